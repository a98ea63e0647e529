"""Training entry point and the distributed training loop tfscale owns.

    python -m tfscale.train --config=configs/smoke.py --workdir=runs/smoke [--config.x.y=v ...]

Why a custom loop: Keras 3 `model.fit` fails under MultiWorkerMirroredStrategy (keras-team/keras
#20585), so tfscale does what Model Garden/Orbit, tf_cnn_benchmarks and NVIDIA's examples do: a
`tf.function` step run by the strategy, with standard Keras callbacks driven through
`keras.callbacks.CallbackList`. Rerunning with the same workdir resumes from the latest checkpoint.
"""

from __future__ import annotations

from tfscale import logs

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import callbacks as tfs_callbacks
from tfscale import config as tfs_config
from tfscale import distribute, init_from, models, optim, schedules
from tfscale.data import pipeline

# Exit code after SIGTERM: the checkpoint is saved, rerun the same command (requeue) to resume.
# 75 is sysexits' EX_TEMPFAIL ("temporary failure; the user is invited to retry").
EXIT_PREEMPTED = 75


def build_model(cfg: ml_collections.ConfigDict) -> keras.Model:
    """The configured model; call inside the strategy scope."""
    return models.create(
        cfg.model.name,
        num_classes=cfg.data.num_classes,
        input_shape=(cfg.data.image_size, cfg.data.image_size, 3),
        zero_init_residual=cfg.model.zero_init_residual,
        bn_momentum=cfg.model.bn_momentum,
        bn_epsilon=cfg.model.bn_epsilon,
        data_format=cfg.model.data_format,
        sync_bn=cfg.model.sync_bn,
    )


def build_optimizer(cfg: ml_collections.ConfigDict, model: keras.Model) -> keras.optimizers.Optimizer:
    """The configured optimizer, loss-scaled under float16, built so checkpoints restore into it."""
    optimizer = optim.make_optimizer(cfg.optim, learning_rate=cfg.optim.lr)
    if cfg.precision == "mixed_float16":
        # float16 gradients underflow without it; bfloat16 has float32's range and needs none.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    # Slots exist before restore, so a checkpoint fills them instead of being deferred.
    optimizer.build(model.trainable_variables)
    return optimizer


def build_model_and_optimizer(cfg: ml_collections.ConfigDict, cluster) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """Seeded model and optimizer in the cluster's strategy scope; logs parameters and FLOPs."""
    keras.utils.set_random_seed(cfg.seed)
    with cluster.strategy.scope():
        model = build_model(cfg)
        optimizer = build_optimizer(cfg, model)
    # What standard Keras callbacks look for; fit() would set them, and we never call compile/fit.
    model.optimizer = optimizer
    model.stop_training = False
    info = models.describe(model)
    logging.info("model %s: %d parameters, %.3g GFLOPs/image", cfg.model.name, info["params"], info["flops_per_image"] / 1e9)
    return model, optimizer


@contextlib.contextmanager
def precision_policy(precision: str):
    """Keras' global dtype policy set to `precision` for the block, restored afterwards."""
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)


def profiler_callbacks(cfg: ml_collections.ConfigDict, workdir: str, cluster) -> list[keras.callbacks.Callback]:
    """A Profiler for `config.profile_steps` (writing into workdir/tensorboard), or nothing."""
    window = tfs_config.profile_window(cfg.profile_steps)
    if window is None:
        return []
    logdir = os.path.join(workdir, "tensorboard")
    return [tfs_callbacks.Profiler(logdir, first_step=window[0], last_step=window[1], is_chief=cluster.is_chief)]


def cross_entropy(labels, logits, num_classes: int, label_smoothing: float):
    """Per-example loss in float32; `labels` are class ids, or soft targets from MixUp/CutMix."""
    targets = labels if labels.dtype.is_floating else tf.one_hot(labels, num_classes, dtype=tf.float32)
    return keras.losses.categorical_crossentropy(
        tf.cast(targets, tf.float32), tf.cast(logits, tf.float32), from_logits=True, label_smoothing=label_smoothing
    )


