"""Validation of a config (tfscale.config.schema): `validate(cfg, num_replicas)` turns every mistake
tfscale can foresee into a `ConfigError` naming the key, its value and what to set instead, before a
step runs or anything is written. No TensorFlow here: the CLIs and make_sbatch validate before
starting anything heavy.
"""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections
from absl import logging

from tfscale.config import rules, step_modes
from tfscale.config.derived import eval_global_batch_size, profile_window
from tfscale.config.names import (ASSIGNMENT_LEVELS, ASSIGNMENT_SCHEMES, AUGMENTS, AUTO_LABEL_OFFSET, BACKENDS,
                                  BATCH_AUGMENTS, BENCHMARK_MODES, CONVERT_HINT, DALI_DECODES, DALI_INSTALL_HINT,
                                  DATASETS, LARGE_BATCH_WITHOUT_LARS, PACK_AUTO, LOADERS, MODEL_NAMES, OPTIMIZERS,
                                  PRECISIONS, SHUFFLES, SYNTHETIC_DATASETS)
from tfscale.errors import ConfigError


def _require_choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"config.{key}={value!r} is not one of: {', '.join(sorted(choices))}")


def _check_model_name(name: str) -> None:
    """The forms config.model.name takes (tfscale.model.build resolves the foreign ones once Keras is loaded)."""
    if name in MODEL_NAMES or name.startswith("keras.applications.") or ":" in name:
        return
    raise ConfigError(f"config.model.name={name!r} is not one of tfscale's models ({', '.join(MODEL_NAMES)}), "
                      "keras.applications.<Name>, package.module:function or path/to/file.py:function")


def _require_positive(cfg: ml_collections.ConfigDict, keys) -> None:
    for key in keys:
        value = _get(cfg, key)
        if not value > 0:
            raise ConfigError(f"config.{key} must be > 0, got {value!r}")


def _get(cfg: ml_collections.ConfigDict, dotted_key: str):
    node = cfg
    for part in dotted_key.split("."):
        node = node[part]
    return node


def _require_divisible(key: str, batch_size: int, num_replicas: int) -> None:
    if batch_size % num_replicas:
        raise ConfigError(
            f"config.{key}={batch_size} cannot be split evenly over {num_replicas} replicas "
            f"(nearest valid sizes: {batch_size // num_replicas * num_replicas} or "
            f"{(batch_size // num_replicas + 1) * num_replicas})"
        )


def _check_bn_groups(cfg: ml_collections.ConfigDict, num_replicas: int) -> None:
    """Ghost BatchNorm's groups must tile each replica's batch (and its micro-batches)."""
    group = cfg.model.bn_group_size
    if not group:
        return
    if cfg.model.sync_bn:
        raise ConfigError(f"config.model.bn_group_size={group} with config.model.sync_bn=True: statistics over groups "
                          "of a replica's batch and over all replicas exclude each other; set one of them")
    micro_batch = cfg.data.global_batch_size // num_replicas // cfg.optim.grad_accum_steps
    if group < 0 or micro_batch % group:
        raise ConfigError(f"config.model.bn_group_size={group} does not divide the batch each replica computes "
                          f"at once ({micro_batch}: config.data.global_batch_size={cfg.data.global_batch_size} over "
                          f"{num_replicas} replicas and {cfg.optim.grad_accum_steps} micro-batches)")


def _check_micro_batch(cfg: ml_collections.ConfigDict, num_replicas: int) -> None:
    """Each replica's batch must split into `optim.grad_accum_steps` equal micro-batches."""
    per_replica, micro_batches = cfg.data.global_batch_size // num_replicas, cfg.optim.grad_accum_steps
    if per_replica % micro_batches:
        raise ConfigError(
            f"config.optim.grad_accum_steps={micro_batches} does not divide the per-replica batch {per_replica} "
            f"(config.data.global_batch_size={cfg.data.global_batch_size} over {num_replicas} replicas)"
        )


