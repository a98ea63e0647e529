"""The one owner of a training run's schedule: what the host does between two compiled loops.

Orbit's `Controller` is the model. The run's set-up (tfscale.training.train) hands the controller the
built pieces: the compiled loops and local SGD's syncs (`loops.Loops`, with the LR table on device),
the checkpoints, the Keras callbacks and the evaluator. The controller then decides, step range by step
range, and nowhere else:
  * where each loop ends (`next_loop_end`): the next step at which the host must act;
  * the LR: a callback's change between loops scales the schedule from there on, a resumed run reads
    the scale back (`loops.LearningRate`);
  * local SGD's world and household syncs after a loop (the `SyncPlan` says when);
  * checkpoints and evals when due, and under local SGD only where workers agree on the weights;
  * preemption: SIGTERM is carried to every worker on the loop's stop flag, and all save at one step;
  * replaying each finished loop's steps to the Keras callbacks with Keras' conventions (epoch, batch,
    `global_step`), so callbacks see the same steps and losses as with one step per loop.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from typing import Callable

import keras
import tensorflow as tf
from absl import logging

from tfscale import config as tfs_config
from tfscale import errors
from tfscale.data.input import pipeline
from tfscale.model import ema
from tfscale.training import checkpoints, engine, local_sgd
from tfscale.training import loops as tfs_loops


class Controller:
    """Trains a run from `start_step` to its end (or a callback's stop, or a preemption), then finishes it.

    `train()` runs the loops; `finish()` brings the workers into agreement, saves the final checkpoint,
    ends the callbacks and returns the final step with the last eval's metrics.
    """

    def __init__(self, run: engine.Run, *, model, loops: tfs_loops.Loops, ckpts: checkpoints.Checkpoints,
                 callbacks: keras.callbacks.CallbackList, start_step: int, stop_requested: threading.Event,
                 evaluating: bool = True):
        """`evaluating` False (`--mode=train`): no eval at all; a side-car evaluator (`--mode=continuous_eval`)
        evaluates the checkpoints instead."""
        self.run, self.model, self.loops, self.ckpts, self.callbacks = run, model, loops, ckpts, callbacks
        self.evaluating = evaluating
        self.plan = loops.plan
        self.start_step = start_step
        self.evaluate = make_evaluator(run, model, callbacks)
        self.end_of_run = EndOfRun()
        self.eval_results: dict = {}
        self._stop_requested = stop_requested
        loops.learning_rate.resume(start_step)

    def eval_if_missing(self, logged: list[dict]) -> None:
        """Runs the eval a run stopped before (SIGTERM or a kill between an eval step's checkpoint and its
        eval) when the chief's metrics lack it: eval is a collective, so the chief's view decides for all."""
        step, steps = self.start_step, self.run.steps
        due = self.evaluating and 0 < step < steps.train_steps and self.plan.due(step, steps.eval_every_steps)
        if not due:
            return
        missing = not any("eval_top1" in row and row["step"] == step for row in logged)
        if self.run.cluster.gather_per_worker([float(missing)])[0][0]:
            self.evaluate(step)

    def train(self, skipped_images: tf.Variable | None) -> None:
        """Loops of steps from the start step to the end (or a callback's stop).

        Each loop runs on device up to `next_loop_end`, then the callbacks see every step of it with Keras'
        conventions plus `global_step`, the run's one step counter, which the checkpoints hold and save.
        A loop's first `on_train_batch_begin` comes before it runs (the profiler starts there); the
        others, like every `on_train_batch_end`, after. The training input ends as soon as the last step
        has run, before the final eval (`end_of_run` times both).
        """
        run, steps, plan, callbacks = self.run, self.run.steps, self.plan, self.callbacks
        iterator = iter(engine.train_dataset(run, self.start_step, skipped_images))
        callbacks.on_train_begin({"global_step": self.start_step})
        step = self.start_step
        while step < steps.train_steps:
            epoch, first_batch = divmod(step, steps.steps_per_epoch)
            if first_batch == 0:
                callbacks.on_epoch_begin(epoch)
            callbacks.on_train_batch_begin(first_batch, {"global_step": step})
            # The first loop runs one step: it pays for tracing, compiling and the input's first batch, which
            # take minutes on a GPU before the first logged step; a line then says how long they took.
            loop_end = step + 1 if step == self.start_step else next_loop_end(run, step, plan)
            self.loops.learning_rate.follow_callbacks(step)  # a callback may have set the LR since the last loop
            started = time.perf_counter()
            losses, top1s, workers_stopping = self._run_loop(self.loops.loop_for(step), iterator, loop_end - step)
            if step == self.start_step:
                logging.info("step %d ran in %.1f s: the training loop traced and compiled (XLA %s), the input's "
                             "first batch read; training goes on", loop_end, time.perf_counter() - started,
                             "on" if run.cfg.jit_compile is True else "off")
            if loop_end == steps.train_steps:
                self.end_of_run.last_step_done()
                with self.end_of_run.part("input_release"):
                    # Its threads would otherwise go on decoding batches nobody takes, beside the final eval,
                    # until the process exits; ending it waits only for the reads and decodes in flight.
                    del iterator
            self.loops.learning_rate.loop_ended()
            self.loops.after(loop_end)  # before the callbacks, so that they see the weights the workers agree on
            _replay_batches(callbacks, step, first_batch, losses, top1s)
            step = loop_end
            # Under local SGD workers agree on the weights only right after a world sync: checkpoints,
            # evals and preemption stops wait for one.
            if workers_stopping and plan.in_agreement(step):  # every worker learns it at the same step: they save together
                self.ckpts.save(step, wait=True)
                self.ckpts.close()
                raise errors.Preempted(step)
            if plan.due(step, steps.checkpoint_every_steps):
                with self.end_of_run.part("final_checkpoint" if step == steps.train_steps else None):
                    self.ckpts.save(step)
            evaluated = self.evaluating and (plan.due(step, steps.eval_every_steps) or step == steps.train_steps)
            if evaluated:
                with self.end_of_run.part("final_eval" if step == steps.train_steps else None):
                    self.eval_results = self.evaluate(step)
            if step % steps.steps_per_epoch == 0:  # with this step's eval as Keras names it (ReduceLROnPlateau's val_loss)
                val_logs = _keras_val_logs(self.eval_results) if evaluated else {}
                self.callbacks.on_epoch_end(epoch, {"loss": losses[-1], **val_logs})
            if self.model.stop_training:  # set by standard callbacks such as EarlyStopping/TerminateOnNaN
                break

    def finish(self) -> tuple[int, dict]:
        """(final step, the last eval's metrics): the workers brought into agreement, the final checkpoint
        saved, the callbacks ended; an eval when none ran at the end (a callback's early stop, or a run
        resumed at its end without a summary)."""
        final_step = int(self.ckpts.step.numpy())
        if not self.plan.in_agreement(final_step):  # stopped by a callback between world syncs
            self.loops.world_sync()
        with self.end_of_run.part("final_checkpoint"):
            self.ckpts.save(final_step, wait=True)
        self.callbacks.on_train_end({"global_step": final_step})
        self.ckpts.close()
        if not self.eval_results and self.evaluating:
            self.eval_results = self.evaluate(final_step)
        return final_step, self.eval_results

    def _run_loop(self, train_loop, iterator, num_steps: int) -> tuple[list[float], list[float], float]:
        """`num_steps` global steps on device; ([mean loss per step], [top-1 per step], replicas stopping) on the
        host."""
        with naming_bad_data(self.run, self.run.cfg.data.train_split):
            losses, top1s, workers_stopping = train_loop(
                iterator, tf.constant(float(self._stop_requested.is_set())), tf.constant(num_steps))
        return losses.numpy().tolist(), top1s.numpy().tolist(), float(workers_stopping.numpy())


def next_loop_end(run: engine.Run, step: int, plan: local_sgd.SyncPlan) -> int:
    """Where the loop starting at `step` ends: after `train.steps_per_loop` steps, or earlier at the
    next step where the host acts (a log row, eval, checkpoint, epoch end, profiler window edge, a
    local-SGD sync or the switch to local SGD)."""
    cfg, steps = run.cfg, run.steps
    periods = (cfg.train.steps_per_loop, cfg.train.log_every_steps, steps.eval_every_steps,
               steps.checkpoint_every_steps, steps.steps_per_epoch)
    boundaries = [(step // period + 1) * period for period in periods]
    window = tfs_config.profile_window(cfg.profile_steps)  # 1-based steps: the trace starts before `first`
    if window is not None:
        boundaries += [edge for edge in (window[0] - 1, window[1]) if edge > step]
    return min(*boundaries, *plan.next_boundaries(step), steps.train_steps)


def make_evaluator(run: engine.Run, model, callbacks: keras.callbacks.CallbackList):
    """`evaluate(step) -> eval metrics`: the whole eval set, logged and handed to the callbacks.

    With `optim.ema_decay` > 0 the eval set runs twice, on the raw weights and then on their EMA
    (swapped in, BatchNorm statistics as they are, raw weights back afterwards); the EMA's metrics are
    `eval_top1_ema`, `eval_top5_ema`, `eval_loss_ema` in the same row.
    """
    eval_step = engine.make_eval_step(run.cfg, run.cluster, model)
    eval_batches = None  # one iterator for every eval, made at the first
    steps = run.steps
    use_ema = ema.is_on(model.optimizer)  # engine.build_model_and_optimizer sets model.optimizer

    def eval_once(step: int, weights: str = "") -> dict:
        nonlocal eval_batches
        with naming_bad_data(run, run.cfg.data.eval_split):
            if eval_batches is None:
                eval_batches = iter(engine.eval_dataset(run))
            return engine.evaluate(eval_step, eval_batches, steps.eval_steps, run.cfg.train.progress_every_s,
                                   say=lambda text: logging.info("eval at step %d%s: %s", step, weights, text))

    def evaluate(step: int) -> dict:
        callbacks.on_test_begin()
        results = raw_and_ema(lambda weights: eval_once(step, weights), model, model.optimizer)
        if use_ema:
            logging.info("eval at step %d: top-1 %.4f  top-5 %.4f  loss %.4f  EMA weights: top-1 %.4f  top-5 %.4f  "
                         "loss %.4f  (%d examples)", step, results["eval_top1"], results["eval_top5"],
                         results["eval_loss"], results["eval_top1_ema"], results["eval_top5_ema"],
                         results["eval_loss_ema"], results["eval_examples"])
        else:
            logging.info("eval at step %d: top-1 %.4f  top-5 %.4f  loss %.4f  (%d examples)", step,
                         results["eval_top1"], results["eval_top5"], results["eval_loss"], results["eval_examples"])
        callbacks.on_test_end({"step": step, "epoch": round(step / steps.steps_per_epoch, 4), **results})
        return results

    return evaluate


def raw_and_ema(eval_once: Callable[[str], dict], model, optimizer) -> dict:
    """`eval_once("")` on the raw weights and, when the optimizer keeps an EMA, `eval_once(" (EMA weights)")` on
    the averages swapped in: their top-1, top-5 and loss join the row as `eval_*_ema`."""
    results = eval_once("")
    if ema.is_on(optimizer):
        with ema.swapped_in(model, optimizer):
            averaged = eval_once(" (EMA weights)")
        results.update({f"{key}_ema": averaged[key] for key in ("eval_top1", "eval_top5", "eval_loss")})
    return results


class EndOfRun:
    """Seconds from the last step's end to the summary, and what they went to: summary.json's
    `end_of_run_s` (`total`, `input_release`, `final_eval`, `final_checkpoint`), logged as well. Empty for
    a run that ended before its last step (a callback's stop)."""

    def __init__(self):
        self._last_step_at, self._parts = None, {}

    def last_step_done(self) -> None:
        self._last_step_at = time.perf_counter()

    @contextlib.contextmanager
    def part(self, name: str | None):
        """Times the block as `name` once the last step is done (None, or before then: not timed)."""
        started = time.perf_counter()
        yield
        if name and self._last_step_at is not None:
            self._parts[name] = self._parts.get(name, 0.0) + time.perf_counter() - started

    def figures(self) -> dict:
        if self._last_step_at is None:
            return {}
        seconds = {"total": time.perf_counter() - self._last_step_at, **self._parts}
        logging.info("from the last step to the summary: %s", ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))
        return {"end_of_run_s": {name: round(value, 3) for name, value in seconds.items()}}


@contextlib.contextmanager
def naming_bad_data(run: engine.Run, split: str):
    """A read error of `split` (a truncated shard, an image that does not decode) becomes a
    `faults.CorruptDataError` naming the shard and record; other errors pass unchanged."""
    try:
        yield
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError, tf.errors.InternalError) as err:  # Internal: DALI's
        explained = pipeline.explain_read_error(err, run.cfg.data, run.data_dir, split, rank=run.cluster.rank,
                                                num_workers=run.cluster.size)
        if explained is None:
            raise
        raise explained from err


@contextlib.contextmanager
def stop_on_sigterm():
    """Yields an Event that SIGTERM (Slurm's warning before a kill) sets; the old handler is back afterwards.

    Repeated signals are harmless (Slurm may signal a task twice); the loop acts at the next step.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested  # signal handlers can only be set from the main thread
        return

    def on_sigterm(signum, frame):
        if not requested.is_set():
            logging.warning("SIGTERM: saving a checkpoint after this step, then exiting with %d", errors.EXIT_PREEMPTED)
        requested.set()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def _keras_val_logs(eval_results: dict) -> dict:
    """An eval's metrics as Keras' fit names them at an epoch's end: val_loss, val_top1, val_top5."""
    return {f"val_{key.removeprefix('eval_')}": eval_results[key] for key in ("eval_loss", "eval_top1", "eval_top5")}


def _replay_batches(callbacks: keras.callbacks.CallbackList, first_step: int, first_batch: int,
                    losses: list[float], top1s: list[float]) -> None:
    """Batch callbacks for each step of a finished loop (its loss and top-1); stops at the first non-finite
    loss, naming it."""
    for offset, (loss, top1) in enumerate(zip(losses, top1s)):
        if offset:
            callbacks.on_train_batch_begin(first_batch + offset, {"global_step": first_step + offset})
        _check_finite(loss, first_step + offset + 1)
        callbacks.on_train_batch_end(first_batch + offset, {"loss": loss, "top1": top1,
                                                            "global_step": first_step + offset + 1})


def _check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"loss is {loss} at step {step}; stopping (the last checkpoint holds the weights before it)"
        )
