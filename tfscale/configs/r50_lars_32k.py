"""ResNet-50 v1.5 with LARS at a 32k global batch: the MLPerf-style large-batch recipe.

    python -m tfscale.train --config=configs/r50_lars_32k.py --workdir=runs/r50_lars_32k \
        --config.data.data_dir=/path/to/imagenet-tfrecords     # one task per GPU, 256 GPUs

Reads ImageNet-1k TFRecord shards from `data.data_dir` (required; see r50_1gpu.py for the layout).
LARS (You et al. 2017; trust coefficient 0.001, BN and biases excluded from adaptation and decay),
momentum 0.9, label smoothing 0.1, linear warmup from 0 over 5 epochs, then polynomial (power 2)
decay to 1e-4 over the remaining epochs, 72 epochs, 1000 classes at 224x224, mixed_float16
(loss-scaled), one worker per GPU under MultiWorkerMirroredStrategy. The base LR grows with the batch
through the linked `optim.lr` (0.2265625 per 256 images = 29.0 at 32,768). LARS recipes are tuned
per batch size and epoch budget (MLPerf submissions sweep base LR, warmup and epochs): treat these
values as the starting point, and expect ~75.9% top-1 (the MLPerf target) only after such tuning.
Written for 256 GPUs x 128 images; fewer replicas are refused unless the batch is scaled down.

Variants as the other ResNet-50 recipes' (`--config=configs/r50_lars_32k.py:amp`, docs/gpu.md): `:amp` is this
recipe's mixed_float16 with XLA and NHWC, `:amp_bf16` bfloat16 instead, `:xla` float32 with XLA.
"""

from tfscale.config import base_config, gpu_variant
from tfscale.configs import r50_1gpu


VARIANTS = ("xla", "amp", "amp_bf16")  # GPU_VARIANTS by name, for --help (which reads this file's text)


def get_config(variant=None):
    c = r50_1gpu.imagenet_resnet50()
    c.data.global_batch_size = 32_768
    c.data.max_per_replica_batch_size = 128
    c.optim.name = "lars"
    c.optim.lr_per_256 = 0.2265625  # -> lr 29.0 at 32,768
    c.optim.weight_decay = 5e-5
    c.optim.lars_eta = 0.001
    c.optim.lars_epsilon = 0.0
    c.optim.label_smoothing = 0.1
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 5.0
    c.schedule.warmup_init_lr = 0.0
    c.schedule.decay = "polynomial"
    # Polynomial decay runs from the warmup's end to the last step; the step decay's keys go back to
    # base_config's defaults (unused here), so that the recipe's config.json is what it always was.
    c.schedule.decay_epochs, c.schedule.decay_fractions = base_config().schedule.decay_epochs, ()
    c.schedule.poly_power = 2.0
    c.schedule.end_lr = 1e-4
    c.train.epochs = 72.0
    c.train.eval_every_epochs = 4.0
    c.checkpoint.every_epochs = 4.0
    c.distribute.backend = "mwms"
    c.precision = "mixed_float16"
    return gpu_variant(c, variant, "r50_lars_32k")
