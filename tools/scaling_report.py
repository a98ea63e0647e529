#!/usr/bin/env python3
"""Scaling table and plot from benchmark.json files and/or CSV tables (workers,images_per_sec[,series]).

    python tools/scaling_report.py runs/sweep/*/benchmark.json --output=runs/sweep/report.md \
        --plot=runs/sweep/report.png
    python tools/scaling_report.py published.csv --reference=1 --plot=published.png

Prints the table (workers, images/sec, speedup S_N = X_N / X_ref, efficiency
E_N = X_N / ((N / N_ref) * X_ref)); `--reference` picks N_ref (default: each series' smallest count).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tfscale.perf import scaling  # noqa: E402

_REFERENCE = flags.DEFINE_integer("reference", None, "Worker count the speedup is relative to (default: smallest).")
_OUTPUT = flags.DEFINE_string("output", None, "Markdown file to write the table (and plot link) to.")
_PLOT = flags.DEFINE_string("plot", None, "PNG file for the throughput and efficiency plot.")
_TITLE = flags.DEFINE_string("title", "tfscale scaling", "Title of the report and plot.")


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give benchmark.json and/or CSV files (workers,images_per_sec[,series])")
    try:
        tables = scaling.scaling_rows(scaling.load(argv[1:]), reference_workers=_REFERENCE.value)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"scaling_report: {err}")
    print(scaling.write_report(tables, _OUTPUT.value, _PLOT.value, _TITLE.value))
    for path in (_OUTPUT.value, _PLOT.value):
        if path:
            print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
