"""Train and validation agree on what each label means.

ImageNet's validation labels come as the devkit's ground truth (ILSVRC2012_IDs in the devkit's own
order, mapped to synsets by data/meta.mat) or as Kaggle's LOC_val_solution.csv (synsets by image id).
Both, written here in their real formats (meta.mat by scipy.io.savemat as the devkit's struct array,
IDs deliberately not in sorted-synset order) for real-photo JPEGs named as ImageNet names them
(tools/make_photo_tree.py), must give each image the label of its class in the TRAIN split's order.
And a run or an export whose splits were converted with different class orders is refused.
"""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, load_config, quiet_env

from tfscale import errors, export
from tfscale.data.convert import convert
from tfscale.data.input import shard_dir
from tfscale.training import engine
from tfscale.workdir import layout

SYNSETS = ("n00000000", "n00000001", "n00000002")  # make_photo_tree.py's class folder names
TRAIN_ORDER = SYNSETS[::-1]  # not sorted: the train split's order is what labels must follow
# The devkit numbers classes its own way: ID 1 is not the first synset in sorted order. IDs past the
# leaves are inner WordNet nodes (num_children > 0), as in the real meta.mat (1001-1860).
DEVKIT_IDS = {1: "n00000001", 2: "n00000002", 3: "n00000000"}
INNER_NODES = {1001: "n09999998", 1002: "n09999999"}
VAL_PER_CLASS = 3


def write_meta_mat(path):
    """data/meta.mat as the devkit holds it: a synsets struct array (N x 1) with the devkit's fields."""
    import scipy.io

    fields = ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images")
    rows = [(i, wnid, f"words of {wnid}", f"gloss of {wnid}", 0, np.zeros(0), 0, 1300) for i, wnid in DEVKIT_IDS.items()]
    rows += [(i, wnid, "inner", "inner", 2, np.array([1.0, 2.0]), 1, 0) for i, wnid in INNER_NODES.items()]
    synsets = np.empty((len(rows), 1), dtype=[(f, object) for f in fields])
    for row_index, row in enumerate(rows):
        for field, value in zip(fields, row):
            synsets[row_index, 0][field] = value
    scipy.io.savemat(path, {"synsets": synsets})


def make_photo_tree(out_dir, per_class, seed):
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_photo_tree.py"), str(out_dir), "--classes",
                    str(len(SYNSETS)), "--per_class", str(per_class), "--seed", str(seed)], check=True,
                   capture_output=True)
    return str(out_dir)


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory):
    """The train split converted (labels in TRAIN_ORDER), a flat val folder and its labels in both distributed forms."""
    root = tmp_path_factory.mktemp("imagenet_like")
    order_file = root / "train_order.txt"
    order_file.write_text("\n".join(TRAIN_ORDER) + "\n")
    shards = str(root / "shards")
    convert.convert(make_photo_tree(root / "train", 4, seed=1), shards, "train", 2, class_order_file=str(order_file),
                    num_workers=1)
    # Validation as ImageNet ships it: one flat folder, ILSVRC2012_val_<8 digits>.JPEG, classes interleaved.
    tree = make_photo_tree(root / "val_tree", VAL_PER_CLASS, seed=2)
    val_dir, truth = root / "val", {}
    val_dir.mkdir()
    photos = [(synset, os.path.join(tree, synset, name)) for synset in SYNSETS
              for name in sorted(os.listdir(os.path.join(tree, synset)))]
    for number, index in enumerate(np.random.default_rng(3).permutation(len(photos)), 1):
        synset, path = photos[index]
        image_id = f"ILSVRC2012_val_{number:08d}"
        shutil.copy(path, val_dir / f"{image_id}.JPEG")
        truth[image_id] = synset
    devkit = root / "ILSVRC2012_devkit_t12" / "data"
    devkit.mkdir(parents=True)
    write_meta_mat(devkit / "meta.mat")
    id_of = {wnid: i for i, wnid in DEVKIT_IDS.items()}
    (devkit / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{id_of[truth[k]]}\n" for k in sorted(truth)))
    with open(root / "LOC_val_solution.csv", "w", newline="") as f:  # Kaggle's rows are in no particular order
        rows = csv.writer(f)
        rows.writerow(["ImageId", "PredictionString"])
        for image_id in sorted(truth, key=lambda k: truth[k] + k[::-1]):
            rows.writerow([image_id, f"{truth[image_id]} 12 20 200 180 {truth[image_id]} 3 4 60 70 "])
    return {"root": root, "shards": shards, "val_dir": str(val_dir), "truth": truth,
            "meta": str(devkit / "meta.mat"), "ground_truth": str(devkit / "ILSVRC2012_validation_ground_truth.txt"),
            "loc_csv": str(root / "LOC_val_solution.csv")}


def stored_labels(shards_dir, split):
    """{image id: (label, synset)} of every record of `split`, read back from the TFRecords."""
    stored = {}
    for record in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(os.path.join(shards_dir, f"{split}-*-of-*")))):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        name = os.path.splitext(feature["image/filename"].bytes_list.value[0].decode())[0]
        stored[name] = (feature["image/class/label"].int64_list.value[0],
                        feature["image/class/synset"].bytes_list.value[0].decode())
    return stored


