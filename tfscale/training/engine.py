"""What training and benchmarking share: the run's set-up, its model and optimizer, its steps.

    run = engine.setup(cfg)                                  # config checked, cluster up, data found
    with engine.precision_policy(cfg.precision):
        model, optimizer = engine.build_model_and_optimizer(cfg, run.cluster)
        train_loop = engine.make_train_loop(cfg, run.cluster, model, optimizer, step=step_variable)

`train.py` drives the loop (through `Loops`, which adds local SGD's loop and syncs when
`distribute.sync` asks for them); `benchmark.py` times the very same replica step. A step is built in
three layers, each usable alone (the benchmark times the first without the rest):

  loss_and_grads(images, labels)       one replica's forward + backward (XLA-compiled with jit_compile)
  replica_step(images, labels, stop)   + gradient reduction, update
  train_loop(iterator, stop, n)        n global steps on device (every replica's step, its loss
                                       summed over the whole job), the LR set per step, the
                                       replicas' BatchNorm statistics averaged after the last

Only this module builds models, optimizers and steps from a config; `distribute.Cluster` supplies the
collectives, so the code here has no branch per backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import cli, logs
from tfscale import config as tfs_config
from tfscale.cluster import distribute
from tfscale.config import validation
from tfscale.data.input import info as data_info
from tfscale.data.input import loaders
from tfscale.data.stage import prepare
from tfscale.launch import launcher_death
from tfscale.model import build, optim, stats
from tfscale.model import update as compiled_update
from tfscale.training import step_choices


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run knows before it builds a model: its checked config, cluster, step counts and data."""

    cfg: ml_collections.ConfigDict
    cluster: distribute.Cluster
    steps: tfs_config.Steps
    data_dir: str  # where the shards are read from (the staged copy when data.stage_dir is set)


def setup(cfg: ml_collections.ConfigDict) -> Run:
    """`join` then `with_data`: the set-up of a run that claims nothing in between (training claims its workdir)."""
    return with_data(cfg, join(cfg))


def join(cfg: ml_collections.ConfigDict) -> distribute.Cluster:
    """Checks `cfg` and joins the cluster: config mistakes fail before a cluster is waited for, the batch
    split once the number of replicas is known. A worker of `tfscale.launch` ends (checkpointing, in
    bounded time) if its launcher dies."""
    launcher_death.follow_launcher()
    found = data_info.facts(cfg.data)  # counts still at ImageNet-1k's defaults become the data's own
    data_info.adopt(cfg.data, found, chosen=cli.command_line_keys())
    validation.validate(cfg)
    data_info.check_tfds_counts(cfg.data, found)
    build.check(cfg)  # a model tfscale did not define is built once, in a graph of its own, before connecting
    cluster = distribute.setup(cfg.distribute)
    step_choices.resolve_compilation(cfg, cluster.strategy.extended.worker_devices)
    step_choices.resolve_pack_bytes(cfg, cluster)
    validation.validate(cfg, num_replicas=cluster.num_replicas)
    data_info.check_tfds_files(cfg.data, num_workers=cluster.size)
    step_choices.check_xla_sync_bn_devices(cfg, cluster.strategy.extended.worker_devices)
    return cluster


def with_data(cfg: ml_collections.ConfigDict, cluster: distribute.Cluster) -> Run:
    """The run on `cluster` with its data found (staged first with data.stage_dir): missing shards or a
    manifest mismatch fail before any model is built."""
    # Each worker stages the train shards it reads: the workers of a node share data.stage_dir and take
    # turns under its lock, so the node's copy ends up with its workers' shards and the eval split.
    data_dir = prepare.prepare_data_dir(
        cfg.data, num_train_examples=cfg.data.num_train_examples, num_eval_examples=cfg.data.num_eval_examples,
        worker_ranks=(cluster.rank,), num_workers=cluster.size,
    )
    return Run(cfg=cfg, cluster=cluster, steps=tfs_config.to_steps(cfg, num_workers=cluster.size), data_dir=data_dir)


# --- model and optimizer ----------------------------------------------------------------------------


@contextlib.contextmanager
def precision_policy(precision: str):
    """Keras' global dtype policy set to `precision` for the block, restored afterwards."""
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)


def build_model(cfg: ml_collections.ConfigDict) -> keras.Model:
    """The configured model (under the current dtype policy); inside a strategy scope to distribute it."""
    return build.create_from_config(cfg)


