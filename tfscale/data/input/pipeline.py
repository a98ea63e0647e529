"""Input pipelines, handed to the strategy as per-replica dataset functions.

`train_input_fn` / `eval_input_fn` return functions of a `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`: each worker builds only its own share of the data and
batches per replica, so tf.distribute never re-shards (its auto-sharding is switched off).

TFRecord training input, per worker:
  shards -> this worker's files (data.assignment) -> their records in a new permutation every pass,
  read by offset from the shards' index files (record_index.py; data.shuffle='index')
  [or: files reshuffled every pass -> parallel interleave -> shuffle buffer of serialized records
  (data.shuffle='buffer', and where no index can be had)]
  -> ONE parallel map: parse + decode (only the crop window, no format branch for tfscale-convert's
  all-JPEG shards) + augment -> batch per replica -> label check per batch
  -> optional batch augmentation (RandAugment / MixUp / CutMix) -> prefetch.
Every stage off the parallel paths costs throughput: bench-input compares this pipeline with a
plain Model-Garden-style one that has none of these extras.
Images leave tf.data as uint8; the model normalises them on the device (4x less host traffic).

Evaluation reads every example exactly once over all workers: example i goes to worker i mod W, and
each worker pads its share with masked examples up to the same number of batches, so no worker
waits for a batch that never comes and no example is dropped or counted twice.
"""

from __future__ import annotations

import os
from typing import Callable

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale.cluster import devices
from tfscale.config.names import SYNTHETIC_DATASETS
from tfscale.config.rules import check_assignment
from tfscale.data.convert import dali_index
from tfscale.data.input import assignment, batch_augment, faults, info, preprocess, record_index, shard_dir, synthetic

InputFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
_READ_BUFFER_BYTES = 8 << 20  # per open shard; large sequential reads suit parallel file systems



def label_check_fn(data_cfg: ml_collections.ConfigDict):
    """Labels outside [0, num_classes) mean a wrong label offset or class count: fail loudly.

    Checks a whole batch at once (element = (images, labels, ...)): a per-example stage on the
    pipeline's sequential path cost more throughput than the check itself (bench-input).
    """
    num_classes, offset = data_cfg.num_classes, data_cfg.label_offset

    def check(images, labels, *rest):
        too_big = tf.debugging.assert_less(
            labels, num_classes,
            message=f"label >= config.data.num_classes={num_classes}; check config.data.label_offset={offset}",
        )
        negative = tf.debugging.assert_non_negative(
            labels, message=f"label < 0 after subtracting config.data.label_offset={offset}; is it {offset - 1}?",
        )
        with tf.control_dependencies([too_big, negative]):
            return (images, tf.identity(labels), *rest)

    return check


def _parse_fn(data_cfg: ml_collections.ConfigDict):
    """serialized tf.Example -> (encoded JPEG, stored label - label_offset)."""
    return lambda serialized: preprocess.parse_example(serialized, label_offset=data_cfg.label_offset)


def _keep_indices(ds: tf.data.Dataset, keep: Callable) -> tf.data.Dataset:
    """The elements of `ds` whose position i (0-based, int64) satisfies keep(i)."""

    def kept(index, element):
        return keep(index)

    def element_only(index, element):
        return element

    return ds.enumerate().filter(kept).map(element_only)


def worker_files(files: list[str], data_cfg, rank: int, workers: int) -> list[str]:
    """The training shards worker `rank` of `workers` reads: its files under data.assignment, or every
    file when the scheme assigns examples (fewer files than workers)."""
    if assignment.shard_level(len(files), workers, data_cfg.assignment_level) != "file":
        return files
    scheme = dict(scheme=data_cfg.assignment, copies=data_cfg.copies, num_workers=workers)
    return [files[i] for i in assignment.assign(len(files), rank=rank, **scheme)]


