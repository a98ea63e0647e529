"""NVIDIA DALI input pipelines on the same TFRecord shards (`data.loader='dali'`; optional: `make dali`).

The same contract as the tf.data pipeline (data/input/pipeline.py): per-worker functions of a
`tf.distribute.InputContext`, uint8 NHWC images and int32 labels (eval: plus a float mask), the
same shards, the same data assignment, the same augmentation semantics:

  train  reader (this worker's files, shuffled through a buffer of `data.shuffle_buffer` records)
         -> imagenet: random-resized-crop decode (area and aspect ranges below) -> bilinear resize -> flip
            none:     full decode -> bilinear resize
  eval   reader (every eval file, this worker's contiguous part, file order) -> imagenet: the central
         `data.eval_crop_fraction` of the shorter side, decoded alone, resized; none: decode, resize
         -> tf.data: the worker's real examples, then masked padding up to the common number of batches.

Where JPEGs are decoded (`data.dali_decode`): `mixed` decodes on the worker's GPU (nvJPEG; resize and
flip run there too), DALI's reason to exist, for a worker process that feeds one replica (`decode_device`);
`cpu` uses DALI's CPU decoder. Either way DALI hands
TensorFlow a host batch of uint8 images (with `mixed`, one copy back from the GPU: ~150 KB an image at
224 px, under 1 GB/s at 5,000 images/sec, a small share of a PCIe link), and the strategy copies it to
the device ahead of the step as it does tf.data's batches. NVIDIA's GPU-resident hand-over needs
MirroredStrategy's per-replica input mode, which MultiWorkerMirroredStrategy and Horovod's one-device
strategy do not implement (TensorFlow raises NotImplementedError); the host hand-over keeps one path,
the one tested here, for every backend, label check and eval padding included. The `mixed` path
itself has not run in tfscale's tests, which have no GPU.

Data assignment. With at least as many files as workers (data.assignment_level file/auto), each
worker's reader gets exactly the files tf.data's would (data.assignment.assign): every scheme works.
With fewer files, `disjoint` splits the examples with DALI's shard_id/num_shards (contiguous blocks,
fixed per worker) and `full` reads everything; the other schemes are refused by name.

Differences from tf.data that remain: DALI samples the crop's aspect ratio (log-uniform) and falls
back to a whole-image crop after 10 failed attempts, TensorFlow's sample_distorted_bounding_box to the
central 87.5%; resampling differs in rounding (pixels agree within a few levels, tests/test_dali.py);
records are shuffled through DALI's buffer (files in a fixed order), not reshuffled file lists.
"""

from __future__ import annotations

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import errors
from tfscale.cluster import devices
from tfscale.config import DALI_INSTALL_HINT
from tfscale.config.rules import check_assignment
from tfscale.data.convert import dali_index
from tfscale.data.input import assignment, pipeline, preprocess, shard_dir

try:
    import nvidia.dali.tfrecord as tfrec
    from nvidia.dali import fn
    from nvidia.dali import math as dali_math
    from nvidia.dali import pipeline_def, types
    from nvidia.dali.plugin import tf as dali_tf
except ImportError as _err:  # validation.validate says it first; this covers callers that skip it
    raise ImportError(f"config.data.loader='dali' needs NVIDIA DALI: {DALI_INSTALL_HINT} ({_err})") from _err

# Random-resized crop, the ranges of tf.data's sample_distorted_bounding_box: area 0.08-1 of the image,
# but a crop must also cover MIN_OBJECT_COVERED of the (whole-image) box, so its area is >= 0.1 there.
AREA_RANGE = (max(preprocess.AREA_RANGE[0], preprocess.MIN_OBJECT_COVERED), preprocess.AREA_RANGE[1])
_SUPPORTED_EXAMPLE_LEVEL = ("disjoint", "full")
_READER = "Reader"


