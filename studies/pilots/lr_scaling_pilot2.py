"""Second pilot for the LR-scaling rerun: LR 1.6, with the step decay, 6 epochs.

    python -m tfscale.study studies/pilots/lr_scaling_pilot2.py --workdir=runs/study_lr_pilot2

The first pilot (lr_scaling_pilot.py) found that at a constant LR of 1.6 or more nothing trains in 3
epochs, warmup or not. Here the LR falls /10 at 1/3, 2/3 and 8/9 of 6 epochs (ImageNet's 30/60/80 of
90), and the warmup lasts 2 epochs (per epoch, from the batch-32 LR), at LR 1.6 reached two ways: batch
2048 at 0.2 per 256 images, and batch 1024 at 0.4 per 256. The rest is the first pilot's: 55,000 images,
weight decay 1e-4, BatchNorm over groups of 32 images, one seed.

Measured (2-core VM, 268 s a run), final eval top-1:
  batch 2048, 0.2 per 256:  no warmup 0.762, gradual 0.579
  batch 1024, 0.4 per 256:  no warmup 0.793, gradual 0.747
No warmup is better here, but this design handicaps the warmup: it lasts the whole first LR phase (the
first decay is at epoch 2), so the warmed-up runs spend almost no steps at the full LR. The rerun needs
the warmup to be a small part of the first phase, as 5 of 30 epochs are in the thesis.
"""

DATA_DIR = "runs/fmnist55k"
GROUP = 32  # images per BatchNorm, at every global batch
BASE_LR = 0.025  # at batch 32
EPOCHS = 6


def overrides(batch: int, lr_per_256: float, warmup: str) -> list[str]:
    cell = [f"--config.data.global_batch_size={batch}", f"--config.optim.lr_per_256={lr_per_256}"]
    if warmup == "gradual":
        return cell + ["--config.schedule.warmup=gradual", "--config.schedule.warmup_epochs=2",
                       f"--config.schedule.warmup_init_lr={BASE_LR}", "--config.schedule.warmup_granularity=epoch"]
    return cell + ["--config.schedule.warmup=none", "--config.schedule.warmup_epochs=0"]


def get_study():
    cells = {}
    for batch, lr_per_256 in ((2048, 0.2), (1024, 0.4)):
        for warmup in ("none", "gradual"):
            cells[f"{warmup}_b{batch}"] = {"overrides": overrides(batch, lr_per_256, warmup),
                                           "plot_values": {"global batch": batch, "warmup": warmup}}
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", "--config.data.num_train_examples=55000",
                      "--config.data.shuffle_buffer=55000", f"--config.model.bn_group_size={GROUP}",
                      "--config.optim.weight_decay=1e-4", f"--config.train.epochs={EPOCHS}",
                      "--config.schedule.decay_epochs=()", "--config.schedule.decay_fractions=(0.3333,0.6667,0.8889)",
                      f"--config.checkpoint.every_epochs={EPOCHS}", "--config.train.eval_every_epochs=2",
                      "--config.train.log_every_steps=10"],
        "cells": cells,
        "seeds": [0],
        "baseline": "gradual_b2048",
        "plot": {"x": "global batch", "series": "warmup", "x_label": "global batch", "log_x": True},
        "title": "LR-scaling pilot 2: LR 1.6, no warmup vs 2-epoch gradual, step decay, ResNet-8, Fashion-MNIST 55k",
    }
