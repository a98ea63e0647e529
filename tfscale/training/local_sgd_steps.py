"""Local SGD on device: the loop whose steps each worker applies alone, the syncs that average state
between workers, and their checkpointed counts. tfscale.training.local_sgd (pure Python) decides when each runs;
tfscale.training.loops runs them.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfscale import errors
from tfscale.training import engine, local_sgd


def make_local_train_loop(cfg, cluster, model, optimizer, *, step: tf.Variable, learning_rate=None,
                          household_gradients: bool = False):
    """`make_train_loop`'s local-SGD twin: every replica applies its own gradients (or its household's mean).

    Each replica applies its own gradients: with `optim.compiled_update` the same compiled update as a
    synchronous step, inside the replica (it reduces nothing); otherwise Keras' `apply_gradients`
    outside `strategy.run`, where it finds no replica context of the strategy to all-reduce in. Either
    way each worker's variables take its own step. That holds for one replica per worker process
    (`check_local_replicas`): a worker's several replicas would all take the first one's step. The
    steps' losses and stop flags are summed over the job once, after the loop's last step: without
    households a local step sends nothing.
    """
    loss_and_grads = engine.make_loss_and_grads(cfg, cluster, model, optimizer, local=True)
    strategy = cluster.strategy
    batch_norm_state = [v for v in model.non_trainable_variables if keras.backend.is_float_dtype(v.dtype)]
    apply_update = engine.make_update(cfg, model, optimizer) if cfg.optim.compiled_update else None

    def replica_grads(images, labels, stop_requested):
        shares, grads = loss_and_grads(images, labels)
        if household_gradients:
            # A household trains synchronously: gradients and BatchNorm statistics averaged inside
            # it every step (one all-reduce for both), as the whole job does without local SGD.
            state = [tf.identity(v.value) for v in batch_norm_state]
            averaged = cluster.mean_over_household([*grads, *state])
            grads = averaged[:len(grads)]
            for variable, value in zip(batch_norm_state, averaged[len(grads):]):
                variable.assign(value)
        if apply_update is not None:
            apply_update(grads)
            return tf.concat([shares, [stop_requested]], axis=0), []
        return tf.concat([shares, [stop_requested]], axis=0), grads

    def global_step(iterator, stop_requested):
        loss_and_stop, grads = strategy.run(replica_grads, args=(*next(iterator), stop_requested))
        if apply_update is None:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return tf.add_n(strategy.experimental_local_results(loss_and_stop))

    return engine.compiled_loop(global_step, optimizer, step, learning_rate, cluster.sum_over_processes)


def check_local_replicas(cluster) -> None:
    """Local SGD runs one replica per worker process (one GPU per task, or Horovod's one rank per GPU)."""
    if cluster.num_replicas != cluster.size:
        raise errors.ConfigError(
            f"config.distribute.sync='local_sgd' needs one replica per worker process, but {cluster.size} process(es) "
            f"run {cluster.num_replicas} replicas (backend {cluster.backend!r}): start one task per GPU (Slurm "
            "--ntasks-per-node = GPUs per node) with backend mwms, or use backend horovod")


def synced_state(model, optimizer, *, sync_slots: bool) -> list:
    """What a local-SGD sync averages: weights, BatchNorm statistics and (`sync_slots`) the optimizer's
    per-variable slots (momentum), not its step count or learning rate, which every worker shares."""
    state = [v for v in model.variables if keras.backend.is_float_dtype(v.dtype)]
    if sync_slots:
        state += [v for v in optimizer.variables if keras.backend.is_float_dtype(v.dtype)
                  and v.path.rsplit("/", 1)[-1] not in ("iteration", "learning_rate")]
    return state


def make_state_sync(cluster, variables, *, household: bool, counter: tf.Variable):
    """`sync()`: `variables` averaged over all replicas (world sync) or over each household, in one
    fused all-reduce; `counter` counts the calls (checkpointed, so the count survives a resume)."""
    strategy = cluster.strategy
    mean = cluster.mean_over_household if household else cluster.mean_over_replicas

    def replica_mean():
        return mean([tf.identity(_tf_variable(v)) for v in variables])  # this replica's copies

    @tf.function(autograph=False)  # as training's step (engine.STEP_FUNCTIONS_WITHOUT_AUTOGRAPH)
    def sync():
        means = strategy.run(replica_mean)
        with strategy.scope():
            for variable, value in zip(variables, means):
                strategy.extended.update(_tf_variable(variable), _assign, args=(value,), group=False)
        counter.assign_add(1)

    return sync


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _assign(variable, value):
    return variable.assign(value)


def sync_counters(cluster, plan: local_sgd.SyncPlan) -> dict[str, tf.Variable]:
    """Local SGD's counts of weight all-reduces, checkpointed with the run (none without local SGD)."""
    if not plan.local:
        return {}
    with cluster.strategy.scope():
        return {name: tf.Variable(0, dtype=tf.int64, trainable=False, name=name)
                for name in ("world_syncs", "household_syncs")}
