"""The data paths a new user walks, as they walk them: README step 2 on their own converted photo tree, and
a TFDS dataset prepared as docs/data.md says (imagenet2012 from a manual-download directory).

Real photos throughout (tools/make_photo_tree.py crops the two scikit-learn ships), real conversion, real
`tfds` preparation, and training as a subprocess of the command a user types. The counts the data hold
(classes, examples) replace a recipe's ImageNet-1k defaults; a count the user states must match.
"""

import json
import os
import subprocess
import sys
import tarfile

import keras
import pytest
import tensorflow as tf
from conftest import REPO, load_config
from helpers.cli_batch import run_batch

from tfscale import config as tfs_config
from tfscale.config import validation
from tfscale.data.convert import convert
from tfscale.data.input import info, pipeline, shard_dir
from tfscale.training import engine
from tfscale.workdir import layout

NUM_CLASSES = 10
TRAIN_PER_CLASS, EVAL_PER_CLASS = 2, 1
# README step 2, as printed there; the test adds the overrides a 2-core CPU needs to finish in seconds.
README_STEP_2 = "tfscale-train --config=r50_1gpu --workdir=runs/r50 --config.data.data_dir="
FEW_STEPS = ("--config.train.epochs=1", "--config.data.global_batch_size=4")  # 20 photos: 5 steps


def make_photo_tree(out_dir, per_class: int, seed: int) -> str:
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_photo_tree.py"), str(out_dir), "--classes",
                    str(NUM_CLASSES), "--per_class", str(per_class), "--seed", str(seed)], check=True,
                   capture_output=True)
    return str(out_dir)


def train_command() -> list[str]:
    """`tfscale-train` where the package installed it (as the README runs it), else the module it runs."""
    script = os.path.join(os.path.dirname(sys.executable), "tfscale-train")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "tfscale.train"]


def log_lines(stderr: str, module: str) -> list[str]:
    """The messages absl logged from `module`.py, without time, thread and file prefix."""
    return [line.split("] ", 1)[1] for line in stderr.splitlines() if f" {module}.py:" in line and "] " in line]


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    """A 10-class photo tree (20 train, 10 validation photos) converted as README step 1 converts one."""
    root = tmp_path_factory.mktemp("photos")
    out = str(root / "shards")
    convert.convert(make_photo_tree(root / "train", TRAIN_PER_CLASS, seed=1), out, "train", 2, num_workers=1)
    convert.convert(make_photo_tree(root / "val", EVAL_PER_CLASS, seed=2), out, "validation", 1, num_workers=1)
    return out


@pytest.mark.slow
def test_readme_step_2_trains_on_a_converted_photo_tree(photo_shards, tmp_path):
    """The README's command with only the run length and batch added: the manifests' counts replace the
    recipe's ImageNet ones and its step decay shrinks with the epochs, each logged; the run ends checkpointed."""
    with open(os.path.join(REPO, "README.md")) as f:
        assert README_STEP_2 in f.read()  # the command below is still the one README step 2 prints
    argv = README_STEP_2.split()[1:-1] + [f"--config.data.data_dir={photo_shards}", *FEW_STEPS]
    result = subprocess.run(train_command() + argv, cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    train_manifest = os.path.join(photo_shards, "manifest-train.json")
    adopted = log_lines(result.stderr, "info")
    assert f"config.data.num_classes=10 from {train_manifest} (in place of ImageNet-1k's 1000, base_config's default)" \
        in adopted, adopted
    assert any(line.startswith(f"config.data.num_train_examples=20 from {train_manifest} ") for line in adopted)
    assert any(line.startswith(f"config.data.num_eval_examples=10 from {photo_shards}/manifest-validation.json ")
               for line in adopted)
    assert ("config.schedule.decay_epochs=(0.3333, 0.6667, 0.8889): config.schedule.decay_fractions "
            "(0.3333, 0.6667, 0.8889) of config.train.epochs=1") in log_lines(result.stderr, "validation")
    workdir = tmp_path / "runs" / "r50"
    summary = json.loads((workdir / layout.SUMMARY).read_text())
    assert summary["steps"] == 5 and summary["global_batch_size"] == 4
    assert tf.train.latest_checkpoint(str(workdir / layout.CHECKPOINTS)).endswith("ckpt-5")
    recorded = json.loads((workdir / layout.CONFIG).read_text())
    assert (recorded["data"]["num_classes"], recorded["data"]["num_train_examples"],
            recorded["data"]["num_eval_examples"]) == (10, 20, 10)


@pytest.mark.slow
def test_a_count_the_user_states_is_kept_and_checked(photo_shards, cli_runs):
    """--config.data.num_classes=1000 is the user's statement, not a default: the manifest refutes it, and the
    run stops in one line before building anything. A recipe's own non-ImageNet count is checked the same way."""
    result, workdir = cli_runs["stated_count"]
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"FATAL config error: config.data.num_classes=1000 but {photo_shards}/manifest-train.json says 10")
    assert not os.path.exists(workdir / layout.CHECKPOINTS)

    recipe = load_config("smoke", "--config.data.dataset=tfrecord", f"--config.data.data_dir={photo_shards}")
    info.adopt(recipe.data, info.facts(recipe.data))  # smoke.py says 640 training examples: not a default
    validation.validate(recipe)
    with pytest.raises(tfs_config.ConfigError, match=r"config.data.num_train_examples=640 but .*manifest-train.json "
                       r"says 20"):
        shard_dir.check_against_manifest(recipe.data, photo_shards, "train", recipe.data.num_train_examples)


