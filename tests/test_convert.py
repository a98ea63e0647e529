"""tfscale.data.convert.convert: image folders -> ImageNet-layout TFRecord shards + manifest.

Images are crops of the two real photographs scikit-learn ships, written in every form ImageNet
contains (baseline/progressive/CMYK/grayscale JPEG, PNG, a PNG named .JPEG, palette and RGBA PNG).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from sklearn.datasets import load_sample_images

from tfscale import io as tfio
from tfscale.data.convert import convert, encode, shards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(REPO, "tools", "tfrecord_convert.py")
CLASSES = ("n01", "n02", "n03")
# Inputs that are not baseline RGB JPEGs and must be re-encoded, by file name.
REENCODED = {"rgb.png", "rgba.png", "palette.PNG", "cmyk.jpg", "gray.jpeg", "progressive.JPEG", "png_in_disguise.JPEG"}


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def photos():
    return [Image.fromarray(x) for x in load_sample_images().images]


def photo_crop(photos, seed: int, max_side_px: int = 120, min_side_px: int = 40) -> Image.Image:
    """An RGB crop of a real photo, resized to sides in [min_side_px, max_side_px]."""
    rng = np.random.default_rng(seed)
    src = photos[seed % len(photos)]
    x0, y0 = int(rng.integers(0, 300)), int(rng.integers(0, 200))
    crop = src.crop((x0, y0, x0 + 320, y0 + 220))
    w, h = int(rng.integers(min_side_px, max_side_px + 1)), int(rng.integers(min_side_px, max_side_px + 1))
    return crop.resize((w, h), Image.BICUBIC)


def write_tree(photos, root, per_class: int = 8) -> dict[str, list[str]]:
    """CLASSES folders of images in every ImageNet flavour; returns {class: [file names]}."""
    tree = {}
    for c, name in enumerate(CLASSES):
        folder = os.path.join(root, name)
        os.makedirs(folder)
        files = []
        for i in range(per_class):
            img = photo_crop(photos, 100 * c + i)
            fname = f"img{i}{('.JPEG', '.jpg', '.jpeg')[i % 3]}"
            img.save(os.path.join(folder, fname), "JPEG", quality=90)
            files.append(fname)
        special = {
            "n01": [("rgb.png", lambda im, p: im.save(p, "PNG")),
                    ("rgba.png", lambda im, p: _with_alpha(im).save(p, "PNG"))],
            "n02": [("cmyk.jpg", lambda im, p: im.convert("CMYK").save(p, "JPEG", quality=90)),
                    ("gray.jpeg", lambda im, p: im.convert("L").save(p, "JPEG", quality=90))],
            "n03": [("progressive.JPEG", lambda im, p: im.save(p, "JPEG", quality=90, progressive=True)),
                    ("png_in_disguise.JPEG", lambda im, p: im.save(p, "PNG")),
                    ("palette.PNG", lambda im, p: im.convert("P", palette=Image.ADAPTIVE).save(p, "PNG"))],
        }[name]
        for j, (fname, save) in enumerate(special):
            save(photo_crop(photos, 1000 + 10 * c + j), os.path.join(folder, fname))
            files.append(fname)
        with open(os.path.join(folder, "README.txt"), "w") as f:  # not an image: ignored
            f.write("notes")
        tree[name] = files
    return tree


def _with_alpha(img):
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(img.size))
    return rgba


def read_examples(path) -> list[tf.train.Example]:
    return [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(path)]


def feature_value(example, key):
    feature = example.features.feature[key]
    kind = feature.WhichOneof("kind")
    (value,) = getattr(feature, kind).value
    return value


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def file_ids(directory) -> dict[str, tuple[int, int]]:
    """{name: (inode, mtime_ns)}: unchanged values mean the file was not rewritten."""
    ids = {}
    for name in os.listdir(directory):
        try:
            stat = os.stat(os.path.join(directory, name))
        except FileNotFoundError:  # a temporary renamed while we look (a conversion is running)
            continue
        ids[name] = (stat.st_ino, stat.st_mtime_ns)
    return ids


@pytest.fixture(scope="module")
def tree_dir(photos, tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    write_tree(photos, root)
    text_file = root.parent / "synset_words.txt"
    text_file.write_text("n01\tfirst class, the one\nn02 second class\nn99\tunused\n")
    return str(root), str(text_file)


@pytest.fixture(scope="module")
def converted(tree_dir, tmp_path_factory):
    """The tree converted once, serially, into 4 shards: (output dir, manifest)."""
    root, text_file = tree_dir
    out = str(tmp_path_factory.mktemp("out"))
    manifest = convert.convert(root, out, "train", 4, class_text_file=text_file, num_workers=1)
    return out, manifest


# ------------------------------------------------------------------------------- class-tree output


def test_feature_keys_are_the_imagenet_ones():
    assert encode.FEATURE_KEYS == (
        "image/encoded", "image/format", "image/height", "image/width", "image/channels", "image/colorspace",
        "image/class/label", "image/class/synset", "image/class/text", "image/filename")


def test_class_tree_shards_features_and_labels(converted, tree_dir):
    out, manifest = converted
    root, _ = tree_dir
    names = [f"train-0000{i}-of-00004" for i in range(4)]
    assert sorted(os.listdir(out)) == ["dali-index", "manifest-train.json"] + names  # no temp or state files left
    # DALI's reader index of every shard (data.loader=dali): one "offset length" line per record.
    assert sorted(os.listdir(os.path.join(out, "dali-index"))) == [name + ".idx" for name in names]
    index_lines = open(os.path.join(out, "dali-index", names[0] + ".idx")).read().splitlines()
    assert len(index_lines) == manifest["shards"][0]["num_examples"]
    last_offset, last_length = map(int, index_lines[-1].split())
    assert last_offset + last_length == manifest["shards"][0]["bytes"]
    bytes_keys = {"image/encoded", "image/format", "image/colorspace", "image/class/synset", "image/class/text",
                  "image/filename"}
    expected_texts = {"n01": b"first class, the one", "n02": b"second class", "n03": b"n03"}
    seen, sizes = [], []
    for name in names:
        examples = read_examples(os.path.join(out, name))
        sizes.append(len(examples))
        synsets = set()
        for ex in examples:
            assert set(ex.features.feature) == set(encode.FEATURE_KEYS)
            for key in encode.FEATURE_KEYS:
                kind = ex.features.feature[key].WhichOneof("kind")
                assert kind == ("bytes_list" if key in bytes_keys else "int64_list"), key
            synset = feature_value(ex, "image/class/synset").decode()
            synsets.add(synset)
            assert feature_value(ex, "image/format") == b"JPEG"
            assert feature_value(ex, "image/colorspace") == b"RGB"
            assert feature_value(ex, "image/channels") == 3
            assert feature_value(ex, "image/class/label") == CLASSES.index(synset) + 1  # 1-based, sorted order
            assert feature_value(ex, "image/class/text") == expected_texts[synset]
            filename = feature_value(ex, "image/filename").decode()
            assert os.path.isfile(os.path.join(root, synset, filename))
            seen.append((synset, filename))
        assert len(synsets) >= 2, f"{name} holds one class only: {synsets}"  # the shuffle mixes classes
    expected = sorted((c, f) for c in CLASSES for f in os.listdir(os.path.join(root, c)) if f != "README.txt")
    assert sorted(seen) == expected
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(expected) == 31


def test_classic_imagenet_parser_reads_the_shards(converted):
    """The parse spec of the official ResNet ImageNet input (bbox features optional) takes our records."""
    out, _ = converted
    spec = {
        "image/encoded": tf.io.FixedLenFeature([], tf.string, default_value=""),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
        "image/class/text": tf.io.FixedLenFeature([], tf.string, default_value=""),
        **{f"image/object/bbox/{k}": tf.io.VarLenFeature(tf.float32) for k in ("xmin", "ymin", "xmax", "ymax")},
    }
    ds = tf.data.TFRecordDataset(tf.io.gfile.glob(os.path.join(out, "train-*-of-*")))
    for parsed in ds.map(lambda r: tf.io.parse_single_example(r, spec)):
        assert 1 <= int(parsed["image/class/label"]) <= 3
        assert tf.io.decode_jpeg(parsed["image/encoded"], channels=3).shape[-1] == 3


def test_manifest_matches_files_on_disk(converted, tree_dir):
    out, manifest = converted
    root, _ = tree_dir
    with open(os.path.join(out, "manifest-train.json")) as f:
        assert json.load(f) == manifest
    assert tfio.read_manifest(out, "train") == manifest
    assert tfio.read_manifest(out, "validation") is None
    assert manifest["split"] == "train" and manifest["num_shards"] == 4 and manifest["num_examples"] == 31
    assert manifest["num_classes"] == 3 and manifest["label_offset"] == 1
    assert manifest["classes"] == list(CLASSES) and manifest["class_labels"] == [1, 2, 3]
    assert manifest["class_texts"] == ["first class, the one", "second class", "n03"]
    assert manifest["skipped"] == [] and manifest["resize_shorter"] == 0 and manifest["seed"] == 0
    assert manifest["tool_version"] and manifest["input_dir"] == root
    for shard in manifest["shards"]:
        path = os.path.join(out, shard["name"])
        assert shard["bytes"] == os.path.getsize(path)
        assert shard["sha256"] == sha256(path)
        assert shard["num_examples"] == len(read_examples(path))


def test_class_order_file_sets_labels(tree_dir, tmp_path):
    root, _ = tree_dir
    order = tmp_path / "order.txt"
    order.write_text("n00_absent\nn03\nn02\nn01\n")
    manifest = convert.convert(root, tmp_path / "out", "train", 1, class_order_file=str(order), num_workers=1)
    assert manifest["classes"] == ["n00_absent", "n03", "n02", "n01"] and manifest["num_classes"] == 4
    for ex in read_examples(tmp_path / "out" / "train-00000-of-00001"):
        synset = feature_value(ex, "image/class/synset").decode()
        assert feature_value(ex, "image/class/label") == {"n03": 2, "n02": 3, "n01": 4}[synset]

    order.write_text("n01\nn03\n")
    with pytest.raises(ValueError, match=r"order\.txt: n02"):
        convert.convert(root, tmp_path / "out2", "train", 1, class_order_file=str(order), num_workers=1)


@pytest.mark.parametrize("form", ["class_tree", "class_order_file", "labels_file", "labels_and_order_files"])
def test_manifest_classes_are_in_stored_label_order_for_every_input_form(photos, tmp_path, form):
    """classes[label - label_offset] is the image's class, and class_labels says that label, however classes came."""
    truth = {f"im{i:02d}.jpg": ("n_zebra", "n_apple", "n_mango")[i % 3] for i in range(9)}
    if form.startswith("labels"):
        root = tmp_path / "flat"
        root.mkdir()
        for i, fname in enumerate(truth):
            photo_crop(photos, 40 + i).save(root / fname, "JPEG", quality=90)
        labels = tmp_path / "labels.txt"
        labels.write_text("".join(truth[f] + "\n" for f in sorted(truth)))
    else:
        root = tmp_path / "tree"
        for i, (fname, synset) in enumerate(truth.items()):
            (root / synset).mkdir(parents=True, exist_ok=True)
            photo_crop(photos, 40 + i).save(root / synset / fname, "JPEG", quality=90)
        labels = None
    order = None
    if "order" in form:
        order = tmp_path / "order.txt"
        order.write_text("n_mango\nn_unused\nn_zebra\nn_apple\n")
    manifest = convert.convert(root, tmp_path / "out", "train", 2, labels_file=labels and str(labels),
                               class_order_file=order and str(order), num_workers=1)
    expected = ["n_mango", "n_unused", "n_zebra", "n_apple"] if order else ["n_apple", "n_mango", "n_zebra"]
    assert manifest["classes"] == expected and manifest["num_classes"] == len(expected)
    offset = manifest["label_offset"]
    assert manifest["class_labels"] == [i + offset for i in range(len(expected))]
    assert tfio.read_manifest(tmp_path / "out", "train")["classes"] == expected  # what export reads
    seen = 0
    for shard in manifest["shards"]:
        for ex in read_examples(tmp_path / "out" / shard["name"]):
            label = feature_value(ex, "image/class/label")
            synset = truth[feature_value(ex, "image/filename").decode()]
            assert feature_value(ex, "image/class/synset").decode() == synset
            assert manifest["classes"][label - offset] == synset
            assert manifest["class_labels"][manifest["classes"].index(synset)] == label
            assert manifest["class_texts"][label - offset] == feature_value(ex, "image/class/text").decode()
            seen += 1
    assert seen == len(truth)


