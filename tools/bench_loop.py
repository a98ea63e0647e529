#!/usr/bin/env python3
"""Steps per loop: 1 vs 10 training steps per host sync, measured side by side in one run.

    python tools/bench_loop.py [--model=cifar_resnet8] [--batch=32] [--steps=200] [--rounds=3]

A small model at a small batch is where the host's per-step work (dispatch, reading the loss back,
callbacks) weighs most, as on a fast GPU. Both candidates run tfscale's own `engine.make_train_loop`
on the same model, optimizer and synthetic data, in turn for `--rounds` rounds (so background load
hits both alike); the median images/sec of each and their ratio are printed.
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import tensorflow as tf  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale.config import validation
from tfscale.data.input import pipeline  # noqa: E402
from tfscale.perf import baselines  # noqa: E402
from tfscale.training import engine

_MODEL = flags.DEFINE_string("model", "cifar_resnet8", "Model to train (a key of tfscale.model.models.MODELS).")
_BATCH = flags.DEFINE_integer("batch", 32, "Global batch size.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed steps per candidate and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds, each running every candidate back to back; ratios are paired within rounds.")
_LOOPS = flags.DEFINE_list("steps_per_loop", ["1", "10"], "Loop lengths to compare; the ratio is last / first.")
_OUTPUT = flags.DEFINE_string("output", None, "Optional JSON file for the figures.")


def _config():
    cfg = tfs_config.base_config()
    cfg.model.name = _MODEL.value
    cfg.data.dataset = "synthetic"
    cfg.data.image_size, cfg.data.num_classes = 32, 10
    cfg.data.global_batch_size = _BATCH.value
    cfg.data.num_train_examples = _BATCH.value * _STEPS.value
    validation.validate(cfg)
    return cfg


def loop_rate(train_loop, iterator, steps_per_loop: int, num_steps: int, batch_size: int) -> float:
    """images/sec of `num_steps` steps run `steps_per_loop` at a time, the loss read back after each loop."""
    no_stop, loop_length = tf.constant(0.0), tf.constant(steps_per_loop)
    train_loop(iterator, no_stop, loop_length)[0].numpy()  # warm-up (tracing happens once, shared by all)
    start = time.perf_counter()
    for _ in range(num_steps // steps_per_loop):
        train_loop(iterator, no_stop, loop_length)[0].numpy()
    return num_steps // steps_per_loop * steps_per_loop * batch_size / (time.perf_counter() - start)


def main(argv):
    del argv
    run = engine.setup(_config())
    cfg, cluster = run.cfg, run.cluster
    model, optimizer = engine.build_model_and_optimizer(cfg, cluster)
    with cluster.strategy.scope():
        step = tf.Variable(0, dtype=tf.int64)
    train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=step)
    iterator = iter(cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
    loops = [int(n) for n in _LOOPS.value]
    candidates = {f"steps_per_loop_{n}": (lambda n=n: loop_rate(train_loop, iterator, n, _STEPS.value, _BATCH.value))
                  for n in loops}
    rates = baselines.interleaved_rounds(candidates, _ROUNDS.value)
    result = baselines.summarize_rates(rates)
    paired = baselines.paired_ratio(rates, f"steps_per_loop_{loops[-1]}", f"steps_per_loop_{loops[0]}")
    result["ratio"], result["ratio_range"] = paired["median"], [paired["min"], paired["max"]]
    print(f"training steps per host sync ({cfg.model.name}, batch {cfg.data.global_batch_size}, synthetic data, "
          f"median of {_ROUNDS.value} rounds):")
    for n in loops:
        print(f"  steps_per_loop={n:<4d} {result[f'steps_per_loop_{n}_images_per_sec']:9.1f} images/sec")
    print(f"  steps_per_loop={loops[-1]} = {baselines.ratio_text(paired)} steps_per_loop={loops[0]}")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump({**result, "host": os.uname().nodename, "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
