"""ResNet-50 v1.5 on ImageNet, 32 GPUs (8 nodes x 4): the large-minibatch recipe of Goyal et al. 2017.

    python -m tfscale.train --config=configs/r50_32gpu.py --workdir=runs/r50_32gpu \
        --config.data.data_dir=/path/to/imagenet-tfrecords     # one task per GPU (srun, tfscale.launch)

Reads ImageNet-1k TFRecord shards from `data.data_dir` (required; see r50_1gpu.py for the layout);
`tools/make_sbatch.py` stages them to node-local disk and points `data_dir` at the copy.
128 images per GPU (global batch 4096), SGD momentum 0.9, weight decay 1e-4 on kernels, LR 0.1 per
256 images (= 1.6), 5-epoch gradual warmup from 0.1, LR /10 at epochs 30, 60 and 80, 90 epochs,
zero-initialised last BN gamma per block, 224x224. Goyal et al. report 76.26% top-1 for batch 8k,
no loss against the 256-batch baseline (a published figure: tfscale has not trained ResNet-50 on
ImageNet). Runs as one worker per GPU under
MultiWorkerMirroredStrategy. On fewer replicas each would take more than 128 images, so it is
refused with the override that scales it down: `--config.data.global_batch_size=512` on 4 GPUs (the
LR follows: 0.2), the same recipe at a smaller batch.

On GPU workers the plain recipe runs float32 with XLA (`jit_compile=auto`: Keras 3's BatchNormalization
is fused only under XLA) and the gradients as one message. GPU variants (docs/gpu.md): `:amp` (float16 +
XLA), `:amp_bf16` (bfloat16 + XLA), `:xla` (float32 + XLA on any device); same batch, LR and epochs. All
of them all-reduce over NCCL (collective_impl=AUTO is NCCL on a worker with a GPU). NVIDIA's FP32/TF32
figures below ran with XLA, as the plain recipe does on GPUs. Published per-GPU figures to compare
with, i.e. the multi-GPU totals of NVIDIA DeepLearningExamples'
TensorFlow/Classification/ConvNets/resnet50v1.5/README.md divided by the GPU count (ResNet-50 v1.5,
training, real ImageNet TFRecords, NGC 20.06-tf1, Horovod, tf.data input, no DALI): 8x V100 16 GB:
396 img/s per GPU FP32 + XLA, 1189 AMP + XLA; 16x V100 32 GB (DGX-2): 406 FP32, 1078 AMP; 8x A100
40 GB: 875 TF32, 2175 AMP. FP32 at 128 images per GPU, AMP at 256: to match NVIDIA's AMP batch,
`--config.data.global_batch_size=8192 --config.data.max_per_replica_batch_size=256` (the LR follows:
3.2; 8k is the largest batch at which Goyal et al. saw no accuracy loss). No published figure covers
32 GPUs over a network: they should keep most of the single-node per-GPU rate, and `tools/sweep.py`
measures the scaling efficiency on your cluster.
"""

from tfscale.config import gpu_variant
from tfscale.configs import r50_1gpu


VARIANTS = ("xla", "amp", "amp_bf16")  # GPU_VARIANTS by name, for --help (which reads this file's text)


def get_config(variant=None):
    c = r50_1gpu.imagenet_resnet50()
    c.model.zero_init_residual = True
    c.data.global_batch_size = 4096  # 32 GPUs x 128 -> lr 1.6
    c.data.max_per_replica_batch_size = 128
    c.optim.name = "sgd"
    c.schedule.warmup = "gradual"
    c.schedule.warmup_epochs = 5.0
    c.schedule.warmup_init_lr = 0.1
    c.distribute.backend = "mwms"
    return gpu_variant(c, variant, "r50_32gpu")