def test_legacy_manifest_is_read_and_replaced_by_a_rerun(converted, tree_dir, tmp_path):
    """Dirs converted by older versions hold `train-manifest.json`: read it; a rerun reuses their shards."""
    original_dir, original = converted
    root, text_file = tree_dir
    out = tmp_path / "out"
    shutil.copytree(original_dir, out)
    os.rename(out / "manifest-train.json", out / "train-manifest.json")
    assert tfio.read_manifest(out, "train") == original
    assert tfio.find_manifest(str(out), "train") == str(out / "train-manifest.json")
    before = file_ids(out)

    manifest = convert.convert(root, out, "train", 4, class_text_file=text_file, num_workers=1)
    after = file_ids(out)
    assert all(after[s["name"]] == before[s["name"]] for s in manifest["shards"]), "shards were rewritten"
    assert sorted(after) == ["dali-index", "manifest-train.json"] + [s["name"] for s in original["shards"]]


def test_remove_temp_files_knows_every_temporary_name(tmp_path):
    ours = [".train-00001-of-00004.tmp-11", ".manifest-train.json.tmp-12", ".train-manifest.json.tmp-13",
            ".train-convert-state.json.tmp-14"]
    others = [".validation-00001-of-00004.tmp-11", ".manifest-validation.json.tmp-12", "train-00000-of-00004",
              ".manifest-train.json", "notes.tmp-1"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"x")
    assert shards.remove_temp_files(str(tmp_path), "train") == sorted(ours)
    assert sorted(os.listdir(tmp_path)) == sorted(others)


