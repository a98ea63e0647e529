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
Users' top complaint about MWMS is jobs that hang, so setup never waits unboundedly. A cluster that
does not come up ends the worker with exit code 69 (`EXIT_CLUSTER_UNAVAILABLE`, sysexits'
EX_UNAVAILABLE; not 137, which `sacct` and users read as the out-of-memory killer) and an error line
that names what is wrong:
  * before connecting: a host name in the cluster spec that does not resolve, or this worker's own
    port already in use (a leftover process, a port given twice), fail at once;
  * a worker that never starts, or an address whose port nobody listens on: TensorFlow's coordination
    service (set through the private API below) gives up registering the cluster after
    `connect_timeout_s` (worker 0, its leader, then; the others about 5 s later: measured on
    TF 2.21), and setup names every worker whose port does not answer. A watchdog process is the
    backstop for what TensorFlow does not time out: after `connect_timeout_s` + WATCHDOG_GRACE_S it
    names the silent workers and has this worker exit 69 through a C-level signal handler (SIGKILL,
    137, only if even that fails);
  * a pre-flight all-reduce proves every worker answers before any real work (a failure is exit 69 too);
  * TensorFlow's coordination service declares a worker dead after `heartbeat_timeout_s` without a
    heartbeat, and the others then fail their next collective instead of waiting. Setting that
    timeout takes a private TensorFlow API; where it is missing, setup warns and TensorFlow's default
    heartbeat timeout applies.

