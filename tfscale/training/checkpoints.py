"""The one owner of a run's checkpoints and of its step counter.

`Checkpoints` restores the workdir's latest checkpoint or initialises a fresh run, makes every worker
start from the chief's state, saves periodically and on preemption, and counts global steps: the
`step` variable it saves is the single step count of a run (the train loop advances it on device;
callbacks receive it as `logs["global_step"]`). `optimizer.iterations` is not used as a step count: it
stops when float16 loss scaling skips an update.

Where each worker writes: the chief to `workdir/checkpoints`. Under tf.distribute strategies saving is
a collective, so the other workers must save at the same moment, into a scratch directory
($TMPDIR/tfscale_ckpt_<pid>_*, one checkpoint kept: on many nodes /tmp is memory) that is discarded at the end;
one that a killed worker left behind (its pid gone) is removed when the next run starts. A Horovod rank saves
(or not) on its own: only the chief does.

Saving is asynchronous by default (`checkpoint.async_save`): TensorFlow copies the state to host memory,
the step goes on, and a thread writes the files (`tf.train.CheckpointOptions(enable_async=True)`). A save
waits for the previous write to end first, and the run's last save (at its end, on preemption) waits for
its own: a run never exits with a checkpoint half written.

What a fault leaves: TensorFlow writes a checkpoint's files first and lists it in the `checkpoint`
state file last (atomically), so a save killed part-way leaves the earlier checkpoints listed and
usable. A listed checkpoint that cannot be read (a file lost or cut short on the file system) is
skipped with a warning and the next older one restored; when none can be, the run stops naming
each file and why, never starting over in silence. A save that fails (disk full, quota) removes
its partial files and raises `errors.WriteError` naming the directory and the free space (an
asynchronous write's failure is raised by the next save or wait).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Callable

import tensorflow as tf
from absl import logging

from tfscale import compat, io
from tfscale.errors import CheckpointError
from tfscale.workdir import layout


class Checkpoints:
    """Restore-or-init, periodic and final saves, and the step counter of one run."""

    def __init__(self, workdir: str, cluster, *, model, optimizer, max_to_keep: int, async_save: bool = False,
                 extra: dict | None = None):
        """`async_save`: writes go on beside training; `extra`: more variables to save by name (local SGD's sync counts)."""
        self.directory = layout.checkpoints(workdir)
        self.cluster = cluster
        with cluster.strategy.scope():
            # Keeps its checkpoint key "global_step", so checkpoints of earlier runs restore.
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        extra = extra or {}
        self._state = [*model.variables, *optimizer.variables, self.step, *extra.values()]
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, global_step=self.step, **extra)
        self._manager = self._make_manager(max_to_keep)
        self._last_saved_step = None
        if async_save:
            _fix_keras_async_copy()
        self._options = tf.train.CheckpointOptions(enable_async=async_save)
        self._writing_step = None  # an asynchronous write not yet waited for

    def _make_manager(self, max_to_keep: int) -> tf.train.CheckpointManager | None:
        """The chief's manager of workdir/checkpoints, a scratch one (collective saving: one kept), or None."""
        if self.cluster.is_chief:
            return tf.train.CheckpointManager(self._checkpoint, self.directory, max_to_keep=max_to_keep)
        if self.cluster.saving_is_collective:
            for stale in remove_stale_scratch():
                logging.info("removed %s, left by a worker that is gone", stale)
            directory = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}_")
            return tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=1)
        return None

    def restore_or_init(self, init: Callable[[], object]) -> int:
        """Restores the chief's latest checkpoint, or calls `init()` for a fresh run; returns the start step.

        Every worker restores from the chief's directory (the workdir is on a shared file system).
        Afterwards all workers hold the chief's state: Horovod ranks each initialised on their own.
        """
        restored = self._restore_newest_usable()
        if restored:
            self._last_saved_step = int(self.step.numpy())  # not written again by the first save
            logging.info("resumed from %s at step %d", restored, self._last_saved_step)
        else:
            init()
        self.cluster.broadcast_from_chief(self._state)
        return int(self.step.numpy())

    def _restore_newest_usable(self) -> str | None:
        """Restores the newest checkpoint that reads back whole; its prefix, or None when there is none."""
        return restore_newest_usable(
            self.directory, lambda prefix: self._checkpoint.restore(prefix).assert_existing_objects_matched())

    def save(self, global_step: int, *, wait: bool = False) -> None:
        """Saves `global_step` unless it is already saved; every worker calls it (it may be a collective).
        With `checkpoint.async_save` the files are written beside the next steps; `wait` returns only once
        they are (a run's last save)."""
        if self._manager is not None and global_step != self._last_saved_step:
            self.wait()  # TensorFlow would wait for it too, but its failure is to be named as its own
            try:
                self._manager.save(checkpoint_number=global_step, options=self._options)
            except (tf.errors.OpError, OSError) as err:
                self._raise_write_error(global_step, err)
            self._last_saved_step = global_step
            if self._options.experimental_enable_async_checkpoint:
                self._writing_step = global_step
                logging.info("writing checkpoint of step %d to %s", global_step, self._manager.directory)
            else:
                logging.info("saved checkpoint at step %d to %s", global_step, self._manager.directory)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Returns once an asynchronous write has ended; raises `errors.WriteError` if it failed."""
        if self._writing_step is None:
            return
        step, self._writing_step = self._writing_step, None
        try:
            self._checkpoint.sync()
            _raise_async_error(self._checkpoint)
        except (tf.errors.OpError, OSError) as err:
            self._raise_write_error(step, err)
        prefix = os.path.join(self._manager.directory, f"ckpt-{step}")
        if prefix not in listed_checkpoints(self._manager.directory):  # written, then listed: or it failed
            self._raise_write_error(step, OSError(f"the asynchronous write of {prefix} ended without listing it"))
        logging.info("saved checkpoint at step %d to %s", step, self._manager.directory)

    def _raise_write_error(self, step: int, err: Exception):
        self._last_saved_step = None
        _remove_partial_save(self._manager.directory, step)
        raise io.write_error(os.path.join(self._manager.directory, f"ckpt-{step}"), err) from err

    def close(self) -> None:
        """Waits for a write still running, then discards this worker's scratch directory (only the chief's
        checkpoints are kept)."""
        self.wait()
        if self._manager is not None and not self.cluster.is_chief:
            shutil.rmtree(self._manager.directory, ignore_errors=True)


SCRATCH_PREFIX = "tfscale_ckpt_"  # + the writing worker's pid + "_" + mkdtemp's suffix, in tempfile.gettempdir()


def remove_stale_scratch(directory: str | None = None) -> list[str]:
    """Removes this user's scratch checkpoint directories in `directory` (default: the temporary directory) whose
    worker no longer runs (a kill -9 skips `close`); returns them. A directory whose pid is alive is kept."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for path in glob.glob(os.path.join(directory, f"{SCRATCH_PREFIX}*_*")):
        pid = os.path.basename(path)[len(SCRATCH_PREFIX):].split("_")[0]
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:  # the directory vanished, or the pid is another user's live process
            continue
    return removed