# ----------------------------------------------------------------------------------------- pixels


def test_pixels_survive_conversion(converted, tree_dir):
    out, _ = converted
    root, _ = tree_dir
    for name in sorted(n for n in os.listdir(out) if n.startswith("train-0")):
        for ex in read_examples(os.path.join(out, name)):
            encoded = feature_value(ex, "image/encoded")
            fname = feature_value(ex, "image/filename").decode()
            path = os.path.join(root, feature_value(ex, "image/class/synset").decode(), fname)
            with open(path, "rb") as f:
                original = f.read()
            decoded = tf.io.decode_jpeg(encoded).numpy()  # channels=0: what the file really holds
            assert decoded.shape == (feature_value(ex, "image/height"), feature_value(ex, "image/width"), 3), fname
            with Image.open(path) as img:
                assert (img.width, img.height) == (decoded.shape[1], decoded.shape[0])
                reference = np.asarray(img.convert("RGB"), np.float32)
            if fname in REENCODED:
                assert encoded != original, fname
                assert encode.jpeg_sof_marker(encoded) == 0xC0, fname  # baseline
                if fname != "rgba.png":  # composited over white: no RGB reference
                    # Quality 95 with 4:2:0 chroma on tiny, detailed crops: a few levels of 255.
                    assert np.abs(decoded.astype(np.float32) - reference).mean() < 6.0, fname
            else:
                assert encoded == original, f"{fname} should pass through byte for byte"
                np.testing.assert_array_equal(decoded, tf.io.decode_jpeg(original).numpy())


