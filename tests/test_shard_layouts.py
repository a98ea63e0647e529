"""Shard directories as the field reads them: every reader's split glob, classic shards without a manifest.

Model Garden documents the input path `imagenet-2012-tfrecord/train*`, NVIDIA's readers glob `train-*`,
tf_cnn_benchmarks `train-*-of-*`: whatever else tfscale leaves in a shard directory (manifests, state
files, temporaries, staging records) must match none of them, or a classic reader fails with
`DataLossError: corrupted record at 0`. And shards written by `build_imagenet_data.py` (1-based labels,
bounding boxes, no manifest) must train as they are. Images are real photographs
(tools/make_photo_tree.py crops the two scikit-learn ships).
"""

import fnmatch
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, classic_example, run_cli

from tfscale import io as tfio
from tfscale.config import base_config
from tfscale.data.convert import convert, dali_index, shards
from tfscale.data.input import pipeline
from tfscale.data.stage import prepare, stage
from tfscale.workdir import layout

SPLITS = ("train", "validation")
GLOBS = {split: (f"{split}*", f"{split}-*", f"{split}-*-of-*") for split in SPLITS}
NUM_CLASSES = 3
# Where a classic reader's parse spec comes from: the official ResNet ImageNet input (bbox optional).
CLASSIC_SPEC = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string, default_value=""),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "image/class/text": tf.io.FixedLenFeature([], tf.string, default_value=""),
    **{f"image/object/bbox/{k}": tf.io.VarLenFeature(tf.float32) for k in ("xmin", "ymin", "xmax", "ymax")},
}


def make_photo_tree(out_dir, per_class: int, seed: int) -> str:
    """NUM_CLASSES folders of real-photo JPEGs (every 5th a PNG), by the repo's own tool."""
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_photo_tree.py"), str(out_dir),
                    "--classes", str(NUM_CLASSES), "--per_class", str(per_class), "--seed", str(seed),
                    "--png_every", "5"], check=True, capture_output=True)
    return str(out_dir)


def classic_read(paths: list[str]) -> list[int]:
    """Labels of every record of `paths`, read and decoded as a classic reader does; raises on a non-shard."""
    labels = []
    for parsed in tf.data.TFRecordDataset(paths).map(lambda r: tf.io.parse_single_example(r, CLASSIC_SPEC)):
        assert tf.io.decode_jpeg(parsed["image/encoded"], channels=3).shape[-1] == 3
        labels.append(int(parsed["image/class/label"]))
    return labels


def data_config(data_dir: str, num_train_examples: int, num_eval_examples: int, **overrides):
    d = base_config().data
    d.dataset, d.data_dir, d.image_size, d.num_classes, d.label_offset = "tfrecord", data_dir, 32, NUM_CLASSES, 1
    d.num_train_examples, d.num_eval_examples, d.global_batch_size, d.shuffle_buffer = (
        num_train_examples, num_eval_examples, 4, 8)
    for key, value in overrides.items():
        d[key] = value
    return d


