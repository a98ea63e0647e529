"""Smoke test: a tiny CIFAR ResNet on a learnable synthetic 32x32 task, about 20 s on 2 CPU cores.

    python -m tfscale.train --config=configs/smoke.py --workdir=runs/smoke

Expect: 60 steps of batch 32, loss falling from ~2.3, eval top-1 well above the 10% of chance
(typically > 0.5), and config.json, metrics.jsonl, summary.json, checkpoints/, tensorboard/ in the
workdir. Running the command again resumes from the final checkpoint instead of starting over.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "cifar_resnet8"
    c.data.dataset = "synthetic_learnable"
    c.data.image_size = 32
    c.data.num_classes = 10
    c.data.num_train_examples = 640  # 20 steps per epoch
    c.data.num_eval_examples = 500  # not a multiple of the batch: the last eval batch is padded
    c.data.global_batch_size = 32
    c.optim.lr_per_256 = 0.8  # 0.1 at batch 32
    c.optim.weight_decay = 5e-4
    c.schedule.warmup_epochs = 0.5
    c.schedule.warmup_init_lr = 0.0
    c.schedule.decay = "cosine"
    c.train.epochs = 3.0
    c.train.log_every_steps = 10
    c.train.eval_every_epochs = 1.5
    c.checkpoint.every_epochs = 1.0
    return c