def test_devkit_ground_truth_and_loc_csv_give_the_train_splits_labels(imagenet_like):
    data, shards = imagenet_like, imagenet_like["shards"]
    # The devkit's form, through the command line, into the train split's directory (the usual layout).
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.data.convert", f"--input_dir={data['val_dir']}", f"--output_dir={shards}",
         "--split=validation", "--num_shards=2", "--num_workers=1", f"--labels_file={data['ground_truth']}",
         f"--devkit_meta={data['meta']}", f"--class_order_from={shards}"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Kaggle's form into another directory.
    loc_out = str(data["root"] / "loc_shards")
    convert.convert(data["val_dir"], loc_out, "validation", 1, labels_file=data["loc_csv"], class_order_from=shards,
                    num_workers=1)

    expected = {image_id: (TRAIN_ORDER.index(synset) + 1, synset) for image_id, synset in data["truth"].items()}
    assert stored_labels(shards, "validation") == expected
    assert stored_labels(loc_out, "validation") == expected
    train = json.load(open(os.path.join(shards, "manifest-train.json")))
    for directory in (shards, loc_out):
        validation = json.load(open(os.path.join(directory, "manifest-validation.json")))
        assert validation["classes"] == train["classes"] == list(TRAIN_ORDER)
        assert validation["num_examples"] == len(SYNSETS) * VAL_PER_CLASS


@pytest.mark.parametrize("case", ["id_out_of_range", "inner_node_id", "not_a_number", "too_few_lines", "numbers_only",
                                  "unknown_synset", "row_for_no_image", "image_without_row", "duplicate_row"])
