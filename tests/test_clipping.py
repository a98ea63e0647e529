"""Gradient clipping by global norm (optim.clip_global_norm) and label smoothing (optim.label_smoothing).

Clipping is checked against an independent recomputation: the gradient of the global batch from a
separate tape, clipped in NumPy, applied as one SGD step. The mirrored check needs the CPU split into
two devices before TensorFlow starts, so it runs this file as a program in a subprocess
(`python tests/test_clipping.py mirrored`). Two MWMS workers and two Horovod ranks clip in
tests/test_multiworker.py and tests/test_horovod.py, whose runs carry optim.clip_global_norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import REPO, frozen_bn_model_and_optimizer, load_config, read_jsonl, run_cli  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale.cluster import distribute  # noqa: E402
from tfscale.config import validation
from tfscale.data.input import pipeline  # noqa: E402
from tfscale.model import optim
from tfscale.training import engine, init_from, local_sgd_steps
from tfscale.workdir import layout

CLIP = 0.05  # the smoke model's gradient norm at initialisation is 0.2-0.4: every step below is clipped


def first_batch(cfg):
    """The global batch of the run's first step, as train's input pipeline makes it."""
    return next(iter(pipeline.train_input_fn(cfg.data, seed=cfg.seed, start_step=0)(tf.distribute.InputContext())))


def reference_gradients(model, images, labels, weight_decay: float, label_smoothing: float = 0.0):
    """The gradient of the global batch's objective (mean smoothed cross-entropy + 0.5 * wd * ||kernels||^2),
    written without tfscale's loss code; returns (gradients as numpy, mean loss without the L2 term)."""
    num_classes = model.output_shape[-1]
    targets = (1.0 - label_smoothing) * tf.one_hot(labels, num_classes) + label_smoothing / num_classes
    with tf.GradientTape() as tape:
        logits = tf.cast(model(images, training=True), tf.float32)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(targets, logits))
        kernels = [v for v in model.trainable_variables if v.path.endswith("kernel")]
        objective = loss + 0.5 * weight_decay * tf.add_n([tf.reduce_sum(tf.square(v)) for v in kernels])
    return [g.numpy() for g in tape.gradient(objective, model.trainable_variables)], float(loss)


def global_norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))


def clipped_sgd_step(weights, grads, lr: float, clip: float):
    """One SGD step (momentum's first step is plain SGD) on gradients clipped to global norm `clip`;
    returns (new weights, global norm before clipping)."""
    norm = global_norm(grads)
    factor = min(1.0, clip / norm)
    return [w - lr * factor * g for w, g in zip(weights, grads)], norm


def one_clipped_step(*overrides: str, local: bool = False) -> dict:
    """One training step of the smoke model (BatchNorm frozen: no dependence on how the batch is split
    over replicas) through tfscale's own loop, against the NumPy recomputation."""
    cfg = load_config("smoke", f"--config.optim.clip_global_norm={CLIP}", *overrides)
    cluster = distribute.setup(cfg.distribute)
    with engine.precision_policy(cfg.precision):
        model, optimizer = frozen_bn_model_and_optimizer(cfg, cluster)
        images, labels = first_batch(cfg)
        initial = [v.numpy() for v in model.trainable_variables]
        grads, _ = reference_gradients(model, images, labels, cfg.optim.weight_decay)
        expected, norm = clipped_sgd_step(initial, grads, cfg.optim.lr, CLIP)
        unclipped = [w - cfg.optim.lr * g for w, g in zip(initial, grads)]
        make_loop = local_sgd_steps.make_local_train_loop if local else engine.make_train_loop
        loop = make_loop(cfg, cluster, model, optimizer, step=tf.Variable(0, dtype=tf.int64))
        # The strategy splits the global batch over its replicas, as it splits train's input.
        batches = cluster.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        loop(iter(batches), tf.constant(0.0), tf.constant(1))
    trained = [v.numpy() for v in model.trainable_variables]
    return {
        "replicas": cluster.num_replicas,
        "error": max(float(np.abs(t - e).max()) for t, e in zip(trained, expected)),
        "unclipped_gap": max(float(np.abs(u - e).max()) for u, e in zip(unclipped, expected)),
        "step_norm": global_norm([t - w0 for t, w0 in zip(trained, initial)]),
        "step_norm_expected": cfg.optim.lr * CLIP,
        "norm": norm,
        "logged_norm": optim.grad_norm(optimizer),
    }


def assert_clipped_update(result: dict, replicas: int) -> None:
    assert result["replicas"] == replicas
    assert result["norm"] > 2 * CLIP  # the clip is active...
    assert result["unclipped_gap"] > 1e-3  # ...and an unclipped update would be far off
    assert result["error"] < 2e-6, result
    assert result["logged_norm"] == pytest.approx(result["norm"], rel=1e-5)


def test_one_device_applies_the_clipped_gradient_of_the_global_batch():
    assert_clipped_update(one_clipped_step(), replicas=1)


def test_local_sgd_clips_each_workers_own_gradient():
    # One worker: its local step's gradient is the global batch's, clipped before its own update.
    assert_clipped_update(one_clipped_step("--config.distribute.sync=local_sgd", local=True), replicas=1)


