"""The study reports' verdicts at the strength of their evidence: every power figure, detectable difference and
further test a report states beside its verdicts, recomputed from its committed study.json (docs/studies/).

Each sentence or table cell that states one of them must hold it at the printed precision, so a figure edited in a
report, or a run changed in its JSON, fails here. The reports' own rule is in docs/studies.md ("Verdicts: as strong
as the evidence"). Pure Python: the JSON, tfscale.study.power and scipy; no training, no TensorFlow.
"""

import json
import math
import os

import numpy as np
import pytest
from conftest import REPO
from scipy import stats
from test_study import LR_THESIS, TABLE_B1, TABLE_B2, TABLE_5_1, p_text  # the thesis figures, checked there

from tfscale.study import power
from tfscale.training import local_sgd

POINTS = 100  # top-1 fractions to points of top-1


def runs_of(report: str) -> dict[str, list[float]]:
    """{cell: every run's final eval top-1} of a committed study.json."""
    with open(os.path.join(REPO, "docs", "studies", report + ".json")) as f:
        return {cell: [run["eval_top1"] for run in runs] for cell, runs in json.load(f)["runs"].items()}


def report_text(report: str) -> str:
    """The report with its line breaks and runs of spaces as single spaces: a sentence wraps anywhere."""
    with open(os.path.join(REPO, "docs", "studies", report + ".md")) as f:
        return " ".join(f.read().split())


def per_finding_row(report: str, finding: str) -> str:
    """The one row of a report's per-finding table whose finding starts with `finding`."""
    with open(os.path.join(REPO, "docs", "studies", report + ".md")) as f:
        section = f.read().split("\n## Per finding\n", 1)[1]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| {finding}")]
    return row


def assert_states(text: str, *phrases: str) -> None:
    missing = [phrase for phrase in phrases if phrase not in text]
    assert not missing, "the report does not state:\n" + "\n".join(missing)


def thesis_spread(table: list[tuple[str, str]]) -> float:
    """The spread (power.means_spread) of a thesis table's cell means, as a fraction of top-1."""
    return power.means_spread([float(mean) for mean, _ in table]) / POINTS


# --- tfscale.study.power on cases with known answers -------------------------------------------------------------


@pytest.mark.parametrize("alternative", power.ALTERNATIVES)
def test_with_no_true_difference_a_tests_power_is_its_level(alternative):
    assert power.t_test_power(0.0, 0.01, 5, alternative) == pytest.approx(power.ALPHA)
    assert power.one_sample_t_power(0.0, 0.01, 5, alternative) == pytest.approx(power.ALPHA)
    assert power.anova_power(0.0, 0.01, cells=4, runs_per_cell=5) == pytest.approx(power.ALPHA)


def test_the_detectable_difference_is_where_the_power_reaches_the_target():
    for alternative in power.ALTERNATIVES:
        difference = power.detectable_difference(0.006, 3, alternative)
        signed = -difference if alternative == "less" else difference
        assert power.t_test_power(signed, 0.006, 3, alternative) == pytest.approx(power.TARGET_POWER)
    # A one-sided test detects less than a two-sided one; more runs detect less.
    assert power.detectable_difference(0.006, 3, "greater") < power.detectable_difference(0.006, 3)
    assert power.detectable_difference(0.006, 5) < power.detectable_difference(0.006, 3)


def test_an_anova_of_two_cells_has_the_two_sided_t_tests_power():
    """F = t^2 for two cells: the noncentral F and the noncentral t give one power (two means d apart have a
    spread of d / 2)."""
    for difference, runs in ((0.004, 3), (0.01, 5), (0.02, 4)):
        assert power.anova_power(difference / 2, 0.006, cells=2, runs_per_cell=runs) == pytest.approx(
            power.t_test_power(difference, 0.006, runs), abs=1e-9)


def test_far_beyond_the_spread_a_test_always_detects_and_scipy_gives_no_nan():
    # scipy's nct.cdf returns nan far in its lower tail; the two-sided power must not.
    for noncentrality in (8.5, 11.0, 40.0):
        assert power.t_test_power(noncentrality * math.sqrt(2 / 3), 1.0, 3) == pytest.approx(1.0, abs=1e-3)


