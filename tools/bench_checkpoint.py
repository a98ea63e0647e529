#!/usr/bin/env python3
"""What a checkpoint costs the training steps: synchronous vs asynchronous saving, side by side in one run.

    python tools/bench_checkpoint.py [--model=resnet50] [--batch=8] [--steps=4] [--rounds=4]

Each candidate saves tfscale's checkpoint of the model and its optimizer (`training.checkpoints`, as
a run saves it) and then runs `--steps` training steps; the figures are the seconds the save call
blocked the host and the seconds the save added to save + steps over the same steps alone (an
asynchronous write shares the machine with the steps after it). Candidates alternate within each
round; the first round (tracing, the first host copy) is left out of the medians.
"""

import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import tensorflow as tf  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale.config import validation  # noqa: E402
from tfscale.data.input import pipeline  # noqa: E402
from tfscale.model import stats  # noqa: E402
from tfscale.training import checkpoints, engine  # noqa: E402

_MODEL = flags.DEFINE_string("model", "resnet50", "Model to train (a key of tfscale.model.models.MODELS).")
_BATCH = flags.DEFINE_integer("batch", 8, "Global batch size.")
_STEPS = flags.DEFINE_integer("steps", 4, "Training steps after each save (one loop).")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds, each saving once per candidate; the first is a warm-up.")
_OUTPUT = flags.DEFINE_string("output", None, "Optional JSON file for the figures.")


def _config():
    cfg = tfs_config.base_config()
    cfg.model.name = _MODEL.value
    cfg.data.dataset = "synthetic"
    cfg.data.image_size, cfg.data.num_classes = 224, 1000
    cfg.data.global_batch_size = _BATCH.value
    cfg.data.num_train_examples = _BATCH.value * _STEPS.value
    validation.validate(cfg)
    return cfg


def main(argv):
    del argv
    run = engine.setup(_config())
    cfg, cluster = run.cfg, run.cluster
    model, optimizer = engine.build_model_and_optimizer(cfg, cluster)
    train_loop, ckpts = None, {}
    for mode in ("sync", "async"):
        ckpts[mode] = checkpoints.Checkpoints(tempfile.mkdtemp(prefix=f"bench_ckpt_{mode}_"), cluster, model=model,
                                              optimizer=optimizer, max_to_keep=2, async_save=mode == "async")
    train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=ckpts["sync"].step)
    iterator = iter(cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
    no_stop, num_steps = tf.constant(0.0), tf.constant(_STEPS.value)

    def steps_s() -> float:
        start = time.perf_counter()
        train_loop(iterator, no_stop, num_steps)[0].numpy()
        return time.perf_counter() - start

    steps_s()  # tracing
    figures = {mode: {"blocked_s": [], "added_s": []} for mode in ckpts}
    for round_index in range(_ROUNDS.value):
        for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
            alone = steps_s()
            start = time.perf_counter()
            ckpts[mode].save(round_index + 1)
            blocked = time.perf_counter() - start
            with_save = blocked + steps_s()
            ckpts[mode].wait()
            if round_index:
                figures[mode]["blocked_s"].append(blocked)
                figures[mode]["added_s"].append(with_save - alone)
    for ckpt in ckpts.values():
        ckpt.close()

    result = {mode: {name: round(statistics.median(x), 3) for name, x in f.items()} for mode, f in figures.items()}
    state_mib = sum(v.numpy().nbytes for v in [*model.variables, *optimizer.variables]) / 2**20
    print(f"checkpoint of {cfg.model.name} + optimizer ({state_mib:.0f} MiB, {stats.describe(model)['params']:,} "
          f"parameters), then {_STEPS.value} steps of batch {_BATCH.value}; medians of {_ROUNDS.value - 1} rounds:")
    for mode, f in result.items():
        print(f"  {mode:5s}  save blocks {f['blocked_s']:7.3f} s   adds {f['added_s']:7.3f} s to save + steps")
    ratio = statistics.median(a / s for a, s in zip(figures["async"]["blocked_s"], figures["sync"]["blocked_s"]))
    print(f"  async blocks the host {ratio:.3f}x as long as sync (paired by round)")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as out:
            json.dump({**result, "state_mib": state_mib, "blocked_ratio": ratio, "host": os.uname().nodename}, out, indent=1)


if __name__ == "__main__":
    app.run(main)
