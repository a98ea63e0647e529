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


def train_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, start_step: int, data_dir: str | None = None,
                   skipped_images: tf.Variable | None = None) -> pipeline.InputFn:
    """Training batches from global step `start_step` on (`pipeline.train_input_fn` says how each loader resumes)."""
    if data_cfg.loader == "dali":
        from tfscale.data.input import dali

        return dali.train_input_fn(data_cfg, seed=seed, start_step=start_step, data_dir=data_dir or data_cfg.data_dir)
    return pipeline.train_input_fn(data_cfg, seed=seed, start_step=start_step, data_dir=data_dir,
                                   skipped_images=skipped_images)


def eval_input_fn(data_cfg: ml_collections.ConfigDict, *, seed: int, global_batch_size: int, num_steps: int,
                  data_dir: str | None = None) -> pipeline.InputFn:
    """`num_steps` eval batches (images, labels, mask); mask 0 marks padding of the last batch."""
    if data_cfg.loader == "dali":
        from tfscale.data.input import dali

        return dali.eval_input_fn(data_cfg, global_batch_size=global_batch_size, num_steps=num_steps,
                                  data_dir=data_dir or data_cfg.data_dir)
    return pipeline.eval_input_fn(data_cfg, seed=seed, global_batch_size=global_batch_size, num_steps=num_steps,
                                  data_dir=data_dir)