def validate(cfg: ml_collections.ConfigDict, num_replicas: int | None = None) -> None:
    """Raises ValueError naming the offending key and value; returns None for a usable config.

    `num_replicas=None` checks what does not depend on the cluster (before one is waited for); with
    the replica count it also checks the batch split. Resolves `data.label_offset=-1` in place.
    """
    _check_model_name(cfg.model.name)
    _require_choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _require_choice("data.dataset", cfg.data.dataset, DATASETS)
    _require_choice("data.augment", cfg.data.augment, AUGMENTS)
    _require_choice("data.batch_augment", cfg.data.batch_augment, BATCH_AUGMENTS)
    _require_choice("data.assignment", cfg.data.assignment, ASSIGNMENT_SCHEMES)
    _require_choice("data.assignment_level", cfg.data.assignment_level, ASSIGNMENT_LEVELS)
    _require_choice("data.shuffle", cfg.data.shuffle, SHUFFLES)
    if cfg.data.copies < 1:
        raise ConfigError(f"config.data.copies must be >= 1, got {cfg.data.copies}")
    try:
        rules.check_local_sgd(cfg, num_replicas)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _require_choice("precision", cfg.precision, PRECISIONS)
    _require_choice("distribute.backend", cfg.distribute.backend, BACKENDS)
    _require_choice("benchmark.mode", cfg.benchmark.mode, BENCHMARK_MODES)
    _require_choice("model.data_format", cfg.model.data_format, ("channels_first", "channels_last"))
    _require_choice("distribute.collective_impl", cfg.distribute.collective_impl, ("AUTO", "NCCL", "RING"))
    _require_positive(cfg, (
        "data.image_size", "data.num_classes", "data.num_train_examples", "data.num_eval_examples",
        "data.global_batch_size", "data.shuffle_buffer", "data.interleave_cycle", "optim.lr",
        "train.epochs", "train.log_every_steps", "train.eval_every_epochs", "train.steps_per_loop",
        "optim.grad_accum_steps", "distribute.device_prefetch_batches", "checkpoint.every_epochs", "checkpoint.max_to_keep", "distribute.num_cpu_devices",
        "distribute.connect_timeout_s", "distribute.heartbeat_timeout_s", "resume.lock_stale_after_s",
        "benchmark.num_batches", "benchmark.display_every", "benchmark.rounds", "benchmark.breakdown_batches",
    ))
    if cfg.data.global_batch_size > cfg.data.num_train_examples:
        raise ConfigError(
            f"config.data.global_batch_size={cfg.data.global_batch_size} exceeds "
            f"config.data.num_train_examples={cfg.data.num_train_examples}: not one full step per epoch"
        )
    _check_data_source(cfg.data)
    _check_loader(cfg.data)
    if cfg.data.ram_budget_mb and not cfg.data.autotune:
        raise ConfigError(f"config.data.ram_budget_mb={cfg.data.ram_budget_mb} budgets tf.data's autotuner, which is off: "
                          "add --config.data.autotune=True, or drop ram_budget_mb")
    if not 0.0 < cfg.data.eval_crop_fraction <= 1.0:
        raise ConfigError(f"config.data.eval_crop_fraction must be in (0, 1], got {cfg.data.eval_crop_fraction}")
    init_path = cfg.model.init_from
    # A checkpoint prefix (W/checkpoints/ckpt-60) is not a file itself; its .index file is.
    if init_path and not any(os.path.exists(init_path + suffix) for suffix in ("", ".index")):
        raise ConfigError(
            f"config.model.init_from={init_path!r} does not exist (expected a tfscale workdir, a checkpoint "
            "prefix, a .keras or a .weights.h5 file)"
        )
    if cfg.model.sync_bn and cfg.distribute.backend == "horovod":
        raise ConfigError(
            "config.model.sync_bn=True needs a tf.distribute backend (mirrored, mwms): Keras' "
            "synchronized BatchNormalization cannot see other Horovod ranks. Set config.model.sync_bn=False "
            "(each rank normalises over its own batch, as in Horovod's ResNet examples)"
        )
    step_modes.check_auto_or_bool("jit_compile", cfg.jit_compile)
    step_modes.check_auto_or_bool("optim.compiled_update", cfg.optim.compiled_update)
    _check_xla_sync_bn(cfg)
    _check_horovod_fp16(cfg)
    pack = cfg.distribute.pack_bytes
    if not (pack == PACK_AUTO or (isinstance(pack, int) and not isinstance(pack, bool) and pack >= 0)):
        raise ConfigError(f"config.distribute.pack_bytes must be >= 0 (0: one message after the backward pass) or "
                          f"{PACK_AUTO!r}, got {pack!r}")
    if bucket_warning(cfg):
        logging.warning("%s", bucket_warning(cfg))
    eval_batch = eval_global_batch_size(cfg.data)
    if eval_batch <= 0:
        raise ConfigError(f"config.data.eval_global_batch_size must be > 0 or -1, got {eval_batch}")
    if not 0.0 <= cfg.optim.ema_decay < 1.0:
        raise ConfigError(f"config.optim.ema_decay must be in [0, 1) (0: off), got {cfg.optim.ema_decay}")
    if cfg.optim.clip_global_norm < 0.0:
        raise ConfigError(f"config.optim.clip_global_norm must be >= 0 (0: off), got {cfg.optim.clip_global_norm}")
    if not 0.0 <= cfg.optim.label_smoothing < 1.0:
        raise ConfigError(f"config.optim.label_smoothing must be in [0, 1) (0: off), got {cfg.optim.label_smoothing}")
    if num_replicas is not None:
        _require_divisible("data.global_batch_size", cfg.data.global_batch_size, num_replicas)
        _check_micro_batch(cfg, num_replicas)
        _check_bn_groups(cfg, num_replicas)
        _require_divisible("data.eval_global_batch_size", eval_batch, num_replicas)
        _check_per_replica_batch(cfg.data, num_replicas, cfg.optim.grad_accum_steps)
    _fill_decay_epochs(cfg.schedule, cfg.train.epochs)
    try:
        rules.check_schedule(cfg.schedule, total_epochs=cfg.train.epochs)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    profile_window(cfg.profile_steps)  # raises on a malformed window
    _check_allreduce_sizes(cfg.benchmark)
    if cfg.benchmark.num_warmup_batches < 0:
        raise ConfigError(f"config.benchmark.num_warmup_batches must be >= 0, got {cfg.benchmark.num_warmup_batches}")
    if cfg.data.global_batch_size > LARGE_BATCH_WITHOUT_LARS and cfg.optim.name != "lars":
        logging.warning(
            "config.data.global_batch_size=%d exceeds %d with config.optim.name=%r: expect an accuracy "
            "loss; large-batch recipes use LARS (see configs/r50_lars_32k.py)",
            cfg.data.global_batch_size, LARGE_BATCH_WITHOUT_LARS, cfg.optim.name,
        )


