"""How a run's step is compiled and sends its gradients, decided once the cluster is up: `jit_compile=auto`,
`optim.compiled_update=auto` and `distribute.pack_bytes=auto` become values (logged, and recorded in config.json
by the chief), and the combinations the replicas cannot run are refused before anything is written.
"""

from __future__ import annotations

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import errors
from tfscale.cluster import distribute
from tfscale.config import step_modes
from tfscale.config.names import PACK_AUTO
from tfscale.planning import plan_workload


def resolve_compilation(cfg: ml_collections.ConfigDict, worker_devices) -> str | None:
    """`jit_compile="auto"` and `optim.compiled_update="auto"` decided for this worker's replicas
    (tfscale.config.step_modes); returns why XLA is on or off for the forward and backward pass."""
    on_gpus = all(tf.DeviceSpec.from_string(device).device_type == "GPU" for device in worker_devices)
    return step_modes.resolve(cfg, on_gpus=on_gpus)


def resolve_pack_bytes(cfg: ml_collections.ConfigDict, cluster: distribute.Cluster) -> None:
    """`distribute.pack_bytes=auto` decided for this job's size (tfscale.planning.plan_workload.auto_pack_bytes), in the config
    (config.json records it) and in the cluster's gradient buckets; one start-up line says what and why."""
    if cfg.distribute.pack_bytes != PACK_AUTO:
        return
    size, why = plan_workload.auto_pack_bytes(cfg, cluster.num_replicas)
    cfg.distribute.pack_bytes = size
    cluster.set_bucket_bytes(size)
    logging.info("config.distribute.pack_bytes=auto -> %d: %s", size, why)


def check_xla_sync_bn_devices(cfg: ml_collections.ConfigDict, worker_devices) -> None:
    """Synchronized BatchNorm inside an XLA-compiled step needs GPU replicas (config refuses it for mwms).

    MirroredStrategy all-reduces inside XLA without a merge_call only when every device is a GPU
    (tensorflow/python/distribute/mirrored_strategy.py `_use_merge_call`); on CPU devices the step
    fails at trace time with "`merge_call` called while defining a new graph" (measured).
    """
    replicas = list(worker_devices)
    if not (cfg.model.sync_bn and cfg.jit_compile and len(replicas) > 1):
        return
    if not all(tf.DeviceSpec.from_string(device).device_type == "GPU" for device in replicas):
        raise errors.ConfigError(
            f"config.model.sync_bn=True with config.jit_compile=True on replicas {', '.join(replicas)}: synchronized "
            "BatchNorm can all-reduce inside an XLA-compiled step only between GPUs. Set config.jit_compile=False "
            "or config.model.sync_bn=False")