def decode_device(dali_decode: str, num_gpus: int, local_replicas: int = 1) -> str:
    """"mixed" (GPU decoding) or "cpu" for `data.dali_decode`, given this worker's GPUs and replicas.

    A worker's DALI pipeline decodes on one GPU (`_gpu_ordinal`) and feeds all of its replicas, so GPU
    decoding needs one replica per worker process (mwms, horovod; or a one-GPU process): under
    `mirrored` on a node of G GPUs, GPU 0 would decode for all G while also training. `auto` then
    decodes on the CPU, and says so; `mixed` is refused.
    """
    if dali_decode == "cpu":
        return "cpu"
    if num_gpus == 0:
        if dali_decode == "mixed":
            raise errors.ConfigError("config.data.dali_decode='mixed' decodes on a GPU and this process sees none: "
                                     "use 'cpu' (or 'auto')")
        return "cpu"
    if local_replicas > 1:
        why = (f"this worker process feeds {local_replicas} replicas (config.distribute.backend='mirrored'?) from one "
               "DALI pipeline, whose GPU decoding would run on one of their GPUs")
        if dali_decode == "mixed":
            raise errors.ConfigError(f"config.data.dali_decode='mixed': {why}. Run one process per GPU "
                                     "(config.distribute.backend='mwms' or 'horovod'), or use config.data.dali_decode='cpu'")
        logging.warning("DALI decodes on the CPU (config.data.dali_decode='auto'): %s; for GPU decoding run one "
                        "process per GPU (config.distribute.backend='mwms' or 'horovod')", why)
        return "cpu"
    return "mixed"


def _visible_gpus() -> int:
    """GPUs this process keeps (distribute.setup has left one per worker process, or all for mirrored)."""
    return len(tf.config.get_visible_devices("GPU"))


def _num_threads(data_cfg: ml_collections.ConfigDict) -> int:
    """DALI's CPU threads: `data.dali_threads`, or the cores this process may use (SLURM_CPUS_PER_TASK-capped)."""
    return data_cfg.dali_threads or devices.usable_cores()


def _gpu_ordinal() -> int:
    """The CUDA ordinal of this worker's GPU (distribute.py leaves one visible to TensorFlow)."""
    return int(tf.config.get_visible_devices("GPU")[0].name.rsplit(":", 1)[1])


def reader_files(data_cfg: ml_collections.ConfigDict, files: list[str], rank: int,
                 num_workers: int) -> tuple[list[str], int, int]:
    """(files, shard_id, num_shards) of worker `rank`'s training reader under data.assignment."""
    check_assignment(data_cfg.assignment, data_cfg.copies, num_workers)
    if assignment.shard_level(len(files), num_workers, data_cfg.assignment_level) == "file":
        return pipeline.worker_files(files, data_cfg, rank, num_workers), 0, 1
    if data_cfg.assignment not in _SUPPORTED_EXAMPLE_LEVEL:
        raise errors.ConfigError(
            f"config.data.assignment={data_cfg.assignment!r} assigns single examples here ({len(files)} files, "
            f"{num_workers} workers), which config.data.loader='dali' does not implement (only "
            f"{' and '.join(_SUPPORTED_EXAMPLE_LEVEL)}): write at least {num_workers} shards, or use loader='tfdata'")
    if data_cfg.assignment == "full":
        return files, 0, 1
    return files, rank, num_workers


def shard_size(num_examples: int, shard_id: int, num_shards: int) -> int:
    """Examples DALI's reader gives shard `shard_id` of `num_shards` (its contiguous block of the list)."""
    return num_examples * (shard_id + 1) // num_shards - num_examples * shard_id // num_shards


def _indexes(data_cfg: ml_collections.ConfigDict, data_dir: str, files: list[str]) -> list[str]:
    """The index files of `files`, written where missing or stale; a truncated shard stops the run (exit 65)."""
    try:
        return dali_index.ensure_indexes(files, dali_index.index_dir(data_dir, data_cfg.dali_index_dir))
    except dali_index.TruncatedShard as err:
        raise errors.CorruptDataError(f"corrupt TFRecord data: {err}") from err
    except dali_index.DaliIndexError as err:
        raise errors.ConfigError(str(err)) from err