def _raise_async_error(checkpoint: tf.train.Checkpoint) -> None:
    """Raises what the asynchronous write thread failed with. `Checkpoint.sync()` waits for the thread but
    keeps its error for the next save (tensorflow/python/checkpoint/async_checkpoint_helper.py: `sync` joins
    the queue only; `_check_async_thread_error` raises, TF 2.21), which would then be named as that save's."""
    helper = getattr(checkpoint, "_async_checkpointer_impl", None)
    check = getattr(helper, "_check_async_thread_error", None)
    if check is not None:
        check()


def _fix_keras_async_copy() -> None:
    """Keras variables copied to host memory by every asynchronous save, not only by the first.

    TensorFlow's asynchronous checkpoint copies each saved object to host memory in a tf.function, on
    every save into the copies the first one made (tensorflow/python/checkpoint/async_checkpoint_helper.py,
    `_copy_to_cpu`, TF 2.21). Keras 3.15's TensorFlow variable makes a new tf.Variable there on every
    call (keras/src/backend/tensorflow/core.py line 107, `_copy_trackable_to_cpu`), so the second
    asynchronous save fails: "tf.function only supports singleton tf.Variables created on the first
    call" (measured). tf.Variable's own method assigns to the copy it made; this makes Keras' do the same.
    """
    from keras.src.backend.tensorflow import core  # the Keras variable class of the TensorFlow backend

    compat.require("_copy_trackable_to_cpu" in vars(core.Variable), "keras",  # its own, which the fix replaces
                   "keras.src.backend.tensorflow.core.Variable._copy_trackable_to_cpu",
                   "tfscale's asynchronous checkpoints")
    if getattr(core.Variable._copy_trackable_to_cpu, "copies_once", False):
        return

    def copy_trackable_to_cpu(self, object_map):
        self.value._copy_trackable_to_cpu(object_map)  # the wrapped tf.Variable's copy, made or refreshed
        if self in object_map:
            object_map[self].assign(object_map[self.value])
        else:
            # Beside TensorFlow's host copy: the save's tf.function runs under the accelerator's device scope, where
            # a second copy of the whole state would take GPU memory.
            with tf.device(object_map[self.value].device):
                object_map[self] = tf.Variable(object_map[self.value])

    copy_trackable_to_cpu.copies_once = True
    core.Variable._copy_trackable_to_cpu = copy_trackable_to_cpu


