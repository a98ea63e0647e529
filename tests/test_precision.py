"""Mixed precision inside tfscale's loop: bfloat16 tracks float32; float16 loss scaling skips bad steps."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import load_config

from tfscale.cluster import distribute
from tfscale.data.input import pipeline
from tfscale.training import engine, train
from tfscale.workdir import layout


def logged_losses(workdir):
    with open(os.path.join(workdir, layout.METRICS)) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.fixture
def float16_policy():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy(previous)


@pytest.mark.slow
def test_bfloat16_follows_float32_loss_curve(tmp_path):
    curves = {}
    for precision in ("float32", "mixed_bfloat16"):
        workdir = str(tmp_path / precision)
        cfg = load_config("smoke", f"--config.precision={precision}", "--config.train.epochs=2.0")
        train.train_and_evaluate(cfg, workdir)
        curves[precision] = np.array(logged_losses(workdir))
    f32, bf16 = curves["float32"], curves["mixed_bfloat16"]
    assert len(f32) == len(bf16) == 4
    assert bf16[-1] < 0.85 * bf16[0]  # it learns
    # bfloat16 keeps 8 mantissa bits: the curves agree to a few percent, not to float32 round-off.
    np.testing.assert_allclose(bf16, f32, rtol=0.06)
    assert keras.config.dtype_policy().name == "float32"  # the run restored the global policy


def test_float16_loss_scaling_skips_an_overflowing_step_and_lowers_the_scale(float16_policy):
    cfg = load_config("smoke", "--config.precision=mixed_float16", "--config.data.global_batch_size=8")
    cluster = distribute.setup(cfg.distribute)
    with cluster.strategy.scope():
        model = engine.build_model(cfg)
        optimizer = engine.build_optimizer(cfg, model)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    train_loop = engine.make_train_loop(cfg, cluster, model, optimizer, step=tf.Variable(0, dtype=tf.int64))

    def step(iterator, stop):  # one global step: (loss, replicas stopping)
        losses, _, stopping = train_loop(iterator, stop, tf.constant(1))
        return tf.stack([losses[0], stopping])

    data = cluster.strategy.distribute_datasets_from_function(
        pipeline.train_input_fn(cfg.data, seed=0, start_step=0)
    )
    iterator = iter(data)

    # Inject an overflow: a loss scale of 2^40 pushes float16 activation gradients past 65504 -> inf.
    optimizer.dynamic_scale.assign(2.0**40)
    before = [v.numpy().copy() for v in model.trainable_variables]
    loss, _ = step(iterator, tf.constant(0.0)).numpy()
    assert np.isfinite(loss)  # the loss itself is float32 and fine; only the gradients overflowed
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**39  # halved
    assert int(optimizer.iterations.numpy()) == 0  # the update was skipped...
    for old, new in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(old, new.numpy())  # ...and no weight moved

    # With a sane scale the next steps apply.
    optimizer.dynamic_scale.assign(2.0**10)
    step(iterator, tf.constant(0.0))
    assert int(optimizer.iterations.numpy()) == 1
    assert any(not np.array_equal(o, n.numpy()) for o, n in zip(before, model.trainable_variables))


def test_float16_training_runs_in_the_loop(tmp_path):
    cfg = load_config("smoke", "--config.precision=mixed_float16", "--config.train.epochs=1.0")
    summary = train.train_and_evaluate(cfg, str(tmp_path))
    assert summary["steps"] == 20
    losses = logged_losses(str(tmp_path))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow
def test_xla_compiled_step_matches_plain_step(tmp_path):
    plain = train.train_and_evaluate(load_config("smoke", "--config.train.epochs=1.0"), str(tmp_path / "plain"))
    xla = train.train_and_evaluate(
        load_config("smoke", "--config.train.epochs=1.0", "--config.jit_compile=True"), str(tmp_path / "xla")
    )
    assert xla["steps"] == plain["steps"] == 20
    np.testing.assert_allclose(
        logged_losses(str(tmp_path / "xla")), logged_losses(str(tmp_path / "plain")), rtol=1e-3
    )
