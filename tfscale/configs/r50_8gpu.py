"""ResNet-50 v1.5 on ImageNet, one node with 8 GPUs (MirroredStrategy): 8 x 128 = 1024 per step.

    python -m tfscale.train --config=configs/r50_8gpu.py --workdir=runs/r50_8gpu \
        --config.data.data_dir=/path/to/imagenet-tfrecords

Reads ImageNet-1k TFRecord shards from `data.data_dir` (required; see r50_1gpu.py for the layout).
Linear scaling gives LR 0.4 (0.1 per 256 images) with a 5-epoch gradual warmup (Goyal et al.
2017), who publish the same top-1 for batches up to 8k as for 256 (76.3-76.4% after 90 epochs; a
published figure: tfscale has not trained ResNet-50 on ImageNet). On fewer GPUs it is
refused (128 images per replica at most); scale it with `--config.data.global_batch_size=128*GPUs`.

On a GPU the plain recipe runs float32 with XLA (`jit_compile=auto`; Keras 3's BatchNormalization is
fused only under XLA), as NVIDIA's FP32/TF32 figures below ran. GPU variants (docs/gpu.md): `:amp`
(float16 + XLA), `:amp_bf16` (bfloat16 + XLA), `:xla` (float32 + XLA on any device); same batch, LR
and epochs. Published images/sec for 8 GPUs to compare with
(training, real ImageNet TFRecords):
  * NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "Training
    performance results" (ResNet-50 v1.5, NGC 20.06-tf1, training_perf.sh: Horovod, tf.data input, no
    DALI): DGX-1 (8x V100 16 GB): 3170 img/s FP32 + XLA (128/GPU), 9510 img/s AMP + XLA (256/GPU);
    DGX A100 (8x A100 40 GB): 7000 img/s TF32 + XLA, 17400 img/s AMP + XLA (256/GPU).
  * tf_cnn_benchmarks (tensorflow.org/performance/benchmarks, May 2017): ResNet-50 v1, DGX-1 8x P100,
    FP32, 64/GPU, real data: 1630 img/s (no mixed-precision figures published there).
NVIDIA's AMP runs use 256 images per GPU where this recipe uses 128 (the memory of a 16 GB V100 at
float32); at float16 `--config.data.global_batch_size=2048 --config.data.max_per_replica_batch_size=256`
matches them (the LR follows: 0.8). Model Garden's GPU recipe (tensorflow/models
official/vision/configs/experiments/image_classification/imagenet_resnet50_gpu.yaml) also trains
float16 with dynamic loss scaling at a global batch of 2048 on a mirrored strategy.
"""

from tfscale.config import gpu_variant
from tfscale.configs import r50_1gpu


VARIANTS = ("xla", "amp", "amp_bf16")  # GPU_VARIANTS by name, for --help (which reads this file's text)


def get_config(variant=None):
    c = r50_1gpu.imagenet_resnet50()
    c.data.global_batch_size = 1024  # 8 GPUs x 128 -> lr 0.4
    c.data.max_per_replica_batch_size = 128
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 5.0
    c.schedule.warmup_init_lr = 0.1
    c.distribute.backend = "mirrored"
    return gpu_variant(c, variant, "r50_8gpu")
