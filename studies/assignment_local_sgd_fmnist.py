"""Data assignment x local SGD on 4 workers (the data-assignment / local-SGD study), small and real.

    make fashion-mnist
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist12k \
        --validation_examples=5000 --train_examples=12800
    python -m tfscale.study studies/assignment_local_sgd_fmnist.py --workdir=runs/study_assignment_local_sgd

ResNet-8 (CIFAR family) on 12,800 Fashion-MNIST training images in 16 shards, 4 MWMS worker processes
(tfscale.launch on one machine), global batch 128 (32 per worker), LR 0.1 with a 1-epoch gradual
warmup, weight decay 5e-4 (the data-assignment thesis's: 1e-4), 8 epochs with step decay /10 at 4 and 6
(50% and 75%, as in He et al.'s CIFAR schedule that thesis used), evaluated on the 5,000 held-out
training images.
Cells: three assignments of the shards to the workers,
  disjoint  each shard on one worker (C=1: 4 shards a worker),
  overlap   each shard on two workers (coarse, C=2: workers 0,2 and 1,3 read the same 8 shards),
  full      every worker reads all 16 shards (C=4),
times three ways to synchronise: synchronous SGD (gradients all-reduced every step, plotted at sync
period 1) and local SGD with a world sync of weights, BatchNorm statistics and momentum every 8 or 64
steps. 3 seeds each; the t-tests ask whether each cell's top-1 is lower than synchronous + disjoint
(the usual data-parallel set-up). The report with the figures measured here is
docs/studies/assignment_local_sgd.md.
"""

DATA_DIR = "runs/fmnist12k"
ASSIGNMENTS = {"disjoint": ["--config.data.assignment=disjoint"],
               "overlap": ["--config.data.assignment=coarse", "--config.data.copies=2"],
               "full": ["--config.data.assignment=full"]}
SYNC_PERIODS = (1, 8, 64)  # 1: synchronous SGD (gradient all-reduce every step)


def sync_overrides(period: int) -> list[str]:
    if period == 1:
        return ["--config.distribute.sync=gradients"]
    return ["--config.distribute.sync=local_sgd", f"--config.distribute.sync_period={period}"]


def get_study():
    cells = {}
    for assignment, assignment_overrides in ASSIGNMENTS.items():
        for period in SYNC_PERIODS:
            name = f"{assignment}_sync" if period == 1 else f"{assignment}_local{period}"
            cells[name] = {"overrides": [*assignment_overrides, *sync_overrides(period)],
                           "plot_values": {"sync period": period, "assignment": assignment}}
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", "--config.data.global_batch_size=128",
                      "--config.optim.lr_per_256=0.2", "--config.train.epochs=8",
                      "--config.schedule.decay_epochs=(4, 6)", "--config.checkpoint.every_epochs=8",
                      "--config.distribute.backend=mwms"],
        "cells": cells,
        "seeds": [0, 1, 2],
        "baseline": "disjoint_sync",
        "num_workers": 4,
        "backend": "mwms",
        "plot": {"x": "sync period", "series": "assignment", "x_label": "steps between weight averages "
                 "(1 = synchronous SGD)", "log_x": True},
        "title": "Assignment x local SGD: ResNet-8, Fashion-MNIST (12.8k), 4 workers",
    }