# ------------------------------------------------------------------------- 1. every reader's glob


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Real photos converted by tfscale: train in 4 shards, validation in 2, in one directory."""
    root = tmp_path_factory.mktemp("layouts")
    out = str(root / "shards")
    manifests = {
        "train": convert.convert(make_photo_tree(root / "train_photos", 8, seed=1), out, "train", 4,
                                 resize_shorter=64, num_workers=1),
        "validation": convert.convert(make_photo_tree(root / "val_photos", 4, seed=2), out, "validation", 2,
                                      resize_shorter=64, num_workers=1),
    }
    return out, manifests


def assert_every_glob_reads_only_shards(data_dir: str, manifests: dict) -> None:
    for split in SPLITS:
        names = sorted(s["name"] for s in manifests[split]["shards"])
        present = sorted(n for n in names if os.path.exists(os.path.join(data_dir, n)))
        for pattern in GLOBS[split]:
            paths = sorted(tf.io.gfile.glob(os.path.join(data_dir, pattern)))
            assert [os.path.basename(p) for p in paths] == present, pattern
            labels = classic_read(paths)
            counts = {s["name"]: s["num_examples"] for s in manifests[split]["shards"]}
            assert len(labels) == sum(counts[n] for n in present), pattern
            assert set(labels) <= set(range(1, NUM_CLASSES + 1))


def test_every_split_glob_reads_only_shards(converted):
    out, manifests = converted
    assert sorted(os.listdir(out)) == ["dali-index", "manifest-train.json", "manifest-validation.json",
                                       "train-00000-of-00004", "train-00001-of-00004", "train-00002-of-00004",
                                       "train-00003-of-00004", "validation-00000-of-00002",
                                       "validation-00001-of-00002"]
    assert_every_glob_reads_only_shards(out, manifests)
    for split in SPLITS:  # and all of them: the count the manifest states
        paths = tf.io.gfile.glob(os.path.join(out, f"{split}*"))
        assert len(classic_read(paths)) == manifests[split]["num_examples"] > 0


def test_nothing_else_tfscale_writes_matches_a_split_glob():
    """Every other name tfscale gives a file in a shard or staging directory, checked by name."""
    others = []
    for split in SPLITS:
        final = [os.path.basename(tfio.manifest_path("", split)), os.path.basename(shards.state_path("", split)),
                 shards.shard_name(split, 3, 4)]
        others += final[:2] + [f".{name.lstrip('.')}.tmp-4242" for name in final]  # the converter's temporaries
        others += [f"{stage.PARTIAL_PREFIX}{name}.4242" for name in final]  # staging's temporaries
    others += [stage.STATE_FILE, stage.LOCK_FILE, stage.SHARD_LIST_FILE, dali_index.INDEX_DIR_NAME]
    others += [os.path.basename(tfio.temp_path(name)) for name in (stage.STATE_FILE, stage.SHARD_LIST_FILE)]
    for split in SPLITS:
        for pattern in GLOBS[split]:
            assert [n for n in others if fnmatch.fnmatchcase(n, pattern)] == [], pattern


def test_an_interrupted_conversion_leaves_nothing_a_glob_reads(converted, tmp_path, monkeypatch):
    out, manifests = converted
    photos = make_photo_tree(tmp_path / "photos", 4, seed=3)
    target = str(tmp_path / "shards")
    real_write_shard = shards.write_shard
    written = []

    def write_two_then_die(path, *args):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(real_write_shard(path, *args))
        return written[-1]

    monkeypatch.setattr(shards, "write_shard", write_two_then_die)
    with pytest.raises(KeyboardInterrupt):
        convert.convert(photos, target, "train", 4, resize_shorter=64, num_workers=1)
    assert [n for n in os.listdir(target) if n.startswith(".")] == [".train-convert-state.json"]
    paths = sorted(tf.io.gfile.glob(os.path.join(target, "train*")))
    assert [os.path.basename(p) for p in paths] == sorted(s["name"] for s in written)
    assert len(classic_read(paths)) == sum(s["num_examples"] for s in written)


def test_tfscale_reads_it_and_a_nodes_staged_copy_too(converted, tmp_path):
    out, manifests = converted
    num_train, num_eval = manifests["train"]["num_examples"], manifests["validation"]["num_examples"]
    cfg = data_config(out, num_train, num_eval)
    assert prepare.prepare_data_dir(cfg, num_train_examples=num_train, num_eval_examples=num_eval) == out
    ds = pipeline.eval_input_fn(cfg, seed=0, global_batch_size=4, num_steps=-(-num_eval // 4))(
        tf.distribute.InputContext())
    masks = np.concatenate([m for _, _, m in ds.as_numpy_iterator()])
    assert masks.sum() == num_eval
    images, labels = next(iter(pipeline.train_input_fn(cfg, seed=0, start_step=0)(tf.distribute.InputContext())))
    assert images.shape == (4, 32, 32, 3) and set(labels.numpy()) <= set(range(NUM_CLASSES))

    # Node 1 of 2 x 1 workers: half the train shards, the staging records, and still only shards in every glob.
    local = str(tmp_path / "node1")
    stage.stage(out, local, readers=stage.Readers((1,), 2))
    assert sorted(n for n in os.listdir(local) if n.startswith("train-")) == [
        "train-00001-of-00004", "train-00003-of-00004"]
    assert {stage.STATE_FILE, stage.SHARD_LIST_FILE, stage.LOCK_FILE} <= set(os.listdir(local))
    assert_every_glob_reads_only_shards(local, manifests)


# ----------------------------------------------------- 2. classic build_imagenet_data.py shards, trained


def write_classic_split(photo_dir: str, out_dir: str, split: str, num_shards: int) -> int:
    """Shards `{split}-00000-of-0000N` as build_imagenet_data.py writes them (1-based labels by sorted
    synset, PNGs re-encoded as JPEG as its ImageCoder does, examples spread round-robin); examples written."""
    synsets = sorted(os.listdir(photo_dir))
    writers = [tf.io.TFRecordWriter(os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}"))
               for i in range(num_shards)]
    count = 0
    for label, synset in enumerate(synsets, start=1):
        for fname in sorted(os.listdir(os.path.join(photo_dir, synset))):
            with open(os.path.join(photo_dir, synset, fname), "rb") as f:
                data = f.read()
            image = tf.io.decode_image(data, channels=3).numpy()
            if not fname.lower().endswith((".jpeg", ".jpg")):
                data = tf.io.encode_jpeg(image, quality=100).numpy()
            boxes = [(0.1, 0.2, 0.8, 0.9)] * (count % 3)  # 0, 1 or 2 boxes, as ImageNet's train set has
            writers[count % num_shards].write(
                classic_example(data, image.shape[0], image.shape[1], label, synset, fname, boxes))
            count += 1
    for writer in writers:
        writer.close()
    return count


@pytest.fixture(scope="module")
def classic(tmp_path_factory):
    """Real-photo shards as the classic converters write them: train 4 shards, validation 2, no manifest."""
    root = tmp_path_factory.mktemp("classic")
    out = str(root / "shards")
    os.makedirs(out)
    num_train = write_classic_split(make_photo_tree(root / "train_photos", 8, seed=4), out, "train", 4)
    num_eval = write_classic_split(make_photo_tree(root / "val_photos", 5, seed=5), out, "validation", 2)
    assert tfio.read_manifest(out, "train") is None and tfio.read_manifest(out, "validation") is None
    return out, num_train, num_eval


def train_on(data_dir: str, workdir: str, num_train: int, num_eval: int, label_offset: int):
    return run_cli(
        "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}", "--config.data.dataset=tfrecord",
        f"--config.data.data_dir={data_dir}", f"--config.data.num_train_examples={num_train}",
        f"--config.data.num_eval_examples={num_eval}", f"--config.data.label_offset={label_offset}",
        f"--config.data.num_classes={NUM_CLASSES}", "--config.data.global_batch_size=8", "--config.train.epochs=1",
        "--config.train.log_every_steps=1", "--config.train.eval_every_epochs=1",
    )


@pytest.mark.slow
def test_classic_shards_train_with_label_offset_1(classic, tmp_path):
    out, num_train, num_eval = classic
    assert (num_train, num_eval) == (24, 15)
    result = train_on(out, str(tmp_path / "run"), num_train, num_eval, label_offset=1)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / layout.SUMMARY) as f:
        summary = json.load(f)
    assert summary["steps"] == num_train // 8 and summary["num_workers"] == 1
    assert 0.0 <= summary["eval_top1"] <= 1.0
    with open(tmp_path / "run" / layout.METRICS) as f:
        evals = [row for row in map(json.loads, f) if "eval_top1" in row]
    assert evals and evals[-1]["eval_examples"] == num_eval  # every validation example, once


@pytest.mark.slow
def test_classic_shards_with_a_wrong_label_offset_fail_clearly(classic, tmp_path):
    out, num_train, num_eval = classic
    result = train_on(out, str(tmp_path / "run"), num_train, num_eval, label_offset=0)
    assert result.returncode != 0
    assert f"label >= config.data.num_classes={NUM_CLASSES}; check config.data.label_offset=0" in result.stderr
    assert not os.path.exists(tmp_path / "run" / layout.SUMMARY)