def test_the_pooled_sd_weighs_each_cells_variance_by_its_degrees_of_freedom():
    cells = [[0.80, 0.82, 0.84], [0.70, 0.71, 0.72, 0.73, 0.74]]
    expected = math.sqrt((2 * np.var(cells[0], ddof=1) + 4 * np.var(cells[1], ddof=1)) / 6)
    assert power.pooled_sd(cells) == pytest.approx(expected)


# --- assignment_local_sgd.md: 3 runs a cell --------------------------------------------------------------------


def test_local_sgd_report_states_its_tests_power_and_detectable_difference():
    runs = runs_of("assignment_local_sgd")
    text = report_text("assignment_local_sgd")
    sd = power.pooled_sd(list(runs.values()))  # over the 9 cells
    half, one = (power.t_test_power(difference / POINTS, sd, 3) for difference in (0.5, 1.0))
    detectable = power.detectable_difference(sd, 3) * POINTS
    spread = thesis_spread(TABLE_B2)
    anova = power.anova_power(spread, sd, cells=3, runs_per_cell=3)  # E2: the three assignments, synchronous
    assert_states(
        text,
        f"The SD between seeds is {sd * POINTS:.2f} points (pooled over the 9 cells), and with 3 runs a cell a "
        f"two-sided test at 0.05 has power {half:.2f} against a true difference of 0.5 points and {one:.2f} against "
        f"1 point; the difference it detects with probability 0.8 is {detectable:.2f} points.",
        f"Against cell means as far apart as Table B.2's 13 (a spread of {spread * POINTS:.2f} points, their "
        f"root-mean-square deviation from their mean), the ANOVA over 3 cells of 3 runs has power {anova:.2f}.",
        f"With 3 runs a cell and an SD between seeds of {sd * POINTS:.2f} points, these two-sided tests have power "
        f"{half:.2f} against a true difference of 0.5 points and {one:.2f} against 1 point, and detect "
        f"{detectable:.2f} points with probability 0.8",
    )
    assert_states(per_finding_row("assignment_local_sgd", "E2.1 and E2.2"),
                  f"p = 0.976; power against a spread of means the size of Table B.2's: {anova:.2f}; two-sided "
                  f"pairwise at 0.5 / 1 point: {half:.2f} / {one:.2f} (SD {sd * POINTS:.2f}, 3 runs a cell) | "
                  "consistent with")
    assert_states(per_finding_row("assignment_local_sgd", "E3.1: disjoint against full"),
                  f"power at 0.5 / 1 point: {half:.2f} / {one:.2f}, 80 % power at {detectable:.2f} "
                  f"(SD {sd * POINTS:.2f}, 3 runs a cell) | consistent with")


def test_local_sgd_report_counts_the_theses_and_its_own_world_syncs():
    thesis_iterations = 182 * math.ceil(45_000 / 128)  # 182 epochs of CIFAR-10's 45,000 images at batch 128
    study_syncs = math.ceil(800 / 64)  # 12 every 64 steps, and the last step's
    assert (round(thesis_iterations, -3), round(thesis_iterations / 64, -3), study_syncs) == (64_000, 1_000, 13)
    assert_states(report_text("assignment_local_sgd"),
                  "about 64k iterations at batch 128, so about 1,000 world syncs at L_W = 64; a run here is 800 "
                  "steps, 13 world syncs at L_W = 64 and 100 at 8.")


# --- assignment_households.md: 5 runs a cell ------------------------------------------------------------------


WORKERS = ["m1", "m2", "m4", "m8"]  # E1
SCHEMES = ["m8", *(f"{scheme}_c{c}" for c in (2, 4) for scheme in ("coarse", "medium_coarse", "fine_grained"))]
HOUSEHOLDS = [f"households_sh{sh}_lw{lw}" for lw in (4, 8, 16) for sh in (4, 1)]
# E1's and E2.2's ANOVAs, E3.2's three one-sided Welch tests, rarer world syncs' two: the report's declared tests.
DECLARED_TESTS = 7


