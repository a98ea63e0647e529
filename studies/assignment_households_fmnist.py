"""The data-assignment thesis's E1, E2.2 and E3.2 on 2 cores: workers, assignment schemes and households.

    make fashion-mnist
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist12k \
        --validation_examples=5000 --train_examples=12800
    python -m tfscale.study studies/assignment_households_fmnist.py --workdir=runs/study_assignment_households

The thesis trains ResNet-20 on CIFAR-10 with up to 16 Horovod workers. Here ResNet-8 trains on 12,800
Fashion-MNIST images for 8 epochs (LR / 10 at 4 and 6, a 1-epoch gradual warmup), MWMS workers on one
machine, evaluated on 5,000 held-out images. Every scheme assigns examples (`data.assignment_level=example`:
16 files are too few for fine_grained's equal pairwise overlaps at 8 workers). The cells:

  E1    m1, m2, m4, m8: M = 1, 2, 4, 8 workers at a constant global batch 128 (128/M a worker),
        disjoint data, synchronous SGD, LR 0.1. m8 is also E2.2's and E3's C = 1 reference.
  E2.2  {coarse, medium_coarse, fine_grained} x C = 2, 4 at M = 8 (the most workers 2 cores carry),
        synchronous, global batch 128: each example on C workers, spread three ways (docs/data.md).
  E3.2  households: M = 8 workers in H = 4 households of 2 (the thesis: M = 16, H = 8, also 2 a household),
        gradients averaged inside a household every step, weights averaged over all 8 every L_W steps,
        L_W = 4, 8, 16 (the thesis's 32, 64, 128 over some 8,500 iterations; here 240-350 iterations),
        the local batch chosen for a constant effective batch 128 (its Eq. A.3, tools/local_sgd_calculator.py)
        at the unscaled LR 0.1, as in its Table 5.1. Household shards S_H = 4 (disjoint: each household
        reads its own quarter) against S_H = 1 (every household reads all the data: coarse, C = 4).

Five seeds a cell, as the thesis used. Report: docs/studies/assignment_households.md; raw per-run values:
docs/studies/assignment_households.json.
"""

from tfscale import local_sgd

DATA_DIR = "runs/fmnist12k"
NUM_TRAIN_EXAMPLES = 12_800
EPOCHS = 8
LR = 0.1  # the thesis's unscaled LR at batch 128
LARGEST_M = 8
HOUSEHOLDS = 4
SYNC_PERIODS = (4, 8, 16)  # L_W, world syncs every so many steps
HOUSEHOLD_SHARDS = {4: ["--config.data.assignment=disjoint"],  # S_H -> the scheme giving it at M=8, H=4
                    1: ["--config.data.assignment=coarse", "--config.data.copies=4"]}


def e1_cell(workers: int) -> dict:
    return {"overrides": ["--config.data.global_batch_size=128", "--config.data.assignment=disjoint"],
            "num_workers": workers}


def e22_cell(scheme: str, copies: int) -> dict:
    return {"overrides": ["--config.data.global_batch_size=128", f"--config.data.assignment={scheme}",
                          f"--config.data.copies={copies}"],
            "num_workers": LARGEST_M}


def e32_cell(household_shards: int, sync_period: int) -> dict:
    plan = local_sgd.household_batch(128, num_workers=LARGEST_M, households=HOUSEHOLDS, sync_period=sync_period,
                                     num_train_examples=NUM_TRAIN_EXAMPLES, epochs=EPOCHS)
    return {"overrides": [f"--config.data.global_batch_size={plan['local_batch'] * LARGEST_M}",
                          *HOUSEHOLD_SHARDS[household_shards], "--config.distribute.sync=local_sgd",
                          f"--config.distribute.sync_period={sync_period}",
                          f"--config.distribute.households={HOUSEHOLDS}", "--config.distribute.household_period=1"],
            "num_workers": LARGEST_M,
            "plot_values": {"L_W": sync_period, "household shards": f"S_H={household_shards}"}}


def get_study():
    cells = {f"m{m}": e1_cell(m) for m in (1, 2, 4, LARGEST_M)}
    cells |= {f"{scheme}_c{c}": e22_cell(scheme, c) for c in (2, 4)
              for scheme in ("coarse", "medium_coarse", "fine_grained")}
    cells |= {f"households_sh{sh}_lw{lw}": e32_cell(sh, lw) for lw in SYNC_PERIODS for sh in HOUSEHOLD_SHARDS}
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", f"--config.data.num_train_examples={NUM_TRAIN_EXAMPLES}",
                      "--config.data.assignment_level=example", f"--config.optim.lr={LR}",
                      f"--config.train.epochs={EPOCHS}", "--config.schedule.decay_epochs=(4, 6)",
                      f"--config.checkpoint.every_epochs={EPOCHS}", f"--config.train.eval_every_epochs={EPOCHS}",
                      "--config.distribute.backend=mwms"],
        "cells": cells,
        "seeds": [0, 1, 2, 3, 4],
        "baseline": f"m{LARGEST_M}",
        "comparisons": [
            *({"cell": f"m{m}", "against": "m1", "alternative": "two-sided"} for m in (2, 4, LARGEST_M)),  # E1
            *({"cell": name, "against": f"m{LARGEST_M}", "alternative": "two-sided"}  # E2.2: against C = 1
              for name in cells if name.endswith(("_c2", "_c4"))),
            *({"cell": f"households_sh1_lw{lw}", "against": f"households_sh4_lw{lw}", "alternative": "greater"}
              for lw in SYNC_PERIODS),  # E3.2: do overlapping household shards help?
        ],
        "plot": {"x": "L_W", "series": "household shards", "log_x": True,
                 "x_label": f"L_W, steps between world syncs (M={LARGEST_M}, H={HOUSEHOLDS}, effective batch 128)"},
        "title": "Workers, assignment schemes and households: ResNet-8, Fashion-MNIST (12.8k), up to 8 workers",
    }