def _worker_records(files: list[str], data_cfg, input_context, seed: int) -> tuple[tf.data.Dataset, bool]:
    """This worker's serialized records, endlessly, and whether they come shuffled already: a new
    permutation every pass (data.shuffle='index', whole files assigned, no cache), else in shuffled
    file order for the shuffle buffer to mix."""
    rank, workers = input_context.input_pipeline_id, input_context.num_input_pipelines
    scheme = dict(scheme=data_cfg.assignment, copies=data_cfg.copies, num_workers=workers)
    check_assignment(data_cfg.assignment, data_cfg.copies, workers)
    if assignment.shard_level(len(files), workers, data_cfg.assignment_level) == "file":
        mine = worker_files(files, data_cfg, rank, workers)
        shard_dir.require_present(mine, os.path.dirname(mine[0]), f"worker {rank} of {workers} reads")
        if data_cfg.shuffle == "index" and not data_cfg.cache:  # a cache holds the records anyway
            index_dir = dali_index.index_dir(os.path.dirname(mine[0]), data_cfg.dali_index_dir)
            spans = record_index.load_spans(mine, index_dir)
            if spans is not None:
                logging.info("worker %d reads its %d training records in a new permutation every pass (record "
                             "index in %s)", rank, spans.count, index_dir)
                return record_index.shuffled_records(spans, seed, data_cfg.deterministic), True
        ds = tf.data.Dataset.from_tensor_slices(mine)
        if not data_cfg.cache:  # a cache below freezes the first epoch's file order anyway
            ds = ds.shuffle(len(mine), seed=seed, reshuffle_each_iteration=True).repeat()
        ds = ds.interleave(
            lambda f: tf.data.TFRecordDataset(f, buffer_size=_READ_BUFFER_BYTES),
            cycle_length=min(data_cfg.interleave_cycle, len(mine)), block_length=1,
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=data_cfg.deterministic,
        )
    else:
        # Fewer files than workers: every worker reads all files in one fixed order and keeps
        # its examples; the fixed order is what makes example indices agree across workers.
        shard_dir.require_present(files, os.path.dirname(files[0]), f"every worker of {workers} reads")
        ds = tf.data.TFRecordDataset(files, buffer_size=_READ_BUFFER_BYTES)
        keep = tf.constant(assignment.pattern(rank=rank, **scheme))  # periodic: item i kept iff keep[i % period]
        ds = _keep_indices(ds, lambda i: tf.gather(keep, i % tf.size(keep, out_type=tf.int64)))
        if not data_cfg.cache:
            ds = ds.repeat()
    if data_cfg.cache:
        ds = ds.cache().repeat()
    return ds, False


def assignment_report(data_cfg: ml_collections.ConfigDict, data_dir: str, num_workers: int) -> dict | None:
    """`assignment.report` of this run's training data (None for synthetic and TFDS input).

    Whole files are assigned when there are enough of them: then the figures count files, and
    examples per worker are the files' share of `data.num_train_examples`.
    """
    if data_cfg.dataset != "tfrecord":
        return None
    num_files = len(shard_dir.list_shards(data_dir, data_cfg.train_split))
    scheme = dict(num_workers=num_workers, scheme=data_cfg.assignment, copies=data_cfg.copies)
    if assignment.shard_level(num_files, num_workers, data_cfg.assignment_level) == "example":
        return assignment.report(data_cfg.num_train_examples, **scheme, item="examples")
    summary = assignment.report(num_files, **scheme, item="files")
    per_file = data_cfg.num_train_examples / num_files
    summary["examples_per_worker_min"] = round(summary["items_per_worker_min"] * per_file)
    summary["examples_per_worker_max"] = round(summary["items_per_worker_max"] * per_file)
    return summary


def _tfds_records(data_cfg, split: str, input_context, *, seed: int, shuffle_files: bool):
    """(encoded image, label) pairs from a locally prepared TFDS dataset; never downloads."""
    import tensorflow_datasets as tfds  # only needed for dataset=tfds

    if data_cfg.assignment != "disjoint":
        raise ValueError(
            f"config.data.assignment={data_cfg.assignment!r} is for TFRecord shards; TFDS input is always "
            "split disjointly over workers (by TFDS's own file sharding)"
        )
    builder = info.tfds_builder(data_cfg)
    # Training input is split between workers by file; engine.setup refused fewer files than workers.
    read_config = tfds.ReadConfig(input_context=input_context, shuffle_seed=seed,
                                  interleave_cycle_length=data_cfg.interleave_cycle)
    ds = builder.as_dataset(split=split, shuffle_files=shuffle_files, read_config=read_config,
                            decoders={"image": tfds.decode.SkipDecoding()})
    return ds.map(lambda ex: (ex["image"], ex["label"] - data_cfg.label_offset))