def test_resize_shorter_shrinks_only_large_images(photos, tmp_path):
    root = tmp_path / "in" / "c"
    root.mkdir(parents=True)
    photos[0].resize((200, 120)).save(root / "large.jpg", quality=90)
    photos[1].resize((90, 150)).save(root / "large.png")
    photos[0].resize((60, 40)).save(root / "small.jpg", quality=90)
    convert.convert(tmp_path / "in", tmp_path / "out", "train", 1, resize_shorter=64, num_workers=1)
    shapes = {}
    for ex in read_examples(tmp_path / "out" / "train-00000-of-00001"):
        fname = feature_value(ex, "image/filename").decode()
        decoded = tf.io.decode_jpeg(feature_value(ex, "image/encoded"))
        shapes[fname] = tuple(decoded.shape)
        assert shapes[fname][:2] == (feature_value(ex, "image/height"), feature_value(ex, "image/width"))
        if fname == "small.jpg":
            assert feature_value(ex, "image/encoded") == (root / "small.jpg").read_bytes()
    assert shapes == {"large.jpg": (64, 107, 3), "large.png": (107, 64, 3), "small.jpg": (40, 60, 3)}
    assert tfio.read_manifest(tmp_path / "out", "train")["resize_shorter"] == 64


# --------------------------------------------------------------------------------- flat + labels


