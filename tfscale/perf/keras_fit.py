"""tfscale's training loop vs Keras `model.fit` (benchmark.mode=train, compare_keras_fit=True, one process).

tfscale's loop (`engine.make_train_loop`, what train.py runs, one step per call) against `fit` on the same
model, optimizer, input pipeline and batch; both timed step by step (interval between step ends, loss read
every step), median step time per round, rounds interleaved as every comparison in
tfscale.perf.baselines. A round times each candidate for a short block (`_BLOCK_STEPS` steps after
`benchmark.num_warmup_batches` untimed ones), `benchmark.rounds` x num_batches / block rounds in all: another
job taking one of a small host's cores for tens of seconds (XLA on 2 CPU cores then runs at ~0.55x) slows
every candidate alike, not the few long rounds of one. `fit` runs compiled with Keras' defaults, as its
users run it, and also with the config's `jit_compile` when the two differ.
"""

from __future__ import annotations

import functools
import statistics
import time

import keras
import ml_collections
import tensorflow as tf

from tfscale.model import optim
from tfscale.perf.baselines import interleaved_rounds, paired_ratio, ratio_text, summarize_rates
from tfscale.training import engine


class _StepTimer(keras.callbacks.Callback):
    """Host time between consecutive batch ends of `fit`, each after reading the step's loss (as tfscale's loop does)."""

    def __init__(self):
        super().__init__()
        self.step_ends = []

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # waits for the step, like the `.numpy()` of tfscale's loop
        self.step_ends.append(time.perf_counter())


def median_step_rate(step_ends: list[float], num_timed: int, global_batch_size: int) -> float:
    """images/sec from the median of the last `num_timed` intervals between step ends.

    A median, not a mean: on a shared host a burst of load hits a few steps, not the figure.
    """
    intervals = [b - a for a, b in zip(step_ends[:-1], step_ends[1:])][-num_timed:]
    return global_batch_size / statistics.median(intervals)


def _keras_fit_model(cfg: ml_collections.ConfigDict, **compile_args) -> keras.Model:
    """The same model and optimizer, compiled as a Keras user would (L2 through the loss, as tfscale) with
    Keras' defaults unless `compile_args` say otherwise."""
    keras.utils.set_random_seed(cfg.seed)
    model = engine.build_model(cfg)
    weight_decay = optim.loss_weight_decay(cfg.optim)

    def loss(labels, logits):
        # Keras hands class ids over as floats; soft MixUp/CutMix targets come as [batch, classes].
        labels = labels if labels.shape.rank == 2 else tf.cast(labels, tf.int32)
        per_example = engine.cross_entropy(labels, logits, cfg.data.num_classes, cfg.optim.label_smoothing)
        return tf.reduce_mean(per_example) + (optim.l2_loss(model.trainable_variables, weight_decay) if weight_decay else 0.0)

    model.compile(optimizer=engine.build_optimizer(cfg, model, reduced_gradients=False), loss=loss, **compile_args)
    return model


# Timed steps per candidate and round: ~0.5 s of a small model on CPU, shorter than a change in the host's load.
_BLOCK_STEPS = 20


def _fit_rate(model: keras.Model, ds: tf.data.Dataset, num_batches: int, global_batch_size: int,
              warmup: int) -> float:
    """images/sec of `fit` over `num_batches` steps after `warmup` untimed ones."""
    timer = _StepTimer()
    model.fit(ds, epochs=1, steps_per_epoch=warmup + num_batches, verbose=0, callbacks=[timer])
    return median_step_rate(timer.step_ends, num_batches, global_batch_size)


def _loop_rate(train_loop, cluster, input_fn, num_batches: int, global_batch_size: int, warmup: int) -> float:
    """images/sec of tfscale's training loop run one step per call, timed exactly as `_fit_rate` times fit.

    One step per call, as fit's default steps_per_execution=1: the comparison is the step itself.
    """
    iterator = iter(cluster.distribute_dataset(input_fn))
    no_stop, one_step = tf.constant(0.0), tf.constant(1)
    step_ends = []
    for _ in range(warmup + num_batches):
        losses = train_loop(iterator, no_stop, one_step)[0]
        losses.numpy()  # read the loss every step, as fit's timer does
        step_ends.append(time.perf_counter())
    return median_step_rate(step_ends, num_batches, global_batch_size)