# ------------------------------------------------------------------------------------------------ TFDS


def write_imagenet_manual_dir(photos: str, manual_dir: str) -> list[str]:
    """The photo tree as ImageNet's two download tars: a tar per synset inside ILSVRC2012_img_train.tar, and
    ILSVRC2012_val_*.JPEG files (labelled by TFDS's own validation label list) in ILSVRC2012_img_val.tar."""
    import tensorflow_datasets as tfds

    synsets = tfds.builder("imagenet2012").info.features["label"].names[:NUM_CLASSES]
    os.makedirs(manual_dir)
    val_photos = []
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"), "w") as train_tar:
        for synset, folder in zip(synsets, sorted(os.listdir(photos))):
            names = sorted(os.listdir(os.path.join(photos, folder)))
            inner = os.path.join(manual_dir, f"{synset}.tar")
            with tarfile.open(inner, "w") as class_tar:
                for i, name in enumerate(names[:TRAIN_PER_CLASS]):
                    class_tar.add(os.path.join(photos, folder, name), arcname=f"{synset}_{i}.JPEG")
            train_tar.add(inner, arcname=f"{synset}.tar")
            os.remove(inner)
            val_photos += [os.path.join(photos, folder, name) for name in names[TRAIN_PER_CLASS:]]
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_val.tar"), "w") as val_tar:
        for i, path in enumerate(val_photos, 1):
            val_tar.add(path, arcname=f"ILSVRC2012_val_{i:08d}.JPEG")
    return val_photos


@pytest.fixture(scope="module")
def imagenet_tfds(tmp_path_factory):
    """imagenet2012 prepared by TFDS from a manual_dir of 20 train and 10 validation photos (docs/data.md 'TFDS')."""
    import tensorflow_datasets as tfds

    root = tmp_path_factory.mktemp("tfds")
    photos = make_photo_tree(root / "photos", TRAIN_PER_CLASS + EVAL_PER_CLASS, seed=3)
    val_photos = write_imagenet_manual_dir(photos, str(root / "manual"))
    builder = tfds.builder("imagenet2012", data_dir=str(root / "data"))
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(root / "manual")))
    return {"data_dir": str(root / "data"), "names": builder.info.features["label"].names, "val_photos": val_photos,
            "info_file": os.path.join(builder.data_dir, "dataset_info.json")}


@pytest.fixture(scope="module")
def cli_runs(photo_shards, imagenet_tfds, tmp_path_factory):
    """{name: (CompletedProcess, workdir)} of this module's `python -m tfscale.train` / `tfscale.export` command
    lines, one after the other, each its own process forked from one that imported them once
    (tests/helpers/cli_batch.py): a count the user states (refused), then TFDS imagenet2012 trained and
    exported."""
    root = tmp_path_factory.mktemp("cli")
    refused_workdir, tfds_workdir = root / "stated_count", root / "tfds" / "run"
    refused_workdir.mkdir()  # an existing, empty workdir: the refusal must leave it so
    commands = {
        "stated_count": ["-m", "tfscale.train", "--config=r50_1gpu", f"--workdir={refused_workdir}", *FEW_STEPS,
                         f"--config.data.data_dir={photo_shards}", "--config.data.num_classes=1000"],
        "tfds_train": ["-m", "tfscale.train", "--config=r50_1gpu", f"--workdir={tfds_workdir}", *FEW_STEPS,
                       "--config.data.dataset=tfds", "--config.data.tfds_name=imagenet2012",
                       f"--config.data.data_dir={imagenet_tfds['data_dir']}",
                       "--config.model.name=cifar_resnet8", "--config.data.image_size=32"],  # a cheap model
        "tfds_export": ["-m", "tfscale.export", f"--workdir={tfds_workdir}"],
    }
    results = run_batch(list(commands.values()), preload=["tfscale.training.train", "tfscale.export"], cwd=REPO,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout_s=900)
    workdirs = {"stated_count": refused_workdir, "tfds_train": tfds_workdir, "tfds_export": tfds_workdir}
    return {name: (result, workdirs[name]) for name, result in zip(commands, results)}


