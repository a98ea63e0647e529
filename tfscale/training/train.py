"""The training command: a run's set-up, its workdir claim and its summary.

    python -m tfscale.train --config=configs/smoke.py --workdir=runs/smoke [--config.x.y=v ...]

Why a custom loop: Keras 3 `model.fit` fails under MultiWorkerMirroredStrategy (keras-team/keras
#20585), so tfscale does what Model Garden/Orbit, tf_cnn_benchmarks and NVIDIA's examples do: a
`tf.function` step run by the strategy, with standard Keras callbacks driven through
`keras.callbacks.CallbackList`. This module joins the cluster, claims the workdir, builds the model,
the checkpoints and the compiled loops, and hands them to tfscale.training.controller, which runs the
loop's schedule. Rerunning with the same workdir resumes from the latest checkpoint.
"""

from __future__ import annotations

from tfscale import cli, errors, logs
from tfscale.cluster import topology
from tfscale.workdir import layout

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported
topology.bind_at_start()  # a task of the templates' step: near its GPU, before TF sizes its pools from the mask
logs.import_tensorflow_without_banner()  # a program: TensorFlow without its oneDNN notice

import json
import math
import os
import sys
import threading
import time

import keras
import ml_collections
import tensorflow as tf
from absl import flags, logging

from tfscale import io
from tfscale.cluster import heartbeat
from tfscale.data.input import assignment, faults, pipeline
from tfscale.model import schedules
from tfscale.training import callbacks as tfs_callbacks
from tfscale.training import checkpoints, controller, engine, evaluator, init_from, local_sgd, local_sgd_steps
from tfscale.training import loops as tfs_loops
from tfscale.workdir import guards as workdirs


def train_and_evaluate(cfg: ml_collections.ConfigDict, workdir: str, extra_callbacks=(),
                       evaluating: bool = True) -> dict:
    """Trains `cfg` in `workdir` (resuming from its latest checkpoint) and returns the summary; `evaluating`
    False (`--mode=train`) leaves every eval to a side-car evaluator.

    `extra_callbacks`: more Keras callbacks, driven after tfscale's own (LR, logging, profiling).
    Setting `model.stop_training` from one ends the run at the end of the current loop of steps
    (`train.steps_per_loop`), checkpointed.
    """
    locks = []
    try:
        cluster = engine.join(cfg)
        heartbeat.describe_resume_with(lambda: checkpoints.resume_hint(workdir))  # said if a peer stops answering
        locks = _claim_workdir(cluster, workdir, cfg)  # before staging: a refused run copies nothing
        run = engine.with_data(cfg, cluster)
        with controller.stop_on_sigterm() as stop_requested, engine.precision_policy(cfg.precision):
            return _train(run, workdir, extra_callbacks, stop_requested, evaluating)
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


def _train(run: engine.Run, workdir: str, extra_callbacks, stop_requested: threading.Event,
           evaluating: bool = True) -> dict:
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
                                    max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save,
                                    extra=sync_counts)
    # config.model.init_from applies to a fresh run only: resuming wins over it.
    start_step = ckpts.restore_or_init(lambda: init_from.apply(cfg, model, engine.build_model))
    logged = workdirs.trim_metrics(workdir, start_step) if run.cluster.is_chief else []
    summary_path = layout.summary(workdir)
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
    callback_list = _callback_list(run, workdir, model, logger, extra_callbacks)
    loops = tfs_loops.Loops(run, plan, model, optimizer, ckpts.step, learning_rate, sync_counts)
    control = controller.Controller(run, model=model, loops=loops, ckpts=ckpts, callbacks=callback_list,
                                    start_step=start_step, stop_requested=stop_requested, evaluating=evaluating)
    start_time = time.time()
    control.eval_if_missing(logged)
    control.train(skipped_images)
    final_step, eval_results = control.finish()
    summary = _summary(run, final_step, time.time() - start_time, logger, eval_results)
    summary.update(control.end_of_run.figures())
    summary.update(loops.report(final_step))
    if count_skipped is not None:
        summary.update(count_skipped())
    if assigned:
        summary["assignment"] = assigned
    if run.cluster.is_chief:
        io.write_json(summary_path, summary, sort_keys=True)
        logging.info("done: %s; workdir %s", json.dumps(summary), os.path.abspath(workdir))
    return summary


def _schedule(run: engine.Run) -> schedules.Schedule:
    """config.schedule over this run's steps: the LR the training loop sets on device (tfs_loops.LearningRate)."""
    cfg, steps = run.cfg, run.steps
    return schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps.steps_per_epoch,
                                   total_steps=steps.train_steps, num_replicas=run.cluster.num_replicas)


