"""How strong a study's tests are: the power to detect a true effect of a given size, at the spread between seeds
the study measured (scipy's noncentral t and F; numpy and scipy only, no TensorFlow).

A test that finds nothing says little unless it would probably have found the effect in question: the studies'
reports (docs/studies.md) call a null result at a power below 0.8 "consistent with" a finding, never a
reproduction of it. Differences and SDs are in the same unit (fractions of top-1, or points); `alpha` is the
tests' level, 0.05 in every report.

    t_test_power(0.005, 0.0059, 3)      # 0.13: two-sided, 3 runs a cell, a 0.5-point difference at an SD of 0.59
    detectable_difference(0.0059, 3)    # 0.018: the difference that test detects 4 times in 5
    anova_power(0.00157, 0.00562, cells=7, runs_per_cell=5)   # 0.16: an F test against a spread of cell means
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, stats

ALPHA = 0.05
TARGET_POWER = 0.8  # the usual bar: a null result below it is "consistent with", not a reproduction
ALTERNATIVES = ("two-sided", "greater", "less")  # as scipy.stats.ttest_ind names them


def pooled_sd(samples: Sequence[Sequence[float]]) -> float:
    """The within-cell SD pooled over cells: each cell's sample variance weighted by its degrees of freedom
    (with equal cells, the root of the mean variance)."""
    degrees = sum(len(sample) - 1 for sample in samples)
    return math.sqrt(sum((len(sample) - 1) * np.var(sample, ddof=1) for sample in samples) / degrees)


def means_spread(means: Sequence[float]) -> float:
    """A set of cell means' spread as the F test measures it: their root-mean-square deviation from their mean."""
    return float(np.std(means))


def _t_power(noncentrality: float, degrees: int, alternative: str, alpha: float) -> float:
    """P(the t statistic falls beyond the test's critical value) when it is noncentral t."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r}: expected one of {ALTERNATIVES}")
    if alternative == "two-sided":
        critical = stats.t.ppf(1 - alpha / 2, degrees)
        # The lower tail as the upper tail of the mirrored statistic: scipy's nct.cdf far in its lower tail
        # returns nan (scipy 1.17), its sf does not.
        return float(stats.nct.sf(critical, degrees, noncentrality) + stats.nct.sf(critical, degrees, -noncentrality))
    critical = stats.t.ppf(1 - alpha, degrees)
    return float(stats.nct.sf(critical, degrees, noncentrality if alternative == "greater" else -noncentrality))


def t_test_power(difference: float, sd: float, runs_per_cell: int, alternative: str = "two-sided",
                 alpha: float = ALPHA) -> float:
    """Power of a two-sample t-test, `runs_per_cell` runs in each cell, when the cells' true means differ by
    `difference` (cell minus the other; its sign matters one-sided) and each run's SD is `sd`.

    The equal-variance test (2n - 2 degrees of freedom): Welch's test, which the reports run, has fewer when the
    two SDs differ, so its power is a little lower than this."""
    return _t_power(difference / (sd * math.sqrt(2 / runs_per_cell)), 2 * runs_per_cell - 2, alternative, alpha)


def one_sample_t_power(difference: float, sd: float, runs: int, alternative: str = "two-sided",
                       alpha: float = ALPHA) -> float:
    """Power of a one-sample t-test of `runs` runs against a fixed value their true mean is `difference` from."""
    return _t_power(difference / (sd / math.sqrt(runs)), runs - 1, alternative, alpha)


def detectable_difference(sd: float, runs_per_cell: int, alternative: str = "two-sided", power: float = TARGET_POWER,
                          alpha: float = ALPHA) -> float:
    """The smallest true difference (a magnitude, in the unit of `sd`) that the two-sample t-test of
    `t_test_power` detects with probability `power`."""
    standard_error = sd * math.sqrt(2 / runs_per_cell)
    sign = -1.0 if alternative == "less" else 1.0

    def shortfall(difference: float) -> float:
        return t_test_power(sign * difference, sd, runs_per_cell, alternative, alpha) - power

    # At a noncentrality of 50 standard errors every test with 2 degrees of freedom or more has power ~1.
    return float(optimize.brentq(shortfall, 0.0, 50 * standard_error))


def anova_power(spread: float, sd: float, cells: int, runs_per_cell: int, alpha: float = ALPHA) -> float:
    """Power of a one-way ANOVA of `cells` cells x `runs_per_cell` runs when the cells' true means have spread
    `spread` (`means_spread`) and each run's SD is `sd`: the noncentral F with noncentrality
    cells * runs_per_cell * spread^2 / sd^2."""
    between, within = cells - 1, cells * (runs_per_cell - 1)
    critical = stats.f.ppf(1 - alpha, between, within)
    noncentrality = cells * runs_per_cell * spread**2 / sd**2
    if noncentrality == 0:  # no effect: the test's level (scipy 1.17's ncf.sf returns -0.95 there, not 0.05)
        return float(stats.f.sf(critical, between, within))
    return float(stats.ncf.sf(critical, between, within, noncentrality))
