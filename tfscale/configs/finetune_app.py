"""Fine-tune a keras.applications classifier on your own class-folder tree (EfficientNetV2B0 by default).

    tfscale-convert --input_dir=raw/train --output_dir=shards --split=train --num_shards=16
    tfscale-convert --input_dir=raw/val --output_dir=shards --split=validation --num_shards=4 --class_order_from=shards
    tfscale-train --config=finetune_app --workdir=runs/ft --config.data.data_dir=shards \
        --config.model.init_from=/path/to/efficientnetv2-b0_notop.h5

`init_from` takes the application's ImageNet weights as Keras distributes them (a Keras 2 `.h5`, with or
without the top; download it where you have the internet: tfscale never downloads) or a `.weights.h5`
you saved; "" trains from scratch. The classifier is always new (`init_skip_head`): your classes, counted
from the shards' manifest like the examples. Another application: `--config.model.name=keras.applications.
ConvNeXtTiny` with its weights file; its keyword arguments go in `config.model.options` (a copy of this
file: `c.model.options.drop_connect_rate = 0.1`). The images are normalised with ImageNet's mean and
deviation, the application's own preprocessing switched off (docs/training.md, "Your own model").

A short, gentle schedule for weights that already know images: 10 epochs, SGD with momentum at 0.01 per
256 images after a one-epoch warmup, cosine decay, light weight decay, label smoothing 0.1. Runs on any
backend: `tfscale-launch --num_workers=N -- -m tfscale.train ...` or the sbatch templates.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "keras.applications.EfficientNetV2B0"
    c.model.init_skip_head = True  # your classes: a new classifier on the pretrained features
    c.data.dataset = "tfrecord"
    c.data.image_size = 224
    c.data.augment = "imagenet"
    c.data.global_batch_size = 64
    c.optim.lr_per_256 = 0.01
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-5
    c.optim.label_smoothing = 0.1
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 1.0
    c.schedule.decay = "cosine"
    c.train.epochs = 10.0
    c.train.eval_every_epochs = 1.0
    c.checkpoint.every_epochs = 1.0
    return c
