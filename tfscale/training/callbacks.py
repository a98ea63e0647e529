"""Keras callbacks that tfscale's training loop drives through `keras.callbacks.CallbackList`.

The loop calls them with Keras' own conventions (`batch` is the index within the epoch) and puts the
run's one step counter in the logs as `global_step`: the steps completed so far (at train begin and
batch begin: before this batch; at batch end: including it). Steps run several to a loop
(`train.steps_per_loop`): a loop's first batch begin comes before it runs, the other batch calls
after it, with each step's own loss. `CallbackList` turns every log value into a float, hence the
`int(...)` where it is read. Decisions that only the chief may take (writing files, printing) are
made here from `is_chief`, not scattered through the loop.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import keras
import tensorflow as tf
from absl import logging

from tfscale import config as tfs_config
from tfscale import io
from tfscale.config import derived
from tfscale.logs import format_duration
from tfscale.model import optim, schedules
from tfscale.workdir import curves, layout


TENSORBOARD_RUNS = ("train", "validation")  # under WORKDIR/tensorboard
EVAL_PREFIX = "eval_"  # metrics.jsonl's eval fields; TensorBoard's validation run drops it: eval_top1 -> top1


def write_scalars(writer, row: dict) -> None:
    """A metrics row as TensorBoard scalars at its step (`time` aside), `eval_` prefixes dropped: the tags that
    training's and validation's runs share."""
    with writer.as_default(step=int(row["step"])):
        for key, value in row.items():
            if key not in ("step", "time"):
                tf.summary.scalar(key.removeprefix(EVAL_PREFIX), value)
    writer.flush()


class MetricsLogger(keras.callbacks.Callback):
    """Chief-only progress: absl log lines, `metrics.jsonl` rows and TensorBoard scalars (runs `train/` and
    `validation/` under WORKDIR/tensorboard, sharing tag names: loss and top1, and the eval's top5). A training
    row's `loss` and `top1` are those of the logged step's global batch (augmented, BatchNorm in training mode:
    noisier than the eval's, and below it on a model that generalises), as a resumed run logs them too.

    images/sec is measured over training steps only: the clock restarts after each evaluation, so an
    eval pass never dilutes the throughput figure. The step line ends with `eta H:MM:SS`: the steps
    still to train at the steady rate measured so far (evaluations and a restart's tracing excluded).
    Every `metrics.jsonl` row (train and eval) carries `time`, the wall clock when it was written
    (Unix seconds, UTC, millisecond resolution): rows of a resumed run, or of different runs, line up
    on one time axis. TensorBoard records its own wall time, so `time` is not a scalar there.
    """

    def __init__(self, workdir: str, *, is_chief: bool, global_batch_size: int, steps_per_epoch: int,
                 train_steps: int, log_every_steps: int, extra_fields: Callable[[], dict] | None = None):
        """`extra_fields()`: more fields of each training row, called on every worker at each logged
        step (it may be a collective)."""
        super().__init__()
        self.extra_fields = extra_fields
        self.is_chief = is_chief
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = steps_per_epoch
        self.train_steps = train_steps
        self.log_every_steps = log_every_steps
        self.workdir = workdir
        self.metrics_path = layout.metrics(workdir)
        # TensorBoard runs as Keras' TensorBoard callback names them: train/ and validation/, with the same tags
        # (loss, top1; top5 for the eval), so the two curves of a tag overlay in one chart.
        self.writer_dirs = {run: os.path.join(layout.tensorboard(workdir), run) for run in TENSORBOARD_RUNS}
        self.writers = {}
        if is_chief:
            for run, directory in self.writer_dirs.items():
                try:
                    self.writers[run] = tf.summary.create_file_writer(directory)
                except tf.errors.OpError as err:  # e.g. a full disk: TensorFlow writes the first event at once
                    raise io.write_error(directory, err) from err
        self.intervals = []  # (steps, seconds) of each logged training interval
        self._mark_time = None
        self._mark_step = None

    def _restart_clock(self, global_step: int) -> None:
        self._mark_time, self._mark_step = time.perf_counter(), global_step

    def on_train_begin(self, logs=None):
        self._restart_clock(int(logs["global_step"]))

    def on_test_end(self, logs=None):
        # `logs` is the eval row (step, epoch, eval_*): written as is, curves.png redrawn, then training time
        # restarts.
        self._write_row(logs)
        if self.is_chief:
            self._draw_curves()
        self._restart_clock(int(logs["step"]))

    def _draw_curves(self) -> None:
        try:
            curves.draw(self.workdir)
        except (OSError, ValueError, RuntimeError) as err:  # a picture is not worth a run: say it, go on
            logging.warning("could not draw %s: %s", layout.curves(self.workdir), err)

    def on_train_batch_end(self, batch, logs=None):
        step = int(logs["global_step"])
        if step % self.log_every_steps and step != self.train_steps:
            return
        elapsed_s = time.perf_counter() - self._mark_time
        steps = step - self._mark_step
        self.intervals.append((steps, elapsed_s))
        row = {
            "step": step,
            "epoch": round(step / self.steps_per_epoch, 4),
            "loss": float(logs["loss"]),
            **({"top1": float(logs["top1"])} if "top1" in logs else {}),
            "lr": float(self.model.optimizer.learning_rate.numpy()),
            "images_per_sec": round(steps * self.global_batch_size / elapsed_s, 2),
            **(self.extra_fields() if self.extra_fields else {}),
        }
        grad_norm = optim.grad_norm(self.model.optimizer)  # with optim.clip_global_norm: this step's, before clipping
        if grad_norm is not None:
            row["grad_norm"] = grad_norm
        if self.is_chief:
            logging.info(
                "step %d/%d  epoch %.2f  loss %.4f  top-1 %.3f  lr %.5g  images/sec %.1f  eta %s",
                step, self.train_steps, row["epoch"], row["loss"], row.get("top1", float("nan")), row["lr"],
                row["images_per_sec"],
                format_duration((self.train_steps - step) * self._seconds_per_step()),
            )
        self._write_row(row)
        self._restart_clock(step)

    def _write_row(self, row) -> None:
        if not self.is_chief or not row:
            return
        # CallbackList hands over every number as a float; counts go back to ints.
        row = {k: int(v) if k in ("step", "eval_examples") else v for k, v in row.items()}
        row["time"] = round(time.time(), 3)
        io.append_line(self.metrics_path, json.dumps(row))  # whole or not at all, even on a full disk
        run = "validation" if any(key.startswith(EVAL_PREFIX) for key in row) else "train"
        try:
            write_scalars(self.writers[run], row)
        except tf.errors.OpError as err:
            raise io.write_error(self.writer_dirs[run], err) from err

    def _seconds_per_step(self) -> float:
        """Mean training-step time without the first interval after a (re)start, which pays for tracing."""
        steady = self.intervals[1:] or self.intervals
        steps = sum(s for s, _ in steady)
        return sum(t for _, t in steady) / steps if steps else 0.0

    def steady_images_per_sec(self) -> float | None:
        """Throughput without the first interval after a (re)start, which pays for tracing."""
        seconds_per_step = self._seconds_per_step()
        return round(self.global_batch_size / seconds_per_step, 2) if seconds_per_step > 0 else None


def profiler_callbacks(profile_steps: str, logdir: str, *, is_chief: bool) -> list[keras.callbacks.Callback]:
    """A Profiler for `config.profile_steps` ("START,END"), or nothing when it is empty."""
    window = tfs_config.profile_window(profile_steps)
    if window is None:
        return []
    return [Profiler(logdir, first_step=window[0], last_step=window[1], is_chief=is_chief)]


class Profiler(keras.callbacks.Callback):
    """Captures a TensorFlow profiler trace of global steps `first_step..last_step` (1-based, inclusive).

    The trace lands in `logdir/plugins/profile/<run>/`, where TensorBoard's Profile tab finds it
    (`pip install tensorboard-plugin-profile`). Only the chief profiles: one worker's trace shows the
    step, the input waits and the all-reduce, and only the chief writes files.
    """

    def __init__(self, logdir: str, *, first_step: int, last_step: int, is_chief: bool):
        super().__init__()
        self.logdir = logdir
        self.first_step, self.last_step = first_step, last_step
        self.enabled = is_chief
        self.active = False

    def on_train_batch_begin(self, batch, logs=None):
        next_step = int(logs["global_step"]) + 1
        if self.enabled and not self.active and self.first_step <= next_step <= self.last_step:
            tf.profiler.experimental.start(self.logdir)
            self.active = True
            logging.info("profiler: tracing steps %d..%d into %s", next_step, self.last_step, self.logdir)

    def on_train_batch_end(self, batch, logs=None):
        if self.active and int(logs["global_step"]) >= self.last_step:
            self._stop()

    def on_train_end(self, logs=None):
        if self.active:  # training ended inside the window: keep what was traced
            self._stop()

    def _stop(self) -> None:
        tf.profiler.experimental.stop()
        self.active = False
        logging.info("profiler: trace written under %s (TensorBoard, Profile tab)", self.logdir)


# --- Keras 3 replacements for horovod.tensorflow.keras callbacks ------------------------------------
# Horovod's own Keras callbacks fail on Keras 3 (they need `.ref()` on variables). These keep their
# meaning for users porting a Horovod `model.fit` script; pair them with
# `optim.averaging_optimizer` in place of `hvd.DistributedOptimizer`. `cluster` is
# `distribute.setup(...)`'s result with backend `horovod`.


class BroadcastGlobalVariables(keras.callbacks.Callback):
    """`hvd.callbacks.BroadcastGlobalVariablesCallback(0)`: rank 0's weights and optimizer state on
    every rank before the first step, so all ranks start identical whatever they initialised."""

    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if not optimizer.built:  # slots must exist to be broadcast; Keras would build them at step 1
            optimizer.build(self.model.trainable_variables)
        self.cluster.broadcast_from_chief([*self.model.variables, *optimizer.variables])


class MetricAverage(keras.callbacks.Callback):
    """`hvd.callbacks.MetricAverageCallback()`: epoch-end metrics averaged over ranks.

    Each rank only sees its shard; list this callback first so that later ones (checkpointing,
    early stopping, CSV logging) act on the job's figures, identically on every rank.
    """

    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))  # same order on every rank
        rows = self.cluster.gather_per_worker([float(logs[k]) for k in keys])
        for key, column in zip(keys, zip(*rows)):
            logs[key] = sum(column) / len(column)


class LearningRateWarmup(keras.callbacks.Callback):
    """`hvd.callbacks.LearningRateWarmupCallback`: LR from `initial_lr / size` to `initial_lr` over
    `warmup_epochs`, set every batch; afterwards the LR is left alone for other schedules.

    Horovod's `momentum_correction` is not reproduced (Keras 3 optimizers keep no such hook).
    """

    def __init__(self, cluster, *, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: int):
        super().__init__()
        self.warmup_steps = derived.epochs_to_steps(warmup_epochs, steps_per_epoch)
        self.schedule = lambda step: schedules.horovod_warmup_lr(
            step, target_lr=initial_lr, num_replicas=cluster.size, warmup_steps=self.warmup_steps
        )

    def on_train_batch_begin(self, batch, logs=None):
        # model.fit's own count: this callback serves Horovod scripts that keep using fit.
        step = int(self.model.optimizer.iterations.numpy())
        if step < self.warmup_steps:  # the last warmup batch reaches initial_lr, as in Horovod
            self.model.optimizer.learning_rate = self.schedule(step)
