"""ResNet image classifiers: the ImageNet ResNet v1.5 family and the CIFAR ResNets.

Two families, one set of conventions:

* ``resnet18/34/50/101/152`` -- ImageNet ResNets (He et al. 2016, "Deep Residual Learning") in the
  "v1.5" variant used by torchvision, NVIDIA and MLPerf: in bottleneck blocks the stride-2 sits in the
  3x3 conv rather than the first 1x1, which costs ~5% more FLOPs for ~0.5% more top-1 accuracy.
  Stem: 7x7/2 conv + BN + ReLU + 3x3/2 max pool; basic blocks (18/34) or bottleneck blocks
  (50/101/152) in four stages; projection shortcut (1x1 conv + BN) wherever the shape changes.
* ``cifar_resnet{8,20,32,44,56,110}`` -- the 6n+2-layer CIFAR ResNets of He et al. 2016 sec. 4.2:
  3x3 conv with 16 filters, then three stages of n basic blocks with 16/32/64 filters.  The paper uses
  parameter-free zero-padded identity shortcuts ("option A"); here shape-changing shortcuts are
  1x1 conv + BN projections, which adds ~1% parameters.  ``cifar_resnet8`` (n=1) is a tiny model for
  smoke tests.

Every model takes NHWC images of 0-255 values, declared ``uint8`` because that is what the tf.data
pipeline produces: shipping uint8 to the accelerator moves 4x fewer bytes than float32, and the first
layer casts and normalises ``(x - mean_rgb) / stddev_rgb`` on the device.  Float input is accepted
too, but Keras casts it to uint8 first (fractions are truncated, out-of-range values wrap), so it
must hold 0-255 values.  With
``data_format="channels_first"`` the normalised images are transposed to NCHW, which is what cuDNN
prefers for float32 on older GPUs.

Layers follow the global Keras dtype policy (e.g. ``mixed_bfloat16``) except the ``logits`` head,
which is float32 so that the loss is computed in float32.  The models output logits (no softmax).

Initialisation follows Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): MSRA fan-out normal
conv kernels, N(0, 0.01) dense head, and optionally zero gamma in the last BatchNorm of every
residual block so that each block starts as the identity.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import keras
from keras import layers, ops

# Per-channel ImageNet statistics on the 0-255 scale (the values used by torchvision and TF official).
IMAGENET_MEAN_RGB = (123.68, 116.78, 103.94)
IMAGENET_STDDEV_RGB = (58.393, 57.12, 57.375)

_DATA_FORMATS = ("channels_last", "channels_first")
_IMAGENET_STAGE_FILTERS = (64, 128, 256, 512)
_CIFAR_STAGE_FILTERS = (16, 32, 64)
_BOTTLENECK_EXPANSION = 4  # a bottleneck block outputs 4x the filters of its 3x3 conv


@keras.saving.register_keras_serializable(package="tfscale")
class ImageNormalization(layers.Layer):
    """Casts images of any dtype and applies ``(x - mean_rgb) / stddev_rgb`` per channel.

    A Layer subclass rather than a Lambda so that saved ``.keras`` models reload without unsafe
    deserialisation.  It has no weights, so there is nothing to train and nothing to ``adapt``.
    The arithmetic is done in float32 and only the result is cast to the compute dtype: in bfloat16
    (8 significant bits) the mean 123.68 itself would already be off by ~0.2.  Autocasting is off so
    that float input also reaches ``call`` unrounded.
    """

    def __init__(self, mean_rgb: Sequence[float], stddev_rgb: Sequence[float], **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.mean_rgb = tuple(float(value) for value in mean_rgb)
        self.stddev_rgb = tuple(float(value) for value in stddev_rgb)

    def call(self, images):
        images = ops.cast(images, "float32")
        mean = ops.convert_to_tensor(self.mean_rgb, dtype="float32")
        stddev = ops.convert_to_tensor(self.stddev_rgb, dtype="float32")
        return ops.cast((images - mean) / stddev, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "mean_rgb": self.mean_rgb, "stddev_rgb": self.stddev_rgb}


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How a model is built, besides its name, class count and input shape: the keyword arguments
    of `create` and of every `MODELS` builder, threaded through the layer builders.

    Attributes:
      zero_init_residual: start the last BN gamma of every residual block at 0 (Goyal et al.).
      bn_momentum: Keras convention, ``moving = momentum * moving + (1 - momentum) * batch``
        (0.9 here equals PyTorch's ``momentum=0.1``).
      bn_epsilon: BatchNorm variance epsilon.
      data_format: layout used inside the network; input is always NHWC.
      mean_rgb, stddev_rgb: per-channel normalisation on the 0-255 scale.
      sync_bn: BatchNorm statistics over the global batch (all replicas) instead of per replica.
      bn_group_size: BatchNorm training statistics over groups of this many examples of a replica's batch
        (`GhostBatchNormalization`); 0: over the replica's whole batch.
    """

    zero_init_residual: bool = True
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    data_format: str = "channels_last"
    mean_rgb: Sequence[float] = IMAGENET_MEAN_RGB
    stddev_rgb: Sequence[float] = IMAGENET_STDDEV_RGB
    sync_bn: bool = False
    bn_group_size: int = 0

    @property
    def channel_axis(self) -> int:
        return 1 if self.data_format == "channels_first" else -1


