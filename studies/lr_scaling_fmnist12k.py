"""Linear LR scaling and warmup at growing global batch (the large-batch ImageNet study), small and real.

    make fashion-mnist
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist12k \
        --validation_examples=5000 --train_examples=12800
    python -m tfscale.study studies/lr_scaling_fmnist12k.py --workdir=runs/study_lr_scaling_12k

ResNet-8 (CIFAR family) on 12,800 Fashion-MNIST training images, 12 epochs (step decay /10 at 4, 8 and
11: ImageNet's 30/60/80 of 90), evaluated on the 5,000 held-out training images. The global batch
grows 32 -> 256 -> 1024, so the steps per epoch shrink 32-fold (400 -> 50 -> 12), as they do from 1 to
32 GPUs at a fixed per-GPU batch. Batch 32 is the "1-GPU" baseline: LR 0.025, no warmup. At the larger
batches, four methods:
  naive     the baseline's LR 0.025 unchanged;
  linear    LR scaled with the batch (0.2 per 256 images), no warmup;
  stepping  linear + a 2-epoch stepping warmup (the LR x 1/3, 2/3 for one epoch each);
  gradual   linear + a 2-epoch gradual warmup from the baseline's LR, per step (Goyal et al.).
Two warmup epochs of twelve, not five of ninety: at batch 1024 an epoch is only 12 steps. 3 seeds each;
the t-tests ask whether each cell's top-1 is lower than the batch-32 baseline's. The report with the
figures measured here is docs/studies/lr_scaling.md.
"""

DATA_DIR = "runs/fmnist12k"
BASE_BATCH = 32
BASE_LR = 0.025  # at BASE_BATCH: lr_per_256 = 0.2
WARMUP_EPOCHS = 2.0
METHODS = ("naive", "linear", "stepping", "gradual")


def method_overrides(method: str, batch: int) -> list[str]:
    lr_per_256 = (BASE_LR if method == "naive" else BASE_LR * batch / BASE_BATCH) * 256 / batch
    overrides = [f"--config.data.global_batch_size={batch}", f"--config.optim.lr_per_256={lr_per_256:g}"]
    if method in ("stepping", "gradual"):
        overrides += [f"--config.schedule.warmup={method}", f"--config.schedule.warmup_epochs={WARMUP_EPOCHS}",
                      f"--config.schedule.warmup_init_lr={BASE_LR}"]
    else:
        overrides += ["--config.schedule.warmup=none", "--config.schedule.warmup_epochs=0"]
    return overrides


def get_study():
    cells = {"b32": {"overrides": method_overrides("linear", BASE_BATCH),
                     "plot_values": {"global batch": BASE_BATCH, "method": list(METHODS)}}}
    for batch in (256, 1024):
        for method in METHODS:
            cells[f"{method}_b{batch}"] = {"overrides": method_overrides(method, batch),
                                           "plot_values": {"global batch": batch, "method": method}}
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", "--config.checkpoint.every_epochs=12"],
        "cells": cells,
        "seeds": [0, 1, 2],
        "baseline": "b32",
        "plot": {"x": "global batch", "series": "method", "x_label": "global batch (32 = the 1-GPU baseline)",
                 "log_x": True},
        "title": "LR scaling + warmup: ResNet-8, Fashion-MNIST (12.8k), 12 epochs",
    }