def build_optimizer(cfg: ml_collections.ConfigDict, model: keras.Model, *,
                    reduced_gradients: bool = True) -> keras.optimizers.Optimizer:
    """The configured optimizer, loss-scaled under float16, built so checkpoints restore into it.

    It applies gradients already reduced over the replicas (tfscale's step); `reduced_gradients=False`
    for Keras' `fit`, which hands over each replica's own and lets the optimizer sum them."""
    optimizer = optim.make_optimizer(cfg.optim, learning_rate=cfg.optim.lr, reduced_gradients=reduced_gradients)
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
    # What standard Keras callbacks look for; fit() would set them, and tfscale never calls compile/fit.
    model.optimizer = optimizer
    model.stop_training = False
    info = stats.describe(model)
    logging.info("model %s: %d parameters (%d trainable: %.1f MB of gradients a step), %.3g GFLOPs/image",
                 cfg.model.name, info["params"], info["trainable_params"], info["gradient_bytes"] / 1e6,
                 info["flops_per_image"] / 1e9)
    return model, optimizer


# --- the training step --------------------------------------------------------------------------------
# STEP_FUNCTIONS_WITHOUT_AUTOGRAPH: step functions are traced as written (`tf.function(autograph=False)`), as Keras
# 3.15's `fit` traces its own (keras/src/backend/tensorflow/trainer.py lines 131, 150): loops are tf.while_loop,
# tensor branches tf.cond/tf.where; converting what a step calls cost ~0.7 s of CPU a process (docs/training.md).


def cross_entropy(labels, logits, num_classes: int, label_smoothing: float):
    """Per-example loss in float32; `labels` are class ids, or soft targets from MixUp/CutMix."""
    targets = labels if labels.dtype.is_floating else tf.one_hot(labels, num_classes, dtype=tf.float32)
    return keras.losses.categorical_crossentropy(
        tf.cast(targets, tf.float32), tf.cast(logits, tf.float32), from_logits=True, label_smoothing=label_smoothing
    )


def top1_hits(labels, logits):
    """Per example, 1.0 where the largest logit is the label's class (with MixUp/CutMix's soft targets: the
    largest target's, as Keras' CategoricalAccuracy counts them)."""
    classes = tf.argmax(labels, -1, output_type=tf.int32) if labels.dtype.is_floating else tf.cast(labels, tf.int32)
    return tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), tf.reshape(classes, [-1])), tf.float32)