def test_households_e1_states_its_correction_the_outlier_and_its_power():
    runs = runs_of("assignment_households")
    e1 = [runs[cell] for cell in WORKERS]
    p = stats.f_oneway(*e1).pvalue
    lowest = min(runs["m8"])
    without_lowest = [*e1[:3], sorted(runs["m8"])[1:]]
    p_without = stats.f_oneway(*without_lowest).pvalue
    p_ranks = stats.kruskal(*e1).pvalue
    sd = power.pooled_sd(e1)
    spread = thesis_spread(TABLE_B1[:4])  # M = 1-8, the counts run here
    anova = power.anova_power(spread, sd, cells=4, runs_per_cell=5)
    bonferroni = min(1.0, DECLARED_TESTS * p)
    assert p < 0.05 < bonferroni  # the report's claim: an effect before the correction, none after
    assert_states(
        report_text("assignment_households"),
        f"a Bonferroni correction over the 7 puts its p at {p_text(bonferroni)}, no effect. The difference does "
        f"not hang on m8's lowest seed ({lowest:.4f}): without it the ANOVA gives p = {p_text(p_without)}, and a "
        f"Kruskal-Wallis test over all 20 runs, on their ranks, {p_text(p_ranks)}.",
        f"Against a spread of cell means the size of the thesis's own (Table B.1's M = 1-8, {spread * POINTS:.2f} "
        f"points, their root-mean-square deviation from their mean) the ANOVA's power is {anova:.2f} "
        f"(SD {sd * POINTS:.2f} points pooled over the four cells, 5 runs a cell).",
    )
    assert_states(per_finding_row("assignment_households", "E1:"),
                  f"p = {p_text(p)}, one of 7 declared tests, uncorrected (Bonferroni over the 7: "
                  f"{p_text(bonferroni)}); without m8's lowest seed {p_text(p_without)}; Kruskal-Wallis over all 20 "
                  f"runs {p_text(p_ranks)}; power against a spread the size of Table B.1's (M = 1-8): {anova:.2f} "
                  f"(SD {sd * POINTS:.2f}, 5 runs a cell) | not reproduced, on one uncorrected test")


def test_households_e22_states_its_power_and_is_consistent_with_not_reproduced():
    runs = runs_of("assignment_households")
    sd = power.pooled_sd([runs[cell] for cell in SCHEMES])
    spread = thesis_spread(TABLE_B2)
    anova = power.anova_power(spread, sd, cells=len(SCHEMES), runs_per_cell=5)
    pairwise = power.t_test_power(0.5 / POINTS, sd, 5)
    detectable = power.detectable_difference(sd, 5) * POINTS
    assert anova < power.TARGET_POWER  # hence "consistent with"
    assert_states(
        report_text("assignment_households"),
        f"With an SD between seeds of {sd * POINTS:.2f} points (pooled over the seven cells) and 5 runs a cell, the "
        f"ANOVA's power against cell means as far apart as Table B.2's (a spread of {spread * POINTS:.2f} points) "
        f"is {anova:.2f}, and a two-sided pairwise test's against a 0.5-point difference {pairwise:.2f} (80 % power "
        f"at {detectable:.2f} points).",
    )
    assert_states(per_finding_row("assignment_households", "E2.2:"),
                  f"p = 0.712; power against a spread of means the size of Table B.2's: {anova:.2f}; two-sided "
                  f"pairwise at 0.5 points: {pairwise:.2f} (SD {sd * POINTS:.2f}, 5 runs a cell) | consistent with")


def test_households_e32_and_rarer_syncs_state_their_power():
    runs = runs_of("assignment_households")
    sd = power.pooled_sd([runs[cell] for cell in HOUSEHOLDS])
    gain = power.t_test_power(0.8 / POINTS, sd, 5, "greater")  # about the thesis's smallest gain from overlap
    smallest_drop = min(float(a) - float(b) for a, b in zip(TABLE_5_1[32], TABLE_5_1[128]))
    drop = power.t_test_power(-smallest_drop / POINTS, sd, 5, "less")
    text = report_text("assignment_households")
    assert_states(
        text,
        f"the std between seeds is {sd * POINTS:.2f} points (pooled over the six households cells), so with 5 runs "
        f"a cell the one-sided test at 0.05 detects a true gain of 0.8 points with probability about {gain:.2f}",
        f"At the thesis's smallest drop ({smallest_drop:.2f} points) the one-sided test's power is {drop:.2f} "
        f"(SD {sd * POINTS:.2f} points, pooled over the six households cells, 5 runs a cell)",
    )
    assert_states(per_finding_row("assignment_households", "E3.2 (its E3.2.4)"),
                  f"power at a true gain of 0.8: {gain:.2f} (SD {sd * POINTS:.2f}, 5 runs a cell)")
    assert_states(per_finding_row("assignment_households", "Rarer world syncs"),
                  f"power at the thesis's smallest drop: {drop:.2f} (SD {sd * POINTS:.2f}, 5 runs a cell)")


