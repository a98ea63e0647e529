"""ResNet-20 on CIFAR-10 (He et al. 2016, sec. 4.2): batch 128, LR 0.1, /10 at epochs 91 and 136.

    python -m tfscale.train --config=configs/cifar_resnet20.py --workdir=runs/cifar20 \
        --config.data.data_dir=/path/to/cifar10-tfrecords

Reads CIFAR-10 as TFRecord shards (`train-*-of-*` with the 50,000 training images, `validation-*-of-*`
with the 10,000 test images, 1-based labels as `tfscale-convert` writes them from a class-folder tree
of the 32x32 images) from `data.data_dir`, which is required. He et al. report 91.25% top-1 with
this recipe (with parameter-free "option A" shortcuts; this model's 1x1 projections add ~1%
parameters). `--config.data.dataset=synthetic_learnable` runs it on a learnable 32x32 synthetic task
with the same shapes and schedule, without data.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "cifar_resnet20"
    c.model.zero_init_residual = False  # the original recipe
    c.data.dataset = "tfrecord"
    c.data.augment = "cifar"  # pad 4, random 32x32 crop, flip (He et al.)
    c.data.image_size = 32
    c.data.num_classes = 10
    c.data.num_train_examples = 50_000
    c.data.num_eval_examples = 10_000
    c.data.global_batch_size = 128
    c.optim.lr_per_256 = 0.2  # 0.1 at batch 128
    c.optim.weight_decay = 1e-4
    c.schedule.warmup = "none"
    c.schedule.warmup_epochs = 0.0
    c.schedule.decay = "step"
    c.schedule.decay_epochs = (91, 136)  # 32k and 48k iterations at batch 128
    c.train.epochs = 182.0  # 64k iterations
    c.train.log_every_steps = 100
    c.train.eval_every_epochs = 10.0
    c.checkpoint.every_epochs = 10.0
    return c
