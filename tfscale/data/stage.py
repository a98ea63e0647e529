"""Stage TFRecord shards from the shared file system to node-local storage before training.

    python tools/stage_data.py --src_dir=/lustre/imagenet/tfrecords [--dest_dir=$TMPDIR/tfscale_data] \
        [--splits=train,validation] [--verify=sha256|size] \
        [--num_workers=8 --worker_ranks=0-3 [--assignment=disjoint|overlap|full --overlap_copies=2]] \
        [--config=configs/r50_32gpu.py --config.data.assignment=...]   # splits and assignment from it

Reading 140 GB of ImageNet shards from a parallel file system every epoch, from every node, loads the
shared servers and makes input speed depend on everybody else's jobs. Staging copies the shards a node
needs once, at job start, to node-local SSD ($TMPDIR); training then reads the local copy.

Which shards a node needs: every eval shard (evaluation reads example i on worker i mod W from every
file), and of the train shards only those its workers read. Given the node's worker ranks, the
worker count and the assignment scheme (`Readers`), the train shards are chosen exactly as
tfscale.data.pipeline assigns them: whole files by tfscale.data.assignment when there are at least as
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
    so the source is read once) and only then renamed into place. A *source* that does not match its
    manifest is an error: the shared copy is bad and is not staged.
  * Resumable without re-hashing. `.tfscale-staged.json` in dest_dir records size, mtime_ns and
    sha256 of each staged file. A file whose size and mtime still match its record is trusted; any
    other file already present is hashed again and re-copied if it does not match.
  * Free space is checked before the first byte is copied.
  * Progress of long copies (bytes, files, MB/s): a bar on a terminal, a log line every
    `progress_every_s` seconds otherwise (batch jobs).
Shards with a manifest (`manifest-{split}.json` written by tfscale's converter, or the older
`{split}-manifest.json`) are verified against it; the manifests are staged too, so the input pipeline
finds them. Shards from other tools are found by name (`{split}-*-of-*`) and verified by size only.

This module must stay cheap to import: no TensorFlow (it runs as its own step on each node).
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from concurrent import futures
from typing import Iterable

from absl import app, flags, logging
from tqdm import tqdm

from tfscale.data import assignment

STATE_FILE = ".tfscale-staged.json"
SHARD_LIST_FILE = ".tfscale-shards.json"  # {split: source shard names}: how workers number a partial copy
LOCK_FILE = ".tfscale-stage.lock"
PARTIAL_PREFIX = ".tfscale-partial-"  # temp names; dot files, so shard globs never see them
VERIFY_MODES = ("sha256", "size")
_STATE_VERSION = 1
# A split's manifest: the converter's name, then the one older versions wrote (which split globs match).
_MANIFEST_FORMATS = ("manifest-{split}.json", "{split}-manifest.json")
_MANIFEST_GLOBS = ("manifest-*.json", "*-manifest.json")
_COPY_CHUNK_BYTES = 8 << 20  # large sequential reads suit parallel file systems
# Kept free beyond the data: a file system that fills to the last block slows down and breaks other users.
_FREE_MARGIN_BYTES = 64 << 20
_LOCK_POLL_MAX_S = 0.1  # how late a waiter may notice the copier is done
_DEFAULT_NUM_THREADS = 4  # a few streams: one stream rarely gets a parallel file system's bandwidth
_BYTES_PER_MB = 1e6
_DEFAULT_PROGRESS_EVERY_S = 30.0  # log-line progress interval when stderr is not a terminal


class StageError(RuntimeError):
    """Staging cannot go on: a bad source shard, too little space, a lock timeout."""


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


@dataclasses.dataclass(frozen=True)
class _Shard:
    """A file to stage and what it must match: the manifest's values, or None without a manifest."""

    name: str
    size_bytes: int | None = None
    sha256: str | None = None
    manifest: str | None = None  # path of the manifest listing it, for error messages


