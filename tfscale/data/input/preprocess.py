"""Parsing and per-example image preprocessing for tf.data (every function works inside `Dataset.map`).

Images leave tf.data as **uint8** [S, S, 3]: the model casts and normalises on the device, so the host
moves 4x fewer bytes than with float32. Randomness is stateful by default (`seed=None`: a new draw
on every call); pass a stateless seed (int tensor of shape [2]) to make a call reproducible.

Speed choices. Measured on the 2-core dev machine with real-photo JPEGs (~508x358, quality 85-95),
output 224x224; CPU time of one core per image, tf.function loop, median of repeats:

  full decode_jpeg (TF default IDCT)                 0.60 ms
  decode_and_crop_jpeg of the random window          0.46 ms   (only the window is decoded)
  resize 300x290 -> 224, bilinear, uint8 input       0.30 ms   (+ saturate_cast: 0.35 ms)
  same, float32 input (cast included)                0.18 ms   <- used
  same, nearest 0.37 / area 0.31 / bicubic 0.59 / bilinear+antialias 1.28 ms
  decode_and_random_crop (all of it, this module)    0.72 ms   (0.86 ms with the uint8 resize)
  center_crop                                        0.72 ms

* `decode_and_crop_jpeg` saves only ~25% of a full decode on ImageNet-sized photos: the entropy
  (Huffman) decoding of every row above the window cannot be skipped (a 16x16 window at the bottom
  edge still costs 0.39 ms, 65% of a full decode). It is still the cheapest correct crop.
* `DCT_METHOD = "INTEGER_FAST"`: in TF 2.21 the default ("") *is* INTEGER_FAST (bit-identical pixels
  on every test image, same speed); INTEGER_ACCURATE is ~2% slower and differs by 1.0 level on
  average (max 17). We name INTEGER_FAST explicitly, which is what Model Garden, TFDS and Keras'
  image_dataset_from_directory get by default, and use it for train and eval alike.
* Resize: TF's ResizeBilinear kernel is ~2x slower on uint8 input than on float input, so the crop
  is cast to float32 first; bilinear without antialias (the scale factors here are < 2 on average;
  antialias costs 4x and bicubic 2x more), then rounded back to uint8.
* Non-JPEG payloads (PNGs renamed .JPEG in old ImageNet shards; PNG/BMP/GIF CIFAR-like data) take a
  `tf.cond` branch on the magic bytes: full `tf.io.decode_image`, then the same window is cut with
  `tf.slice`. The branch costs ~0.02 ms per JPEG.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

# Batch augmentation (Keras layers on whole batches) is its own module; the pipeline and the config
# checks find it here, next to the per-example augmentations.

AUGMENTS = ("imagenet", "cifar", "none")

# libjpeg IDCT used for every JPEG decode here (see the module docstring for the measurement).
DCT_METHOD = "INTEGER_FAST"
# Model Garden / tf_cnn_benchmarks random-resized-crop settings.
MIN_OBJECT_COVERED = 0.1
MAX_ATTEMPTS = 10
AREA_RANGE = (0.08, 1.0)  # of the image
ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)  # width / height
CIFAR_PAD = 4  # zero padding (as in He et al. 2016 and Model Garden's CIFAR input), then crop back

_FEATURES = {
    # Only what training needs is parsed; every other feature (format, size, synset, text,
    # filename, image/object/bbox/* of build_imagenet_data.py shards, ...) is ignored.
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def parse_example(serialized, *, label_offset: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Serialized tf.Example -> (encoded image bytes, label int32 = stored label - label_offset).

    ImageNet shards store 1-based labels (0 unused): use label_offset=1 there. Missing
    `image/encoded` or `image/class/label` is an error, never a silent default.
    """
    features = tf.io.parse_single_example(serialized, _FEATURES)
    label = tf.cast(features["image/class/label"] - label_offset, tf.int32)
    return features["image/encoded"], label


# --------------------------------------------------------------------------------------------
# Helpers


def _split_seed(seed, num: int):
    """None -> [None] * num (stateful draws); a stateless seed -> `num` independent seeds."""
    if seed is None:
        return [None] * num
    seed = tf.convert_to_tensor(seed)
    if seed.dtype not in (tf.int32, tf.int64):
        seed = tf.cast(seed, tf.int64)
    return tf.unstack(tf.random.experimental.stateless_split(seed, num))


