"""The one owner of a run's checkpoints and of its step counter.

`Checkpoints` restores the workdir's latest checkpoint or initialises a fresh run, makes every worker
start from the chief's state, saves periodically and on preemption, and counts global steps: the
`step` variable it saves is the single step count of a run (the train loop advances it on device;
callbacks receive it as `logs["global_step"]`). `optimizer.iterations` is not used as a step count: it
stops when float16 loss scaling skips an update.

Where each worker writes: the chief to `workdir/checkpoints`. Under tf.distribute strategies saving is
a collective, so the other workers must save at the same moment, into a scratch directory that is
discarded at the end. A Horovod rank saves (or not) on its own: only the chief does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

import tensorflow as tf
from absl import logging


class Checkpoints:
    """Restore-or-init, periodic and final saves, and the step counter of one run."""

    def __init__(self, workdir: str, cluster, *, model, optimizer, max_to_keep: int, extra: dict | None = None):
        """`extra`: more variables to save by name (local SGD's sync counts)."""
        self.directory = os.path.join(workdir, "checkpoints")
        self.cluster = cluster
        with cluster.strategy.scope():
            # Keeps its checkpoint key "global_step", so checkpoints of earlier runs restore.
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        extra = extra or {}
        self._state = [*model.variables, *optimizer.variables, self.step, *extra.values()]
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, global_step=self.step, **extra)
        self._manager = self._make_manager(max_to_keep)
        self._last_saved_step = None

    def _make_manager(self, max_to_keep: int) -> tf.train.CheckpointManager | None:
        """The chief's manager of workdir/checkpoints, a scratch one (collective saving), or None."""
        if self.cluster.is_chief:
            directory = self.directory
        elif self.cluster.saving_is_collective:
            directory = tempfile.mkdtemp(prefix="tfscale_ckpt_")
        else:
            return None
        return tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=max_to_keep)

    def restore_or_init(self, init: Callable[[], object]) -> int:
        """Restores the chief's latest checkpoint, or calls `init()` for a fresh run; returns the start step.

        Every worker restores from the chief's directory (the workdir is on a shared file system).
        Afterwards all workers hold the chief's state: Horovod ranks each initialised on their own.
        """
        latest = tf.train.latest_checkpoint(self.directory)
        if latest:
            self._checkpoint.restore(latest).assert_existing_objects_matched()
            self._last_saved_step = int(self.step.numpy())  # not written again by the first save
            logging.info("resumed from %s at step %d", latest, self._last_saved_step)
        else:
            init()
        self.cluster.broadcast_from_chief(self._state)
        return int(self.step.numpy())

    def save(self, global_step: int) -> None:
        """Saves `global_step` unless it is already saved; every worker calls it (it may be a collective)."""
        if self._manager is not None and global_step != self._last_saved_step:
            self._manager.save(checkpoint_number=global_step)
            self._last_saved_step = global_step
            logging.info("saved checkpoint at step %d to %s", global_step, self._manager.directory)

    def close(self) -> None:
        """Discards this worker's scratch directory (only the chief's checkpoints are kept)."""
        if self._manager is not None and not self.cluster.is_chief:
            shutil.rmtree(self._manager.directory, ignore_errors=True)
