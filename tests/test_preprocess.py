"""tfscale.data.input.preprocess: parsing and per-example / per-batch preprocessing, in tf.data graph mode."""

import io
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from PIL import Image  # noqa: E402

from tfscale.data.input import batch_augment, preprocess  # noqa: E402

S = 64  # output size used by most tests (small keeps them fast)


def _photo(height, width, seed=0):
    """A photo-like image: smooth colour gradients, a few shapes and mild noise (uint8 HxWx3)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([
        127 + 100 * np.sin(x / (7 + seed)) * np.cos(y / 11),
        127 + 100 * np.cos((x + y) / 13),
        255 * x / width,
    ], axis=-1)
    for _ in range(6):
        cy, cx, r = rng.integers(0, height), rng.integers(0, width), rng.integers(5, 30)
        img[(y - cy) ** 2 + (x - cx) ** 2 < r ** 2] = rng.integers(0, 256, 3)
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(array, fmt, **kwargs):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kwargs)
    return buf.getvalue()


def _bytes(v):
    if isinstance(v, str):  # as the Python 3 version of build_imagenet_data.py's _bytes_feature does
        v = v.encode("utf-8")
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))


def _int64(v):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=v if isinstance(v, list) else [v]))


def _float(v):
    return tf.train.Feature(float_list=tf.train.FloatList(value=v))


def _standard_example(encoded, label, height, width, fmt=b"JPEG"):
    """The ImageNet layout written by most converters (tfscale's included)."""
    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": _bytes(encoded), "image/format": _bytes(fmt), "image/height": _int64(height),
        "image/width": _int64(width), "image/channels": _int64(3), "image/colorspace": _bytes(b"RGB"),
        "image/class/label": _int64(label), "image/class/synset": _bytes(b"n01440764"),
        "image/class/text": _bytes(b"tench, Tinca tinca"), "image/filename": _bytes(b"n01440764_10026.JPEG"),
    }))


def _build_imagenet_data_example(encoded, label, synset, human, bbox, height, width, filename):
    """Exactly what the classic inception/data/build_imagenet_data.py `_convert_to_example` builds."""
    xmin, ymin, xmax, ymax = [], [], [], []
    for b in bbox:
        assert len(b) == 4
        [l.append(point) for l, point in zip([xmin, ymin, xmax, ymax], b)]
    colorspace, channels, image_format = b"RGB", 3, b"JPEG"
    return tf.train.Example(features=tf.train.Features(feature={
        "image/height": _int64(height),
        "image/width": _int64(width),
        "image/colorspace": _bytes(colorspace),
        "image/channels": _int64(channels),
        "image/class/label": _int64(label),
        "image/class/synset": _bytes(synset),
        "image/class/text": _bytes(human),
        "image/object/bbox/xmin": _float(xmin),
        "image/object/bbox/xmax": _float(xmax),
        "image/object/bbox/ymin": _float(ymin),
        "image/object/bbox/ymax": _float(ymax),
        "image/object/bbox/label": _int64([label] * len(xmin)),
        "image/format": _bytes(image_format),
        "image/filename": _bytes(os.path.basename(filename)),
        "image/encoded": _bytes(encoded),
    }))


@pytest.fixture(scope="module")
def images():
    photo = _photo(150, 200, seed=1)  # landscape, 4:3
    tall = _photo(180, 120, seed=2)  # portrait
    small = _photo(32, 32, seed=3)  # CIFAR-like
    return {
        "photo": photo, "tall": tall, "small": small,
        "photo_jpeg": _encode(photo, "JPEG", quality=92),
        "tall_jpeg": _encode(tall, "JPEG", quality=90),
        "photo_png": _encode(photo, "PNG"),  # the old shards' "PNG disguised as .JPEG"
        "small_png": _encode(small, "PNG"),
        "small_jpeg": _encode(small, "JPEG", quality=95),
    }