def _read(files: list[str], indexes: list[str], *, shard_id: int, num_shards: int, shuffle_buffer: int,
          label_offset: int):
    """(encoded image, int32 label - label_offset) DataNodes of a TFRecord reader."""
    shuffle = dict(random_shuffle=True, initial_fill=shuffle_buffer) if shuffle_buffer > 1 else {}
    record = fn.readers.tfrecord(
        path=files, index_path=indexes, shard_id=shard_id, num_shards=num_shards, stick_to_shard=True,
        name=_READER, features={
            "image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
            "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1),
        }, **shuffle)
    label = fn.cast(fn.reshape(record["image/class/label"], shape=[]) - label_offset, dtype=types.INT32)
    return record["image/encoded"], label


def _resize(images, image_size: int):
    """Bilinear, no antialias, uint8 in and out: the resize of tf.data's pipeline."""
    return fn.resize(images, size=[image_size, image_size], interp_type=types.INTERP_LINEAR, antialias=False)


def _center_window(encoded, crop_fraction: float):
    """(anchor [x, y], shape [side, side]) of preprocess._center_window: same truncation and rounding."""
    shape = fn.peek_image_shape(encoded)  # [H, W, C]
    height, width = fn.cast(shape[0], dtype=types.INT32), fn.cast(shape[1], dtype=types.INT32)
    side = fn.cast(dali_math.floor(crop_fraction * fn.cast(dali_math.min(height, width), dtype=types.FLOAT)),
                   dtype=types.INT32)
    side = dali_math.max(side, 1)
    anchor = fn.stack((width - side + 1) // 2, (height - side + 1) // 2)
    return anchor, fn.stack(side, side)


@pipeline_def(enable_conditionals=False)
def _train_pipeline(files, indexes, *, shard_id, num_shards, data_cfg, device):
    """Random-resized crop (imagenet) or plain resize (none); decoded on `device` ("cpu" or "mixed")."""
    encoded, label = _read(files, indexes, shard_id=shard_id, num_shards=num_shards,
                           shuffle_buffer=data_cfg.shuffle_buffer, label_offset=data_cfg.label_offset)
    if data_cfg.augment == "imagenet":
        images = fn.decoders.image_random_crop(
            encoded, device=device, output_type=types.RGB, random_area=list(AREA_RANGE),
            random_aspect_ratio=list(preprocess.ASPECT_RATIO_RANGE), num_attempts=preprocess.MAX_ATTEMPTS)
        images = fn.flip(_resize(images, data_cfg.image_size), horizontal=fn.random.coin_flip(probability=0.5))
    else:
        images = _resize(fn.decoders.image(encoded, device=device, output_type=types.RGB), data_cfg.image_size)
    return images.cpu(), label  # the host hand-over (module docstring); a no-op when decoded on the CPU


@pipeline_def(enable_conditionals=False)
def _eval_pipeline(files, indexes, *, shard_id, num_shards, data_cfg, device):
    """The central crop (imagenet) or plain resize (none), no randomness; decoded on `device`."""
    encoded, label = _read(files, indexes, shard_id=shard_id, num_shards=num_shards, shuffle_buffer=1,
                           label_offset=data_cfg.label_offset)
    if data_cfg.augment == "imagenet":
        anchor, shape = _center_window(encoded, data_cfg.eval_crop_fraction)
        images = fn.decoders.image_slice(encoded, anchor, shape, device=device, output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False, axis_names="WH")
    else:
        images = fn.decoders.image(encoded, device=device, output_type=types.RGB)
    return _resize(images, data_cfg.image_size).cpu(), label


def _dataset(pipe, batch_size: int, image_size: int) -> tf.data.Dataset:
    """The pipeline as a host-side tf.data dataset of (uint8 images, int32 labels) batches."""
    with tf.device("/cpu:0"):
        return dali_tf.DALIDataset(
            pipeline=pipe, batch_size=batch_size, num_threads=pipe.num_threads, device_id=pipe.device_id,
            output_shapes=((batch_size, image_size, image_size, 3), (batch_size,)),
            output_dtypes=(tf.uint8, tf.int32),
            # A GPU pipeline feeding a host-side op is the intended hand-over here: its outputs are host buffers.
            fail_on_device_mismatch=pipe.device_id is None)


def _pipeline_args(data_cfg: ml_collections.ConfigDict, input_context: tf.distribute.InputContext,
                   batch_size: int, seed: int) -> dict:
    """Pipeline keywords: the decode device, and the GPU (CUDA ordinal) when it is "mixed"."""
    local_replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    device = decode_device(data_cfg.dali_decode, _visible_gpus(), local_replicas)
    return dict(device=device, batch_size=batch_size, num_threads=_num_threads(data_cfg), seed=seed,
                device_id=_gpu_ordinal() if device == "mixed" else None,
                exec_dynamic=True)  # DALI's executor that allows the GPU -> CPU step (`.cpu()`)


def train_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, start_step: int, data_dir: str):
    """DALI's `pipeline.train_input_fn`: per-replica batches (uint8 images, int32 labels), endless."""

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        rank, workers = input_context.input_pipeline_id, input_context.num_input_pipelines
        files, shard_id, num_shards = reader_files(data_cfg, shard_dir.list_shards(data_dir, data_cfg.train_split),
                                                   rank, workers)
        shard_dir.require_present(files, data_dir, f"worker {rank} of {workers} reads")
        batch = input_context.get_per_replica_batch_size(data_cfg.global_batch_size)
        args = _pipeline_args(data_cfg, input_context, batch, seed=pipeline.worker_seed(seed, start_step, rank))
        pipe = _train_pipeline(files, _indexes(data_cfg, data_dir, files), shard_id=shard_id, num_shards=num_shards,
                               data_cfg=data_cfg, **args)
        logging.info("DALI training input of worker %d: %d files, shard %d of %d, %s decoding, %d threads%s",
                     rank, len(files), shard_id, num_shards, args["device"], pipe.num_threads,
                     " (data.cache is a tf.data option: DALI reads the shards every pass)" if data_cfg.cache else "")
        ds = _dataset(pipe, batch, data_cfg.image_size).map(pipeline.label_check_fn(data_cfg))
        return pipeline.finish(ds, data_cfg)

    return input_fn


