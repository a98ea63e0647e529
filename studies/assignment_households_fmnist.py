"""The data-assignment thesis's E1, E2.2 and E3.2 on 2 cores: workers, assignment schemes and households.

    make fashion-mnist
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist12k \
        --validation_examples=5000 --train_examples=12800
    python -m tfscale.study studies/assignment_households_fmnist.py --workdir=runs/study_assignment_households

The thesis trains ResNet-20 on CIFAR-10 with up to 16 workers. Here ResNet-8 trains on 12,800
Fashion-MNIST images for 8 epochs (LR / 10 at 4 and 6, a 1-epoch gradual warmup, weight decay 5e-4;
the thesis used 1e-4 and no warmup in E1 or in its Table 5.1 runs), MWMS workers on one machine,
evaluated on 5,000 held-out images. Every scheme assigns examples (`data.assignment_level=example`:
16 files are too few for fine_grained's equal pairwise overlaps at 8 workers). The cells:

  E1    m1, m2, m4, m8: M = 1, 2, 4, 8 workers at a constant global batch 128 (128/M a worker),
        disjoint data, synchronous SGD, LR 0.1. m8 is also E2.2's C = 1 reference.
  E2.2  {coarse, medium_coarse, fine_grained} x C = 2, 4 at M = 8 (the most workers 2 cores carry),
        synchronous, global batch 128: each example on C workers, spread three ways (docs/data.md).
  E3.2  households: M = 8 workers in H = 4 households of 2 (the thesis: M = 16, H = 8, also 2 a household),
        gradients averaged inside a household every step, weights averaged over all 8 every L_W steps,
        L_W = 4, 8, 16 (the thesis's 32, 64, 128 over 8,554 iterations at 128, 9,828 at 32 derived; here 232-344),
        the local batch chosen for a constant effective batch 128 (its Eq. A.3, tools/local_sgd_calculator.py)
        at the unscaled LR 0.1, as in its Table 5.1. Household shards S_H = 4 (disjoint: each household
        reads its own quarter) against S_H = 1 (every household reads all the data: coarse, C = 4).

Five seeds a cell, as the thesis used. The thesis found the households' overlap gain at H = 8 with L_W of
16 or more, and at H = 4 (4 households of 4 at M = 16) at L_W = 128; E3.2 here (4 households of 2 at
M = 8, L_W <= 16) is outside its grid, so the report calls that finding not comparable, not refuted.
Report: docs/studies/assignment_households.md; raw per-run values: docs/studies/assignment_households.json.

`assignment_households_fmnist.py:thesis` is the thesis's own E2.2 and E3.2 (ResNet-20, CIFAR-10's 45,000
training images, 182 epochs, M = 16, H = 8, L_W = 32 / 64 / 128, S_H = 8 / 2 / 1) as one Slurm job array
of 16-worker runs (docs/studies.md); its E1 varies the worker count, so each M is a job of its own.
"""

import dataclasses

from tfscale.training import local_sgd


@dataclasses.dataclass(frozen=True)
class Scale:
    title: str
    config: str
    overrides: tuple[str, ...]  # for every run, besides the schedule below
    num_train_examples: int
    epochs: int
    largest_m: int
    households: int
    sync_periods: tuple[int, ...]  # L_W: world syncs every so many steps
    household_shards: tuple[int, ...]  # S_H: how many different data shards the households read
    e1: bool  # E1's cells (their worker counts differ: a local study only)


SMALL = Scale("ResNet-8, Fashion-MNIST (12.8k)", "configs/fmnist_resnet.py",
              ("--config.data.data_dir=runs/fmnist12k", "--config.data.num_train_examples=12800",
               "--config.schedule.decay_epochs=(4, 6)", "--config.distribute.backend=mwms"),
              num_train_examples=12_800, epochs=8, largest_m=8, households=4, sync_periods=(4, 8, 16),
              household_shards=(4, 1), e1=True)