def _callback_list(run: engine.Run, workdir: str, model, logger, extra_callbacks) -> keras.callbacks.CallbackList:
    """The logger (it logs the LR the loop set), the profiler, then the user's."""
    cfg, steps = run.cfg, run.steps
    profiler = tfs_callbacks.profiler_callbacks(cfg.profile_steps, layout.tensorboard(workdir),
                                                is_chief=run.cluster.is_chief)
    return keras.callbacks.CallbackList(
        [logger, *profiler, *extra_callbacks], model=model,
        epochs=math.ceil(steps.train_steps / steps.steps_per_epoch), steps=steps.steps_per_epoch,
    )


def _summary(run: engine.Run, final_step: int, wall_time_s: float, logger, eval_results: dict) -> dict:
    summary = {
        "steps": final_step,
        "wall_time_s": round(wall_time_s, 2),
        "images_per_sec": logger.steady_images_per_sec(),
        **{key: eval_results[key] for key in ("eval_top1", "eval_top5", "eval_loss") if key in eval_results},
        "num_workers": run.cluster.size,
        "num_replicas": run.cluster.num_replicas,
        "global_batch_size": run.cfg.data.global_batch_size,
    }
    # The EMA's figures only when optim.ema_decay > 0: a run without EMA keeps exactly the keys above.
    summary.update({key: value for key, value in eval_results.items() if key.endswith("_ema")})
    return summary


def main(cfg: ml_collections.ConfigDict, workdir: str, extra_callbacks=(), evaluating: bool = True) -> None:
    """The CLI's work: train, and turn a preemption or a fault the user must act on into its exit code
    (config errors: `run_cli` prints them as one FATAL line; data faults too, here)."""
    try:
        with faults.fatal_on_data_faults():
            train_and_evaluate(cfg, workdir, extra_callbacks, evaluating)
    except errors.Preempted as preempted:
        logging.warning("%s; exit code %d", preempted, errors.EXIT_PREEMPTED)
        sys.exit(errors.EXIT_PREEMPTED)
    except (errors.WorkdirBusy, errors.WriteError, errors.CheckpointError, errors.ChiefRefused) as err:
        logging.error("%s; exit code %d", err, errors.exit_code(err))  # the user's to act on: one line, no traceback
        sys.exit(errors.exit_code(err))
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as err:  # MWMS: a worker stopped answering
        line = heartbeat.lost_peer_line(err, cfg.distribute.heartbeat_timeout_s)
        if line is None:
            raise
        logging.error("%s (exit code %d)", line, errors.EXIT_CLUSTER_UNAVAILABLE)
        sys.exit(errors.EXIT_CLUSTER_UNAVAILABLE)


MODES = ("train_and_eval", "train", *evaluator.MODES)  # Model Garden's --mode
MODE_HELP = ("train_and_eval: train, evaluating every train.eval_every_epochs; train: no eval (leave it to a "
             "side-car); eval: the workdir's newest (or --checkpoint's) checkpoint once, in this process, with the "
             "run's own config (no --config needed); continuous_eval: each new checkpoint as it appears, until the "
             "run's last (tfscale.training.evaluator)")


def requested_mode(argv: list[str]) -> str:
    """--mode's value in `argv` ("--mode=eval" or "--mode eval"); the default when absent."""
    for i, arg in enumerate(argv):
        if arg.startswith("--mode="):
            return arg.partition("=")[2]
        if arg == "--mode" and i + 1 < len(argv):
            return argv[i + 1]
    return MODES[0]


def _define_eval_flags() -> None:
    flags.DEFINE_enum("mode", "eval", MODES, MODE_HELP)
    flags.DEFINE_string("workdir", None, "The training run's workdir (config.json, checkpoints/).")
    flags.DEFINE_string("checkpoint", "", "eval: this checkpoint prefix (W/checkpoints/ckpt-N); default: the newest.")
    flags.DEFINE_string("split", "", "The split to evaluate (default: the run's data.eval_split).")
    flags.DEFINE_float("timeout_s", 3600.0, "continuous_eval: stop when no new checkpoint appeared for this long.")
    flags.mark_flag_as_required("workdir")


def _evaluate(f: flags.FlagValues) -> None:
    logs.configure()
    with faults.fatal_on_data_faults():
        evaluator.run_mode(f.mode, f.workdir, f.checkpoint, f.split, f.timeout_s)


def run():
    """Console-script entry point (`tfscale-train`): training (`--mode=train_and_eval`, `train`), or the
    evaluator of a run's checkpoints (`--mode=eval`, `continuous_eval`: tfscale.training.evaluator)."""
    mode = requested_mode(sys.argv[1:])
    if mode in evaluator.MODES:
        cli.run_tool(_evaluate, define_flags=_define_eval_flags,
                     errors=(*cli.INPUT_ERRORS, errors.CheckpointError, errors.ConfigError))
        return
    mode_flag = flags.DEFINE_enum("mode", MODES[0], MODES, MODE_HELP)
    cli.make_key_flags(["mode"])
    cli.run_cli(lambda cfg, workdir: main(cfg, workdir, evaluating=mode_flag.value != "train"),
                workdir_help="Directory for checkpoints, metrics and summaries.")


if __name__ == "__main__":
    run()