def _resize_uint8(image, image_size: int):
    """Bilinear resize (half-pixel centers, no antialias) of a uint8 image to uint8 [S, S, C].

    The crop is cast to float32 *before* resizing: TF's ResizeBilinear kernel is ~2x slower on
    uint8 input than on float input, so cast + float resize is cheaper than resizing uint8 directly
    (measured 0.18 vs 0.30 ms per 300x290 -> 224x224 image, single core). Bilinear output is a convex
    combination of values in [0, 255], so +0.5 and a plain cast round to nearest without clipping.
    """
    resized = tf.image.resize(tf.cast(image, tf.float32), [image_size, image_size], method="bilinear",
                              antialias=False)
    return tf.cast(resized + 0.5, tf.uint8)


def _resize_if_needed(image, image_size: int):
    """Resize only when the image is not already S x S (that path returns the pixels untouched)."""
    shape = tf.shape(image)
    same = tf.logical_and(tf.equal(shape[0], image_size), tf.equal(shape[1], image_size))
    image = tf.cond(same, lambda: tf.identity(image), lambda: _resize_uint8(image, image_size))
    image.set_shape([image_size, image_size, 3])
    return image


def _flip(image, seed):
    if seed is None:
        return tf.image.random_flip_left_right(image)
    return tf.image.stateless_random_flip_left_right(image, seed=seed)