@pytest.mark.slow
def test_tfds_imagenet_trains_through_the_cli_and_exports_its_class_names(imagenet_tfds, cli_runs):
    """dataset=tfds as docs/data.md runs it: the example counts come from TFDS's info (logged), and the export
    names its outputs with the dataset's 1000 synsets, in labels.txt and in the served top-5."""
    result, workdir = cli_runs["tfds_train"]
    workdir = str(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    adopted = log_lines(result.stderr, "info")
    assert any(line.startswith(f"config.data.num_train_examples=20 from {imagenet_tfds['info_file']} ")
               for line in adopted), adopted
    assert any(line.startswith(f"config.data.num_eval_examples=10 from {imagenet_tfds['info_file']} ")
               for line in adopted), adopted
    with open(os.path.join(workdir, layout.METRICS)) as f:
        assert [json.loads(line)["eval_examples"] for line in f if "eval_top1" in line] == [10]

    exported, _ = cli_runs["tfds_export"]
    assert exported.returncode == 0, exported.stderr[-3000:]
    export_dir = os.path.join(workdir, "export")
    with open(os.path.join(export_dir, "export.json")) as f:
        export_info = json.load(f)
    assert export_info["class_names"] == imagenet_tfds["names"] and len(export_info["class_names"]) == 1000
    assert export_info["class_names_source"] == f"TFDS dataset info {imagenet_tfds['info_file']}"
    with open(os.path.join(export_dir, "labels.txt")) as f:
        assert f.read().split() == imagenet_tfds["names"]
    served = tf.saved_model.load(os.path.join(export_dir, "saved_model")).signatures["serving_default"]
    with open(imagenet_tfds["val_photos"][0], "rb") as f:
        out = served(images=tf.constant([f.read()]))
    ids, classes = out["top5_ids"][0].numpy(), [c.decode() for c in out["top5_classes"][0].numpy()]
    assert classes == [imagenet_tfds["names"][i] for i in ids]


def test_tfds_split_of_fewer_files_than_workers_is_refused_by_name(imagenet_tfds):
    """TFDS hands each worker whole files; 2 workers on a 1-file split are refused before anything is built,
    naming split, files, workers and the ways out, where tfds itself would fail inside every worker's input."""
    cfg = load_config("r50_1gpu", "--config.data.dataset=tfds", "--config.data.tfds_name=imagenet2012",
                      f"--config.data.data_dir={imagenet_tfds['data_dir']}")
    info.check_tfds_files(cfg.data, num_workers=1)
    with pytest.raises(tfs_config.ConfigError) as refused:
        info.check_tfds_files(cfg.data, num_workers=2)
    message = str(refused.value)
    for part in ("config.data.train_split='train' of TFDS dataset imagenet2012/5.1.0", "is 1 file(s) but this run "
                 "has 2 workers", "num_shards=2", "at most 1 worker(s)", "tfscale-convert"):
        assert part in message, message
    two_workers = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=2)
    validation.validate(cfg)
    with pytest.raises(ValueError, match=r"`num_shards=1` but `num_input_pipelines=2`"):
        pipeline.train_input_fn(cfg.data, seed=0, start_step=0)(two_workers)


@pytest.mark.slow
def test_the_finetune_recipe_starts_an_application_from_its_keras_weights_file(photo_shards, tmp_path):
    """configs/finetune_app.py on the converted photo tree, from an EfficientNetV2B0 weights file in the Keras 2
    .h5 form Keras distributes ImageNet weights in (written here from a fresh model: nothing is downloaded)."""
    weights = tmp_path / "efficientnetv2-b0_notop.h5"
    # Written in this process (Keras is imported here already): a process of its own would import TensorFlow
    # for it. Under float32, whatever a test before this one left as Keras' global policy.
    with engine.precision_policy("float32"):
        keras.applications.EfficientNetV2B0(include_top=False, weights=None, input_shape=(64, 64, 3),
                                            include_preprocessing=False).save(str(weights))
    result = subprocess.run(
        train_command() + ["--config=finetune_app", "--workdir=runs/ft", f"--config.data.data_dir={photo_shards}",
                           f"--config.model.init_from={weights}", "--config.data.image_size=64",
                           "--config.schedule.warmup_epochs=0.2", *FEW_STEPS],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = [line for line in log_lines(result.stderr, "init_from") if line.startswith(f"init_from {weights}")]
    assert loaded and loaded[0].endswith("re-initialised logits/kernel, logits/bias"), loaded
    summary = json.loads((tmp_path / "runs" / "ft" / layout.SUMMARY).read_text())
    assert summary["steps"] == 5 and "eval_top1" in summary
    recorded = json.loads((tmp_path / "runs" / "ft" / layout.CONFIG).read_text())
    assert (recorded["model"]["name"], recorded["data"]["num_classes"]) == ("keras.applications.EfficientNetV2B0", 10)