def test_float16_loss_scaling_clips_the_unscaled_gradient():
    # The LossScaleOptimizer hands the clipping optimizer unscaled gradients: clipping the scaled ones
    # (x 32768) would leave an update 32768 times smaller and log a norm 32768 times larger.
    # Batch 8: float16 convolutions are slow on this CPU.
    result = one_clipped_step("--config.precision=mixed_float16", "--config.data.global_batch_size=8")
    assert result["step_norm"] == pytest.approx(result["step_norm_expected"], rel=1e-4)
    assert result["logged_norm"] == pytest.approx(result["norm"], rel=1e-2)  # float16 forward vs float32 reference


@pytest.mark.slow
def test_mirrored_two_devices_clip_the_summed_gradient():
    # Each replica's half-batch gradient has about half the global norm: clipping those before the sum
    # would give a different update from the NumPy one.
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "mirrored"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_clipped_update(json.loads(proc.stdout.strip().splitlines()[-1]), replicas=2)


@pytest.mark.parametrize("key, value", [("optim.clip_global_norm", -1.0), ("optim.label_smoothing", 1.0),
                                        ("optim.label_smoothing", -0.1)])
def test_out_of_range_values_are_refused_naming_the_key(key, value):
    with pytest.raises(tfs_config.ConfigError, match=f"config.{key}"):
        validation.validate(load_config("smoke", f"--config.{key}={value}"))


# --- through the CLI: the first step's logged loss is the smoothed loss, its update the clipped one -------


def confident_initial_weights(cfg, images, path: str) -> keras.Model:
    """The seeded model with its classifier scaled up until the logits of `images` have a standard deviation
    of 4 (far from a freshly initialised model's near-uniform prediction, whose loss smoothing barely
    changes); saved to `path` for init_from."""
    keras.utils.set_random_seed(cfg.seed)
    model = engine.build_model(cfg)
    head = model.get_layer(init_from.HEAD_LAYER)
    head.kernel.assign(head.kernel * (4.0 / float(tf.math.reduce_std(model(images, training=True)))))
    model.save_weights(path)
    return model


def numpy_cross_entropy(logits: np.ndarray, labels: np.ndarray, label_smoothing: float) -> float:
    logits = logits.astype(np.float64)
    log_probs = logits - logits.max(axis=1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(axis=1, keepdims=True))
    targets = np.full(logits.shape, label_smoothing / logits.shape[1])
    targets[np.arange(len(labels)), labels] += 1.0 - label_smoothing
    return float(-(targets * log_probs).sum(axis=1).mean())


@pytest.mark.slow
def test_cli_run_logs_the_smoothed_loss_and_applies_the_clipped_update(tmp_path):
    init_path, workdir = str(tmp_path / "init.weights.h5"), str(tmp_path / "run")
    overrides = ["--config.optim.label_smoothing=0.1", f"--config.optim.clip_global_norm={CLIP}",
                 f"--config.model.init_from={init_path}", "--config.train.epochs=0.05",  # one step of 32
                 "--config.schedule.warmup=none", "--config.train.log_every_steps=1", "--config.train.eval_steps=1",
                 "--config.data.deterministic=True"]
    cfg = load_config("smoke", *overrides)
    images, labels = first_batch(cfg)
    model = confident_initial_weights(cfg, images, init_path)
    initial = [v.numpy() for v in model.trainable_variables]
    step_logits = model(images, training=True).numpy()  # what train's first step sees (batch statistics)
    grads, _ = reference_gradients(model, images, labels, cfg.optim.weight_decay, label_smoothing=0.1)

    result = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}", *overrides)
    assert result.returncode == 0, result.stderr[-4000:]

    (row,) = [r for r in read_jsonl(os.path.join(workdir, layout.METRICS)) if "loss" in r]
    assert row["step"] == 1
    smoothed = numpy_cross_entropy(step_logits, labels.numpy(), 0.1)
    # The unsmoothed loss lies 100 tolerances away (a near-uniform prediction would put it at ~0).
    assert abs(smoothed - numpy_cross_entropy(step_logits, labels.numpy(), 0.0)) > 100 * 1e-5 * smoothed
    assert row["loss"] == pytest.approx(smoothed, rel=1e-5)
    expected, norm = clipped_sgd_step(initial, grads, row["lr"], CLIP)
    assert norm > 2 * CLIP and row["grad_norm"] == pytest.approx(norm, rel=1e-4)  # the smoothed loss's gradient
    trained = init_from.restore_run(workdir, engine.build_model).model.trainable_variables
    for variable, want in zip(trained, expected):
        np.testing.assert_allclose(variable.numpy(), want, atol=2e-6, err_msg=variable.path)
    # The clipped step moved the weights; an unclipped one (over twice as long) would miss by as much.
    assert max(float(np.abs(w - w0).max()) for w, w0 in zip(expected, initial)) > 1e-4


if __name__ == "__main__" and sys.argv[1:] == ["mirrored"]:
    print(json.dumps(one_clipped_step("--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2")))
