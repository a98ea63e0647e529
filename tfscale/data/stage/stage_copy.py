"""Checking and copying staged shards: verified while copied, renamed into place only when they match.

Each shard is written to `.tfscale-partial-{name}.{pid}` in dest_dir, checked (size against the
manifest's `bytes`; with verify="sha256" also the sha256 computed while copying, so the source is read
once) and only then renamed into place. A copy that does not match its manifest is made once more
(`MISMATCH_RECOPIES`: a flaky read is not a bad shard); a second mismatch is an error naming the shard,
the expected and the observed value (the shared copy is bad). A read of a source that fails with an
error a shared file system recovers from (`TRANSIENT_READ_ERRNOS`: EIO, ESTALE, ...) is tried again at
the same offset, from a freshly opened file, with exponential backoff (`ReadRetry`); other errors
(ENOENT, EACCES, and any error writing the destination, such as ENOSPC) fail at once. A staged file
whose size and mtime match its state record is trusted without reading it again. Copies run on a few
threads (hashlib and file I/O release the GIL).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import shutil
import sys
import threading
import time
from concurrent import futures

from absl import logging
from tqdm import tqdm

from tfscale import io as tfio
from tfscale.data.stage.stage_plan import Shard
from tfscale.data.stage.stage_state import PARTIAL_PREFIX, StageError

VERIFY_MODES = ("sha256", "size")
BYTES_PER_MB = 1e6
_COPY_CHUNK_BYTES = 8 << 20  # large sequential reads suit parallel file systems
# Kept free beyond the data: a file system that fills to the last block slows down and breaks other users.
_FREE_MARGIN_BYTES = 64 << 20
# Read errors a shared file system recovers from: a server failing over or a client reconnecting
# (EIO, ETIMEDOUT, ENOTCONN on Lustre/GPFS), an NFS handle gone stale across a server restart
# (ESTALE), a busy server (EAGAIN). Waiting cannot fix the others (ENOENT, EACCES, ...).
TRANSIENT_READ_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EAGAIN, errno.ETIMEDOUT, errno.ENOTCONN})
READ_ATTEMPTS = 4  # tries of one read of a source shard before staging gives up
READ_RETRY_FIRST_DELAY_S = 1.0  # wait after the first failed try; doubled after each further one (1, 2, 4 s)
MISMATCH_RECOPIES = 1  # a copy that does not match its manifest is made again this many times, then it fails


@dataclasses.dataclass(frozen=True)
class ReadRetry:
    """How often, and how patiently, a read of a source shard that failed transiently is tried again."""

    attempts: int = READ_ATTEMPTS  # tries in a row of the same read, the first included
    first_delay_s: float = READ_RETRY_FIRST_DELAY_S  # wait before the second try; doubled before each next one

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"read attempts must be at least 1, got {self.attempts}")
        if self.first_delay_s < 0:
            raise ValueError(f"read retry delay must be >= 0 seconds, got {self.first_delay_s}")

    def delay_s(self, failures: int) -> float:
        """The wait after the `failures`-th failed try in a row (1-based)."""
        return self.first_delay_s * 2 ** (failures - 1)


def _record(path: str, sha256: str | None) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _expected_size(src_dir: str, shard: Shard) -> int:
    """The manifest's size; without a manifest the source's (stat on the shared file system)."""
    if shard.size_bytes is not None:
        return shard.size_bytes
    src = os.path.join(src_dir, shard.name)
    try:
        return os.path.getsize(src)
    except FileNotFoundError:
        raise FileNotFoundError(f"{src} does not exist") from None


def check_staged(src_dir: str, dest_dir: str, shard: Shard, record: dict | None, verify: str) -> dict | None:
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
    sha256 = tfio.file_sha256(path)
    if reference is not None and sha256 != reference:
        logging.warning("staged %s does not match its sha256 (corrupt?): copying it again", path)
        return None
    return _record(path, sha256)


def _read_chunk(fin, buffer) -> int:
    """Reads the next bytes of a source shard into `buffer`; how many (0 at its end).

    The one place a source shard's bytes are read (tests inject read faults here)."""
    return fin.readinto(buffer)


def _naming(err: OSError, path: str) -> OSError:
    """err, or the same error naming `path` when it names no file (read/write errors name none)."""
    return err if err.filename is not None or err.errno is None else OSError(err.errno, err.strerror, path)


def _wait_or_give_up(src: str, err: OSError, failures: int, retry: ReadRetry) -> None:
    """After the `failures`-th failed read in a row: sleeps before the next try, or raises."""
    if err.errno not in TRANSIENT_READ_ERRNOS:
        raise _naming(err, src) from err  # waiting will not make the file appear or readable
    name = errno.errorcode.get(err.errno, str(err.errno))
    if failures >= retry.attempts:
        raise StageError(f"reading {src} failed {failures} times in a row ({name}: {err.strerror}), the last "
                         f"of {retry.attempts} attempts; is the shared file system down? Not staged (rerun "
                         "when it is back: what is staged stays)") from err
    delay_s = retry.delay_s(failures)
    logging.warning("reading %s failed (%s: %s), attempt %d of %d: retrying in %g s", src, name, err.strerror,
                    failures, retry.attempts, delay_s)
    time.sleep(delay_s)


