"""Speedup and scaling efficiency from measured or published throughput: a table and a plot.

With X_N the total images/sec on N workers (GPUs) and a reference count N_ref (usually 1):

    speedup     S_N = X_N / X_ref
    efficiency  E_N = X_N / ((N / N_ref) * X_ref)      (1.0 = perfectly linear scaling)

Inputs are tfscale `benchmark.json` files (one run each: `num_workers`, `total_images_per_sec`,
grouped into series by backend and mode) or CSV files with columns `workers,images_per_sec` and an
optional `series` column, so that a published table can be put next to a measured one.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
from collections import defaultdict


@dataclasses.dataclass(frozen=True)
class Point:
    series: str
    workers: int
    images_per_sec: float


def _point_from_benchmark(path: str) -> Point:
    with open(path) as f:
        report = json.load(f)
    try:
        return Point(f"{report['backend']} {report['mode']}", int(report["num_workers"]),
                     float(report["total_images_per_sec"]))
    except KeyError as err:
        raise ValueError(f"{path}: not a train/synthetic benchmark.json of tfscale (no {err})") from None


def _points_from_csv(path: str) -> list[Point]:
    default_series = os.path.splitext(os.path.basename(path))[0]
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"workers", "images_per_sec"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: needs columns workers,images_per_sec; missing {', '.join(sorted(missing))}")
        points = []
        for line_number, row in enumerate(reader, start=2):
            try:
                points.append(Point(row.get("series") or default_series, int(row["workers"]), float(row["images_per_sec"])))
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line_number}: cannot read workers={row['workers']!r} "
                                 f"images_per_sec={row['images_per_sec']!r}") from None
    return points


def load(paths: list[str]) -> list[Point]:
    """Points from benchmark.json and CSV files, in the order given."""
    points = []
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"scaling input not found: {path}")
        points += _points_from_csv(path) if path.endswith(".csv") else [_point_from_benchmark(path)]
    return points


def scaling_rows(points: list[Point], reference_workers: int | None = None) -> dict[str, list[dict]]:
    """Per series, rows sorted by workers: workers, images_per_sec, speedup, efficiency."""
    by_series = defaultdict(dict)
    for point in points:
        if point.workers < 1 or point.images_per_sec <= 0:
            raise ValueError(f"series {point.series!r}: workers={point.workers}, images/sec={point.images_per_sec} "
                             "must both be positive")
        if point.workers in by_series[point.series]:
            raise ValueError(f"series {point.series!r} has two figures for {point.workers} workers")
        by_series[point.series][point.workers] = point.images_per_sec
    tables = {}
    for series, rates in by_series.items():
        reference = min(rates) if reference_workers is None else reference_workers
        if reference not in rates:
            raise ValueError(f"series {series!r} has no figure for the reference {reference} workers "
                             f"(it has {', '.join(map(str, sorted(rates)))})")
        tables[series] = [
            {"workers": n, "images_per_sec": x, "reference_workers": reference,
             "speedup": x / rates[reference], "efficiency": x / ((n / reference) * rates[reference])}
            for n, x in sorted(rates.items())
        ]
    return tables


def markdown_table(tables: dict[str, list[dict]]) -> str:
    lines = ["| series | workers | images/sec | speedup | efficiency |", "|---|---:|---:|---:|---:|"]
    for series, rows in tables.items():
        for row in rows:
            lines.append(f"| {series} | {row['workers']} | {row['images_per_sec']:.2f} | {row['speedup']:.2f}x | "
                         f"{100 * row['efficiency']:.1f}% |")
    return "\n".join(lines)


@contextlib.contextmanager
def two_panel_png(path: str, title: str, *, figsize: tuple[float, float], legend_fontsize: float | None = None):
    """Yields two side-by-side axes to draw on; on exit each gets a grid and a legend and the figure is saved
    as a PNG at `path` (matplotlib's Agg backend: clusters' login nodes have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=figsize)
    yield axes
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(tables: dict[str, list[dict]], path: str, title: str) -> None:
    """Measured vs ideal (linear) throughput, and efficiency, against workers, as a PNG."""
    with two_panel_png(path, title, figsize=(11, 4.2), legend_fontsize=8) as (rate_ax, efficiency_ax):
        for series, rows in tables.items():
            workers = [r["workers"] for r in rows]
            reference = rows[0]["reference_workers"]
            reference_rate = next(r["images_per_sec"] for r in rows if r["workers"] == reference)
            (line,) = rate_ax.plot(workers, [r["images_per_sec"] for r in rows], "o-", label=f"{series} measured")
            rate_ax.plot(workers, [reference_rate * n / reference for n in workers], "--", color=line.get_color(),
                         alpha=0.6, label=f"{series} ideal (linear)")
            efficiency_ax.plot(workers, [100 * r["efficiency"] for r in rows], "o-", color=line.get_color(),
                               label=series)
        all_workers = sorted({r["workers"] for rows in tables.values() for r in rows})
        for ax in (rate_ax, efficiency_ax):
            ax.set_xticks(all_workers)
        rate_ax.set(xlabel="workers (GPUs)", ylabel="total images/sec", title="throughput")
        efficiency_ax.axhline(100, color="gray", linestyle="--", linewidth=1)
        efficiency_ax.set(xlabel="workers (GPUs)", ylabel="scaling efficiency (%)", title="efficiency", ylim=(0, 110))


def write_report(tables: dict[str, list[dict]], markdown_path: str | None, plot_path: str | None, title: str) -> str:
    """Writes the Markdown table (with the plot linked) and the PNG; returns the table text."""
    table = markdown_table(tables)
    if plot_path:
        plot(tables, plot_path, title)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(f"# {title}\n\n{table}\n")
            if plot_path:
                f.write(f"\n![{title}]({os.path.relpath(plot_path, os.path.dirname(markdown_path) or '.')})\n")
    return table