# --- layer helpers -------------------------------------------------------------------------------


def _conv_kernel_initializer() -> keras.initializers.Initializer:
    """MSRA init as in Goyal et al.; a fresh instance per layer because Keras 3 initialisers
    without an explicit seed reuse their seed on every call, giving same-shaped layers equal weights."""
    return keras.initializers.VarianceScaling(2.0, mode="fan_out", distribution="untruncated_normal")


def _conv(x, filters: int, kernel_size: int, stride: int, name: str, opts: ModelOptions):
    """Bias-free conv (the following BatchNorm has its own shift).

    Strided convs pad explicitly and symmetrically ((k-1)//2 on each side, as torchvision and TF
    official ResNets do) instead of using "same", which on even inputs pads only bottom/right;
    this keeps results independent of input parity and weights portable from torchvision.
    """
    padding = "same"
    if stride > 1 and kernel_size > 1:
        x = layers.ZeroPadding2D((kernel_size - 1) // 2, data_format=opts.data_format, name=f"{name}_pad")(x)
        padding = "valid"
    return layers.Conv2D(
        filters,
        kernel_size,
        strides=stride,
        padding=padding,
        use_bias=False,
        kernel_initializer=_conv_kernel_initializer(),
        data_format=opts.data_format,
        name=name,
    )(x)


def _batch_norm(x, name: str, opts: ModelOptions, *, closes_residual_branch: bool = False):
    """BatchNorm; with ``zero_init_residual`` the BN closing a residual branch starts at gamma=0."""
    zero_gamma = closes_residual_branch and opts.zero_init_residual
    ghost = {"group_size": opts.bn_group_size} if opts.bn_group_size else {}
    return (GhostBatchNormalization if ghost else layers.BatchNormalization)(
        **ghost,
        axis=opts.channel_axis,
        momentum=opts.bn_momentum,
        epsilon=opts.bn_epsilon,
        gamma_initializer="zeros" if zero_gamma else "ones",
        # Cross-replica batch statistics: with them, N replicas x batch b compute exactly what one
        # replica with batch N*b computes (and small per-GPU batches normalise better).
        synchronized=opts.sync_bn,
        name=name,
    )(x)


@keras.saving.register_keras_serializable(package="tfscale")
class GhostBatchNormalization(layers.BatchNormalization):
    """BatchNormalization whose training statistics are those of groups of `group_size` consecutive examples
    (ghost batch norm, Hoffer et al. 2017): one device with batch G x group_size normalises as G replicas of
    group_size with per-replica BatchNorm do, and updates the moving statistics with the mean of the groups'
    statistics, as tfscale's replicas average theirs after each step. Inference and frozen layers are plain
    BatchNorm. The batch must be a multiple of `group_size` (validation.validate checks the per-replica batch).
    """

    def __init__(self, group_size: int, **kwargs):
        super().__init__(**kwargs)
        self.group_size = group_size

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or mask is not None or self.renorm:
            return super().call(inputs, training=training, mask=mask)
        x = ops.cast(inputs, "float32")  # as BatchNormalization: float16 statistics overflow
        grouped = ops.reshape(x, (-1, self.group_size, *x.shape[1:]))
        channel_axis = self.axis % len(x.shape) + 1  # in the grouped tensor
        reduce_axes = [a for a in range(1, len(grouped.shape)) if a != channel_axis]
        mean, variance = ops.moments(grouped, axes=reduce_axes, keepdims=True)
        normalized = (grouped - mean) * ops.rsqrt(variance + self.epsilon)
        shape = [1] * len(grouped.shape)
        shape[channel_axis] = -1
        if self.scale:
            normalized = normalized * ops.reshape(ops.cast(self.gamma, "float32"), shape)
        if self.center:
            normalized = normalized + ops.reshape(ops.cast(self.beta, "float32"), shape)
        for moving, batch_value in ((self.moving_mean, mean), (self.moving_variance, variance)):
            group_average = ops.reshape(ops.mean(batch_value, axis=0), (-1,))
            moving.assign(ops.cast(moving, "float32") * self.momentum + group_average * (1.0 - self.momentum))
        return ops.cast(ops.reshape(normalized, ops.shape(x)), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "group_size": self.group_size}


def _conv_bn_relu(x, filters: int, kernel_size: int, stride: int, prefix: str, index: int, opts: ModelOptions):
    x = _conv(x, filters, kernel_size, stride, f"{prefix}_conv{index}", opts)
    x = _batch_norm(x, f"{prefix}_bn{index}", opts)
    return layers.ReLU(name=f"{prefix}_relu{index}")(x)


# --- residual blocks -----------------------------------------------------------------------------


def _shortcut(x, out_filters: int, stride: int, prefix: str, opts: ModelOptions):
    """Identity when the shape is unchanged, else a 1x1 conv + BN projection (never zero-gamma)."""
    if stride == 1 and x.shape[opts.channel_axis] == out_filters:
        return x
    x = _conv(x, out_filters, 1, stride, f"{prefix}_shortcut_conv", opts)
    return _batch_norm(x, f"{prefix}_shortcut_bn", opts)


def _merge(residual, shortcut, prefix: str):
    x = layers.Add(name=f"{prefix}_add")([shortcut, residual])
    return layers.ReLU(name=f"{prefix}_out")(x)


def _basic_block(x, filters: int, stride: int, prefix: str, opts: ModelOptions):
    """Two 3x3 convs (ResNet-18/34 and CIFAR); the stride is in the first."""
    shortcut = _shortcut(x, filters, stride, prefix, opts)
    y = _conv_bn_relu(x, filters, 3, stride, prefix, 1, opts)
    y = _conv(y, filters, 3, 1, f"{prefix}_conv2", opts)
    y = _batch_norm(y, f"{prefix}_bn2", opts, closes_residual_branch=True)
    return _merge(y, shortcut, prefix)


def _bottleneck_block(x, filters: int, stride: int, prefix: str, opts: ModelOptions):
    """1x1 reduce, 3x3, 1x1 expand (ResNet-50/101/152); v1.5: the stride is in the 3x3 conv."""
    out_filters = filters * _BOTTLENECK_EXPANSION
    shortcut = _shortcut(x, out_filters, stride, prefix, opts)
    y = _conv_bn_relu(x, filters, 1, 1, prefix, 1, opts)
    y = _conv_bn_relu(y, filters, 3, stride, prefix, 2, opts)
    y = _conv(y, out_filters, 1, 1, f"{prefix}_conv3", opts)
    y = _batch_norm(y, f"{prefix}_bn3", opts, closes_residual_branch=True)
    return _merge(y, shortcut, prefix)


def _stage(
    x, block_fn: Callable, filters: int, num_blocks: int, first_stride: int, stage_index: int, opts: ModelOptions
):
    """``num_blocks`` blocks; only the first one downsamples."""
    for block_index in range(1, num_blocks + 1):
        stride = first_stride if block_index == 1 else 1
        x = block_fn(x, filters, stride, f"stage{stage_index}_block{block_index}", opts)
    return x


# --- backbones -----------------------------------------------------------------------------------


def _imagenet_backbone(x, opts: ModelOptions, *, block_fn: Callable, blocks_per_stage: Sequence[int]):
    """7x7/2 conv stem + 3x3/2 max pool (4x downsampling), then four stages at strides 1, 2, 2, 2."""
    x = _conv(x, 64, 7, 2, "stem_conv", opts)
    x = _batch_norm(x, "stem_bn", opts)
    x = layers.ReLU(name="stem_relu")(x)
    # Zero padding is equivalent to torchvision's -inf padding here because the input is post-ReLU.
    x = layers.ZeroPadding2D(1, data_format=opts.data_format, name="stem_pool_pad")(x)
    x = layers.MaxPooling2D(3, strides=2, data_format=opts.data_format, name="stem_pool")(x)
    for stage_index, (filters, num_blocks) in enumerate(zip(_IMAGENET_STAGE_FILTERS, blocks_per_stage), start=1):
        first_stride = 1 if stage_index == 1 else 2
        x = _stage(x, block_fn, filters, num_blocks, first_stride, stage_index, opts)
    return x


def _cifar_backbone(x, opts: ModelOptions, *, blocks_per_stage: int):
    """3x3 conv with 16 filters, then three stages of basic blocks (16/32/64 filters, strides 1/2/2)."""
    x = _conv(x, _CIFAR_STAGE_FILTERS[0], 3, 1, "stem_conv", opts)
    x = _batch_norm(x, "stem_bn", opts)
    x = layers.ReLU(name="stem_relu")(x)
    for stage_index, filters in enumerate(_CIFAR_STAGE_FILTERS, start=1):
        first_stride = 1 if stage_index == 1 else 2
        x = _stage(x, _basic_block, filters, blocks_per_stage, first_stride, stage_index, opts)
    return x


# --- model assembly ------------------------------------------------------------------------------


def _validate(input_shape, opts: ModelOptions) -> None:
    if opts.data_format not in _DATA_FORMATS:
        raise ValueError(f"data_format must be one of {_DATA_FORMATS}, got {opts.data_format!r}")
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (height, width, channels) (NHWC images), got {input_shape}")
    num_channels = input_shape[-1]
    if not len(opts.mean_rgb) == len(opts.stddev_rgb) == num_channels:
        raise ValueError(
            f"mean_rgb {tuple(opts.mean_rgb)} and stddev_rgb {tuple(opts.stddev_rgb)} need one value per "
            f"input channel ({num_channels})"
        )


def _build_classifier(
    model_name: str, backbone: Callable, num_classes: int, input_shape: tuple[int, int, int], opts: ModelOptions
) -> keras.Model:
    """uint8 NHWC images -> normalise (-> NCHW) -> backbone -> global average pool -> float32 logits."""
    _validate(input_shape, opts)
    images = keras.Input(shape=tuple(input_shape), dtype="uint8", name="images")
    x = ImageNormalization(opts.mean_rgb, opts.stddev_rgb, name="normalize")(images)
    if opts.data_format == "channels_first":
        x = layers.Permute((3, 1, 2), name="to_channels_first")(x)
    x = backbone(x, opts)
    x = layers.GlobalAveragePooling2D(data_format=opts.data_format, name="avg_pool")(x)
    # float32 head: under mixed precision the softmax/cross-entropy must not be computed in 16 bits.
    logits = layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer="zeros",
        dtype="float32",
        name="logits",
    )(x)
    return keras.Model(images, logits, name=model_name)


