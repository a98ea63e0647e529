"""ResNet-50 v1.5 on ImageNet, 32 GPUs (8 nodes x 4): the large-minibatch recipe of Goyal et al. 2017.

    python -m tfscale.train --config=configs/r50_32gpu.py --workdir=runs/r50_32gpu \
        --config.data.data_dir=/path/to/imagenet-tfrecords     # one task per GPU (srun, tfscale.launch)

Reads ImageNet-1k TFRecord shards from `data.data_dir` (required; see r50_1gpu.py for the layout);
`tools/make_sbatch.py` stages them to node-local disk and points `data_dir` at the copy.
128 images per GPU (global batch 4096), SGD momentum 0.9, weight decay 1e-4 on kernels, LR 0.1 per
256 images (= 1.6), 5-epoch gradual warmup from 0.1, LR /10 at epochs 30, 60 and 80, 90 epochs,
zero-initialised last BN gamma per block, 224x224. Expect ~76% top-1 (Goyal et al. report 76.26%
for batch 8k), i.e. no loss against the 256-batch baseline. Runs as one worker per GPU under
MultiWorkerMirroredStrategy. On fewer replicas each would take more than 128 images, so it is
refused with the override that scales it down: `--config.data.global_batch_size=512` on 4 GPUs (the
LR follows: 0.2), the same recipe at a smaller batch.
"""

from tfscale.config import base_config


def get_config():
    c = base_config()
    c.model.name = "resnet50"
    c.model.zero_init_residual = True
    c.data.image_size = 224
    c.data.num_classes = 1000
    c.data.dataset = "tfrecord"
    c.data.global_batch_size = 4096  # 32 GPUs x 128
    c.data.max_per_replica_batch_size = 128
    c.optim.name = "sgd"
    c.optim.lr_per_256 = 0.1  # -> lr 1.6
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-4
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 5.0
    c.schedule.warmup_init_lr = 0.1
    c.schedule.decay = "step"
    c.schedule.decay_epochs = (30, 60, 80)
    c.train.epochs = 90.0
    c.distribute.backend = "mwms"
    return c
