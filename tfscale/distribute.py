"""Cluster setup: the only module that builds a tf.distribute strategy or reads cluster environment.

`setup(cfg.distribute) -> Cluster` returns everything the rest of tfscale needs to know about the
topology (rank, size, replicas, chief) and the strategy to run steps with. Rank checks elsewhere go
through `Cluster.is_chief`, so there is one definition of "the process that writes files".

Multi-worker jobs (`mwms`, MultiWorkerMirroredStrategy) take their cluster from, in order:
an explicit TF_CONFIG; the Slurm step the task belongs to (SLURM_PROCID and the step's
SLURM_STEP_NODELIST / SLURM_STEP_TASKS_PER_NODE / SLURM_STEP_NUM_TASKS before the job's, ports from
`distribute.port_base` or the job and step ids); `python -m tfscale.launch`, which writes a TF_CONFIG.
Users' top complaint about MWMS is jobs that hang, so setup never waits unboundedly:
  * a watchdog process names the workers that did not answer and kills the worker (exit 137) when
    the cluster is not up within `connect_timeout_s` (TensorFlow itself would wait forever);
  * a pre-flight all-reduce proves every worker answers before any real work;
  * TensorFlow's coordination service declares a worker dead after `heartbeat_timeout_s` without a
    heartbeat, and the others then fail their next collective instead of waiting.

`horovod` runs one rank per process on one device (a OneDeviceStrategy, so the loop's code is the
same), launched by horovodrun / mpirun / srun --mpi=pmix / `tfscale.launch --backend=horovod`.
The Cluster carries the Horovod pieces the loop needs: gradient averaging, summing metrics across
ranks, broadcasting the chief's variables and sharding the input by rank. Gloo's rendezvous timeout
(`connect_timeout_s`) bounds the wait for missing ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys

from typing import Any, Callable

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import logs
from tfscale.config import BACKENDS, HOROVOD_INSTALL_HINT


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
    worker_addresses: tuple[str, ...] = ()  # host:port of every worker (mwms only)
    hvd: Any = None  # the horovod.tensorflow module (horovod only)
    fp16_allreduce: bool = False  # horovod: gradients travel as float16

    @property
    def is_chief(self) -> bool:
        """The chief writes workdir files and prints progress; the others stay quiet."""
        return self.rank == 0

    @property
    def saving_is_collective(self) -> bool:
        """MWMS needs every worker in a checkpoint save; a Horovod rank saves (or not) on its own."""
        return self.hvd is None

    def loss_batch_size(self, global_batch_size: int) -> int:
        """The batch one replica's loss is averaged over so that the reduced gradient is the global mean.

        tf.distribute sums replica gradients, so each divides by the global batch; Horovod averages
        rank gradients (hvd.Average), so each rank divides by its own batch.
        """
        return global_batch_size // self.size if self.hvd else global_batch_size

    def all_reduce_gradients(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """Horovod's gradient average; tf.distribute strategies reduce inside `apply_gradients`.

        A plain tape plus grouped_allreduce is the Horovod path that works on Keras 3:
        hvd.DistributedOptimizer runs there but silently skips the averaging.
        """
        if self.hvd is None:
            return grads
        compression = self.hvd.Compression.fp16 if self.fp16_allreduce else self.hvd.Compression.none
        return self.hvd.grouped_allreduce(grads, op=self.hvd.Average, compression=compression)

    def gradient_all_reduce(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """The cross-replica gradient reduction of a training step, as an op of its own (call inside a replica step).

        Horovod: the same average (and compression) as `all_reduce_gradients`. tf.distribute: the
        replica-context SUM that Keras' `apply_gradients` performs. The benchmark times it alone.
        """
        if self.hvd is not None:
            return self.all_reduce_gradients(grads)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)

    def average_state(self, variables) -> None:
        """Averages non-trainable model state (BatchNorm moving statistics) over all replicas.

        Call inside a replica step. Keras 3 variables under tf.distribute, like Horovod ranks, keep
        each replica's own moving statistics, so without this eval results and checkpoints would
        depend on which replica computed them.
        """
        floats = [v for v in variables if keras.backend.is_float_dtype(v.dtype)]
        if self.num_replicas == 1 or not floats:
            return
        values = [tf.identity(v.value) for v in floats]  # this replica's copy, read as a tensor
        if self.hvd is not None:
            averages = self.hvd.grouped_allreduce(values, op=self.hvd.Average)
        else:
            averages = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, values)
        for variable, average in zip(floats, averages):
            variable.assign(average)

    def sum_across_processes(self, tensor: tf.Tensor) -> tf.Tensor:
        """Sums a per-process value over all processes (a strategy's `reduce` already did for MWMS)."""
        return tensor if self.hvd is None else self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def mean_across_processes(self, values: list[float]) -> list[float]:
        """Eager mean of per-process numbers (every process passes them in the same order)."""
        if self.hvd is None or not values:
            return list(values)
        return self.hvd.allreduce(tf.constant(values, tf.float64), op=self.hvd.Average).numpy().tolist()

    def gather_per_worker(self, values: list[float]) -> list[list[float]]:
        """Every worker's `values` (the same length on each), in rank order, returned on every worker.

        Eager; every worker must call it at the same point (it is a collective).
        """
        rows = np.zeros([self.size, len(values)])
        rows[self.rank] = values
        if self.size == 1:
            return rows.tolist()
        if self.hvd is not None:
            return self.hvd.allreduce(tf.constant(rows), op=self.hvd.Sum).numpy().tolist()
        # A strategy reduce sums over replicas; each worker's replicas share its row.
        share = tf.constant(rows / (self.num_replicas // self.size))

        @tf.function
        def sum_rows():
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: share), axis=None)

        return sum_rows().numpy().tolist()

    def broadcast_from_chief(self, variables) -> None:
        """Copies the chief's values into `variables` (Keras or TF variables) on every process.

        MWMS keeps replicas identical itself; Horovod ranks start from whatever each initialised or
        restored, so training starts with this. Keras 3 variables are passed as the tf.Variable they
        wrap (`.value`): Horovod's broadcast_variables needs `.ref()`, which Keras variables lack.
        """
        if self.hvd is not None:
            tf_variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
            self.hvd.broadcast_variables(tf_variables, root_rank=0)

    def distribute_dataset(self, input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
        """`input_fn`'s dataset for this process, sharded over all processes, placed on its devices."""
        if self.hvd is None:
            return self.strategy.distribute_datasets_from_function(input_fn)
        # Each rank is its own one-device "strategy", so tell input_fn about the whole Horovod job.
        context = tf.distribute.InputContext(
            num_input_pipelines=self.size, input_pipeline_id=self.rank, num_replicas_in_sync=self.size
        )
        return self.strategy.distribute_datasets_from_function(lambda _: input_fn(context))

    def topology_line(self) -> str:
        devices = ",".join(self.strategy.extended.worker_devices)
        return (
            f"tfscale worker rank={self.rank}/{self.size} local_rank={self.local_rank} host={self.host} "
            f"backend={self.backend} replicas={self.num_replicas} devices={devices}"
        )


# --- Slurm -----------------------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in Slurm's order (what `scontrol show hostnames` prints).

    'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1; several bracket groups multiply, the
    first varying slowest: 'rack[1-2]-n[01-02]' -> rack1-n01 rack1-n02 rack2-n01 rack2-n02. Slurm
    (hostlist.c) rejects text after the last group ('nid[1-2]-ib'); it is accepted here as a suffix.
    """
    hosts = []
    for pattern in _split_outside_brackets(hostlist, hostlist):
        hosts += _expand_host_pattern(pattern, hostlist)
    return hosts


def _split_outside_brackets(text: str, hostlist: str) -> list[str]:
    """Splits at commas/whitespace that are not inside [...]: 'a[1,3],b' -> 'a[1,3]', 'b'."""
    parts, current, depth = [], "", 0
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"host list {hostlist!r}: unbalanced or nested brackets")
        if depth == 0 and (char == "," or char.isspace()):
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"host list {hostlist!r}: '[' without ']'")
    return [p for p in parts + [current] if p]


def _expand_host_pattern(pattern: str, hostlist: str) -> list[str]:
    """One comma-free pattern, e.g. 'rack[1-2]-n[01,03]', expanded group by group (first group outermost)."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    rests = _expand_host_pattern(tail, hostlist)
    return [f"{head}{number}{rest}" for number in _expand_ranges(match.group(1), hostlist) for rest in rests]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    """'01-03,07' -> 01 02 03 07: each range keeps the zero padding of its first number, as Slurm does."""
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ValueError(f"host list {hostlist!r}: {part!r} is not a range like 3 or 01-04")
        width = len(first)  # zero padding is part of the name: [01-03] -> 01, 02, 03
        numbers += [f"{n:0{width}d}" for n in range(int(first), int(last or first) + 1)]
    return numbers


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or not (repeat.rstrip(")") or "1").isdigit():
            raise ValueError(f"tasks per node {tasks_per_node!r}: {part!r} is not like 2 or 2(x3)")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


# A Slurm task's view of the cluster it belongs to, step-level variables first. srun sets the
# SLURM_STEP_* ones for the tasks it starts; the job-level ones describe the whole allocation, which
# an `srun -n 2` inside a 4-task allocation uses only part of (TensorFlow's SlurmClusterResolver
# reads the step's too). The job-level ones remain for steps started by other means.
# SLURM_PROCID and SLURM_LOCALID are already per step: the rank within the step, and among the
# step's tasks on this node.
_SLURM_NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_TASKS_PER_NODE_KEYS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_SLURM_NUM_TASKS_KEYS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")

# Default MWMS ports of a Slurm step: a block of ports in 20000-39999 (tools/slurm_testbed.sh keeps
# its daemons above), one port per task on a node. The block depends on the job id AND the step id:
# two steps of one job running at once on a node (`srun -n 2 ... & srun -n 2 ... &`) would
# otherwise both bind base+0, base+1. Blocks are PORTS_PER_SLURM_STEP wide, so jobs with nearby ids
# (consecutive submissions, likely neighbours on a shared node) do not overlap either, as they did
# with a base of 20000 + job id: steps 0-3 of jobs whose ids differ by less than 625 get disjoint
# blocks. A step with more tasks on a node than a block holds spills into the next block; give such
# layouts an explicit distribute.port_base.
SLURM_PORT_RANGE = (20000, 40000)  # [first, end)
PORTS_PER_SLURM_STEP = 8  # tasks per node a block holds: one per GPU of an 8-GPU node
CONCURRENT_SLURM_STEPS = 4  # steps of one job that get disjoint blocks


def _first_present(env: dict, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(key, value) of the first of `keys` set in `env`, or None."""
    return next(((key, env[key]) for key in keys if key in env), None)


def slurm_num_tasks(env: dict) -> int:
    """Tasks of this Slurm step (SLURM_STEP_NUM_TASKS), else of the job (SLURM_NTASKS); 1 outside Slurm."""
    found = _first_present(env, _SLURM_NUM_TASKS_KEYS)
    return int(found[1]) if found else 1


def slurm_port_base(env: dict) -> int:
    """The first MWMS port of this Slurm step on every node (see SLURM_PORT_RANGE above for why)."""
    first, end = SLURM_PORT_RANGE
    num_blocks = (end - first) // PORTS_PER_SLURM_STEP
    job_id = int(env.get("SLURM_JOB_ID", "0"))
    step_id = int(env.get("SLURM_STEP_ID", "0"))
    block = (job_id * CONCURRENT_SLURM_STEPS + step_id % CONCURRENT_SLURM_STEPS) % num_blocks
    return first + block * PORTS_PER_SLURM_STEP


def slurm_tf_config(env: dict, port_base: int) -> dict:
    """A TF_CONFIG for this task's Slurm step, in Slurm's default block distribution (task i runs on the
    node holding slot i), or a ValueError naming the variables that disagree.

    Step-level variables are read before job-level ones (see _SLURM_NODELIST_KEYS). Worker j on a
    node listens on `port_base + j`; port_base 0 derives it from the job and step ids (`slurm_port_base`).
    """
    hosts_key, hostlist = _required_slurm_var(env, _SLURM_NODELIST_KEYS)
    counts_key, tasks_per_node = _required_slurm_var(env, _SLURM_TASKS_PER_NODE_KEYS)
    tasks_key, num_tasks = _required_slurm_var(env, _SLURM_NUM_TASKS_KEYS)
    _, proc_id = _required_slurm_var(env, ("SLURM_PROCID",))
    hosts, counts = expand_hostlist(hostlist), expand_tasks_per_node(tasks_per_node)
    if len(hosts) != len(counts):
        raise ValueError(f"{hosts_key}={hostlist} has {len(hosts)} hosts but {counts_key}={tasks_per_node} "
                         f"describes {len(counts)}")
    port_base = port_base or slurm_port_base(env)
    workers = [f"{host}:{port_base + local}" for host, count in zip(hosts, counts) for local in range(count)]
    if len(workers) != int(num_tasks):
        raise ValueError(f"{tasks_key}={num_tasks} but {hosts_key} / {counts_key} hold {len(workers)} task slots")
    if not 0 <= int(proc_id) < len(workers):
        raise ValueError(f"SLURM_PROCID={proc_id} is not a rank of the {len(workers)} tasks in {tasks_key}")
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": int(proc_id)}}


def _required_slurm_var(env: dict, keys: tuple[str, ...]) -> tuple[str, str]:
    found = _first_present(env, keys)
    if found is None:
        raise ValueError(f"a Slurm task with SLURM_NTASKS/SLURM_STEP_NUM_TASKS > 1 but none of {', '.join(keys)} "
                         "is set: start the workers with srun, or give TF_CONFIG")
    return found


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


def _configure_coordination_service(tf_config: dict, heartbeat_timeout_s: float) -> None:
    """Sets the dead-worker detection time before MWMS would configure the service with defaults.

    This is the private call MultiWorkerMirroredStrategy makes itself (it skips its own when a
    service is configured); no public API exposes the heartbeat timeout.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    num_workers = len(tf_config["cluster"]["worker"])
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=num_workers)],
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


def preflight_horovod(hvd) -> None:
    """Every rank contributes 1; anything but the rank count means the job is broken."""
    total = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="tfscale_preflight"))
    if total != hvd.size():
        raise RuntimeError(f"pre-flight all-reduce counted {total} Horovod ranks, expected {hvd.size()}")