def _builder(model_name: str, backbone: Callable, summary: str) -> Callable[..., keras.Model]:
    """A named builder ``(num_classes, input_shape, **options) -> keras.Model`` for ``MODELS``."""

    def build(num_classes: int, input_shape: tuple[int, int, int], **options) -> keras.Model:
        return _build_classifier(model_name, backbone, num_classes, input_shape, ModelOptions(**options))

    build.__name__ = build.__qualname__ = model_name
    build.__doc__ = f"Build {summary}.  Arguments and defaults as in `tfscale.model.models.create`."
    return build


def _imagenet_builder(model_name: str, block_fn: Callable, blocks_per_stage: tuple[int, ...]):
    backbone = partial(_imagenet_backbone, block_fn=block_fn, blocks_per_stage=blocks_per_stage)
    block_kind = "bottleneck" if block_fn is _bottleneck_block else "basic"
    return _builder(model_name, backbone, f"ImageNet ResNet v1.5, {block_kind} blocks {blocks_per_stage}")


def _cifar_builder(depth: int):
    blocks_per_stage = (depth - 2) // 6
    backbone = partial(_cifar_backbone, blocks_per_stage=blocks_per_stage)
    return _builder(f"cifar_resnet{depth}", backbone, f"CIFAR ResNet-{depth} (n={blocks_per_stage})")


