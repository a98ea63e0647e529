"""Asynchronous checkpoints (checkpoint.async_save): a save returns while its files are written, and what
it writes is the state at the save, whatever the steps after it change.

kill -9 during an asynchronous write, preemption and a full disk are walked through with real runs in
tests/test_reliability.py (the default saves asynchronously).
"""

import glob
import os
import subprocess
import sys
import tempfile
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import load_config, small_file_system

from tfscale import errors
from tfscale.cluster import distribute
from tfscale.training import checkpoints
from tfscale.workdir import layout

WIDTH = 1024  # 4 MiB of weights: a write that is still running when save() returns


def build(cluster):
    with cluster.strategy.scope():
        model = keras.Sequential([keras.Input([WIDTH]), keras.layers.Dense(WIDTH), keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def weights(model):
    return [w.copy() for w in model.get_weights()]


@pytest.mark.parametrize("async_save", [True, False])
def test_each_checkpoint_holds_the_state_of_its_save(tmp_path, async_save):
    cluster = distribute.setup(load_config("smoke").distribute)
    model, optimizer = build(cluster)
    ckpts = checkpoints.Checkpoints(str(tmp_path), cluster, model=model, optimizer=optimizer, max_to_keep=5,
                                    async_save=async_save)
    assert ckpts.restore_or_init(lambda: None) == 0
    saved = {}
    for step in (1, 2, 3):  # the second asynchronous save is the one Keras' host copy used to fail
        model.set_weights([np.full_like(w, step) for w in model.get_weights()])
        ckpts.step.assign(step)
        ckpts.save(step)
        saved[step] = weights(model)
        # The next steps change the weights while the files may still be written.
        model.set_weights([np.full_like(w, -step) for w in model.get_weights()])
    ckpts.save(3, wait=True)  # already saved: only waits
    ckpts.close()

    listed = checkpoints.listed_checkpoints(layout.checkpoints(str(tmp_path)))
    assert [os.path.basename(p) for p in listed] == ["ckpt-3", "ckpt-2", "ckpt-1"]
    for prefix, step in zip(listed, (3, 2, 1)):
        fresh, _ = build(cluster)
        _, restored_step = checkpoints.restore_model(str(tmp_path), fresh, prefix)
        assert restored_step == step
        for got, want in zip(fresh.get_weights(), saved[step]):
            np.testing.assert_array_equal(got, want)


def test_a_failed_asynchronous_write_is_named_by_the_next_wait(tmp_path):
    """The disk fills while ckpt-2 is written beside the steps: the wait names ckpt-2 (not the next save), removes
    its partial files and leaves ckpt-1 listed."""
    cluster = distribute.setup(load_config("smoke").distribute)
    model, optimizer = build(cluster)
    with small_file_system(tmp_path / "disk", "12m") as disk:  # ckpt-1's 8.4 MB fit, ckpt-2's do not
        ckpts = checkpoints.Checkpoints(str(disk), cluster, model=model, optimizer=optimizer, max_to_keep=5,
                                        async_save=True)
        ckpts.restore_or_init(lambda: None)
        ckpts.save(1, wait=True)
        ckpts.save(2)
        with pytest.raises(errors.WriteError, match=r"could not write .*/checkpoints/ckpt-2: .*No space left on device"):
            ckpts.wait()
        directory = layout.checkpoints(str(disk))
        assert [os.path.basename(p) for p in checkpoints.listed_checkpoints(directory)] == ["ckpt-1"]
        assert not [name for name in os.listdir(directory) if name.startswith("ckpt-2")]


def test_a_non_chief_worker_keeps_one_scratch_checkpoint_and_a_gone_workers_scratch_is_removed(tmp_path, monkeypatch):
    """Collective saving makes every MWMS worker write; the others' copies go to $TMPDIR (RAM on many nodes)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tempfile.gettempdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"{checkpoints.SCRATCH_PREFIX}{gone.pid}_abc"  # a killed worker's, never closed
    stale.mkdir()
    (stale / "ckpt-7.index").write_text("left behind")
    running = tmp_path / f"{checkpoints.SCRATCH_PREFIX}{os.getppid()}_def"  # a live process's: kept
    running.mkdir()
    cluster = distribute.setup(load_config("smoke").distribute)
    worker = types.SimpleNamespace(strategy=cluster.strategy, is_chief=False, saving_is_collective=True,
                                   broadcast_from_chief=lambda state: None)
    model, optimizer = build(cluster)
    workdir = tmp_path / "work"
    ckpts = checkpoints.Checkpoints(str(workdir), worker, model=model, optimizer=optimizer, max_to_keep=5)
    assert not stale.exists() and running.exists()
    (scratch,) = glob.glob(str(tmp_path / f"{checkpoints.SCRATCH_PREFIX}{os.getpid()}_*"))
    for step in (1, 2, 3):
        ckpts.step.assign(step)
        ckpts.save(step)
    assert [os.path.basename(p) for p in checkpoints.listed_checkpoints(scratch)] == ["ckpt-3"]
    assert sorted(os.listdir(scratch)) == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index"]
    assert not workdir.exists()  # the workdir's checkpoints are the chief's
    ckpts.close()
    assert not os.path.exists(scratch)


HOST_COPY_PLACEMENT = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from tensorflow.python.util import object_identity  # the map TensorFlow's asynchronous checkpoint passes
from tfscale.training import checkpoints
checkpoints._fix_keras_async_copy()
with tf.device("/CPU:1"):  # stands in for the GPU a variable lives on and the save's device scope
    variable = keras.Variable(tf.ones([4]))
    object_map = object_identity.ObjectIdentityDictionary()
    variable._copy_trackable_to_cpu(object_map)
    variable._copy_trackable_to_cpu(object_map)  # the second save refreshes the same copies
print(object_map[variable.value].device)
print(object_map[variable].device)
"""


def test_asynchronous_saving_keeps_the_keras_variables_host_copy_on_the_host():
    """TensorFlow puts its copy on CPU:0 of the variable's task; the Keras wrapper's copy goes beside it, not to the
    device scope the save runs under (a second logical CPU stands in for the GPU)."""
    result = subprocess.run([sys.executable, "-c", HOST_COPY_PLACEMENT], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    tensorflows, keras_ = result.stdout.split()
    assert tensorflows.endswith("/device:CPU:0") and keras_ == tensorflows, result.stdout
