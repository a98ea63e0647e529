"""Cluster setup: the only module that builds a tf.distribute strategy or reads the cluster environment.

`setup(cfg.distribute) -> Cluster` returns everything the rest of tfscale needs to know about the
topology (rank, size, replicas, chief), the strategy to run steps with, and the few collectives the
loop uses. Rank checks elsewhere go through `Cluster.is_chief`, so there is one definition of "the
process that writes files". The collectives differ by backend; the Cluster hands them to one of the
two implementations in `tfscale.cluster.collectives` (tf.distribute strategies, Horovod).

Multi-worker jobs (`mwms`, MultiWorkerMirroredStrategy) take their cluster from, in order:
an explicit TF_CONFIG; the Slurm step the task belongs to (SLURM_PROCID and the step's
SLURM_STEP_NODELIST / SLURM_STEP_TASKS_PER_NODE / SLURM_STEP_NUM_TASKS before the job's, ports from
`distribute.port_base` or the job and step ids; parsed in `tfscale.cluster.slurm_env`); `python -m
tfscale.launch`, which writes a TF_CONFIG.
A multi-worker cluster connects through `tfscale.cluster.connect`, which never waits unboundedly (exit 69
with a line naming what is wrong); Horovod starts through `tfscale.cluster.horovod_start`.

`horovod` runs one rank per process on one device (a OneDeviceStrategy, so the loop's code is the
same), launched by horovodrun / mpirun / srun --mpi=pmix / `tfscale.launch --backend=horovod`.
Its collectives average gradients, sum metrics across ranks, broadcast the chief's variables and
shard the input by rank. Gloo's rendezvous timeout (`connect_timeout_s`) bounds the wait for
missing ranks: Gloo then aborts the process (SIGABRT, exit 134, not 69), naming the missing ranks (its
timeout throws, uncaught, in Horovod's C++ background thread).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import logs
from tfscale.cluster import connect, devices, horovod_start
from tfscale.cluster.collectives import Collectives, HorovodCollectives, InputFn, StrategyCollectives
# The Slurm side of reading the environment; re-exported, as callers know them as `distribute.<name>`.
from tfscale.cluster.slurm_env import (CONCURRENT_SLURM_STEPS, PORTS_PER_SLURM_STEP, SLURM_PORT_RANGE,  # noqa: F401
                                       expand_hostlist, expand_tasks_per_node, slurm_num_tasks, slurm_port_base,
                                       slurm_tf_config)
from tfscale.config import BACKENDS, step_modes
from tfscale.config.rules import num_households


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What one process knows about the job it is part of, and the collectives its steps use.

    Everything after `is_chief` differs by backend and is delegated: see `tfscale.cluster.collectives`.
    """

    backend: str
    strategy: tf.distribute.Strategy
    rank: int  # this worker's index, 0..size-1
    size: int  # number of worker processes
    local_rank: int  # index among the workers on this host
    num_replicas: int  # model replicas over all workers (one per device)
    host: str
    all_reduce: str  # how gradients are all-reduced across replicas, for the topology line (e.g. "NCCL")
    _collectives: Collectives = dataclasses.field(repr=False, compare=False)

    @property
    def is_chief(self) -> bool:
        """The chief writes workdir files and prints progress; the others stay quiet."""
        return self.rank == 0

    @property
    def saving_is_collective(self) -> bool:
        """True when every worker takes part in a checkpoint save (MWMS); a Horovod rank saves on its own."""
        return self._collectives.saving_is_collective

    def loss_batch_size(self, global_batch_size: int) -> int:
        """The batch one replica's loss is averaged over so that the reduced gradient is the global mean.

        tf.distribute sums replica gradients, so each divides by the global batch; Horovod averages
        rank gradients (hvd.Average), so each rank divides by its own batch.
        """
        return global_batch_size // self.size if self._collectives.averages_gradients else global_batch_size

    def set_bucket_bytes(self, bucket_bytes: int) -> None:
        """Gradients from now on in buckets of this many bytes (`distribute.pack_bytes=auto`, decided at start)."""
        self._collectives.bucket_bytes = bucket_bytes

    def reduce_gradients(self, grads: list[tf.Tensor | None]) -> list[tf.Tensor | None]:
        """The step's one gradient all-reduce (call inside a replica step): tf.distribute sums the replicas'
        gradients, Horovod averages the ranks' (`loss_batch_size` makes either the global-batch mean).

        Every replica gets the same values back, so what is decided on them afterwards (float16 loss
        scaling's skip of a step with inf/NaN, clipping by global norm) is decided alike everywhere,
        without a collective of its own. The optimizer applies them as they are (`optim.make_optimizer`).
        """
        with tf.name_scope("gradient_all_reduce"):  # the name profiles and step_timeline show
            return self._collectives.reduce_gradients(grads)

    def average_replica_state(self, variables) -> None:
        """Averages non-trainable model state (BatchNorm moving statistics) over all replicas.

        Call inside a replica step. Keras 3 variables under tf.distribute, like Horovod ranks, keep
        each replica's own moving statistics, so without this eval results and checkpoints would
        depend on which replica computed them.
        """
        floats = [v for v in variables if keras.backend.is_float_dtype(v.dtype)]
        if self.num_replicas == 1 or not floats:
            return
        values = [tf.identity(v.value) for v in floats]  # this replica's copy, read as a tensor
        for variable, average in zip(floats, self._collectives.mean_over_replicas(values)):
            variable.assign(average)

    def mean_over_replicas(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor averaged over every replica of the job, in one fused all-reduce (call inside a replica step)."""
        return self._collectives.mean_over_replicas(values)

    def mean_over_household(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor averaged over this replica's household (`distribute.households`; call inside a replica step)."""
        return self._collectives.mean_over_household(values)

    def sum_over_processes(self, tensor: tf.Tensor) -> tf.Tensor:
        """Sums a per-process value over all processes, in one all-reduce (call in a tf.function)."""
        return self._collectives.sum_over_processes(tensor)

    def gather_per_worker(self, values: list[float]) -> list[list[float]]:
        """Every worker's `values` (the same length on each), in rank order, returned on every worker.

        Eager; every worker must call it at the same point (it is a collective).
        """
        rows = np.zeros([self.size, len(values)])
        rows[self.rank] = values
        if self.size == 1:
            return rows.tolist()
        return self._collectives.sum_over_workers(rows).tolist()

    def broadcast_from_chief(self, variables) -> None:
        """Copies the chief's values into `variables` (Keras or TF variables) on every process."""
        self._collectives.broadcast_from_chief(variables)

    def distribute_dataset(self, input_fn: InputFn):
        """`input_fn`'s dataset for this process, sharded over all processes, placed on its devices."""
        return self._collectives.distribute_dataset(input_fn)


# --- setup ----------------------------------------------------------------------------------------


def setup(dist_cfg: ml_collections.ConfigDict, env: dict | None = None, allow_hidden_gpus: bool = False) -> Cluster:
    """Builds the strategy for `dist_cfg.backend`, checks the cluster answers, logs the topology.

    First refuses a node whose GPUs TensorFlow cannot see (`devices.require_visible_gpus`), before any worker
    connects; `allow_hidden_gpus` is the doctor's, which reports that itself.
    """
    env = dict(os.environ if env is None else env)
    if not allow_hidden_gpus:
        devices.require_visible_gpus(env)
    if dist_cfg.backend in ("one_device", "mirrored"):
        gpus = devices.prepare_gpus(local_rank=None)  # memory growth; this process uses every GPU it sees
        strategy = _one_device_strategy() if dist_cfg.backend == "one_device" else _mirrored_strategy(dist_cfg)
        cluster = _strategy_cluster(dist_cfg, strategy, env, num_gpus=len(gpus))
    elif dist_cfg.backend == "mwms":
        cluster = _multi_worker_cluster(dist_cfg, env)
    elif dist_cfg.backend == "horovod":
        cluster = _horovod_cluster(dist_cfg, env)
    else:
        raise ValueError(f"config.distribute.backend={dist_cfg.backend!r} is not one of: {', '.join(BACKENDS)}")
    logging.info(_topology_line(cluster))
    # One topology line per worker, then progress from the chief only (warnings and errors from all).
    logs.gate_workers(cluster.is_chief, log_all_ranks=dist_cfg.log_all_ranks)
    return cluster


def _strategy_cluster(dist_cfg: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, env: dict,
                      tf_config: dict | None = None, num_gpus: int = 0) -> Cluster:
    """A tf.distribute job: one worker, or the workers of `tf_config`."""
    implementation = devices.collective_implementation(dist_cfg.collective_impl, num_gpus)
    return Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=tf_config["task"]["index"] if tf_config else 0,
        size=len(tf_config["cluster"]["worker"]) if tf_config else 1,
        local_rank=local_rank_from_env(env),
        num_replicas=strategy.num_replicas_in_sync,
        host=socket.gethostname(),
        all_reduce=_strategy_all_reduce(dist_cfg.backend, strategy.num_replicas_in_sync, implementation),
        _collectives=StrategyCollectives(strategy, dist_cfg.device_prefetch_batches,
                                         bucket_bytes=step_modes.fixed_pack_bytes(dist_cfg),
                                         household_size=_household_size(dist_cfg, strategy.num_replicas_in_sync),
                                         communication_hint=devices.communication_hint(implementation)),
    )