def tf_data_options(data_cfg: ml_collections.ConfigDict, deterministic: bool | None = None) -> tf.data.Options:
    """`deterministic`: None follows data.deterministic; True where order is correctness (eval)."""
    options = tf.data.Options()
    # tfscale shards by itself (per input pipeline); a second, automatic sharding would drop data.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = bool(data_cfg.deterministic if deterministic is None else deterministic)
    # The autotuner's model thread sleeps between tuning rounds (longer as a run goes on) and,
    # behind tf.distribute's MultiDeviceIterator, deleting the iterator waits for it to wake
    # (RootDataset::Iterator::~Iterator joins it): a run's end stalled 8-15 s on a worker. Without
    # it AUTOTUNE means the thread pool's size (capped at 16 per map) and a prefetch buffer that grows
    # when it runs dry; measured here at parity or better (docs/benchmarking.md). The per-device
    # datasets tf.distribute builds behind this one are untuned too: collectives.untune_device_datasets.
    options.autotune.enabled = bool(data_cfg.autotune)
    if data_cfg.private_threads:
        options.threading.private_threadpool_size = data_cfg.private_threads
    elif (cores := devices.input_thread_cap()) is not None:
        # A Slurm task on a node whose tasks are not bound to cores sees the whole node: its share
        # is SLURM_CPUS_PER_TASK, and G tasks sizing their pools to the node would oversubscribe it G times.
        options.threading.private_threadpool_size = cores
        options.autotune.cpu_budget = cores
    if data_cfg.ram_budget_mb:
        options.autotune.ram_budget = data_cfg.ram_budget_mb << 20
    return options


def finish(ds: tf.data.Dataset, data_cfg, deterministic: bool | None = None) -> tf.data.Dataset:
    return ds.with_options(tf_data_options(data_cfg, deterministic)).prefetch(tf.data.AUTOTUNE)


def _batch_augment(ds: tf.data.Dataset, data_cfg) -> tf.data.Dataset:
    augmenter = batch_augment.batch_augmenter(
        data_cfg.batch_augment, num_classes=data_cfg.num_classes, randaugment_ops=data_cfg.randaugment_ops,
        randaugment_factor=data_cfg.randaugment_factor, mixup_alpha=data_cfg.mixup_alpha,
        cutmix_factor=data_cfg.cutmix_factor,
    )
    return ds if augmenter is None else ds.map(augmenter, num_parallel_calls=tf.data.AUTOTUNE)


def _train_example_fn(data_cfg: ml_collections.ConfigDict, data_dir: str):
    """record -> (uint8 image, int32 label): parse (TFRecord) + decode + augment, one function.

    One parallel map from record to training example: separate stages (parse, label check,
    decode) cost a hand-over between tf.data threads per example, a few % (bench-input).
    """
    to_example = (lambda encoded, label: (encoded, label)) if data_cfg.dataset == "tfds" else _parse_fn(data_cfg)
    jpeg_only = data_cfg.dataset == "tfrecord" and shard_dir.holds_only_jpeg(data_dir, data_cfg.train_split)

    def prepare(*record):
        encoded, label = to_example(*record)
        image = preprocess.train_preprocess(encoded, image_size=data_cfg.image_size, augment=data_cfg.augment,
                                            jpeg_only=jpeg_only)
        return image, tf.cast(label, tf.int32)

    return prepare