`horovod` runs one rank per process on one device (a OneDeviceStrategy, so the loop's code is the
same), launched by horovodrun / mpirun / srun --mpi=pmix / `tfscale.launch --backend=horovod`.
Its collectives average gradients, sum metrics across ranks, broadcast the chief's variables and
shard the input by rank. Gloo's rendezvous timeout (`connect_timeout_s`) bounds the wait for
missing ranks: Gloo then aborts the process (SIGABRT, exit 134, not 69), naming the missing ranks (its
timeout throws, uncaught, in Horovod's C++ background thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import functools
import importlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys

from typing import Any, Callable

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import devices, local_sgd, logs
from tfscale.collectives import Collectives, HorovodCollectives, InputFn, StrategyCollectives
from tfscale.config import BACKENDS, HOROVOD_INSTALL_HINT
from tfscale.errors import EXIT_CLUSTER_UNAVAILABLE, ClusterUnavailable
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
    """Replicas per household under local SGD with households (tfscale.local_sgd); 0 without them."""
    households = local_sgd.num_households(dist_cfg.households, num_replicas)
    if dist_cfg.sync != "local_sgd" or num_replicas % households:
        return 0
    return num_replicas // households


def _multi_worker_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    tf_config = _resolve_tf_config(dist_cfg, env)
    # One GPU per worker process in a cluster; a one-worker job (no cluster) mirrors over every local GPU.
    gpus = devices.prepare_gpus(local_rank_from_env(env) if tf_config else None, host=socket.gethostname())
    implementation = devices.collective_implementation(dist_cfg.collective_impl, len(gpus))
    strategy = _multi_worker_strategy(dist_cfg, tf_config, implementation)
    return _strategy_cluster(dist_cfg, strategy, env, tf_config, num_gpus=len(gpus))


def _horovod_cluster(dist_cfg: ml_collections.ConfigDict, env: dict) -> Cluster:
    hvd, num_gpus = _init_horovod(dist_cfg, env)
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


# --- hang protection -------------------------------------------------------------------------------

# How much later than `connect_timeout_s` the watchdog steps in when TensorFlow times out the
# registration itself: the leader gives up at connect_timeout_s, the other workers about 5 s after it
# (measured, TF 2.21), and then setup still probes the peers (at most PROBE_TIMEOUT_S).
WATCHDOG_GRACE_S = 15.0
PROBE_TIMEOUT_S = 2.0  # a peer whose port takes no TCP connection within this does not answer
# The watchdog asks this worker to exit 69 with this signal, then SIGKILLs it after WATCHDOG_KILL_AFTER_S.
WATCHDOG_SIGNAL = signal.SIGUSR2
WATCHDOG_KILL_AFTER_S = 5.0


def _cluster_unavailable(message: str) -> ClusterUnavailable:
    message = f"tfscale pre-flight: {message}. Stopping this worker (exit code {EXIT_CLUSTER_UNAVAILABLE})."
    logging.error("%s", message)
    return ClusterUnavailable(message)


def _split_address(address: str) -> tuple[str, int]:
    """("host", port) of a cluster-spec address "host:port" ("[v6 literal]:port" too); ValueError if malformed."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


# The next two functions also run in the watchdog process (`_watchdog_source`): stdlib only, imports inside.
def _unanswered_peers(addresses, own_index, timeout_s):
    """Every other worker whose port takes no TCP connection, as "worker I at HOST:PORT (why)".

    The peers are probed in parallel, so a large cluster takes `timeout_s`, not one timeout per worker.
    """
    import concurrent.futures
    import socket

    def probe(index):
        host, _, port = addresses[index].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return None
        except (OSError, ValueError) as err:
            return f"worker {index} at {addresses[index]} ({getattr(err, 'strerror', None) or err})"

    others = [index for index in range(len(addresses)) if index != own_index]
    if not others:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, len(others))) as pool:
        return [silent for silent in pool.map(probe, others) if silent]


def _not_up_message(what, unanswered):
    answered = "(every port answers: a worker may be stuck, or its TF_CONFIG describes another cluster)"
    return (f"{what}; no answer from: {'; '.join(unanswered) or answered}. "
            "Check TF_CONFIG / the Slurm allocation and that every worker started")


_WATCHDOG_MAIN = r"""
import os, select, signal, sys
backstop_s, connect_timeout_s, probe_timeout_s, kill_after_s = (float(arg) for arg in sys.argv[1:5])
parent_pid, own_index, exit_signal, exit_code = (int(arg) for arg in sys.argv[5:9])
addresses = sys.argv[9:]
ready, _, _ = select.select([sys.stdin], [], [], backstop_s)
if ready:  # the parent finished connecting (closed the pipe) or died (EOF too)
    sys.exit(0)
what = (f"the cluster did not come up within distribute.connect_timeout_s={connect_timeout_s:g}s "
        f"(the watchdog stepped in after {backstop_s:g}s)")
print(f"tfscale pre-flight: {_not_up_message(what, _unanswered_peers(addresses, own_index, probe_timeout_s))}. "
      f"Stopping this worker (exit code {exit_code}).", file=sys.stderr, flush=True)
os.kill(parent_pid, exit_signal)  # its C-level handler exits with exit_code, GIL or not
ready, _, _ = select.select([sys.stdin], [], [], kill_after_s)
if not ready:  # no such handler (or it could not run): the parent must not hang on
    print(f"tfscale pre-flight: the worker did not exit on signal {exit_signal}; killing it",
          file=sys.stderr, flush=True)
    os.kill(parent_pid, signal.SIGKILL)
"""


def _watchdog_source() -> str:
    helpers = "".join(inspect.getsource(function) for function in (_unanswered_peers, _not_up_message))
    return f"from __future__ import annotations\n{helpers}{_WATCHDOG_MAIN}"


# Runs in its own small process: while TensorFlow connects the cluster, the main thread sits in C++
# holding the GIL, so no Python thread of ours could run (or even exit) until it returns.
def _start_watchdog(backstop_s: float, connect_timeout_s: float, addresses, own_index: int) -> subprocess.Popen:
    """A watchdog process that names silent workers and ends this one (exit 69) if connecting takes
    longer than `backstop_s`. Close its stdin (`_stop_watchdog`) once the cluster is up."""
    args = [backstop_s, connect_timeout_s, PROBE_TIMEOUT_S, WATCHDOG_KILL_AFTER_S,
            os.getpid(), own_index, int(WATCHDOG_SIGNAL), EXIT_CLUSTER_UNAVAILABLE]
    return subprocess.Popen([sys.executable, "-c", _watchdog_source(), *map(str, args), *addresses],
                            stdin=subprocess.PIPE)


def _stop_watchdog(watchdog: subprocess.Popen) -> None:
    watchdog.stdin.close()
    watchdog.wait()


@contextlib.contextmanager
def _exit_on_signal(signum: int, exit_code: int):
    """While in the block, signal `signum` ends this process at once with `exit_code`.

    Measured on TF 2.21 with the main thread stuck in MultiWorkerMirroredStrategy's connect: a
    Python `signal.signal` handler never runs (Python runs handlers between bytecodes of the main
    thread, which never returns from C++), SIGTERM is caught by TensorFlow and does nothing, and libc's
    `_exit` installed as the handler exits with the signal's number (no signal is numbered 69).
    What works is a ctypes callback installed with libc's signal(): the kernel delivers a
    process-directed signal to the main thread, which holds the GIL, so the callback runs and
    `os._exit`s. Python code in a signal handler is only safe because it exits at once; the
    watchdog SIGKILLs a worker the handler could not end. Where ctypes or libc's signal() is missing,
    nothing is installed and the watchdog's SIGKILL (exit 137) is the only way out.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda _signum: os._exit(exit_code))
        previous = libc.signal(signum, ctypes.cast(handler, ctypes.c_void_p))
        if previous == ctypes.c_void_p(-1).value:  # SIG_ERR
            raise OSError(ctypes.get_errno(), f"signal({signum}) failed")
    except (OSError, AttributeError) as err:
        logging.warning("cannot install the exit-%d handler for signal %d (%s): a hung connect ends with SIGKILL",
                        exit_code, signum, err)
        yield
        return
    try:
        yield
    finally:
        libc.signal(signum, previous)  # the handler object stays alive until here
        del handler


def _check_cluster_addresses(addresses, own_index: int) -> None:
    """Fails at once (ClusterUnavailable) when a host name does not resolve or this worker's port is taken.

    TensorFlow names neither (measured, TF 2.21): an unresolvable host looks to it like a silent
    worker (it waits the whole connect timeout), and a port in use raises "UnknownError: Could not
    start gRPC server", the port only in a gRPC log line.
    """
    def resolve(index: int) -> str | None:
        try:
            host, port = _split_address(addresses[index])
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return None
        except ValueError as err:
            return f"worker {index}: {err}"
        except OSError as err:  # socket.gaierror: no such host, or no DNS answer
            return f"worker {index} at {addresses[index]}: host name {host!r} does not resolve ({err.strerror or err})"

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, len(addresses))) as pool:
        unresolved = [problem for problem in pool.map(resolve, range(len(addresses))) if problem]
    if unresolved:
        raise _cluster_unavailable(f"the cluster spec has addresses no worker can connect to: {'; '.join(unresolved)}. "
                                   "Check TF_CONFIG / the Slurm node list")
    port = _split_address(addresses[own_index])[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As gRPC binds (0.0.0.0:PORT, SO_REUSEADDR): a port left in TIME_WAIT by a finished job is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as err:
            own = f"this worker's port {port} (worker {own_index} at {addresses[own_index]} in the cluster spec)"
            if err.errno != errno.EADDRINUSE:
                raise _cluster_unavailable(f"{own} cannot be bound: {err.strerror or err}") from None
            raise _cluster_unavailable(
                f"{own} is already in use by another process: a leftover worker of an earlier job (see "
                f"`ss -ltnp 'sport = :{port}'`), or a port given to two workers on this host"
            ) from None


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


def _configure_coordination_service(tf_config: dict, heartbeat_timeout_s: float,
                                    register_timeout_s: float = 0.0) -> bool:
    """Sets the dead-worker detection time (and, given `register_timeout_s`, how long the workers may
    take to register) before MWMS would configure the service with defaults.

    This is the private call MultiWorkerMirroredStrategy makes itself (it skips its own when a
    service is configured). Where this TensorFlow lacks it: a warning (once per process), False, and
    MWMS configures the service itself with TensorFlow's default heartbeat timeout (and no
    registration timeout: the watchdog then steps in at `connect_timeout_s`).
    """
    num_workers = len(tf_config["cluster"]["worker"])
    try:
        configure, coordinated_job = _coordination_service_api()
        configure(
            service_type="standalone",
            service_leader="/job:worker/replica:0/task:0",
            heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
            cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
            coordinated_jobs=[coordinated_job(name="worker", num_tasks=num_workers)],
        )
    except (LookupError, TypeError) as err:  # TypeError: another signature, or another protobuf class than context's
        _warn_default_heartbeat(str(err))
        return False
    if register_timeout_s:
        _register_with_barrier()
    return True


def _register_with_barrier() -> None:
    """Makes the leader give up, too, when the cluster does not register within the timeout.

    Measured on TF 2.21: with `cluster_register_timeout_in_ms` alone, a worker whose leader (worker 0)
    is missing raises DeadlineExceededError after the timeout (+ about 5 s), but the leader waits
    forever for a missing worker. With `cluster_register_with_barrier` (a field of the same protobuf
    that configure_coordination_service has no argument for) registration is a barrier with that
    timeout: the leader raises DeadlineExceededError naming the tasks that did not register, and the
    workers that did register get the same error.
    """
    from tensorflow.python.eager import context

    try:
        context.context().coordination_service.cluster_register_with_barrier = True
    except AttributeError as err:  # an older protobuf without the field
        logging.warning("TensorFlow %s cannot time out cluster registration on the leader (%s): a missing worker "
                        "is detected by tfscale's watchdog instead", tf.__version__, err)


def _tf_times_out_registration() -> bool:
    """True when TensorFlow itself will raise on every worker if the cluster does not register in time."""
    from tensorflow.python.eager import context

    service = context.context().coordination_service
    return bool(service and service.cluster_register_timeout_in_ms
                and getattr(service, "cluster_register_with_barrier", False))


@functools.lru_cache(maxsize=None)  # once per process (and reason): every MWMS setup would repeat it
def _warn_default_heartbeat(reason: str) -> None:
    logging.warning(
        "TensorFlow %s does not offer the private coordination-service API tfscale sets the heartbeat "
        "timeout with (%s): dead-worker detection uses TensorFlow's default heartbeat timeout "
        "(distribute.heartbeat_timeout_s is not applied)", tf.__version__, reason,
    )


def _communication_options(dist_cfg: ml_collections.ConfigDict,
                           implementation: str) -> tf.distribute.experimental.CommunicationOptions:
    """MWMS's all-reduce options; `implementation` is `devices.collective_implementation`'s choice (AUTO resolved)."""
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=dist_cfg.pack_bytes,
        timeout_seconds=dist_cfg.collective_timeout_s or None,
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation, implementation),
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


