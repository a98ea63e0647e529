"""Steps per loop and gradient accumulation: the fast paths compute what the plain step computes."""

import contextlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, checkpoint_values, frozen_bn_model_and_optimizer, load_config, read_jsonl, stop_at_step

from tfscale import config as tfs_config
from tfscale.cluster import distribute
from tfscale.cluster.collectives import HorovodCollectives
from tfscale.config import validation
from tfscale.data.input import pipeline
from tfscale.launch import launch
from tfscale.training import controller, engine, local_sgd, train
from tfscale.workdir import layout


class RecordSteps(keras.callbacks.Callback):
    """What a user's callback sees: (global_step, loss) at every batch end, and the steps epochs end at."""

    def __init__(self):
        super().__init__()
        self.batch_ends, self.epoch_ends = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends.append((batch, int(logs["global_step"]), logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends.append(epoch)


@contextlib.contextmanager
def autograph_conversions():
    """The names of the functions AutoGraph converts inside the block. Its entry point for every conversion is
    private: TensorFlow 2.21, tensorflow/python/autograph/impl/api.py `_convert_actual`."""
    from tensorflow.python.autograph.impl import api

    converted, convert = [], api._convert_actual

    def counting(entity, program_ctx):
        converted.append(f"{getattr(entity, '__module__', '?')}.{getattr(entity, '__qualname__', repr(entity))}")
        return convert(entity, program_ctx)

    api._convert_actual = counting
    try:
        yield converted
    finally:
        api._convert_actual = convert


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """The smoke recipe with 1 and with 10 steps per loop; logs every 20 steps, so loops of 10 never
    end at a log row by accident of the log period. "autograph": what AutoGraph converted in the first run."""
    runs = {}
    for steps_per_loop in (1, 10):
        workdir = str(tmp_path_factory.mktemp(f"loop{steps_per_loop}"))
        recorder = RecordSteps()
        cfg = load_config("smoke", f"--config.train.steps_per_loop={steps_per_loop}", "--config.train.log_every_steps=20")
        with autograph_conversions() as converted:
            summary = train.train_and_evaluate(cfg, workdir, extra_callbacks=[recorder])
        runs[steps_per_loop] = workdir, summary, recorder
        runs.setdefault("autograph", converted)
    return runs


@pytest.mark.slow
def test_a_run_traces_its_steps_eval_and_input_without_autograph(loop_runs):
    """The training loop, the eval step and the input pipeline's functions are traced as written
    (docs/training.md "Steps per loop"): AutoGraph converts none of them, nor anything of tfscale they call.
    Converting them cost every process ~0.7 s of CPU before its first step, ~1.5 s with a TFRecord pipeline.
    (TensorFlow's asynchronous checkpoint converts its own host copy, AsyncCheckpointHelper._copy_to_cpu.)"""
    converted = loop_runs["autograph"]
    assert "tensorflow.python.checkpoint.async_checkpoint_helper.AsyncCheckpointHelper._copy_to_cpu" in converted
    assert [name for name in converted if name.startswith("tfscale.")] == []


@pytest.mark.slow
def test_steps_per_loop_10_is_bit_identical_to_1(loop_runs):
    (one, one_summary, _), (ten, ten_summary, _) = loop_runs[1], loop_runs[10]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "images_per_sec")} for r in rows]  # noqa: E731
    assert strip(read_jsonl(os.path.join(ten, layout.METRICS))) == strip(read_jsonl(os.path.join(one, layout.METRICS)))  # losses, LRs, eval metrics: exactly equal
    ones, tens = checkpoint_values(one), checkpoint_values(ten)
    assert ones.keys() == tens.keys()
    for key in ones:
        np.testing.assert_array_equal(tens[key], ones[key], err_msg=key)
    assert ten_summary["eval_top1"] == one_summary["eval_top1"] and ten_summary["steps"] == 60


