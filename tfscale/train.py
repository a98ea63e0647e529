"""Training entry point and the distributed training loop tfscale owns.

    python -m tfscale.train --config=configs/smoke.py --workdir=runs/smoke [--config.x.y=v ...]

Why a custom loop: Keras 3 `model.fit` fails under MultiWorkerMirroredStrategy (keras-team/keras
#20585), so tfscale does what Model Garden/Orbit, tf_cnn_benchmarks and NVIDIA's examples do: a
`tf.function` step run by the strategy, with standard Keras callbacks driven through
`keras.callbacks.CallbackList`. Rerunning with the same workdir resumes from the latest checkpoint.
"""

from __future__ import annotations

from tfscale import cli, errors, logs, workdir_layout

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import callbacks as tfs_callbacks
from tfscale import checkpoints, ema, engine, init_from, io, local_sgd, local_sgd_steps, schedules
from tfscale import config as tfs_config
from tfscale import loops as tfs_loops
from tfscale import workdir as workdirs
from tfscale.data.input import assignment, faults, pipeline


def train_and_evaluate(cfg: ml_collections.ConfigDict, workdir: str, extra_callbacks=()) -> dict:
    """Trains `cfg` in `workdir` (resuming from its latest checkpoint) and returns the summary.

    `extra_callbacks`: more Keras callbacks, driven after tfscale's own (LR, logging, profiling).
    Setting `model.stop_training` from one ends the run at the end of the current loop of steps
    (`train.steps_per_loop`), checkpointed.
    """
    locks = []
    try:
        cluster = engine.join(cfg)
        locks = _claim_workdir(cluster, workdir, cfg)  # before staging: a refused run copies nothing
        run = engine.with_data(cfg, cluster)
        stop_requested, restore_sigterm = _watch_sigterm()
        try:
            with engine.precision_policy(cfg.precision):
                return _train(run, workdir, extra_callbacks, stop_requested)
        finally:
            restore_sigterm()
    finally:
        for lock in locks:  # also when the data check after the claim fails
            lock.release()


def _claim_workdir(cluster, workdir: str, cfg: ml_collections.ConfigDict) -> list[workdirs.Lock]:
    """The chief locks `workdir`, checks a resumed run's config and writes config.json; every worker
    learns its verdict, so a refusal stops the whole job at once (the others would otherwise wait for
    the chief in their first collective). Returns the chief's lock ([] on the others)."""
    refusal, locks = None, []
    if cluster.is_chief:
        try:
            locks.append(workdirs.claim(workdir, cfg.to_dict(), cfg.resume))
        except (errors.WorkdirBusy, errors.ConfigError, errors.WriteError) as err:
            refusal = err
    chief_code = cluster.gather_per_worker([float(errors.exit_code(refusal)) if refusal else 0.0])[0][0]
    if refusal is not None:
        raise refusal
    if chief_code:
        raise errors.ChiefRefused(int(chief_code))
    return locks