def bucket_warning(cfg: ml_collections.ConfigDict) -> str | None:
    """Why `distribute.pack_bytes` buckets cannot overlap the backward pass in this config (None: they can, or
    there are none). The planner predicts no overlap for such a config either."""
    pack = step_modes.fixed_pack_bytes(cfg.distribute)
    if pack <= 0:
        return None
    if cfg.jit_compile is True:  # auto is decided at start, and buckets turn it off (step_modes.xla_conflict)
        return (f"config.distribute.pack_bytes={pack} with config.jit_compile=True: XLA computes every gradient at "
                "once, so no bucket goes out before the backward pass ends and the buckets only add all-reduces; "
                "set pack_bytes=0 (one message) or jit_compile=False")
    if cfg.model.sync_bn and cfg.distribute.backend in ("mwms", "mirrored"):
        return (f"config.distribute.pack_bytes={pack} with config.model.sync_bn=True under "
                f"{cfg.distribute.backend}: the strategy runs a step's collectives in the order they were traced, so "
                "the first bucket waits for the backward pass's synchronized BatchNorm all-reduces and nothing "
                "overlaps (traced on CPU workers: the first bucket left 12 ms before the backward pass ended, against "
                "115 ms before it without sync_bn); set model.sync_bn=False or pack_bytes=0")
    return None


def decay_boundaries(schedule_cfg: ml_collections.ConfigDict, train_epochs: float) -> tuple[float, ...]:
    """The step decay's boundaries in absolute epochs: `schedule.decay_epochs`, or when that is () the
    `schedule.decay_fractions` of `train_epochs` (rounded to 1e-4 epochs: steps are coarser)."""
    if tuple(schedule_cfg.decay_epochs) or not tuple(schedule_cfg.decay_fractions):
        return tuple(schedule_cfg.decay_epochs)
    fractions = tuple(schedule_cfg.decay_fractions)
    if not all(0.0 < f <= 1.0 for f in fractions):
        raise ConfigError(f"config.schedule.decay_fractions={fractions} must lie in (0, 1]: fractions of config.train.epochs")
    return tuple(round(f * train_epochs, 4) for f in fractions)


