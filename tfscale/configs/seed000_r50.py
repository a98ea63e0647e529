"""The large-batch ImageNet study's ResNet-50 runs (its Exps 4-9): linear LR scaling and warmup at 32 GPUs.

    python -m tfscale.train --config=configs/seed000_r50.py:gradual5 --workdir=runs/seed000_gradual5 \
        --config.data.data_dir=/shared/imagenet

One recipe, six methods by config argument; everything else is the study's: ResNet-50 v1.5, 32 GPUs x
128 images = global batch 4096, SGD momentum 0.9, weight decay 1e-4, 90 epochs, LR / 10 at epochs 30,
60 and 80, the LR changed once per epoch during warmup as the study's callbacks did
(`--config.schedule.warmup_granularity=step` gives Goyal et al.'s per-step warmup instead):

  naive        LR 0.1 whatever the batch (the single-GPU recipe's LR, unscaled)
  linear       linear scaling: 0.1 per 256 images -> 1.6, no warmup
  stepping5    + 5-epoch stepping warmup: 1.6 x (1..5)/6 = 0.2667 ... 1.3333, then 1.6
  stepping5_32 the same at 32 images per GPU: global batch 1024, LR 0.4
  gradual5     + 5-epoch gradual warmup from the 1-GPU LR 0.05: 0.05, 0.36, 0.67, 0.98, 1.29, then 1.6
  gradual10    + 10-epoch gradual warmup from 0.05

Reads TFRecord shards (tfscale-convert or the classic ImageNet scripts). On fewer GPUs keep the
method's result with gradient accumulation (`--config.optim.grad_accum_steps`), as the recipe's
per-replica limit (128) says when refused.
"""

from tfscale.errors import ConfigError
from tfscale.configs import r50_32gpu

METHODS = VARIANTS = ("naive", "linear", "stepping5", "stepping5_32", "gradual5", "gradual10")
SINGLE_GPU_BATCH = 128  # the study's 1-GPU run: the gradual warmups start at its LR


def get_config(method=None):
    if method not in METHODS:
        raise ConfigError(f"seed000_r50:{method} is not a method of this study: use one of {', '.join(METHODS)}"
                          if method else f"seed000_r50 needs a method: seed000_r50.py:METHOD with METHOD one of "
                          f"{', '.join(METHODS)}")
    c = r50_32gpu.get_config()
    c.schedule.warmup = "none"
    c.schedule.warmup_granularity = "epoch"
    c.schedule.warmup_init_lr = c.optim.get_ref("lr_per_256") * SINGLE_GPU_BATCH / 256  # 0.05
    if method == "naive":
        c.optim.lr_per_256 = 25.6 / c.data.get_ref("global_batch_size").to_float()  # lr = 0.1 at any batch
    if method.startswith("stepping"):
        c.schedule.warmup, c.schedule.warmup_epochs = "stepping", 5.0
    if method == "stepping5_32":
        c.data.global_batch_size = 1024  # 32 GPUs x 32
    if method.startswith("gradual"):
        c.schedule.warmup, c.schedule.warmup_epochs = "gradual", float(method[len("gradual"):])
    return c
