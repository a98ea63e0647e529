"""What a staging destination records about itself, and the lock that gives it one copier per node.

Files in dest_dir besides the staged shards and manifests (all dot files: shard globs never see them):
  `.tfscale-staged.json`    size, mtime_ns and sha256 of each verified staged file (`load_state`)
  `.tfscale-shards.json`    {split: every source shard name, in reading order} (tfscale.data.input.shard_list)
  `.tfscale-stage.lock`     flock'ed by the copier; holds "pid P on HOST" for the waiters' messages
  `.tfscale-partial-*`      shards being copied; `.{name}.tmp-{pid}` for the JSON files and manifests
                            (tfscale.io's atomic writes). Both are removed by the next lock holder.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import socket
import time

from absl import logging

from tfscale import io as tfio
from tfscale.data.input.shard_list import SHARD_LIST_FILE
from tfscale.errors import StageError

STATE_FILE = ".tfscale-staged.json"
LOCK_FILE = ".tfscale-stage.lock"
PARTIAL_PREFIX = ".tfscale-partial-"  # temp names; dot files, so shard globs never see them
_STATE_VERSION = 1
_LOCK_POLL_MAX_S = 0.1  # how late a waiter may notice the copier is done
# Files written with tfio's atomic writes: their temporaries are ours to clean up.
_ATOMICALLY_WRITTEN = (STATE_FILE, SHARD_LIST_FILE, *tfio.MANIFEST_GLOBS)


# --------------------------------------------------------------------------------------- records


def load_state(dest_dir: str) -> dict[str, dict]:
    """{name: {"size", "mtime_ns", "sha256"}} of files verified when staged; {} when unknown."""
    path = os.path.join(dest_dir, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
        if state.get("version") == _STATE_VERSION and isinstance(state.get("files"), dict):
            return {name: record for name, record in state["files"].items() if isinstance(record, dict)}
    except FileNotFoundError:
        return {}
    except (ValueError, AttributeError):
        pass
    # Losing the records costs one re-hash of what is staged, not correctness.
    logging.warning("ignoring unreadable %s: staged files will be re-verified", path)
    return {}


def save_state(dest_dir: str, records: dict[str, dict]) -> None:
    """Atomic (temp + rename): a crash leaves the old or the new state, never half of one."""
    tfio.write_json(os.path.join(dest_dir, STATE_FILE), {"version": _STATE_VERSION, "files": records}, indent=0,
                    sort_keys=True)


# ------------------------------------------------------------------------------------------ lock


def _lock_holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "unknown process"
    except OSError:
        return "unknown process"


def acquire_lock(dest_dir: str, timeout_s: float) -> tuple[int, float]:
    """(fd holding an exclusive flock on dest_dir's lock file, seconds waited for it).

    flock has no timeout, so this polls a non-blocking flock. The lock file is never deleted:
    deleting it would let a late process lock a new file while another still holds the old one.
    flock is per node on most parallel file systems, which is why dest_dir should be node-local.
    """
    path = os.path.join(dest_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    start_s = time.monotonic()
    poll_s = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited_s = time.monotonic() - start_s
            if poll_s == 0.01:  # the first miss: say once why this process is idle
                logging.info("waiting for %s: %s is staging into %s", path, _lock_holder(path), dest_dir)
            if waited_s >= timeout_s:
                os.close(fd)
                raise StageError(f"timed out after {waited_s:.1f} s waiting for the staging lock {path}, held by "
                                 f"{_lock_holder(path)}; raise lock_timeout_s if staging is just slow") from None
            time.sleep(min(poll_s, max(timeout_s - waited_s, 0.001)))
            poll_s = min(2 * poll_s, _LOCK_POLL_MAX_S)
    # Who holds it, for the waiters' messages.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd, time.monotonic() - start_s


def remove_partial_files(dest_dir: str) -> list[str]:
    """Deletes temp files a crashed copier left. Only call while holding the lock: then none is live."""
    stale = sorted(glob.glob(os.path.join(glob.escape(dest_dir), f"{PARTIAL_PREFIX}*")))
    for name_glob in _ATOMICALLY_WRITTEN:
        stale += tfio.temp_files(dest_dir, name_glob)
    for path in stale:
        tfio.remove_quietly(path)
    return stale
