"""Index files for DALI's TFRecord reader, written from the TFRecord framing (no TensorFlow).

`fn.readers.tfrecord` needs one text file per shard, a line `offset length` per record (bytes, the
whole record with its length header and both CRCs), as DALI's `tfrecord2idx` writes them. That tool
imports TensorFlow and reads every byte (~9 s a shard); here only the 8-byte length headers are read
and the records themselves skipped, so a 140 MB ImageNet shard is indexed in milliseconds.

Where they live: `{data_dir}/dali-index/{shard}.idx` (or `data.dali_index_dir`), a folder no shard glob
(`train*`, `train-*`, `train-*-of-*`) matches. tfscale-convert writes them with the shards; the DALI
loader checks every index it uses against its shard (the last record must end where the file ends)
and rewrites missing or stale ones, so a staged copy or shards from other tools get theirs on first use.
"""

from __future__ import annotations

import os

from absl import logging

from tfscale import io as tfio
from tfscale.errors import DaliIndexError, TruncatedShard

INDEX_DIR_NAME = "dali-index"


def index_dir(data_dir: str, configured: str = "") -> str:
    """Where the indexes of the shards in `data_dir` go: `configured`, or `data_dir/dali-index`."""
    return configured or os.path.join(data_dir, INDEX_DIR_NAME)


def index_path(shard_path: str, directory: str) -> str:
    return os.path.join(directory, os.path.basename(shard_path) + ".idx")


def write_index(shard_path: str, path: str) -> int:
    """Writes the index of one shard atomically; returns its number of records."""
    spans, complete = tfio.tfrecord_spans(shard_path)
    if not complete:
        raise TruncatedShard(f"{shard_path} is truncated (its last record runs past the end of the file): "
                             "re-convert or re-stage it")
    try:
        tfio.write_bytes(path, "".join(f"{offset} {length}\n" for offset, length in spans).encode())
    except OSError as e:
        raise DaliIndexError(f"cannot write the DALI index {path}: {e.strerror or e}; set config.data.dali_index_dir "
                             "to a writable directory (node-local is fine: indexes are small)") from e
    return len(spans)


def _index_end(path: str) -> int | None:
    """Where the index at `path` says the last record ends (bytes), or None when it is unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64))
            last = f.read().decode().strip().splitlines()[-1].split()
        return int(last[0]) + int(last[1])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def is_current(shard_path: str, path: str) -> bool:
    """True when the index at `path` exists and its last record ends where the shard ends.

    Catches a missing index, one of an earlier version of the shard (other size) and a torn index;
    costs a stat and one small read per shard.
    """
    return os.path.exists(path) and _index_end(path) == os.path.getsize(shard_path)


def ensure_indexes(shard_paths: list[str], directory: str) -> list[str]:
    """The index paths of `shard_paths` in `directory`, (re)writing those missing or stale.

    Workers of one node may do this at once: each write is atomic and writes the same bytes.
    """
    paths = [index_path(shard, directory) for shard in shard_paths]
    stale = [(shard, path) for shard, path in zip(shard_paths, paths) if not is_current(shard, path)]
    if stale:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise DaliIndexError(f"cannot create the DALI index folder {directory}: {e.strerror or e}; set "
                                 "config.data.dali_index_dir to a writable directory") from e
        for shard, path in stale:
            write_index(shard, path)
        logging.info("wrote %d DALI index files in %s (%d were current)", len(stale), directory,
                     len(paths) - len(stale))
    return paths


def num_records(index_paths: list[str]) -> int:
    """Records in the shards of these index files (a line each)."""
    total = 0
    for path in index_paths:
        with open(path, "rb") as f:
            total += sum(1 for _ in f)
    return total


def write_for_shards(output_dir: str, shard_names: list[str]) -> str:
    """The converter's step: indexes of freshly written shards in `output_dir/dali-index`; returns that dir."""
    directory = index_dir(output_dir)
    ensure_indexes([os.path.join(output_dir, name) for name in shard_names], directory)
    return directory