def _train(run: engine.Run, workdir: str, extra_callbacks, stop_requested: threading.Event) -> dict:
    """Builds the model, restores or initialises it, trains to the end, evaluates, writes the summary."""
    cfg, steps = run.cfg, run.steps
    # The chief reports it (the log line, summary.json); the others need not spend the seconds.
    assigned = pipeline.assignment_report(cfg.data, run.data_dir, run.cluster.size) if run.cluster.is_chief else None
    if assigned:
        logging.info(assignment.describe(assigned))
    model, optimizer = engine.build_model_and_optimizer(cfg, run.cluster)
    plan = local_sgd.make_plan(cfg.distribute, num_replicas=run.cluster.num_replicas,
                               steps_per_epoch=steps.steps_per_epoch, train_steps=steps.train_steps)
    sync_counts = local_sgd_steps.sync_counters(run.cluster, plan)
    ckpts = checkpoints.Checkpoints(workdir, run.cluster, model=model, optimizer=optimizer,
                                    max_to_keep=cfg.checkpoint.max_to_keep, extra=sync_counts)
    # config.model.init_from applies to a fresh run only: resuming wins over it.
    start_step = ckpts.restore_or_init(lambda: init_from.apply(cfg, model, engine.build_model))
    logged = workdirs.trim_metrics(workdir, start_step) if run.cluster.is_chief else []
    summary_path = workdir_layout.summary(workdir)
    if start_step >= steps.train_steps and os.path.exists(summary_path):
        logging.info("training already complete at step %d; summary in %s", start_step, summary_path)
        with open(summary_path) as f:
            return json.load(f)

    skipped_images, count_skipped = (faults.skipped_images_counter(run.cluster) if cfg.data.skip_corrupt_images
                                     else (None, None))
    logger = tfs_callbacks.MetricsLogger(
        workdir, is_chief=run.cluster.is_chief, global_batch_size=cfg.data.global_batch_size,
        steps_per_epoch=steps.steps_per_epoch, train_steps=steps.train_steps, log_every_steps=cfg.train.log_every_steps,
        extra_fields=count_skipped,
    )
    learning_rate = tfs_loops.LearningRate(_schedule(run), optimizer, run.cluster)
    learning_rate.resume(start_step)
    callback_list = _callback_list(run, workdir, model, logger, extra_callbacks)
    run_eval = _evaluator(run, model, callback_list)
    loops = tfs_loops.Loops(run, plan, model, optimizer, ckpts.step, learning_rate, sync_counts)
    start_time = time.time()
    if _eval_missing_at(run, plan, start_step, logged):  # stopped at an eval step before its eval ran
        run_eval(start_step)
    end_of_run = _EndOfRun()
    eval_results = _train_loop(run, model, loops, ckpts, callback_list, run_eval, stop_requested, start_step,
                               skipped_images, end_of_run)
    final_step = int(ckpts.step.numpy())
    if not plan.in_agreement(final_step):  # stopped by a callback between world syncs
        loops.world_sync()
    with end_of_run.part("final_checkpoint"):
        ckpts.save(final_step)
    callback_list.on_train_end({"global_step": final_step})
    ckpts.close()
    if not eval_results:  # stopped early by a callback, or resumed at the end without a summary
        eval_results = run_eval(final_step)
    summary = _summary(run, final_step, time.time() - start_time, logger, eval_results)
    summary.update(end_of_run.figures())
    summary.update(loops.report(final_step))
    if count_skipped is not None:
        summary.update(count_skipped())
    if assigned:
        summary["assignment"] = assigned
    if run.cluster.is_chief:
        io.write_json(summary_path, summary, sort_keys=True)
        logging.info("done: %s; workdir %s", json.dumps(summary), os.path.abspath(workdir))
    return summary


def _eval_missing_at(run: engine.Run, plan: local_sgd.SyncPlan, start_step: int, logged: list[dict]) -> bool:
    """True on every worker when the run resumes at an eval step whose eval row the chief lacks
    (SIGTERM or a kill between that step's checkpoint and its eval): eval is a collective, so the
    chief's view decides for all."""
    due = 0 < start_step < run.steps.train_steps and plan.due(start_step, run.steps.eval_every_steps)
    missing = due and not any("eval_top1" in row and row["step"] == start_step for row in logged)
    return bool(run.cluster.gather_per_worker([float(missing)])[0][0]) if due else False


def _schedule(run: engine.Run) -> schedules.Schedule:
    """config.schedule over this run's steps: the LR the training loop sets on device (tfs_loops.LearningRate)."""
    cfg, steps = run.cfg, run.steps
    return schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps.steps_per_epoch,
                                   total_steps=steps.train_steps, num_replicas=run.cluster.num_replicas)


def _callback_list(run: engine.Run, workdir: str, model, logger, extra_callbacks) -> keras.callbacks.CallbackList:
    """The logger (it logs the LR the loop set), the profiler, then the user's."""
    cfg, steps = run.cfg, run.steps
    profiler = tfs_callbacks.profiler_callbacks(cfg.profile_steps, workdir_layout.tensorboard(workdir),
                                                is_chief=run.cluster.is_chief)
    return keras.callbacks.CallbackList(
        [logger, *profiler, *extra_callbacks], model=model,
        epochs=math.ceil(steps.train_steps / steps.steps_per_epoch), steps=steps.steps_per_epoch,
    )