def test_households_report_marks_the_thesiss_derived_iteration_counts():
    """The thesis gives 8,554 iterations (L_W = 128); at L_W = 32 its Eq. A.3's local batch is 52.5, and the
    iterations depend on how it is rounded."""
    def plan(sync_period: int) -> dict:
        return local_sgd.household_batch(128, num_workers=16, households=8, sync_period=sync_period,
                                         num_train_examples=45_000, epochs=182)

    exact_local_batch = 128 * 8 * 32 / (16 * (8 + 32 - 1))
    rounded_down = 182 * math.ceil(45_000 / (16 * math.floor(exact_local_batch)))
    assert plan(128)["iterations"] == 8_554
    text = report_text("assignment_households")
    assert_states(
        text,
        f"47 is the thesis's 8,554 steps over 182 epochs; {plan(32)['steps_per_epoch']} is derived, from its Eq. "
        f"A.3's local batch of {exact_local_batch:.1f} at L_W = 32 rounded to {plan(32)['local_batch']}",
        f"8,554 steps at L_W = 128 (the thesis's figure) and {plan(32)['iterations']:,} at L_W = 32 (derived here: "
        f"its Eq. A.3 gives a local batch of {exact_local_batch:.1f}, rounded to {plan(32)['local_batch']}; "
        f"{math.floor(exact_local_batch)} would give {rounded_down:,})",
    )
    assert_states(per_finding_row("assignment_households", "Rarer world syncs"),
                  f"8,554 steps at L_W = 128 ({plan(32)['iterations']:,} at L_W = 32, derived")
    assert "8,554-9,828" not in text


# --- lr_scaling.md: each verdict's power at the thesis's difference between its two runs -----------------------


# finding (the per-finding row's start) -> (cell, against, the thesis's run, its run against, alternative)
LR_COMPARISONS = {
    "Exp 6 against Exp 5": ("stepping1", "linear", "stepping 5", "linear", "greater"),
    "Exp 8 against Exp 5": ("gradual1", "linear", "gradual 5", "linear", "greater"),
    "Exp 9 against Exp 5": ("gradual2", "linear", "gradual 10", "linear", "greater"),
    "Exp 9 against Exp 8": ("gradual2", "gradual1", "gradual 10", "gradual 5", "two-sided"),
    "Exp 8 against Exp 6": ("gradual1", "stepping1", "gradual 5", "stepping 5", "two-sided"),
    "Exp 7 against Exp 6": ("stepping1_b256", "stepping1", "stepping 5, 32 a GPU", "stepping 5", "two-sided"),
}


def thesis_difference(run: str, against: str) -> float:
    """The difference of two of the LR-scaling thesis's single runs, in points."""
    return float(LR_THESIS[run][0]) - float(LR_THESIS[against][0])


def lr_power(finding: str, runs: dict[str, list[float]]) -> tuple[float, float]:
    """(the pooled SD in points, the test's power at the thesis's difference) of a finding of LR_COMPARISONS."""
    cell, against, thesis_run, thesis_against, alternative = LR_COMPARISONS[finding]
    sd = power.pooled_sd([runs[cell], runs[against]])
    difference = thesis_difference(thesis_run, thesis_against) / POINTS
    return sd * POINTS, power.t_test_power(difference, sd, 5, alternative)