def make_loss_and_grads(cfg, cluster, model, optimizer):
    """`loss_and_grads(images, labels) -> (loss share, gradients)` of one replica: forward + backward only."""
    global_batch_size = cfg.data.global_batch_size
    weight_decay = optim.loss_weight_decay(cfg.optim)
    loss_batch_size = cluster.loss_batch_size(global_batch_size)

    def loss_and_grads(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = cross_entropy(labels, logits, cfg.data.num_classes, cfg.optim.label_smoothing)
            # Normalised so that the backend's gradient reduction yields the global-batch mean.
            objective = tf.nn.compute_average_loss(per_example, global_batch_size=loss_batch_size)
            if weight_decay:
                objective += tf.nn.scale_regularization_loss(optim.l2_loss(model.trainable_variables, weight_decay))
            scaled = optimizer.scale_loss(objective)
        # This replica's share of the global mean loss: the shares sum to it over all replicas.
        loss_share = tf.reduce_sum(per_example) / global_batch_size
        return loss_share, tape.gradient(scaled, model.trainable_variables)

    if cfg.jit_compile:
        # XLA compiles forward + backward only: the iterator and the cross-replica gradient
        # all-reduce inside apply_gradients cannot live in an XLA cluster.
        return tf.function(loss_and_grads, jit_compile=True)
    return loss_and_grads


def make_replica_step(cfg, cluster, model, optimizer):
    """`replica_step(images, labels, stop_requested) -> [loss share, stop flag]`: one replica's part of a step."""
    loss_and_grads = make_loss_and_grads(cfg, cluster, model, optimizer)

    def replica_step(images, labels, stop_requested):
        loss_share, grads = loss_and_grads(images, labels)
        grads = cluster.all_reduce_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if not cfg.model.sync_bn:  # synchronized BatchNorm computes identical statistics everywhere
            cluster.average_state(model.non_trainable_variables)
        # The stop flag rides on the loss all-reduce: if any worker got SIGTERM, every worker
        # learns it at the same step and they checkpoint together (saving is a collective).
        return tf.stack([loss_share, stop_requested])

    return replica_step


def run_replica_step(cluster, replica_step, images, labels, stop_requested):
    """Runs `replica_step` on every replica; returns [mean loss over the global batch, replicas stopping]."""
    per_replica = cluster.strategy.run(replica_step, args=(images, labels, stop_requested))
    return cluster.sum_across_processes(cluster.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))


def make_train_step(cfg, cluster, model, optimizer):
    """A compiled function running one global step.

    `train_step(iterator, stop_requested)` returns [mean loss over the global batch, number of
    replicas whose worker was asked to stop].
    """
    replica_step = make_replica_step(cfg, cluster, model, optimizer)

    @tf.function
    def train_step(iterator, stop_requested):
        return run_replica_step(cluster, replica_step, *next(iterator), stop_requested)

    return train_step


def make_eval_step(cfg, cluster, model):
    """A compiled function returning summed (loss, top-1 hits, top-5 hits, examples) of one batch."""
    top_k = min(5, cfg.data.num_classes)

    def replica_step(images, labels, mask):
        logits = tf.cast(model(images, training=False), tf.float32)
        per_example = cross_entropy(labels, logits, cfg.data.num_classes, 0.0)
        top1 = tf.cast(tf.math.in_top_k(labels, logits, 1), tf.float32)
        top5 = tf.cast(tf.math.in_top_k(labels, logits, top_k), tf.float32)
        # Sums, not means: padded examples (mask 0) drop out and the totals add across replicas exactly.
        return tf.stack([tf.reduce_sum(x * mask) for x in (per_example, top1, top5, mask)])

    @tf.function
    def eval_step(iterator):
        sums = cluster.strategy.run(replica_step, args=next(iterator))
        return cluster.sum_across_processes(cluster.strategy.reduce(tf.distribute.ReduceOp.SUM, sums, axis=None))

    return eval_step


def evaluate(eval_step, eval_dataset, num_steps: int) -> dict:
    """Runs the eval set once; metrics are exact example counts over all replicas."""
    iterator = iter(eval_dataset)
    totals = tf.zeros([4])
    for _ in range(num_steps):
        totals += eval_step(iterator)
    loss_sum, top1_hits, top5_hits, examples = totals.numpy().tolist()
    return {
        "eval_loss": loss_sum / examples,
        "eval_top1": top1_hits / examples,
        "eval_top5": top5_hits / examples,
        "eval_examples": int(examples),
    }


def _checkpoint_manager(checkpoint, workdir: str, cluster, max_to_keep: int) -> tf.train.CheckpointManager | None:
    """The chief's manager of workdir/checkpoints; None for a worker that does not save at all.

    Under MWMS saving is a collective, so the other workers must save too: into a scratch directory.
    """
    if cluster.is_chief:
        return tf.train.CheckpointManager(checkpoint, os.path.join(workdir, "checkpoints"), max_to_keep=max_to_keep)
    if not cluster.saving_is_collective:
        return None
    return tf.train.CheckpointManager(checkpoint, tempfile.mkdtemp(prefix="tfscale_ckpt_"), max_to_keep=max_to_keep)


