"""Bad records inside shards: name them when a run stops on one, or skip and count them when asked.

A shard can be whole (its TFRecord framing and checksums fine) and still hold a record whose image
does not decode: bytes that are no image, a JPEG cut short, a format the converter mislabelled.
tf.data reports such a record only as "Invalid JPEG data" from inside a map, and a truncated shard
only as a byte offset; neither names the file. So:

  * A run stops on the first bad record by default (`data.skip_corrupt_images=False`), and before it
    exits it scans the files it was reading (`find_undecodable`, `truncated_shards`) to say which
    shard and which record (0-based index in the shard) it was. The scan is a tf.data pipeline with
    every core; it reads up to the first few bad records, so its cost falls on the failure only.
  * `data.skip_corrupt_images=True` drops training records that do not decode (`skip_undecodable`)
    and counts them in a host variable that the run reports (log rows, summary.json). The count is of
    records the input pipeline has prepared, read-ahead included. Evaluation never skips: its
    example counts are the contract of the eval metrics, so a bad eval record always stops the run.

`CorruptDataError` is what the user sees; train.py turns it into exit code 65 (EX_DATAERR).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable

import tensorflow as tf
from absl import logging

from tfscale import errors
from tfscale import io as tfio
from tfscale.errors import CorruptDataError


@contextlib.contextmanager
def fatal_on_data_faults():
    """A data fault inside the block ends the process with one line, `FATAL data error: ...`, and its exit
    code: the message names the file, so a traceback (TensorFlow's are long) would only bury it."""
    try:
        yield
    except errors.DATA_FAULTS as err:
        code = errors.exit_code(err)
        print(errors.fatal("data", err, code), file=sys.stderr, flush=True)
        sys.exit(code)


# Words of the errors an image decode or a tf.Example parse raises inside tf.data (InvalidArgumentError).
_DECODE_ERROR_WORDS = ("JPEG", "jpeg", "image file format", "DecodeImage", "DecodePng", "DecodeGif", "DecodeBmp",
                       "Could not parse example")
_MAX_NAMED = 5  # bad records named in one message (the scan stops there)


# Errors of DALI's operators that read image bytes (decoders, and the eval crop's shape peek) reach TensorFlow as
# an InternalError naming the operator, with DALI's own words after it ("Failed to decode sample #2 : SHARD at
# index OFFSET", "nvImageCodec failure: '#4'", ...).
_DALI_IMAGE_OPERATORS = ("nvidia.dali.fn.decoders.", "nvidia.dali.fn.peek_image_shape")


def is_decode_error(err: tf.errors.OpError) -> bool:
    if isinstance(err, tf.errors.InternalError):  # data.loader=dali
        return any(operator in err.message for operator in _DALI_IMAGE_OPERATORS)
    return isinstance(err, tf.errors.InvalidArgumentError) and any(w in err.message for w in _DECODE_ERROR_WORDS)


# ------------------------------------------------------------------------------------ truncated shards


def truncated_shards(paths: list[str]) -> list[str]:
    """'path: reason' for every TFRecord file whose record framing runs past its end.

    Seeks from header to header, so it reads 8 bytes per record, not the data: cheap enough to
    run when tf.data has reported a DataLossError without saying which file it was reading.
    """
    bad = []
    for path in paths:
        size = tf.io.gfile.stat(path).length
        spans, complete = tfio.tfrecord_spans(path, open_file=tf.io.gfile.GFile, size_bytes=size)
        if not complete:
            position = spans[-1][0] + spans[-1][1] if spans else 0
            bad.append(f"{path}: record {len(spans)} at byte {position} runs past the end ({size} bytes)")
    return bad


# ------------------------------------------------------------------------------- undecodable records


def _decodes(prepare: Callable, record: tf.Tensor) -> tf.data.Dataset:
    """A one-element dataset: True when `prepare(record)` succeeds, False when it raises."""

    def succeeded(r):
        with tf.control_dependencies(tf.nest.flatten(prepare(r))):  # the decode runs, though its result is unused
            return tf.constant(True)

    attempt = tf.data.Dataset.from_tensors(record).map(succeeded).ignore_errors()
    return attempt.concatenate(tf.data.Dataset.from_tensors(False)).take(1)


def find_undecodable(paths: list[str], prepare: Callable[[tf.Tensor], object], limit: int = _MAX_NAMED) -> list[str]:
    """'path: record i (reason)' for the first `limit` records of `paths` that `prepare` cannot turn
    into an example (parse + decode), in file order; [] when every record decodes."""
    num_files = len(paths)

    def records_of(file_index):
        records = tf.data.TFRecordDataset(tf.gather(paths, file_index))
        return records.enumerate().map(lambda index, record: (file_index, index, record))

    def checked(file_index, index, record):
        return _decodes(prepare, record).map(lambda ok: (file_index, index, ok))

    scan = tf.data.Dataset.range(num_files).interleave(
        records_of, cycle_length=max(1, min(num_files, 16)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    scan = scan.interleave(checked, cycle_length=64, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    bad = scan.filter(lambda file_index, index, ok: tf.logical_not(ok)).take(limit)
    named = []
    for file_index, index, _ in bad.as_numpy_iterator():
        path = paths[int(file_index)]
        named.append(f"{path}: record {int(index)} ({_reason(path, int(index), prepare)})")
    return named


def _reason(path: str, index: int, prepare: Callable) -> str:
    """What `prepare` raises on record `index` of `path` (run again, eagerly, for its message)."""
    record = next(iter(tf.data.TFRecordDataset(path).skip(index).take(1)))
    try:
        prepare(record)
    except tf.errors.OpError as err:
        return errors.one_line(err)
    return "decodes when read alone"


def skip_undecodable(records: tf.data.Dataset, prepare: Callable, placeholder: tuple, counter: tf.Variable | None,
                     *, deterministic: bool) -> tf.data.Dataset:
    """`records.map(prepare)` (parallel) without the records that raise, each counted in `counter`.

    `placeholder`: an example of `prepare`'s structure, never emitted. Each record is prepared in a
    one-element dataset whose error `ignore_errors` drops, so a bad record becomes a flag, not a
    failed pipeline (`ignore_errors` on the whole map would drop it without a trace).
    """

    def attempt(*record):
        prepared = tf.data.Dataset.from_tensors(record).map(lambda *r: (*prepare(*r), True)).ignore_errors()
        return prepared.concatenate(tf.data.Dataset.from_tensors((*placeholder, False))).take(1)

    def count(*example_and_ok):
        ok = example_and_ok[-1]
        if counter is None:  # nobody asks how many (the benchmark's input mode)
            return ok
        with tf.control_dependencies([counter.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
            return tf.identity(ok)

    examples = records.interleave(attempt, cycle_length=tf.data.AUTOTUNE, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=deterministic)
    return examples.filter(count).map(lambda *example_and_ok: example_and_ok[:-1])


def skipped_images_counter(cluster) -> tuple[tf.Variable, Callable[[], dict]]:
    """This worker's counter for `skip_undecodable`, and a function giving the job's total as a log field.

    The function is a collective (`cluster.gather_per_worker`): every worker calls it at the same steps.
    """
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)  # on this host's CPU, where tf.data runs
    reported = [0]

    def job_total() -> dict:
        total = int(sum(row[0] for row in cluster.gather_per_worker([float(counter.numpy())])))
        if total > reported[0] and cluster.is_chief:
            logging.warning("%d corrupt image(s) skipped so far (data.skip_corrupt_images=True)", total)
        reported[0] = total
        return {"corrupt_images_skipped": total}

    return counter, job_total


def explain(err: tf.errors.OpError, paths: list[str], prepare: Callable, what: str) -> CorruptDataError | None:
    """A CorruptDataError naming the shard (and record) behind `err`, or None when `err` is no data fault.

    `paths`: the shards the failing pipeline read; `prepare`: its record -> example function; `what`:
    how the message continues (what the user can do).
    """
    if isinstance(err, tf.errors.DataLossError):
        bad = truncated_shards(paths) or [f"no truncated shard found among the {len(paths)} read"]
        return CorruptDataError(f"corrupt TFRecord data ({errors.one_line(err)}): {'; '.join(bad)}")
    if not is_decode_error(err):
        return None
    bad = find_undecodable(paths, prepare)
    if not bad:
        return CorruptDataError(f"a record did not decode ({errors.one_line(err)}), yet a scan of the "
                                f"{len(paths)} shards read found none that fails again: {what}")
    return CorruptDataError(f"corrupt image: {'; '.join(bad)}. {what}")