def eval_input_fn(data_cfg: ml_collections.ConfigDict, *, global_batch_size: int, num_steps: int, data_dir: str):
    """DALI's `pipeline.eval_input_fn`: `num_steps` batches (images, labels, mask), padding masked out.

    Worker r of W evaluates its contiguous part of the eval examples (DALI's shard r of W) in file
    order, every time the same.
    """

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        rank, workers = input_context.input_pipeline_id, input_context.num_input_pipelines
        files = shard_dir.list_shards(data_dir, data_cfg.eval_split)
        shard_dir.require_present(files, data_dir, f"of {data_cfg.eval_split} (every worker evaluates from every file)")
        indexes = _indexes(data_cfg, data_dir, files)
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        pipe = _eval_pipeline(files, indexes, shard_id=rank, num_shards=workers, data_cfg=data_cfg,
                              **_pipeline_args(data_cfg, input_context, batch, seed=0))
        decoded = _dataset(pipe, batch, data_cfg.image_size)
        # The reader wraps around into the next pass: keep this worker's examples of the first one.
        real = decoded.unbatch().take(shard_size(dali_index.num_records(indexes), rank, workers)).map(
            lambda image, label: (image, label, tf.constant(1.0)))
        return pipeline.pad_eval(real, data_cfg, input_context, global_batch_size=global_batch_size,
                                 num_steps=num_steps)

    return input_fn