def _discard_scratch(manager: tf.train.CheckpointManager | None, cluster) -> None:
    if manager is not None and not cluster.is_chief:  # scratch checkpoints exist only because saving is collective
        shutil.rmtree(manager.directory, ignore_errors=True)


def _write_json(path: str, obj) -> None:
    # Write-then-rename: a killed process never leaves a half-written file behind.
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint of `step` is saved and the run can be resumed."""

    def __init__(self, step: int):
        super().__init__(f"preempted: checkpoint saved at step {step}; rerun the same command to resume")
        self.step = step


def _watch_sigterm() -> tuple[threading.Event, callable]:
    """An Event set by SIGTERM (Slurm's warning before a kill), and a function restoring the old handler.

    Repeated signals are harmless (Slurm may signal a task twice); the loop acts at the next step.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return requested, lambda: None  # signal handlers can only be set from the main thread

    def on_sigterm(signum, frame):
        if not requested.is_set():
            logging.warning("SIGTERM: saving a checkpoint after this step, then exiting with %d", EXIT_PREEMPTED)
        requested.set()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    return requested, lambda: signal.signal(signal.SIGTERM, previous)


def _check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"loss is {loss} at step {step}; stopping (the last checkpoint holds the weights before it)"
        )


def train_and_evaluate(cfg: ml_collections.ConfigDict, workdir: str, extra_callbacks=()) -> dict:
    """Trains `cfg` in `workdir` (resuming from its latest checkpoint) and returns the summary.

    `extra_callbacks`: more Keras callbacks, driven after tfscale's own (LR, logging, checkpoints).
    Setting `model.stop_training` from one ends the run after the current step, checkpointed.
    """
    tfs_config.validate(cfg)  # config mistakes fail before a cluster is waited for
    cluster = distribute.setup(cfg.distribute)
    tfs_config.validate(cfg, num_replicas=cluster.num_replicas)  # now the batch split can be checked
    steps = tfs_config.to_steps(cfg)
    os.makedirs(workdir, exist_ok=True)
    if cluster.is_chief:
        _write_json(os.path.join(workdir, "config.json"), cfg.to_dict())

    stop_requested, restore_sigterm = _watch_sigterm()
    try:
        with precision_policy(cfg.precision):
            return _run(cfg, workdir, cluster, steps, extra_callbacks, stop_requested)
    finally:
        restore_sigterm()


