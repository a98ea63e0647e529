"""Cluster setup: the only module that builds a tf.distribute strategy, imports horovod or reads cluster environment.

`setup(cfg.distribute) -> Cluster` returns everything the rest of tfscale needs to know about the
topology (rank, size, replicas, chief), the strategy to run steps with, and the few collectives the
loop uses. Rank checks elsewhere go through `Cluster.is_chief`, so there is one definition of "the
process that writes files". The collectives differ by backend; the Cluster hands them to one of the
two implementations in `tfscale.collectives` (tf.distribute strategies, Horovod).

Multi-worker jobs (`mwms`, MultiWorkerMirroredStrategy) take their cluster from, in order:
an explicit TF_CONFIG; the Slurm step the task belongs to (SLURM_PROCID and the step's
SLURM_STEP_NODELIST / SLURM_STEP_TASKS_PER_NODE / SLURM_STEP_NUM_TASKS before the job's, ports from
`distribute.port_base` or the job and step ids; parsed in `tfscale.slurm_env`); `python -m
tfscale.launch`, which writes a TF_CONFIG.
Users' top complaint about MWMS is jobs that hang, so setup never waits unboundedly:
  * a watchdog process names the workers that did not answer and kills the worker (exit 137) when
    the cluster is not up within `connect_timeout_s` (TensorFlow itself would wait forever);
  * a pre-flight all-reduce proves every worker answers before any real work;
  * TensorFlow's coordination service declares a worker dead after `heartbeat_timeout_s` without a
    heartbeat, and the others then fail their next collective instead of waiting. Setting that
    timeout takes a private TensorFlow API; where it is missing, setup warns and TensorFlow's default
    heartbeat timeout applies.

`horovod` runs one rank per process on one device (a OneDeviceStrategy, so the loop's code is the
same), launched by horovodrun / mpirun / srun --mpi=pmix / `tfscale.launch --backend=horovod`.
Its collectives average gradients, sum metrics across ranks, broadcast the chief's variables and
shard the input by rank. Gloo's rendezvous timeout (`connect_timeout_s`) bounds the wait for
missing ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import socket
import subprocess
import sys

from typing import Any, Callable

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import local_sgd, logs
from tfscale.collectives import Collectives, HorovodCollectives, InputFn, StrategyCollectives
from tfscale.config import BACKENDS, HOROVOD_INSTALL_HINT
# The Slurm side of reading the environment; re-exported, as callers know them as `distribute.<name>`.
from tfscale.slurm_env import (CONCURRENT_SLURM_STEPS, PORTS_PER_SLURM_STEP, SLURM_PORT_RANGE,  # noqa: F401
                               expand_hostlist, expand_tasks_per_node, slurm_num_tasks, slurm_port_base,
                               slurm_tf_config)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What one process knows about the job it is part of, and the collectives its steps use.

    Everything after `is_chief` differs by backend and is delegated: see `tfscale.collectives`.
    """

    backend: str
    strategy: tf.distribute.Strategy
    rank: int  # this worker's index, 0..size-1
    size: int  # number of worker processes
    local_rank: int  # index among the workers on this host
    num_replicas: int  # model replicas over all workers (one per device)
    host: str
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

    def gradients_for_apply(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """What to hand to `optimizer.apply_gradients` (call inside a replica step).

        Horovod: the ranks' average. tf.distribute: `grads` unchanged (Keras' `apply_gradients` sums
        them across replicas itself).
        """
        return self._collectives.gradients_for_apply(grads)

    def standalone_gradient_all_reduce(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """The cross-replica gradient reduction of a training step, as an op of its own (inside a replica step).

        tf.distribute: the replica-context SUM that Keras' `apply_gradients` performs; Horovod: the
        same average as `gradients_for_apply`. The benchmark times it alone.
        """
        return self._collectives.standalone_gradient_all_reduce(grads)

    def agree_on_finite(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """`grads`, made non-finite on every replica when any replica's are (call inside a replica step).

        For float16 loss scaling: Keras checks gradients for inf/NaN replica by replica, so without
        this one worker could skip a step while another applies it (and waits in its all-reduce).
        tf.distribute: one extra scalar all-reduce; Horovod: `grads` unchanged (already averaged).
        """
        return self._collectives.agree_on_finite(grads)

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
        """Sums a per-process value over all processes (a strategy's `reduce` already did for MWMS)."""
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


def setup(dist_cfg: ml_collections.ConfigDict, env: dict | None = None) -> Cluster:
    """Builds the strategy for `dist_cfg.backend`, checks the cluster answers, logs the topology."""
    env = dict(os.environ if env is None else env)
    if dist_cfg.backend == "one_device":
        cluster = _strategy_cluster(dist_cfg, _one_device_strategy(), env)
    elif dist_cfg.backend == "mirrored":
        cluster = _strategy_cluster(dist_cfg, _mirrored_strategy(dist_cfg), env)
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
                      tf_config: dict | None = None) -> Cluster:
    """A tf.distribute job: one worker, or the workers of `tf_config`."""
    return Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=tf_config["task"]["index"] if tf_config else 0,
        size=len(tf_config["cluster"]["worker"]) if tf_config else 1,
        local_rank=local_rank_from_env(env),
        num_replicas=strategy.num_replicas_in_sync,
        host=socket.gethostname(),
        _collectives=StrategyCollectives(strategy, dist_cfg.device_prefetch_batches,
                                         household_size=_household_size(dist_cfg, strategy.num_replicas_in_sync)),
    )


def _household_size(dist_cfg: ml_collections.ConfigDict, num_replicas: int) -> int:
    """Replicas per household under local SGD with households (tfscale.local_sgd); 0 without them."""
    households = local_sgd.num_households(dist_cfg.households, num_replicas)
    if dist_cfg.sync != "local_sgd" or num_replicas % households:
        return 0
    return num_replicas // households


def _multi_worker_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    tf_config = _resolve_tf_config(dist_cfg, env)
    strategy = _multi_worker_strategy(dist_cfg, tf_config, local_rank_from_env(env))
    return _strategy_cluster(dist_cfg, strategy, env, tf_config)


def _horovod_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    hvd = _init_horovod(dist_cfg, env)
    strategy = _one_device_strategy()
    return Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=hvd.rank(),
        size=hvd.size(),
        local_rank=hvd.local_rank(),
        num_replicas=hvd.size(),
        host=socket.gethostname(),
        _collectives=HorovodCollectives(hvd, strategy, fp16_allreduce=dist_cfg.horovod_fp16_allreduce,
                                        device_prefetch_batches=dist_cfg.device_prefetch_batches,
                                        household=_horovod_household(hvd, dist_cfg)),
    )