def _evaluator(run: engine.Run, model, callback_list):
    """`run_eval(step) -> eval metrics`: the whole eval set, logged and handed to the callbacks.

    With `optim.ema_decay` > 0 the eval set runs twice, on the raw weights and then on their EMA
    (swapped in, BatchNorm statistics as they are, raw weights back afterwards); the EMA's metrics are
    `eval_top1_ema`, `eval_top5_ema`, `eval_loss_ema` in the same row.
    """
    eval_step = engine.make_eval_step(run.cfg, run.cluster, model)
    eval_ds = engine.eval_dataset(run)
    steps = run.steps
    use_ema = ema.is_on(model.optimizer)  # engine.build_model_and_optimizer sets model.optimizer

    def evaluate() -> dict:
        with _naming_bad_data(run, run.cfg.data.eval_split):
            return engine.evaluate(eval_step, eval_ds, steps.eval_steps)

    def run_eval(step: int) -> dict:
        callback_list.on_test_begin()
        results = evaluate()
        if use_ema:
            with ema.swapped_in(model, model.optimizer):
                averaged = evaluate()
            results.update({f"{key}_ema": averaged[key] for key in ("eval_top1", "eval_top5", "eval_loss")})
            logging.info("eval at step %d: top-1 %.4f  top-5 %.4f  loss %.4f  EMA weights: top-1 %.4f  top-5 %.4f  "
                         "loss %.4f  (%d examples)", step, results["eval_top1"], results["eval_top5"],
                         results["eval_loss"], results["eval_top1_ema"], results["eval_top5_ema"],
                         results["eval_loss_ema"], results["eval_examples"])
        else:
            logging.info("eval at step %d: top-1 %.4f  top-5 %.4f  loss %.4f  (%d examples)", step,
                         results["eval_top1"], results["eval_top5"], results["eval_loss"], results["eval_examples"])
        callback_list.on_test_end({"step": step, "epoch": round(step / steps.steps_per_epoch, 4), **results})
        return results

    return run_eval


def _train_loop(run, model, loops: tfs_loops.Loops, ckpts, callback_list, run_eval, stop_requested, start_step: int,
                skipped_images: tf.Variable | None, end_of_run: _EndOfRun) -> dict:
    """Loops of steps from `start_step` to the end (or a callback's stop); returns the last eval's metrics.

    Each loop runs on device up to the next step where the host must act (`_loop_end`), then the
    callbacks see every step of it with Keras' conventions (epoch, batch within it) plus
    `global_step`, the run's one step counter, which `ckpts` holds and saves: the same step numbers
    and losses as with one step per loop. A loop's first `on_train_batch_begin` comes before it runs
    (the profiler starts there); the others, like every `on_train_batch_end`, after. The training
    input ends as soon as the last step has run, before the final eval (`end_of_run` times both).
    """
    steps, plan = run.steps, loops.plan
    iterator = iter(engine.train_dataset(run, start_step, skipped_images))
    eval_results = {}
    callback_list.on_train_begin({"global_step": start_step})
    step = start_step
    while step < steps.train_steps:
        epoch, first_batch = divmod(step, steps.steps_per_epoch)
        if first_batch == 0:
            callback_list.on_epoch_begin(epoch)
        callback_list.on_train_batch_begin(first_batch, {"global_step": step})
        loop_end = _loop_end(run, step, plan)
        loops.learning_rate.follow_callbacks(step)  # a callback may have set the LR since the last loop
        losses, workers_stopping = _run_loop(run, loops.loop_for(step), iterator, stop_requested, loop_end - step)
        if loop_end == steps.train_steps:
            end_of_run.last_step_done()
            with end_of_run.part("input_release"):
                # Its threads would otherwise go on decoding batches nobody takes, beside the final eval,
                # until the process exits; ending it waits only for the reads and decodes in flight.
                del iterator
        loops.learning_rate.loop_ended()
        loops.after(loop_end)  # before the callbacks, so that they see the weights the workers agree on
        _replay_batches(callback_list, step, first_batch, losses)
        step = loop_end
        # Under local SGD workers agree on the weights only right after a world sync: checkpoints,
        # evals and preemption stops wait for one.
        if workers_stopping and plan.in_agreement(step):  # every worker learns it at the same step: they save together
            ckpts.save(step)
            ckpts.close()
            raise errors.Preempted(step)
        if plan.due(step, steps.checkpoint_every_steps):
            with end_of_run.part("final_checkpoint" if step == steps.train_steps else None):
                ckpts.save(step)
        evaluated = plan.due(step, steps.eval_every_steps) or step == steps.train_steps
        if evaluated:
            with end_of_run.part("final_eval" if step == steps.train_steps else None):
                eval_results = run_eval(step)
        if step % steps.steps_per_epoch == 0:  # with this step's eval as Keras names it (ReduceLROnPlateau's val_loss)
            val_logs = _keras_val_logs(eval_results) if evaluated else {}
            callback_list.on_epoch_end(epoch, {"loss": losses[-1], **val_logs})
        if model.stop_training:  # set by standard callbacks such as EarlyStopping/TerminateOnNaN
            break
    return eval_results


