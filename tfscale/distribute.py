"""Cluster setup: the only module that builds a tf.distribute strategy or reads cluster environment.

`setup(cfg.distribute) -> Cluster` returns everything the rest of tfscale needs to know about the
topology (rank, size, replicas, chief) and the strategy to run steps with. Rank checks elsewhere go
through `Cluster.is_chief`, so there is one definition of "the process that writes files".
"""

from __future__ import annotations

import dataclasses
import socket

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale.config import BACKENDS


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What one process knows about the job it is part of."""

    backend: str
    strategy: tf.distribute.Strategy
    rank: int  # this worker's index, 0..size-1
    size: int  # number of worker processes
    local_rank: int  # index among the workers on this host
    num_replicas: int  # model replicas over all workers (one per device)
    host: str

    @property
    def is_chief(self) -> bool:
        """The chief writes workdir files and prints progress; the others stay quiet."""
        return self.rank == 0

    def topology_line(self) -> str:
        devices = ",".join(self.strategy.extended.worker_devices)
        return (
            f"tfscale worker rank={self.rank}/{self.size} local_rank={self.local_rank} host={self.host} "
            f"backend={self.backend} replicas={self.num_replicas} devices={devices}"
        )


def _split_cpu(num_devices: int) -> list[str]:
    """Splits the host CPU into logical devices so `mirrored` can be exercised without GPUs."""
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
    except RuntimeError as err:
        raise RuntimeError(
            f"distribute.num_cpu_devices={num_devices} must be set before TensorFlow initialises its "
            "devices; call distribute.setup() before running any TensorFlow op"
        ) from err
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _one_device_strategy() -> tf.distribute.Strategy:
    gpus = tf.config.list_logical_devices("GPU")
    return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")


def _mirrored_strategy(dist_cfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return tf.distribute.MirroredStrategy()
    devices = _split_cpu(dist_cfg.num_cpu_devices)
    # NCCL does not exist on CPU; the reduce-to-one-device path is exact and fine for a few devices.
    return tf.distribute.MirroredStrategy(
        devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def _multi_worker_strategy() -> tuple[tf.distribute.Strategy, int, int]:
    """MultiWorkerMirroredStrategy from TF_CONFIG (without one: a single-worker job); (strategy, rank, size)."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    workers = resolver.cluster_spec().as_dict().get("worker", [None])
    return strategy, int(resolver.task_id or 0), len(workers)


def setup(dist_cfg: ml_collections.ConfigDict) -> Cluster:
    """Builds the strategy for `dist_cfg.backend` and logs this worker's topology line."""
    rank, size = 0, 1
    if dist_cfg.backend == "one_device":
        strategy = _one_device_strategy()
    elif dist_cfg.backend == "mirrored":
        strategy = _mirrored_strategy(dist_cfg)
    elif dist_cfg.backend == "multi_worker":
        strategy, rank, size = _multi_worker_strategy()
    else:
        raise ValueError(f"config.distribute.backend={dist_cfg.backend!r} is not one of: {', '.join(BACKENDS)}")
    cluster = Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=rank,
        size=size,
        local_rank=0,
        num_replicas=strategy.num_replicas_in_sync,
        host=socket.gethostname(),
    )
    logging.info(cluster.topology_line())
    return cluster