def test_bad_validation_labels_name_the_file_and_line(imagenet_like, tmp_path, case):
    data = imagenet_like
    ground_truth = open(data["ground_truth"]).read().splitlines()
    loc = open(data["loc_csv"]).read().splitlines()
    labels, meta, match = tmp_path / "labels", None, None
    if case in ("id_out_of_range", "inner_node_id", "not_a_number"):
        bad = {"id_out_of_range": "1000", "inner_node_id": "1001", "not_a_number": "n00000001"}[case]
        labels.write_text("\n".join(ground_truth[:4] + [bad] + ground_truth[5:]) + "\n")
        meta = data["meta"]
        match = (f"{labels}:5: 'n00000001' is not an ILSVRC2012_ID" if case == "not_a_number" else
                 f"{labels}:5: ILSVRC2012_ID {bad} is not a leaf class of --devkit_meta {meta} \\(IDs 1-3\\)")
    elif case == "too_few_lines":
        labels.write_text("\n".join(ground_truth[:-1]) + "\n")
        meta = data["meta"]
        match = f"--labels_file {labels} has 8 labels but input_dir {data['val_dir']} has 9 images"
    elif case == "numbers_only":  # the ground truth without the devkit's mapping
        labels.write_text("\n".join(ground_truth) + "\n")
        match = f"--labels_file {labels} holds numbers .* needs --devkit_meta"
    else:
        rows = loc[1:]
        if case == "unknown_synset":
            rows[2] = rows[2].replace(",n0000000", ",n0000009", 1)
            match = (f"{labels}:4: 1 classes of {labels} are not in the train classes of --class_order_from "
                     f"{data['shards']}: n0000009\\d")
        elif case == "row_for_no_image":
            rows.append("ILSVRC2012_val_00000010,n00000001 1 2 3 4")
            match = f"--labels_file {labels} has 10 rows but input_dir .* has 9 images: line 11 names an image that is not"
        elif case == "image_without_row":
            missing = rows.pop(3).split(",")[0]
            match = f"{data['val_dir']}/{missing}.JPEG has no row in --labels_file {labels}"
        else:
            rows.append(rows[0])
            match = f"{labels}:11: {rows[0].split(',')[0]} has a row already, on line 2"
        labels.write_text("\n".join([loc[0]] + rows) + "\n")
    with pytest.raises(ValueError, match=match):
        convert.convert(data["val_dir"], tmp_path / "out", "validation", 1, labels_file=str(labels), devkit_meta=meta,
                        class_order_from=data["shards"], num_workers=1)
    assert not (tmp_path / "out").exists()


def test_a_run_and_an_export_whose_splits_disagree_on_class_order_are_refused(imagenet_like, tmp_path):
    # Train in TRAIN_ORDER; validation converted on its own, its classes sorted: every eval label would be wrong.
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in os.listdir(imagenet_like["shards"]):
        if name.startswith(("train-", "manifest-train")):
            shutil.copy(os.path.join(imagenet_like["shards"], name), shards / name)
    val_tree = make_photo_tree(tmp_path / "val_tree", 2, seed=5)
    convert.convert(val_tree, str(shards), "validation", 1, num_workers=1)
    expected = (f"the validation split does not have the classes of the train split: class index 0 is 'n00000000' "
                f"in {shards / 'manifest-validation.json'} but 'n00000002' in {shards / 'manifest-train.json'}, so eval "
                f"would score predictions against the wrong classes. Convert validation again with "
                f"--class_order_from={shards}")
    overrides = [f"--config.data.data_dir={shards}", "--config.data.num_classes=3", "--config.data.num_train_examples=12",
                 "--config.data.num_eval_examples=6", "--config.model.name=cifar_resnet8",
                 "--config.data.global_batch_size=4"]

    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "tfscale.train", "--config=configs/digits.py", f"--workdir={workdir}",
                             *overrides], cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 65  # a data fault (EX_DATAERR), on one line
    assert result.stderr.strip().splitlines()[-1] == f"FATAL data error: {expected} (exit code 65)"
    assert "Traceback" not in result.stderr
    assert not os.path.exists(workdir / layout.CHECKPOINTS) and not os.path.exists(workdir / layout.METRICS)

    # A run trained before the validation split was replaced: its export is refused too, before any weights load.
    cfg = load_config("digits", *overrides)
    exported = tmp_path / "trained"
    tf.train.Checkpoint(model=engine.build_model(cfg), global_step=tf.Variable(1, dtype=tf.int64)).save(
        str(exported / layout.CHECKPOINTS / "ckpt"))
    (exported / layout.CONFIG).write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(errors.ManifestError) as refused:
        export.export(str(exported))
    assert str(refused.value) == expected and not os.path.exists(exported / "export")

    # The fix the message names: validation converted again in the train split's order.
    convert.convert(val_tree, str(shards), "validation", 1, class_order_from=str(shards), num_workers=1)
    shard_dir.check_same_classes(cfg.data)
