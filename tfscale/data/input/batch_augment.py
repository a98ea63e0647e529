"""Batch augmentation with Keras core preprocessing layers (RandAugment, MixUp, CutMix), in tf.data.

`batch_augmenter(name, ...)` returns a function for `ds.batch(...).map(fn)`: uint8 images in, uint8
images out (the model takes uint8), labels one-hot/soft where the images are mixed.

RandAugment by default runs only the operations it draws (`_randaugment_select`, ~15x faster than
the layer's own call), through Keras internals verified on the Keras versions in
_RANDAUGMENT_VERIFIED_KERAS; on any other version it falls back to the layer's call with a warning.
"""

from __future__ import annotations

import functools
import re

import tensorflow as tf
from absl import logging

BATCH_AUGMENTS = ("none", "randaugment", "mixup", "cutmix")

_BATCH_OPTIONS = {
    "randaugment_ops": 2, "randaugment_factor": 0.5, "randaugment_impl": "select", "mixup_alpha": 0.2,
    "cutmix_factor": 1.0, "seed": None,
}
_RANDAUGMENT_IMPLS = ("select", "keras")


def _to_uint8(images):
    """Float images in ~[0, 255] -> uint8, rounded (the model takes uint8)."""
    return tf.cast(tf.clip_by_value(images, 0.0, 255.0) + 0.5, tf.uint8)


# `_randaugment_select` runs keras.layers.RandAugment's operation sub-layers itself, through internals
# read in keras/src/layers/preprocessing/image_preprocessing/rand_augment.py: the class attribute
# _AUGMENT_LAYERS (attribute names of its 11 operation layers, in the order its own draw indexes),
# each operation's get_random_transformation/transform_images, and the layer's num_ops and
# SeedGenerator `generator`. Verified (same operations, same distribution) on these Keras versions,
# first and last included:
_RANDAUGMENT_VERIFIED_KERAS = ((3, 10), (3, 15))
_OPERATION_METHODS = ("get_random_transformation", "transform_images")


def _randaugment_unsupported(layer, keras_version: str) -> str | None:
    """Why `_randaugment_select` must not use this layer's internals, or None when it may."""
    match = re.match(r"(\d+)\.(\d+)", keras_version)
    first, last = _RANDAUGMENT_VERIFIED_KERAS
    if not match or not first <= (int(match.group(1)), int(match.group(2))) <= last:
        return f"it is verified on Keras {first[0]}.{first[1]}-{last[0]}.{last[1]} only"
    names = getattr(layer, "_AUGMENT_LAYERS", None)
    if not names or not all(hasattr(getattr(layer, name, None), m) for name in names for m in _OPERATION_METHODS):
        return "this RandAugment has no _AUGMENT_LAYERS operation sub-layers"
    if not hasattr(layer, "num_ops") or not hasattr(layer, "generator"):
        return "this RandAugment has no num_ops/generator"
    return None


@functools.lru_cache(maxsize=None)  # once per process (and reason): every input pipeline builds one
def _warn_slow_randaugment(keras_version: str, reason: str) -> None:
    logging.warning("RandAugment: Keras %s, falling back to keras.layers.RandAugment's own call, ~15x slower "
                    "(~45 ms instead of ~3 ms of CPU per 224x224 image): the fast path is off because %s. "
                    "Check the fast path on this version (tests/test_preprocess.py), then extend "
                    "tfscale.data.input.batch_augment._RANDAUGMENT_VERIFIED_KERAS.",
                    keras_version, reason)


def _randaugment_select(layer):
    """keras.layers.RandAugment's own operations, but only the drawn ones are computed.

    The layer's call() evaluates all 11 operations for every one of its `num_ops` slots and keeps
    the drawn one with `where`: ~45 ms of CPU per 224x224 image here, i.e. ~40 img/s on this 2-core
    machine. Drawing the operation index the same way (uniform, once per slot and batch) and running
    only that branch with `tf.switch_case` gives the same distribution of outputs for ~1/10 of the
    cost (~3 ms/img). Returns None, with a warning, where the Keras internals this uses are not
    verified (`_randaugment_unsupported`).
    """
    import keras

    reason = _randaugment_unsupported(layer, keras.__version__)
    if reason:
        _warn_slow_randaugment(keras.__version__, reason)
        return None
    operations = [getattr(layer, name) for name in layer._AUGMENT_LAYERS]

    def branch(operation, images):
        def run():
            transformation = operation.get_random_transformation(images, training=True, seed=layer.generator)
            return tf.cast(operation.transform_images(images, transformation, training=True), tf.float32)

        return run

    def apply(images):
        images = tf.cast(images, tf.float32)
        for _ in range(layer.num_ops):
            index = keras.random.randint((), 0, len(operations), seed=layer.generator)
            out = tf.switch_case(tf.cast(index, tf.int32), [branch(op, images) for op in operations])
            out.set_shape(images.shape)
            images = out
        return images

    return apply


