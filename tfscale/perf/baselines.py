"""What a user would write instead of tfscale, timed side by side with tfscale in one run.

Every comparison runs its candidates back to back in each of `benchmark.rounds` rounds (the order
reversed every other round) and reports each candidate's median rate and, for the figures to quote,
the median and range of the ratios taken within rounds: the host's drift between rounds cancels out
of those, not out of a ratio of medians.

  * `compare_input_pipelines` (benchmark.mode=input): tfscale's training input pipeline (as
      configured, and without its record shuffle buffer), with tf.data and, when DALI is installed
      (`make dali`), with DALI (data.loader=dali, decoding where data.dali_decode says), vs
      (m) a plain Model-Garden-style pipeline on the same shards: interleave -> one map (parse,
          random-resized-crop window, decode_and_crop_jpeg, resize, flip) -> batch -> prefetch, no
          shuffle buffer, no label checks; the same per-image ops as tfscale, so the ratio measures
          what tfscale's pipeline adds (Model Garden's own code also resizes in uint8 and normalises
          to float32 on the host, both slower: this baseline is the stricter one);
      (a) a decode-only ceiling: the same shards read in parallel and every JPEG fully decoded with
          `tf.io.decode_jpeg`, no augmentation, images delivered as ragged batches;
      (b) `keras.utils.image_dataset_from_directory` on the same images as JPEG files (resized to
          8/7 of the crop, as the usual 256 -> 224 recipe) followed by `RandomCrop` + `RandomFlip`
          (Keras 3 has no random-resized-crop layer).
  * tfscale's training loop vs Keras `model.fit`: tfscale.perf.keras_fit, with the helpers below.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
from typing import Callable

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging
from scipy import stats

from tfscale.data.input import loaders, pipeline, preprocess, shard_dir

_KERAS_RESIZE_RATIO = 8 / 7  # resize to 256 before a 224 crop, as the classic ImageNet recipe


def interleaved_rounds(candidates: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Every candidate (a function returning images/sec) once per round, back to back, the order reversed
    every other round, so that a host speeding up or slowing down within a round favours no side; every
    round's rate."""
    rates = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            rates[name].append(candidates[name]())
            logging.info("round %d  %-15s %8.1f images/sec", round_index + 1, name, rates[name][-1])
    return rates


def summarize_rates(rates: dict[str, list[float]]) -> dict:
    """`<name>_images_per_sec` medians plus every round's figure under `rounds`."""
    result = {f"{name}_images_per_sec": round(statistics.median(r), 1) for name, r in rates.items()}
    result["rounds"] = {name: [round(x, 1) for x in r] for name, r in rates.items()}
    return result


def paired_ratio(rates: dict[str, list[float]], ours: str, theirs: str) -> dict:
    """`ours` / `theirs` within each round (measured back to back): the median over rounds, and the spread.
    A ratio of the two medians would mix rounds, and with them the host's drift between rounds."""
    ratios = [a / b for a, b in zip(rates[ours], rates[theirs])]
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def ratio_text(ratio: dict) -> str:
    return f"{ratio['median']:.3f}x (rounds {ratio['min']:.3f}-{ratio['max']:.3f})"


# --- input pipelines ------------------------------------------------------------------------------


def _num_images(batch) -> int:
    images = batch[0]
    return int(images.nrows()) if isinstance(images, tf.RaggedTensor) else int(images.shape[0])


def dataset_images_per_sec(ds: tf.data.Dataset, *, warmup_batches: int, timed_batches: int) -> float:
    """Throughput of iterating `ds` on the host, excluding `warmup_batches` (autotuning, file opens)."""
    iterator = iter(ds)
    for _ in range(warmup_batches):
        next(iterator)
    num_images = 0
    start = time.perf_counter()
    for _ in range(timed_batches):
        num_images += _num_images(next(iterator))
    return num_images / (time.perf_counter() - start)


def tfscale_input(cfg: ml_collections.ConfigDict, loader: str = "tfdata") -> tf.data.Dataset:
    """Exactly the training pipeline, for one worker, with `loader` reading the shards."""
    cfg = copy.deepcopy(cfg)
    cfg.data.loader = loader
    return loaders.train_input_fn(cfg.data, seed=cfg.seed, start_step=0)(tf.distribute.InputContext())


def dali_installed() -> bool:
    try:
        from tfscale.data.input import dali  # noqa: F401  (the import is the test)
    except ImportError:
        return False
    return True


