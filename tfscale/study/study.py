r"""Seeded studies: every cell of a grid of config overrides x every seed, run, collected and tested.

    python -m tfscale.study studies/lr_scaling_fmnist.py --workdir=runs/lr_study     # or tfscale-study
    python -m tfscale.study docs/studies/lr_scaling.json      # a stored study.json's tables, recomputed

A study file is Python with `get_study()` returning a dict:

    {"config": "configs/cifar_resnet20.py",          # the base recipe (PATH[:ARG], as --config takes it)
     "overrides": ["--config.data.data_dir=..."],    # for every run
     "cells": {"naive": ["--config.optim.lr_per_256=..."], "linear": [...], ...},   # name -> overrides
     # or name -> {"overrides": [...], "plot_values": {...}, "num_workers": M, "seeds": [...]} (this cell's own)
     "seeds": [0, 1, 2],                             # config.seed of each run of a cell
     "baseline": "linear",                           # the cell every other is tested against
     # optional: further Welch tests, each of one cell against another; alternative: less | greater | two-sided
     "comparisons": [{"cell": "gradual", "against": "linear", "alternative": "greater"}],
     "num_workers": 1, "backend": "mwms",            # > 1: each run through tfscale.launch
     "plot": {"x": "data.global_batch_size", "series": "method", "x_label": "global batch"}}

Each run is `python -m tfscale.train` in `WORKDIR/runs/<cell>/seed<k>`; a run whose summary.json
exists is finished and skipped, so a killed study (or a preempted job) picks up where it stopped.
`--by_seed` runs every cell's first seed, then every cell's second, ...: a study stopped part-way has
every cell at about the same number of runs.
Afterwards the summaries are collected into `study.json` (every run's figures), `study.md` (per cell:
runs, mean +- sample std of the final eval top-1, mean wall time, and the one-tailed Welch t-test
p-value of "this cell's top-1 is lower than the baseline's", scipy.stats.ttest_ind with
equal_var=False, alternative="less"; then one row per entry of "comparisons": the difference of the
means and the p-value of the alternative asked for) and `study.png` (mean top-1 +- std against `plot.x` for each
value of `plot.series`; the values come from the cells' `"plot_values"` entries; a list of series values
puts the cell's point on each of those lines), and each finished run goes to TensorBoard's HParams
dashboard (`tensorboard --logdir WORKDIR`; tfscale/study/hparams.py writes WORKDIR/hparams/).

On a Slurm cluster the runs can go out as a job array, one task a run, each with the job's nodes and
GPUs: `tools/make_sbatch.py --study=STUDY_FILE ...` writes it; task K asks `--run_index=K --print_run`
what to train, trains it with the template's launcher and refreshes the report (docs/studies.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
import time

from absl import app, flags, logging

from tfscale import cli
from tfscale import io as tfio
from tfscale import logs
from tfscale.study import hparams
from tfscale.workdir import layout

_REQUIRED = ("config", "cells", "seeds", "baseline")
ALTERNATIVES = ("less", "greater", "two-sided")  # scipy.stats.ttest_ind's


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    overrides: tuple[str, ...]
    plot_values: dict  # e.g. {"data.global_batch_size": 512, "method": "linear"} for study.png
    num_workers: int  # worker processes of each run: the cell's "num_workers", else the study's, else 1
    seeds: tuple[int, ...]  # config.seed of each run: the cell's "seeds", else the study's


def load_study(path_arg: str) -> dict:
    """The study file's `get_study()` (`PATH:ARG`: `get_study(ARG)`, e.g. a study's thesis-scale version),
    checked: ValueError naming the file and the key."""
    path, _, arg = path_arg.partition(":")
    spec = importlib.util.spec_from_file_location("tfscale_study_file", path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"study file {path} does not exist")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_study"):
        raise ValueError(f"study file {path} has no get_study()")
    parameters = inspect.signature(module.get_study).parameters
    if arg and not parameters:
        raise ValueError(f"study file {path}: get_study() takes no argument, so {path_arg} names no version of it")
    study = dict(module.get_study(arg) if arg else module.get_study())
    path = path_arg  # the messages below name the version
    missing = [key for key in _REQUIRED if key not in study]
    if missing:
        raise ValueError(f"study file {path}: get_study() lacks {', '.join(missing)}")
    if study["baseline"] not in study["cells"]:
        raise ValueError(f"study file {path}: baseline {study['baseline']!r} is not one of the cells "
                         f"{', '.join(study['cells'])}")
    for name, seeds in [("seeds", study["seeds"])] + [(f"cell {cell.name}: seeds", cell.seeds)
                                                      for cell in cells_of(study)]:
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"study file {path}: {name} must be distinct and at least one, got {list(seeds)}")
    for i, comparison in enumerate(study.get("comparisons", ())):
        _check_comparison(path, i, comparison, study["cells"])
    for cell in cells_of(study):  # their keys are the HParams dashboard's columns
        try:
            hparams.override_items(cell.name, cell.overrides)
        except ValueError as err:
            raise ValueError(f"study file {path}: {err}") from err
    return study


def _check_comparison(path: str, index: int, comparison: dict, cells: dict) -> None:
    where = f"study file {path}: comparisons[{index}]"
    if not isinstance(comparison, dict) or set(comparison) != {"cell", "against", "alternative"}:
        raise ValueError(f"{where} must be a dict with exactly cell, against and alternative, got {comparison!r}")
    for key in ("cell", "against"):
        if comparison[key] not in cells:
            raise ValueError(f"{where}: {key} {comparison[key]!r} is not one of the cells {', '.join(cells)}")
    if comparison["alternative"] not in ALTERNATIVES:
        raise ValueError(f"{where}: alternative {comparison['alternative']!r} is not one of {', '.join(ALTERNATIVES)}")


def cells_of(study: dict) -> list[Cell]:
    cells = []
    for name, spec in study["cells"].items():
        spec = spec if isinstance(spec, dict) else {"overrides": spec}
        workers = int(spec.get("num_workers", study.get("num_workers", 1)))
        seeds = tuple(int(seed) for seed in spec.get("seeds", study.get("seeds", ())))
        cells.append(Cell(name, tuple(spec["overrides"]), dict(spec.get("plot_values", {})), workers, seeds))
    return cells


def run_dir(workdir: str, cell: str, seed: int) -> str:
    return os.path.join(workdir, "runs", cell, f"seed{seed}")


def runs_of(study: dict) -> list[tuple[Cell, int]]:
    """Every run of the study, (cell, seed): cells in file order, each cell's seeds. Slurm array task K runs the
    K-th."""
    return [(cell, seed) for cell in cells_of(study) for seed in cell.seeds]


def by_seed(runs: list[tuple[Cell, int]]) -> list[tuple[Cell, int]]:
    """`runs` with every cell's first seed first, then every cell's second, ... (cells in file order)."""
    position = {}
    for cell, seed in runs:
        position[(cell.name, seed)] = sum(1 for other, _ in position if other == cell.name)
    return sorted(runs, key=lambda run: position[(run[0].name, run[1])])  # stable: file order within a round


def run_overrides(study: dict, cell: Cell, seed: int) -> list[str]:
    """The `--config.*` overrides of one run: the study's, the cell's, then its seed."""
    return [*study.get("overrides", ()), *cell.overrides, f"--config.seed={seed}"]


def train_command(study: dict, cell: Cell, seed: int, directory: str) -> list[str]:
    """The command of one run: tfscale.train, through tfscale.launch for more than one worker."""
    train = ["-m", "tfscale.train", f"--config={study['config']}", f"--workdir={directory}",
             *run_overrides(study, cell, seed)]
    if cell.num_workers == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "tfscale.launch", f"--num_workers={cell.num_workers}",
            f"--backend={study.get('backend', 'mwms')}", "--", *train]


def select_run(study: dict, index: int) -> tuple[Cell, int]:
    runs = runs_of(study)
    if not 0 <= index < len(runs):
        raise ValueError(f"run index {index} is out of range: the study has {len(runs)} runs (0-{len(runs) - 1})")
    return runs[index]


def run_all(study: dict, workdir: str, runs: list[tuple[Cell, int]] | None = None) -> None:
    """Every run (or those given) in order, skipping finished ones; a failed run stops the study, naming its log."""
    for cell, seed in runs_of(study) if runs is None else runs:
        directory = run_dir(workdir, cell.name, seed)
        if os.path.exists(layout.summary(directory)):
            logging.info("skipping %s seed %d: finished (%s)", cell.name, seed, directory)
            continue
        os.makedirs(directory, exist_ok=True)
        log_path = os.path.join(directory, "train.log")
        logging.info("running %s seed %d -> %s", cell.name, seed, directory)
        started = time.time()
        with open(log_path, "a") as log:
            code = subprocess.run(train_command(study, cell, seed, directory), stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"run {cell.name} seed {seed} failed with exit code {code}; its log: {log_path}")
        logging.info("finished %s seed %d in %.0f s", cell.name, seed, time.time() - started)


def print_run(study: dict, workdir: str, cell: Cell, seed: int) -> None:
    """What a Slurm array task needs to start one run with its own launcher (slurm/*.sbatch reads it):
    one value a line: the config, the run's workdir (absolute), then its overrides."""
    lines = [study["config"], os.path.abspath(run_dir(workdir, cell.name, seed)), *run_overrides(study, cell, seed)]
    if any("\n" in line for line in lines):
        raise ValueError(f"cell {cell.name}: an override holds a line break, which the job script cannot pass on")
    print("\n".join(lines))


def collect(study: dict, workdir: str) -> dict[str, list[dict]]:
    """{cell: [summary of each finished seed, with "seed"]}."""
    results = {}
    for cell in cells_of(study):
        runs = []
        for seed in cell.seeds:
            path = layout.summary(run_dir(workdir, cell.name, seed))
            if os.path.exists(path):
                with open(path) as f:
                    runs.append({"seed": seed, **json.load(f)})
        results[cell.name] = runs
    return results


def cell_statistics(results: dict[str, list[dict]], baseline: str) -> dict[str, dict]:
    """Per cell: runs, mean and sample std of eval_top1, mean wall time, Welch one-tailed p vs the baseline."""
    import numpy as np

    reference = [r["eval_top1"] for r in results[baseline]]
    table = {}
    for name, runs in results.items():
        top1 = [r["eval_top1"] for r in runs]
        row = {"runs": len(top1), "top1_mean": float(np.mean(top1)) if top1 else math.nan,
               "top1_std": float(np.std(top1, ddof=1)) if len(top1) > 1 else math.nan,
               "wall_time_s_mean": float(np.mean([r["wall_time_s"] for r in runs])) if runs else math.nan,
               "p_lower_than_baseline": math.nan}
        if name != baseline:
            row["p_lower_than_baseline"] = welch_p(top1, reference, "less")
        table[name] = row
    return table


def welch_p(top1: list[float], reference: list[float], alternative: str) -> float:
    """Welch's t-test p-value (scipy) that `top1` is less / greater / different than `reference`; nan below 2 runs."""
    from scipy import stats

    if len(top1) < 2 or len(reference) < 2:
        return math.nan
    return float(stats.ttest_ind(top1, reference, equal_var=False, alternative=alternative).pvalue)


def comparison_statistics(results: dict[str, list[dict]], comparisons: list[dict]) -> list[dict]:
    """One row per comparison: its cells, runs, the difference of the mean top-1 (cell - against) and p."""
    rows = []
    for comparison in comparisons:
        top1, reference = ([r["eval_top1"] for r in results[comparison[key]]] for key in ("cell", "against"))
        difference = sum(top1) / len(top1) - sum(reference) / len(reference) if top1 and reference else math.nan
        rows.append({**comparison, "runs": [len(top1), len(reference)], "top1_difference": difference,
                     "p": welch_p(top1, reference, comparison["alternative"])})
    return rows


def _number(value: float, digits: int = 4) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown(study: dict, table: dict[str, dict], results: dict[str, list[dict]]) -> str:
    lines = [f"| cell | runs | eval top-1 mean +- std | wall time (s) | p (lower than {study['baseline']}) | "
             "per-seed top-1 |", "|---|---|---|---|---|---|"]
    for name, row in table.items():
        seeds = ", ".join(f"{r['seed']}: {r['eval_top1']:.4f}" for r in results[name])
        lines.append(f"| {name} | {row['runs']} | {_number(row['top1_mean'])} +- {_number(row['top1_std'])} | "
                     f"{_number(row['wall_time_s_mean'], 0)} | {_number(row['p_lower_than_baseline'], 3)} | {seeds} |")
    note = ("p: one-tailed Welch t-test (scipy.stats.ttest_ind, equal_var=False, alternative='less') of the cell's "
            f"final eval top-1 against {study['baseline']}'s; '-' for the baseline and cells with fewer than 2 runs.")
    text = "\n".join(lines) + "\n\n" + note + "\n"
    comparisons = comparison_statistics(results, study.get("comparisons", []))
    if comparisons:
        rows = ["| cell | against | runs | top-1 difference | alternative | p |", "|---|---|---|---|---|---|"]
        rows += [f"| {c['cell']} | {c['against']} | {c['runs'][0]} vs {c['runs'][1]} | {c['top1_difference']:+.4f} | "
                 f"{c['alternative']} | {_number(c['p'], 3)} |" for c in comparisons]
        text += ("\n" + "\n".join(rows) + "\n\nEach row: Welch t-test of the cell's final eval top-1 against the "
                 "other cell's; 'less': the cell is lower, 'greater': higher, 'two-sided': different.\n")
    return text


def tables_from_json(stored: dict) -> str:
    """study.md's tables again from a stored study.json (its study and runs), so every figure can be checked."""
    results = stored["runs"]
    return markdown(stored["study"], cell_statistics(results, stored["study"]["baseline"]), results)


def plot_series(study: dict, table: dict[str, dict]) -> dict:
    """{series value: sorted [(x, mean top-1, std)]} for study.png, from the cells' plot_values."""
    spec = study["plot"]
    series: dict = {}
    for cell in cells_of(study):
        row = table[cell.name]
        if row["runs"] and spec["x"] in cell.plot_values:
            labels = cell.plot_values.get(spec.get("series"), cell.name)
            # A list: the point starts several lines (the small-batch baseline every method scales from).
            for label in labels if isinstance(labels, (list, tuple)) else [labels]:
                series.setdefault(label, []).append((cell.plot_values[spec["x"]], row["top1_mean"],
                                                     0.0 if math.isnan(row["top1_std"]) else row["top1_std"]))
    return {label: sorted(points) for label, points in series.items()}


def plot(study: dict, table: dict[str, dict], path: str) -> bool:
    """study.png: mean top-1 +- std against plot.x, one line per plot.series value; False when not asked for."""
    spec = study.get("plot")
    if not spec:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(7, 4.5))
    series = plot_series(study, table)
    for label, points in series.items():
        xs, means, stds = zip(*points)
        axes.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=str(label))
    axes.set_xlabel(spec.get("x_label", spec["x"]))
    axes.set_ylabel("final eval top-1 (mean +- std over seeds)")
    if spec.get("log_x"):
        axes.set_xscale("log", base=2)
        # Tick the grid's own values, written as numbers (32, 256, 1024), not as powers of two.
        axes.set_xticks(sorted({x for points in series.values() for x, _, _ in points}))
        axes.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    # Wrapped at about what fits across the 7-inch figure at 10 pt.
    axes.set_title("\n".join(textwrap.wrap(study.get("title", ""), 85)), fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(title=spec.get("series"))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def report(study: dict, workdir: str) -> dict[str, dict]:
    """study.json, study.md, study.png and the HParams summaries (WORKDIR/hparams) from the finished runs;
    returns the per-cell table."""
    results = collect(study, workdir)
    table = cell_statistics(results, study["baseline"])
    tfio.write_json(os.path.join(workdir, "study.json"),
                    {"study": study, "cells": table, "runs": results,
                     "comparisons": comparison_statistics(results, study.get("comparisons", []))})  # keys in the
    # study file's order, so tables_from_json lists the cells as study.md does
    tfio.write_bytes(os.path.join(workdir, "study.md"), markdown(study, table, results).encode())
    plot(study, table, os.path.join(workdir, "study.png"))
    hparams.write(workdir, [hparams.RunSpec(cell.name, seed, cell.overrides,
                                                        run_dir(workdir, cell.name, seed))
                                  for cell, seed in runs_of(study)])
    return table


def _study(f: flags.FlagValues, arguments: list[str]) -> None:
    logs.configure()
    if len(arguments) != 1:
        raise app.UsageError("usage: python -m tfscale.study STUDY_FILE --workdir=DIR [--report_only] [--run_index=K] "
                             "[--by_seed]"
                             "\n   or: python -m tfscale.study STUDY_JSON (print its tables from the stored runs)")
    if arguments[0].endswith(".json"):
        try:
            with open(arguments[0]) as stored:
                print(tables_from_json(json.load(stored)), end="")
        except (OSError, ValueError, KeyError) as err:
            sys.exit(f"FATAL study error: {arguments[0]} is not a readable study.json: {err!r}")
        return
    if not f.workdir:
        raise app.UsageError("--workdir is required with a study file")
    try:
        study = load_study(arguments[0])
        runs = by_seed(runs_of(study)) if f.by_seed else None
        runs = runs if f.run_index is None else [select_run(study, f.run_index)]
        if f.print_run:
            if runs is None:
                raise ValueError("--print_run needs --run_index")
            print_run(study, f.workdir, *runs[0])
            return
    except (ValueError, OSError) as err:
        sys.exit(f"FATAL study error: {err}")
    os.makedirs(f.workdir, exist_ok=True)
    if not f.report_only:
        try:
            run_all(study, f.workdir, runs)
        except RuntimeError as err:
            sys.exit(f"FATAL {err}")
    table = report(study, f.workdir)
    logging.info("study of %d cells, %d runs: %s", len(table), len(runs_of(study)),
                 os.path.join(f.workdir, "study.md"))


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Where the runs, study.json, study.md, study.png and hparams/ "
                        "(TensorBoard's HParams dashboard) go; required with a study file.")
    flags.DEFINE_bool("report_only", False, "Only collect the finished runs into the report; run nothing.")
    flags.DEFINE_bool("by_seed", False, "Run every cell's first seed, then every cell's second, ...: stopped part-way, "
                      "every cell has about as many runs as the others (default: each cell's seeds in turn).")
    flags.DEFINE_integer("run_index", None, "Only this run (0-based, cells in file order x seeds), then the "
                         "report: what one task of a Slurm job array does.")
    flags.DEFINE_bool("print_run", False, "With --run_index: print the run's config, workdir and overrides, one a "
                      "line, and run nothing (the sbatch templates' job-array mode reads this).")


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-study` and `python -m tfscale.study`."""
    cli.run_tool(_study, define_flags=_define_flags, errors=(), argv=argv, takes_arguments=True)


if __name__ == "__main__":
    run()