@dataclasses.dataclass(frozen=True)
class Readers:
    """The training workers one node stages train shards for, and how shards are assigned to workers."""

    ranks: tuple[int, ...]  # the node's workers (input pipeline ids)
    num_workers: int  # workers of the whole job
    scheme: str = "disjoint"  # config.data.assignment
    copies: int = 1  # config.data.overlap_copies (scheme "overlap")

    def __post_init__(self):
        assignment.check(self.scheme, self.copies, self.num_workers)
        if not self.ranks:
            raise ValueError("no worker ranks given")
        outside = [rank for rank in self.ranks if not 0 <= rank < self.num_workers]
        if outside:
            raise ValueError(f"worker ranks {outside} are not in [0, num_workers={self.num_workers})")

    def file_indices(self, num_files: int) -> list[int]:
        """Sorted indices of the files these workers read, as tfscale.data.pipeline assigns them."""
        if assignment.shard_level(num_files, self.num_workers) == "example":
            return list(range(num_files))  # fewer files than workers: every worker reads every file
        indices = set()
        for rank in self.ranks:
            indices.update(assignment.assign(num_files, rank=rank, num_workers=self.num_workers, scheme=self.scheme,
                                             copies=self.copies))
        return sorted(indices)


def parse_ranks(spec: str) -> tuple[int, ...]:
    """"0,1,2,3", "0-3" or "0-3,8-11" -> sorted distinct ranks; ValueError naming a bad part."""
    ranks = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"worker ranks {spec!r}: {part!r} is not a rank or a range first-last like 0-3")
        first = int(match.group(1))
        ranks.update(range(first, int(match.group(2) or first) + 1))
    return tuple(sorted(ranks))


def default_stage_root() -> str:
    """$TMPDIR (on many clusters Slurm sets a per-job node-local one), else /tmp."""
    return os.environ.get("TMPDIR") or "/tmp"


# --------------------------------------------------------------------------------------- which files


def _read_manifest(path: str) -> dict | None:
    """The manifest at `path`, None when there is none; a clear error when it is unusable."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise StageError(f"manifest {path} is not valid JSON: {e}") from e
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "name" in s for s in shards):
        raise StageError(f"manifest {path} has no valid 'shards' list")
    return manifest


def _split_manifest(src_dir: str, split: str) -> tuple[str | None, dict | None]:
    """(path, contents) of the manifest of `split` in src_dir, the converter's name first; (None, None)."""
    for name_format in _MANIFEST_FORMATS:
        path = os.path.join(src_dir, name_format.format(split=split))
        manifest = _read_manifest(path)
        if manifest is not None:
            return path, manifest
    return None, None


def _manifest_shards(manifest: dict, path: str) -> list[_Shard]:
    for entry in manifest["shards"]:
        _check_plain_name(entry["name"])  # a manifest names files next to it, never elsewhere
    return [_Shard(s["name"], s.get("bytes"), s.get("sha256"), path) for s in manifest["shards"]]


def _named_shards(src_dir: str, split: str) -> list[_Shard]:
    """Shards of a split without a manifest: files named `{split}-*-of-*`."""
    pattern = os.path.join(glob.escape(src_dir), f"{split}-*-of-*")
    names = sorted(os.path.basename(p) for p in glob.glob(pattern) if os.path.isfile(p))
    if not names:
        raise FileNotFoundError(f"no {_MANIFEST_FORMATS[0].format(split=split)} and no shards named {split}-*-of-* "
                                f"in {src_dir}")
    return [_Shard(name) for name in names]


def _check_plain_name(name: str) -> None:
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"files must be plain file names in src_dir, got {name!r}")


def _listed_files(src_dir: str, files: Iterable[str]) -> list[_Shard]:
    """Exactly `files`, verified against whichever manifest in src_dir lists them."""
    known: dict[str, _Shard] = {}
    paths = {p for pattern in _MANIFEST_GLOBS for p in glob.glob(os.path.join(glob.escape(src_dir), pattern))}
    for path in sorted(paths):
        manifest = _read_manifest(path)
        known.update({s.name: s for s in _manifest_shards(manifest, path)})
    shards = []
    for name in files:
        _check_plain_name(name)
        shards.append(known.get(name, _Shard(name)))
    return shards


