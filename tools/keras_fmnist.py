#!/usr/bin/env python3
"""The anchor of the time-to-accuracy benchmark: Fashion-MNIST trained as a plain Keras user would.

    python tools/keras_fmnist.py [--data_dir=/usr/share/datasets/fashion-mnist] [--train_examples=12800]

Arrays from the IDX files, a tf.data pipeline with pad-4 crop and flip, tfscale's own cifar_resnet8,
configs/fmnist_resnet.py's schedule (batch 32, LR 0.025 with a one-epoch linear warmup, /10 at epochs 4, 8
and 11 of 12, SGD with momentum 0.9 and weight decay 5e-4), and `model.compile` with Keras' defaults
(so `jit_compile="auto"`). `model.fit` evaluates on the 10,000 test images after every epoch; each epoch
prints one JSON line `{"epoch", "val_top1", "time_s"}`, seconds since the process started, which
tools/bench_time_to_accuracy.py reads.
"""

import time

START = time.time()  # before the imports: time to accuracy counts from process start

import gzip  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfscale.model import models  # noqa: E402

_DATA_DIR = flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist", "Directory of the IDX .gz files.")
_TRAIN_EXAMPLES = flags.DEFINE_integer("train_examples", 12_800, "The first this many training images.")
_EPOCHS = flags.DEFINE_integer("epochs", 12, "Training epochs.")
_SEED = flags.DEFINE_integer("seed", 0, "keras.utils.set_random_seed.")

BATCH = 32
BASE_LR = 0.2 * BATCH / 256  # configs/fmnist_resnet.py: 0.2 per 256 images
DECAY_EPOCHS = (4, 8, 11)


def read_idx(path: str) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(os.path.join(_DATA_DIR.value, f"{prefix}-images-idx3-ubyte.gz"))[..., None]
    labels = read_idx(os.path.join(_DATA_DIR.value, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64)
    return images, labels


def augment(image, label):
    image = tf.image.pad_to_bounding_box(image, 4, 4, 36, 36)
    image = tf.image.random_crop(image, (28, 28, 1))
    return tf.image.random_flip_left_right(image), label


def to_rgb(image, label):
    return tf.image.grayscale_to_rgb(image), label  # tfscale's ResNets take RGB, as tfscale's pipeline gives them


class WarmupStepDecay(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def __call__(self, step):
        epoch = tf.cast(step, tf.float32) / self.steps_per_epoch
        decay = tf.pow(0.1, tf.cast(tf.reduce_sum(tf.cast(epoch >= DECAY_EPOCHS, tf.int32)), tf.float32))
        return BASE_LR * tf.minimum(1.0, (epoch * self.steps_per_epoch + 1) / self.steps_per_epoch) * decay


class EpochLine(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(json.dumps({"epoch": epoch + 1, "val_top1": round(float(logs["val_accuracy"]), 4),
                          "time_s": round(time.time() - START, 2)}), flush=True)


def main(argv):
    del argv
    keras.utils.set_random_seed(_SEED.value)
    train_images, train_labels = load("train")
    train_images, train_labels = train_images[:_TRAIN_EXAMPLES.value], train_labels[:_TRAIN_EXAMPLES.value]
    test_images, test_labels = load("t10k")
    train = (tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(len(train_labels))
             .map(augment, num_parallel_calls=tf.data.AUTOTUNE).map(to_rgb).batch(BATCH).prefetch(tf.data.AUTOTUNE))
    test = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).map(to_rgb).batch(256)

    model = models.create("cifar_resnet8", num_classes=10, input_shape=(28, 28, 3), zero_init_residual=False)
    schedule = WarmupStepDecay(steps_per_epoch=len(train_labels) // BATCH)
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9, weight_decay=5e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(train, epochs=_EPOCHS.value, validation_data=test, callbacks=[EpochLine()], verbose=0)


if __name__ == "__main__":
    app.run(main)
