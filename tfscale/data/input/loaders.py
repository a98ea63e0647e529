"""The run's input, from `data.loader`: tf.data (pipeline.py) or NVIDIA DALI (dali.py), with one contract.

`train_input_fn` / `eval_input_fn` return per-worker dataset functions of a `tf.distribute.InputContext`
(see pipeline.py): training batches (uint8 images, labels), endless; eval batches (images, labels, mask).
Chosen here, above both loaders, so that neither imports the other; DALI is imported only when asked
for (it is installed only with `make dali`).
"""

from __future__ import annotations

import ml_collections
import tensorflow as tf

from tfscale.data.input import pipeline


def _traced_as_written(input_fn: pipeline.InputFn) -> pipeline.InputFn:
    """`input_fn` building its datasets with AutoGraph off. The map functions branch with tf.cond already
    (preprocess.py), and converting them cost ~0.5 s of CPU a process reading TFRecords; tf.data converts a map
    function unless the context that builds the dataset says not to (TensorFlow 2.21,
    tensorflow/python/data/ops/structured_function.py: `autograph.tf_convert(self._func, ag_ctx)`), and
    `do_not_convert` is that context. The steps are traced as written too (engine.STEP_FUNCTIONS_WITHOUT_AUTOGRAPH)."""
    return tf.autograph.experimental.do_not_convert(input_fn)


def train_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, start_step: int, data_dir: str | None = None,
                   skipped_images: tf.Variable | None = None) -> pipeline.InputFn:
    """Training batches from global step `start_step` on (`pipeline.train_input_fn` says how each loader resumes)."""
    if data_cfg.loader == "dali":
        from tfscale.data.input import dali

        return _traced_as_written(dali.train_input_fn(data_cfg, seed=seed, start_step=start_step,
                                                      data_dir=data_dir or data_cfg.data_dir))
    return _traced_as_written(pipeline.train_input_fn(data_cfg, seed=seed, start_step=start_step, data_dir=data_dir,
                                                      skipped_images=skipped_images))


def eval_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, global_batch_size: int, num_steps: int,
                  data_dir: str | None = None) -> pipeline.InputFn:
    """`num_steps` eval batches (images, labels, mask); mask 0 marks padding of the last batch."""
    if data_cfg.loader == "dali":
        from tfscale.data.input import dali

        return _traced_as_written(dali.eval_input_fn(data_cfg, global_batch_size=global_batch_size,
                                                     num_steps=num_steps, data_dir=data_dir or data_cfg.data_dir))
    return _traced_as_written(pipeline.eval_input_fn(data_cfg, seed=seed, global_batch_size=global_batch_size,
                                                     num_steps=num_steps, data_dir=data_dir))
