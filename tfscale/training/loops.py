"""A run's compiled loops: the LR each step takes on device (`LearningRate`), the synchronous loop and
local SGD's with the syncs between them (`Loops`); tfscale.train drives them step range by step range.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import errors
from tfscale.model import schedules
from tfscale.training import engine, local_sgd, local_sgd_steps


class LearningRate:
    """The LR the compiled loop sets before every step: `schedule` (config.schedule) as a float32 table on
    device, indexed by the run's step counter, times `scale`.

    `scale` is 1 until a Keras callback sets the optimizer's LR between two loops (ReduceLROnPlateau,
    at an epoch's end): the loop's next start finds the LR changed (`follow_callbacks`) and scales the
    schedule by the callback's factor from there on, so the warmup or decay goes on from the LR the
    callback chose. It needs no checkpoint entry: the optimizer's LR variable is saved with the
    optimizer, so a resumed run reads the scale back from it (`resume`). Every worker sees the same
    metrics, runs the same callbacks and so takes the same scale.
    """

    def __init__(self, schedule: schedules.Schedule, optimizer, cluster):
        self.schedule, self.optimizer = schedule, optimizer
        self._table = tf.constant(schedule.table(), tf.float32)
        with cluster.strategy.scope():
            self.scale = tf.Variable(1.0, dtype=tf.float32, trainable=False, name="lr_scale")
        self._set_by_loop = None  # the LR the last loop left in the optimizer; None before this process's first

    def __call__(self, step: tf.Tensor) -> tf.Tensor:
        """The LR of global step `step` (a tensor), inside the compiled loop."""
        return tf.gather(self._table, tf.minimum(step, self.schedule.total_steps - 1)) * self.scale

    def resume(self, start_step: int) -> None:
        """After a restore at `start_step`: the scale a callback had set, from the LR the optimizer saved."""
        scheduled = float(np.float32(self.schedule(start_step - 1))) if start_step > 0 else 0.0  # as tabulated
        if scheduled > 0:
            self.scale.assign(float(self.optimizer.learning_rate.numpy()) / scheduled)  # exactly 1 if no callback
            self.loop_ended()

    def loop_ended(self) -> None:
        """Call right after each loop, before the callbacks see it."""
        self._set_by_loop = float(self.optimizer.learning_rate.numpy())

    def follow_callbacks(self, step: int) -> None:
        """Before the loop starting at `step`: a callback that changed the LR scales the schedule from here on."""
        if self._set_by_loop is None:
            return
        now = float(self.optimizer.learning_rate.numpy())
        if now == self._set_by_loop:
            return
        if self._set_by_loop == 0.0:
            raise errors.ConfigError(
                f"a callback set the LR to {now:g} before step {step}, where config.schedule's LR is 0: a scale of "
                "the schedule cannot follow it; change config.schedule (e.g. schedule.warmup_init_lr) instead")
        factor = now / self._set_by_loop
        self.scale.assign(float(self.scale.numpy()) * factor)
        self._set_by_loop = now
        logging.info("a callback set the LR to %g before step %d: config.schedule is scaled by %g from here on "
                     "(x%g in all)", now, step, factor, float(self.scale.numpy()))


class Loops:
    """The compiled loops of a run and local SGD's syncs between them (tfscale.training.local_sgd decides when)."""

    def __init__(self, run: engine.Run, plan: local_sgd.SyncPlan, model, optimizer, step, learning_rate: LearningRate,
                 counts):
        cfg, cluster = run.cfg, run.cluster
        self.plan, self.counts, self.learning_rate = plan, counts, learning_rate
        self.synchronous = engine.make_train_loop(cfg, cluster, model, optimizer, step=step, learning_rate=learning_rate)
        if not plan.local:
            return
        local_sgd_steps.check_local_replicas(cluster)
        self.local = local_sgd_steps.make_local_train_loop(cfg, cluster, model, optimizer, step=step, learning_rate=learning_rate,
                                                           household_gradients=plan.household_gradients)
        self.state = local_sgd_steps.synced_state(model, optimizer, sync_slots=cfg.distribute.sync_slots)
        self.world_sync = local_sgd_steps.make_state_sync(cluster, self.state, household=False, counter=counts["world_syncs"])
        self.household_sync = local_sgd_steps.make_state_sync(cluster, self.state, household=True,
                                                              counter=counts["household_syncs"])
        self.values_per_sync = sum(int(np.prod(v.shape)) for v in self.state)
        logging.info("local SGD: world sync every %d steps (%s) from step %d, %s; a sync averages %d values in one "
                     "all-reduce", plan.sync_period, "weights, BatchNorm statistics"
                     + (" and optimizer slots" if cfg.distribute.sync_slots else ""), plan.local_from_step,
                     _households_text(plan), self.values_per_sync)

    def loop_for(self, step: int):
        """The loop that runs the steps starting at `step`."""
        return self.local if self.plan.is_local(step) else self.synchronous

    def after(self, step: int) -> None:
        """The sync due after the step ending at `step`, if any."""
        if self.plan.world_sync_due(step):
            self.world_sync()
        elif self.plan.household_sync_due(step):
            self.household_sync()

    def report(self, final_step: int) -> dict:
        """Summary figures of the communication local SGD did; logged as well."""
        if not self.plan.local:
            return {}
        world, household = (int(self.counts[name].numpy()) for name in ("world_syncs", "household_syncs"))
        local_steps = max(0, final_step - self.plan.local_from_step)
        logging.info("local SGD: %d world syncs (weight all-reduces of %d values) and %d household syncs in %d local "
                     "steps; %d synchronous steps before them", world, self.values_per_sync, household, local_steps,
                     min(final_step, self.plan.local_from_step))
        return {"world_syncs": world, "household_syncs": household, "local_steps": local_steps}


def _households_text(plan: local_sgd.SyncPlan) -> str:
    if plan.households == plan.num_replicas:
        return "every worker on its own between syncs"
    inside = ("household gradients averaged every step" if plan.household_gradients
              else f"household weights averaged every {plan.household_period} steps")
    return f"{plan.households} households of {plan.num_replicas // plan.households} workers ({inside})"