def _horovod_household(hvd, dist_cfg: ml_collections.ConfigDict):
    """This rank's household as a Horovod process set (every rank registers all of them, in order), or None."""
    size = _household_size(dist_cfg, hvd.size())
    if size <= 1 or size == hvd.size():  # every rank alone (no household all-reduce), or all ranks
        return None
    households = [hvd.add_process_set(list(range(first, first + size))) for first in range(0, hvd.size(), size)]
    return households[hvd.rank() // size]


def _topology_line(cluster: Cluster) -> str:
    devices = ",".join(cluster.strategy.extended.worker_devices)
    return (
        f"tfscale worker rank={cluster.rank}/{cluster.size} local_rank={cluster.local_rank} host={cluster.host} "
        f"backend={cluster.backend} replicas={cluster.num_replicas} devices={devices}"
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


# --- hang protection -------------------------------------------------------------------------------


# Runs in its own small process: while TensorFlow connects the cluster, the main thread sits in C++
# holding the GIL, so no Python thread of ours could run (or even exit) until it returns.
_WATCHDOG_SOURCE = r"""
import os, select, signal, socket, sys
timeout_s, parent_pid, own_index = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
addresses = sys.argv[4:]
ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
if ready:  # the parent finished connecting (closed the pipe) or died (EOF too)
    sys.exit(0)
silent = []
for index, address in enumerate(addresses):
    if index == own_index:
        continue
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except OSError as err:
        silent.append(f"worker {index} at {address} ({err.strerror or err})")
print(
    f"tfscale pre-flight: the cluster did not come up within distribute.connect_timeout_s={timeout_s:g}s; "
    f"no answer from: {'; '.join(silent) or '(every port answers: a worker may be stuck or misconfigured)'}. "
    "Check TF_CONFIG / the Slurm allocation and that every worker started. Stopping this worker.",
    file=sys.stderr, flush=True,
)
os.kill(parent_pid, signal.SIGKILL)
"""


def _start_watchdog(timeout_s: float, addresses, own_index: int) -> subprocess.Popen:
    """A watchdog process that names silent workers and kills this one if connecting takes too long.

    Close its stdin (`_stop_watchdog`) once the cluster is up.
    """
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG_SOURCE, str(timeout_s), str(os.getpid()), str(own_index), *addresses],
        stdin=subprocess.PIPE,
    )


