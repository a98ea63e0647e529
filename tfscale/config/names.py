"""The names every layer may read: the accepted values of each config key and the hints said when an
optional part is missing. Pure Python with no tfscale imports, so it sits at the bottom of the house:
config validation, the data wings, the cluster and the launcher all read it without importing
TensorFlow or each other. The modules that implement each choice dispatch on the same names
(tests/test_config.py checks that the copies equal the implementing modules' names).
"""


# Above this global batch plain SGD loses accuracy even with warmup (Goyal et al. 2017: 8k is the
# limit of linear scaling); LARS is what carries ResNet-50 past it.
LARGE_BATCH_WITHOUT_LARS = 8192

# How to make what `data.dataset='tfrecord'` reads; said wherever shards are missing.
CONVERT_HINT = (
    "make shards from an image folder with `tfscale-convert --input_dir=DIR --output_dir=SHARDS --split=train` "
    "(and --split=validation), then pass --config.data.data_dir=SHARDS; for speed tests without data, "
    "--config.data.dataset=synthetic"
)
# Stored-label offsets by dataset (data.label_offset=-1): ImageNet-layout shards keep 0 for "background",
# TFDS ClassLabel features are 0-based.
AUTO_LABEL_OFFSET = {"tfrecord": 1, "tfds": 0, "synthetic": 0, "synthetic_learnable": 0}
SYNTHETIC_DATASETS = ("synthetic", "synthetic_learnable")

# ImageNet-1k's class and example counts: base_config's defaults for data.num_classes, num_train_examples and
# num_eval_examples, the values a recipe leaves for the data to replace (tfscale.data.input.info.adopt).
IMAGENET_1K_COUNTS = {"num_classes": 1000, "num_train_examples": 1_281_167, "num_eval_examples": 50_000}

DATASETS = ("synthetic", "synthetic_learnable", "tfrecord", "tfds")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
JIT_AUTO = "auto"  # config.jit_compile's and optim.compiled_update's default, resolved by tfscale.config.step_modes
PACK_AUTO = "auto"  # config.distribute.pack_bytes from the plan, resolved by tfscale.planning.plan_workload.auto_pack_bytes
BACKENDS = ("one_device", "mirrored", "mwms", "horovod")
MODEL_NAMES = (  # the keys of tfscale.model.models.MODELS
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "cifar_resnet8", "cifar_resnet20", "cifar_resnet32", "cifar_resnet44", "cifar_resnet56", "cifar_resnet110",
)
OPTIMIZERS = ("sgd", "lars")  # tfscale.model.optim.OPTIMIZERS
AUGMENTS = ("imagenet", "cifar", "none")  # tfscale.data.input.preprocess.AUGMENTS
BATCH_AUGMENTS = ("none", "randaugment", "mixup", "cutmix")  # tfscale.data.input.batch_augment.BATCH_AUGMENTS
# Said wherever horovod is needed and missing (distribute.setup, the launcher).
HOROVOD_INSTALL_HINT = "build it against this TensorFlow with `make horovod` (tools/install_horovod.sh; README 'Horovod')"
BENCHMARK_MODES = ("train", "synthetic", "input", "allreduce")
LOADERS = ("tfdata", "dali")
SHUFFLES = ("index", "buffer")  # data.shuffle
DALI_DECODES = ("auto", "mixed", "cpu")
# Said wherever data.loader=dali finds no DALI (validation.validate, the DALI loader).
DALI_INSTALL_HINT = ("install NVIDIA DALI and its TensorFlow plugin with `make dali` (pip install 'tfscale[dali]', then "
                     "the plugin built against this TensorFlow; docs/data.md 'DALI'), or use config.data.loader='tfdata'")

# data.assignment / data.assignment_level (tfscale.data.input.assignment implements them).
ASSIGNMENT_SCHEMES = ("disjoint", "full", "coarse", "medium_coarse", "fine_grained", "overlap")
ASSIGNMENT_LEVELS = ("auto", "file", "example")
# distribute.sync (tfscale.training.local_sgd).
SYNC_MODES = ("gradients", "local_sgd")
# schedule.warmup, schedule.warmup_granularity, schedule.decay (tfscale.model.schedules).
WARMUPS = ("none", "gradual", "stepping", "horovod")
WARMUP_GRANULARITIES = ("auto", "step", "epoch")  # auto: gradual per step, stepping per epoch
DECAYS = ("constant", "step", "cosine", "polynomial", "exponential")

__all__ = [
    "LARGE_BATCH_WITHOUT_LARS",
    "CONVERT_HINT",
    "AUTO_LABEL_OFFSET",
    "SYNTHETIC_DATASETS",
    "IMAGENET_1K_COUNTS",
    "DATASETS",
    "PRECISIONS",
    "BACKENDS",
    "MODEL_NAMES",
    "OPTIMIZERS",
    "AUGMENTS",
    "BATCH_AUGMENTS",
    "HOROVOD_INSTALL_HINT",
    "BENCHMARK_MODES",
    "LOADERS",
    "SHUFFLES",
    "DALI_DECODES",
    "DALI_INSTALL_HINT",
    "ASSIGNMENT_SCHEMES",
    "ASSIGNMENT_LEVELS",
    "SYNC_MODES",
    "WARMUPS",
    "WARMUP_GRANULARITIES",
    "DECAYS",
]