@pytest.fixture(scope="module")
def shard(images):
    """An in-memory (ram://) TFRecord shard; labels 1-based as in ImageNet shards."""
    examples = [
        (_standard_example(images["photo_jpeg"], 1, 150, 200), images["photo_jpeg"], 1),
        (_build_imagenet_data_example(
            images["tall_jpeg"], 1000, b"n15075141", b"toilet tissue, toilet paper, bathroom tissue",
            [[0.1, 0.2, 0.8, 0.9], [0.0, 0.0, 0.5, 0.5]], 180, 120, "/data/train/n15075141/n15075141_999.JPEG"),
         images["tall_jpeg"], 1000),
        (_build_imagenet_data_example(images["photo_png"], 7, b"n01530575", b"brambling", [], 150, 200,
                                      "n01530575_10086.JPEG"), images["photo_png"], 7),
        (_standard_example(images["small_png"], 3, 32, 32, fmt=b"PNG"), images["small_png"], 3),
    ]
    path = "ram://tfscale_test_preprocess/train-00000-of-00001"
    with tf.io.TFRecordWriter(path) as writer:
        for example, _, _ in examples:
            writer.write(example.SerializeToString())
    return path, [(encoded, label) for _, encoded, label in examples]


def _run_map(fn, *tensors):
    """fn applied inside Dataset.map (graph mode); returns the first output as numpy."""
    ds = tf.data.Dataset.from_tensors(tuple(tf.constant(t) for t in tensors)).map(fn)
    return tf.nest.map_structure(lambda x: x.numpy(), next(iter(ds)))


# ------------------------------------------------------------------------------------------
# parse_example


@pytest.mark.parametrize("offset", [0, 1])
def test_parse_example_shifts_labels_and_keeps_bytes(shard, offset):
    path, expected = shard
    ds = tf.data.TFRecordDataset(path).map(lambda s: preprocess.parse_example(s, label_offset=offset))
    got = [(e.numpy(), int(l.numpy()), l.dtype) for e, l in ds]
    assert len(got) == len(expected)
    for (enc, label, dtype), (want_enc, want_label) in zip(got, expected):
        assert enc == want_enc
        assert label == want_label - offset
        assert dtype == tf.int32


def test_parse_example_missing_label_is_an_error():
    example = tf.train.Example(features=tf.train.Features(feature={"image/encoded": _bytes(b"x")}))
    with pytest.raises(tf.errors.InvalidArgumentError):
        preprocess.parse_example(tf.constant(example.SerializeToString()), label_offset=1)


# ------------------------------------------------------------------------------------------
# ImageNet train / eval


def test_train_crop_shape_dtype_for_every_record(shard):
    path, _ = shard
    ds = tf.data.TFRecordDataset(path).map(lambda s: preprocess.parse_example(s, label_offset=1)).map(
        lambda e, l: (preprocess.train_preprocess(e, image_size=S, augment="imagenet"), l))
    assert ds.element_spec[0].shape == (S, S, 3) and ds.element_spec[0].dtype == tf.uint8
    for image, _ in ds:
        assert image.shape == (S, S, 3) and image.dtype == tf.uint8


def _manual_center_crop(array, image_size, fraction=0.875):
    """Reference: full decode, crop the central square `fraction` of the shorter side, resize."""
    h, w = array.shape[:2]
    size = int(fraction * min(h, w))
    top, left = (h - size + 1) // 2, (w - size + 1) // 2
    crop = array[top:top + size, left:left + size].astype(np.float32)
    out = tf.image.resize(crop, [image_size, image_size], method="bilinear", antialias=False).numpy()
    return np.floor(out + 0.5).astype(np.uint8)


@pytest.mark.parametrize("key", ["photo_jpeg", "tall_jpeg"])
def test_center_crop_matches_manual_reference(images, key):
    decoded = tf.io.decode_jpeg(images[key], channels=3, dct_method=preprocess.DCT_METHOD).numpy()
    want = _manual_center_crop(decoded, S).astype(int)
    got = _run_map(lambda e: preprocess.center_crop(e, image_size=S), images[key]).astype(int)
    assert got.shape == (S, S, 3)
    # decode_and_crop_jpeg decodes only the window; chroma upsampling at its border may differ a little.
    assert np.abs(got - want).mean() < 1.0
    assert np.abs(got - want).max() <= 16
    # eval_preprocess is the same function
    again = _run_map(lambda e: preprocess.eval_preprocess(e, image_size=S, augment="imagenet"), images[key])
    np.testing.assert_array_equal(again, got)


