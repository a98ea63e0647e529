"""ResNet-50 v1.5 on ImageNet, one node with 8 GPUs (MirroredStrategy): 8 x 128 = 1024 per step.

    python -m tfscale.train --config=configs/r50_8gpu.py --workdir=runs/r50_8gpu \
        --config.data.data_dir=/path/to/imagenet-tfrecords

Reads ImageNet-1k TFRecord shards from `data.data_dir` (required; see r50_1gpu.py for the layout).
Linear scaling gives LR 0.4 (0.1 per 256 images) with a 5-epoch gradual warmup (Goyal et al.
2017); expect ~76% top-1 after 90 epochs, the same as the 256-batch recipe. On fewer GPUs it is
refused (128 images per replica at most); scale it with `--config.data.global_batch_size=128*GPUs`.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "resnet50"
    c.data.image_size = 224
    c.data.num_classes = 1000
    c.data.dataset = "tfrecord"
    c.data.global_batch_size = 1024  # 128 per GPU
    c.data.max_per_replica_batch_size = 128
    c.optim.lr_per_256 = 0.1  # -> lr 0.4
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-4
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 5.0
    c.schedule.warmup_init_lr = 0.1
    c.schedule.decay = "step"
    c.schedule.decay_epochs = (30, 60, 80)
    c.train.epochs = 90.0
    c.distribute.backend = "mirrored"
    return c