def _shards_read_by(readers: Readers, split: str, shards: list[_Shard]) -> list[_Shard]:
    """The shards of `split` the workers of `readers` read; files are numbered in sorted name order,
    as the input pipeline numbers `{split}-*-of-*`."""
    names = sorted(s.name for s in shards)
    wanted = {names[i] for i in readers.file_indices(len(names))}
    logging.info("staging %d of %d %s shards: those workers %s of %d read (assignment %s)", len(wanted), len(names),
                 split, _ranks_text(readers.ranks), readers.num_workers, readers.scheme)
    return [s for s in shards if s.name in wanted]


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 3) -> "0-3"; anything else comma-separated."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def plan(src_dir: str, splits: Iterable[str], files: Iterable[str] | None, *, train_split: str | None = "train",
         readers: Readers | None = None) -> tuple[list[_Shard], list[str], dict[str, list[str]]]:
    """(shards to stage, manifest file names to stage alongside, {split: all its shard names, sorted}).

    Shards without duplicates, in order. With `readers`, of the `train_split` shards only those the
    readers' workers read; other splits whole. `files` stages exactly those files and lists no split.
    """
    shard_lists = {}
    if files is not None:
        shards, manifests = _listed_files(src_dir, files), []
    else:
        shards, manifests = [], []
        for split in splits:
            path, manifest = _split_manifest(src_dir, split)
            if manifest is None:
                split_shards = _named_shards(src_dir, split)
            else:
                split_shards = _manifest_shards(manifest, path)
                manifests.append(os.path.basename(path))
            shard_lists[split] = sorted(s.name for s in split_shards)
            if readers is not None and split == train_split:
                split_shards = _shards_read_by(readers, split, split_shards)
            shards += split_shards
    unique = {s.name: s for s in reversed(shards)}  # reversed: the first listing of a name wins
    return [unique[name] for name in dict.fromkeys(s.name for s in shards)], list(dict.fromkeys(manifests)), shard_lists


# ----------------------------------------------------------------------------------- state and lock


def _load_state(dest_dir: str) -> dict[str, dict]:
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


def _save_state(dest_dir: str, records: dict[str, dict]) -> None:
    """Atomic (temp + rename): a crash leaves the old or the new state, never half of one.

    Not fsynced: a process crash keeps written data, and an OS crash usually takes a job's $TMPDIR with it.
    """
    path = os.path.join(dest_dir, STATE_FILE)
    temp = os.path.join(dest_dir, f"{PARTIAL_PREFIX}{STATE_FILE}.{os.getpid()}")
    with open(temp, "w") as f:
        json.dump({"version": _STATE_VERSION, "files": records}, f, indent=0, sort_keys=True)
    os.replace(temp, path)