def _init_horovod(dist_cfg: ml_collections.ConfigDict, env: dict) -> tuple[Any, int]:
    """(horovod.tensorflow initialised with the config's knobs, every rank answering; GPUs this rank keeps: 0 or 1)."""
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
    gpus = devices.prepare_gpus(hvd.local_rank(), host=socket.gethostname())
    host_copies = devices.horovod_host_copy_warning(len(gpus), hvd.nccl_built())
    if host_copies:
        logging.warning("horovod: %s", host_copies)
    preflight_horovod(hvd)
    return hvd, len(gpus)


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


def _multi_worker_strategy(dist_cfg, tf_config: dict | None, implementation: str) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy over `tf_config`'s workers (None: this process alone), all-reducing with
    `implementation`; this worker's GPU is already chosen (`devices.prepare_gpus`)."""
    options = _communication_options(dist_cfg, implementation)
    if tf_config is None:  # not in a cluster: a one-worker MWMS job, handy for testing the path
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    os.environ["TF_CONFIG"] = json.dumps(tf_config)  # what TFConfigClusterResolver reads
    addresses, own_index = tf_config["cluster"]["worker"], tf_config["task"]["index"]
    _check_cluster_addresses(addresses, own_index)
    timeout_s = dist_cfg.connect_timeout_s
    _configure_coordination_service(tf_config, dist_cfg.heartbeat_timeout_s, timeout_s)
    # TensorFlow raises when registration times out: the watchdog is only the backstop, a bit later.
    backstop_s = timeout_s + (WATCHDOG_GRACE_S if _tf_times_out_registration() else 0.0)
    step = "registering the cluster"
    with _exit_on_signal(WATCHDOG_SIGNAL, EXIT_CLUSTER_UNAVAILABLE):
        watchdog = _start_watchdog(backstop_s, timeout_s, addresses, own_index)
        try:
            strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
            step = "the pre-flight all-reduce"
            preflight_all_reduce(strategy)
        except tf.errors.OpError as err:
            if isinstance(err, tf.errors.DeadlineExceededError) and step == "registering the cluster":
                what = f"the cluster did not come up within distribute.connect_timeout_s={timeout_s:g}s"
            else:
                what = f"the cluster did not come up: {step} failed ({type(err).__name__}: {_first_line(err)})"
            raise _cluster_unavailable(
                _not_up_message(what, _unanswered_peers(addresses, own_index, PROBE_TIMEOUT_S))) from err
        finally:
            _stop_watchdog(watchdog)
    return strategy


def _first_line(err: tf.errors.OpError, max_chars: int = 300) -> str:
    line = (err.message or "").strip().split("\n")[0]
    return line if len(line) <= max_chars else line[:max_chars] + "..."