def make_loss_and_grads(cfg, cluster, model, optimizer, *, local: bool = False):
    """`loss_and_grads(images, labels) -> ([loss share, top-1 share], gradients)` of one replica: forward +
    backward only. The shares are this replica's parts of the global batch's mean loss and top-1 accuracy.

    With `optim.grad_accum_steps = k` the replica's batch is cut into k micro-batches whose gradients
    are summed (`accumulate`); each micro-batch's loss is normalised by the global batch, so the sum is
    the gradient of the global-batch mean exactly as with k = 1. `local` (local SGD): the gradient of
    this replica's own batch mean, which it applies without any reduction.
    """
    global_batch_size = cfg.data.global_batch_size
    micro_batches = cfg.optim.grad_accum_steps
    # Weight decay belongs to the update, not to a micro-batch: each adds its k-th part.
    weight_decay = optim.loss_weight_decay(cfg.optim) / micro_batches
    if local:
        loss_batch_size = global_batch_size // cluster.num_replicas
    else:
        loss_batch_size = cluster.loss_batch_size(global_batch_size)
    # tf.distribute divides the regularizer by the replicas whose gradients it will sum; a local step sums none.
    scale_regularization = (lambda loss: loss) if local else tf.nn.scale_regularization_loss

    def loss_and_grads(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = cross_entropy(labels, logits, cfg.data.num_classes, cfg.optim.label_smoothing)
            # Normalised so that the backend's gradient reduction yields the global-batch mean.
            objective = tf.nn.compute_average_loss(per_example, global_batch_size=loss_batch_size)
            if weight_decay:
                objective += scale_regularization(optim.l2_loss(model.trainable_variables, weight_decay))
            scaled = optimizer.scale_loss(objective)
        # This replica's shares of the global mean loss and top-1: the shares sum to them over all replicas.
        shares = tf.stack([tf.reduce_sum(per_example), tf.reduce_sum(top1_hits(labels, logits))]) / global_batch_size
        return shares, tape.gradient(scaled, model.trainable_variables)

    # Done by `join` unless a tool skipped it.
    step_choices.resolve_compilation(cfg, cluster.strategy.extended.worker_devices)
    if cfg.jit_compile:
        # XLA compiles forward + backward only: the iterator and the cross-replica gradient
        # all-reduce inside apply_gradients cannot live in an XLA cluster.
        loss_and_grads = tf.function(loss_and_grads, jit_compile=True, autograph=False)
    return accumulate(loss_and_grads, micro_batches, model.trainable_variables)


def accumulate(loss_and_grads, micro_batches: int, variables):
    """`loss_and_grads` over `micro_batches` equal slices of the batch, shares and gradients summed.

    The slices run one after another in a `tf.while_loop`, so activations of only one micro-batch are
    alive at a time: that is the memory gradient accumulation saves. BatchNorm normalises each
    micro-batch on its own and updates its moving statistics once per micro-batch.
    """
    if micro_batches == 1:
        return loss_and_grads

    def accumulated(images, labels):
        image_slices = tf.reshape(images, [micro_batches, -1, *images.shape[1:]])
        label_slices = tf.reshape(labels, [micro_batches, -1, *labels.shape[1:]])

        def add_slice(i, share_sums, grad_sums):
            shares, grads = loss_and_grads(image_slices[i], label_slices[i])
            return i + 1, share_sums + shares, [total + grad for total, grad in zip(grad_sums, grads)]

        # Sums start at zero rather than at slice 0's result, so the loop body is traced once.
        init = (tf.constant(0), tf.zeros([2]), [tf.zeros(v.shape, v.dtype) for v in variables])
        return tf.while_loop(lambda i, *_: i < micro_batches, add_slice, init, maximum_iterations=micro_batches)[1:]

    return accumulated


def make_replica_step(cfg, cluster, model, optimizer):
    """`replica_step(images, labels, stop_requested) -> [loss, top-1, stop flag]`: one replica's part of a
    step, returning this replica's shares of the three (a loop sums them over the job after its last step)."""
    loss_and_grads = make_loss_and_grads(cfg, cluster, model, optimizer)
    apply_update = make_update(cfg, model, optimizer)

    def replica_step(images, labels, stop_requested):
        shares, grads = loss_and_grads(images, labels)
        # The stop flag travels with the loss: if any worker got SIGTERM, every worker learns it at
        # the same loop end and they checkpoint together (saving is a collective).
        step_sums = tf.concat([shares, [stop_requested]], axis=0)
        # Reduced before the update, so that a float16 step's inf/NaN check sees every replica's
        # overflow in its sum: all skip together, with no collective of their own.
        apply_update(cluster.reduce_gradients(grads))
        return step_sums

    return replica_step


def make_update(cfg, model, optimizer):
    """`update(reduced_grads)` inside a replica step: the update compiled (`optim.compiled_update`,
    tfscale.model.update) or Keras' `apply_gradients`."""
    variables = model.trainable_variables
    if cfg.optim.compiled_update:
        return compiled_update.make_update(optimizer, variables)
    return lambda grads: optimizer.apply_gradients(zip(grads, variables))


def run_replica_step(cluster, replica_step, images, labels, stop_requested):
    """Runs `replica_step` on every replica; returns its [loss, top-1, replicas stopping] shares summed over this
    worker's replicas, with no collective (`cluster.sum_over_processes` finishes them): a job's sums are
    the mean loss and top-1 over the global batch and the replicas stopping."""
    per_replica = cluster.strategy.run(replica_step, args=(images, labels, stop_requested))
    return tf.add_n(cluster.strategy.experimental_local_results(per_replica))


def make_train_loop(cfg, cluster, model, optimizer, *, step: tf.Variable, learning_rate=None):
    """A compiled function running several global steps on device, with one host sync at the end.

    `train_loop(iterator, stop_requested, num_steps) -> (losses, top-1s, replicas stopping)`: `losses[i]` and
    `top-1s[i]` are step i's mean loss and top-1 accuracy over the global batch (its training batch, as the
    model saw it while training: augmented, BatchNorm in training mode); the stop count (replicas whose worker was asked to
    stop) is the last step's. Each worker keeps its own steps' sums during the loop and the job sums
    them in one all-reduce after its last step: the host reads neither sooner, and a step's only
    collective stays its gradients' all-reduce (docs/benchmarking.md). Before each step the
    optimizer's LR is set to `learning_rate(step)` (a tensor function of the run's step counter: a
    `LearningRate`; None keeps the LR), and after it `step` is advanced: the LR changes every step
    although the host sees only the loop's end. This is Orbit's `steps_per_loop` / Keras'
    `steps_per_execution`.

    Each replica updates its own BatchNorm moving statistics during the loop; they are averaged over
    the replicas once, after its last step, so eval, checkpoints and export (which run between loops)
    see one set. That equals averaging after every step: the update `m = momentum * m + (1 - momentum) * s`
    is linear in `m` and in the batch statistic `s`, and training normalises with `s`, never `m`, so the
    mean of the replicas' statistics follows the same recursion as averaged ones (tested to rounding). It
    saves an all-reduce of every statistic per step: ~4 points of 2-worker scaling under MWMS on loopback
    (docs/benchmarking.md).
    """
    replica_step = make_replica_step(cfg, cluster, model, optimizer)

    def global_step(iterator, stop_requested):
        return run_replica_step(cluster, replica_step, *next(iterator), stop_requested)

    def average_batch_norm_state():
        if not cfg.model.sync_bn:  # synchronized BatchNorm computes identical statistics everywhere
            cluster.strategy.run(lambda: cluster.average_replica_state(model.non_trainable_variables))

    return compiled_loop(global_step, optimizer, step, learning_rate, cluster.sum_over_processes,
                         after_last_step=average_batch_norm_state)


def compiled_loop(global_step, optimizer, step: tf.Variable, learning_rate, job_sums, after_last_step=None):
    """`train_loop(iterator, stop_requested, num_steps) -> (losses, top-1s, replicas stopping)` running
    `global_step` (-> this worker's [loss, top-1, replicas stopping] sums) `num_steps` times in one tf.function,
    the LR set before and `step` advanced after each; then `after_last_step()`, if given, and `job_sums` of
    every step's sums in one call."""

    @tf.function(autograph=False)  # see STEP_FUNCTIONS_WITHOUT_AUTOGRAPH above
    def train_loop(iterator, stop_requested, num_steps):
        # A step's only collective is its gradients' all-reduce: each reads the weights the previous
        # one wrote, so they run in order (Horovod refuses a collective whose name, the same in every
        # iteration, is still in flight).
        def one_step(i, per_step, stopping):  # per_step: [loss, top-1] of each step; stopping: the last step's
            if learning_rate is not None:
                optimizer.learning_rate.assign(learning_rate(step))
            sums = global_step(iterator, stop_requested)
            step.assign_add(1)
            return i + 1, per_step.write(i, sums[:2]), sums[2]

        init = (tf.constant(0), tf.TensorArray(tf.float32, size=num_steps), tf.constant(0.0))
        _, per_step, stopping = tf.while_loop(lambda i, *_: i < num_steps, one_step, init, maximum_iterations=num_steps)
        if after_last_step is not None:
            after_last_step()
        sums = job_sums(tf.concat([tf.reshape(tf.transpose(per_step.stack()), [-1]), [stopping]], axis=0))
        return sums[:num_steps], sums[num_steps:-1], sums[-1]

    return train_loop


# --- evaluation -------------------------------------------------------------------------------------


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

    @tf.function(autograph=False)  # see STEP_FUNCTIONS_WITHOUT_AUTOGRAPH above
    def eval_step(iterator):
        sums = cluster.strategy.run(replica_step, args=next(iterator))
        return cluster.sum_over_processes(tf.add_n(cluster.strategy.experimental_local_results(sums)))

    return eval_step


def evaluate(eval_step, iterator, num_steps: int, progress_every_s: float = 0.0,
             say: Callable[[str], None] | None = None) -> dict:
    """Runs the eval set once (`num_steps` batches of `eval_dataset`'s iterator); metrics are exact
    example counts over all replicas. With `say`, every `progress_every_s` seconds: how many batches are done
    and when the eval will end (minutes of silence on a large eval set otherwise)."""
    totals = tf.zeros([4])
    start = last_said = time.perf_counter()
    for done in range(1, num_steps + 1):
        totals += eval_step(iterator)
        now = time.perf_counter()
        if say is not None and done < num_steps and now - last_said >= progress_every_s:
            eta_s = (now - start) / done * (num_steps - done)
            say(f"{done}/{num_steps} batches in {now - start:.0f} s, eta {logs.format_duration(eta_s)}")
            last_said = now
    loss_sum, top1_hits, top5_hits, examples = totals.numpy().tolist()
    return {
        "eval_loss": loss_sum / examples,
        "eval_top1": top1_hits / examples,
        "eval_top5": top5_hits / examples,
        "eval_examples": int(examples),
    }


# --- data ---------------------------------------------------------------------------------------------


def train_dataset(run: Run, start_step: int, skipped_images: tf.Variable | None = None):
    """The training input, distributed over the job, continuing the data order at `start_step`;
    `skipped_images` counts this worker's undecodable records (data.skip_corrupt_images)."""
    cfg = run.cfg
    return run.cluster.distribute_dataset(
        loaders.train_input_fn(cfg.data, seed=cfg.seed, start_step=start_step, data_dir=run.data_dir,
                               skipped_images=skipped_images)
    )


def eval_dataset(run: Run):
    """The whole eval set pass after pass, each pass `run.steps.eval_steps` padded batches whose padding is
    masked out of the metrics, the same examples in the same order every pass.

    One iterator serves every eval of a run: its input pipeline, per-device buffers and threads are
    built once, not at each eval (as Keras' `fit` keeps its validation iterator between epochs).
    """
    cfg, steps = run.cfg, run.steps
    one_pass = loaders.eval_input_fn(cfg.data, seed=cfg.seed, global_batch_size=steps.eval_global_batch_size,
                                     num_steps=steps.eval_steps, data_dir=run.data_dir)
    return run.cluster.distribute_dataset(lambda context: one_pass(context).repeat())
