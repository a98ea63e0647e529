"""The demo: CIFAR ResNet-20 on scikit-learn's 1,797 real handwritten digit scans (32x32 TFRecords).

    python tools/digits_demo.py --workdir=runs/demo       # writes the shards, then runs:
    python -m tfscale.train --config=configs/digits.py --workdir=runs/demo/train \
        --config.data.data_dir=runs/demo/shards

Expect eval top-1 well above 90% on the 359 held-out scans after 2-4 minutes on 2 CPU cores. No
flips in the augmentation: a mirrored digit is a different symbol.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "cifar_resnet20"
    c.data.dataset = "tfrecord"
    c.data.data_dir = "runs/demo/shards"
    c.data.image_size = 32
    c.data.num_classes = 10
    c.data.label_offset = 1  # tfscale's conversion tool writes ImageNet-style 1-based labels
    c.data.num_train_examples = 1438
    c.data.num_eval_examples = 359
    c.data.augment = "none"
    c.data.global_batch_size = 64
    c.data.shuffle_buffer = 2048
    c.data.cache = True  # 1,438 small images: read the shards once
    c.optim.lr_per_256 = 0.4  # 0.1 at batch 64
    c.optim.weight_decay = 5e-4
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 1.0
    c.schedule.decay = "cosine"
    c.train.epochs = 15.0
    c.train.log_every_steps = 50
    c.train.eval_every_epochs = 5.0
    c.checkpoint.every_epochs = 5.0
    return c
