"""Benchmarks in the spirit of tf_cnn_benchmarks, built from the same parts as training.

    python -m tfscale.benchmark --config=configs/r50_1gpu.py --workdir=runs/bench_input \
        --config.benchmark.mode=input --config.data.dataset=tfrecord \
        --config.data.data_dir=SHARDS --config.benchmark.image_dir=JPEG_TREE

`input` mode measures the training input pipeline alone, side by side in one run with
  (a) a decode-only ceiling: the same shards read in parallel and every JPEG fully decoded with
      `tf.io.decode_jpeg`, no augmentation, images delivered as ragged batches;
  (b) what a Keras user writes instead: `keras.utils.image_dataset_from_directory` on the same
      images as JPEG files (resized to 8/7 of the crop, as the usual 256 -> 224 recipe) followed by
      `RandomCrop` + `RandomFlip` (Keras 3 has no random-resized-crop layer).
The pipelines run in turn for `benchmark.input_rounds` rounds and each figure is the median, so
background load hits all three alike. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import keras
import ml_collections
import tensorflow as tf
from absl import app, flags, logging
from ml_collections import config_flags

from tfscale import config as tfs_config
from tfscale.data import pipeline, preprocess

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for benchmark.json.")

_KERAS_RESIZE_RATIO = 8 / 7  # resize to 256 before a 224 crop, as the classic ImageNet recipe


def _num_images(batch) -> int:
    images = batch[0]
    return int(images.nrows()) if isinstance(images, tf.RaggedTensor) else int(images.shape[0])


def images_per_sec(ds: tf.data.Dataset, *, warmup_batches: int, timed_batches: int) -> float:
    """Throughput of iterating `ds` on the host, excluding `warmup_batches` (autotuning, file opens)."""
    iterator = iter(ds)
    for _ in range(warmup_batches):
        next(iterator)
    num_images = 0
    start = time.perf_counter()
    for _ in range(timed_batches):
        num_images += _num_images(next(iterator))
    return num_images / (time.perf_counter() - start)


def tfscale_input(cfg: ml_collections.ConfigDict) -> tf.data.Dataset:
    """Exactly the training pipeline, for one worker."""
    return pipeline.train_input_fn(cfg.data, seed=cfg.seed, start_step=0)(tf.distribute.InputContext())


def decode_only_input(cfg: ml_collections.ConfigDict) -> tf.data.Dataset:
    """The same shards, reader parallelism and options, but a full JPEG decode and nothing else."""
    files = pipeline.list_shards(cfg.data.data_dir, cfg.data.train_split)
    ds = tf.data.Dataset.from_tensor_slices(files).repeat().interleave(
        tf.data.TFRecordDataset, cycle_length=min(cfg.data.interleave_cycle, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False,
    )

    def decode(serialized):
        encoded, label = preprocess.parse_example(serialized, label_offset=cfg.data.label_offset)
        return preprocess.decode_full(encoded), label

    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.ragged_batch(cfg.data.global_batch_size, drop_remainder=True)
    return ds.with_options(pipeline.tf_data_options(cfg.data)).prefetch(tf.data.AUTOTUNE)


def keras_baseline_input(cfg: ml_collections.ConfigDict, image_dir: str) -> tf.data.Dataset:
    """What the Keras tutorials write: image_dataset_from_directory + augmentation layers."""
    size = cfg.data.image_size
    load_size = round(size * _KERAS_RESIZE_RATIO)
    ds = keras.utils.image_dataset_from_directory(
        image_dir, image_size=(load_size, load_size), batch_size=cfg.data.global_batch_size, shuffle=True,
        seed=cfg.seed, verbose=False,
    )
    augment = keras.Sequential([keras.layers.RandomCrop(size, size), keras.layers.RandomFlip("horizontal")])

    def augment_batch(images, labels):
        return augment(images, training=True), labels

    ds = ds.repeat().map(augment_batch, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def run_input_benchmark(cfg: ml_collections.ConfigDict) -> dict:
    """Median images/sec of the three pipelines over `benchmark.input_rounds` interleaved rounds."""
    bench = cfg.benchmark
    candidates = {"tfscale": lambda: tfscale_input(cfg), "decode_only": lambda: decode_only_input(cfg)}
    if bench.image_dir:
        candidates["keras_baseline"] = lambda: keras_baseline_input(cfg, bench.image_dir)
    rates = {name: [] for name in candidates}
    for round_index in range(bench.input_rounds):
        for name, make in candidates.items():
            rate = images_per_sec(make(), warmup_batches=bench.num_warmup_batches, timed_batches=bench.num_batches)
            rates[name].append(rate)
            logging.info("round %d  %-15s %8.1f images/sec", round_index + 1, name, rate)
    result = {f"{name}_images_per_sec": round(statistics.median(r), 1) for name, r in rates.items()}
    result["rounds"] = {name: [round(x, 1) for x in r] for name, r in rates.items()}
    result.update(
        global_batch_size=cfg.data.global_batch_size, image_size=cfg.data.image_size,
        num_batches=bench.num_batches, num_warmup_batches=bench.num_warmup_batches, cpu_count=os.cpu_count(),
        tensorflow=tf.__version__, keras=keras.__version__,
    )
    return result


def _print_input_report(result: dict) -> None:
    ours = result["tfscale_images_per_sec"]
    print(f"input pipeline, images/sec (batch {result['global_batch_size']}, {result['image_size']}px, "
          f"median of {len(result['rounds']['tfscale'])} rounds):")
    print(f"  tfscale train pipeline (crop-window decode + flip)   {ours:9.1f}")
    rows = (("decode_only", "decode-only ceiling (full decode_jpeg)"),
            ("keras_baseline", "keras image_dataset_from_directory + RandomCrop/Flip"))
    for key, label in rows:
        if f"{key}_images_per_sec" in result:
            theirs = result[f"{key}_images_per_sec"]
            print(f"  {label:52s} {theirs:9.1f}   tfscale = {ours / theirs:.2f}x")
    print(json.dumps({k: v for k, v in result.items() if k.endswith("images_per_sec")}))


def run_benchmark(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
    tfs_config.validate(cfg)
    if cfg.benchmark.mode != "input":
        raise NotImplementedError(f"config.benchmark.mode={cfg.benchmark.mode!r} is not implemented yet")
    if cfg.data.dataset != "tfrecord":
        raise ValueError("config.benchmark.mode='input' needs config.data.dataset='tfrecord' and data_dir")
    result = run_input_benchmark(cfg)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "benchmark.json"), "w") as f:
        json.dump({"mode": "input", **result, "config": cfg.to_dict()}, f, indent=2)
    _print_input_report(result)
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    run_benchmark(_CONFIG.value, _WORKDIR.value)


def run():
    """Console-script entry point (`tfscale-bench`)."""
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=tfs_config.parse_flags)


if __name__ == "__main__":
    run()