def read_shard_list(data_dir: str, split: str) -> list[str] | None:
    """Names of every `split` shard of the source `data_dir` was staged from, in reading order; None when
    data_dir is not a staging destination of that split. The copy may hold only some of them (`Readers`).
    """
    try:
        with open(os.path.join(data_dir, SHARD_LIST_FILE)) as f:
            names = json.load(f)["splits"][split]
    except (OSError, ValueError, KeyError, TypeError):  # absent (not staged here) or unreadable
        return None
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def _save_shard_lists(dest_dir: str, shard_lists: dict[str, list[str]]) -> None:
    """Records (merged with other splits already recorded) how the staged splits' shards are numbered."""
    path = os.path.join(dest_dir, SHARD_LIST_FILE)
    try:
        with open(path) as f:
            recorded = dict(json.load(f)["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    if all(recorded.get(split) == names for split, names in shard_lists.items()):
        return
    recorded.update(shard_lists)
    temp = os.path.join(dest_dir, f"{PARTIAL_PREFIX}{SHARD_LIST_FILE}.{os.getpid()}")
    with open(temp, "w") as f:
        json.dump({"version": _STATE_VERSION, "splits": recorded}, f, indent=0, sort_keys=True)
    os.replace(temp, path)


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


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_partial_files(dest_dir: str) -> list[str]:
    """Deletes temp files a crashed copier left. Only call while holding the lock: then none is live."""
    stale = sorted(glob.glob(os.path.join(glob.escape(dest_dir), f"{PARTIAL_PREFIX}*")))
    for path in stale:
        _remove_quietly(path)
    return stale


# ------------------------------------------------------------------------------ checking and copying


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_COPY_CHUNK_BYTES)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(memoryview(buffer)[:n])
    return digest.hexdigest()


def _record(path: str, sha256: str | None) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _expected_size(src_dir: str, shard: _Shard) -> int:
    """The manifest's size; without a manifest the source's (stat on the shared file system)."""
    if shard.size_bytes is not None:
        return shard.size_bytes
    src = os.path.join(src_dir, shard.name)
    try:
        return os.path.getsize(src)
    except FileNotFoundError:
        raise FileNotFoundError(f"{src} does not exist") from None


def check_staged(src_dir: str, dest_dir: str, shard: _Shard, record: dict | None, verify: str) -> dict | None:
    """The state record of a valid staged copy of `shard`, or None when it must be (re)copied."""
    path = os.path.join(dest_dir, shard.name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_size != _expected_size(src_dir, shard):
        return None
    want_sha256 = shard.sha256 if verify == "sha256" else None
    record = record or {}
    if (record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns
            and (want_sha256 is None or record.get("sha256") == want_sha256)):
        return record  # unchanged since it was verified: trusted without reading 140 GB again
    if verify == "size":
        return _record(path, None)  # the file changed since any recorded hash: that hash says nothing now
    # Changed or unknown: read it. Without a manifest, the hash recorded when it was copied is the reference.
    reference = shard.sha256 or record.get("sha256")
    sha256 = _file_sha256(path)
    if reference is not None and sha256 != reference:
        logging.warning("staged %s does not match its sha256 (corrupt?): copying it again", path)
        return None
    return _record(path, sha256)


def _copy_stream(src: str, partial: str, digest, on_bytes=None) -> int:
    """Copies src to partial (new file), feeding `digest` and on_bytes(n) on the way; bytes copied."""
    copied_bytes = 0
    buffer = bytearray(_COPY_CHUNK_BYTES)
    view = memoryview(buffer)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with open(src, "rb", buffering=0) as fin, open(fd, "wb", buffering=0) as fout:
        if hasattr(os, "posix_fadvise"):  # Linux: more read-ahead for one long sequential read
            os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := fin.readinto(buffer):
            chunk = view[:n]
            if digest is not None:
                digest.update(chunk)  # hashlib releases the GIL here, so copier threads hash in parallel
            fout.write(chunk)
            copied_bytes += n
            if on_bytes is not None:
                on_bytes(n)
    return copied_bytes


def _check_copy(src: str, shard: _Shard, copied_bytes: int, expected_bytes: int, sha256: str | None) -> None:
    """Raises when what was read from `src` is not what its manifest (or its size before copying) says."""
    if shard.manifest is None:
        if copied_bytes != expected_bytes:
            raise StageError(f"{src} changed while it was copied ({expected_bytes} -> {copied_bytes} bytes); "
                             "not staged")
        return
    if copied_bytes != expected_bytes:
        raise StageError(f"source shard {src} has {copied_bytes} bytes but {shard.manifest} says {expected_bytes}: "
                         "the shared copy is truncated or corrupt; not staged")
    if sha256 is not None and shard.sha256 is not None and sha256 != shard.sha256:
        raise StageError(f"source shard {src} does not match {shard.manifest}: sha256 {sha256} != {shard.sha256}; "
                         "the shared copy is corrupt (re-copy or re-convert it); not staged")


def copy_verified(src_dir: str, dest_dir: str, shard: _Shard, expected_bytes: int, verify: str,
                  on_bytes=None) -> dict:
    """Copies one shard via a temp name, renamed into place only after verification; its state record.

    on_bytes(n) is called as each chunk of n bytes is copied (progress).
    """
    src = os.path.join(src_dir, shard.name)
    final = os.path.join(dest_dir, shard.name)
    partial = os.path.join(dest_dir, f"{PARTIAL_PREFIX}{shard.name}.{os.getpid()}")
    digest = hashlib.sha256() if verify == "sha256" else None
    try:
        copied_bytes = _copy_stream(src, partial, digest, on_bytes)
        sha256 = digest.hexdigest() if digest is not None else None
        _check_copy(src, shard, copied_bytes, expected_bytes, sha256)
        os.replace(partial, final)
    except BaseException:
        _remove_quietly(partial)  # no half-copied or unverified file stays behind
        raise
    return _record(final, sha256)


def _source_sizes(src_dir: str, shards: list[_Shard]) -> dict[str, int]:
    """{name: bytes} of the sources to copy; checks they exist and match their manifest's size first."""
    sizes = {}
    for shard in shards:
        src = os.path.join(src_dir, shard.name)
        try:
            size = os.path.getsize(src)
        except FileNotFoundError:
            listed = f" listed in {shard.manifest}" if shard.manifest else ""
            raise FileNotFoundError(f"shard {src}{listed} does not exist") from None
        if shard.size_bytes is not None and size != shard.size_bytes:
            raise StageError(f"source shard {src} has {size} bytes but {shard.manifest} says {shard.size_bytes}: "
                             "the shared copy is truncated or corrupt; not staged")
        sizes[shard.name] = size
    return sizes


def _free_bytes(path: str) -> int:
    """Bytes available to this user at `path` (a function, so tests can pretend a disk is full)."""
    return shutil.disk_usage(path).free


def check_free_space(dest_dir: str, needed_bytes: int) -> None:
    """Raises before anything is copied when dest_dir cannot take `needed_bytes` (+ a margin).

    Conservative: staged files about to be replaced (corrupt, outdated) still count as used space.
    """
    free_bytes = _free_bytes(dest_dir)
    if needed_bytes + _FREE_MARGIN_BYTES > free_bytes:
        raise StageError(f"not enough space in {dest_dir}: staging needs {needed_bytes} bytes "
                         f"({needed_bytes / 1e9:.2f} GB) + {_FREE_MARGIN_BYTES} bytes margin, but only {free_bytes} "
                         f"bytes ({free_bytes / 1e9:.2f} GB) are available")


class _Progress:
    """Bytes and files copied so far and the rate: a tqdm bar on a terminal, else a log line every `every_s` s.

    Updated from the copier threads; the lock keeps the counts whole.
    """

    def __init__(self, total_bytes: int, total_files: int, every_s: float):
        self._total_bytes, self._total_files, self._every_s = total_bytes, total_files, every_s
        self._bytes = self._files = 0
        self._start_s = self._logged_s = time.monotonic()
        self._lock = threading.Lock()
        self._bar = None
        if total_files and sys.stderr.isatty():
            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"stage {total_files} files",
                             file=sys.stderr, dynamic_ncols=True)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self._bytes += n
            if self._bar is not None:
                self._bar.update(n)
            else:
                self._maybe_log()

    def file_done(self) -> None:
        with self._lock:
            self._files += 1
            if self._bar is not None:
                self._bar.set_postfix_str(f"{self._files}/{self._total_files} files")
            else:
                self._maybe_log()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _maybe_log(self) -> None:
        now_s = time.monotonic()
        if now_s - self._logged_s < self._every_s:
            return
        self._logged_s = now_s
        rate = self._bytes / max(now_s - self._start_s, 1e-9)  # bytes/s
        left_s = (self._total_bytes - self._bytes) / rate if rate > 0 else float("inf")
        logging.info("staging progress: %d/%d files, %.1f/%.1f MB, %.1f MB/s, ~%.0f s left", self._files,
                     self._total_files, self._bytes / _BYTES_PER_MB, self._total_bytes / _BYTES_PER_MB,
                     rate / _BYTES_PER_MB, left_s)


def _run_parallel(fn, items: list, num_threads: int, on_result) -> None:
    """fn(item) on a thread pool, on_result(item, result) in this thread as each finishes.

    On the first error, what has not started is cancelled, what runs finishes (and is recorded), and the
    error is raised.
    """
    if not items:
        return
    pool = futures.ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(items))))
    errors = []
    try:
        jobs = {pool.submit(fn, item): item for item in items}
        for job in futures.as_completed(jobs):
            if job.cancelled():
                continue
            try:
                result = job.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the running copies finish
                if not errors:
                    for other in jobs:
                        other.cancel()
                errors.append(e)
                continue
            on_result(jobs[job], result)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise errors[0]