def _stop_watchdog(watchdog: subprocess.Popen) -> None:
    watchdog.stdin.close()
    watchdog.wait()


# Where TensorFlow keeps the coordination service's protobufs: TF 2.21's own context.py imports them
# from the first; older releases had the second. Setting the heartbeat timeout takes private
# TensorFlow API (no public one does), so `_coordination_service_api` checks it is there.
_COORDINATION_CONFIG_MODULES = (
    "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
    "tensorflow.tsl.protobuf.coordination_config_pb2",
)


def _coordination_service_api() -> tuple[Callable[..., None], type]:
    """This TensorFlow's (context().configure_coordination_service, CoordinatedJob protobuf), or a
    LookupError saying which is missing."""
    from tensorflow.python.eager import context

    configure = getattr(context.context(), "configure_coordination_service", None)
    if configure is None:
        raise LookupError("tensorflow.python.eager.context.context() has no configure_coordination_service")
    for name in _COORDINATION_CONFIG_MODULES:
        try:
            return configure, importlib.import_module(name).CoordinatedJob
        except (ImportError, AttributeError):
            continue
    raise LookupError(f"no CoordinatedJob protobuf in {' or '.join(_COORDINATION_CONFIG_MODULES)}")


def _configure_coordination_service(tf_config: dict, heartbeat_timeout_s: float) -> bool:
    """Sets the dead-worker detection time before MWMS would configure the service with defaults.

    This is the private call MultiWorkerMirroredStrategy makes itself (it skips its own when a
    service is configured). Where this TensorFlow lacks it: a warning (once per process), False, and
    MWMS configures the service itself with TensorFlow's default heartbeat timeout.
    """
    num_workers = len(tf_config["cluster"]["worker"])
    try:
        configure, coordinated_job = _coordination_service_api()
        configure(
            service_type="standalone",
            service_leader="/job:worker/replica:0/task:0",
            heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
            coordinated_jobs=[coordinated_job(name="worker", num_tasks=num_workers)],
        )
        return True
    except (LookupError, TypeError) as err:  # TypeError: another signature, or another protobuf class than context's
        _warn_default_heartbeat(str(err))
        return False


@functools.lru_cache(maxsize=None)  # once per process (and reason): every MWMS setup would repeat it
def _warn_default_heartbeat(reason: str) -> None:
    logging.warning(
        "TensorFlow %s does not offer the private coordination-service API tfscale sets the heartbeat "
        "timeout with (%s): dead-worker detection uses TensorFlow's default heartbeat timeout "
        "(distribute.heartbeat_timeout_s is not applied)", tf.__version__, reason,
    )


def _communication_options(dist_cfg: ml_collections.ConfigDict) -> tf.distribute.experimental.CommunicationOptions:
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, dist_cfg.collective_impl)
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=dist_cfg.pack_bytes,
        timeout_seconds=dist_cfg.collective_timeout_s or None,
        implementation=implementation,
    )


def preflight_all_reduce(strategy: tf.distribute.Strategy) -> None:
    """Every replica contributes 1; anything but the replica count means the cluster is broken."""

    @tf.function
    def count_replicas():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

    total = float(count_replicas())
    if total != strategy.num_replicas_in_sync:
        raise RuntimeError(f"pre-flight all-reduce counted {total} replicas, expected {strategy.num_replicas_in_sync}")


# --- Horovod --------------------------------------------------------------------------------------


def import_horovod():
    """horovod.tensorflow, or an error that says how to get a working one."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ImportError(f"distribute.backend=horovod but Horovod is not installed: {HOROVOD_INSTALL_HINT}") from err
    except tf.errors.NotFoundError as err:  # its C++ ops do not load into this TensorFlow
        raise ImportError(
            f"Horovod was built against another TensorFlow than {tf.__version__} ({err}); {HOROVOD_INSTALL_HINT}"
        ) from err
    return hvd


def _horovod_environment(dist_cfg: ml_collections.ConfigDict, env: dict) -> dict[str, str]:
    """Horovod's knobs from the config; hvd.init() reads them from the environment."""
    knobs = {}
    if dist_cfg.horovod_fusion_bytes:
        knobs["HOROVOD_FUSION_THRESHOLD"] = str(dist_cfg.horovod_fusion_bytes)
    if dist_cfg.horovod_cycle_time_ms:
        knobs["HOROVOD_CYCLE_TIME"] = f"{dist_cfg.horovod_cycle_time_ms:g}"
    if "HOROVOD_GLOO_TIMEOUT_SECONDS" not in env:
        # Gloo's rendezvous waits this long for every rank, then fails instead of hanging.
        knobs["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(max(1, int(dist_cfg.connect_timeout_s)))
    return knobs


def _wants_process_sets(dist_cfg: ml_collections.ConfigDict) -> bool:
    return dist_cfg.sync == "local_sgd" and dist_cfg.households > 1


def preflight_horovod(hvd) -> None:
    """Every rank contributes 1; anything but the rank count means the job is broken."""
    total = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="tfscale_preflight"))
    if total != hvd.size():
        raise RuntimeError(f"pre-flight all-reduce counted {total} Horovod ranks, expected {hvd.size()}")


