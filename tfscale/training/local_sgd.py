"""Local SGD, post-local SGD and households: when workers communicate, as pure Python (no TensorFlow).

Synchronous training (`distribute.sync = "gradients"`) all-reduces gradients every step. Local SGD
(`"local_sgd"`) lets each of the M workers (replicas) step on its own batch with its own weights, and
averages the weights every L_W = `sync_period` steps in one fused all-reduce (a "world sync"); with
`sync_slots` the optimizer slots (momentum; the EMA) are averaged with them. BatchNorm statistics
are averaged at world syncs too. Post-local SGD (`post_local_after_epochs`) trains synchronously
first and switches to local SGD after that many epochs.

Households (`households` = H): H groups of M/H consecutive workers (a node, typically). Inside a
household, gradients are averaged every step (`household_period` L_H = 1), or the household
averages its weights every L_H steps; households average weights with each other at world syncs.
H = M (or 0) is plain local SGD, H = 1 with L_H = 1 is synchronous SGD.

Everything the host decides (where loops end, when to sync, checkpoint, evaluate or stop) is here
as `SyncPlan`: checkpoints, evals and preemption stops happen only right after a world sync, when
every worker holds the same weights, so a resumed run continues exactly. The study's effective-batch
calculator (`household_batch`) is here too; `tools/local_sgd_calculator.py` prints it.
"""

from __future__ import annotations

import dataclasses
import math

from tfscale.config.rules import num_households


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """When a run communicates. Steps are global step counts after a loop (1-based ends)."""

    local: bool  # distribute.sync == "local_sgd"
    sync_period: int  # L_W
    household_period: int  # L_H
    households: int  # H (== num_replicas: every worker alone)
    num_replicas: int  # M
    local_from_step: int  # first step of the local phase (post-local SGD), 0 without it
    train_steps: int  # the run's last step ends with a world sync, whatever the period

    @property
    def household_gradients(self) -> bool:
        """Gradients are averaged inside households every step (1 < M/H, L_H = 1)."""
        return self.local and self.households < self.num_replicas and self.household_period == 1

    def is_local(self, step: int) -> bool:
        """The step that starts at `step` (0-based) runs without a gradient all-reduce."""
        return self.local and step >= self.local_from_step

    def world_sync_due(self, step: int) -> bool:
        """Weights are averaged over all workers after the step that ends at `step`."""
        return self.is_local(step - 1) and ((step - self.local_from_step) % self.sync_period == 0
                                            or step == self.train_steps)

    def household_sync_due(self, step: int) -> bool:
        """Weights are averaged inside households (L_H > 1) after the step that ends at `step`."""
        return (self.is_local(step - 1) and 1 < self.household_period and self.households < self.num_replicas
                and (step - self.local_from_step) % self.household_period == 0 and not self.world_sync_due(step))

    def in_agreement(self, step: int) -> bool:
        """Every worker holds the same weights at `step` (a world sync just happened, or training is synchronous)."""
        return not self.is_local(step - 1) or self.world_sync_due(step)

    def due(self, step: int, every_steps: int) -> bool:
        """A periodic action (checkpoint, eval) of period `every_steps` falls due at `step`.

        Synchronous: at multiples of the period. Local: at the first world sync at or after one.
        """
        if not self.is_local(step - 1):
            return step % every_steps == 0
        if not self.world_sync_due(step):
            return False
        since_switch = step - 1 - self.local_from_step
        previous_sync = self.local_from_step + since_switch // self.sync_period * self.sync_period
        return step // every_steps > previous_sync // every_steps

    def next_boundaries(self, step: int) -> list[int]:
        """Steps after `step` where a loop must end for this plan (phase switch, next sync)."""
        if not self.local:
            return []
        if step < self.local_from_step:
            return [self.local_from_step]
        household_syncs = self.households < self.num_replicas and self.household_period > 1
        period = self.household_period if household_syncs else self.sync_period
        return [self.local_from_step + ((step - self.local_from_step) // period + 1) * period, self.train_steps]


def make_plan(dist_cfg, *, num_replicas: int, steps_per_epoch: int, train_steps: int) -> SyncPlan:
    """The plan of `distribute.sync*` for a run of `train_steps` steps on `num_replicas` replicas."""
    local = dist_cfg.sync == "local_sgd"
    return SyncPlan(
        local=local, sync_period=dist_cfg.sync_period, household_period=dist_cfg.household_period,
        households=num_households(dist_cfg.households, num_replicas) if local else 1, num_replicas=num_replicas,
        local_from_step=round(dist_cfg.post_local_after_epochs * steps_per_epoch) if local else 0,
        train_steps=train_steps,
    )


def household_of(replica: int, *, households: int, num_replicas: int) -> int:
    """Household index of a worker: consecutive ranks share one (ranks of a node, typically)."""
    return replica // (num_replicas // households)


# --- the study's effective batch (its Eq. A.3) -------------------------------------------------------------


def effective_batch(local_batch: float, *, num_workers: int, households: int, sync_period: int) -> float:
    """B_e = B_l * M * (H + L_W - 1) / (H * L_W)."""
    h, lw = households, sync_period
    return local_batch * num_workers * (h + lw - 1) / (h * lw)


def lr_scale(*, households: int, sync_period: int) -> float:
    """The study's LR multiplier for households: L_W * H / (H + L_W - 1) (with a 5-epoch gradual warmup)."""
    return sync_period * households / (households + sync_period - 1)


def household_batch(effective: float, *, num_workers: int, households: int, sync_period: int,
                    num_train_examples: int, epochs: int) -> dict:
    """B_l, iterations and world syncs of a household run meant to match effective batch `effective`.

    B_l = round(B_e * H * L_W / (M * (H + L_W - 1))); each epoch every worker passes N/M examples,
    ceil(N / (M * B_l)) iterations; world syncs = ceil(iterations / L_W). The study's example (H = 8,
    L_W = 128, B_e = 128, M = 16, CIFAR-10's 45,000 training images, 182 epochs = 64k iterations at
    batch 128) gives B_l = 61, 8554 iterations and 67 world syncs.
    """
    h, lw, m = households, sync_period, num_workers
    local_batch = max(1, round(effective * h * lw / (m * (h + lw - 1))))
    steps_per_epoch = math.ceil(num_train_examples / (m * local_batch))
    iterations = epochs * steps_per_epoch
    return {
        "local_batch": local_batch,
        "effective_batch": effective_batch(local_batch, num_workers=m, households=h, sync_period=lw),
        "steps_per_epoch": steps_per_epoch,
        "iterations": iterations,
        "world_syncs": math.ceil(iterations / lw),
        "lr_scale": lr_scale(households=h, sync_period=lw),
    }