def _legacy_manifest_name(name: str) -> str | None:
    """"manifest-train.json" -> "train-manifest.json" (the name older versions used); else None."""
    match = re.fullmatch(r"manifest-(.+)\.json", name)
    return _MANIFEST_FORMATS[1].format(split=match.group(1)) if match else None


def _stage_manifests(src_dir: str, dest_dir: str, names: list[str]) -> None:
    """Copies the (small) manifests when the staged copy differs; atomically, like the shards.

    A legacy-named manifest staged by an older version goes: split globs would read it as a shard.
    """
    for name in names:
        legacy = _legacy_manifest_name(name)
        if legacy:
            _remove_quietly(os.path.join(dest_dir, legacy))
        with open(os.path.join(src_dir, name), "rb") as f:
            data = f.read()
        final = os.path.join(dest_dir, name)
        try:
            with open(final, "rb") as f:
                if f.read() == data:
                    continue
        except FileNotFoundError:
            pass
        partial = os.path.join(dest_dir, f"{PARTIAL_PREFIX}{name}.{os.getpid()}")
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, final)


# ------------------------------------------------------------------------------------------- stage


def _check_args(src_dir: str, dest_dir: str, verify: str) -> None:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"source directory {src_dir} does not exist (or is not a directory)")
    if os.path.isdir(dest_dir) and os.path.samefile(src_dir, dest_dir):
        raise ValueError(f"src_dir and dest_dir are the same directory: {src_dir}")