def test_callbacks_see_every_step_with_its_own_loss(loop_runs):
    (_, _, one), (_, _, ten) = loop_runs[1], loop_runs[10]
    assert [s for _, s, _ in ten.batch_ends] == list(range(1, 61))
    assert ten.batch_ends == one.batch_ends  # (batch in epoch, global step, loss) of every step
    assert len({loss for _, _, loss in ten.batch_ends}) > 50  # the losses are each step's, not a loop's last
    assert ten.epoch_ends == one.epoch_ends == [0, 1, 2]


def test_learning_rate_changes_every_step_inside_a_loop(loop_runs):
    # Warmup over the first 10 steps (0.5 epochs of 20 steps): lr(s) = 0.1 * s / 10. With loops of 10 steps
    # the host sets nothing between steps 1..9; the updates still used 0.01, 0.02, ... (bit-identity above
    # proves the weights saw them), and the row of step 20 logs lr(19) on the cosine.
    rows = {r["step"]: r for r in read_jsonl(os.path.join(loop_runs[10][0], layout.METRICS)) if "lr" in r}
    assert rows[20]["lr"] == pytest.approx(0.05 * (1 + np.cos(np.pi * 9 / 50)), rel=1e-6)


@pytest.mark.slow
def test_reduce_lr_on_plateau_scales_the_schedule_in_the_compiled_loop_and_a_resumed_run_keeps_it(tmp_path):
    """Keras' ReduceLROnPlateau, watching the eval loss, halves the LR at the end of epoch 1 (nothing improves
    by 100): the loop's later steps run at half of config.schedule, the step decay at step 50 included, and
    a rerun after a stop at step 50 goes on at that half without the callback."""
    overrides = ("--config.train.steps_per_loop=10", "--config.train.eval_every_epochs=1",
                 "--config.schedule.warmup=none", "--config.schedule.decay=step", "--config.schedule.decay_epochs=(2.25,)")
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=100.0)
    train.train_and_evaluate(load_config("smoke", *overrides), str(tmp_path), extra_callbacks=[plateau, stop_at_step(50)])
    train.train_and_evaluate(load_config("smoke", *overrides), str(tmp_path))  # resumes at step 50
    lr = {r["step"]: r["lr"] for r in read_jsonl(os.path.join(tmp_path, layout.METRICS)) if "lr" in r}
    # 20 steps an epoch, LR 0.1, / 10 from step 45; each row logs the LR of its loop's last step.
    assert lr == pytest.approx({10: 0.1, 20: 0.1, 30: 0.1, 40: 0.1, 50: 0.005, 60: 0.005}, rel=1e-6)


def test_a_callback_setting_the_lr_where_the_schedule_is_zero_is_refused_by_name(tmp_path):
    class SetLearningRate(keras.callbacks.Callback):  # at the end of epoch 1, where the LR has been 0 since step 20
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.optimizer.learning_rate = 0.05

    cfg = load_config("smoke", "--config.train.steps_per_loop=10", "--config.schedule.warmup=none",
                      "--config.schedule.decay=step", "--config.schedule.decay_epochs=(1,)",
                      "--config.schedule.decay_factor=0.0")
    with pytest.raises(tfs_config.ConfigError, match="a callback set the LR to 0.05 before step 40, where "
                       "config.schedule's LR is 0"):
        train.train_and_evaluate(cfg, str(tmp_path), extra_callbacks=[SetLearningRate()])


def test_a_loop_ends_where_the_host_must_act():
    cfg = load_config("smoke", "--config.train.steps_per_loop=100", "--config.train.log_every_steps=7",
                      "--config.profile_steps=33,35")
    run = engine.Run(cfg=cfg, cluster=None, steps=tfs_config.to_steps(cfg), data_dir="")
    plan = local_sgd.make_plan(cfg.distribute, num_replicas=1, steps_per_epoch=run.steps.steps_per_epoch,
                               train_steps=run.steps.train_steps)
    ends, step = [], 0
    while step < run.steps.train_steps:
        step = controller.next_loop_end(run, step, plan)
        ends.append(step)
    # log rows every 7, checkpoints and epochs every 20, eval every 30, the profiler window 33..35, the end 60
    assert ends == [7, 14, 20, 21, 28, 30, 32, 35, 40, 42, 49, 56, 60]


