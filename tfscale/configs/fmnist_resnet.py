"""A CIFAR ResNet on Fashion-MNIST (28x28 grey, 10 classes): the small-scale studies' recipe (docs/studies/).

    make fashion-mnist      # Debian's dataset-fashion-mnist: the original IDX files
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist \
        --validation_examples=5000 --train_examples=12800
    python -m tfscale.train --config=configs/fmnist_resnet.py --workdir=runs/fmnist_r8 \
        --config.data.data_dir=runs/fmnist

Reads `train-*` (the `--train_examples` subset; set data.num_train_examples to what was converted, the
manifest cross-check names a mismatch) and evaluates on `validation-*`, the 5,000 held-out training
images; `--config.data.eval_split=test` evaluates on the 10,000 test images. Batch 32 with the LR of
0.2 per 256 images (0.025), gradual warmup over the first epoch, step decay /10 at epochs 4, 8 and 11
of 12 (ImageNet's 30/60/80 of 90, rounded), pad-4 crop and flip augmentation. Measured here on the
12,800-image subset: top-1 0.866 +- 0.001 over 3 seeds (without the warmup), 1.5-2.5 minutes a run on
2 CPU cores.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "cifar_resnet8"
    c.model.zero_init_residual = False
    c.data.dataset = "tfrecord"
    c.data.image_size = 28
    c.data.num_classes = 10
    c.data.num_train_examples = 12_800
    c.data.num_eval_examples = 5_000
    c.data.augment = "cifar"  # pad 4, random 28x28 crop, horizontal flip (clothes are mirror-symmetric)
    c.data.global_batch_size = 32
    c.data.shuffle_buffer = 12_800  # the whole subset: a full shuffle every epoch
    c.data.cache = True  # 28x28 grey PNGs, a few MB decoded
    c.optim.lr_per_256 = 0.2  # 0.025 at batch 32
    c.optim.weight_decay = 5e-4
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 1.0
    c.schedule.decay = "step"
    c.schedule.decay_epochs = (4, 8, 11)
    c.train.epochs = 12.0
    c.train.log_every_steps = 100
    c.train.steps_per_loop = 50
    c.train.eval_every_epochs = 4.0
    c.checkpoint.every_epochs = 4.0
    return c
