"""ResNet-50 v1.5 on ImageNet, one GPU: batch 256, LR 0.1, 90 epochs, /10 at epochs 30, 60, 80.

    python -m tfscale.train --config=configs/r50_1gpu.py --workdir=runs/r50_1gpu \
        --config.data.data_dir=/path/to/imagenet-tfrecords

Reads ImageNet-1k TFRecord shards (`train-*-of-*`, `validation-*-of-*`, 1-based labels: the layout of
`tfscale-convert` and of the classic build_imagenet_data.py / imagenet_to_gcs.py converters) from
`data.data_dir`, which is required. The reference recipe of Goyal et al. 2017 for a 256 batch (no
warmup needed at this size), for which they publish 76.4% top-1 after 90 epochs (their Table 1;
a published figure: tfscale has not trained ResNet-50 on ImageNet). Speed only, without data:
`--config.data.dataset=synthetic`, or `python -m tfscale.benchmark ... --config.benchmark.mode=synthetic`.

On a GPU the plain recipe runs float32 with XLA (`jit_compile=auto`; Keras 3's BatchNormalization is
fused only under XLA), as NVIDIA's FP32/TF32 figures below ran. GPU variants (docs/gpu.md): `:amp`
(float16 + XLA), `:amp_bf16` (bfloat16 + XLA), `:xla` (float32 + XLA on any device); same batch, LR
and epochs. Published images/sec on 1 GPU to compare `python -m
tfscale.benchmark` with (training, real ImageNet TFRecords):
  * NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "Training
    performance results" (ResNet-50 v1.5, NGC 20.06-tf1 container, training_perf.sh: tf.data input,
    no DALI): V100 16 GB (DGX-1): 412 img/s FP32 + XLA (batch 128), 1270 img/s AMP + XLA (batch 256);
    A100 40 GB (DGX A100): 909 img/s TF32 + XLA, 2375 img/s AMP + XLA (batch 256).
  * tf_cnn_benchmarks (tensorflow.org/performance/benchmarks, May 2017; tensorflow/tensorflow
    tensorflow/docs_src/performance/benchmarks.md): ResNet-50 v1, P100 (DGX-1), FP32, batch 64,
    real data: 218 img/s. Those tables have no mixed-precision figures.
This recipe's batch (256) is NVIDIA's AMP batch; their FP32 figures are at 128, what a 16 GB V100
holds at float32 (`--config.data.global_batch_size=128`, the LR follows: 0.05).
"""

from tfscale.config import base_config, gpu_variant


def imagenet_resnet50():
    """The ImageNet ResNet-50 block every r50 recipe shares (Goyal et al.'s 90-epoch recipe at 256 images):
    SGD with momentum 0.9, weight decay 1e-4, 0.1 per 256 images, / 10 at 30, 60 and 80 of 90 epochs."""
    c = base_config()
    c.model.name = "resnet50"
    c.data.image_size = 224
    c.data.num_classes = 1000  # ImageNet-1k; shards with a manifest (or TFDS info) of other data: their count, logged
    c.data.dataset = "tfrecord"
    c.data.global_batch_size = 256
    c.optim.lr_per_256 = 0.1
    c.optim.momentum = 0.9
    c.optim.weight_decay = 1e-4
    c.schedule.decay = "step"
    # /10 at epochs 30, 60 and 80 of 90, as fractions: `--config.train.epochs=N` moves them to the same share of N.
    c.schedule.decay_epochs = ()
    c.schedule.decay_fractions = (30 / 90, 60 / 90, 80 / 90)
    c.train.epochs = 90.0
    return c


VARIANTS = ("xla", "amp", "amp_bf16")  # GPU_VARIANTS by name, for --help (which reads this file's text)


def get_config(variant=None):
    c = imagenet_resnet50()
    c.data.max_per_replica_batch_size = 256  # one GPU
    c.schedule.warmup = "none"
    c.schedule.warmup_epochs = 0.0
    c.distribute.backend = "one_device"
    return gpu_variant(c, variant, "r50_1gpu")
