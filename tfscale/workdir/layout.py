"""The files of a run's workdir, named once: everything that writes or reads one goes through here.

    WORKDIR/config.json            the resolved config the run trains with (guards.py)
    WORKDIR/config_history.jsonl   the changes a resumed run accepted (guards.py)
    WORKDIR/lock.json              the live job that holds the workdir (guards.py)
    WORKDIR/metrics.jsonl          a row per logged step and per eval (training/callbacks.MetricsLogger)
    WORKDIR/tensorboard/           the same as TensorBoard scalars, and profiler traces
    WORKDIR/curves.png             loss, top-1, LR and images/sec against step, redrawn after each eval (curves.py)
    WORKDIR/checkpoints/           tf.train checkpoints, `ckpt-<step>` and their state file (training/checkpoints.py)
    WORKDIR/summary.json           the finished run's figures (training/train.py; read by export and studies)
    WORKDIR/benchmark.json         a benchmark's figures (tfscale.perf.benchmark; read by sweeps and tfscale-plan)
    WORKDIR/export/                model.keras, the SavedModel, labels.txt, export.json (export.py's default)
"""

from __future__ import annotations

import os

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
LOCK = "lock.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"
BENCHMARK = "benchmark.json"
EXPORT = "export"
CURVES = "curves.png"


def config(workdir: str) -> str:
    return os.path.join(workdir, CONFIG)


def history(workdir: str) -> str:
    return os.path.join(workdir, HISTORY)


def lock(workdir: str) -> str:
    return os.path.join(workdir, LOCK)


def metrics(workdir: str) -> str:
    return os.path.join(workdir, METRICS)


def tensorboard(workdir: str) -> str:
    return os.path.join(workdir, TENSORBOARD)


def checkpoints(workdir: str) -> str:
    return os.path.join(workdir, CHECKPOINTS)


def summary(workdir: str) -> str:
    return os.path.join(workdir, SUMMARY)


def export(workdir: str) -> str:
    return os.path.join(workdir, EXPORT)


def curves(workdir: str) -> str:
    return os.path.join(workdir, CURVES)


def benchmark(workdir: str) -> str:
    return os.path.join(workdir, BENCHMARK)