# --- gradient accumulation ------------------------------------------------------------------------


def _frozen_bn_step_weights(cfg, batches):
    """Weights after one update per batch, BatchNorm frozen (inference mode): no batch-size dependence."""
    cluster = distribute.setup(cfg.distribute)
    model, optimizer = frozen_bn_model_and_optimizer(cfg, cluster)
    replica_step = engine.make_replica_step(cfg, cluster, model, optimizer)

    @tf.function
    def step(images, labels):
        return engine.run_replica_step(cluster, replica_step, images, labels, tf.constant(0.0))

    losses = [float(step(images, labels)[0]) for images, labels in batches]
    return [v.numpy() for v in model.trainable_variables], losses


def test_four_micro_batches_of_8_equal_one_batch_of_32():
    base = load_config("smoke", "--config.optim.lr_per_256=2.0")  # large LR: differences would show
    batches = list(pipeline.train_input_fn(base.data, seed=0, start_step=0)(tf.distribute.InputContext()).take(4))
    reference_weights, reference_losses = _frozen_bn_step_weights(base, batches)
    accumulated_weights, accumulated_losses = _frozen_bn_step_weights(
        load_config("smoke", "--config.optim.lr_per_256=2.0", "--config.optim.grad_accum_steps=4"), batches)
    initial_weights, _ = _frozen_bn_step_weights(base, [])
    moved = max(np.abs(w - w0).max() for w, w0 in zip(reference_weights, initial_weights))
    assert moved > 1e-2  # the updates were real
    np.testing.assert_allclose(accumulated_losses, reference_losses, rtol=1e-6)
    for ours, reference in zip(accumulated_weights, reference_weights):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)


class CountingReductions:
    """The cluster, counting on device how often the gradients are reduced."""

    def __init__(self, cluster):
        self.cluster = cluster
        with cluster.strategy.scope():
            self.reductions = tf.Variable(0)

    def __getattr__(self, name):
        return getattr(self.cluster, name)

    def reduce_gradients(self, grads):
        self.reductions.assign_add(1)
        return self.cluster.reduce_gradients(grads)