def test_center_crop_of_png_disguised_as_jpeg_is_exact(images):
    got = _run_map(lambda e: preprocess.center_crop(e, image_size=S), images["photo_png"])
    np.testing.assert_array_equal(got, _manual_center_crop(images["photo"], S))


def test_center_crop_fraction(images):
    got = _run_map(lambda e: preprocess.center_crop(e, image_size=S, crop_fraction=1.0), images["photo_png"])
    np.testing.assert_array_equal(got, _manual_center_crop(images["photo"], S, fraction=1.0))


def test_random_crop_stateful_draws_differ(images):
    ds = tf.data.Dataset.from_tensors(images["photo_jpeg"]).repeat(8).map(
        lambda e: preprocess.decode_and_random_crop(e, image_size=S))
    outs = [x.numpy() for x in ds]
    assert len({o.tobytes() for o in outs}) >= 6


def test_random_crop_stateless_seed_reproducible(images):
    def crop(seed):
        return _run_map(lambda e, s: preprocess.decode_and_random_crop(e, image_size=S, seed=s),
                        images["photo_jpeg"], np.array(seed, np.int64))

    np.testing.assert_array_equal(crop([1, 2]), crop([1, 2]))
    assert len({crop([1, k]).tobytes() for k in range(6)}) >= 5


def test_random_crop_is_the_resized_sampled_window(images):
    # Stateless seed s: the box is sampled with stateless_split(s, 2)[0] (flip seed [1]). For a PNG
    # (exact pixels) the output must equal the bilinear resize of exactly that window, maybe mirrored.
    seed = tf.constant([3, 4], tf.int64)
    for area_range in ((0.08, 1.0), (0.2, 0.4)):
        out = _run_map(lambda e: preprocess.decode_and_random_crop(e, image_size=S, seed=seed, area_range=area_range),
                       images["photo_png"])
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            [150, 200, 3], tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
            seed=tf.random.experimental.stateless_split(seed, 2)[0], min_object_covered=0.1,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=area_range, max_attempts=10)
        (y, x, _), (h, w, _) = begin.numpy(), size.numpy()
        assert (h, w) != (150, 200), "sampling did not fail for this seed"
        crop = images["photo"][y:y + h, x:x + w].astype(np.float32)
        want = np.floor(tf.image.resize(crop, [S, S]).numpy() + 0.5).astype(np.uint8)
        assert np.array_equal(out, want) or np.array_equal(out, want[:, ::-1])


def test_random_crop_falls_back_to_center_crop_when_sampling_fails(images):
    # No window of at least 90% area has aspect ratio 3 in a 4:3 image: sampling fails every time.
    out = _run_map(lambda e: preprocess.decode_and_random_crop(
        e, image_size=S, area_range=(0.9, 1.0), aspect_ratio_range=(3.0, 3.0)), images["photo_png"])
    center = _manual_center_crop(images["photo"], S)
    assert np.array_equal(out, center) or np.array_equal(out, center[:, ::-1])


