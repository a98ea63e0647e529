"""Learning-rate schedules as pure functions of the global step.

`make_schedule(cfg, ...)` returns a `Schedule`: `schedule(step) -> float`, and the float32 `table()` of
every step of the run that the compiled training loop reads on device (loops.LearningRate). Because
the LR depends on nothing but the global step, a run resumed from a checkpoint and every worker of a
multi-node job compute the same curve. This module imports neither TensorFlow nor
Keras, so it is cheap to import (config validation uses `check`) and testable in plain Python.

Time is measured in global steps (optimizer updates). Durations are configured in epochs and turned into
steps with `epoch = step / steps_per_epoch` (a float) and `epochs_to_steps` (round to the nearest
step), the one rule config.to_steps uses too. The LR of step `s` is the LR used for the update that turns step `s` into `s + 1`.

A schedule is a warmup followed by a decay:

    lr(step) = warmup(step)   if step < warmup_steps
               decay(step)    otherwise

Decays are written in ABSOLUTE epochs/steps (a step decay at epochs 30/60/80 drops at those epochs
whatever the warmup length); cosine and polynomial run over the post-warmup span
[warmup_steps, total_steps] so they start exactly at `base_lr` when the warmup ends.

Warmups (WARMUPS):
  none      no warmup (warmup_steps = 0 whatever warmup_epochs says).
  gradual   Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv
            1706.02677), sec. 2.2: linear per step from `warmup_init_lr` to `base_lr`.
  stepping  `base_lr * (e + 1) / (W + 1)`: per epoch a staircase, constant within epoch e.
`warmup_granularity` (WARMUP_GRANULARITIES) says when the warmup LR changes: "step" (Goyal et al.;
stepping then follows its staircase's line), "epoch" (what a per-epoch LR callback does, as the
large-batch ImageNet study tfscale reruns did: gradual 0.05, 0.36, ..., 1.29, then 1.6; stepping its
staircase), or "auto": gradual per step, stepping per epoch.
  horovod   Horovod's `LearningRateWarmupCallback`: from `base_lr / num_replicas` to `base_lr`.
Decays (DECAYS): constant, step (He et al. 2016 / Goyal et al. 2017), cosine (Loshchilov & Hutter
2017, SGDR, without restarts), polynomial (MLPerf ResNet-50 LARS recipe), exponential (staircase).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Callable, Sequence

from tfscale.config.derived import epochs_to_steps
from tfscale.config.names import DECAYS, WARMUPS
from tfscale.config.rules import require_schedule_choice, unknown_schedule_choice

# Periods such as 2.4 or 0.1 epochs are not exact binary fractions, so `epoch / period` can land just
# below a whole number on the very step the period ends (3 / 10 / 0.1 == 2.9999999999999996). Steps are
# at least 1 / steps_per_epoch epochs apart, so this slack never moves a step that is genuinely before
# a boundary past it.
_BOUNDARY_SLACK = 1e-9


# --------------------------------------------------------------------------------------------------
# Warmups: lr for 0 <= step < warmup_steps
# --------------------------------------------------------------------------------------------------


def gradual_warmup_lr(step: int, *, init_lr: float, target_lr: float, warmup_steps: int) -> float:
    """Goyal et al. 2017 gradual warmup, interpolated per step.

        lr = init_lr + (target_lr - init_lr) * step / warmup_steps

    Step 0 uses `init_lr`; the first step after the warmup (step == warmup_steps) would use `target_lr`.
    """
    return init_lr + (target_lr - init_lr) * step / warmup_steps


def gradual_warmup_per_epoch_lr(step: int, *, init_lr: float, target_lr: float, steps_per_epoch: int,
                                warmup_epochs: float) -> float:
    """The gradual warmup set once per epoch (`warmup_granularity="epoch"`), as a per-epoch LR callback does:

        lr = init_lr + (target_lr - init_lr) * e / W,   e = floor(step / steps_per_epoch) < W

    From 0.05 (the 1-GPU LR) to 1.6 over W = 5 epochs: 0.05, 0.36, 0.67, 0.98, 1.29, then 1.6.
    """
    return init_lr + (target_lr - init_lr) * (step // steps_per_epoch) / warmup_epochs


def stepping_warmup_per_step_lr(step: int, *, target_lr: float, steps_per_epoch: int, warmup_epochs: float) -> float:
    """The stepping warmup's ramp taken per step (`warmup_granularity="step"`): its staircase's line,

        lr = target_lr * (1 + step / steps_per_epoch) / (W + 1)

    from target / (W + 1) at step 0 towards target; equal to the staircase at every epoch start.
    """
    return target_lr * (1 + step / steps_per_epoch) / (warmup_epochs + 1)


def stepping_warmup_lr(step: int, *, target_lr: float, steps_per_epoch: int, warmup_epochs: float) -> float:
    """Per-epoch staircase warmup: constant within an epoch, W + 1 equal increments up to target.

        e  = floor(step / steps_per_epoch)          (epoch index, 0-based)
        lr = target_lr * (e + 1) / (W + 1)          for e < W = warmup_epochs

    With target 1.6 and W = 5: 0.2667, 0.5333, 0.8, 1.0667, 1.3333, then 1.6 from epoch 5 on. This is
    what a warmup set once per epoch (e.g. on epoch begin) produces; it never starts from 0.
    """
    epoch_index = step // steps_per_epoch
    return target_lr * (epoch_index + 1) / (warmup_epochs + 1)


def horovod_warmup_lr(step: int, *, target_lr: float, num_replicas: int, warmup_steps: int) -> float:
    """Horovod's `LearningRateWarmupCallback` (horovod/_keras/callbacks.py,
    `LearningRateWarmupCallbackImpl`), from target_lr / size to target_lr, per batch:

        lr = target_lr / size * (epoch * (size - 1) / warmup_epochs + 1)

    where Horovod's `epoch` is `current_epoch + (batch + 1) / steps_per_epoch`: the callback adds one
    batch "to produce round numbers at the end of each epoch", so the LAST warmup batch reaches
    target_lr exactly and the first one is one batch above target_lr / size. In global steps
    (epoch = (step + 1) / steps_per_epoch) and with warmup_epochs * steps_per_epoch = warmup_steps:

        lr = target_lr / size * (1 + (size - 1) * (step + 1) / warmup_steps)

    Using the whole number `warmup_steps` (rather than warmup_epochs * steps_per_epoch) is identical
    for whole-step warmups and keeps the curve continuous otherwise. Horovod's optional momentum
    correction is not an LR and is not modelled here. With size == 1 this is constant target_lr.
    """
    return target_lr / num_replicas * (1 + (num_replicas - 1) * (step + 1) / warmup_steps)


# --------------------------------------------------------------------------------------------------
# Decays: lr for step >= warmup_steps, in absolute steps/epochs
# --------------------------------------------------------------------------------------------------


def constant_lr(step: int, *, base_lr: float) -> float:
    """lr = base_lr."""
    return base_lr


def step_decay_lr(step: int, *, steps_per_epoch: int, boundaries_epochs: Sequence[float],
                  lr_per_segment: Sequence[float]) -> float:
    """Piecewise-constant ("step") decay of He et al. 2016 / Goyal et al. 2017 (/10 at 30, 60, 80):

        lr = base_lr * decay_factor ** (number of boundaries b with b <= epoch),  epoch = step / spe

    `lr_per_segment[i]` is base_lr * decay_factor ** i, precomputed by `make_schedule`. A boundary
    takes effect on the first step whose epoch reaches it: step / spe is correctly rounded, so a step
    exactly on a decimal boundary (240 / 100 == 2.4) compares equal to it.
    """
    return lr_per_segment[bisect.bisect_right(boundaries_epochs, step / steps_per_epoch)]


def cosine_decay_lr(step: int, *, base_lr: float, end_lr: float, start_step: int, end_step: int) -> float:
    """Cosine annealing (Loshchilov & Hutter 2017, SGDR, one cycle, no restarts) over [start, end]:

        t  = clip((step - start_step) / (end_step - start_step), 0, 1)
        lr = end_lr + (base_lr - end_lr) * (1 + cos(pi * t)) / 2

    base_lr at start_step (end of warmup), end_lr at end_step (total_steps) and after it.
    """
    progress = min(1.0, max(0.0, (step - start_step) / (end_step - start_step)))
    return end_lr + (base_lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def polynomial_decay_lr(step: int, *, base_lr: float, end_lr: float, start_step: int, end_step: int,
                        power: float) -> float:
    """Polynomial decay of the MLPerf ResNet-50 LARS recipe (You et al. 2017, "Large Batch Training of
    Convolutional Networks"; power 2 in the reference), over the post-warmup span:

        t  = clip((step - start_step) / (end_step - start_step), 0, 1)
        lr = end_lr + (base_lr - end_lr) * (1 - t) ** power

    Variant: the MLPerf reference (mlcommons/training image_classification/tensorflow2/lars_util.py,
    `PolynomialDecayWithWarmup`, and its TF1 origin tensorflow/tpu models/official/resnet/lars_util.py)
    evaluates Keras `PolynomialDecay(decay_steps=train_steps - warmup_steps + 1, power=2.0)` at
    `step - warmup_steps` after a linear warmup from 0. We follow it (warmup: use `gradual` with
    warmup_init_lr=0; power: poly_power), except that our denominator is
    `total_steps - warmup_steps` without the "+ 1", so the LR reaches end_lr exactly at total_steps
    instead of one step after training ends (a 1-step difference, below 1e-4 relative for ImageNet).
    The reference's default end_lr is 1e-4; ours comes from config.schedule.end_lr.
    """
    progress = min(1.0, max(0.0, (step - start_step) / (end_step - start_step)))
    return end_lr + (base_lr - end_lr) * (1.0 - progress) ** power


def exponential_decay_lr(step: int, *, base_lr: float, steps_per_epoch: int, decay_factor: float,
                         every_epochs: float) -> float:
    """Staircase exponential decay (e.g. 0.97 every 2.4 epochs in the EfficientNet / MnasNet recipes):

        lr = base_lr * decay_factor ** floor(epoch / every_epochs),  epoch = step / steps_per_epoch
    """
    periods = math.floor(step / steps_per_epoch / every_epochs + _BOUNDARY_SLACK)
    return base_lr * decay_factor ** periods


# --------------------------------------------------------------------------------------------------
# Putting a warmup and a decay together
# --------------------------------------------------------------------------------------------------


def warmup_steps_of(schedule_cfg, *, steps_per_epoch: int) -> int:
    """Number of warmup steps: round(warmup_epochs * steps_per_epoch), or 0 for warmup 'none'."""
    if schedule_cfg.warmup == "none":
        return 0
    return max(0, epochs_to_steps(schedule_cfg.warmup_epochs, steps_per_epoch))


def _warmup_fn(schedule_cfg, *, base_lr: float, steps_per_epoch: int, warmup_steps: int,
               num_replicas: int) -> Callable[[int], float] | None:
    name = schedule_cfg.warmup
    granularity = getattr(schedule_cfg, "warmup_granularity", "auto")
    per_epoch = granularity == "epoch" or (granularity == "auto" and name == "stepping")
    per_epoch_args = dict(target_lr=base_lr, steps_per_epoch=steps_per_epoch,
                          warmup_epochs=float(schedule_cfg.warmup_epochs))
    if name == "none" or warmup_steps == 0:
        return None
    if name == "gradual" and per_epoch:
        return functools.partial(gradual_warmup_per_epoch_lr, init_lr=float(schedule_cfg.warmup_init_lr),
                                 **per_epoch_args)
    if name == "gradual":
        return functools.partial(gradual_warmup_lr, init_lr=float(schedule_cfg.warmup_init_lr),
                                 target_lr=base_lr, warmup_steps=warmup_steps)
    if name == "stepping":
        return functools.partial(stepping_warmup_lr if per_epoch else stepping_warmup_per_step_lr, **per_epoch_args)
    if name == "horovod":
        return functools.partial(horovod_warmup_lr, target_lr=base_lr, num_replicas=num_replicas,
                                 warmup_steps=warmup_steps)
    raise ValueError(unknown_schedule_choice("warmup", name, WARMUPS))


def _decay_fn(schedule_cfg, *, base_lr: float, steps_per_epoch: int, warmup_steps: int,
              total_steps: int) -> Callable[[int], float]:
    name = schedule_cfg.decay
    # Cosine/polynomial span the post-warmup steps; at least 1 so a degenerate span cannot divide by 0.
    span = {"start_step": warmup_steps, "end_step": max(total_steps, warmup_steps + 1)}
    if name == "constant":
        return functools.partial(constant_lr, base_lr=base_lr)
    if name == "step":
        boundaries = tuple(float(b) for b in schedule_cfg.decay_epochs)
        factor = float(schedule_cfg.decay_factor)
        lr_per_segment = tuple(base_lr * factor**i for i in range(len(boundaries) + 1))
        return functools.partial(step_decay_lr, steps_per_epoch=steps_per_epoch,
                                 boundaries_epochs=boundaries, lr_per_segment=lr_per_segment)
    if name == "cosine":
        return functools.partial(cosine_decay_lr, base_lr=base_lr, end_lr=float(schedule_cfg.end_lr), **span)
    if name == "polynomial":
        return functools.partial(polynomial_decay_lr, base_lr=base_lr, end_lr=float(schedule_cfg.end_lr),
                                 power=float(schedule_cfg.poly_power), **span)
    if name == "exponential":
        return functools.partial(exponential_decay_lr, base_lr=base_lr, steps_per_epoch=steps_per_epoch,
                                 decay_factor=float(schedule_cfg.decay_factor),
                                 every_epochs=float(schedule_cfg.exp_decay_every_epochs))
    raise ValueError(unknown_schedule_choice("decay", name, DECAYS))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """config.schedule for one run of `total_steps` steps: the LR of a global step, as a function and a table."""

    lr_at: Callable[[int], float]
    total_steps: int

    def __call__(self, step: int) -> float:
        return self.lr_at(step)

    def table(self) -> list[float]:
        """The LR of every step of the run, in step order: what the loop indexes with the step counter."""
        return [self.lr_at(step) for step in range(self.total_steps)]


def make_schedule(schedule_cfg, *, base_lr: float, steps_per_epoch: int, total_steps: int,
                  num_replicas: int = 1) -> Schedule:
    """Returns the `Schedule` (`lr(global_step) -> float`) of `schedule_cfg` (config.schedule).

    base_lr: the peak LR after warmup (usually config.optim.lr = lr_per_256 * global_batch_size / 256).
    steps_per_epoch, total_steps: from `config.to_steps` (train batches drop the remainder).
    num_replicas: workers x devices; only the 'horovod' warmup uses it (it starts at base_lr / size).

    Everything that does not depend on the step is resolved here, so the returned function is a couple
    of float operations per call. Run `check()` first (validation.validate does) for readable errors about
    epochs; this function only rejects what it cannot compute with.
    """
    if steps_per_epoch < 1 or total_steps < 1 or num_replicas < 1:
        raise ValueError(
            f"make_schedule needs steps_per_epoch, total_steps and num_replicas >= 1, got "
            f"steps_per_epoch={steps_per_epoch}, total_steps={total_steps}, num_replicas={num_replicas}"
        )
    require_schedule_choice("warmup", schedule_cfg.warmup, WARMUPS)
    require_schedule_choice("decay", schedule_cfg.decay, DECAYS)
    base_lr = float(base_lr)
    steps_per_epoch = int(steps_per_epoch)
    warmup_steps = warmup_steps_of(schedule_cfg, steps_per_epoch=steps_per_epoch)
    warmup = _warmup_fn(schedule_cfg, base_lr=base_lr, steps_per_epoch=steps_per_epoch,
                        warmup_steps=warmup_steps, num_replicas=int(num_replicas))
    decay = _decay_fn(schedule_cfg, base_lr=base_lr, steps_per_epoch=steps_per_epoch,
                      warmup_steps=warmup_steps, total_steps=int(total_steps))

    def lr_at(step: int) -> float:
        step = int(step)  # accepts numpy / eager-tensor scalars; the arithmetic below stays in Python
        if step < 0:
            raise ValueError(f"the global step must be >= 0, got {step}")
        if warmup is not None and step < warmup_steps:
            return float(warmup(step))
        return float(decay(step))

    return Schedule(lr_at, int(total_steps))
