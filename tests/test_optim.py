"""Tests for tfscale.model.optim: LARS against an independent NumPy reference, exclusions, L2, factory.

The distributed check runs MirroredStrategy over 2 logical CPU devices in a subprocess, because
logical devices must be configured before TensorFlow initialises its devices (which the rest of
this file does). The subprocess imports this file as a module and calls `_run_mirrored`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from tfscale.model import optim

LR = 2.0  # LARS-sized: big enough that decay and trust ratio move float32 weights visibly
MOMENTUM = 0.9
ETA = 0.001
NUM_STEPS = 4

# Trainable variables of `_build_model`, in order (path suffixes), and whether they are conv/dense
# kernels.
# Written out by hand so the reference does not reuse the module's `is_decayed`.
EXPECTED_PATHS = (
    ("conv/kernel", True),
    ("bn/gamma", False),
    ("bn/beta", False),
    ("fc/kernel", True),
    ("fc/bias", False),
    ("head/kernel", True),  # starts at zero: trust ratio must fall back to 1
    ("head/bias", False),
)
DECAYED = [decayed for _, decayed in EXPECTED_PATHS]
ZERO_GRAD_STEP, ZERO_GRAD_VAR = 2, 3  # fc/kernel gets an all-zero gradient on step 2: ratio 1


# ----------------------------------------------------------------------------- NumPy reference
def lars_reference(weights, grads_per_step, decayed, lrs, momentum, weight_decay, eta, epsilon,
                   nesterov):
    """LARS in float64 NumPy, written from the formulas (You et al. 2017 / tf.contrib LARS).

    Returns (weights, velocities) after applying each step's gradients with that step's LR.
    """
    w = [np.asarray(x, np.float64) for x in weights]
    v = [np.zeros_like(x) for x in w]
    for lr, grads in zip(lrs, grads_per_step):
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            if decayed[i]:
                w_norm, g_norm = np.linalg.norm(w[i]), np.linalg.norm(g)
                if w_norm > 0 and g_norm > 0:
                    ratio = eta * w_norm / (g_norm + weight_decay * w_norm + epsilon)
                else:
                    ratio = 1.0
                step = lr * ratio * (g + weight_decay * w[i])
            else:
                step = lr * g  # excluded: plain momentum SGD, no decay
            v[i] = momentum * v[i] + step
            w[i] = w[i] - (momentum * v[i] + step if nesterov else v[i])
    return w, v


def rel_err(actual, expected):
    expected = np.asarray(expected, np.float64)
    return np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected)


def assert_close(actual_list, expected_list, rtol=1e-6):
    """Per-variable relative error (L2 over the tensor) and element-wise closeness."""
    for (path, _), a, e in zip(EXPECTED_PATHS, actual_list, expected_list):
        assert rel_err(a, e) <= rtol, f"{path}: relative error {rel_err(a, e):.3g}"
        np.testing.assert_allclose(a, e, rtol=10 * rtol, atol=rtol * np.abs(e).max(), err_msg=path)


# ----------------------------------------------------------------------------- fixtures/helpers
def _build_model():
    inputs = keras.Input((4, 4, 2))
    x = keras.layers.Conv2D(3, 3, use_bias=False, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(4, name="fc")(x)
    outputs = keras.layers.Dense(3, kernel_initializer="zeros", name="head")(x)
    return keras.Model(inputs, outputs, name="tiny")


def _initial_weights(model):
    """Fixed non-trivial values (gamma around 1, non-zero biases); head/kernel stays zero."""
    rng = np.random.default_rng(0)
    values = []
    for v in model.trainable_variables:
        if v.path.endswith("head/kernel"):
            values.append(np.zeros(v.shape, np.float32))
        elif v.path.endswith("bn/gamma"):
            values.append((1.0 + 0.1 * rng.standard_normal(v.shape)).astype(np.float32))
        else:
            values.append((0.5 * rng.standard_normal(v.shape)).astype(np.float32))
    return values


def _gradients(model, num_steps=NUM_STEPS):
    """Different fixed gradients per step; one all-zero kernel gradient to hit ratio 1."""
    rng = np.random.default_rng(1)
    steps = []
    for s in range(num_steps):
        grads = [(0.1 * rng.standard_normal(v.shape)).astype(np.float32)
                 for v in model.trainable_variables]
        if s == ZERO_GRAD_STEP:
            grads[ZERO_GRAD_VAR] = np.zeros_like(grads[ZERO_GRAD_VAR])
        steps.append(grads)
    return steps


def _setup(**lars_kwargs):
    model = _build_model()
    paths = [v.path for v in model.trainable_variables]
    assert len(paths) == len(EXPECTED_PATHS)
    assert all(p.endswith(e) for p, (e, _) in zip(paths, EXPECTED_PATHS)), paths
    init = _initial_weights(model)
    for v, x in zip(model.trainable_variables, init):
        v.assign(x)
    opt = optim.LARS(learning_rate=LR, momentum=MOMENTUM, eta=ETA, **lars_kwargs)
    opt.build(model.trainable_variables)
    return model, opt, init, _gradients(model)


def _run_steps(model, opt, grads_per_step, use_tf_function=False):
    def step(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    fn = tf.function(step) if use_tf_function else step
    for grads in grads_per_step:
        fn([tf.constant(g) for g in grads])
    return [v.numpy() for v in model.trainable_variables]


def _velocities(opt):
    return [v.numpy() for v in opt._velocities]


def _cfg(name="lars", nesterov=False):
    c = ml_collections.ConfigDict()
    c.name = name
    c.momentum = 0.9
    c.nesterov = nesterov
    c.weight_decay = 1e-4
    c.lars_eta = 0.001
    c.lars_epsilon = 0.0
    return c


# ----------------------------------------------------------------------------- LARS numerics
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [1e-4, 1e-2])
def test_lars_matches_numpy_reference(weight_decay, nesterov):
    model, opt, init, grads = _setup(weight_decay=weight_decay, nesterov=nesterov)
    actual = _run_steps(model, opt, grads)
    lrs = [LR] * len(grads)
    expected_w, expected_v = lars_reference(init, grads, DECAYED, lrs, MOMENTUM, weight_decay,
                                            ETA, 0.0, nesterov)
    assert_close(actual, expected_w)
    assert_close(_velocities(opt), expected_v)
    if weight_decay == 1e-2:
        # The tolerance can see the decay: dropping it from the reference moves kernels far more.
        no_decay_w, _ = lars_reference(init, grads, DECAYED, lrs, MOMENTUM, 0.0, ETA, 0.0,
                                       nesterov)
        assert rel_err(no_decay_w[0], expected_w[0]) > 1e-4


def test_lars_excluded_variables_get_plain_momentum_sgd():
    """BN gamma/beta and biases: v = m v + lr g; w -= v, no decay and no trust ratio."""
    model, opt, init, grads = _setup(weight_decay=1e-2)
    actual = _run_steps(model, opt, grads)
    for i, decayed in enumerate(DECAYED):
        if decayed:
            continue
        w, v = init[i].astype(np.float64), 0.0
        for step_grads in grads:
            v = MOMENTUM * v + LR * step_grads[i].astype(np.float64)
            w = w - v
        np.testing.assert_allclose(actual[i], w, rtol=1e-6, atol=1e-6, err_msg=EXPECTED_PATHS[i][0])


def test_lars_zero_weight_kernel_uses_trust_ratio_one():
    model, opt, init, grads = _setup(weight_decay=1e-2)
    head = 5
    assert not init[head].any()
    actual = _run_steps(model, opt, grads[:1])
    # Ratio 1 and wd * w = 0, so the first step is plain lr * g.
    np.testing.assert_allclose(actual[head], -LR * grads[0][head], rtol=1e-6)


def test_lars_zero_gradient_uses_trust_ratio_one():
    """||g|| = 0 (fc/kernel on step ZERO_GRAD_STEP): the step is lr * wd * w, not 0 and not nan."""
    wd = 1e-2
    model, opt, init, grads = _setup(weight_decay=wd)
    before = _run_steps(model, opt, grads[:ZERO_GRAD_STEP])
    velocity_before = _velocities(opt)[ZERO_GRAD_VAR]
    after = _run_steps(model, opt, [grads[ZERO_GRAD_STEP]])
    expected_v = MOMENTUM * velocity_before + LR * 1.0 * wd * before[ZERO_GRAD_VAR]
    np.testing.assert_allclose(after[ZERO_GRAD_VAR], before[ZERO_GRAD_VAR] - expected_v, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lars_low_precision_gradients_are_cast_to_float32(dtype):
    model, opt, init, grads = _setup(weight_decay=1e-2)
    low = [[tf.cast(g, dtype) for g in step] for step in grads]
    rounded = [[tf.cast(g, tf.float32).numpy() for g in step] for step in low]
    for step in low:
        opt.apply_gradients(zip(step, model.trainable_variables))
    actual = [v.numpy() for v in model.trainable_variables]
    assert all(a.dtype == np.float32 for a in actual)
    expected, _ = lars_reference(init, rounded, DECAYED, [LR] * len(grads), MOMENTUM, 1e-2, ETA,
                                 0.0, False)
    assert_close(actual, expected)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_tf_function_matches_eager(nesterov):
    model, opt, _, grads = _setup(weight_decay=1e-2, nesterov=nesterov)
    eager = _run_steps(model, opt, grads)
    model, opt, _, grads = _setup(weight_decay=1e-2, nesterov=nesterov)
    graph = _run_steps(model, opt, grads, use_tf_function=True)
    assert_close(graph, eager)


def _run_mirrored(out_path, nesterov):
    """Subprocess body: the same LARS steps under MirroredStrategy on 2 logical CPUs.

    Each replica contributes half of the step's gradient; Keras all-reduces with SUM, so the
    applied gradient equals the single-device one. Saves every replica's copy of every variable.
    """
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model, opt, _, grads = _setup(weight_decay=1e-2, nesterov=nesterov)

    @tf.function
    def train_step(step_grads):
        def replica_fn(gs):
            opt.apply_gradients(zip([g * 0.5 for g in gs], model.trainable_variables))

        strategy.run(replica_fn, args=(step_grads,))

    for step_grads in grads:
        train_step([tf.constant(g) for g in step_grads])
    arrays = {}
    for i, v in enumerate(model.trainable_variables):
        for r, local in enumerate(strategy.experimental_local_results(v.value)):
            arrays[f"v{i}_r{r}"] = local.numpy()
    arrays["iterations"] = np.asarray(int(opt.iterations.numpy()))
    np.savez(out_path, **arrays)


_SUBPROCESS_CODE = """
import sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, {tests_dir!r})
import test_optim
test_optim._run_mirrored({out_path!r}, nesterov={nesterov!r})
"""


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_mirrored_strategy_matches_eager(tmp_path, nesterov):
    out_path = str(tmp_path / "mirrored.npz")
    code = _SUBPROCESS_CODE.format(tests_dir=os.path.dirname(os.path.abspath(__file__)),
                                   out_path=out_path, nesterov=nesterov)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    model, opt, _, grads = _setup(weight_decay=1e-2, nesterov=nesterov)
    eager = _run_steps(model, opt, grads)
    saved = np.load(out_path)
    assert int(saved["iterations"]) == len(grads)
    for r in range(2):
        assert_close([saved[f"v{i}_r{r}"] for i in range(len(eager))], eager)


# ----------------------------------------------------------------------------- exclusions and L2
def _classification_model():
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(2, 3, name="conv")(inputs)  # with bias
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, name="fc")(x)
    return keras.Model(inputs, outputs, name="cls")


def test_is_decayed_on_real_model():
    model = _classification_model()
    # Functional models name paths "<layer>/<variable>"; drop any outer prefix Keras may add.
    got = {"/".join(v.path.split("/")[-2:]): optim.is_decayed(v) for v in model.weights}
    assert got == {
        "conv/kernel": True,
        "conv/bias": False,
        "bn/gamma": False,
        "bn/beta": False,
        "bn/moving_mean": False,
        "bn/moving_variance": False,
        "fc/kernel": True,
        "fc/bias": False,
    }
    # Raw tf.Variables (names like "fc/kernel:0") classify the same way.
    assert [optim.is_decayed(v.value) for v in model.weights] == list(got.values())


def test_l2_loss_counts_kernels_only():
    model = _classification_model()
    rng = np.random.default_rng(2)
    for v in model.trainable_variables:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))  # biases/gamma/beta non-zero too
    kernels = [v.numpy().astype(np.float64) for v in model.trainable_variables
               if v.path.endswith("/kernel")]
    expected = 0.5 * 1e-2 * sum(float(np.sum(k ** 2)) for k in kernels)
    loss = optim.l2_loss(model.trainable_variables, 1e-2)
    assert loss.dtype == tf.float32
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    all_vars = 0.5 * 1e-2 * sum(float(np.sum(v.numpy() ** 2)) for v in model.trainable_variables)
    assert abs(all_vars - expected) > 1e-3  # the exclusion matters for this model
    assert float(optim.l2_loss([], 1e-2)) == 0.0


def test_l2_loss_is_float32_for_low_precision_variables():
    kernel = keras.Variable(np.full((3, 3), 2.0), dtype="bfloat16", name="kernel")
    loss = optim.l2_loss([kernel], 0.5)
    assert loss.dtype == tf.float32
    np.testing.assert_allclose(float(loss), 0.5 * 0.5 * 9 * 4.0)


def test_l2_loss_gradient_is_weight_decay_times_w():
    model = _classification_model()
    with tf.GradientTape() as tape:
        loss = optim.l2_loss(model.trainable_variables, 1e-3)
    grads = tape.gradient(loss, model.trainable_variables)
    for v, g in zip(model.trainable_variables, grads):
        if v.path.endswith("/kernel"):
            np.testing.assert_allclose(g.numpy(), 1e-3 * v.numpy(), rtol=1e-6)
        else:
            assert g is None or not np.any(g.numpy())


# ----------------------------------------------------------------------------- factory and config
def test_make_optimizer_sgd():
    opt = optim.make_optimizer(_cfg("sgd", nesterov=True), 0.2)
    assert isinstance(opt, keras.optimizers.SGD)  # applying gradients the step has reduced (optim.applying_reduced_gradients)
    assert opt.momentum == 0.9 and opt.nesterov is True and opt.weight_decay is None
    np.testing.assert_allclose(float(opt.learning_rate), 0.2)


def test_make_optimizer_lars():
    opt = optim.make_optimizer(_cfg("lars"), 3)  # an int LR is accepted and made a float
    assert isinstance(opt, optim.LARS)
    assert (opt.momentum, opt.lars_weight_decay, opt.eta, opt.epsilon, opt.nesterov) == (
        0.9, 1e-4, 0.001, 0.0, False)
    # The Keras base class's decoupled decay must stay off, or kernels would be decayed twice.
    assert opt.weight_decay is None
    np.testing.assert_allclose(float(opt.learning_rate), 3.0)


def test_make_optimizer_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        optim.make_optimizer(_cfg("adamw"), 0.1)
    assert "adamw" in str(err.value)
    assert all(name in str(err.value) for name in optim.OPTIMIZERS)


def test_lars_get_config_round_trip():
    opt = optim.LARS(learning_rate=0.3, momentum=0.8, weight_decay=5e-5, eta=0.002, epsilon=1e-9,
                     nesterov=True)
    config = opt.get_config()
    assert config["weight_decay"] == 5e-5
    clone = optim.LARS.from_config(config)
    assert (clone.momentum, clone.lars_weight_decay, clone.eta, clone.epsilon, clone.nesterov) == (
        0.8, 5e-5, 0.002, 1e-9, True)
    assert clone.weight_decay is None
    np.testing.assert_allclose(float(clone.learning_rate), 0.3)


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_setting_learning_rate_changes_next_step(name):
    """A callback sets `optimizer.learning_rate = x`; the traced train step must use the new x."""
    model, _, init, grads = _setup()
    opt = optim.make_optimizer(_cfg(name), 0.1)
    opt.build(model.trainable_variables)

    @tf.function
    def step(gs):
        opt.apply_gradients(zip(gs, model.trainable_variables))

    step([tf.constant(g) for g in grads[0]])
    w1 = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    opt.learning_rate = 0.5
    step([tf.constant(g) for g in grads[1]])
    w2 = [v.numpy() for v in model.trainable_variables]
    np.testing.assert_allclose(float(opt.learning_rate), 0.5)

    if name == "sgd":  # Keras SGD: v = m v - lr g; w += v (no decay inside the optimizer)
        w0 = [x.astype(np.float64) for x in init]
        expected = [b + 0.9 * (b - a) - 0.5 * g[1] for a, b, g in
                    zip(w0, w1, zip(grads[0], grads[1]))]
    else:
        expected, _ = lars_reference(init, grads[:2], DECAYED, [0.1, 0.5], 0.9, 1e-4, 0.001, 0.0,
                                     False)
    assert_close(w2, expected)
    # And the step really is bigger than it would have been at the old rate (bias: lr * g part).
    bias = 4
    old_rate = w1[bias] - 0.1 * grads[1][bias] - 0.9 * (init[bias] - w1[bias])
    assert rel_err(w2[bias], old_rate) > 1e-3


def test_loss_weight_decay():
    assert optim.loss_weight_decay(_cfg("sgd")) == 1e-4
    assert optim.loss_weight_decay(_cfg("lars")) == 0.0
    with pytest.raises(ValueError, match="adamw"):
        optim.loss_weight_decay(_cfg("adamw"))
