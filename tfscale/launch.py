"""Local multi-process launcher: runs N copies of a Python command as one multi-worker job on this host.

    python -m tfscale.launch --num_workers=2 [--backend=mwms|horovod] -- -m tfscale.train \
        --config=configs/smoke.py --workdir=runs/x

Each worker is `sys.executable <args after -->` with the cluster environment its backend reads:
`TF_CONFIG` on free loopback ports for MultiWorkerMirroredStrategy (`mwms`), or the Gloo rendezvous
variables horovodrun sets for a single-host job (`horovod`, with horovodrun's rendezvous HTTP server
running inside this process). Every worker also gets `TFSCALE_LOCAL_RANK/SIZE` and thread limits, and
`-m tfscale.train` / `-m tfscale.benchmark` get `--config.distribute.backend` set to the same backend.

The launcher is a supervisor, not a trainer: it never imports TensorFlow (seconds and hundreds of MB
per launch for nothing). It prefixes worker output with `[rank r] `, forwards SIGINT/SIGTERM (Slurm
sends SIGTERM before killing a job, and the workers checkpoint on it), stops the whole job as soon as
one worker fails, and exits with the first failing worker's code. Workers run in their own sessions
so that the launcher can signal and kill each worker's whole process group, grandchildren included:
no process it started outlives it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from tfscale.config import HOROVOD_INSTALL_HINT

LOOPBACK = "127.0.0.1"
BACKENDS = ("mwms", "horovod")
HOROVOD_MISSING = f"backend horovod needs Horovod: {HOROVOD_INSTALL_HINT}"
USAGE_EXIT_CODE = 2  # argparse's convention for usage errors
POLL_INTERVAL_S = 0.05  # how often the supervisor checks its workers; sets the reaction latency
PUMP_JOIN_TIMEOUT_S = 5.0  # how long to wait for the last output lines once every worker is gone

# One lock for every line the launcher writes, so a line never interleaves with another, even when
# stdout and stderr are the same terminal or file.
_OUTPUT_LOCK = threading.Lock()


class LaunchError(RuntimeError):
    """The job cannot be started (e.g. the backend's library is missing); nothing was launched."""


# ----------------------------------------------------------------------------------------------
# Cluster environment


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free on the loopback interface right now.

    All sockets are held open together so the kernel cannot hand out the same port twice, then
    released: the workers bind them a moment later. Another process could grab a port in between,
    so call this immediately before starting the workers.
    """
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def available_cores() -> int:
    """Cores this process may run on (Slurm and taskset restrict the affinity mask, not cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads_per_worker(num_workers: int) -> int:
    """An equal share of the cores per worker, so N workers do not oversubscribe the host."""
    return max(1, available_cores() // num_workers)


def _tf_config(rank: int, ports: Sequence[int]) -> str:
    cluster = {"worker": [f"{LOOPBACK}:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})


def _horovod_env(rank: int, num_workers: int, rendezvous_port: int) -> dict[str, str]:
    """What horovodrun's gloo_run sets for one slot of a single-host job (create_run_env_vars +
    create_slot_env_vars): all ranks on one host, so local == global and there is one cross group."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": LOOPBACK,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
        # Must equal the host name in the rendezvous server's plan: it names the `local_<host>` scope.
        "HOROVOD_HOSTNAME": LOOPBACK,
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(num_workers),
        "HOROVOD_LOCAL_RANK": str(rank),
        "HOROVOD_LOCAL_SIZE": str(num_workers),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
    }


def _thread_env(threads: int) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(threads),
        "TF_NUM_INTRAOP_THREADS": str(threads),
        "TF_NUM_INTEROP_THREADS": str(threads),
    }


def worker_env(
    rank: int,
    num_workers: int,
    ports_or_rendezvous: Sequence[int] | int,
    backend: str,
    threads: int | None,
) -> dict[str, str]:
    """The variables the launcher sets for worker `rank` (on top of the inherited environment).

    `ports_or_rendezvous`: for `mwms` the list of `num_workers` worker ports; for `horovod` the
    rendezvous server's port. `threads=None` leaves the thread variables alone.
    """
    if backend == "mwms":
        ports = list(ports_or_rendezvous) if not isinstance(ports_or_rendezvous, int) else []
        if len(ports) != num_workers:
            raise ValueError(f"backend mwms needs {num_workers} worker ports, got {ports_or_rendezvous!r}")
        env = {"TF_CONFIG": _tf_config(rank, ports)}
    elif backend == "horovod":
        if not isinstance(ports_or_rendezvous, int):
            raise ValueError(f"backend horovod needs the rendezvous port, got {ports_or_rendezvous!r}")
        env = _horovod_env(rank, num_workers, ports_or_rendezvous)
    else:
        raise ValueError(f"backend={backend!r} is not one of: {', '.join(BACKENDS)}")
    env["TFSCALE_LOCAL_RANK"] = str(rank)
    env["TFSCALE_LOCAL_SIZE"] = str(num_workers)
    if threads is not None:
        env.update(_thread_env(threads))
    # Python block-buffers stdout into a pipe: lines would reach the launcher late, and be lost
    # entirely if the worker is killed. horovodrun sets this for the same reason.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _child_env(base: dict[str, str], overrides: dict[str, str], backend: str) -> dict[str, str]:
    env = dict(base)
    if backend != "mwms":
        # An inherited TF_CONFIG (e.g. from an outer launcher) would describe some other cluster.
        env.pop("TF_CONFIG", None)
    env.update(overrides)
    return env


# ----------------------------------------------------------------------------------------------
# Horovod rendezvous


class _HorovodRendezvous:
    """horovodrun's rendezvous HTTP server (gloo_run.launch_gloo), run inside the launcher.

    `hvd.init()` in each worker fetches its peers from this key-value server; the plan tells the server
    how many workers join each scope (global, local_<host>, cross_<local rank>).
    """

    def __init__(self, num_workers: int):
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.http.http_server import RendezvousServer
        except ImportError as err:
            raise LaunchError(f"{HOROVOD_MISSING} ({err})") from err
        self._server = RendezvousServer(verbose=0)
        # start() binds a free port itself and keeps it bound: no window for another process to take it.
        self.port = int(self._server.start())
        hosts = parse_hosts(f"{LOOPBACK}:{num_workers}")
        self._server.init(get_host_assignments(hosts, num_workers))  # positional: names vary by version

    def stop(self) -> None:
        self._server.stop()


# ----------------------------------------------------------------------------------------------
# Output


def _say(message: str) -> None:
    """One launcher line on stderr, never interleaved with worker lines."""
    _write_line(sys.stderr, f"tfscale.launch: {message}\n")


def _write_line(stream: IO[str], line: str) -> None:
    with _OUTPUT_LOCK:
        try:
            try:
                stream.write(line)
            except UnicodeEncodeError:  # a worker printed something the launcher's stream cannot encode
                encoding = getattr(stream, "encoding", None) or "ascii"
                stream.write(line.encode(encoding, errors="backslashreplace").decode(encoding))
            stream.flush()
        except (OSError, ValueError):
            # The launcher's output is gone (closed pipe, `| head`). Drop the line but keep draining:
            # a worker blocked on a full pipe would hang the whole job.
            pass


def _pump_lines(pipe: IO[bytes], stream: IO[str], prefix: str) -> None:
    """Copies `pipe` to `stream` line by line with `prefix`; returns at end of file."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", errors="replace")
            if not text.endswith("\n"):  # last line without newline: keep the next prefix on its own line
                text += "\n"
            _write_line(stream, prefix + text)


def _start_pumps(proc: subprocess.Popen, rank: int, out: IO[str], err: IO[str]) -> list[threading.Thread]:
    pumps = []
    for pipe, stream, name in ((proc.stdout, out, "stdout"), (proc.stderr, err, "stderr")):
        # Daemon: a grandchild that escaped the kill could hold the pipe open forever.
        thread = threading.Thread(
            target=_pump_lines, args=(pipe, stream, f"[rank {rank}] "), name=f"rank{rank}-{name}", daemon=True
        )
        thread.start()
        pumps.append(thread)
    return pumps


# ----------------------------------------------------------------------------------------------
# Processes


def exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal S (Popen returncode -S) exits with 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_code(code: int) -> str:
    if code > 128:
        try:
            return f"code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"code {code}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the worker's whole process group, so its own subprocesses get it too."""
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True: the worker leads a group with its pid
    except (ProcessLookupError, PermissionError):  # the whole group is gone already
        pass


def _running(procs: Sequence[subprocess.Popen]) -> list[subprocess.Popen]:
    return [proc for proc in procs if proc.poll() is None]


def _spawn(rank: int, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        stdin=subprocess.DEVNULL,  # N workers must not compete for the terminal
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Own session = own process group: the launcher can kill a worker with its grandchildren,
        # and a terminal Ctrl-C reaches the workers once, through the launcher, not twice.
        start_new_session=True,
    )


class _SignalRecorder:
    """Records SIGINT/SIGTERM for the supervise loop instead of dying, while installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_SignalRecorder":
        # Handlers can only be installed from the main thread; elsewhere the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was installed from C and cannot be restored from Python.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _supervise(procs: Sequence[subprocess.Popen], grace_period_s: float, signals: _SignalRecorder) -> int:
    """Waits for all workers; stops the job on a forwarded signal or the first failure.

    Returns the first non-zero worker exit code (0 when every worker exited 0).
    """
    first_failure: int | None = None
    exited: set[int] = set()
    forwarded = 0
    kill_deadline_s: float | None = None  # monotonic time at which stragglers get SIGKILL

    def stop_after_grace() -> None:
        nonlocal kill_deadline_s
        if kill_deadline_s is None:
            kill_deadline_s = time.monotonic() + grace_period_s

    while len(exited) < len(procs):
        while forwarded < len(signals.received):
            sig = signals.received[forwarded]
            forwarded += 1
            running = _running(procs)
            _say(f"received {signal.Signals(sig).name}; forwarding it to {len(running)} worker(s)")
            for proc in running:
                _signal_group(proc, sig)
            stop_after_grace()

        for rank, proc in enumerate(procs):
            if rank in exited or proc.poll() is None:
                continue
            exited.add(rank)
            code = exit_code(proc.returncode)
            if code == 0 or first_failure is not None:
                continue
            first_failure = code
            if kill_deadline_s is not None:  # already stopping: this code is simply the job's result
                _say(f"rank {rank} exited with {_describe_code(code)}")
                continue
            others = _running(procs)
            _say(f"rank {rank} exited with {_describe_code(code)}; stopping the other {len(others)} worker(s)")
            for other in others:
                _signal_group(other, signal.SIGTERM)
            stop_after_grace()

        if kill_deadline_s is not None and time.monotonic() >= kill_deadline_s:
            for rank, proc in enumerate(procs):
                if proc.poll() is None:
                    _say(f"rank {rank} still running {grace_period_s:g} s after being stopped; sending SIGKILL")
                    _signal_group(proc, signal.SIGKILL)
            kill_deadline_s = float("inf")  # killed once; SIGKILL cannot be ignored, so just reap
        time.sleep(POLL_INTERVAL_S)
    return first_failure or 0


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILLs every worker's process group and reaps the workers: nothing outlives the launcher."""
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


# Programs whose config has `distribute.backend`: the launcher sets it to match the environment it builds.
_TFSCALE_PROGRAMS = ("tfscale.train", "tfscale.benchmark")


def with_backend(argv: list[str], backend: str) -> list[str]:
    """`argv` with `--config.distribute.backend=BACKEND` added for tfscale's own programs.

    The launcher's --backend decides the environment (TF_CONFIG or a Gloo rendezvous), so the config
    must say the same; an explicit override that contradicts it is an error, not a silent winner.
    """
    if not (len(argv) >= 2 and argv[0] == "-m" and argv[1] in _TFSCALE_PROGRAMS):
        return list(argv)
    prefix = "--config.distribute.backend="
    given = [arg[len(prefix):] for arg in argv if arg.startswith(prefix)]
    if given and given[-1] != backend:
        raise ValueError(
            f"--backend={backend} but the worker command says {prefix}{given[-1]}: drop the override "
            f"(the launcher sets it) or launch with --backend={given[-1]}"
        )
    return list(argv) if given else [*argv, prefix + backend]


def launch(
    argv: list[str],
    *,
    num_workers: int,
    backend: str = "mwms",
    threads_per_worker: int | None = None,
    grace_period_s: float = 10.0,
    env: dict | None = None,
) -> int:
    """Runs `sys.executable *argv` as `num_workers` workers of one job; returns the job's exit code.

    `threads_per_worker=None` gives each worker an equal share of the cores. `env` is the environment
    to inherit (default: this process's). Raises ValueError for bad arguments and LaunchError when the
    backend cannot start (e.g. horovod not installed); otherwise the exit code is 0 if every worker
    exited 0, else the first failing worker's code (128 + S for a worker killed by signal S).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not argv:
        raise ValueError("nothing to run: give the worker's Python arguments")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of: {', '.join(BACKENDS)}")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
    threads = threads_per_worker or default_threads_per_worker(num_workers)
    argv = with_backend(argv, backend)
    base_env = dict(os.environ if env is None else env)
    # Resolved now, not at import: callers (and pytest's capture) may have replaced the streams.
    out, err = sys.stdout, sys.stderr

    rendezvous = _HorovodRendezvous(num_workers) if backend == "horovod" else None
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    # The recorder stays installed through the clean-up too: a SIGTERM arriving then must not kill
    # the launcher before it has killed the workers.
    with _SignalRecorder() as signals:
        try:
            # Ports last, right before the workers start, to keep the window for port theft small.
            endpoint = rendezvous.port if rendezvous else free_ports(num_workers)
            _say(f"starting {num_workers} worker(s), backend {backend}, {threads} thread(s) each: "
                 f"{shlex.join([sys.executable, *argv])}")
            for rank in range(num_workers):
                overrides = worker_env(rank, num_workers, endpoint, backend, threads)
                procs.append(_spawn(rank, argv, _child_env(base_env, overrides, backend)))
                pumps.extend(_start_pumps(procs[-1], rank, out, err))
            return _supervise(procs, grace_period_s, signals)
        finally:
            _kill_all(procs)  # also on exceptions (a failed spawn, KeyboardInterrupt outside the handler)
            for pump in pumps:
                pump.join(timeout=PUMP_JOIN_TIMEOUT_S)
            if rendezvous:
                rendezvous.stop()


# ----------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tfscale.launch",
        usage="%(prog)s --num_workers=N [--backend=mwms|horovod] [--threads_per_worker=K] "
        "[--grace_period_s=10] -- <python args...>",
        description="Runs N local workers of one multi-worker job: sys.executable <python args...>.",
        allow_abbrev=False,
    )
    parser.add_argument("--num_workers", type=int, required=True, help="worker processes to start (>= 1)")
    parser.add_argument("--backend", choices=BACKENDS, default="mwms",
                        help="mwms: TF_CONFIG for MultiWorkerMirroredStrategy; horovod: Gloo rendezvous")
    parser.add_argument("--threads_per_worker", type=int, default=None,
                        help="OMP/TF thread pool size per worker (default: cores // num_workers, >= 1)")
    parser.add_argument("--grace_period_s", type=float, default=10.0,
                        help="seconds workers get to exit after SIGTERM before SIGKILL")
    return parser


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Launcher flags before `--`, the worker's Python arguments after it (never parsed here)."""
    parser = _parser()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("nothing to run: put the worker's Python arguments after --, e.g. -- -m tfscale.train ...")
    if args.num_workers < 1:
        parser.error(f"--num_workers must be >= 1, got {args.num_workers}")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        parser.error(f"--threads_per_worker must be >= 1, got {args.threads_per_worker}")
    if args.grace_period_s < 0:
        parser.error(f"--grace_period_s must be >= 0, got {args.grace_period_s:g}")
    return args, command


def main(argv: Sequence[str]) -> int:
    """The command line without the program name; returns the exit code (2 for usage errors)."""
    try:
        args, command = _parse(argv)
    except SystemExit as exit_:  # argparse reports usage errors (and --help) by exiting
        return int(exit_.code or 0)
    try:
        return launch(
            command,
            num_workers=args.num_workers,
            backend=args.backend,
            threads_per_worker=args.threads_per_worker,
            grace_period_s=args.grace_period_s,
        )
    except LaunchError as err:
        _say(f"error: {err}")
        return 1
    except ValueError as err:  # arguments that contradict each other; nothing was started
        _say(f"error: {err}")
        return 2


def run() -> None:
    """Console script `tfscale-launch`."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
