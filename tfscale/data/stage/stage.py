"""Stage TFRecord shards from the shared file system to node-local storage before training.

    python tools/stage_data.py --src_dir=/lustre/imagenet/tfrecords [--dest_dir=$TMPDIR/tfscale_data] \
        [--splits=train,validation] [--verify=sha256|size] [--read_attempts=4 --read_retry_delay_s=1] \
        [--num_workers=8 --worker_ranks=0-3 [--assignment=coarse|... --copies=2]] \
        [--config=configs/r50_32gpu.py --config.data.assignment=...]   # splits and assignment from it

Reading 140 GB of ImageNet shards from a parallel file system every epoch, from every node, loads the
shared servers and makes input speed depend on everybody else's jobs. Staging copies the shards a node
needs once, at job start, to node-local SSD ($TMPDIR); training then reads the local copy.

Which shards a node needs: every eval shard (evaluation reads example i on worker i mod W from every
file), and of the train shards only those its workers read. Given the node's worker ranks, the
worker count and the assignment scheme (`Readers`), the train shards are chosen exactly as
tfscale.data.input.pipeline assigns them: whole files by tfscale.data.input.assignment when there are at least as
many files as workers, else every file (each worker then keeps every W-th example of all of them).
Without ranks every shard is staged. Every worker must still number the train files as in the full
directory to find its own, so staging records each split's source shard names, in reading order, in
`.tfscale-shards.json` in dest_dir (`read_shard_list`); the input pipeline lists a staged copy's
shards from it.

What makes it safe to call from every process of every node (and to re-run):
  * One copier per node. Every process calls `stage()`; an exclusive `fcntl.flock` on a lock file in
    dest_dir lets exactly one copy while the others block (bounded by `lock_timeout_s`). Afterwards
    the waiters find everything staged and return. The kernel drops the lock of a process that dies,
    so a waiter takes over from a crashed copier and finishes the job.
  * Nothing unverified under a final name. Each shard is written to a temp name in dest_dir, checked
    (size against the manifest's `bytes`, and with verify="sha256" the sha256 computed while copying,
    so the source is read once) and only then renamed into place.
  * A copy that does not match its manifest is made once more (a flaky read is not a bad shard);
    a second mismatch is an error naming the shard, the expected and the observed sha256 (or size):
    the shared copy is bad and is not staged.
  * Transient read errors of the shared file system (EIO, ESTALE "stale file handle", EAGAIN,
    ETIMEDOUT, ENOTCONN) are retried, each retry logged with the path and errno: `read_attempts`
    tries of the same read (default 4), waiting `read_retry_delay_s` (default 1 s), doubled each time.
    After the last one, an error names the path, the errno and the attempts. Other errors (ENOENT,
    EACCES, ENOSPC writing dest_dir) fail at once, naming the file.
  * Resumable without re-hashing. `.tfscale-staged.json` in dest_dir records size, mtime_ns and
    sha256 of each staged file, saved after each copy. A file whose size and mtime still match its
    record is trusted; any other file already present is hashed again and re-copied if it does not
    match. A node killed mid-copy leaves only temp files: the next run deletes them and copies what
    is missing (a half-copied shard from its start).
  * Free space is checked before the first byte is copied: too little is an error naming dest_dir,
    the bytes needed and the bytes free.
  * Progress of long copies (bytes, files, MB/s): a bar on a terminal, a log line every
    `progress_every_s` seconds otherwise (batch jobs).
Shards with a manifest (`manifest-{split}.json` written by tfscale's converter, or the older
`{split}-manifest.json`) are verified against it; the manifests are staged too, so the input pipeline
finds them. Shards from other tools are found by name (`{split}-*-of-*`) and verified by size only.

The parts: tfscale.data.stage.stage_plan (which shards: `Readers`, `plan`), tfscale.data.stage.stage_state (state
and shard-list records, the lock, cleanup), tfscale.data.stage.stage_copy (checking, copying, progress).
This module runs them under the lock (`stage`) and is the command-line tool.

This module must stay cheap to import: no TensorFlow (it runs as its own step on each node).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Iterable

from absl import app, flags, logging

from tfscale import cli
from tfscale.config.names import ASSIGNMENT_SCHEMES
from tfscale.data.input.shard_list import SHARD_LIST_FILE, read_shard_list, save_shard_lists
from tfscale.data.stage import stage_copy
from tfscale.data.stage.stage_copy import BYTES_PER_MB, READ_ATTEMPTS, READ_RETRY_FIRST_DELAY_S, VERIFY_MODES, ReadRetry
from tfscale.data.stage.stage_plan import Readers, Shard, parse_ranks, plan
from tfscale.data.stage.stage_state import (LOCK_FILE, PARTIAL_PREFIX, STATE_FILE, StageError, acquire_lock, load_state,
                                            remove_partial_files, save_state)

# The names users of staging (the input pipeline, job scripts, tests) reach through this module.
__all__ = ["LOCK_FILE", "PARTIAL_PREFIX", "SHARD_LIST_FILE", "STATE_FILE", "VERIFY_MODES", "Readers", "StageError",
           "StageReport", "default_stage_root", "parse_ranks", "read_shard_list", "run", "stage"]
_DEFAULT_NUM_THREADS = 4  # a few streams: one stream rarely gets a parallel file system's bandwidth
_DEFAULT_PROGRESS_EVERY_S = 30.0  # log-line progress interval when stderr is not a terminal


@dataclasses.dataclass
class StageReport:
    """What one `stage()` call did. Counts are of shards; manifests are not counted."""

    dest_dir: str
    files_copied: int
    files_skipped: int  # already staged and valid
    bytes_copied: int
    seconds: float  # work of this call after it got the lock (checking + copying)
    mb_per_s: float  # bytes_copied / 1e6 / seconds
    copied_by_this_process: bool  # True when this call copied at least one shard
    lock_wait_seconds: float = 0.0  # time spent waiting for another process's copy


def default_stage_root() -> str:
    """$TMPDIR (on many clusters Slurm sets a per-job node-local one), else /tmp."""
    return os.environ.get("TMPDIR") or "/tmp"


# ------------------------------------------------------------------------------------------- stage


def _check_args(src_dir: str, dest_dir: str, verify: str) -> None:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"source directory {src_dir} does not exist (or is not a directory)")
    if os.path.isdir(dest_dir) and os.path.samefile(src_dir, dest_dir):
        raise ValueError(f"src_dir and dest_dir are the same directory: {src_dir}")


def _stage_locked(src_dir: str, dest_dir: str, shards: list[Shard], manifests: list[str],
                  shard_lists: dict[str, list[str]], verify: str, num_threads: int,
                  progress_every_s: float, read_retry: ReadRetry) -> tuple[int, int]:
    """The work of the lock holder; (files copied, bytes copied)."""
    stale = remove_partial_files(dest_dir)
    if stale:
        logging.info("removed %d partial files of an interrupted staging run in %s", len(stale), dest_dir)
    old_records = load_state(dest_dir)
    records = dict(old_records)  # entries of files outside this plan stay: another call may have staged them
    to_copy = []

    def keep_or_copy(shard, record):
        if record is None:
            records.pop(shard.name, None)
            to_copy.append(shard)
        else:
            records[shard.name] = record

    # Hashing only happens for files whose record is missing or stale; threads overlap those reads.
    stage_copy.run_parallel(lambda s: stage_copy.check_staged(src_dir, dest_dir, s, old_records.get(s.name), verify),
                            shards, num_threads, keep_or_copy)
    order = {shard.name: i for i, shard in enumerate(shards)}
    to_copy.sort(key=lambda s: order[s.name])  # plan order (checks finish in any order)
    if records != old_records:
        save_state(dest_dir, records)
    sizes = stage_copy.source_sizes(src_dir, to_copy)
    manifest_bytes = sum(os.path.getsize(os.path.join(src_dir, name)) for name in manifests)
    if to_copy:
        stage_copy.check_free_space(dest_dir, sum(sizes.values()) + manifest_bytes)
    copied = []
    progress = stage_copy.Progress(sum(sizes.values()), len(to_copy), progress_every_s)

    def record_copy(shard, record):
        records[shard.name] = record
        copied.append(shard.name)
        save_state(dest_dir, records)  # after every file: a crash loses at most the copies under way
        progress.file_done()

    try:
        stage_copy.run_parallel(
            lambda s: stage_copy.copy_verified(src_dir, dest_dir, s, sizes[s.name], verify, progress.add_bytes,
                                               read_retry),
            to_copy, num_threads, record_copy)
    finally:
        progress.close()
    # Last, so that the manifests and lists only appear once all the shards they list are in place.
    stage_copy.stage_manifests(src_dir, dest_dir, manifests)
    save_shard_lists(dest_dir, shard_lists)
    return len(copied), sum(sizes[name] for name in copied)


def _log_report(report: StageReport, src_dir: str) -> None:
    if report.files_copied:
        logging.info("staged %s -> %s: copied %d files, %.1f MB in %.2f s = %.1f MB/s (%d already staged)",
                     src_dir, report.dest_dir, report.files_copied, report.bytes_copied / BYTES_PER_MB,
                     report.seconds, report.mb_per_s, report.files_skipped)
    else:
        logging.info("already staged: %d files in %s (checked in %.2f s, waited %.2f s for the lock)",
                     report.files_skipped, report.dest_dir, report.seconds, report.lock_wait_seconds)


def stage(src_dir: str, dest_dir: str, *, splits: Iterable[str] = ("train", "validation"),
          files: list[str] | None = None, train_split: str | None = "train", readers: Readers | None = None,
          verify: str = "sha256", lock_timeout_s: float = 3600.0, num_threads: int = _DEFAULT_NUM_THREADS,
          progress_every_s: float = _DEFAULT_PROGRESS_EVERY_S, read_attempts: int = READ_ATTEMPTS,
          read_retry_delay_s: float = READ_RETRY_FIRST_DELAY_S) -> StageReport:
    """Copies the shards a node needs from `src_dir` to `dest_dir` (node-local), verified; see the module doc.

    Args:
      src_dir: the shards on the shared file system, with `manifest-{split}.json` where there is one.
      dest_dir: node-local directory (created if needed), e.g. under `default_stage_root()`.
      splits: stage the shards of these splits: those their manifest lists, else `{split}-*-of-*`.
      files: instead of `splits`, exactly these file names in src_dir; verified against any manifest
        in src_dir that lists them. Manifests are not added.
      train_split: the split `readers` applies to (None: none, e.g. when it is also evaluated on).
      readers: this node's training workers and the assignment scheme: of `train_split` only the
        shards they read are staged. None: every shard.
      verify: "sha256" (size and hash against the manifest) or "size" (size only, no hashing).
      lock_timeout_s: how long a process waits for another one's copy before giving up with an error.
      num_threads: files copied (and hashed) at once.
      progress_every_s: without a terminal, a progress log line at most this often (seconds).
      read_attempts: tries of a source read that fails transiently (EIO, ESTALE, ...) before giving up.
      read_retry_delay_s: wait after the first failed try (seconds); doubled after each further one.

    Returns:
      A StageReport. Every process of a node may call this at once: one copies, the rest wait and
      return with copied_by_this_process=False.
    """
    if isinstance(splits, str):
        splits = (splits,)
    _check_args(src_dir, dest_dir, verify)
    read_retry = ReadRetry(read_attempts, read_retry_delay_s)
    shards, manifests, shard_lists = plan(src_dir, splits, files, train_split=train_split, readers=readers)
    os.makedirs(dest_dir, exist_ok=True)
    fd, lock_wait_s = acquire_lock(dest_dir, lock_timeout_s)
    try:
        start_s = time.monotonic()
        files_copied, bytes_copied = _stage_locked(src_dir, dest_dir, shards, manifests, shard_lists, verify,
                                                   num_threads, progress_every_s, read_retry)
        seconds = time.monotonic() - start_s
    finally:
        os.close(fd)  # releases the flock: the next waiter goes
    report = StageReport(
        dest_dir=dest_dir, files_copied=files_copied, files_skipped=len(shards) - files_copied,
        bytes_copied=bytes_copied, seconds=seconds, mb_per_s=bytes_copied / BYTES_PER_MB / max(seconds, 1e-9),
        copied_by_this_process=files_copied > 0, lock_wait_seconds=lock_wait_s,
    )
    _log_report(report, src_dir)
    return report


# --------------------------------------------------------------------------------------------- CLI


_FLAG_NAMES = ("src_dir", "dest_dir", "splits", "files", "train_split", "num_workers", "worker_ranks", "assignment",
               "copies", "config", "verify", "lock_timeout_s", "num_threads", "progress_every_s", "read_attempts",
               "read_retry_delay_s")
# What --config decides (from config.data); giving one of these flags as well would be two answers.
_CONFIG_DECIDES = ("splits", "train_split", "assignment", "copies")


def _define_flags() -> None:
    """Flags exist only when the tool runs: importing this module (the input pipeline does) adds none."""
    if "src_dir" in flags.FLAGS:
        return
    from ml_collections import config_flags  # no TensorFlow: config files build ConfigDicts only

    flags.DEFINE_string("src_dir", None, "Shards (and manifest-{split}.json) on the shared file system.")
    flags.DEFINE_string("dest_dir", None, "Node-local directory to stage into; default: "
                        "$TMPDIR/tfscale_data (/tmp/tfscale_data without $TMPDIR).")
    flags.DEFINE_list("splits", ["train", "validation"], "Splits to stage.")
    flags.DEFINE_list("files", None, "Exactly these file names in src_dir instead of --splits.")
    flags.DEFINE_string("train_split", "train", "The split --worker_ranks applies to; other splits are staged whole.")
    flags.DEFINE_integer("num_workers", None, "Training workers of the whole job (with --worker_ranks).")
    flags.DEFINE_string("worker_ranks", None, "This node's training workers, e.g. 0,1,2,3 or 0-3: only the train "
                        "shards they read are staged. Default: every shard.")
    flags.DEFINE_enum("assignment", "disjoint", ASSIGNMENT_SCHEMES, "config.data.assignment of the training run.")
    flags.DEFINE_integer("copies", 2, "config.data.copies of the training run (coarse, medium_coarse, fine_grained, overlap).")
    config_flags.DEFINE_config_file("config", None, "The training config (+ its --config.* overrides): splits and "
                                    "assignment come from its data section instead of the flags above.")
    flags.DEFINE_enum("verify", "sha256", VERIFY_MODES, "sha256: size and hash against the manifest; "
                      "size: size only.")
    flags.DEFINE_float("lock_timeout_s", 3600.0, "Seconds to wait for another process's staging.")
    flags.DEFINE_integer("num_threads", _DEFAULT_NUM_THREADS, "Files copied at once.")
    flags.DEFINE_float("progress_every_s", _DEFAULT_PROGRESS_EVERY_S, "Without a terminal: seconds between "
                       "progress log lines.")
    flags.DEFINE_integer("read_attempts", READ_ATTEMPTS, "Tries of a source read failing with a transient error "
                         "(EIO, ESTALE, EAGAIN, ETIMEDOUT, ENOTCONN) before staging gives up.", lower_bound=1)
    flags.DEFINE_float("read_retry_delay_s", READ_RETRY_FIRST_DELAY_S, "Seconds to wait after the first failed "
                       "try of a read; doubled after each further one.", lower_bound=0.0)
    flags.mark_flags_as_required(["src_dir"])
    cli.make_key_flags(_FLAG_NAMES)


def _selection(f) -> tuple[list[str], str | None, Readers | None]:
    """(splits, train split, readers) from the flags, or from --config's data section."""
    splits, train_split, scheme, copies, level = f.splits, f.train_split, f.assignment, f.copies, "auto"
    if f.config is not None:
        both = [f"--{name}" for name in _CONFIG_DECIDES if f[name].present]
        if both:
            raise app.UsageError(f"{', '.join(both)} and --config both decide this; --config's data section wins "
                                 "for training, so drop the flags (or override --config.data.*)")
        data = f.config.data
        splits, train_split = list(dict.fromkeys([data.train_split, data.eval_split])), data.train_split
        scheme, copies, level = data.assignment, data.copies, data.assignment_level
        if data.eval_split == data.train_split:
            train_split = None  # every worker evaluates from every file of it: no per-worker share
    if (f.num_workers is None) != (f.worker_ranks is None):
        raise app.UsageError("--num_workers and --worker_ranks go together (or neither: stage every shard)")
    if f.num_workers is None:
        return splits, train_split, None
    if f.files is not None:
        raise app.UsageError("--files names exactly what to stage: it takes no --num_workers/--worker_ranks")
    return splits, train_split, Readers(parse_ranks(f.worker_ranks), f.num_workers, scheme, copies, level)


def _stage_from_flags(f: flags.FlagValues) -> None:
    splits, train_split, readers = _selection(f)
    report = stage(f.src_dir, f.dest_dir or os.path.join(default_stage_root(), "tfscale_data"), splits=splits,
                   files=f.files, train_split=train_split, readers=readers, verify=f.verify,
                   lock_timeout_s=f.lock_timeout_s, num_threads=f.num_threads, progress_every_s=f.progress_every_s,
                   read_attempts=f.read_attempts, read_retry_delay_s=f.read_retry_delay_s)
    print(report.dest_dir)  # stdout: for job scripts, DATA_DIR=$(python tools/stage_data.py ...)
    sys.stdout.flush()


def run(argv: list[str] | None = None) -> None:
    """Entry point of tools/stage_data.py and `python -m tfscale.data.stage`."""
    cli.run_tool(_stage_from_flags, define_flags=_define_flags, errors=(StageError, *cli.INPUT_ERRORS), argv=argv)


if __name__ == "__main__":
    run()