def compare_keras_fit(cfg: ml_collections.ConfigDict, cluster, model, optimizer, input_fn) -> dict:
    """Median images/sec of tfscale's training step and of Keras `model.fit`, same model, data and batch.

    `fit` runs as its users run it, `compile`'s defaults (jit_compile="auto": XLA on TensorFlow when the
    model's layers allow it), and, when that differs from the config's `jit_compile`, also compiled with the
    config's setting ("matched"): the first ratio is what a user sees, the second what the step itself costs.
    `model`, `optimizer`: the benchmark's own, trained here by tfscale's step; `fit` needs a compiled
    model of its own, built from the same config and seed.
    """
    if cluster.size != 1 or cluster.num_replicas != 1:
        raise ValueError("config.benchmark.compare_keras_fit=True compares one process on one device: "
                         "run it without a launcher and with config.distribute.backend=one_device")
    batch, steps = cfg.data.global_batch_size, cfg.benchmark.num_batches
    step = tf.Variable(0, dtype=tf.int64, trainable=False)
    train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=step)
    fit_models = {"keras_fit": _keras_fit_model(cfg)}
    if fit_models["keras_fit"].jit_compile != cfg.jit_compile:
        fit_models["keras_fit_matched"] = _keras_fit_model(cfg, jit_compile=cfg.jit_compile)
    warmup, block = max(1, cfg.benchmark.num_warmup_batches), min(steps, _BLOCK_STEPS)
    candidates = {"tfscale_loop": lambda: _loop_rate(train_loop, cluster, input_fn, block, batch, warmup)}
    for name, fit_model in fit_models.items():
        candidates[name] = functools.partial(_fit_rate, fit_model, input_fn(tf.distribute.InputContext()), block,
                                             batch, warmup)
    for candidate in candidates.values():
        candidate()  # untimed: tracing, XLA's compile, the input pipeline's autotuning
    rates = interleaved_rounds(candidates, cfg.benchmark.rounds * max(1, round(steps / block)))
    result = summarize_rates(rates)
    result["keras_jit_compile"] = {name: bool(fit_model.jit_compile) for name, fit_model in fit_models.items()}
    result["tfscale_jit_compile"] = bool(cfg.jit_compile)
    result["paired_ratio"] = paired_ratio(rates, "tfscale_loop", "keras_fit")
    result["tfscale_vs_keras_fit"] = result["paired_ratio"]["median"]
    if "keras_fit_matched" in fit_models:
        result["paired_ratio_matched"] = paired_ratio(rates, "tfscale_loop", "keras_fit_matched")
        result["tfscale_vs_keras_fit_matched"] = result["paired_ratio_matched"]["median"]
    return result


def print_fit_report(result: dict, cfg: ml_collections.ConfigDict) -> None:
    rounds = len(result["rounds"]["tfscale_loop"])
    print(f"training step vs Keras model.fit ({cfg.model.name}, batch {cfg.data.global_batch_size}, "
          f"{cfg.data.dataset} data, median of {rounds} rounds):")
    xla = {True: "XLA", False: "no XLA"}
    print(f"  tfscale loop step     {result['tfscale_loop_images_per_sec']:9.1f} images/sec "
          f"({xla[result['tfscale_jit_compile']]}, config.jit_compile)")
    print(f"  keras model.fit       {result['keras_fit_images_per_sec']:9.1f} images/sec "
          f"({xla[result['keras_jit_compile']['keras_fit']]}, compile's defaults)")
    if "keras_fit_matched" in result["keras_jit_compile"]:
        print(f"  keras model.fit       {result['keras_fit_matched_images_per_sec']:9.1f} images/sec "
              f"({xla[result['keras_jit_compile']['keras_fit_matched']]}, matched to tfscale)")
    print(f"  tfscale = {ratio_text(result['paired_ratio'])} model.fit as Keras users run it")
    if "paired_ratio_matched" in result:
        print(f"  tfscale = {ratio_text(result['paired_ratio_matched'])} model.fit matched")

