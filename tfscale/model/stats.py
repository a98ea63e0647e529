"""A built Keras model's size and cost: parameters, analytic forward FLOPs, and per-layer gradient bytes
and FLOPs (what tfscale-plan's performance model sends and computes). Convolutions (plain, depthwise,
separable) and Dense layers only.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import layers


def describe(model: keras.Model) -> dict:
    """Size and cost of a model built by this module.

    Returns a dict with:
      params: ``model.count_params()`` -- every weight, including the BatchNorm moving mean and
        variance (which are not trained but are saved in checkpoints).
      trainable_params: the weights the optimiser updates.  This is the quantity papers and
        torchvision report as "parameters" (torchvision keeps BN running statistics in buffers,
        not parameters): 25,557,032 for ResNet-50 with 1000 classes.
      gradient_bytes: what one step's gradients weigh: the trainable weights' bytes.
      flops_per_image: analytic forward-pass FLOPs for one image, counting a multiply-add as
        2 FLOPs, summed over convolutions and Dense layers only (BN, ReLU, pooling, additions and biases
        are ignored, as in the usual published figures).  ResNet-50 v1.5 at 224x224 is
        ~4.1e9 multiply-adds, i.e. ~8.2e9 FLOPs here.  Needs a fixed input size.
    """
    trainable_params = sum(math.prod(weight.shape) for weight in model.trainable_weights)
    return {
        "params": int(model.count_params()),
        "trainable_params": int(trainable_params),
        "gradient_bytes": sum(size for size, _ in layer_costs(model)),
        "flops_per_image": 2 * sum(multiply_adds_per_image(layer) for layer in model.layers),
    }


def multiply_adds_per_image(layer) -> int:
    """Kernel size (= multiply-adds per output position) times the number of output positions."""
    if isinstance(layer, (layers.DepthwiseConv2D, layers.SeparableConv2D)):
        # A depthwise kernel (kh, kw, in, multiplier) runs at every position, then a separable conv's 1x1.
        kernels = ([layer.depthwise_kernel, layer.pointwise_kernel] if isinstance(layer, layers.SeparableConv2D)
                   else [layer.kernel])
        output_shape = layer.output.shape
        positions_shape = output_shape[2:] if layer.data_format == "channels_first" else output_shape[1:-1]
        _require_known(layer, positions_shape)
        return int(sum(math.prod(k.shape) for k in kernels) * math.prod(positions_shape))
    if isinstance(layer, layers.Conv2D):
        output_shape = layer.output.shape
        positions_shape = output_shape[2:] if layer.data_format == "channels_first" else output_shape[1:-1]
    elif isinstance(layer, layers.Dense):
        positions_shape = layer.output.shape[1:-1]  # empty for the usual (batch, features) input
    else:
        return 0
    _require_known(layer, positions_shape)
    # Conv2D kernel is (kh, kw, in_channels / groups, out_channels); Dense kernel is (in, out).
    return int(math.prod(layer.kernel.shape) * math.prod(positions_shape))


def _require_known(layer, positions_shape) -> None:
    if any(size is None for size in positions_shape):
        raise ValueError(f"Layer {layer.name!r} has unknown spatial size {positions_shape}; "
                         "build the model with a fixed input_shape to count FLOPs")


def layer_costs(model) -> list[tuple[int, int]]:
    """(gradient bytes, forward FLOPs per image) of each layer of a Keras model that has trainable weights."""
    costs = []
    for layer in model.layers:
        size = sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in layer.trainable_weights)
        if size:
            costs.append((int(size), 2 * multiply_adds_per_image(layer)))
    return costs