def test_accumulation_reduces_gradients_once_per_update():
    cfg = load_config("smoke", "--config.optim.grad_accum_steps=4")
    cluster = CountingReductions(distribute.setup(cfg.distribute))
    with cluster.strategy.scope():
        model = engine.build_model(cfg)
        optimizer = engine.build_optimizer(cfg, model)
    train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=tf.Variable(0, dtype=tf.int64))
    iterator = iter(cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
    train_loop(iterator, tf.constant(0.0), tf.constant(3))
    assert int(cluster.reductions.numpy()) == 3 and int(optimizer.iterations.numpy()) == 3


def test_micro_batch_must_divide_the_replica_batch():
    cfg = load_config("smoke", "--config.optim.grad_accum_steps=3")
    with pytest.raises(ValueError, match=r"optim.grad_accum_steps=3 does not divide the per-replica batch 32"):
        validation.validate(cfg, num_replicas=1)


def test_the_32_gpu_recipe_runs_on_4_gpus_by_accumulating_8_micro_batches(tmp_path):
    cfg = load_config("r50_32gpu", f"--config.data.data_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"--config.optim.grad_accum_steps=8 \(gradient accumulation\)"):
        validation.validate(cfg, num_replicas=4)
    cfg = load_config("r50_32gpu", f"--config.data.data_dir={tmp_path}", "--config.optim.grad_accum_steps=8")
    validation.validate(cfg, num_replicas=4)  # 4 x 8 micro-batches of 128: the recipe's global batch 4096
    assert cfg.optim.lr == 1.6 and tfs_config.to_steps(cfg).train_steps == 90 * (1_281_167 // 4096)


@pytest.mark.slow
def test_two_workers_accumulating_equal_one_worker_with_the_whole_batch(tmp_path):
    """2 MWMS workers x 2 micro-batches of 8 == 1 worker x one batch of 32 (BatchNorm frozen)."""
    from conftest import quiet_env
    from test_multiworker import DRIVER, SHORT, read_log, wait_all, weights

    def command(output, workdir, *overrides):
        return [sys.executable, DRIVER, str(tmp_path / output), "--freeze_bn", *SHORT, "--config.model.sync_bn=False",
                f"--workdir={tmp_path / workdir}", *overrides]

    reference = subprocess.run(command("one.npz", "one"), cwd=REPO, env=quiet_env(), capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    ports = launch.free_ports(2)
    procs = [
        subprocess.Popen(command(f"w{rank}.npz", "two", "--config.distribute.backend=mwms", "--config.optim.grad_accum_steps=2"),
                         cwd=REPO, env=quiet_env(**launch.worker_env(rank, 2, ports, "mwms", 1)),
                         stdout=open(tmp_path / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT)
        for rank in range(2)
    ]
    assert wait_all(procs) == [0, 0], read_log(tmp_path, 0)[-3000:] + read_log(tmp_path, 1)[-3000:]

    rank0, rank1, one = (weights(tmp_path / name) for name in ("w0.npz", "w1.npz", "one.npz"))
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)  # the workers agree exactly
    moved = max(np.abs(w - w0).max() for w, w0 in zip(one, weights(tmp_path / "one_init.npz")))
    assert moved > 5e-3
    for ours, reference_weights in zip(rank0, one):  # float sums in another order: round-off only
        np.testing.assert_allclose(ours, reference_weights, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_accumulating_run_resumes_exactly(tmp_path):
    """Stopped at step 25 and rerun, a run with 2 micro-batches ends where the uninterrupted one does."""
    accumulate = ("--config.optim.grad_accum_steps=2", "--config.train.steps_per_loop=5")
    whole = str(tmp_path / "whole")
    train.train_and_evaluate(load_config("smoke", *accumulate), whole)
    resumed = str(tmp_path / "resumed")
    first = train.train_and_evaluate(load_config("smoke", *accumulate), resumed, extra_callbacks=[stop_at_step(25)])
    assert first["steps"] == 25
    assert train.train_and_evaluate(load_config("smoke", *accumulate), resumed)["steps"] == 60
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "images_per_sec")} for r in rows]  # noqa: E731
    stop_eval = {"step": 25}  # the interrupted run evaluated where it stopped; the whole run did not
    assert [r for r in strip(read_jsonl(os.path.join(resumed, layout.METRICS))) if not stop_eval.items() <= r.items()] == strip(read_jsonl(os.path.join(whole, layout.METRICS)))
    expected, actual = checkpoint_values(whole), checkpoint_values(resumed)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.parametrize("backend", ["one_device", "horovod_stub"])
def test_batches_go_to_the_device_through_input_options_of_the_configured_depth_without_autotuner(backend):
    # GPU hosts copy the next `device_prefetch_batches` batches per replica to the GPU during the
    # step; here the device is the CPU, so what is checked is that every backend asks for it.
    cfg = load_config("smoke", "--config.distribute.device_prefetch_batches=3")
    if backend == "one_device":
        cluster = distribute.setup(cfg.distribute)
        collectives = cluster._collectives
    else:
        class OneRank:  # what HorovodCollectives asks of the horovod module to shard the input
            size, rank = staticmethod(lambda: 1), staticmethod(lambda: 0)

        collectives = HorovodCollectives(OneRank(), tf.distribute.OneDeviceStrategy("/cpu:0"),
                                         device_prefetch_batches=cfg.distribute.device_prefetch_batches)
    data = collectives.distribute_dataset(lambda context: tf.data.Dataset.range(6).batch(2))
    assert data._options.experimental_fetch_to_device
    assert data._options.experimental_per_replica_buffer_size == 3
    assert [batch.numpy().tolist() for batch in data] == [[0, 1], [2, 3], [4, 5]]
    # Each device's share runs through a dataset tf.distribute builds itself; with the autotuner on,
    # deleting its iterator joins the autotuner's thread, which sleeps up to a minute (collectives.py).
    per_worker_iterator = iter(data)._iterators[0]._iterator
    device_datasets = [device_iterator._dataset for device_iterator in per_worker_iterator._device_iterators]
    assert device_datasets and all(ds.options().autotune.enabled is False for ds in device_datasets)


def _train_mirrored(out_path: str) -> None:
    """Subprocess body (the CPU split in 2 devices before TensorFlow starts): 6 steps of the smoke recipe on 2 replicas, in loops of 1 and of 3
    steps, from the same initial weights; saves every replica's copy of every model variable."""
    cfg = load_config("smoke", "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2")
    cluster = distribute.setup(cfg.distribute)
    assert cluster.num_replicas == 2
    arrays = {}
    for steps_per_loop in (1, 3):
        keras.utils.set_random_seed(0)
        with cluster.strategy.scope():
            model = engine.build_model(cfg)
            optimizer = engine.build_optimizer(cfg, model)
            step = tf.Variable(0, dtype=tf.int64)
        train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=step)
        # One pipeline split in two: each replica normalises a different half of every batch.
        iterator = iter(cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
        for _ in range(6 // steps_per_loop):
            train_loop(iterator, tf.constant(0.0), tf.constant(steps_per_loop))
        for v in model.variables:
            for replica, value in enumerate(cluster.strategy.experimental_local_results(v.value)):
                arrays[f"loop{steps_per_loop}/{v.path}/replica{replica}"] = value.numpy()
    np.savez(out_path, **arrays)


@pytest.mark.slow
def test_batch_norm_statistics_averaged_once_per_loop_equal_averaging_every_step(tmp_path):
    """The replicas' moving statistics are averaged after a loop's last step, not after every step: the
    same values to rounding (the update is linear), identical on both replicas, and the weights unchanged."""
    out_path = str(tmp_path / "mirrored.npz")
    code = (f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            f"import test_train_loop\ntest_train_loop._train_mirrored({out_path!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = np.load(out_path)
    names = sorted({key.split("/", 1)[1].rsplit("/", 1)[0] for key in saved.files})
    moving = [name for name in names if "moving_" in name]
    assert moving
    for name in names:
        per_step, per_loop = (saved[f"loop{k}/{name}/replica0"] for k in (1, 3))
        np.testing.assert_array_equal(saved[f"loop3/{name}/replica1"], per_loop, err_msg=name)
        np.testing.assert_allclose(per_loop, per_step, rtol=1e-4, atol=1e-6, err_msg=name)
    # The statistics moved from their initial values (0 and 1), so equality above is not trivially met.
    assert any(np.abs(saved[f"loop3/{name}/replica0"] - ("variance" in name)).max() > 1e-3 for name in moving)


def test_gradient_buckets_fill_from_the_last_gradient_and_skip_missing_ones():
    from tfscale.cluster.collectives import gradient_buckets

    grads = [tf.zeros([10]), None, tf.zeros([30]), tf.zeros([5], tf.float16), tf.zeros([100])]  # 40, -, 120, 10, 400 B
    assert gradient_buckets(grads, 0) == [[4, 3, 2, 0]]
    # A tensor above the bucket size goes alone; the others fill buckets up to 130 bytes, last first.
    assert gradient_buckets(grads, 130) == [[4], [3, 2], [0]]
    assert gradient_buckets([None], 130) == [] and gradient_buckets([None], 0) == []
