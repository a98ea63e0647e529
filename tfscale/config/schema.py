"""The one place that knows every configuration key tfscale reads.

`base_config()` holds every key with its default and a one-line comment; config files in `configs/`
start from it and change what their recipe needs. Derived values are linked, never copied:
`optim.lr` is `optim.lr_per_256 * data.global_batch_size / 256` (the linear scaling rule of
Goyal et al. 2017), so `--config.data.global_batch_size=512` rescales the LR and `print(config)`
shows it. Durations are written in epochs (floats) and turned into steps only by
`tfscale.config.derived.to_steps`. `gpu_variant` gives the ResNet-50 recipes their GPU variants.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from tfscale.config.names import IMAGENET_1K_COUNTS, JIT_AUTO
from tfscale.errors import ConfigError


def base_config() -> ml_collections.ConfigDict:
    """Every key tfscale reads, with its default. Recipes in configs/ override a subset."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds weight init, synthetic data and shuffling; same seed -> same run
    c.precision = "float32"  # float32 | mixed_float16 (GPU, loss-scaled) | mixed_bfloat16 (TPU/Ampere+, CPU)
    # XLA-compile each replica's forward + backward pass: auto (as Keras' compile: XLA unless the config asks
    # for something XLA cannot run; decided at start, logged, recorded in config.json) | True | False
    c.jit_compile = ml_collections.FieldReference(JIT_AUTO, field_type=object)
    c.profile_steps = ""  # "START,END": TensorFlow profiler trace of those global steps into tensorboard/

    c.model = ml_collections.ConfigDict()
    # tfscale's ResNet (tfscale.model.models.MODELS), keras.applications.<Name>, or your builder:
    # package.module:function or path/to/file.py:function (tfscale.model.build; docs/training.md)
    c.model.name = "resnet50"
    c.model.options = ml_collections.ConfigDict()  # keyword arguments of a keras.applications model or your builder
    # None: the model's own. tfscale's ResNets: True (Goyal et al.), 0.9, 1e-5; other models keep their BatchNorm's.
    c.model.zero_init_residual = config_dict.placeholder(bool)  # ResNets: last BN gamma of each residual block at 0
    c.model.bn_momentum = config_dict.placeholder(float)  # Keras BatchNormalization momentum (moving-average decay)
    c.model.bn_epsilon = config_dict.placeholder(float)  # BatchNormalization epsilon
    c.model.sync_bn = False  # BatchNorm statistics over all replicas (exact N x b == 1 x N*b; costs an all-reduce)
    c.model.bn_group_size = 0  # >0: BatchNorm statistics over groups of this many examples of each replica's batch
    c.model.data_format = "channels_last"  # channels_first can be faster on some GPUs; CPUs need last
    c.model.init_from = ""  # start from these weights: a tfscale workdir/checkpoint, .keras or .weights.h5 ("" = random)
    c.model.init_skip_head = False  # init_from: re-initialise the classifier (fine-tuning to another num_classes)

    c.data = ml_collections.ConfigDict()
    c.data.dataset = "tfrecord"  # tfrecord (shards, data_dir) | tfds | synthetic (random, like tf_cnn_benchmarks) | synthetic_learnable
    c.data.data_dir = ""  # TFRecord shard directory (tfrecord) or local TFDS data_dir (tfds; never downloads); required for both
    c.data.loader = "tfdata"  # tfdata | dali (NVIDIA DALI, optional: `make dali`): what reads, decodes and augments tfrecord shards (docs/data.md)
    c.data.dali_decode = "auto"  # dali: where JPEGs are decoded: auto (mixed with a GPU, else cpu) | mixed (GPU, nvJPEG) | cpu
    c.data.dali_threads = 0  # dali: CPU threads of each worker's pipeline; 0: the cores this process may use
    c.data.dali_index_dir = ""  # dali: the shards' index files; "": data_dir/dali-index (written there when missing)
    c.data.stage_dir = ""  # copy shards here first (node-local SSD, e.g. $TMPDIR); "" reads in place
    c.data.tfds_name = ""  # TFDS dataset name, e.g. imagenet2012 (dataset=tfds)
    c.data.train_split = "train"  # shard file prefix (train-00000-of-01024) or TFDS split
    c.data.eval_split = "validation"  # shard file prefix or TFDS split
    c.data.label_offset = -1  # subtracted from stored labels; -1 follows the dataset: 1 for TFRecord shards (ImageNet layout, 0 unused), 0 for TFDS
    c.data.augment = "imagenet"  # imagenet (random-resized crop + flip) | cifar (pad 4, crop, flip) | none
    c.data.eval_crop_fraction = 0.875  # imagenet eval: central crop of the shorter side, then resize
    c.data.batch_augment = "none"  # none | randaugment | mixup | cutmix (Keras core layers, in tf.data)
    c.data.randaugment_ops = 2  # RandAugment: operations per image
    c.data.randaugment_factor = 0.5  # RandAugment: magnitude in [0, 1]
    c.data.mixup_alpha = 0.2  # MixUp: Beta(alpha, alpha) mixing
    c.data.cutmix_factor = 1.0  # CutMix: Beta parameter of the box size
    c.data.shuffle = "index"  # index: a new permutation of the worker's records every pass, read by offset | buffer: a window of shuffle_buffer records
    c.data.shuffle_buffer = 10_000  # records held for shuffling, per worker (data.shuffle='buffer', DALI, and shards without an index)
    c.data.interleave_cycle = 16  # shards read in parallel, per worker
    c.data.deterministic = False  # True: reproducible order at some speed cost
    c.data.cache = False  # cache decoded-ready records in RAM (small datasets only)
    c.data.skip_corrupt_images = False  # True: training drops records whose image does not decode and counts them; False: stop naming the record (eval always stops)
    c.data.private_threads = 0  # tf.data private thread pool size; 0: share TensorFlow's
    # tf.data's autotuner (AUTOTUNE sized by a model thread); False: AUTOTUNE is the pool size, at most 16
    # per map. Off by default: under tf.distribute ending an input waits up to the tuner's period (docs/data.md).
    c.data.autotune = False
    c.data.ram_budget_mb = 0  # tf.data autotune RAM budget (needs data.autotune); 0: TensorFlow's default
    c.data.assignment = "disjoint"  # disjoint | full | coarse | medium_coarse | fine_grained | overlap: which data each worker reads (docs/data.md)
    c.data.copies = 2  # C, workers reading each example (coarse, medium_coarse, fine_grained, overlap; 1 = disjoint, M = full)
    c.data.assignment_level = "auto"  # what the scheme assigns: auto (files, or examples when fewer files than workers) | file | example
    c.data.image_size = 224  # square training/eval resolution in pixels
    # The three counts default to ImageNet-1k's (IMAGENET_1K_COUNTS). Where the data say otherwise (a
    # tfscale-convert manifest, TFDS's dataset info), a default is replaced by the data's count and logged;
    # any other value, or one given on the command line, must match the data (docs/configuration.md).
    c.data.num_classes = IMAGENET_1K_COUNTS["num_classes"]  # classes the model predicts
    c.data.num_train_examples = IMAGENET_1K_COUNTS["num_train_examples"]  # examples per training epoch
    c.data.num_eval_examples = IMAGENET_1K_COUNTS["num_eval_examples"]  # examples in one full evaluation
    c.data.global_batch_size = 256  # images per step summed over all replicas
    c.data.max_per_replica_batch_size = 0  # recipes: the per-replica batch they were written for; larger is refused (0: no limit)
    # Not a linked field: assigning to a linked field would overwrite the train batch it points at.
    c.data.eval_global_batch_size = -1  # images per eval step; -1: same as global_batch_size
    c.data.synthetic_noise = 0.35  # synthetic_learnable: pixel noise relative to the class pattern

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "sgd"  # sgd | lars
    c.optim.lr_per_256 = 0.1  # LR for a global batch of 256; scaled linearly with the batch
    c.optim.lr = c.optim.get_ref("lr_per_256") * c.data.get_ref("global_batch_size") / 256  # linked
    c.optim.momentum = 0.9  # heavy-ball momentum
    c.optim.nesterov = False  # Nesterov momentum
    c.optim.weight_decay = 1e-4  # L2 on conv/dense kernels only (BN and biases are not decayed)
    c.optim.label_smoothing = 0.0  # cross-entropy targets (1 - s) * one_hot + s / num_classes; 0.1 in the large-batch LARS recipes
    # The update (finite check, unscaling, clipping, momentum/LARS, EMA) as one XLA-compiled function per replica:
    # auto (on GPU replicas, where it saves ~1,800 kernel launches a ResNet-50 step; off on CPU ones) | True | False
    c.optim.compiled_update = ml_collections.FieldReference(JIT_AUTO, field_type=object)
    c.optim.clip_global_norm = 0.0  # clip the all-reduced (averaged) gradients to this global L2 norm before the update (0: off)
    c.optim.lars_eta = 0.001  # LARS trust coefficient
    c.optim.lars_epsilon = 0.0  # LARS denominator epsilon
    c.optim.grad_accum_steps = 1  # micro-batches per optimizer update (global batch stays data.global_batch_size)
    c.optim.ema_decay = 0.0  # exponential moving average of the weights for eval/export (0: off; e.g. 0.9999)

    c.schedule = ml_collections.ConfigDict()
    c.schedule.warmup = "gradual"  # none | gradual | stepping | horovod (lr/size -> lr)
    c.schedule.warmup_epochs = 5.0  # warmup length (Goyal et al.: 5)
    c.schedule.warmup_init_lr = 0.0  # gradual warmup starts here
    c.schedule.warmup_granularity = "auto"  # when the warmup LR changes: step | epoch | auto (gradual per step, stepping per epoch)
    c.schedule.decay = "step"  # constant | step | cosine | polynomial | exponential
    c.schedule.decay_epochs = (30, 60, 80)  # step decay boundaries, absolute epochs; () with decay_fractions: from those
    c.schedule.decay_fractions = ()  # step decay boundaries as fractions of train.epochs, used when decay_epochs is ()
    c.schedule.decay_factor = 0.1  # step: LR multiplier per boundary; exponential: per period
    c.schedule.exp_decay_every_epochs = 2.4  # exponential: period in epochs
    c.schedule.poly_power = 2.0  # polynomial: exponent (MLPerf LARS recipe uses 2)
    c.schedule.end_lr = 0.0  # cosine/polynomial: final LR

    c.train = ml_collections.ConfigDict()
    c.train.epochs = 90.0  # training length in epochs (may be fractional)
    c.train.log_every_steps = 100  # chief prints and appends to metrics.jsonl this often
    c.train.steps_per_loop = 100  # steps inside one tf.function between host syncs (cut at log/eval/checkpoint steps)
    c.train.eval_every_epochs = 1.0  # evaluate this often (and always at the end)
    c.train.eval_steps = -1  # -1: the whole eval set once; >0: cap for quick checks
    c.train.progress_every_s = 30.0  # an eval that runs longer says how far it is this often (batches, eta)
    c.train.overlap_epochs = False  # True: train.epochs counts data passes; run ceil(epochs/C) passes of each worker's C*N/M examples

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_epochs = 1.0  # save this often (and at the end)
    c.checkpoint.max_to_keep = 3  # older checkpoints are deleted
    c.checkpoint.async_save = True  # training goes on while a checkpoint is written (from a host copy of the state)

    c.resume = ml_collections.ConfigDict()
    c.resume.allow_config_changes = False  # True: resume even when result-changing keys differ from config.json (recorded in config_history.jsonl)
    c.resume.lock_stale_after_s = 120.0  # another host's workdir lock not refreshed this long is a dead job's: taken over

    c.distribute = ml_collections.ConfigDict()
    c.distribute.backend = "one_device"  # one_device | mirrored (all local GPUs) | mwms (MultiWorkerMirroredStrategy) | horovod
    c.distribute.num_cpu_devices = 1  # mirrored on a CPU host: split the CPU into this many devices
    c.distribute.log_all_ranks = False  # True: every worker logs progress; default: other workers print their topology line, warnings, errors
    c.distribute.connect_timeout_s = 300.0  # all workers must answer within this, else a message and exit
    c.distribute.heartbeat_timeout_s = 60.0  # a worker silent this long (hung, unreachable) ends the job: exit 69, one line
    c.distribute.collective_timeout_s = 0.0  # abort any single all-reduce after this long (0: no limit)
    c.distribute.collective_impl = "AUTO"  # AUTO (NCCL where the worker has a GPU, else rings) | RING | NCCL
    c.distribute.device_prefetch_batches = 2  # batches per replica copied to the GPU ahead of the step (tf.distribute InputOptions)
    # gradients all-reduced in buckets of this many bytes, the last layer's first, each sent while the backward pass
    # goes on (0: one message after it; auto: tfscale-plan's best size for distribute.plan_system at the job's size,
    # 0 under XLA, decided at start and logged)
    c.distribute.pack_bytes = ml_collections.FieldReference(0, field_type=object)
    c.distribute.plan_system = ""  # pack_bytes=auto plans for this: a system of tfscale-plan --system, or its JSON file
    c.distribute.port_base = 0  # Slurm without TF_CONFIG: first worker port on each node (0: derived from SLURM_JOB_ID and SLURM_STEP_ID)
    c.distribute.horovod_fusion_bytes = 0  # horovod: tensor-fusion buffer, HOROVOD_FUSION_THRESHOLD (0: 128 MiB)
    c.distribute.horovod_cycle_time_ms = 0.0  # horovod: wait to fuse tensors, HOROVOD_CYCLE_TIME (0: Horovod's)
    c.distribute.horovod_fp16_allreduce = False  # horovod + mixed_float16: send gradients as float16 (half the traffic; prescaled by 1/ranks)
    c.distribute.sync = "gradients"  # gradients (all-reduce every step) | local_sgd (local steps, weights averaged every sync_period)
    c.distribute.sync_period = 8  # local_sgd: L_W, steps between world syncs (one fused all-reduce of weights and slots)
    c.distribute.sync_slots = True  # local_sgd: average optimizer slots (momentum) with the weights at each world sync
    c.distribute.households = 0  # local_sgd: H groups of M/H workers averaging gradients inside (0: every worker alone)
    c.distribute.household_period = 1  # local_sgd: L_H, steps between averages inside a household (1: gradients every step)
    c.distribute.post_local_after_epochs = 0.0  # local_sgd: synchronous for these first epochs, local SGD after (post-local SGD)

    c.benchmark = ml_collections.ConfigDict()
    c.benchmark.mode = "train"  # train | synthetic | input | allreduce (message sizes + the model's gradients)
    c.benchmark.num_warmup_batches = 10  # steps excluded from the reported rate
    c.benchmark.num_batches = 100  # timed steps
    c.benchmark.display_every = 10  # print a step line this often
    c.benchmark.breakdown_batches = 20  # train/synthetic: steps timed for the forward+backward and all-reduce parts
    c.benchmark.image_dir = ""  # input mode: the same images as a JPEG class tree, for the Keras baseline
    c.benchmark.compare_keras_fit = False  # train mode, 1 process: also time Keras model.fit on the same model/data
    c.benchmark.rounds = 3  # side-by-side comparisons: interleaved rounds per candidate; the median is reported
    c.benchmark.allreduce_min_bytes = 1024  # allreduce: smallest message per replica (float32), as nccl-tests' -b
    c.benchmark.allreduce_max_bytes = 256 << 20  # allreduce: largest message per replica, as nccl-tests' -e
    c.benchmark.allreduce_factor = 4  # allreduce: each size is the previous times this, as nccl-tests' -f
    c.benchmark.with_allreduce = False  # synthetic/train: the all-reduce table too, after the timed steps (scaling sweeps)
    return c


