"""Process supervision for `tfscale.launch`: starts the workers, prefixes their output, stops the job.

The launcher builds each worker's environment (`launch.py`); this module runs the workers as one job.
It prefixes worker output with `[rank r] `, forwards SIGINT/SIGTERM (Slurm sends SIGTERM before
killing a job, and the workers checkpoint on it), stops the whole job as soon as one worker fails,
and returns the first failing worker's code. Workers run in their own sessions so that the
supervisor can signal and kill each worker's whole process group, grandchildren included: no process
it started outlives it. Like the launcher, it never imports TensorFlow.

A launcher that dies without that clean-up (`kill -9`, the out-of-memory killer, a closed terminal)
takes its workers with it: `tfscale.launch.launcher_death`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from tfscale.launch import launcher_death

POLL_INTERVAL_S = 0.05  # how often the supervisor checks its workers; sets the reaction latency
PUMP_JOIN_TIMEOUT_S = 5.0  # how long to wait for the last output lines once every worker is gone

# One lock for every line the launcher writes, so a line never interleaves with another, even when
# stdout and stderr are the same terminal or file.
_OUTPUT_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------
# Output


def say(message: str) -> None:
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


def _spawn(command: Sequence[str], env: dict[str, str], log_fd: int | None) -> subprocess.Popen:
    return subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,  # N workers must not compete for the terminal
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Own session = own process group: the launcher can kill a worker with its grandchildren,
        # and a terminal Ctrl-C reaches the workers once, through the launcher, not twice.
        start_new_session=True,
        preexec_fn=launcher_death.end_with_launcher(),
        pass_fds=() if log_fd is None else (log_fd,),
    )


class SignalRecorder:
    """Records SIGINT/SIGTERM for the supervise loop instead of dying, while installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "SignalRecorder":
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


def run_workers(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict[str, str]],
    grace_period_s: float,
    signals: SignalRecorder,
    out: IO[str],
    err: IO[str],
) -> int:
    """Runs worker `rank`'s command `commands[rank]` with the environment `envs[rank]`,
    its output copied to `out`/`err` with a `[rank r] ` prefix; returns the job's exit code.

    The job stops on a signal `signals` records or the first failure (`_supervise`); however it ends,
    every worker is killed and reaped before this returns.
    """
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    log_fd = launcher_death.launcher_log_fd()
    about_launcher = launcher_death.worker_env(grace_period_s, log_fd)
    try:
        for rank, (command, env) in enumerate(zip(commands, envs, strict=True)):
            procs.append(_spawn(command, {**env, **about_launcher}, log_fd))
            pumps.extend(_start_pumps(procs[-1], rank, out, err))
        return _supervise(procs, grace_period_s, signals)
    finally:
        _kill_all(procs)  # also on exceptions (a failed spawn, KeyboardInterrupt outside the handler)
        if log_fd is not None:
            os.close(log_fd)
        for pump in pumps:
            pump.join(timeout=PUMP_JOIN_TIMEOUT_S)


def _supervise(procs: Sequence[subprocess.Popen], grace_period_s: float, signals: SignalRecorder) -> int:
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
        forwarded_before, forwarded = forwarded, _forward_signals(procs, signals, forwarded)
        if forwarded > forwarded_before:
            stop_after_grace()

        for rank, code in _newly_exited(procs, exited):
            if code == 0 or first_failure is not None:
                continue
            first_failure = code
            if kill_deadline_s is not None:  # already stopping: this code is simply the job's result
                say(f"rank {rank} exited with {_describe_code(code)}")
                continue
            _stop_others(procs, rank, code)
            stop_after_grace()

        if kill_deadline_s is not None and time.monotonic() >= kill_deadline_s:
            _kill_stragglers(procs, grace_period_s)
            kill_deadline_s = float("inf")  # killed once; SIGKILL cannot be ignored, so just reap
        time.sleep(POLL_INTERVAL_S)
    return first_failure or 0


def _forward_signals(procs: Sequence[subprocess.Popen], signals: SignalRecorder, forwarded: int) -> int:
    """Forwards the signals received after the first `forwarded` ones to the running workers;
    returns how many have been forwarded now (all received so far)."""
    while forwarded < len(signals.received):
        sig = signals.received[forwarded]
        forwarded += 1
        running = _running(procs)
        say(f"received {signal.Signals(sig).name}; forwarding it to {len(running)} worker(s)")
        for proc in running:
            _signal_group(proc, sig)
    return forwarded


def _newly_exited(procs: Sequence[subprocess.Popen], exited: set[int]) -> list[tuple[int, int]]:
    """(rank, exit code) of the workers that exited since the last call; adds their ranks to `exited`."""
    new = []
    for rank, proc in enumerate(procs):
        if rank in exited or proc.poll() is None:
            continue
        exited.add(rank)
        new.append((rank, exit_code(proc.returncode)))
    return new


def _stop_others(procs: Sequence[subprocess.Popen], rank: int, code: int) -> None:
    """SIGTERMs the workers still running after worker `rank` failed with `code`."""
    others = _running(procs)
    say(f"rank {rank} exited with {_describe_code(code)}; stopping the other {len(others)} worker(s)")
    for other in others:
        _signal_group(other, signal.SIGTERM)


def _kill_stragglers(procs: Sequence[subprocess.Popen], grace_period_s: float) -> None:
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            say(f"rank {rank} still running {grace_period_s:g} s after being stopped; sending SIGKILL")
            _signal_group(proc, signal.SIGKILL)


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILLs every worker's process group and reaps the workers: nothing outlives the launcher."""
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()

