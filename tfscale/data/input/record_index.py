"""Training records in a new seeded permutation every pass, read at the byte offsets their index files give.

A shuffle buffer holds records: 10,000 ImageNet JPEGs are ~1.1 GB per worker, and a record can only
move within that window of the read order. The index files (one per shard, a line `offset length` per
framed record; tfscale-convert writes them, and they are DALI's too) let each worker draw a whole
permutation of its records instead, holding only their (file, offset, length) (20 bytes a record):

    pass p -> positions 0..n-1 -> tf.random.experimental.index_shuffle(seed=[seed, p]) -> record ids
           -> batches of ids -> one pread per record (parallel, GIL released in the read) -> record bytes

Every record comes once per pass, in an order independent of the shard layout. The reads are random
rather than sequential: cheap on node-local SSD (data.stage_dir) and page-cached files; on a parallel
file system whose small random reads are slow, `data.shuffle='buffer'` keeps sequential reads.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

import numpy as np
import tensorflow as tf
from absl import logging

from tfscale.data.convert import dali_index
from tfscale.errors import DaliIndexError, TruncatedShard

_IDS_PER_READ = 32  # records read per call: amortises the call's overhead, keeps the parallel map fed
_FRAME_HEAD_BYTES, _FRAME_TAIL_BYTES = 12, 4  # length (8) + its CRC (4) before the data; the data's CRC after


@dataclasses.dataclass(frozen=True)
class RecordSpans:
    """Where each record of some shards lies: record r is bytes [offsets[r], offsets[r] + lengths[r])
    of paths[file_ids[r]], framing included."""

    paths: tuple[str, ...]
    file_ids: np.ndarray  # int32
    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64

    @property
    def count(self) -> int:
        return len(self.offsets)


def load_spans(paths: list[str], index_dir: str) -> RecordSpans | None:
    """The spans of `paths` from their index files in `index_dir`, (re)writing missing or stale ones (a read
    of the length headers only); None, logged, when they cannot be had (a folder nobody may write, a
    truncated shard: the caller falls back to a shuffle buffer and the read names the shard)."""
    try:
        index_paths = dali_index.ensure_indexes(paths, index_dir)
    except (DaliIndexError, TruncatedShard) as err:
        logging.warning("record index unavailable (%s): shuffling through config.data.shuffle_buffer instead", err)
        return None
    tables = []
    for path in index_paths:
        with open(path, "rb") as f:
            tables.append(np.array(f.read().split(), dtype=np.int64).reshape(-1, 2))
    file_ids = np.concatenate([np.full(len(t), i, np.int32) for i, t in enumerate(tables)])
    spans = np.concatenate(tables)
    return RecordSpans(paths=tuple(paths), file_ids=file_ids, offsets=spans[:, 0], lengths=spans[:, 1])


def shuffled_records(spans: RecordSpans, seed: int, deterministic: bool) -> tf.data.Dataset:
    """The serialized records of `spans`, endlessly, each pass a permutation seeded by (`seed`, pass)."""
    count = spans.count
    file_ids, offsets, lengths = (tf.constant(a) for a in (spans.file_ids, spans.offsets, spans.lengths))
    read = _Reader(spans.paths)

    def one_pass(pass_number):
        positions = tf.data.Dataset.range(count).batch(_IDS_PER_READ)
        seed_pair = tf.stack([tf.constant(seed, tf.int64), pass_number])
        return positions.map(lambda p: tf.random.experimental.index_shuffle(p, seed_pair, count - 1))

    def read_batch(ids):
        records = tf.numpy_function(read, [tf.gather(file_ids, ids), tf.gather(offsets, ids), tf.gather(lengths, ids)],
                                    tf.string, stateful=False)
        return tf.ensure_shape(records, [None])

    ids = tf.data.Dataset.counter().flat_map(one_pass)
    return ids.map(read_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic).unbatch()


class _Reader:
    """`reader(file_ids, offsets, lengths) -> record data`: one pread per framed record (thread-safe: pread
    does not move a shared file position), its length header checked against the index."""

    def __init__(self, paths: tuple[str, ...]):
        self.paths = paths
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def _fd(self, file_id: int) -> int:
        fd = self._fds.get(file_id)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file_id)
                if fd is None:
                    fd = self._fds[file_id] = os.open(self.paths[file_id], os.O_RDONLY)
        return fd

    def __call__(self, file_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = np.empty(len(file_ids), dtype=object)
        for k, (file_id, offset, length) in enumerate(zip(file_ids.tolist(), offsets.tolist(), lengths.tolist())):
            framed = os.pread(self._fd(file_id), length, offset)
            data_bytes = length - _FRAME_HEAD_BYTES - _FRAME_TAIL_BYTES
            if len(framed) != length or int.from_bytes(framed[:8], "little") != data_bytes:
                # A ValueError reaches tf.data as InvalidArgumentError: the run names the shard (faults.explain).
                raise ValueError(f"{self.paths[file_id]}: no {length}-byte record at byte {offset}, where its index "
                                 "file puts one: the shard was cut short or rewritten after it was indexed")
            out[k] = framed[_FRAME_HEAD_BYTES:-_FRAME_TAIL_BYTES]
        return out


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