def test_flat_folder_with_labels_file(photos, tmp_path):
    folder = tmp_path / "val"
    folder.mkdir()
    truth = {}
    for i in reversed(range(12)):  # creation order differs from name order
        fname = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        photo_crop(photos, 500 + i).save(folder / fname, "JPEG", quality=90)
        truth[fname] = ("n02", "n10", "n05")[i % 3]
    labels = tmp_path / "val_labels.txt"
    labels.write_text("".join(truth[f] + "\n" for f in sorted(truth)))
    manifest = convert.convert(folder, tmp_path / "out", "validation", 3, labels_file=str(labels), num_workers=1)
    assert manifest["classes"] == ["n02", "n05", "n10"] and manifest["num_examples"] == 12
    assert [s["name"] for s in manifest["shards"]] == [f"validation-0000{i}-of-00003" for i in range(3)]
    for shard in manifest["shards"]:
        for ex in read_examples(tmp_path / "out" / shard["name"]):
            fname = feature_value(ex, "image/filename").decode()
            assert feature_value(ex, "image/class/synset").decode() == truth[fname]
            assert feature_value(ex, "image/class/label") == manifest["classes"].index(truth[fname]) + 1

    labels.write_text("".join(truth[f] + "\n" for f in sorted(truth)[:11]))
    with pytest.raises(ValueError, match=r"val_labels\.txt has 11 labels.* 12 images"):
        convert.convert(folder, tmp_path / "out2", "validation", 3, labels_file=str(labels), num_workers=1)


# ------------------------------------------------------------------------------------ bad images


def test_corrupt_images_are_skipped_or_fail_with_strict(photos, tmp_path, caplog):
    for c in ("a", "b"):
        (tmp_path / "in" / c).mkdir(parents=True)
        for i in range(3):
            photo_crop(photos, 700 + i).save(tmp_path / "in" / c / f"ok{i}.jpg", quality=90)
    bad = {
        str(tmp_path / "in" / "a" / "random.JPEG"): np.random.default_rng(0).bytes(3000),
        str(tmp_path / "in" / "a" / "truncated.jpg"): (tmp_path / "in" / "a" / "ok0.jpg").read_bytes()[:900],
        str(tmp_path / "in" / "b" / "empty.jpeg"): b"",
    }
    for path, data in bad.items():
        with open(path, "wb") as f:
            f.write(data)

    with pytest.raises(ValueError, match="random.JPEG") as error:
        convert.convert(tmp_path / "in", tmp_path / "strict", "train", 2, strict=True, num_workers=1)
    assert "truncated.jpg" in str(error.value) and "empty.jpeg" in str(error.value)
    assert not (tmp_path / "strict").exists()  # nothing written, no manifest

    with caplog.at_level("WARNING"):
        manifest = convert.convert(tmp_path / "in", tmp_path / "out", "train", 2, num_workers=1)
    assert sorted(s["path"] for s in manifest["skipped"]) == sorted(bad)
    assert all(s["reason"] for s in manifest["skipped"])
    assert manifest["num_examples"] == 6 and [s["num_examples"] for s in manifest["shards"]] == [3, 3]
    for path in bad:
        assert path in caplog.text