def _fill_decay_epochs(schedule_cfg: ml_collections.ConfigDict, train_epochs: float) -> None:
    """Writes the boundaries `decay_fractions` give into `decay_epochs` (once: config.json records them), logged.

    A recipe written as fractions keeps its shape when `--config.train.epochs` shortens or lengthens it.
    """
    boundaries = decay_boundaries(schedule_cfg, train_epochs)
    if boundaries == tuple(schedule_cfg.decay_epochs):
        return
    schedule_cfg.decay_epochs = boundaries
    logging.info("config.schedule.decay_epochs=%s: config.schedule.decay_fractions %s of config.train.epochs=%g",
                 boundaries, tuple(round(f, 4) for f in schedule_cfg.decay_fractions), train_epochs)


def _check_allreduce_sizes(bench_cfg: ml_collections.ConfigDict) -> None:
    low, high, factor = bench_cfg.allreduce_min_bytes, bench_cfg.allreduce_max_bytes, bench_cfg.allreduce_factor
    if not 4 <= low <= high or factor < 2:
        raise ConfigError(
            f"config.benchmark.allreduce_min_bytes={low}, allreduce_max_bytes={high}, allreduce_factor={factor}: "
            "need 4 <= min <= max (bytes of float32 per replica) and a factor >= 2")


def _check_xla_sync_bn(cfg: ml_collections.ConfigDict) -> None:
    """Synchronized BatchNorm all-reduces in the forward pass, i.e. inside the XLA-compiled function.

    Under MultiWorkerMirroredStrategy that is a cross-worker collective inside XLA, which TensorFlow
    does not support (tensorflow#58961; on CPU: "Collectives are not yet implemented for CPU devices
    when compiling with XLA", measured with 2 workers).
    """
    if cfg.model.sync_bn and cfg.jit_compile is True and cfg.distribute.backend == "mwms":
        raise ConfigError(
            "config.model.sync_bn=True with config.jit_compile=True under config.distribute.backend='mwms': "
            "synchronized BatchNorm would all-reduce across workers inside the XLA-compiled step, which "
            "TensorFlow does not support. Set config.jit_compile=False (keep exact global-batch statistics) or "
            "config.model.sync_bn=False (per-replica statistics, as NVIDIA's and Model Garden's ResNet-50 runs)"
        )


def _check_horovod_fp16(cfg: ml_collections.ConfigDict) -> None:
    """float16 on the wire only for loss-scaled float16 gradients (the others underflow in float16)."""
    if cfg.distribute.horovod_fp16_allreduce and cfg.precision != "mixed_float16":
        raise ConfigError(
            f"config.distribute.horovod_fp16_allreduce=True with config.precision={cfg.precision!r}: only "
            "mixed_float16 gradients are loss-scaled, others below float16's 6e-8 would reach the all-reduce as 0. "
            "Use config.precision='mixed_float16', or config.distribute.horovod_fp16_allreduce=False"
        )