def _strategy_all_reduce(backend: str, num_replicas: int, implementation: str) -> str:
    """What reduces gradients: MWMS's collective implementation, MirroredStrategy's cross-device op, or nothing."""
    if num_replicas == 1:
        return "none (one replica)"
    if backend == "mirrored":  # MirroredStrategy picks NcclAllReduce on GPUs itself; CPU devices get _mirrored_strategy's
        return "NCCL" if implementation == "NCCL" else "ReductionToOneDevice"
    return implementation if implementation != "AUTO" else "AUTO (TensorFlow's rings)"


def _household_size(dist_cfg: ml_collections.ConfigDict, num_replicas: int) -> int:
    """Replicas per household under local SGD with households (docs/local_sgd.md); 0 without them."""
    households = num_households(dist_cfg.households, num_replicas)
    if dist_cfg.sync != "local_sgd" or num_replicas % households:
        return 0
    return num_replicas // households


def _multi_worker_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    tf_config = _resolve_tf_config(dist_cfg, env)
    # One GPU per worker process in a cluster; a one-worker job (no cluster) mirrors over every local GPU.
    gpus = devices.prepare_gpus(local_rank_from_env(env) if tf_config else None, host=socket.gethostname())
    implementation = devices.collective_implementation(dist_cfg.collective_impl, len(gpus))
    strategy = connect.multi_worker_strategy(dist_cfg, tf_config, implementation)
    return _strategy_cluster(dist_cfg, strategy, env, tf_config, num_gpus=len(gpus))