def restore_newest_usable(directory: str, restore: Callable[[str], object]) -> str | None:
    """Calls `restore(prefix)` on the checkpoints of `directory`, newest first, until one reads back whole;
    returns its prefix, None when there is none, and raises CheckpointError naming each and why when
    none can be read (a file lost or cut short on the file system): never an older state in silence."""
    failures = []
    for prefix in listed_checkpoints(directory):
        try:
            restore(prefix)
            return prefix
        except Exception as err:  # noqa: BLE001 - TensorFlow's reader raises OpError, ValueError, IndexError...
            reason = " ".join(str(err).split())[:300]
            logging.warning("skipping checkpoint %s: it cannot be restored (%s)", prefix, reason)
            failures.append(f"{prefix} ({reason})")
    if failures:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: " + "; ".join(failures) + ". Nothing was deleted; "
            "restore the files, or move the directory away to train from scratch"
        )
    return None


def restore_model(workdir: str, model, checkpoint: str | None = None, optimizer=None) -> tuple[str, int]:
    """`model`'s weights and the global step from `checkpoint` (a prefix `W/checkpoints/ckpt-N`), or from
    the newest checkpoint of `workdir` that reads back whole, as a resumed run would; (prefix, step).
    The checkpoint's optimizer is left out (export and init_from need only the model), unless `optimizer` is
    given (built: the evaluator's EMA lives in its slots)."""
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    state = tf.train.Checkpoint(model=model, global_step=step, **({"optimizer": optimizer} if optimizer else {}))

    def restore(prefix: str) -> None:
        state.restore(prefix).assert_existing_objects_matched().expect_partial()

    if checkpoint is not None:
        if not tf.io.gfile.exists(checkpoint + ".index"):
            raise FileNotFoundError(f"checkpoint {checkpoint} does not exist (no {checkpoint}.index)")
        restore(checkpoint)
        return checkpoint, int(step.numpy())
    directory = layout.checkpoints(workdir)
    prefix = restore_newest_usable(directory, restore)
    if prefix is None:
        raise FileNotFoundError(f"no checkpoint in {directory}: has the run in {workdir} saved one yet?")
    return prefix, int(step.numpy())


def listed_checkpoints(directory: str) -> list[str]:
    """Checkpoint prefixes in `directory`, newest first: those the state file lists, or, when that file
    is unreadable, every `ckpt-N` with an index file."""
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError) as err:  # a state file that is not a CheckpointState
        logging.warning("checkpoint state file in %s unreadable (%s); looking for ckpt-N files", directory, err)
        state = None
        found = glob.glob(os.path.join(glob.escape(directory), "ckpt-*.index"))
        return sorted((path[: -len(".index")] for path in found), key=_checkpoint_number, reverse=True)
    if state is None:
        return []
    return list(reversed(state.all_model_checkpoint_paths or [state.model_checkpoint_path]))


def resume_hint(workdir: str) -> str:
    """Where a rerun of the run in `workdir` resumes: its newest listed checkpoint, or the start."""
    listed = listed_checkpoints(layout.checkpoints(workdir))
    if not listed:
        return f"No checkpoint was saved yet in {workdir}: a rerun starts from step 0."
    return (f"The last checkpoint is step {_checkpoint_number(listed[0])} ({listed[0]}): rerun the same command "
            "to resume from it.")


def _checkpoint_number(prefix: str) -> int:
    match = re.search(r"-(\d+)$", prefix)
    return int(match.group(1)) if match else -1


def _remove_partial_save(directory: str, number: int) -> None:
    """Deletes what a failed save of `ckpt-number` left (never a listed, complete checkpoint)."""
    prefix = os.path.join(directory, f"ckpt-{number}")
    if any(os.path.basename(p) == os.path.basename(prefix) for p in listed_checkpoints(directory)):
        return
    for path in glob.glob(glob.escape(prefix) + "[._]*"):
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else io.remove_quietly(path)