def _check_data_source(data_cfg: ml_collections.ConfigDict) -> None:
    """The dataset and the keys that say where it is must agree; fills data.label_offset=-1."""
    dataset = data_cfg.dataset
    if dataset in SYNTHETIC_DATASETS:
        for key in ("data_dir", "stage_dir", "tfds_name"):
            if data_cfg[key]:
                raise ConfigError(
                    f"config.data.{key}={data_cfg[key]!r} is set but config.data.dataset={dataset!r} reads no "
                    f"files: drop the {key} override, or set config.data.dataset='tfrecord' (or 'tfds') to train on it"
                )
    elif not data_cfg.data_dir:
        what = "TFRecord shards" if dataset == "tfrecord" else "a prepared TFDS data_dir"
        hint = CONVERT_HINT if dataset == "tfrecord" else "prepare it with `tfds build` where the data is"
        raise ConfigError(f"config.data.dataset={dataset!r} needs config.data.data_dir ({what}): {hint}")
    elif "://" not in data_cfg.data_dir and not os.path.isdir(data_cfg.data_dir):
        hint = CONVERT_HINT if dataset == "tfrecord" else "prepare it with `tfds build` where the data is"
        raise ConfigError(f"config.data.data_dir={data_cfg.data_dir!r} is not a directory: {hint}")
    if dataset == "tfds":
        if not data_cfg.tfds_name:
            raise ConfigError("config.data.dataset='tfds' needs config.data.tfds_name (e.g. imagenet2012)")
        if data_cfg.stage_dir:
            raise ConfigError(
                f"config.data.stage_dir={data_cfg.stage_dir!r} stages TFRecord shards; with "
                "config.data.dataset='tfds' copy the TFDS data_dir yourself and point data_dir at the copy"
            )
    elif data_cfg.tfds_name:
        raise ConfigError(
            f"config.data.tfds_name={data_cfg.tfds_name!r} is set but config.data.dataset={dataset!r}: "
            "set config.data.dataset='tfds' to read it, or drop tfds_name"
        )
    if data_cfg.label_offset == -1:
        data_cfg.label_offset = AUTO_LABEL_OFFSET[dataset]
    if data_cfg.label_offset < 0:
        raise ConfigError(f"config.data.label_offset must be >= 0 (or -1: automatic), got {data_cfg.label_offset}")
    if dataset == "tfds" and data_cfg.label_offset != 0:
        raise ConfigError(
            f"config.data.label_offset={data_cfg.label_offset} with config.data.dataset='tfds': TFDS class labels "
            "are 0-based (ClassLabel), so any offset makes class 0 negative; use 0 (or -1: automatic)"
        )


def _check_loader(data_cfg: ml_collections.ConfigDict) -> None:
    """data.loader=dali: DALI is installed and the data options are ones its pipeline implements."""
    _require_choice("data.loader", data_cfg.loader, LOADERS)
    _require_choice("data.dali_decode", data_cfg.dali_decode, DALI_DECODES)
    if data_cfg.dali_threads < 0:
        raise ConfigError(f"config.data.dali_threads must be >= 0 (0: the cores available), got {data_cfg.dali_threads}")
    if data_cfg.loader != "dali":
        return
    refused = {  # key: (value the DALI pipeline needs, why)
        "dataset": ("tfrecord", "DALI reads TFRecord shards"),
        "batch_augment": ("none", "batch augmentations are Keras layers in tf.data"),
        "skip_corrupt_images": (False, "DALI stops on an image it cannot decode"),
    }
    for key, (needed, why) in refused.items():
        if data_cfg[key] != needed:
            raise ConfigError(f"config.data.{key}={data_cfg[key]!r} does not work with config.data.loader='dali' "
                              f"({why}): use {key}={needed!r} or config.data.loader='tfdata'")
    if data_cfg.augment == "cifar":
        raise ConfigError("config.data.augment='cifar' is not implemented by config.data.loader='dali' (imagenet and "
                          "none are): use config.data.loader='tfdata' for CIFAR-style pad-and-crop")
    missing = [name for name in ("nvidia.dali", "nvidia.dali.plugin.tf") if not _module_found(name)]
    if missing:
        raise ConfigError(f"config.data.loader='dali' but {missing[0]} is not installed: {DALI_INSTALL_HINT}")


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def _check_per_replica_batch(data_cfg: ml_collections.ConfigDict, num_replicas: int, micro_batches: int) -> None:
    """A recipe run on fewer replicas than it was written for would put its whole batch on each."""
    limit = data_cfg.max_per_replica_batch_size
    per_replica = data_cfg.global_batch_size // num_replicas
    if limit and per_replica // micro_batches > limit:
        written_for = math.ceil(data_cfg.global_batch_size / limit)
        raise ConfigError(
            f"this run has {num_replicas} replica(s), so each would take {per_replica // micro_batches} images at once "
            f"(config.data.global_batch_size={data_cfg.global_batch_size} / {num_replicas} replicas / "
            f"{micro_batches} micro-batches); the recipe was written for {written_for} replicas of "
            f"config.data.max_per_replica_batch_size={limit}. Run it on {written_for} replicas, or keep its result "
            f"with --config.optim.grad_accum_steps={math.ceil(per_replica / limit)} (gradient accumulation), or "
            f"scale it to this run with --config.data.global_batch_size={limit * num_replicas} (the LR follows "
            "linearly), or raise config.data.max_per_replica_batch_size if your devices hold more"
        )
