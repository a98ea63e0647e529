"""Connecting a MultiWorkerMirroredStrategy cluster without hanging: `multi_worker_strategy`.

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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
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
from typing import Callable

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import compat
from tfscale.config import step_modes
from tfscale.errors import EXIT_CLUSTER_UNAVAILABLE, ClusterUnavailable

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
        raise LookupError(compat.hook_note("tensorflow", "context().configure_coordination_service"))
    for name in _COORDINATION_CONFIG_MODULES:
        try:
            return configure, importlib.import_module(name).CoordinatedJob
        except (ImportError, AttributeError):
            continue
    raise LookupError(compat.hook_note("tensorflow", f"CoordinatedJob in {' or '.join(_COORDINATION_CONFIG_MODULES)}"))


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
        bytes_per_pack=step_modes.fixed_pack_bytes(dist_cfg),  # auto: tfscale's own buckets, sized at start
        timeout_seconds=dist_cfg.collective_timeout_s or None,
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation, implementation),
    )


def preflight_all_reduce(strategy: tf.distribute.Strategy) -> None:
    """Every replica contributes 1; anything but the replica count means the cluster is broken."""

    @tf.function(autograph=False)
    def count_replicas():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

    total = float(count_replicas())
    if total != strategy.num_replicas_in_sync:
        raise RuntimeError(f"pre-flight all-reduce counted {total} replicas, expected {strategy.num_replicas_in_sync}")


def multi_worker_strategy(dist_cfg, tf_config: dict | None, implementation: str) -> tf.distribute.Strategy:
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