def _horovod_setup(dist_cfg: ml_collections.ConfigDict, env: dict) -> tuple[Any, tf.distribute.Strategy]:
    hvd = import_horovod()
    knobs = _horovod_environment(dist_cfg, env)
    os.environ.update(knobs)
    timeout_s = knobs.get("HOROVOD_GLOO_TIMEOUT_SECONDS", env.get("HOROVOD_GLOO_TIMEOUT_SECONDS"))
    if timeout_s:
        # Gloo aborts the process (SIGABRT) naming the missing rank numbers; this line says why.
        logging.info("horovod: waiting up to %s s for every rank at the rendezvous (distribute.connect_timeout_s)", timeout_s)
    hvd.init()
    _pin_gpu(hvd.local_rank())
    preflight_horovod(hvd)
    return hvd, _one_device_strategy()


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


def setup(dist_cfg: ml_collections.ConfigDict, env: dict | None = None) -> Cluster:
    """Builds the strategy for `dist_cfg.backend`, checks the cluster answers, logs the topology."""
    env = dict(os.environ if env is None else env)
    local_rank = local_rank_from_env(env)
    tf_config = None
    hvd = None
    if dist_cfg.backend == "horovod":
        hvd, strategy = _horovod_setup(dist_cfg, env)
    elif dist_cfg.backend == "one_device":
        strategy = _one_device_strategy()
    elif dist_cfg.backend == "mirrored":
        strategy = _mirrored_strategy(dist_cfg)
    elif dist_cfg.backend == "mwms":
        tf_config = _resolve_tf_config(dist_cfg, env)
        strategy = _multi_worker_strategy(dist_cfg, tf_config, local_rank)
    else:
        raise ValueError(f"config.distribute.backend={dist_cfg.backend!r} is not one of: {', '.join(BACKENDS)}")
    addresses = tuple(tf_config["cluster"]["worker"]) if tf_config else ()
    if hvd is not None:
        rank, size, local_rank, num_replicas = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.size()
    else:
        rank = tf_config["task"]["index"] if tf_config else 0
        size, num_replicas = len(addresses) or 1, strategy.num_replicas_in_sync
    cluster = Cluster(
        backend=dist_cfg.backend,
        strategy=strategy,
        rank=rank,
        size=size,
        local_rank=local_rank,
        num_replicas=num_replicas,
        host=socket.gethostname(),
        worker_addresses=addresses,
        hvd=hvd,
        fp16_allreduce=dist_cfg.horovod_fp16_allreduce,
    )
    logging.info(cluster.topology_line())
    # One topology line per worker, then progress from the chief only (warnings and errors from all).
    logs.gate_workers(cluster.is_chief, log_all_ranks=dist_cfg.log_all_ranks)
    return cluster