# Where a launcher says how many ranks it started, first match wins: horovodrun / tfscale.launch,
# mpirun (also inside a Slurm job, whose SLURM_* the ranks inherit), an srun step.
_LAUNCHER_SIZE_KEYS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def check_horovod_size(size: int, env: dict, controller: str) -> None:
    """Fails when Horovod sees fewer ranks than the launcher started.

    The silent way Horovod breaks under a cluster launcher: `srun -n 2` of a Gloo-only Horovod (or
    of an MPI one without `--mpi=pmix`) gives every task a job of its own (rank 0 of 1), and each
    would train alone and write the same checkpoints.
    """
    found = next(((key, env[key]) for key in _LAUNCHER_SIZE_KEYS if key in env), None)
    if found is None or int(found[1]) == size:
        return
    key, value = found
    hint = ("Horovod was built without MPI (`horovodrun --check-build`): install OpenMPI (mpicc on PATH), "
            "rerun `make horovod`" if controller != "MPI" else
            "start the ranks with `srun --mpi=pmix` (the MPI plugin of this Slurm that OpenMPI speaks)")
    raise RuntimeError(f"{key}={value} processes were started but Horovod ({controller} controller) sees {size} "
                       f"rank(s): they would each train alone. {hint}; or use horovodrun --gloo "
                       "(slurm/horovod.sbatch LAUNCHER=horovodrun-gloo)")


def _init_horovod(dist_cfg: ml_collections.ConfigDict, env: dict) -> Any:
    """horovod.tensorflow, initialised with the config's knobs, this rank's GPU pinned and every rank answering."""
    hvd = import_horovod()
    knobs = _horovod_environment(dist_cfg, env)
    os.environ.update(knobs)
    timeout_s = knobs.get("HOROVOD_GLOO_TIMEOUT_SECONDS", env.get("HOROVOD_GLOO_TIMEOUT_SECONDS"))
    if timeout_s and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:  # a Gloo launcher (horovodrun --gloo, tfscale.launch)
        # Gloo aborts the process (SIGABRT) naming the missing rank numbers; this line says why.
        logging.info("horovod: waiting up to %s s for every rank at the rendezvous (distribute.connect_timeout_s)", timeout_s)
    if _wants_process_sets(dist_cfg):
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # households are registered once every rank is known
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    controller = "MPI" if hvd.mpi_enabled() else "Gloo"
    check_horovod_size(hvd.size(), env, controller)
    if hvd.rank() == 0:
        logging.info("horovod: %d ranks, %s controller", hvd.size(), controller)
    _pin_gpu(hvd.local_rank())
    preflight_horovod(hvd)
    return hvd


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


def _pin_gpu(local_rank: int) -> None:
    """One GPU per worker process, chosen by local rank (when the scheduler left several visible)."""
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) > 1:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)


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


def _multi_worker_strategy(dist_cfg, tf_config: dict | None, local_rank: int) -> tf.distribute.Strategy:
    if tf_config is None:  # not in a cluster: a one-worker MWMS job, handy for testing the path
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=_communication_options(dist_cfg))
    os.environ["TF_CONFIG"] = json.dumps(tf_config)  # what TFConfigClusterResolver reads
    _pin_gpu(local_rank)
    addresses = tf_config["cluster"]["worker"]
    watchdog = _start_watchdog(dist_cfg.connect_timeout_s, addresses, tf_config["task"]["index"])
    try:
        _configure_coordination_service(tf_config, dist_cfg.heartbeat_timeout_s)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=_communication_options(dist_cfg))
        preflight_all_reduce(strategy)
    finally:
        _stop_watchdog(watchdog)
    return strategy