def test_png_disguised_as_jpeg_goes_through_every_path(shard, images):
    assert not tf.io.is_jpeg(images["photo_png"]).numpy()
    for augment in preprocess.AUGMENTS:
        for fn in (preprocess.train_preprocess, preprocess.eval_preprocess):
            out = _run_map(lambda e: fn(e, image_size=S, augment=augment), images["photo_png"])
            assert out.shape == (S, S, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(_run_map(preprocess.decode_full, images["photo_png"]), images["photo"])


def test_grayscale_and_cmyk_jpegs_decode_to_rgb(images):
    for mode in ("L", "CMYK"):
        buf = io.BytesIO()
        Image.fromarray(images["photo"]).convert(mode).save(buf, "JPEG", quality=90)
        for fn in (lambda e: preprocess.decode_and_random_crop(e, image_size=S),
                   lambda e: preprocess.center_crop(e, image_size=S), preprocess.decode_full):
            out = _run_map(fn, buf.getvalue())
            assert out.ndim == 3 and out.shape[-1] == 3 and out.dtype == np.uint8


# ------------------------------------------------------------------------------------------
# augment="none" and "cifar"


def test_none_at_source_size_returns_decoded_pixels_exactly(images):
    for fn in (preprocess.train_preprocess, preprocess.eval_preprocess):
        out = _run_map(lambda e: fn(e, image_size=32, augment="none"), images["small_png"])
        np.testing.assert_array_equal(out, images["small"])  # lossless source: the exact array
        out = _run_map(lambda e: fn(e, image_size=32, augment="none"), images["small_jpeg"])
        want = tf.io.decode_jpeg(images["small_jpeg"], channels=3, dct_method=preprocess.DCT_METHOD).numpy()
        np.testing.assert_array_equal(out, want)


def test_none_resizes_to_image_size_without_randomness(images):
    outs = [_run_map(lambda e: preprocess.train_preprocess(e, image_size=S, augment="none"), images["photo_jpeg"])
            for _ in range(2)]
    assert outs[0].shape == (S, S, 3) and outs[0].dtype == np.uint8
    np.testing.assert_array_equal(outs[0], outs[1])


def _shift_candidates(image, pad=4):
    """Every (dy, dx, flip) result of zero-pad `pad` + crop back + optional flip."""
    h, w = image.shape[:2]
    padded = np.pad(image, [(pad, pad), (pad, pad), (0, 0)])
    out = {}
    for oy in range(2 * pad + 1):
        for ox in range(2 * pad + 1):
            crop = padded[oy:oy + h, ox:ox + w]
            out[(pad - oy, pad - ox, False)] = crop
            out[(pad - oy, pad - ox, True)] = crop[:, ::-1]
    return out


def test_cifar_augment_shape_and_shifts(images):
    small = images["small"]
    candidates = _shift_candidates(small)
    seen = set()
    for k in range(40):
        out = _run_map(lambda x, s: preprocess.cifar_augment(x, seed=s), small, np.array([7, k], np.int64))
        assert out.shape == small.shape and out.dtype == np.uint8
        match = [key for key, cand in candidates.items() if np.array_equal(out, cand)]
        assert match, "output is not a pad-4 crop (+flip) of the input"
        seen.update(match)
    shifts = {max(abs(dy), abs(dx)) for dy, dx, _ in seen}
    assert 4 in shifts, f"a 4-pixel shift never occurred in 40 draws: {sorted(shifts)}"
    assert {flip for _, _, flip in seen} == {False, True}
    # zero padding: a shift by 4 leaves 4 black rows/columns
    out = candidates[(4, 4, False)]
    assert not out[:4].any() and not out[:, :4].any()


def test_cifar_augment_stateless_reproducible_stateful_varies(images):
    small = images["small"]
    a = _run_map(lambda x: preprocess.cifar_augment(x, seed=tf.constant([1, 2])), small)
    b = _run_map(lambda x: preprocess.cifar_augment(x, seed=tf.constant([1, 2])), small)
    np.testing.assert_array_equal(a, b)
    ds = tf.data.Dataset.from_tensors(small).repeat(12).map(preprocess.cifar_augment)
    assert len({x.numpy().tobytes() for x in ds}) > 3


def test_cifar_train_and_eval(images):
    out = _run_map(lambda e: preprocess.train_preprocess(e, image_size=32, augment="cifar"), images["small_png"])
    assert any(np.array_equal(out, c) for c in _shift_candidates(images["small"]).values())
    out = _run_map(lambda e: preprocess.eval_preprocess(e, image_size=32, augment="cifar"), images["small_png"])
    np.testing.assert_array_equal(out, images["small"])
    # other sizes: resized first, then augmented
    for fn in (preprocess.train_preprocess, preprocess.eval_preprocess):
        out = _run_map(lambda e: fn(e, image_size=48, augment="cifar"), images["photo_jpeg"])
        assert out.shape == (48, 48, 3) and out.dtype == np.uint8


def test_unknown_augment_is_rejected(images):
    with pytest.raises(ValueError, match=r"'autoaugment'.*imagenet.*cifar.*none"):
        preprocess.train_preprocess(tf.constant(images["photo_jpeg"]), image_size=S, augment="autoaugment")
    with pytest.raises(ValueError, match="'bogus'"):
        preprocess.eval_preprocess(tf.constant(images["photo_jpeg"]), image_size=S, augment="bogus")


def test_full_pipeline_batches_uint8(shard):
    path, _ = shard
    for augment in preprocess.AUGMENTS:
        ds = tf.data.TFRecordDataset(path).map(lambda s: preprocess.parse_example(s, label_offset=1))
        ds = ds.map(lambda e, l: (preprocess.train_preprocess(e, image_size=S, augment=augment), l),
                    num_parallel_calls=tf.data.AUTOTUNE).batch(4)
        images, labels = next(iter(ds))
        assert images.shape == (4, S, S, 3) and images.dtype == tf.uint8
        assert labels.numpy().tolist() == [0, 999, 6, 2]


# ------------------------------------------------------------------------------------------
# batch augmenters (Keras core layers inside tf.data)

NUM_CLASSES = 10


def _batches(images):
    rng = np.random.default_rng(0)
    x = np.stack([_photo(S, S, seed=s) for s in range(8)])
    y = rng.integers(0, NUM_CLASSES, 8).astype(np.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat(3), x, y


@pytest.mark.parametrize("name", ["mixup", "cutmix"])
def test_mix_augmenters_in_dataset_map(images, name):
    ds, x, y = _batches(images)
    fn = batch_augment.batch_augmenter(name, num_classes=NUM_CLASSES, mixup_alpha=0.4, cutmix_factor=1.0,
                                       randaugment_ops=2, randaugment_factor=0.5)
    out = ds.map(fn, num_parallel_calls=2)
    assert out.element_spec[0].shape == (8, S, S, 3) and out.element_spec[0].dtype == tf.uint8
    assert out.element_spec[1].shape == (8, NUM_CLASSES) and out.element_spec[1].dtype == tf.float32
    results = [(a.numpy(), b.numpy()) for a, b in out]
    for mixed, soft in results:
        assert mixed.dtype == np.uint8 and mixed.shape == x.shape
        assert soft.shape == (8, NUM_CLASSES)
        np.testing.assert_allclose(soft.sum(axis=1), 1.0, atol=1e-5)
        assert (soft >= -1e-6).all()
        # every row keeps weight on its own label (mix weight > 0 unless a box covers everything)
        assert (soft[np.arange(8), y] > 0).mean() >= 0.5
    assert not all(np.array_equal(results[0][0], r[0]) for r in results[1:]), "draws differ between batches"
    assert any(not np.array_equal(r[0], x) for r in results), "images were mixed"
    # already-soft labels are accepted
    soft_in = tf.one_hot(y, NUM_CLASSES)
    _, soft_out = next(iter(tf.data.Dataset.from_tensors((x, soft_in)).map(fn)))
    np.testing.assert_allclose(soft_out.numpy().sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("impl", ["select", "keras"])
def test_randaugment_in_dataset_map(images, impl):
    ds, x, y = _batches(images)
    fn = batch_augment.batch_augmenter("randaugment", num_classes=NUM_CLASSES, randaugment_ops=2,
                                       randaugment_factor=0.5, mixup_alpha=0.2, cutmix_factor=1.0,
                                       randaugment_impl=impl)
    out = ds.map(fn, num_parallel_calls=2)
    assert out.element_spec[0].shape == (8, S, S, 3) and out.element_spec[0].dtype == tf.uint8
    assert out.element_spec[1].dtype == tf.int32
    results = [(a.numpy(), b.numpy()) for a, b in out]
    for augmented, labels in results:
        assert augmented.dtype == np.uint8 and augmented.shape == x.shape
        np.testing.assert_array_equal(labels, y)
    assert any(not np.array_equal(r[0], x) for r in results)


def test_batch_augmenter_none_and_errors():
    assert batch_augment.batch_augmenter("none", num_classes=NUM_CLASSES) is None
    assert batch_augment.batch_augmenter("", num_classes=NUM_CLASSES, mixup_alpha=0.2) is None
    with pytest.raises(ValueError, match=r"'autoaugment'.*randaugment.*mixup.*cutmix"):
        batch_augment.batch_augmenter("autoaugment", num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="mixup_alfa"):
        batch_augment.batch_augmenter("mixup", num_classes=NUM_CLASSES, mixup_alfa=0.2)
    with pytest.raises(ValueError, match="'fast'"):
        batch_augment.batch_augmenter("randaugment", num_classes=NUM_CLASSES, randaugment_impl="fast")


def test_randaugment_select_draws_vary_between_batches(images):
    # Same input batch every time: outputs differ only through the drawn operations and magnitudes.
    _, x, y = _batches(images)
    fn = batch_augment.batch_augmenter("randaugment", num_classes=NUM_CLASSES, randaugment_ops=1)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat(6).map(fn)
    outs = {a.numpy().tobytes() for a, _ in ds}
    assert len(outs) >= 4


def test_batch_augmenters_ignore_global_mixed_precision_policy(images):
    import keras

    _, x, y = _batches(images)
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        for name in ("mixup", "cutmix", "randaugment"):
            fn = batch_augment.batch_augmenter(name, num_classes=NUM_CLASSES)
            a, b = next(iter(tf.data.Dataset.from_tensors((x, y)).map(fn)))
            assert a.dtype == tf.uint8
            if name != "randaugment":
                assert b.dtype == tf.float32
                np.testing.assert_allclose(b.numpy().sum(axis=1), 1.0, atol=1e-5)
    finally:
        keras.config.set_dtype_policy(old)


def _randaugment_layer():
    import keras

    return keras.layers.RandAugment(value_range=(0, 255), num_ops=2, factor=0.5, dtype="float32")


def test_randaugment_fast_path_is_taken_on_the_installed_keras(monkeypatch):
    import keras

    warnings = []
    monkeypatch.setattr(batch_augment.logging, "warning", lambda *args: warnings.append(args))
    batch_augment._warn_slow_randaugment.cache_clear()
    assert batch_augment._randaugment_unsupported(_randaugment_layer(), keras.__version__) is None, keras.__version__
    assert batch_augment._randaugment_select(_randaugment_layer()) is not None
    assert warnings == []


@pytest.mark.parametrize("version", ["3.9.2", "3.16.0", "4.0.0.dev0", "unknown"])
def test_randaugment_outside_the_verified_keras_versions_warns_once_and_falls_back(monkeypatch, version):
    import keras

    warnings = []
    monkeypatch.setattr(keras, "__version__", version)
    monkeypatch.setattr(batch_augment.logging, "warning", lambda message, *args: warnings.append(message % args))
    batch_augment._warn_slow_randaugment.cache_clear()
    for _ in range(3):
        assert batch_augment._randaugment_select(_randaugment_layer()) is None
    assert len(warnings) == 1
    assert f"Keras {version}" in warnings[0] and "15x slower" in warnings[0] and "3.10-3.15" in warnings[0]
    batch_augment._warn_slow_randaugment.cache_clear()  # later tests start with no warning given


def test_randaugment_without_its_operation_layers_falls_back(monkeypatch):
    import keras

    layer = _randaugment_layer()
    monkeypatch.setattr(type(layer), "_AUGMENT_LAYERS", ["random_shear", "no_such_operation"])
    reason = batch_augment._randaugment_unsupported(layer, keras.__version__)
    assert reason and "_AUGMENT_LAYERS" in reason

