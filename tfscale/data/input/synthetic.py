"""Synthetic image data: tf_cnn_benchmarks-style random batches and a small learnable task.

Both are functions of the global example position, not of iterator state: the examples of global
step s are positions s*G .. s*G+G-1 (G = global batch), split over replicas in rank order. That makes
three things exact by construction, which the tests rely on:
  * resuming at step s reproduces the data a run that never stopped would have seen;
  * N workers x batch b see the same global batch as 1 worker x batch N*b;
  * evaluation visits every example exactly once, with the last batch padded and masked.
"""

from __future__ import annotations

import ml_collections
import tensorflow as tf

# Offsets that give each stream its own stateless-random seeds.
_PROTOTYPE_STREAM = 1_000_003
_EVAL_STREAM = 7_919
_LABEL_STREAM = 104_729


def _local_replicas(input_context: tf.distribute.InputContext) -> int:
    return input_context.num_replicas_in_sync // input_context.num_input_pipelines


def _positions_fn(input_context: tf.distribute.InputContext, global_batch: int):
    """batch counter -> global example positions of that per-replica batch of this input pipeline.

    The pipeline's k-th batch feeds its (k mod R)-th local replica at step k // R; replicas take
    consecutive slices of the global batch in rank order.
    """
    local_replicas = _local_replicas(input_context)
    first_slot = input_context.input_pipeline_id * local_replicas
    per_replica_batch = input_context.get_per_replica_batch_size(global_batch)

    def positions(batch_counter):
        step = batch_counter // local_replicas
        slot = first_slot + batch_counter % local_replicas
        start = step * global_batch + slot * per_replica_batch
        return tf.range(start, start + per_replica_batch, dtype=tf.int64)

    return positions


def _seed(stream: int, index):
    return tf.stack([tf.constant(stream, tf.int64), tf.cast(index, tf.int64)])


def _learnable_image(example_seed, label, *, task_seed: int, image_size: int, noise: float):
    """The class's smooth pattern (fixed by `task_seed`) plus per-example noise, as uint8 pixels."""
    coarse = tf.random.stateless_uniform([4, 4, 3], seed=_seed(task_seed + _PROTOTYPE_STREAM, label))
    pattern = tf.image.resize(coarse[tf.newaxis], [image_size, image_size])[0]
    jitter = noise * tf.random.stateless_normal([image_size, image_size, 3], seed=example_seed)
    return tf.cast(tf.clip_by_value(pattern + jitter, 0.0, 1.0) * 255.0, tf.uint8)


def _example_fn(data_cfg: ml_collections.ConfigDict, task_seed: int, split_stream: int):
    """index -> (image, label); train and eval share the class patterns but draw different examples."""

    def example(index):
        label = tf.random.stateless_uniform(
            [], seed=_seed(task_seed + split_stream + _LABEL_STREAM, index), maxval=data_cfg.num_classes,
            dtype=tf.int32,
        )
        image = _learnable_image(
            _seed(task_seed + split_stream, index), label, task_seed=task_seed,
            image_size=data_cfg.image_size, noise=data_cfg.synthetic_noise,
        )
        return image, label

    return example


def _random_batch(data_cfg: ml_collections.ConfigDict, per_replica_batch: int, seed: int):
    shape = [per_replica_batch, data_cfg.image_size, data_cfg.image_size, 3]
    images = tf.random.stateless_uniform(shape, seed=[seed, 0], maxval=256, dtype=tf.int32)
    labels = tf.random.stateless_uniform([per_replica_batch], seed=[seed, 1], maxval=data_cfg.num_classes, dtype=tf.int32)
    return tf.cast(images, tf.uint8), labels


def train_dataset(data_cfg, input_context, *, seed: int, start_step: int) -> tf.data.Dataset:
    """Per-replica training batches (uint8 images, int32 labels), starting at global step `start_step`."""
    per_replica_batch = input_context.get_per_replica_batch_size(data_cfg.global_batch_size)
    if data_cfg.dataset == "synthetic":
        # tf_cnn_benchmarks' synthetic mode: one batch built once and replayed, so the host costs nothing.
        return tf.data.Dataset.from_tensors(_random_batch(data_cfg, per_replica_batch, seed)).repeat()
    positions = _positions_fn(input_context, data_cfg.global_batch_size)
    ds = tf.data.Dataset.range(start_step * _local_replicas(input_context), 2**62).map(positions).unbatch()
    ds = ds.map(lambda p: p % data_cfg.num_train_examples)
    ds = ds.map(_example_fn(data_cfg, seed, split_stream=0), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(per_replica_batch, drop_remainder=True)


def eval_dataset(data_cfg, input_context, *, seed: int, global_batch_size: int, num_steps: int) -> tf.data.Dataset:
    """Per-replica eval batches (images, labels, mask) covering each eval example exactly once."""
    per_replica_batch = input_context.get_per_replica_batch_size(global_batch_size)
    num_examples = data_cfg.num_eval_examples
    example = _example_fn(data_cfg, seed, split_stream=_EVAL_STREAM)
    positions = _positions_fn(input_context, global_batch_size)

    def padded_example(position):
        # Padding positions repeat the last example; their mask of 0 keeps them out of every metric.
        image, label = example(tf.minimum(position, num_examples - 1))
        return image, label, tf.cast(position < num_examples, tf.float32)

    ds = tf.data.Dataset.range(num_steps * _local_replicas(input_context)).map(positions).unbatch()
    ds = ds.map(padded_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(per_replica_batch, drop_remainder=True)