def decode_only_input(cfg: ml_collections.ConfigDict) -> tf.data.Dataset:
    """The same shards, reader parallelism and options, but a full JPEG decode and nothing else."""
    files = shard_dir.list_shards(cfg.data.data_dir, cfg.data.train_split)
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


def model_garden_crop_window(image_shape) -> tf.Tensor:
    """Model Garden's `random_crop_image_v2` window [offset_y, offset_x, h, w], center-crop fallback.

    As official/vision/ops/preprocess_ops.py: `sample_distorted_bounding_box` on the whole image
    (area 0.08-1, aspect 3/4-4/3, 10 attempts); when it gives back the whole image, the central 87.5%
    of the shorter side (`center_crop_image_v2`). min_object_covered is tfscale's 0.1 (legacy Model
    Garden ResNet and tf_cnn_benchmarks), so both pipelines draw from one distribution
    (tests/test_input_parity.py) and the benchmark compares pipelines, not recipes. Written out
    here, not taken from tfscale.data.input.preprocess: it is the reference tfscale is tested against.
    """
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        image_shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4]),
        min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    height, width = image_shape[0], image_shape[1]
    crop = tf.cast(0.875 * tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    center = tf.stack([(height - crop + 1) // 2, (width - crop + 1) // 2, crop, crop])
    whole = tf.logical_and(tf.equal(size[0], height), tf.equal(size[1], width))
    return tf.where(whole, center, tf.stack([begin[0], begin[1], size[0], size[1]]))


def model_garden_augment(encoded, image_size: int) -> tf.Tensor:
    """One JPEG -> random-resized crop, bilinear resize, random flip: uint8 [S, S, 3], no branches."""
    window = model_garden_crop_window(tf.image.extract_jpeg_shape(encoded))
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3, dct_method=preprocess.DCT_METHOD)
    image = tf.image.resize(tf.cast(image, tf.float32), [image_size, image_size], method="bilinear")
    return tf.image.random_flip_left_right(tf.cast(image + 0.5, tf.uint8))


def model_garden_input(cfg: ml_collections.ConfigDict) -> tf.data.Dataset:
    """A plain Model-Garden-style training pipeline on the same shards: nothing but the work itself.

    files (shuffled, repeated) -> parallel interleave -> ONE parallel map: parse, crop window,
    decode_and_crop_jpeg, resize, flip -> batch -> prefetch. No record shuffle buffer, no label
    checks, no assignment, non-deterministic order. The per-image ops cost what tfscale's cost (the
    same JPEG IDCT, bilinear resize in float32, uint8 out), so the ratio measures pipeline structure.
    """
    data = cfg.data
    files = shard_dir.list_shards(data.data_dir, data.train_split)
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=cfg.seed).repeat()
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(data.interleave_cycle, len(files)),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)

    def parse_and_augment(serialized):
        features = tf.io.parse_single_example(serialized, {
            "image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
        label = tf.cast(features["image/class/label"] - data.label_offset, tf.int32)
        return model_garden_augment(features["image/encoded"], data.image_size), label

    ds = ds.map(parse_and_augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    options = tf.data.Options()
    options.deterministic = False
    return ds.batch(data.global_batch_size, drop_remainder=True).with_options(options).prefetch(tf.data.AUTOTUNE)


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


def compare_input_pipelines(cfg: ml_collections.ConfigDict) -> dict:
    """Median images/sec of tfscale's pipeline, the decode-only ceiling and (with image_dir) Keras'."""
    bench = cfg.benchmark
    buffered, unshuffled = copy.deepcopy(cfg), copy.deepcopy(cfg)
    buffered.data.shuffle = unshuffled.data.shuffle = "buffer"
    unshuffled.data.shuffle_buffer = 1
    makers = {"tfscale": lambda: tfscale_input(cfg), "tfscale_buffer_shuffle": lambda: tfscale_input(buffered),
              "tfscale_no_shuffle": lambda: tfscale_input(unshuffled),
              "model_garden": lambda: model_garden_input(cfg), "decode_only": lambda: decode_only_input(cfg)}
    with_dali = dali_installed()
    if with_dali:
        makers["tfscale_dali"] = lambda: tfscale_input(cfg, loader="dali")
    if bench.image_dir:
        makers["keras_baseline"] = lambda: keras_baseline_input(cfg, bench.image_dir)

    def timed(make):
        return lambda: dataset_images_per_sec(make(), warmup_batches=bench.num_warmup_batches,
                                              timed_batches=bench.num_batches)

    rates = interleaved_rounds({name: timed(make) for name, make in makers.items()}, bench.rounds)
    result = summarize_rates(rates)
    # tfscale against each other candidate, paired within rounds: `tfscale = X x` in the report
    result["paired_ratios"] = {name: paired_ratio(rates, "tfscale", name) for name in rates if name != "tfscale"}
    result["tfscale_vs_model_garden"] = result["paired_ratios"]["model_garden"]["median"]
    result["tfscale_no_shuffle_vs_model_garden"] = paired_ratio(rates, "tfscale_no_shuffle", "model_garden")["median"]
    if with_dali:
        from tfscale.data.input import dali

        result["tfscale_dali_vs_tfdata"] = paired_ratio(rates, "tfscale_dali", "tfscale")["median"]
        result["dali_decode"] = dali.decode_device(cfg.data.dali_decode, len(tf.config.get_visible_devices("GPU")))
    result["shuffle_quality"] = shuffle_quality(cfg.data)
    result.update(global_batch_size=cfg.data.global_batch_size, image_size=cfg.data.image_size,
                  shuffle_buffer=cfg.data.shuffle_buffer,
                  num_batches=bench.num_batches, num_warmup_batches=bench.num_warmup_batches)
    return result


def shuffle_quality(data_cfg: ml_collections.ConfigDict) -> dict:
    """How much of the shards' order is left after each shuffle, over the first pass's worth (n) of one
    worker's records: the share of them that are distinct (1.0: each record once, a permutation) and the
    rank correlation of a record's place in the stream with its place in its shard (0: no trace left)."""
    def key(record: bytes) -> bytes:
        return hashlib.blake2b(record, digest_size=8).digest()

    place_in_shard = {}
    for path in shard_dir.list_shards(data_cfg.data_dir, data_cfg.train_split):
        records = [key(r) for r in tf.data.TFRecordDataset(path).as_numpy_iterator()]
        place_in_shard.update({k: i / len(records) for i, k in enumerate(records)})
    n = len(place_in_shard)
    quality = {}
    for shuffle in ("index", "buffer"):
        cfg = copy.deepcopy(data_cfg)
        cfg.shuffle = shuffle
        stream = [key(r) for r in pipeline.train_records(cfg, cfg.data_dir, tf.distribute.InputContext(), seed=0)
                  .take(n).as_numpy_iterator()]
        rho = stats.spearmanr(np.arange(n), [place_in_shard[k] for k in stream]).statistic
        quality[shuffle] = {"distinct_share": round(len(set(stream)) / n, 4), "rank_correlation": round(float(rho), 4)}
    return quality


def print_input_report(result: dict) -> None:
    print(f"input pipeline, images/sec (batch {result['global_batch_size']}, {result['image_size']}px, "
          f"median of {len(result['rounds']['tfscale'])} rounds; ratios: median and range of the rounds' own):")
    rows = (
        ("tfscale", "tfscale train pipeline (a permutation per pass)"),
        ("tfscale_buffer_shuffle", f"tfscale, shuffle buffer of {result['shuffle_buffer']} records"),
        ("tfscale_no_shuffle", "tfscale train pipeline without record shuffle"),
        ("tfscale_dali", f"tfscale train pipeline, DALI ({result.get('dali_decode')} decoding)"),
        ("model_garden", "Model-Garden-style (same per-image ops, no extras)"),
        ("decode_only", "decode-only ceiling (full decode_jpeg)"),
        ("keras_baseline", "keras image_dataset_from_directory + RandomCrop/Flip"),
    )
    for key, label in rows:
        if f"{key}_images_per_sec" in result:
            theirs = result[f"{key}_images_per_sec"]
            ratio = "" if key == "tfscale" else f"   tfscale = {ratio_text(result['paired_ratios'][key])}"
            print(f"  {label:52s} {theirs:9.1f}{ratio}")
    if "tfscale_dali_vs_tfdata" not in result:
        print("  DALI: not installed (make dali)")
    print(f"  vs Model-Garden-style: tfscale {result['tfscale_vs_model_garden']:.3f}x, without record shuffle "
          f"{result['tfscale_no_shuffle_vs_model_garden']:.3f}x (medians of ratios within rounds)")
    for shuffle, label in (("index", "a permutation per pass"), ("buffer", f"{result['shuffle_buffer']}-record buffer")):
        figures = result["shuffle_quality"][shuffle]
        print(f"  shuffle, {label}: {figures['distinct_share']:.1%} of a pass's worth of records distinct, rank "
              f"correlation with the place in the shard {figures['rank_correlation']:+.3f}")
