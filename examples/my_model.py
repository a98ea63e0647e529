"""Your own model in tfscale: a builder function in a file of yours.

    tfscale-train --config=digits --workdir=runs/mine --config.data.data_dir=runs/demo/shards \
        --config.model.name=examples/my_model.py:build_model

tfscale calls `build_model(num_classes=..., input_shape=(height, width, 3), **config.model.options)`
(a recipe file sets options, e.g. `c.model.options.width = 64`) and trains what it returns on every
backend. The contract (docs/training.md, "Your own model"):

* a functional or Sequential `keras.Model`;
* one input of `input_shape`: uint8 NHWC images of 0-255 values, as tfscale's input pipeline and the
  exported model's serving signature give them, so the model normalises them itself;
* one output: `num_classes` logits, no softmax. A float32 last layer keeps the loss in float32 under
  mixed precision.

Weight decay and LARS reach the variables whose names end in `kernel` (Conv2D, DepthwiseConv2D, Dense),
not BatchNorm's or the biases. `config.model.sync_bn`, `bn_group_size`, `bn_momentum` and `bn_epsilon`
reach every BatchNormalization layer. Keras layers only: then `model.keras` of `tfscale-export` loads
anywhere, without this file.
"""

import keras
from keras import layers


def build_model(num_classes, input_shape, width=32, dropout_rate=0.0):
    """A compact CNN: three stages of two 3x3 conv + BatchNorm + ReLU blocks, the width doubling per stage."""
    images = keras.Input(shape=input_shape, dtype="uint8", name="images")
    x = layers.Rescaling(1 / 127.5, offset=-1.0, name="to_unit_range")(images)  # 0-255 -> [-1, 1]
    for stage, filters in enumerate((width, 2 * width, 4 * width)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                              name=f"stage{stage}_conv{block}")(x)
            x = layers.BatchNormalization(name=f"stage{stage}_bn{block}")(x)
            x = layers.ReLU(name=f"stage{stage}_relu{block}")(x)
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    if dropout_rate:
        x = layers.Dropout(dropout_rate, name="dropout")(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(images, logits, name="my_cnn")