def _eval_example_fn(data_cfg: ml_collections.ConfigDict, data_dir: str):
    """(encoded, label) -> (uint8 image, int32 label, mask 1.0): the eval crop."""
    jpeg_only = data_cfg.dataset == "tfrecord" and shard_dir.holds_only_jpeg(data_dir, data_cfg.eval_split)

    def prepare(encoded, label):
        image = preprocess.eval_preprocess(
            encoded, image_size=data_cfg.image_size, augment=data_cfg.augment,
            crop_fraction=data_cfg.eval_crop_fraction, jpeg_only=jpeg_only,
        )
        return image, tf.cast(label, tf.int32), tf.constant(1.0)

    return prepare


def worker_seed(seed: int, start_step: int, rank: int) -> int:
    """The shuffle seed of worker `rank`: its own order (as `full` assignment needs), new at every restart."""
    return (seed * 1_000_003 + start_step * 7_919 + rank) % 2**31


def train_records(data_cfg: ml_collections.ConfigDict, data_dir: str, input_context, seed: int) -> tf.data.Dataset:
    """This worker's serialized training records from the shards in `data_dir`, endlessly, shuffled as
    data.shuffle says (a permutation per pass, or through the shuffle buffer)."""
    records, shuffled = _worker_records(shard_dir.list_shards(data_dir, data_cfg.train_split), data_cfg,
                                        input_context, seed)
    return records if shuffled else _buffer_shuffle(records, data_cfg, seed)


def _buffer_shuffle(records: tf.data.Dataset, data_cfg, seed: int) -> tf.data.Dataset:
    if data_cfg.shuffle_buffer <= 1:
        return records
    # The records, before parsing: the smallest form an example takes here. Holding 10,000 of them
    # costs 2-6% of the input rate in memory traffic (bench-input's "shuffle buffer" row).
    return records.shuffle(data_cfg.shuffle_buffer, seed=seed)


def train_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, start_step: int,
                   data_dir: str | None = None, skipped_images: tf.Variable | None = None) -> InputFn:
    """Training batches (uint8 images, labels) from global step `start_step` on.

    `data_dir` overrides `data_cfg.data_dir` (the staged copy). Synthetic data resumes exactly at
    `start_step`; record streams are reshuffled with a seed that includes it, so a resumed run
    does not replay the examples it began with. With `data.skip_corrupt_images`, records whose image
    does not decode are dropped and counted in `skipped_images` (an int64 variable of this worker).
    """
    data_dir = data_dir or data_cfg.data_dir

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if data_cfg.dataset in SYNTHETIC_DATASETS:
            return finish(synthetic.train_dataset(data_cfg, input_context, seed=seed, start_step=start_step), data_cfg)
        shuffle_seed = worker_seed(seed, start_step, input_context.input_pipeline_id)
        per_replica_batch = input_context.get_per_replica_batch_size(data_cfg.global_batch_size)
        if data_cfg.dataset == "tfds":
            records = _tfds_records(data_cfg, data_cfg.train_split, input_context, seed=shuffle_seed, shuffle_files=True)
            records = _buffer_shuffle(records.repeat(), data_cfg, shuffle_seed)
        else:
            records = train_records(data_cfg, data_dir, input_context, shuffle_seed)
        prepare = _train_example_fn(data_cfg, data_dir)
        if data_cfg.skip_corrupt_images:
            size = data_cfg.image_size
            placeholder = (tf.zeros([size, size, 3], tf.uint8), tf.constant(0, tf.int32))
            ds = faults.skip_undecodable(records, prepare, placeholder, skipped_images,
                                         deterministic=data_cfg.deterministic)
        else:
            ds = records.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=data_cfg.deterministic)
        ds = ds.batch(per_replica_batch, drop_remainder=True).map(label_check_fn(data_cfg))
        ds = _batch_augment(ds, data_cfg)
        return finish(ds, data_cfg)

    return input_fn