@pytest.mark.parametrize("finding", LR_COMPARISONS)
def test_lr_scaling_rows_state_their_power_at_the_theses_difference(finding):
    sd, at_thesis = lr_power(finding, runs_of("lr_scaling"))
    assert_states(per_finding_row("lr_scaling", finding),
                  f"power at the thesis's difference: {at_thesis:.2f} (SD {sd:.2f}")


def test_lr_scaling_linear_against_b32_states_the_one_sample_tests_power():
    runs = runs_of("lr_scaling")
    sd = stats.tstd(runs["linear"])
    at_thesis = power.one_sample_t_power(thesis_difference("linear", "1 GPU") / POINTS, sd, 5, "less")
    assert_states(per_finding_row("lr_scaling", "Exp 5 against the 1-GPU run"),
                  f"power at the thesis's difference: {at_thesis:.2f} (SD {sd * POINTS:.2f}, 5 runs)")


LR_DECLARED_TESTS = 1 + len(LR_COMPARISONS)  # the one-sample test against b32, and the Welch tests


def test_lr_scaling_exp6_says_its_verdict_rests_on_one_uncorrected_test():
    runs = runs_of("lr_scaling")
    p = stats.ttest_ind(runs["stepping1"], runs["linear"], equal_var=False, alternative="greater").pvalue
    bonferroni = min(1.0, LR_DECLARED_TESTS * p)
    assert p < 0.05 < bonferroni
    assert_states(report_text("lr_scaling"),
                  f"p = {p_text(p)} (one-sided Welch), one of the report's 7 tests and uncorrected: a Bonferroni "
                  f"correction over the 7 puts it at {p_text(bonferroni)}, no effect.")
    assert_states(per_finding_row("lr_scaling", "Exp 6 against Exp 5"),
                  f"p = {p_text(p)}, uncorrected (Bonferroni over the report's 7 tests: {p_text(bonferroni)})",
                  "| reproduced in direction only, on one uncorrected test:")


def test_lr_scaling_prose_states_the_warmups_power():
    runs = runs_of("lr_scaling")
    stepping_sd, stepping = lr_power("Exp 6 against Exp 5", runs)
    gradual = [lr_power(finding, runs)[1] for finding in ("Exp 8 against Exp 5", "Exp 9 against Exp 5")]
    assert_states(report_text("lr_scaling"),
                  f"at that difference and the SD here ({stepping_sd:.2f} points, 5 runs a cell), the test's power "
                  f"is {stepping:.2f}.",
                  f"(powers at the thesis's differences: {gradual[0]:.2f} and {gradual[1]:.2f})")


def test_lr_scaling_tests_the_theses_stepping_on_par_with_gradual_finding():
    """The thesis's Exp 8 finding, "stepping ≈ gradual warmup": gradual1 against stepping1, two-sided Welch."""
    runs = runs_of("lr_scaling")
    gradual, stepping = runs["gradual1"], runs["stepping1"]
    p = stats.ttest_ind(gradual, stepping, equal_var=False, alternative="two-sided").pvalue
    difference = (np.mean(gradual) - np.mean(stepping)) * POINTS
    thesis = thesis_difference("gradual 5", "stepping 5")
    sd, at_thesis = lr_power("Exp 8 against Exp 6", runs)
    assert p < 0.05  # detected: not parity here
    assert_states(
        report_text("lr_scaling"),
        f"its 5-epoch gradual warmup reaches {LR_THESIS['gradual 5'][0]} % against the stepping warmup's "
        f"{LR_THESIS['stepping 5'][0]} %, {thesis:.2f} between two single runs. Here gradual1 is "
        f"{-difference:.2f} points below stepping1 ({np.mean(gradual):.4f} +- {stats.tstd(gradual):.4f} against "
        f"{np.mean(stepping):.4f} +- {stats.tstd(stepping):.4f}; p = {p_text(p)}, two-sided Welch; the power at the "
        f"thesis's {thesis:.2f} is {at_thesis:.2f}, SD {sd:.2f} points, 5 runs a cell).",
    )
    assert_states(per_finding_row("lr_scaling", "Exp 8 against Exp 6"),
                  f"gradual1 against stepping1: {difference:.2f} |", f"Welch, two-sided: p = {p_text(p)};",
                  "| not comparable:")
