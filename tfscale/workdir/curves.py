"""WORKDIR/curves.png: a run's curves drawn from its own metrics.jsonl, redrawn after each eval.

Four panels against the step: loss and top-1, training beside validation (with the EMA weights' where
the run keeps them); the learning rate; images/sec. What TensorBoard shows, as one file to open on a
cluster's login node or to attach to a report. matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import json
import os

from tfscale.workdir import layout


def read_rows(workdir: str) -> list[dict]:
    """metrics.jsonl's rows; a last line cut short (a killed writer) is left out."""
    rows = []
    with open(layout.metrics(workdir)) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [s for s, _ in points], [v for _, v in points]


# (panel title, [(metrics.jsonl key, legend label)])
PANELS = (
    ("loss", [("loss", "train"), ("eval_loss", "validation"), ("eval_loss_ema", "validation, EMA weights")]),
    ("top-1", [("top1", "train"), ("eval_top1", "validation"), ("eval_top1_ema", "validation, EMA weights")]),
    ("learning rate", [("lr", "")]),
    ("images/sec (training steps)", [("images_per_sec", "")]),
)


def draw(workdir: str) -> dict[str, int]:
    """Draws curves.png from the workdir's metrics (replacing the last one whole); {key: points drawn}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(workdir)
    drawn = {}
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for axis, (title, lines) in zip(axes.flat, PANELS):
        for key, label in lines:
            steps, values = _series(rows, key)
            if steps:
                axis.plot(steps, values, marker="o" if key.startswith("eval") else None, markersize=3,
                          label=label or None)
                drawn[key] = len(steps)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if any(label for key, label in lines if key in drawn):
            axis.legend(fontsize=8)
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle(os.path.basename(os.path.abspath(workdir)))
    figure.tight_layout()
    path = layout.curves(workdir)
    partial = f"{path}.partial.png"  # a reader never sees half a file
    figure.savefig(partial, dpi=90)
    plt.close(figure)
    os.replace(partial, path)
    return drawn