def _center_window(shape, crop_fraction: float):
    """[offset_y, offset_x, size, size] of the central square `crop_fraction` of the shorter side.

    Same arithmetic as Model Garden's center crop (size truncated, odd remainders to the far side).
    """
    height, width = shape[0], shape[1]
    size = tf.cast(crop_fraction * tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    size = tf.maximum(size, 1)
    return tf.stack([(height - size + 1) // 2, (width - size + 1) // 2, size, size])


def _random_window(shape, *, seed, area_range, aspect_ratio_range):
    """Inception-style crop window [offset_y, offset_x, h, w] for an image of `shape` [H, W, C].

    Falls back to the 87.5% center crop when sampling failed (the op then returns the whole
    image), like Model Garden.
    """
    bbox = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=[1, 1, 4])
    kwargs = dict(
        bounding_boxes=bbox, min_object_covered=MIN_OBJECT_COVERED, aspect_ratio_range=aspect_ratio_range,
        area_range=area_range, max_attempts=MAX_ATTEMPTS, use_image_if_no_bounding_boxes=True,
    )
    if seed is None:
        begin, size, _ = tf.image.sample_distorted_bounding_box(shape, **kwargs)
    else:
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(shape, seed=seed, **kwargs)
    sampled = tf.stack([begin[0], begin[1], size[0], size[1]])
    failed = tf.logical_and(tf.equal(size[0], shape[0]), tf.equal(size[1], shape[1]))
    return tf.where(failed, _center_window(shape, 0.875), sampled)


def _decode_window(encoded, window_fn: Callable[[tf.Tensor], tf.Tensor], jpeg_only: bool = False):
    """Decodes only the window `window_fn(shape)` of an image: uint8 [h, w, 3].

    JPEGs go through `decode_and_crop_jpeg` (only the window is decoded). Anything else (a PNG
    disguised as .JPEG, BMP, GIF first frame) is fully decoded by `decode_image` and then sliced.
    jpeg_only: every payload is known to be JPEG (tfscale-convert's manifest says so), so the format
    branch is left out: it costs ~4% of the training input rate.
    """

    def jpeg():
        window = window_fn(tf.image.extract_jpeg_shape(encoded))
        return tf.image.decode_and_crop_jpeg(encoded, window, channels=3, dct_method=DCT_METHOD)

    def other():
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        window = window_fn(tf.shape(image))
        return tf.slice(image, tf.stack([window[0], window[1], 0]), tf.stack([window[2], window[3], 3]))

    image = jpeg() if jpeg_only else tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image.set_shape([None, None, 3])
    return image


# --------------------------------------------------------------------------------------------
# Per-example functions


def decode_full(encoded) -> tf.Tensor:
    """Plain full decode to uint8 [H, W, 3] (JPEG with `DCT_METHOD`; PNG/BMP/GIF via decode_image).

    Also the decode-only ceiling of the input benchmark.
    """
    image = tf.cond(
        tf.io.is_jpeg(encoded),
        lambda: tf.io.decode_jpeg(encoded, channels=3, dct_method=DCT_METHOD),
        lambda: tf.io.decode_image(encoded, channels=3, expand_animations=False),
    )
    image.set_shape([None, None, 3])
    return image


def decode_and_random_crop(encoded, *, image_size: int, seed=None, area_range=AREA_RANGE,
                           aspect_ratio_range=ASPECT_RATIO_RANGE, jpeg_only: bool = False) -> tf.Tensor:
    """ImageNet training crop: random-resized crop (Inception / Model Garden) + random flip.

    Samples a window covering `area_range` of the image with aspect ratio in `aspect_ratio_range`
    (min_object_covered 0.1, 10 attempts, whole image as the box; center crop if sampling fails),
    decodes only that window, resizes it to `image_size` (bilinear) and flips it with p=0.5.
    `seed`: None (stateful) or a stateless int seed of shape [2]; `jpeg_only`: see `_decode_window`.
    Returns uint8 [S, S, 3].
    """
    box_seed, flip_seed = _split_seed(seed, 2)
    crop = _decode_window(
        encoded,
        lambda shape: _random_window(shape, seed=box_seed, area_range=area_range,
                                     aspect_ratio_range=aspect_ratio_range),
        jpeg_only,
    )
    image = _flip(_resize_uint8(crop, image_size), flip_seed)
    image.set_shape([image_size, image_size, 3])
    return image


def center_crop(encoded, *, image_size: int, crop_fraction: float = 0.875, jpeg_only: bool = False) -> tf.Tensor:
    """ImageNet eval: the central square `crop_fraction` of the shorter side, resized to S x S.

    Only that window is decoded (for JPEGs). Returns uint8 [S, S, 3].
    """
    crop = _decode_window(encoded, lambda shape: _center_window(shape, crop_fraction), jpeg_only)
    image = _resize_uint8(crop, image_size)
    image.set_shape([image_size, image_size, 3])
    return image


def cifar_augment(image_uint8, *, seed=None) -> tf.Tensor:
    """CIFAR augmentation of one image [H, W, C]: zero-pad 4 px per side, random H x W crop, flip.

    Zero padding (not reflect), as in He et al. 2016 and Model Garden. Shape and dtype unchanged.
    """
    image = tf.convert_to_tensor(image_uint8)
    crop_seed, flip_seed = _split_seed(seed, 2)
    shape = tf.shape(image)
    padded = tf.pad(image, [[CIFAR_PAD, CIFAR_PAD], [CIFAR_PAD, CIFAR_PAD], [0, 0]])
    if crop_seed is None:
        offsets = tf.random.uniform([2], 0, 2 * CIFAR_PAD + 1, dtype=tf.int32)
    else:
        offsets = tf.random.stateless_uniform([2], crop_seed, 0, 2 * CIFAR_PAD + 1, dtype=tf.int32)
    cropped = tf.slice(padded, tf.concat([offsets, [0]], 0), shape)
    cropped.set_shape(image.shape)
    return _flip(cropped, flip_seed)


def _check_augment(augment: str) -> None:
    if augment not in AUGMENTS:
        raise ValueError(f"augment={augment!r} is not one of {AUGMENTS}")


def train_preprocess(encoded, *, image_size: int, augment: str, seed=None, jpeg_only: bool = False) -> tf.Tensor:
    """Encoded image -> augmented uint8 [S, S, 3] for training.

    imagenet: random-resized crop (only the window decoded) + flip.
    cifar:    full decode, resize to S if needed, pad 4 + random crop + flip.
    none:     full decode, resize to S if needed; no randomness.
    jpeg_only (imagenet): every payload is a JPEG, no format branch (see `_decode_window`).
    """
    _check_augment(augment)
    if augment == "imagenet":
        return decode_and_random_crop(encoded, image_size=image_size, seed=seed, jpeg_only=jpeg_only)
    image = _resize_if_needed(decode_full(encoded), image_size)
    if augment == "cifar":
        image = cifar_augment(image, seed=seed)
    return image


def eval_preprocess(encoded, *, image_size: int, augment: str, crop_fraction: float = 0.875,
                    jpeg_only: bool = False) -> tf.Tensor:
    """Encoded image -> deterministic uint8 [S, S, 3] for evaluation.

    imagenet: center crop of `crop_fraction` of the shorter side, resized. cifar/none: full decode,
    resize to S if needed. jpeg_only: as in `train_preprocess`.
    """
    _check_augment(augment)
    if augment == "imagenet":
        return center_crop(encoded, image_size=image_size, crop_fraction=crop_fraction, jpeg_only=jpeg_only)
    return _resize_if_needed(decode_full(encoded), image_size)