THESIS = Scale("ResNet-20, CIFAR-10 (45k)", "configs/cifar_resnet20.py",  # the backend: the job's --backend
               ("--config.data.num_train_examples=45000", "--config.data.num_eval_examples=5000"),  # 5,000 held out
               num_train_examples=45_000, epochs=182, largest_m=16, households=8, sync_periods=(32, 64, 128),
               household_shards=(8, 2, 1), e1=False)
LR = 0.1  # the thesis's unscaled LR at batch 128


def sync_cell(assignment: list[str], workers: int) -> dict:
    return {"overrides": ["--config.data.global_batch_size=128", *assignment], "num_workers": workers}


def household_shards(scale: Scale, shards: int) -> list[str]:
    """S_H household shards: households of consecutive workers, so `coarse` with C = H / S_H copies gives them."""
    copies = scale.households // shards
    return ["--config.data.assignment=disjoint"] if copies == 1 else [
        "--config.data.assignment=coarse", f"--config.data.copies={copies}"]


def household_cell(scale: Scale, shards: int, sync_period: int) -> dict:
    plan = local_sgd.household_batch(128, num_workers=scale.largest_m, households=scale.households,
                                     sync_period=sync_period, num_train_examples=scale.num_train_examples,
                                     epochs=scale.epochs)
    return {"overrides": [f"--config.data.global_batch_size={plan['local_batch'] * scale.largest_m}",
                          *household_shards(scale, shards), "--config.distribute.sync=local_sgd",
                          f"--config.distribute.sync_period={sync_period}",
                          f"--config.distribute.households={scale.households}",
                          "--config.distribute.household_period=1"],
            "num_workers": scale.largest_m,
            "plot_values": {"L_W": sync_period, "household shards": f"S_H={shards}"}}


def get_study(version: str = ""):
    if version not in ("", "thesis"):
        raise ValueError(f"assignment_households_fmnist.py:{version}: the versions are this file (no argument) "
                         "and :thesis")
    scale = THESIS if version else SMALL
    m, reference = scale.largest_m, f"m{scale.largest_m}"
    worker_counts = (1, 2, 4, m) if scale.e1 else (m,)
    cells = {f"m{workers}": sync_cell(["--config.data.assignment=disjoint"], workers) for workers in worker_counts}
    cells |= {f"{scheme}_c{c}": sync_cell([f"--config.data.assignment={scheme}", f"--config.data.copies={c}"], m)
              for c in (2, 4) for scheme in ("coarse", "medium_coarse", "fine_grained")}
    cells |= {f"households_sh{sh}_lw{lw}": household_cell(scale, sh, lw)
              for lw in scale.sync_periods for sh in scale.household_shards}
    disjoint = scale.household_shards[0]
    return {
        "config": scale.config,
        "overrides": [*scale.overrides, "--config.data.assignment_level=example", f"--config.optim.lr={LR}",
                      f"--config.train.epochs={scale.epochs}", f"--config.checkpoint.every_epochs={scale.epochs}",
                      f"--config.train.eval_every_epochs={scale.epochs}"],
        "cells": cells,
        "seeds": [0, 1, 2, 3, 4],
        "baseline": reference,
        "comparisons": [
            *({"cell": f"m{workers}", "against": "m1", "alternative": "two-sided"}  # E1: against one worker
              for workers in worker_counts if workers > 1 and scale.e1),
            *({"cell": name, "against": reference, "alternative": "two-sided"}  # E2.2: against C = 1
              for name in cells if name.endswith(("_c2", "_c4"))),
            *({"cell": f"households_sh{sh}_lw{lw}", "against": f"households_sh{disjoint}_lw{lw}",
               "alternative": "greater"}  # E3.2: do overlapping household shards help?
              for lw in scale.sync_periods for sh in scale.household_shards[1:]),
        ],
        "plot": {"x": "L_W", "series": "household shards", "log_x": True,
                 "x_label": f"L_W, steps between world syncs (M={m}, H={scale.households}, effective batch 128)"},
        "title": f"Workers, assignment schemes and households: {scale.title}, up to {m} workers",
    }
