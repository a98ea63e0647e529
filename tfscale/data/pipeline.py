"""Input pipelines, handed to the strategy as per-replica dataset functions.

`train_input_fn` / `eval_input_fn` return functions of a `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`: each worker builds only its own share of the data and
batches per replica, so tf.distribute never re-shards (its auto-sharding is switched off).
"""

from __future__ import annotations

from typing import Callable

import ml_collections
import tensorflow as tf

from tfscale.data import synthetic

InputFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


def _with_options(ds: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    # tfscale shards by itself (per input pipeline); a second, automatic sharding would drop data.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def _unsupported(data_cfg: ml_collections.ConfigDict):
    return NotImplementedError(f"config.data.dataset={data_cfg.dataset!r} has no input pipeline yet")


def train_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, start_step: int) -> InputFn:
    """Training batches (uint8 images, int32 labels) from global step `start_step` on."""

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if data_cfg.dataset in ("synthetic", "synthetic_learnable"):
            ds = synthetic.train_dataset(data_cfg, input_context, seed=seed, start_step=start_step)
        else:
            raise _unsupported(data_cfg)
        return _with_options(ds)

    return input_fn


def eval_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, global_batch_size: int, num_steps: int) -> InputFn:
    """`num_steps` eval batches (images, labels, mask); mask 0 marks padding of the last batch."""

    def input_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if data_cfg.dataset in ("synthetic", "synthetic_learnable"):
            ds = synthetic.eval_dataset(
                data_cfg, input_context, seed=seed, global_batch_size=global_batch_size, num_steps=num_steps
            )
        else:
            raise _unsupported(data_cfg)
        return _with_options(ds)

    return input_fn