@pytest.mark.parametrize("case, match", [
    ("missing_dir", "does_not_exist"),
    ("empty_dir", "empty"),
    ("empty_class", "n_empty has no images"),
    ("flat_without_labels", "labels_file"),
    ("unknown_split", "'test'"),
    ("zero_shards", "num_shards"),
    ("too_many_shards", "num_shards=9 is more than the 2 images"),
])
def test_bad_input_gives_clear_errors(photos, tmp_path, case, match):
    root = tmp_path / "in"
    root.mkdir()
    split, num_shards = {"unknown_split": ("test", 1), "zero_shards": ("train", 0),
                         "too_many_shards": ("train", 9)}.get(case, ("train", 1))
    if case == "missing_dir":
        root = tmp_path / "does_not_exist"
    elif case == "empty_class":
        (root / "n_full").mkdir()
        photo_crop(photos, 1).save(root / "n_full" / "x.jpg")
        (root / "n_empty").mkdir()
    elif case == "flat_without_labels":
        photo_crop(photos, 1).save(root / "x.jpg")
    elif case != "empty_dir":
        (root / "n").mkdir()
        for i in range(2):
            photo_crop(photos, i).save(root / "n" / f"{i}.jpg")
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        convert.convert(root, tmp_path / "out", split, num_shards, num_workers=1)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- resume and determinism


def test_shards_of_unknown_origin_are_rewritten_and_other_files_kept(converted, tree_dir, tmp_path):
    """Without the manifest (or a killed run's state) nothing proves how a shard was made: rewrite it."""
    original_dir, original = converted
    root, text_file = tree_dir
    out = tmp_path / "out"
    shutil.copytree(original_dir, out)
    os.remove(out / "manifest-train.json")
    (out / "notes.txt").write_text("mine")
    (out / "validation-00000-of-00001").write_bytes(b"other split")
    (out / "train-00000-of-00002").write_bytes(b"other shard count")
    before = file_ids(out)

    manifest = convert.convert(root, out, "train", 4, class_text_file=text_file, num_workers=1)
    after = file_ids(out)
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in original["shards"]]
    assert all(after[s["name"]] != before[s["name"]] for s in manifest["shards"])
    for name in ("notes.txt", "validation-00000-of-00001", "train-00000-of-00002"):
        assert after[name] == before[name], name
    assert (out / "notes.txt").read_text() == "mine"


def test_rerun_reuses_complete_shards(converted, tree_dir, tmp_path):
    original_dir, original = converted
    root, text_file = tree_dir
    out = tmp_path / "out"
    shutil.copytree(original_dir, out)
    os.remove(out / "train-00001-of-00004")
    with open(out / "train-00002-of-00004", "r+b") as f:
        f.truncate(1000)
    (out / ".train-00003-of-00004.tmp-424242").write_bytes(b"partial")
    before = file_ids(out)

    manifest = convert.convert(root, out, "train", 4, class_text_file=text_file, num_workers=1)
    after = file_ids(out)
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in original["shards"]]
    for name in ("train-00000-of-00004", "train-00003-of-00004"):
        assert after[name] == before[name], f"{name} was complete and should not be rewritten"
    assert after["train-00002-of-00004"] != before["train-00002-of-00004"]
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_rerun_with_other_options_rewrites_every_shard(converted, tree_dir, tmp_path):
    original_dir, original = converted
    root, text_file = tree_dir
    out = tmp_path / "out"
    shutil.copytree(original_dir, out)
    resized = convert.convert(root, out, "train", 4, class_text_file=text_file, resize_shorter=48, num_workers=1)
    assert all(a["inputs_sha256"] != b["inputs_sha256"] for a, b in zip(resized["shards"], original["shards"]))
    for shard in resized["shards"]:
        for ex in read_examples(out / shard["name"]):
            assert min(feature_value(ex, "image/height"), feature_value(ex, "image/width")) <= 48
    back = convert.convert(root, out, "train", 4, class_text_file=text_file, num_workers=1)
    assert [s["sha256"] for s in back["shards"]] == [s["sha256"] for s in original["shards"]]