def _source_chunks(src: str, buffer: bytearray, retry: ReadRetry):
    """Yields the bytes of `src`, one chunk read into `buffer` at a time.

    A read that fails transiently is tried again after a wait, from the same offset of a newly opened
    file (an ESTALE handle is dead): the chunks yielded are the file's bytes in order, once each.
    """
    view = memoryview(buffer)
    offset = failures = 0
    while True:
        try:
            with open(src, "rb", buffering=0) as fin:
                if hasattr(os, "posix_fadvise"):  # Linux: more read-ahead for one long sequential read
                    os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                fin.seek(offset)
                while n := _read_chunk(fin, buffer):
                    offset, failures = offset + n, 0
                    yield view[:n]  # the consumer's write errors are raised there, not caught here
            return
        except OSError as e:
            failures += 1
            _wait_or_give_up(src, e, failures, retry)


def _write_all(fout, chunk: memoryview, path: str) -> None:
    """Writes all of `chunk`: a disk that fills up writes part of it first, then raises ENOSPC."""
    try:
        while chunk:
            chunk = chunk[fout.write(chunk):]
    except OSError as e:
        raise _naming(e, path) from e


def _copy_stream(src: str, partial: str, digest, on_bytes=None, retry: ReadRetry = ReadRetry()) -> int:
    """Copies src to partial (new file), feeding `digest` and on_bytes(n) on the way; bytes copied."""
    copied_bytes = 0
    buffer = bytearray(_COPY_CHUNK_BYTES)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with open(fd, "wb", buffering=0) as fout:
        for chunk in _source_chunks(src, buffer, retry):
            if digest is not None:
                digest.update(chunk)  # hashlib releases the GIL here, so copier threads hash in parallel
            _write_all(fout, chunk, partial)
            copied_bytes += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return copied_bytes


def _copy_mismatch(src: str, shard: Shard, copied_bytes: int, expected_bytes: int, sha256: str | None) -> str | None:
    """What is wrong with a copy of `src` (bytes read, their sha256) against its manifest, or None."""
    if shard.manifest is None:
        if copied_bytes != expected_bytes:
            return f"{src} changed while it was copied ({expected_bytes} -> {copied_bytes} bytes)"
        return None
    if copied_bytes != expected_bytes:
        return (f"copy of source shard {src} has {copied_bytes} bytes, but {shard.manifest} says "
                f"{expected_bytes}")
    if sha256 is not None and shard.sha256 is not None and sha256 != shard.sha256:
        return (f"copy of source shard {src} does not match {shard.manifest}: expected sha256 {shard.sha256}, "
                f"observed {sha256}")
    return None


def copy_verified(src_dir: str, dest_dir: str, shard: Shard, expected_bytes: int, verify: str,
                  on_bytes=None, retry: ReadRetry = ReadRetry()) -> dict:
    """Copies one shard via a temp name, renamed into place only after verification; its state record.

    A copy that does not verify is made again (`MISMATCH_RECOPIES` times) before this raises.
    on_bytes(n) is called as each chunk of n bytes is copied (progress; negative for a discarded copy).
    """
    src = os.path.join(src_dir, shard.name)
    final = os.path.join(dest_dir, shard.name)
    partial = os.path.join(dest_dir, f"{PARTIAL_PREFIX}{shard.name}.{os.getpid()}")
    copies = MISMATCH_RECOPIES + 1
    try:
        for copy_number in range(1, copies + 1):
            digest = hashlib.sha256() if verify == "sha256" else None
            copied_bytes = _copy_stream(src, partial, digest, on_bytes, retry)
            sha256 = digest.hexdigest() if digest is not None else None
            mismatch = _copy_mismatch(src, shard, copied_bytes, expected_bytes, sha256)
            if mismatch is None:
                os.replace(partial, final)
                return _record(final, sha256)
            os.remove(partial)
            if on_bytes is not None:
                on_bytes(-copied_bytes)  # that copy is thrown away: progress counts the next one
            if copy_number < copies:
                logging.warning("%s: copying it again (copy %d of %d)", mismatch, copy_number + 1, copies)
        raise StageError(f"{mismatch}, in each of {copies} copies: the shared copy is corrupt or reads of it keep "
                         "failing (re-copy or re-convert it); not staged")
    except BaseException:
        tfio.remove_quietly(partial)  # no half-copied or unverified file stays behind
        raise


def source_sizes(src_dir: str, shards: list[Shard]) -> dict[str, int]:
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


class Progress:
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
                     self._total_files, self._bytes / BYTES_PER_MB, self._total_bytes / BYTES_PER_MB,
                     rate / BYTES_PER_MB, left_s)


def run_parallel(fn, items: list, num_threads: int, on_result) -> None:
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
    return tfio.LEGACY_MANIFEST_FORMAT.format(split=match.group(1)) if match else None


def stage_manifests(src_dir: str, dest_dir: str, names: list[str]) -> None:
    """Copies the (small) manifests when the staged copy differs; atomically, like the shards.

    A legacy-named manifest staged by an older version goes: split globs would read it as a shard.
    """
    for name in names:
        legacy = _legacy_manifest_name(name)
        if legacy:
            tfio.remove_quietly(os.path.join(dest_dir, legacy))
        with open(os.path.join(src_dir, name), "rb") as f:
            data = f.read()
        final = os.path.join(dest_dir, name)
        try:
            with open(final, "rb") as f:
                if f.read() == data:
                    continue
        except FileNotFoundError:
            pass
        tfio.write_bytes(final, data)