def _stage_locked(src_dir: str, dest_dir: str, shards: list[_Shard], manifests: list[str],
                  shard_lists: dict[str, list[str]], verify: str, num_threads: int,
                  progress_every_s: float) -> tuple[int, int]:
    """The work of the lock holder; (files copied, bytes copied)."""
    stale = remove_partial_files(dest_dir)
    if stale:
        logging.info("removed %d partial files of an interrupted staging run in %s", len(stale), dest_dir)
    old_records = _load_state(dest_dir)
    records = dict(old_records)  # entries of files outside this plan stay: another call may have staged them
    to_copy = []

    def keep_or_copy(shard, record):
        if record is None:
            records.pop(shard.name, None)
            to_copy.append(shard)
        else:
            records[shard.name] = record

    # Hashing only happens for files whose record is missing or stale; threads overlap those reads.
    _run_parallel(lambda s: check_staged(src_dir, dest_dir, s, old_records.get(s.name), verify), shards,
                  num_threads, keep_or_copy)
    order = {shard.name: i for i, shard in enumerate(shards)}
    to_copy.sort(key=lambda s: order[s.name])  # plan order (checks finish in any order)
    if records != old_records:
        _save_state(dest_dir, records)
    sizes = _source_sizes(src_dir, to_copy)
    manifest_bytes = sum(os.path.getsize(os.path.join(src_dir, name)) for name in manifests)
    if to_copy:
        check_free_space(dest_dir, sum(sizes.values()) + manifest_bytes)
    copied = []
    progress = _Progress(sum(sizes.values()), len(to_copy), progress_every_s)

    def record_copy(shard, record):
        records[shard.name] = record
        copied.append(shard.name)
        _save_state(dest_dir, records)  # after every file: a crash loses at most the copies under way
        progress.file_done()

    try:
        _run_parallel(lambda s: copy_verified(src_dir, dest_dir, s, sizes[s.name], verify, progress.add_bytes),
                      to_copy, num_threads, record_copy)
    finally:
        progress.close()
    # Last, so that the manifests and lists only appear once all the shards they list are in place.
    _stage_manifests(src_dir, dest_dir, manifests)
    _save_shard_lists(dest_dir, shard_lists)
    return len(copied), sum(sizes[name] for name in copied)


def _log_report(report: StageReport, src_dir: str) -> None:
    if report.files_copied:
        logging.info("staged %s -> %s: copied %d files, %.1f MB in %.2f s = %.1f MB/s (%d already staged)",
                     src_dir, report.dest_dir, report.files_copied, report.bytes_copied / _BYTES_PER_MB,
                     report.seconds, report.mb_per_s, report.files_skipped)
    else:
        logging.info("already staged: %d files in %s (checked in %.2f s, waited %.2f s for the lock)",
                     report.files_skipped, report.dest_dir, report.seconds, report.lock_wait_seconds)