def batch_augmenter(name: str, *, num_classes: int, **options):
    """A function (images, labels) -> (images, labels) for `ds.batch(...).map(fn)`, or None.

    name: "randaugment" | "mixup" | "cutmix" | "none" / "" (-> None).
    options (all optional; the ones another augmenter uses are ignored, unknown ones rejected):
      randaugment_ops (2), randaugment_factor (0.5), mixup_alpha (0.2), cutmix_factor (1.0),
      randaugment_impl ("select": compute only the drawn operations, see `_randaugment_select`;
      "keras": the layer's own call, ~15x slower), seed (None: int seed of the layers' SeedGenerator).

    Input: uint8 images [B, H, W, 3] and int class ids [B].
      randaugment   -> (uint8 images, labels unchanged)
      mixup, cutmix -> (uint8 images, float32 soft labels [B, num_classes], rows summing to 1)
    The layers compute in float32 (dtype pinned, whatever the global mixed-precision policy);
    images are rounded back to uint8 (mixing error <= 0.5 level) since the model takes uint8.
    Soft labels (float [B, num_classes]) are accepted as input too.

    Keras 3 semantics to know: RandAugment draws its `num_ops` operations once per *batch* (all
    images of a batch get the same operations, with per-image magnitudes); MixUp/CutMix pair each
    image with a random permutation of the same batch (one mixing weight per image; CutMix derives
    the label weight from the pasted box's area). The layers are built on the host CPU so their
    seed-state variable lives next to tf.data.
    """
    if not name or name == "none":
        return None
    opts = _batch_options(name, options)
    if name == "randaugment":
        return _randaugment(opts)
    if name == "mixup":
        return _mixup(opts, num_classes)
    return _cutmix(opts, num_classes)


def _batch_options(name: str, options: dict) -> dict:
    """`options` over the defaults, after checking `name` and every option; raises ValueError."""
    if name not in BATCH_AUGMENTS:
        raise ValueError(f"batch augment {name!r} is not one of {BATCH_AUGMENTS}")
    unknown = sorted(set(options) - set(_BATCH_OPTIONS))
    if unknown:
        raise ValueError(f"unknown batch_augmenter options {unknown}; valid: {sorted(_BATCH_OPTIONS)}")
    opts = {**_BATCH_OPTIONS, **options}
    if opts["randaugment_impl"] not in _RANDAUGMENT_IMPLS:
        raise ValueError(f"randaugment_impl={opts['randaugment_impl']!r} is not one of {_RANDAUGMENT_IMPLS}")
    return opts


# The augmenters build their layers on the host CPU and import Keras only when called: parsing and
# per-example preprocessing do not need Keras.


def _randaugment(opts: dict):
    """(images, labels) -> (RandAugmented uint8 images, the same labels)."""
    import keras

    with tf.device("/CPU:0"):
        layer = keras.layers.RandAugment(
            value_range=(0, 255), num_ops=int(opts["randaugment_ops"]),
            factor=float(opts["randaugment_factor"]), seed=opts["seed"], dtype="float32",
        )
        layer.build((None, None, None, 3))
    select = _randaugment_select(layer) if opts["randaugment_impl"] == "select" else None
    apply = select or (lambda images: layer(images, training=True))

    def randaugment(images, labels):
        out = _to_uint8(apply(images))
        out.set_shape(images.shape)
        return out, labels

    return randaugment


def _mixup(opts: dict, num_classes: int):
    import keras

    with tf.device("/CPU:0"):
        layer = keras.layers.MixUp(alpha=float(opts["mixup_alpha"]), seed=opts["seed"], dtype="float32")
    return _mixing(layer, num_classes, "mixup")


def _cutmix(opts: dict, num_classes: int):
    import keras

    with tf.device("/CPU:0"):
        layer = keras.layers.CutMix(factor=float(opts["cutmix_factor"]), seed=opts["seed"], dtype="float32")
    return _mixing(layer, num_classes, "cutmix")


def _mixing(layer, num_classes: int, name: str):
    """(images, labels) -> (mixed uint8 images, float32 soft labels) through a MixUp/CutMix `layer`."""

    def mix(images, labels):
        if labels.dtype.is_floating:
            soft = tf.cast(labels, tf.float32)
        else:
            soft = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=tf.float32)
        out = layer({"images": images, "labels": soft}, training=True)
        mixed = _to_uint8(out["images"])
        mixed.set_shape(images.shape)
        soft_out = tf.cast(out["labels"], tf.float32)
        soft_out.set_shape(soft.shape)
        return mixed, soft_out

    mix.__name__ = name
    return mix