# `--config=configs/r50_32gpu.py:amp`: the ResNet-50 recipes as GPU clusters run them (docs/gpu.md).
GPU_VARIANTS = {
    "xla": "float32",  # the published float32 recipe, XLA-compiled: what NVIDIA's FP32/TF32 figures ran
    "amp": "mixed_float16",  # V100-class and newer: float16 Tensor Cores, dynamic loss scaling
    "amp_bf16": "mixed_bfloat16",  # A100/H100: bfloat16 keeps float32's range, no loss scaling
}


def gpu_variant(c: ml_collections.ConfigDict, variant: str | None, recipe: str) -> ml_collections.ConfigDict:
    """`c` unchanged (float32, the recipe as published; XLA on GPU workers by `jit_compile=auto`) or its fast GPU
    variant (`GPU_VARIANTS`).

    The variant changes how each step runs, never what it computes on paper: global batch, LR
    schedule and epochs stay the recipe's. Its precision, XLA on the gradient step on every device
    (Keras 3's BatchNormalization is unfused without it), NHWC tensors (cuDNN's Tensor Core kernels want
    channels_last) and 100 steps per host sync. Nothing here depends on another key, so `--config.*`
    overrides, applied after the variant (e.g. the backend make_sbatch sets), cannot contradict it;
    NCCL is each worker's own choice at run time (`tfscale.cluster.devices.collective_implementation`).
    """
    if not variant:
        return c
    if variant not in GPU_VARIANTS:
        raise ConfigError(f"{recipe}:{variant} is not a variant of {recipe}: use one of "
                          f"{', '.join(GPU_VARIANTS)}, or no ':variant' for the float32 recipe")
    c.precision = GPU_VARIANTS[variant]
    c.jit_compile = True
    c.model.data_format = "channels_last"
    c.train.steps_per_loop = 100
    return c