MODELS: dict[str, Callable[..., keras.Model]] = {
    "resnet18": _imagenet_builder("resnet18", _basic_block, (2, 2, 2, 2)),
    "resnet34": _imagenet_builder("resnet34", _basic_block, (3, 4, 6, 3)),
    "resnet50": _imagenet_builder("resnet50", _bottleneck_block, (3, 4, 6, 3)),
    "resnet101": _imagenet_builder("resnet101", _bottleneck_block, (3, 4, 23, 3)),
    "resnet152": _imagenet_builder("resnet152", _bottleneck_block, (3, 8, 36, 3)),
    **{f"cifar_resnet{depth}": _cifar_builder(depth) for depth in (8, 20, 32, 44, 56, 110)},
}


def create(name: str, num_classes: int, input_shape: tuple[int, int, int], **options) -> keras.Model:
    """Build the model ``name`` (a key of ``MODELS``), uninitialised by any checkpoint.

    Args:
      name: e.g. ``"resnet50"`` or ``"cifar_resnet20"``.
      num_classes: width of the logits layer.
      input_shape: ``(height, width, channels)`` of the NHWC images fed to the model, whatever
        ``data_format`` is; a fixed size is needed for ``describe()``'s FLOP count.
      **options: the fields of `ModelOptions` (zero_init_residual, bn_momentum, bn_epsilon,
        data_format, mean_rgb, stddev_rgb, sync_bn), which documents them and their defaults.

    Returns:
      An uncompiled functional ``keras.Model`` mapping uint8 images to float32 logits.

    Raises:
      ValueError: for an unknown ``name`` (the message lists the valid names) or bad arguments.
      TypeError: for an option that is not a field of `ModelOptions`.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](num_classes, input_shape, **options)