def stage(src_dir: str, dest_dir: str, *, splits: Iterable[str] = ("train", "validation"),
          files: list[str] | None = None, train_split: str | None = "train", readers: Readers | None = None,
          verify: str = "sha256", lock_timeout_s: float = 3600.0, num_threads: int = _DEFAULT_NUM_THREADS,
          progress_every_s: float = _DEFAULT_PROGRESS_EVERY_S) -> StageReport:
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

    Returns:
      A StageReport. Every process of a node may call this at once: one copies, the rest wait and
      return with copied_by_this_process=False.
    """
    if isinstance(splits, str):
        splits = (splits,)
    _check_args(src_dir, dest_dir, verify)
    shards, manifests, shard_lists = plan(src_dir, splits, files, train_split=train_split, readers=readers)
    os.makedirs(dest_dir, exist_ok=True)
    fd, lock_wait_s = acquire_lock(dest_dir, lock_timeout_s)
    try:
        start_s = time.monotonic()
        files_copied, bytes_copied = _stage_locked(src_dir, dest_dir, shards, manifests, shard_lists, verify,
                                                   num_threads, progress_every_s)
        seconds = time.monotonic() - start_s
    finally:
        os.close(fd)  # releases the flock: the next waiter goes
    report = StageReport(
        dest_dir=dest_dir, files_copied=files_copied, files_skipped=len(shards) - files_copied,
        bytes_copied=bytes_copied, seconds=seconds, mb_per_s=bytes_copied / _BYTES_PER_MB / max(seconds, 1e-9),
        copied_by_this_process=files_copied > 0, lock_wait_seconds=lock_wait_s,
    )
    _log_report(report, src_dir)
    return report


# --------------------------------------------------------------------------------------------- CLI


_FLAG_NAMES = ("src_dir", "dest_dir", "splits", "files", "train_split", "num_workers", "worker_ranks", "assignment",
               "overlap_copies", "config", "verify", "lock_timeout_s", "num_threads", "progress_every_s")
# What --config decides (from config.data); giving one of these flags as well would be two answers.
_CONFIG_DECIDES = ("splits", "train_split", "assignment", "overlap_copies")


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
    flags.DEFINE_enum("assignment", "disjoint", assignment.SCHEMES, "config.data.assignment of the training run.")
    flags.DEFINE_integer("overlap_copies", 2, "config.data.overlap_copies of the training run (assignment=overlap).")
    config_flags.DEFINE_config_file("config", None, "The training config (+ its --config.* overrides): splits and "
                                    "assignment come from its data section instead of the flags above.")
    flags.DEFINE_enum("verify", "sha256", VERIFY_MODES, "sha256: size and hash against the manifest; "
                      "size: size only.")
    flags.DEFINE_float("lock_timeout_s", 3600.0, "Seconds to wait for another process's staging.")
    flags.DEFINE_integer("num_threads", _DEFAULT_NUM_THREADS, "Files copied at once.")
    flags.DEFINE_float("progress_every_s", _DEFAULT_PROGRESS_EVERY_S, "Without a terminal: seconds between "
                       "progress log lines.")
    flags.mark_flags_as_required(["src_dir"])
    # --help lists the flags of the main script (sys.argv[0]); these are defined here, so say they are its.
    for name in _FLAG_NAMES:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def _selection(f) -> tuple[list[str], str | None, Readers | None]:
    """(splits, train split, readers) from the flags, or from --config's data section."""
    splits, train_split, scheme, copies = f.splits, f.train_split, f.assignment, f.overlap_copies
    if f.config is not None:
        both = [f"--{name}" for name in _CONFIG_DECIDES if f[name].present]
        if both:
            raise app.UsageError(f"{', '.join(both)} and --config both decide this; --config's data section wins "
                                 "for training, so drop the flags (or override --config.data.*)")
        data = f.config.data
        splits, train_split = list(dict.fromkeys([data.train_split, data.eval_split])), data.train_split
        scheme, copies = data.assignment, data.overlap_copies
        if data.eval_split == data.train_split:
            train_split = None  # every worker evaluates from every file of it: no per-worker share
    if (f.num_workers is None) != (f.worker_ranks is None):
        raise app.UsageError("--num_workers and --worker_ranks go together (or neither: stage every shard)")
    if f.num_workers is None:
        return splits, train_split, None
    if f.files is not None:
        raise app.UsageError("--files names exactly what to stage: it takes no --num_workers/--worker_ranks")
    return splits, train_split, Readers(parse_ranks(f.worker_ranks), f.num_workers, scheme, copies)


def _main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    dest_dir = f.dest_dir or os.path.join(default_stage_root(), "tfscale_data")
    try:
        splits, train_split, readers = _selection(f)
        report = stage(f.src_dir, dest_dir, splits=splits, files=f.files, train_split=train_split, readers=readers,
                       verify=f.verify, lock_timeout_s=f.lock_timeout_s, num_threads=f.num_threads,
                       progress_every_s=f.progress_every_s)
    except (StageError, ValueError, OSError) as e:  # one clear line, no traceback
        logging.error("%s", e)
        return 1
    print(report.dest_dir)  # stdout: for job scripts, DATA_DIR=$(python tools/stage_data.py ...)
    sys.stdout.flush()
    return 0


def run(argv: list[str] | None = None) -> None:
    """Entry point of tools/stage_data.py and `python -m tfscale.data.stage`."""
    _define_flags()
    app.run(_main, argv=argv)


if __name__ == "__main__":
    run()