def test_parallel_output_equals_serial(converted, tree_dir, tmp_path):
    _, serial = converted
    root, text_file = tree_dir
    parallel = convert.convert(root, tmp_path / "out", "train", 4, class_text_file=text_file, num_workers=2)
    assert [s["sha256"] for s in parallel["shards"]] == [s["sha256"] for s in serial["shards"]]
    assert {k: v for k, v in parallel.items() if k != "shards"} == {k: v for k, v in serial.items() if k != "shards"}


def _cli(*args):
    return [sys.executable, CLI, *args]


def test_killed_conversion_resumes(photos, tmp_path):
    """SIGKILL the CLI after two shards; a rerun keeps the finished shards and completes the rest."""
    (tmp_path / "in" / "c").mkdir(parents=True)
    for i in range(16):  # large enough that writing 16 resized shards takes about a second
        photo_crop(photos, 800 + i, max_side_px=1600, min_side_px=1400).save(tmp_path / "in" / "c" / f"{i}.jpg",
                                                                             quality=90)
    args = ["--input_dir", str(tmp_path / "in"), "--split", "train", "--num_shards", "16",
            "--resize_shorter", "64", "--num_workers", "1"]
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli(*args, f"--output_dir={out}"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    deadline = time.monotonic() + 120

    def finished_shards():
        return {n: v for n, v in file_ids(out).items() if n.startswith("train-0")} if out.is_dir() else {}

    while len(finished_shards()) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    finished = finished_shards()
    assert 2 <= len(finished) < 16 and not (out / "manifest-train.json").exists()
    # Serially, shard k+1 starts only after shard k is on record; the newest may have missed it.
    recorded = sorted(finished, key=lambda n: finished[n][1])[:-1]

    manifest = convert.convert(tmp_path / "in", out, "train", 16, resize_shorter=64, num_workers=1)
    after = file_ids(out)
    assert all(after[n] == finished[n] for n in recorded), "finished shards were rewritten"
    assert sorted(after) == sorted([f"train-{i:05d}-of-00016" for i in range(16)] + ["dali-index", "manifest-train.json"])
    reference = convert.convert(tmp_path / "in", tmp_path / "ref", "train", 16, resize_shorter=64, num_workers=1)
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in reference["shards"]]


# -------------------------------------------------------------------------------------------- CLI


def test_cli_smoke_and_missing_input_dir(tree_dir, tmp_path):
    root, _ = tree_dir
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(_cli(f"--input_dir={root}", f"--output_dir={tmp_path / 'out'}", "--split=validation",
                                 "--num_shards=2", "--num_workers=1"), capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "out")) == [
        "dali-index", "manifest-validation.json", "validation-00000-of-00002", "validation-00001-of-00002"]
    assert tfio.read_manifest(tmp_path / "out", "validation")["num_examples"] == 31

    missing = tmp_path / "no_such_dir"
    result = subprocess.run(_cli(f"--input_dir={missing}", f"--output_dir={tmp_path / 'out2'}", "--split=train",
                                 "--num_shards=2"), capture_output=True, text=True, env=env)
    assert result.returncode != 0 and str(missing) in result.stderr
    assert not (tmp_path / "out2").exists()