def _horovod_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    hvd, num_gpus = horovod_start.init_horovod(dist_cfg, env)
    strategy = _one_device_strategy()
    return Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=hvd.rank(),
        size=hvd.size(),
        local_rank=hvd.local_rank(),
        num_replicas=hvd.size(),
        host=socket.gethostname(),
        all_reduce=_horovod_all_reduce(hvd, num_gpus, dist_cfg.horovod_fp16_allreduce),
        _collectives=HorovodCollectives(hvd, strategy, fp16_allreduce=dist_cfg.horovod_fp16_allreduce,
                                        bucket_bytes=step_modes.fixed_pack_bytes(dist_cfg),
                                        device_prefetch_batches=dist_cfg.device_prefetch_batches,
                                        household=_horovod_household(hvd, dist_cfg)),
    )


def _horovod_all_reduce(hvd, num_gpus: int, fp16: bool) -> str:
    """Horovod's all-reduce as this rank runs it: NCCL on its GPU, else MPI or Gloo on host memory."""
    if hvd.size() == 1:
        return "none (one replica)"
    if num_gpus and hvd.nccl_built():
        where = "NCCL"
    else:
        where = f"horovod {'MPI' if hvd.mpi_enabled() else 'Gloo'} (host memory)"
    return where + (", float16 on the wire" if fp16 else "")


def _horovod_household(hvd, dist_cfg: ml_collections.ConfigDict):
    """This rank's household as a Horovod process set (every rank registers all of them, in order), or None."""
    size = _household_size(dist_cfg, hvd.size())
    if size <= 1 or size == hvd.size():  # every rank alone (no household all-reduce), or all ranks
        return None
    households = [hvd.add_process_set(list(range(first, first + size))) for first in range(0, hvd.size(), size)]
    return households[hvd.rank() // size]


def _topology_line(cluster: Cluster) -> str:
    worker_devices = ",".join(cluster.strategy.extended.worker_devices)
    return (
        f"tfscale worker rank={cluster.rank}/{cluster.size} local_rank={cluster.local_rank} host={cluster.host} "
        f"backend={cluster.backend} replicas={cluster.num_replicas} devices={worker_devices} "
        f"all-reduce={cluster.all_reduce} cores={devices.describe_cores()}"
    )


# --- where the cluster comes from -----------------------------------------------------------------


def local_rank_from_env(env: dict) -> int:
    """This process's index on its host, from whichever launcher started it.

    SLURM_LOCALID counts the tasks of this process's srun step on its node: the right index for an
    `srun -n 2` in a larger allocation too.
    """
    for key in ("TFSCALE_LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK"):
        if key in env:
            return int(env[key])
    return 0


def _resolve_tf_config(dist_cfg: ml_collections.ConfigDict, env: dict) -> dict | None:
    """An explicit TF_CONFIG; else the Slurm step's cluster when it has several tasks; else None (one worker)."""
    if "TF_CONFIG" in env:
        return json.loads(env["TF_CONFIG"])
    if slurm_num_tasks(env) > 1 and "SLURM_PROCID" in env:
        if "SLURM_STEP_NUM_TASKS" not in env:
            # srun always sets the step's variables: this is likely the batch script itself, one process.
            logging.warning("no SLURM_STEP_* variables (not started by srun?): expecting the %s tasks of the whole "
                            "job to join; run the workers with srun", slurm_num_tasks(env))
        tf_config = slurm_tf_config(env, dist_cfg.port_base)
        if tf_config["task"]["index"] == 0:  # the same on every task: the chief says it once
            logging.info("tfscale cluster from Slurm job %s step %s: workers %s", env.get("SLURM_JOB_ID", "?"),
                         env.get("SLURM_STEP_ID", "?"), ",".join(tf_config["cluster"]["worker"]))
        return tf_config
    return None


# --- strategies ------------------------------------------------------------------------------------


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
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice())



