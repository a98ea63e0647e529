"""A worker whose launcher dies ends too: `kill -9` of `tfscale-launch`, the out-of-memory killer or a
closed terminal must not leave workers running with the workdir lock, their devices and no output.

The launcher's half (`tfscale.launch.supervise` uses it): each worker is started with the parent-death
signal SIGTERM (Linux prctl, `end_with_launcher`), so a worker that is still starting ends at once,
and learns the launcher's pid, grace period and log file (`worker_env`).

The worker's half: a tfscale program calls `follow_launcher()` at start-up (engine.setup). It turns
the parent-death signal off and watches the launcher from a thread instead, so that what happens
next is in order: the worker's output goes to the launcher's log file (or nowhere, if the launcher
wrote to a terminal or pipe that may have died with it) with a line saying why; then the worker gets
SIGTERM (tfscale's preemption path: every worker checkpoints at the same step and exits 75); and
whatever it is doing (a collective waiting for a peer that is gone, say) its whole process group is
killed `grace_period_s` later, as the launcher would have done.

The thread needs the GIL: TensorFlow releases it while a step or collective runs. Connecting the
cluster holds it, and there tfscale.cluster.distribute's watchdog process ends a worker that hangs.
Like the launcher, this module never imports TensorFlow.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
import threading
import time

LAUNCHER_POLL_INTERVAL_S = 0.2  # how often a worker checks that its launcher is alive (one getppid each)

# What the launcher tells each worker about itself, for `follow_launcher`.
LAUNCHER_PID_VAR = "TFSCALE_LAUNCHER_PID"
GRACE_PERIOD_VAR = "TFSCALE_GRACE_PERIOD_S"  # seconds from SIGTERM to SIGKILL, the launcher's --grace_period_s
LOG_FD_VAR = "TFSCALE_LAUNCHER_LOG_FD"  # an inherited fd of the launcher's log file (only a regular file)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ----------------------------------------------------------------------------------------------
# The launcher's half


def _prctl():
    """libc's prctl (Linux), or None where there is none: then only `follow_launcher`'s thread acts."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def end_with_launcher():
    """The function a worker runs between fork and exec: SIGTERM to it when the launcher dies; None
    without prctl.

    Everything it calls is looked up here, before the fork: the launcher has threads (output pumps),
    and a child may take no lock another thread held at the fork. The kernel sends the signal when the
    thread that forked ends, which in `tfscale-launch` is the main thread, i.e. the launcher itself.
    """
    prctl, launcher_pid = _prctl(), os.getpid()
    if prctl is None:
        return None
    getppid, exit_now, sigterm = os.getppid, os._exit, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if getppid() != launcher_pid:  # the launcher died before the signal was set: nobody would send it
            exit_now(128 + sigterm)

    return preexec


def launcher_log_fd() -> int | None:
    """A duplicate of the launcher's stderr for its workers to inherit, when it is a regular file (a batch
    job's log, `> log 2>&1`): there a worker whose launcher died still writes its last lines. None for
    a terminal or a pipe: those may close with the launcher, and writes to them would then fail."""
    try:
        return os.dup(2) if stat.S_ISREG(os.fstat(2).st_mode) else None
    except OSError:
        return None


def worker_env(grace_period_s: float, log_fd: int | None) -> dict[str, str]:
    """What a worker's `follow_launcher` needs to know, as environment variables."""
    env = {LAUNCHER_PID_VAR: str(os.getpid()), GRACE_PERIOD_VAR: f"{grace_period_s:g}"}
    if log_fd is not None:
        env[LOG_FD_VAR] = str(log_fd)
    return env


# ----------------------------------------------------------------------------------------------
# The worker's half


_following: list[int] = []  # the launcher pid `follow_launcher` watches, once it does


def follow_launcher() -> bool:
    """In a worker of `tfscale.launch`: end this worker in order when its launcher dies (module doc).

    Call once, early, from the main thread (the parent-death signal is the calling thread's); later
    calls do nothing. Returns True when this process is a launcher's worker and is now watched.
    """
    if _following:
        return True
    try:
        launcher_pid = int(os.environ[LAUNCHER_PID_VAR])
        grace_period_s = float(os.environ.get(GRACE_PERIOD_VAR, "10"))
    except (KeyError, ValueError):
        return False
    if os.getppid() != launcher_pid and _pid_exists(launcher_pid):
        return False  # a grandchild that inherited the variables: the launcher is not this process's parent
    log_fd = _inherited_log_fd(os.environ.get(LOG_FD_VAR))
    for name in (LAUNCHER_PID_VAR, GRACE_PERIOD_VAR, LOG_FD_VAR):
        os.environ.pop(name, None)  # this process's own subprocesses have another parent
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # from here on the thread acts: output first, then the signal
    _following.append(launcher_pid)
    threading.Thread(target=_watch_launcher, args=(launcher_pid, grace_period_s, log_fd), name="launcher-watch",
                     daemon=True).start()
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _inherited_log_fd(value: str | None) -> int | None:
    try:
        fd = int(value)
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (TypeError, ValueError, OSError):
        return None


def _watch_launcher(launcher_pid: int, grace_period_s: float, log_fd: int | None) -> None:
    """Waits for the launcher to die (this process then has another parent), then stops this worker:
    output to the launcher's log (or nowhere), SIGTERM, and SIGKILL to its process group after
    `grace_period_s`, whatever it was doing."""
    while os.getppid() == launcher_pid:
        time.sleep(LAUNCHER_POLL_INTERVAL_S)
    # Output first: the pipes to the launcher are broken, and the SIGTERM handler's lines must land.
    _redirect_output(log_fd)
    rank = os.environ.get("TFSCALE_LOCAL_RANK", "?")
    _say_orphaned(f"[rank {rank}] tfscale: the launcher (pid {launcher_pid}) is gone; stopping this worker with "
                  f"SIGTERM (tfscale programs checkpoint and exit 75), SIGKILL in {grace_period_s:g} s if it "
                  "still runs. Rerun the same launch command to resume")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_period_s)
    _say_orphaned(f"[rank {rank}] tfscale: still running {grace_period_s:g} s after its launcher died; "
                  "sending SIGKILL to its process group")
    # Own session (the launcher's start_new_session): the group is this worker and its subprocesses.
    os.killpg(os.getpgrp(), signal.SIGKILL) if os.getpgrp() == os.getpid() else os.kill(os.getpid(), signal.SIGKILL)


def _redirect_output(log_fd: int | None) -> None:
    """Points this process's stdout and stderr at `log_fd`, else at /dev/null."""
    target = log_fd if log_fd is not None else os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(target, fd)


def _say_orphaned(message: str) -> None:
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
