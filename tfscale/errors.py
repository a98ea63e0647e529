"""Every error tfscale names for the user to act on, the exit code each ends a process with, and how
it is said: one line, the file, key or value at fault in it.

The exit codes follow sysexits.h, so that a batch script can tell "requeue" from "fix the input"
(docs/reliability.md lists them). The bottom of the import graph: the standard library only, so the
launcher, the staging tool and the pure-Python planners can all use it without TensorFlow.
"""

from __future__ import annotations

import re

# --- exit codes -------------------------------------------------------------------------------------

EXIT_CONFIG = 1  # the run's config cannot run (or would change a resumed run's result): fix it
EXIT_CHECKPOINT = 1  # no usable checkpoint in a workdir that has some
EXIT_USAGE = 2  # argparse's and absl's convention for usage errors
EXIT_CORRUPT_DATA = 65  # EX_DATAERR: a shard cut short, a record that does not decode, a manifest that is not JSON
EXIT_MISSING_DATA = 66  # EX_NOINPUT: the data directory, a split, a listed shard or the TFDS dataset is not there
EXIT_CLUSTER_UNAVAILABLE = 69  # EX_UNAVAILABLE: the cluster did not come up
EXIT_WORKDIR_BUSY = 73  # EX_CANTCREAT: another live job holds the workdir
EXIT_WRITE_FAILED = 74  # EX_IOERR: a checkpoint, metrics or summary write failed (disk full, quota)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM, checkpoint saved: rerun the same command (requeue) to resume


# --- the named errors -------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config that cannot run: the message names the key, its value and what to set instead."""


class ManifestError(ValueError):
    """A manifest exists but cannot be used (not JSON, no list of shards); the message names the file."""


class MissingDataError(FileNotFoundError):
    """Data a run's config names is not there (a directory, a split, a listed shard, a prepared TFDS dataset)."""


class CorruptDataError(ValueError):
    """A shard or a record in it cannot be read; the message names the file (and record)."""


DATA_FAULTS = (CorruptDataError, ManifestError, MissingDataError)


class WriteError(OSError):
    """A run's file could not be written (disk full, quota, permissions); names the path and the free space."""


class WorkdirBusy(RuntimeError):
    """Another live job holds the workdir; the message names its host and pid."""


class CheckpointError(RuntimeError):
    """The workdir has checkpoints, and none of them can be restored; the message names each and why."""


class StageError(RuntimeError):
    """Staging cannot go on: a bad source shard, too little space, a lock timeout."""


class DaliIndexError(OSError):
    """A DALI index cannot be written; the message names the file and the key that moves it."""


class TruncatedShard(DaliIndexError):
    """A shard's last record runs past the end of the file; the message names the shard."""


class LaunchError(RuntimeError):
    """The job cannot be started (e.g. the backend's library is missing); nothing was launched."""


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint of `step` is saved and the run can be resumed."""

    def __init__(self, step: int):
        super().__init__(f"preempted: checkpoint saved at step {step}; rerun the same command to resume")
        self.step = step


class ChiefRefused(RuntimeError):
    """A non-chief worker's view of the chief refusing the workdir: same exit code, the reason is in rank 0's log."""

    def __init__(self, exit_code: int):
        super().__init__(f"the chief (rank 0) refused the workdir (exit code {exit_code}); its log says why")
        self.exit_code = exit_code


class ClusterUnavailable(SystemExit):
    """The cluster did not come up: the process exits with EXIT_CLUSTER_UNAVAILABLE unless caught.

    A SystemExit, so that `train`/`benchmark` end with code 69 whatever they catch as errors; the
    message (logged when raised) names the workers, port or host names at fault.
    """

    def __init__(self, message: str):
        super().__init__(EXIT_CLUSTER_UNAVAILABLE)
        self.message = message

    def __str__(self) -> str:
        return self.message


_EXIT_CODES = ((Preempted, EXIT_PREEMPTED), (WorkdirBusy, EXIT_WORKDIR_BUSY), (WriteError, EXIT_WRITE_FAILED),
               (ConfigError, EXIT_CONFIG), (CheckpointError, EXIT_CHECKPOINT), (MissingDataError, EXIT_MISSING_DATA),
               (CorruptDataError, EXIT_CORRUPT_DATA), (ManifestError, EXIT_CORRUPT_DATA))


def exit_code(err: BaseException) -> int:
    """The process exit code for an error that ends a run (1 for anything unforeseen)."""
    if isinstance(err, ChiefRefused):
        return err.exit_code
    return next((code for kind, code in _EXIT_CODES if isinstance(err, kind)), 1)


# --- one line ---------------------------------------------------------------------------------------


def one_line(err: BaseException) -> str:
    """`err`'s message on one line; TensorFlow's start with the op's internal function name, dropped."""
    text = " ".join(str(getattr(err, "message", err)).split())
    return re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)


def fatal(kind: str, err: BaseException | str, code: int | None = None) -> str:
    """The line a process ends on for an error the user must act on: `FATAL <kind> error: <what>`, with
    the exit code when it is not the generic 1, so that the log says what a batch script will see."""
    line = f"FATAL {kind} error: {err}"
    return f"{line} (exit code {code})" if code is not None else line
