"""Pilot for the LR-scaling rerun: at which global batch does linear scaling without a warmup start to hurt?

    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist55k \
        --validation_examples=5000
    python -m tfscale.study studies/pilots/lr_scaling_pilot.py --workdir=runs/study_lr_pilot

The set-up of the LR-scaling rerun for a few epochs, one seed: the whole 55,000-image
Fashion-MNIST training split, weight decay 1e-4, BatchNorm over groups of 32 images at every batch (ghost
BatchNorm: each BatchNorm sees what one GPU of 32 images sees, as when GPUs are added at a fixed per-GPU
batch), LR 0.2 per 256 images scaled linearly. At each batch, linear scaling with no warmup against a
1-epoch gradual warmup per epoch from the batch-32 LR; a constant LR after the warmup (no decay in 3
epochs). Where the two differ, the rerun's largest batch lies.

Measured (2-core VM, 148 s a run): after 3 epochs at a constant LR, eval top-1 / last training loss
  batch 1024 (LR 0.8):  no warmup 0.711 / 0.57, gradual 0.755 / 0.64
  batch 2048 (LR 1.6):  no warmup 0.348 / 0.84, gradual 0.402 / 1.25
  batch 4096 (LR 3.2):  no warmup 0.216 / 1.88, gradual 0.092 / 2.21
At 1024 both train; from LR 1.6 on neither does in 3 epochs at a constant LR, warmup or not: the
second pilot (lr_scaling_pilot2.py) adds the step decay and a 2-epoch warmup at LR 1.6.
"""

DATA_DIR = "runs/fmnist55k"
GROUP = 32  # images per BatchNorm, at every global batch
BASE_LR = 0.025  # at batch 32: 0.2 per 256 images


def overrides(batch: int, warmup: str) -> list[str]:
    lr_per_256 = 0.2
    cell = [f"--config.data.global_batch_size={batch}", f"--config.optim.lr_per_256={lr_per_256}"]
    if warmup == "gradual":
        return cell + ["--config.schedule.warmup=gradual", "--config.schedule.warmup_epochs=1",
                       f"--config.schedule.warmup_init_lr={BASE_LR}", "--config.schedule.warmup_granularity=epoch"]
    return cell + ["--config.schedule.warmup=none", "--config.schedule.warmup_epochs=0"]


def get_study():
    cells = {}
    for batch in (1024, 2048, 4096):
        for warmup in ("none", "gradual"):
            cells[f"{warmup}_b{batch}"] = {"overrides": overrides(batch, warmup),
                                           "plot_values": {"global batch": batch, "warmup": warmup}}
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", "--config.data.num_train_examples=55000",
                      "--config.data.shuffle_buffer=55000", f"--config.model.bn_group_size={GROUP}",
                      "--config.optim.weight_decay=1e-4", "--config.train.epochs=3",
                      "--config.schedule.decay=constant", "--config.checkpoint.every_epochs=3",
                      "--config.train.eval_every_epochs=1"],
        "cells": cells,
        "seeds": [0],
        "baseline": "gradual_b1024",
        "plot": {"x": "global batch", "series": "warmup", "x_label": "global batch", "log_x": True},
        "title": "LR-scaling pilot: no warmup vs 1-epoch gradual warmup, ResNet-8, Fashion-MNIST 55k, 3 epochs",
    }