class _EndOfRun:
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


def _keras_val_logs(eval_results: dict) -> dict:
    """An eval's metrics as Keras' fit names them at an epoch's end: val_loss, val_top1, val_top5."""
    return {f"val_{key.removeprefix('eval_')}": eval_results[key] for key in ("eval_loss", "eval_top1", "eval_top5")}


def _loop_end(run: engine.Run, step: int, plan: local_sgd.SyncPlan) -> int:
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


def _run_loop(run: engine.Run, train_loop, iterator, stop_requested: threading.Event, num_steps: int):
    """`num_steps` global steps on device; ([mean loss per step], replicas stopping) on the host."""
    with _naming_bad_data(run, run.cfg.data.train_split):
        losses, workers_stopping = train_loop(iterator, tf.constant(float(stop_requested.is_set())),
                                              tf.constant(num_steps))
    return losses.numpy().tolist(), float(workers_stopping.numpy())


@contextlib.contextmanager
def _naming_bad_data(run: engine.Run, split: str):
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


def _replay_batches(callback_list, first_step: int, first_batch: int, losses: list[float]) -> None:
    """Batch callbacks for each step of a finished loop; stops at the first non-finite loss, naming it."""
    for offset, loss in enumerate(losses):
        if offset:
            callback_list.on_train_batch_begin(first_batch + offset, {"global_step": first_step + offset})
        _check_finite(loss, first_step + offset + 1)
        callback_list.on_train_batch_end(first_batch + offset, {"loss": loss, "global_step": first_step + offset + 1})


def _check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"loss is {loss} at step {step}; stopping (the last checkpoint holds the weights before it)"
        )


def _summary(run: engine.Run, final_step: int, wall_time_s: float, logger, eval_results: dict) -> dict:
    summary = {
        "steps": final_step,
        "wall_time_s": round(wall_time_s, 2),
        "images_per_sec": logger.steady_images_per_sec(),
        "eval_top1": eval_results["eval_top1"],
        "eval_top5": eval_results["eval_top5"],
        "eval_loss": eval_results["eval_loss"],
        "num_workers": run.cluster.size,
        "num_replicas": run.cluster.num_replicas,
        "global_batch_size": run.cfg.data.global_batch_size,
    }
    # The EMA's figures only when optim.ema_decay > 0: a run without EMA keeps exactly the keys above.
    summary.update({key: value for key, value in eval_results.items() if key.endswith("_ema")})
    return summary


def _watch_sigterm() -> tuple[threading.Event, callable]:
    """An Event set by SIGTERM (Slurm's warning before a kill), and a function restoring the old handler.

    Repeated signals are harmless (Slurm may signal a task twice); the loop acts at the next step.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return requested, lambda: None  # signal handlers can only be set from the main thread

    def on_sigterm(signum, frame):
        if not requested.is_set():
            logging.warning("SIGTERM: saving a checkpoint after this step, then exiting with %d", errors.EXIT_PREEMPTED)
        requested.set()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    return requested, lambda: signal.signal(signal.SIGTERM, previous)


def main(cfg: ml_collections.ConfigDict, workdir: str, extra_callbacks=()) -> None:
    """The CLI's work: train, and turn a preemption or a fault the user must act on into its exit code
    (config errors: `run_cli` prints them as one FATAL line; data faults too, here)."""
    try:
        with faults.fatal_on_data_faults():
            train_and_evaluate(cfg, workdir, extra_callbacks)
    except errors.Preempted as preempted:
        logging.warning("%s; exit code %d", preempted, errors.EXIT_PREEMPTED)
        sys.exit(errors.EXIT_PREEMPTED)
    except (errors.WorkdirBusy, errors.WriteError, errors.CheckpointError, errors.ChiefRefused) as err:
        logging.error("%s; exit code %d", err, errors.exit_code(err))  # the user's to act on: one line, no traceback
        sys.exit(errors.exit_code(err))


def run():
    """Console-script entry point (`tfscale-train`)."""
    cli.run_cli(main, workdir_help="Directory for checkpoints, metrics and summaries.")


if __name__ == "__main__":
    run()
