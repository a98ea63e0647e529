"""A tfscale config as the planner sees it: its Workload (the model's layers, batch, the backend's all-reduces), a
System by name or JSON file, and the bucket size `distribute.pack_bytes=auto` takes for a job (`auto_pack_bytes`,
which the run calls at start and tfscale-plan prints). No TensorFlow until a config's model is built.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

from tfscale.config import validation
from tfscale.planning.plan_model import System, Workload, best_bucket_bytes, keras_update_ops


def load_system(path: str, **overrides) -> System:
    """A System from a JSON file of its fields (docs/scaling.md shows one), with `overrides` applied."""
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--system={path}: {err}") from None
    unknown = set(fields) - {f.name for f in dataclasses.fields(System)}
    if unknown:
        raise ValueError(f"--system={path}: unknown field(s) {', '.join(sorted(unknown))}")
    fields.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    try:
        return dataclasses.replace(System(**fields), **overrides)
    except TypeError as err:
        raise ValueError(f"--system={path}: {err}") from None


def workload_from_config(cfg, per_gpu_batch: int | None = None, layers=None, batchnorm_bytes: int = 0,
                         num_variables: int | None = None) -> Workload:
    """The Workload a tfscale config runs: its model's layers, batch, and the backend's all-reduces."""
    if layers is None:
        layers, batchnorm_bytes, num_variables = model_layers(cfg)
    backend = cfg.distribute.backend
    # The step sends its gradients in buckets of pack_bytes, each as soon as it is full (both backends), unless
    # XLA computes every gradient at once (jit_compile) or pack_bytes=0 makes one message after the backward
    # pass, or MWMS with synchronized BatchNorm holds the first bucket until the backward pass's BatchNorm
    # all-reduces have run (config.validation.bucket_warning). Horovod fuses a message up to
    # HOROVOD_FUSION_THRESHOLD (128 MiB by default).
    bucketed = bool(cfg.distribute.pack_bytes) and not validation.bucket_warning(cfg)
    fusion = cfg.distribute.pack_bytes or ((cfg.distribute.horovod_fusion_bytes or 128 << 20) if backend == "horovod" else 0)
    return Workload(
        model=cfg.model.name,
        per_gpu_batch=per_gpu_batch or cfg.data.max_per_replica_batch_size or cfg.data.global_batch_size,
        layers=tuple(layers), algorithm="nccl", overlap="buckets" if bucketed else "none", fusion_bytes=fusion,
        wire_factor=0.5 if backend == "horovod" and cfg.distribute.horovod_fp16_allreduce else 1.0,
        # After its last step, engine's loop sums its steps' losses and the stop flag (float32 each) and
        # averages BatchNorm's moving statistics (unless synchronized BatchNorm made them equal).
        loop_collectives=(4 * (cfg.train.steps_per_loop + 1), *(() if cfg.model.sync_bn else (batchnorm_bytes,))),
        steps_per_loop=cfg.train.steps_per_loop,
        num_train_examples=cfg.data.num_train_examples, epochs=cfg.train.epochs,
        num_eval_examples=cfg.data.num_eval_examples, eval_every_epochs=cfg.train.eval_every_epochs,
        checkpoint_every_epochs=cfg.checkpoint.every_epochs, async_checkpoint=cfg.checkpoint.async_save,
        state_bytes=state_bytes(cfg, sum(size for size, _ in layers), batchnorm_bytes),
        num_variables=num_variables or len(layers),
        update_ops=0 if cfg.optim.compiled_update else keras_update_ops(cfg.precision, num_variables or len(layers)))


def state_bytes(cfg, gradient_bytes: int, batchnorm_bytes: int) -> int:
    """A checkpoint's bytes: the weights, one momentum slot each (SGD and LARS), their EMA, BatchNorm's statistics."""
    copies = 2 + (1 if cfg.optim.get("ema_decay", 0.0) else 0)
    return copies * gradient_bytes + batchnorm_bytes


def model_layers(cfg) -> tuple[list[tuple[int, int]], int, int]:
    """(gradient bytes, forward FLOPs) of each layer with trainable weights of the config's model, forward order,
    the bytes of its non-trainable float weights (BatchNorm's moving statistics) and its trainable variables."""
    import numpy as np

    from tfscale.model import build, stats  # Keras, only when a config's model is planned

    model = build.create_from_config(cfg)
    frozen = sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in model.non_trainable_weights)
    return stats.layer_costs(model), int(frozen), len(model.trainable_variables)


def auto_pack_bytes(cfg, num_gpus: int, per_gpu_batch: int | None = None) -> tuple[int, str]:
    """`distribute.pack_bytes=auto` for a job of `num_gpus` replicas of `per_gpu_batch` images (default: the
    global batch split over them): (bytes, why), the bucket size of `bucket_advice` for `distribute.plan_system`,
    or 0 (one message) where buckets cannot help."""
    if cfg.jit_compile:
        return 0, "jit_compile=True: no gradient leaves an XLA call before the backward pass ends, so one message"
    if num_gpus < 2:
        return 0, "one replica: nothing to all-reduce"
    if not cfg.distribute.plan_system:
        return 0, ("no config.distribute.plan_system to plan buckets for (a system of tfscale-plan --system, or its "
                   "JSON file), so one message")
    unbucketed = copy.deepcopy(cfg)
    unbucketed.distribute.pack_bytes = 0
    workload = workload_from_config(unbucketed, per_gpu_batch=per_gpu_batch or cfg.data.global_batch_size // num_gpus)
    system = resolve_system(cfg.distribute.plan_system, workload.model, workload.per_gpu_batch)
    if system.gpu_images_per_sec <= 0:
        return 0, (f"{system.name} has no one-GPU rate for {workload.model} at {workload.per_gpu_batch} per GPU "
                   "(give gpu_images_per_sec in its JSON file), so one message")
    size, exposed_s = best_bucket_bytes(workload, system, num_gpus)
    unbucketed.distribute.pack_bytes = size
    reason = validation.bucket_warning(unbucketed)
    if reason:
        return 0, f"buckets of {size} bytes could not overlap: {reason}"
    return size, (f"tfscale-plan's bucket for {system.name} at {num_gpus} GPUs, {exposed_s * 1e3:.1f} ms of all-reduce "
                  "left exposed a step")


def resolve_system(name_or_path: str, model: str, per_gpu_batch: int) -> System:
    """A published system by name (calibrated; its one-GPU rate when a published series matches the model and
    batch), or a JSON file."""
    from tfscale.planning import plan_published

    if name_or_path in plan_published.REFERENCE_SYSTEMS:
        return plan_published.REFERENCE_SYSTEMS[name_or_path]
    if name_or_path in plan_published.SYSTEMS:
        system = plan_published.calibrated_systems()[name_or_path]
        series = [s for s in plan_published.SERIES if (s.system, s.model, s.per_gpu_batch) ==
                  (name_or_path, model, per_gpu_batch)]
        if series:
            one = series[0].one_gpu or dict(series[0].images_per_sec)[1]
            system = dataclasses.replace(system, gpu_images_per_sec=one, sources={
                **system.sources, "gpu_images_per_sec": series[0].source})
        return system
    if not os.path.isfile(name_or_path):
        known = [*plan_published.SYSTEMS, *plan_published.REFERENCE_SYSTEMS]
        raise ValueError(f"--system={name_or_path!r} is neither a file nor one of: {', '.join(known)}")
    return load_system(name_or_path)