def _run(cfg, workdir, cluster, steps: tfs_config.Steps, extra_callbacks, stop_requested: threading.Event) -> dict:
    # Data problems (missing shards, manifest mismatch) surface before any model is built.
    data_dir = pipeline.prepare_data_dir(
        cfg.data, num_train_examples=cfg.data.num_train_examples, num_eval_examples=cfg.data.num_eval_examples
    )
    model, optimizer = build_model_and_optimizer(cfg, cluster)
    with cluster.strategy.scope():
        # The loop's step; differs from optimizer.iterations when float16 loss scaling skips a step.
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, global_step=global_step)
    manager = _checkpoint_manager(checkpoint, workdir, cluster, cfg.checkpoint.max_to_keep)
    # Every worker restores the chief's latest checkpoint (the workdir is on a shared file system);
    # a non-chief's own scratch directory is empty at every start.
    latest = tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints"))
    restored_step = None
    if latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
        restored_step = int(global_step.numpy())
        logging.info("resumed from %s at step %d", latest, restored_step)
    else:  # config.model.init_from applies to a fresh run only: resuming wins over it
        init_from.apply(cfg, model, build_model)
    # Horovod ranks each initialised (or restored) on their own: start from the chief's state.
    cluster.broadcast_from_chief([*model.variables, *optimizer.variables, global_step])
    start_step = int(global_step.numpy())
    summary_path = os.path.join(workdir, "summary.json")
    if start_step >= steps.train_steps and os.path.exists(summary_path):
        logging.info("training already complete at step %d; summary in %s", start_step, summary_path)
        with open(summary_path) as f:
            return json.load(f)

    train_ds = cluster.distribute_dataset(
        pipeline.train_input_fn(cfg.data, seed=cfg.seed, start_step=start_step, data_dir=data_dir)
    )
    eval_ds = cluster.distribute_dataset(
        pipeline.eval_input_fn(
            cfg.data, seed=cfg.seed, global_batch_size=steps.eval_global_batch_size, num_steps=steps.eval_steps,
            data_dir=data_dir,
        )
    )
    train_step = make_train_step(cfg, cluster, model, optimizer)
    eval_step = make_eval_step(cfg, cluster, model)

    schedule = schedules.make_schedule(
        cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps.steps_per_epoch,
        total_steps=steps.train_steps, num_replicas=cluster.num_replicas,
    )
    logger = tfs_callbacks.MetricsLogger(
        workdir, is_chief=cluster.is_chief, global_batch_size=cfg.data.global_batch_size,
        steps_per_epoch=steps.steps_per_epoch, train_steps=steps.train_steps,
        log_every_steps=cfg.train.log_every_steps,
    )
    saver = tfs_callbacks.CheckpointSaver(manager, every_steps=steps.checkpoint_every_steps, restored_step=restored_step)
    callback_list = keras.callbacks.CallbackList(
        [tfs_callbacks.LearningRateScheduler(schedule), logger, saver, *profiler_callbacks(cfg, workdir, cluster),
         *extra_callbacks], model=model,
        epochs=math.ceil(steps.train_steps / steps.steps_per_epoch), steps=steps.steps_per_epoch,
    )

    def run_eval(step: int) -> dict:
        callback_list.on_test_begin()
        try:
            results = evaluate(eval_step, eval_ds, steps.eval_steps)
        except tf.errors.DataLossError as err:
            raise pipeline.explain_data_loss(err, cfg.data, data_dir, cfg.data.eval_split) from err
        logging.info("eval at step %d: top-1 %.4f  top-5 %.4f  loss %.4f  (%d examples)", step,
                     results["eval_top1"], results["eval_top5"], results["eval_loss"], results["eval_examples"])
        callback_list.on_test_end({"step": step, "epoch": round(step / steps.steps_per_epoch, 4), **results})
        return results

    start_time = time.time()
    eval_results = {}
    callback_list.on_train_begin()
    iterator = iter(train_ds)
    for step in range(start_step, steps.train_steps):
        epoch, batch = divmod(step, steps.steps_per_epoch)
        if batch == 0:
            callback_list.on_epoch_begin(epoch)
        callback_list.on_train_batch_begin(batch)
        try:
            loss, workers_stopping = train_step(iterator, tf.constant(float(stop_requested.is_set()))).numpy().tolist()
        except tf.errors.DataLossError as err:
            raise pipeline.explain_data_loss(err, cfg.data, data_dir, cfg.data.train_split) from err
        _check_finite(loss, step + 1)
        global_step.assign(step + 1)
        callback_list.on_train_batch_end(batch, {"loss": loss, "global_step": step + 1})
        if workers_stopping:
            saver.save(step + 1)
            _discard_scratch(manager, cluster)
            raise Preempted(step + 1)
        if (step + 1) % steps.eval_every_steps == 0 or step + 1 == steps.train_steps:
            eval_results = run_eval(step + 1)
        if batch == steps.steps_per_epoch - 1:
            callback_list.on_epoch_end(epoch, {"loss": loss})
        if model.stop_training:  # set by standard callbacks such as EarlyStopping/TerminateOnNaN
            break
    final_step = int(global_step.numpy())
    callback_list.on_train_end({"global_step": final_step})
    _discard_scratch(manager, cluster)
    if not eval_results:  # stopped early by a callback, or resumed at the end without a summary
        eval_results = run_eval(final_step)

    summary = {
        "steps": final_step,
        "wall_time_s": round(time.time() - start_time, 2),
        "images_per_sec": logger.steady_images_per_sec(),
        "eval_top1": eval_results["eval_top1"],
        "eval_top5": eval_results["eval_top5"],
        "eval_loss": eval_results["eval_loss"],
        "num_workers": cluster.size,
        "num_replicas": cluster.num_replicas,
        "global_batch_size": cfg.data.global_batch_size,
    }
    if cluster.is_chief:
        _write_json(summary_path, summary)
        logging.info("done: %s; workdir %s", json.dumps(summary), os.path.abspath(workdir))
    return summary


def main(cfg: ml_collections.ConfigDict, workdir: str) -> None:
    """The CLI's work: train, and turn a preemption into its documented exit code."""
    try:
        train_and_evaluate(cfg, workdir)
    except Preempted as preempted:
        logging.warning("%s; exit code %d", preempted, EXIT_PREEMPTED)
        sys.exit(EXIT_PREEMPTED)


def run():
    """Console-script entry point (`tfscale-train`)."""
    tfs_config.run_cli(main, workdir_help="Directory for checkpoints, metrics and summaries.")


if __name__ == "__main__":
    run()
