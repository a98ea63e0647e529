"""Values derived from a config: the step counts of a run (the only place epochs become steps), the
eval batch and the profiler window. Pure Python; validation and the run read them alike.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from tfscale.config.rules import num_copies
from tfscale.errors import ConfigError


def epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    """The whole number of global steps nearest `epochs` epochs: round(epochs * steps_per_epoch).

    The one rounding rule: `to_steps`, the warmups and the Horovod-porting callback all use it.
    """
    return round(epochs * steps_per_epoch)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The step counts of a run; the only place epochs become steps."""

    steps_per_epoch: int
    train_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    eval_global_batch_size: int
    eval_steps: int
    eval_batch_padding: int  # examples the last eval batch is padded with (masked out of metrics)


def eval_global_batch_size(data_cfg: ml_collections.ConfigDict) -> int:
    """The eval batch: `data.eval_global_batch_size`, or the training batch when it is -1."""
    if data_cfg.eval_global_batch_size == -1:
        return data_cfg.global_batch_size
    return data_cfg.eval_global_batch_size


def to_steps(cfg: ml_collections.ConfigDict, num_workers: int = 1) -> Steps:
    """Turns the epoch durations of `cfg` into step counts (train batches drop the remainder).

    `train.overlap_epochs` (the data-assignment study's accounting): with C copies of every example,
    `train.epochs` = E passes over the data take ceil(E / C) overlap epochs, in each of which every
    worker passes its C*N/M examples once (C*N/B steps), and eval comes every ceil(N/B) steps.
    """
    steps_per_epoch = cfg.data.num_train_examples // cfg.data.global_batch_size

    def at_least_one_step(epochs: float) -> int:
        return max(1, epochs_to_steps(epochs, steps_per_epoch))

    train_steps, eval_every_steps = at_least_one_step(cfg.train.epochs), at_least_one_step(cfg.train.eval_every_epochs)
    if cfg.train.overlap_epochs:
        copies = num_copies(cfg.data.assignment, cfg.data.copies, num_workers)
        steps_per_overlap_epoch = copies * cfg.data.num_train_examples // cfg.data.global_batch_size
        train_steps = math.ceil(cfg.train.epochs / copies) * steps_per_overlap_epoch
        eval_every_steps = max(1, round(cfg.train.eval_every_epochs
                                        * math.ceil(cfg.data.num_train_examples / cfg.data.global_batch_size)))

    eval_batch = eval_global_batch_size(cfg.data)
    full_eval_steps = math.ceil(cfg.data.num_eval_examples / eval_batch)
    eval_steps = full_eval_steps if cfg.train.eval_steps < 0 else min(cfg.train.eval_steps, full_eval_steps)
    padding = full_eval_steps * eval_batch - cfg.data.num_eval_examples
    return Steps(
        steps_per_epoch=steps_per_epoch,
        train_steps=train_steps,
        eval_every_steps=eval_every_steps,
        checkpoint_every_steps=at_least_one_step(cfg.checkpoint.every_epochs),
        eval_global_batch_size=eval_batch,
        eval_steps=eval_steps,
        eval_batch_padding=padding if eval_steps == full_eval_steps else 0,
    )


def profile_window(profile_steps: str) -> tuple[int, int] | None:
    """`config.profile_steps` "START,END" -> (START, END) global steps, or None when empty."""
    if not profile_steps:
        return None
    parts = str(profile_steps).split(",")
    try:
        first, last = (int(p) for p in parts)
    except ValueError:
        first = last = 0
    if len(parts) != 2 or not 1 <= first <= last:
        raise ConfigError(
            f"config.profile_steps={profile_steps!r} must be 'START,END' with 1 <= START <= END (global steps), e.g. '10,20'"
        )
    return first, last

