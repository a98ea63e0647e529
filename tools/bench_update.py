#!/usr/bin/env python3
"""The optimizer's update compiled (optim.compiled_update) vs Keras' apply_gradients, side by side in one run.

    python tools/bench_update.py [--model=resnet50] [--precision=float32] [--image_size=224] [--batch=8]

Both candidates run tfscale's own `engine.make_train_loop` on the same model config, optimizer and
synthetic data, differing only in `optim.compiled_update`, in turn for `--rounds` rounds; the median
images/sec of each and their ratio paired by round are printed, with the ops each step runs outside
XLA (`perf.step_ops`).
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import tensorflow as tf  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale.config import validation  # noqa: E402
from tfscale.data.input import pipeline  # noqa: E402
from tfscale.perf import baselines, step_ops  # noqa: E402
from tfscale.training import engine  # noqa: E402

_MODEL = flags.DEFINE_string("model", "resnet50", "Model to train (a key of tfscale.model.models.MODELS).")
_PRECISION = flags.DEFINE_enum("precision", "float32", ["float32", "mixed_bfloat16", "mixed_float16"], "Precision policy.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Image side in pixels.")
_BATCH = flags.DEFINE_integer("batch", 8, "Global batch size.")
_JIT = flags.DEFINE_bool("jit_compile", True, "XLA-compile forward + backward (config.jit_compile).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per candidate and round (one loop).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds, each running both candidates back to back.")
_OUTPUT = flags.DEFINE_string("output", None, "Optional JSON file for the figures.")


def _config(compiled: bool):
    cfg = tfs_config.base_config()
    cfg.model.name, cfg.precision, cfg.jit_compile = _MODEL.value, _PRECISION.value, _JIT.value
    cfg.optim.compiled_update = compiled
    cfg.data.dataset = "synthetic"
    cfg.data.image_size, cfg.data.num_classes = _IMAGE_SIZE.value, 1000
    cfg.data.global_batch_size = _BATCH.value
    cfg.data.num_train_examples = _BATCH.value * _STEPS.value
    validation.validate(cfg)
    return cfg


def _candidate(compiled: bool):
    """(a function timing one loop in images/sec, the step's ops outside XLA)."""
    run = engine.setup(_config(compiled))
    cfg, cluster = run.cfg, run.cluster
    with engine.precision_policy(cfg.precision):
        model, optimizer = engine.build_model_and_optimizer(cfg, cluster)
        with cluster.strategy.scope():
            step = tf.Variable(0, dtype=tf.int64)
        train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=step)
    iterator = iter(cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
    no_stop, num_steps = tf.constant(0.0), tf.constant(_STEPS.value)
    train_loop(iterator, no_stop, num_steps)[0].numpy()  # tracing and XLA compiles
    ops = step_ops.ops_outside_xla(train_loop.get_concrete_function(iterator, no_stop, num_steps))

    def rate() -> float:
        start = time.perf_counter()
        train_loop(iterator, no_stop, num_steps)[0].numpy()
        return _STEPS.value * _BATCH.value / (time.perf_counter() - start)

    return rate, ops


def main(argv):
    del argv
    candidates, ops = {}, {}
    for name, compiled in (("keras_apply", False), ("compiled_update", True)):
        candidates[name], ops[name] = _candidate(compiled)
    rates = baselines.interleaved_rounds(candidates, _ROUNDS.value)
    result = baselines.summarize_rates(rates)
    paired = baselines.paired_ratio(rates, "compiled_update", "keras_apply")
    result["ratio"], result["ops_outside_xla"] = paired, {name: sum(c.values()) for name, c in ops.items()}
    print(f"{_MODEL.value} {_PRECISION.value}, {_IMAGE_SIZE.value}px, batch {_BATCH.value}, jit_compile={_JIT.value}, "
          f"median of {_ROUNDS.value} rounds:")
    for name in candidates:
        print(f"  {name:16s} {result[f'{name}_images_per_sec']:8.1f} images/sec, "
              f"{result['ops_outside_xla'][name]:5d} ops a step outside XLA")
    print(f"  compiled_update = {baselines.ratio_text(paired)} keras_apply")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump({**result, "host": os.uname().nodename, "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
