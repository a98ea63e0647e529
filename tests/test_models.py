"""Tests for tfscale.model.models: sizes against published counts, trainability, dtypes, initialisation."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import config as tfs_config
from tfscale.model import build, models
from tfscale.model import stats as model_stats

IMAGENET_NAMES = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]

# torchvision's parameter counts (1000 classes, no conv bias).  torchvision keeps the BatchNorm
# running mean/variance in buffers, so these equal our `trainable_params`, not `params`.
TORCHVISION_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}

SMALL_BATCH_SIZE = 2


def _small_setup(name):
    """(num_classes, input_shape) small enough to train a step on 2 CPU cores quickly."""
    if name.startswith("cifar"):
        return 10, (32, 32, 3)
    return 1000, (64, 64, 3)


def _random_images(input_shape, batch_size=SMALL_BATCH_SIZE, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(batch_size, *input_shape), dtype=np.uint8)


def _random_labels(num_classes, batch_size=SMALL_BATCH_SIZE, seed=0):
    return np.random.default_rng(seed).integers(0, num_classes, size=(batch_size,))


@pytest.fixture(scope="module")
def small_models():
    """Build each model once per module (building ResNet-152 takes seconds), without zero-gamma so
    that every trainable weight gets a non-zero gradient in the first step."""
    cache = {}

    def get(name):
        if name not in cache:
            num_classes, input_shape = _small_setup(name)
            keras.utils.set_random_seed(0)
            cache[name] = models.create(name, num_classes, input_shape, zero_init_residual=False)
        return cache[name]

    return get


@pytest.fixture
def mixed_bfloat16_policy():
    """Switch the global policy to mixed_bfloat16 and restore the previous one, even on failure."""
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy(previous_policy)


def _batch_norm_layers(model, suffix):
    return [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
            and layer.name.endswith(suffix)]


# --- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGENET_NAMES)
def test_imagenet_trainable_params_match_torchvision(name, small_models):
    stats = model_stats.describe(small_models(name))  # the count does not depend on the input size
    assert stats["trainable_params"] == TORCHVISION_PARAMS[name]
    # `params` additionally counts the BN moving mean and variance: 2 per trainable (gamma, beta) pair.
    bn_gamma_beta = sum(
        int(np.prod(w.shape)) for layer in small_models(name).layers
        if isinstance(layer, keras.layers.BatchNormalization) for w in layer.trainable_weights
    )
    assert stats["params"] == stats["trainable_params"] + bn_gamma_beta


def test_cifar_resnet20_has_about_0_27m_params(small_models):
    stats = model_stats.describe(small_models("cifar_resnet20"))
    assert 260_000 <= stats["trainable_params"] <= 280_000


def test_resnet50_flops_at_224():
    # torchvision lists ResNet-50 (v1.5) at 4.09 "GFLOPS", which are multiply-adds; at 2 FLOPs per
    # multiply-add that is 8.18e9.  (He et al.'s 3.8e9 is for v1, stride in the first 1x1.)
    model = models.create("resnet50", 1000, (224, 224, 3))
    flops = model_stats.describe(model)["flops_per_image"]
    assert flops == pytest.approx(8.2e9, rel=0.02)


def test_describe_needs_fixed_input_size():
    model = models.create("cifar_resnet8", 10, (None, None, 3))
    with pytest.raises(ValueError, match="fixed input"):
        model_stats.describe(model)


def test_resnet50_is_v1_5_with_stride_in_the_3x3_conv(small_models):
    model = small_models("resnet50")
    assert model.get_layer("stage2_block1_conv1").strides == (1, 1)
    assert model.get_layer("stage2_block1_conv2").strides == (2, 2)
    assert model.get_layer("stage2_block1_conv2").kernel_size == (3, 3)
    assert model.get_layer("stage2_block1_shortcut_conv").strides == (2, 2)


# --- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_forward_backward_and_sgd_step(name, small_models):
    model = small_models(name)
    num_classes, input_shape = _small_setup(name)
    images = _random_images(input_shape)
    labels = _random_labels(num_classes)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = loss_fn(labels, logits)
    gradients = tape.gradient(loss, model.trainable_variables)

    assert tuple(logits.shape) == (SMALL_BATCH_SIZE, num_classes)
    assert np.isfinite(float(loss))
    for variable, gradient in zip(model.trainable_variables, gradients):
        assert gradient is not None, f"no gradient for {variable.path}"
        assert np.all(np.isfinite(gradient)), f"non-finite gradient for {variable.path}"

    before = [variable.numpy() for variable in model.trainable_variables]
    keras.optimizers.SGD(learning_rate=0.1).apply_gradients(zip(gradients, model.trainable_variables))
    unchanged = [variable.path for variable, old in zip(model.trainable_variables, before)
                 if np.array_equal(variable.numpy(), old)]
    assert not unchanged, f"SGD step left these weights unchanged: {unchanged}"


# --- input and dtypes ----------------------------------------------------------------------------


def test_accepts_uint8_and_integer_valued_float32(small_models):
    model = small_models("cifar_resnet8")
    images = _random_images((32, 32, 3))
    assert model.inputs[0].dtype == "uint8"
    logits_from_uint8 = model(images, training=False)
    logits_from_float32 = model(images.astype(np.float32), training=False)
    np.testing.assert_allclose(logits_from_uint8, logits_from_float32, rtol=1e-6, atol=1e-6)


def test_normalization_is_fixed_and_weightless(small_models):
    model = small_models("cifar_resnet8")
    normalize = model.get_layer("normalize")
    assert normalize.weights == []
    images = np.array([[[[0, 128, 255]]]], dtype=np.uint8)
    expected = (images - np.array(models.IMAGENET_MEAN_RGB)) / np.array(models.IMAGENET_STDDEV_RGB)
    np.testing.assert_allclose(normalize(images), expected, rtol=1e-6)


def test_mixed_bfloat16_computes_in_bfloat16_with_float32_logits(mixed_bfloat16_policy):
    model = models.create("cifar_resnet8", 10, (32, 32, 3))
    assert model.get_layer("stem_conv").compute_dtype == "bfloat16"
    logits = model(_random_images((32, 32, 3)), training=False)
    assert logits.dtype == "float32"
    assert np.all(np.isfinite(logits))


def test_policy_restored_after_mixed_precision_test():
    assert keras.mixed_precision.global_policy().name == "float32"


# --- initialisation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, last_bn_suffix", [("cifar_resnet8", "_bn2"), ("resnet50", "_bn3")])
@pytest.mark.parametrize("zero_init_residual", [True, False])
def test_zero_init_residual(name, last_bn_suffix, zero_init_residual):
    num_classes, input_shape = _small_setup(name)
    model = models.create(name, num_classes, input_shape, zero_init_residual=zero_init_residual)
    last_bns = [layer for layer in _batch_norm_layers(model, last_bn_suffix) if "_block" in layer.name]
    num_blocks = sum(isinstance(layer, keras.layers.Add) for layer in model.layers)  # one Add per block
    assert len(last_bns) == num_blocks > 0
    expected_gamma = 0.0 if zero_init_residual else 1.0
    for layer in last_bns:
        assert np.all(layer.gamma.numpy() == expected_gamma), layer.name
    shortcut_bns = _batch_norm_layers(model, "_shortcut_bn")
    assert shortcut_bns
    for layer in shortcut_bns + _batch_norm_layers(model, "_bn1"):
        assert np.all(layer.gamma.numpy() == 1.0), layer.name


# --- layout and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cifar_resnet20", "resnet50"])
def test_channels_first_builds_with_same_size(name):
    # TF on CPU cannot run NCHW convolutions, so only build the graph and compare sizes.
    num_classes, input_shape = _small_setup(name)
    nhwc = models.create(name, num_classes, input_shape)
    nchw = models.create(name, num_classes, input_shape, data_format="channels_first")
    assert model_stats.describe(nchw) == model_stats.describe(nhwc)
    assert tuple(nchw.get_layer("to_channels_first").output.shape) == (None, 3, *input_shape[:2])
    assert all(layer.axis == [1] or layer.axis == 1 for layer in _batch_norm_layers(nchw, ""))
    assert all(layer.data_format == "channels_first"
               for layer in nchw.layers if isinstance(layer, keras.layers.Conv2D))


def test_save_and_reload_keeps_outputs(small_models, tmp_path):
    model = small_models("cifar_resnet8")
    path = tmp_path / "cifar_resnet8.keras"
    model.save(path)
    reloaded = keras.saving.load_model(path)
    images = _random_images((32, 32, 3))
    np.testing.assert_allclose(reloaded(images, training=False), model(images, training=False), rtol=1e-6, atol=1e-6)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as error:
        models.create("resnet51", 1000, (224, 224, 3))
    message = str(error.value)
    assert "resnet51" in message
    assert "resnet50" in message and "cifar_resnet20" in message


def test_every_builder_is_named_after_its_key():
    for name, builder in models.MODELS.items():
        assert builder.__name__ == name


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="bn_momentun"):
        models.create("cifar_resnet8", 10, (32, 32, 3), bn_momentun=0.9)


def test_create_from_config_reads_the_model_and_data_keys():
    cfg = tfs_config.base_config()
    cfg.model.name = "cifar_resnet8"
    cfg.data.num_classes = 7
    cfg.data.image_size = 24
    cfg.model.zero_init_residual = False
    cfg.model.bn_momentum = 0.8
    cfg.model.bn_epsilon = 1e-3
    cfg.model.sync_bn = True
    cfg.model.data_format = "channels_first"
    model = build.create_from_config(cfg)
    assert model.name == "cifar_resnet8"
    assert tuple(model.inputs[0].shape) == (None, 24, 24, 3) and tuple(model.outputs[0].shape) == (None, 7)
    batch_norms = _batch_norm_layers(model, "")
    assert batch_norms and all(layer.momentum == 0.8 and layer.epsilon == 1e-3 and layer.synchronized
                               and np.all(layer.gamma.numpy() == 1.0) for layer in batch_norms)
    assert model.get_layer("stem_conv").data_format == "channels_first"
    np.testing.assert_allclose(model.get_layer("normalize").mean_rgb, models.IMAGENET_MEAN_RGB)