def _eval_records(data_cfg, data_dir: str, input_context) -> tf.data.Dataset:
    """(encoded, label) of this worker's eval examples: example i goes to worker i mod W."""
    rank, workers = input_context.input_pipeline_id, input_context.num_input_pipelines
    if data_cfg.dataset == "tfds":
        ds = _tfds_records(data_cfg, data_cfg.eval_split, None, seed=0, shuffle_files=False)
    else:
        files = shard_dir.list_shards(data_dir, data_cfg.eval_split)
        shard_dir.require_present(files, data_dir, f"of {data_cfg.eval_split} (every worker evaluates from every file)")
        # A deterministic interleave: parallel reads, yet every worker numbers the examples alike.
        ds = tf.data.Dataset.from_tensor_slices(files).interleave(
            lambda f: tf.data.TFRecordDataset(f, buffer_size=_READ_BUFFER_BYTES),
            cycle_length=min(data_cfg.interleave_cycle, len(files)), num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        ).map(_parse_fn(data_cfg))
    return _keep_indices(ds, lambda i: i % workers == rank)


def pad_eval(real: tf.data.Dataset, data_cfg, input_context, *, global_batch_size: int,
             num_steps: int) -> tf.data.Dataset:
    """This worker's (image, label, 1.0) examples, padded with masked ones to `num_steps` per-replica batches."""
    per_replica_batch = input_context.get_per_replica_batch_size(global_batch_size)
    local_replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    size = data_cfg.image_size
    padding = tf.data.Dataset.from_tensors(
        (tf.zeros([size, size, 3], tf.uint8), tf.constant(0, tf.int32), tf.constant(0.0))
    ).repeat()
    ds = real.concatenate(padding).take(num_steps * local_replicas * per_replica_batch)
    ds = ds.batch(per_replica_batch, drop_remainder=True).map(label_check_fn(data_cfg))
    # Always deterministic: the options also reach upstream ops that take their order from them
    # (TFDS's parallel decode map), and example i must be the same example on every worker.
    return finish(ds, data_cfg, deterministic=True)


def eval_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, global_batch_size: int, num_steps: int,
                  data_dir: str | None = None) -> InputFn:
    """`num_steps` eval batches (images, labels, mask); mask 0 marks padding of the last batch."""
    data_dir = data_dir or data_cfg.data_dir

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if data_cfg.dataset in SYNTHETIC_DATASETS:
            ds = synthetic.eval_dataset(
                data_cfg, input_context, seed=seed, global_batch_size=global_batch_size, num_steps=num_steps
            )
            return finish(ds, data_cfg)
        real = _eval_records(data_cfg, data_dir, input_context).map(
            _eval_example_fn(data_cfg, data_dir), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )
        return pad_eval(real, data_cfg, input_context, global_batch_size=global_batch_size, num_steps=num_steps)

    return input_fn


def explain_read_error(err: tf.errors.OpError, data_cfg: ml_collections.ConfigDict, data_dir: str, split: str, *,
                       rank: int, num_workers: int) -> Exception | None:
    """A `faults.CorruptDataError` naming the shard and record behind a read error of worker `rank`'s
    `split` pipeline; None when `err` is no data fault (re-raise it) or the data are not shards."""
    if data_cfg.dataset != "tfrecord":
        return None
    read = shard_dir.list_shards(data_dir, split)
    if split == data_cfg.eval_split:
        advice = "Evaluation never skips an image (its counts are exact): re-convert or remove that record"
    else:
        read = worker_files(read, data_cfg, rank, num_workers)
        skip = ("--config.data.skip_corrupt_images=True" if data_cfg.loader == "tfdata" else
                "--config.data.loader=tfdata --config.data.skip_corrupt_images=True (DALI cannot skip them)")
        advice = f"Re-convert that shard, or skip such records with {skip} (counted in metrics.jsonl and summary.json)"
    parse = _parse_fn(data_cfg)
    # The whole image, not the step's crop: a JPEG cut short decodes in a random window above the cut,
    # so the crop that failed may not fail again, and the scan must not depend on that luck.
    decode_all = lambda record: preprocess.decode_full(parse(record)[0])  # noqa: E731
    present = [p for p in read if not shard_dir.is_staged_copy(data_dir) or os.path.exists(p)]  # a node's partial copy
    return faults.explain(err, present, decode_all, advice)
