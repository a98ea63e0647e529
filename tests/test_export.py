"""Export: the user's whole path from an image folder to a served model, and the export's own contracts."""

import json
import os
import shutil
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, load_config
from helpers.cli_batch import run_batch
from PIL import Image

from tfscale import export
from tfscale.training import engine, train
from tfscale.workdir import layout

DIGIT_CLASSES = [f"digit_{d}" for d in range(10)]
IMAGE_SIZE_PX = 16  # the 8x8 scans upscaled: 4x cheaper than 32x32 and still ~95% top-1 after 88 steps
HOLDOUT_FRACTION = 0.2

# Runs in a fresh interpreter that never imports tfscale: what a serving host does with the export.
SERVE_SCRIPT = r'''
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

export_dir, image_dir = sys.argv[1], sys.argv[2]
with open(os.path.join(export_dir, "labels.txt")) as f:
    class_ids = {name: i for i, name in enumerate(line.strip() for line in f)}
paths = sorted(os.path.join(root, name) for root, _, names in os.walk(image_dir) for name in names)
truth = [class_ids[os.path.basename(os.path.dirname(p))] for p in paths]
loaded = tf.saved_model.load(os.path.join(export_dir, "saved_model"))  # kept: the signature uses its variables
serve = loaded.signatures["serving_default"]
outputs = {"probabilities": [], "top5_ids": [], "top5_classes": []}
for start in range(0, len(paths), 64):
    encoded = [open(p, "rb").read() for p in paths[start:start + 64]]
    result = serve(images=tf.constant(encoded))
    for key in outputs:
        outputs[key].append(result[key].numpy())
probabilities, top5_ids, top5_classes = (np.concatenate(outputs[key]) for key in outputs)
predicted = top5_ids[:, 0]

# model.keras on the first images, decoded as the eval pipeline does (16x16 files: no resize).
model = keras.models.load_model(os.path.join(export_dir, "model.keras"))
pixels = np.stack([tf.io.decode_jpeg(open(p, "rb").read(), channels=3, dct_method="INTEGER_FAST").numpy()
                   for p in paths[:8]])
keras_probabilities = tf.nn.softmax(model(pixels, training=False)).numpy()
print(json.dumps({
    "num_images": len(paths),
    "num_correct": int(sum(int(p) == t for p, t in zip(predicted, truth))),
    "argmax_is_top1": bool((np.argmax(probabilities, axis=1) == predicted).all()),
    "dtypes": [str(probabilities.dtype), str(top5_ids.dtype)],
    "top5_shape": list(top5_ids.shape),
    "top1_class_names_agree": all(c[0].decode() == list(class_ids)[i] for c, i in zip(top5_classes, predicted)),
    "probability_sums": [float(probabilities.sum(axis=1).min()), float(probabilities.sum(axis=1).max())],
    "keras_max_abs_diff": float(np.abs(keras_probabilities - probabilities[:8]).max()),
    "keras_argmax_agrees": bool((np.argmax(keras_probabilities, axis=1) == predicted[:8]).all()),
    "keras_layer_classes": sorted({type(layer).__module__.split(".")[0] for layer in model.layers}),
    "tfscale_imported": "tfscale" in sys.modules,
}))
'''


def write_digit_jpegs(root) -> dict:
    """scikit-learn's real digit scans as RGB baseline JPEGs (quality 95) in train/ and validation/ class folders."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    counts = {"train": 0, "validation": 0}
    for label in range(10):
        indices = rng.permutation(np.flatnonzero(digits.target == label))
        num_holdout = round(len(indices) * HOLDOUT_FRACTION)
        for position, index in enumerate(indices):
            split = "validation" if position < num_holdout else "train"
            folder = os.path.join(root, split, DIGIT_CLASSES[label])
            os.makedirs(folder, exist_ok=True)
            pixels = (digits.images[index] * (255.0 / 16.0)).astype(np.uint8)  # scans are 0..16
            image = Image.fromarray(pixels, mode="L").resize((IMAGE_SIZE_PX, IMAGE_SIZE_PX), Image.BICUBIC)
            image.convert("RGB").save(os.path.join(folder, f"scan_{index:04d}.jpg"), quality=95)
            counts[split] += 1
    return counts


def quiet_env():
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def convert_both_splits(images_dir, shards_dir):
    """`python -m tfscale.data.convert` (what tfscale-convert runs) for both splits, side by side."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tfscale.data.convert", f"--input_dir={os.path.join(images_dir, split)}",
             f"--output_dir={shards_dir}", f"--split={split}", f"--num_shards={num_shards}", "--num_workers=1"],
            cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for split, num_shards in (("train", 2), ("validation", 1))
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]


def stored_images(shards_dir, split):
    """{file name: encoded bytes} of every example in the split's shards."""
    files = sorted(tf.io.gfile.glob(os.path.join(shards_dir, f"{split}-*-of-*")))
    stored = {}
    for record in tf.data.TFRecordDataset(files):
        example = tf.train.Example.FromString(record.numpy())
        feature = example.features.feature
        stored[feature["image/filename"].bytes_list.value[0].decode()] = feature["image/encoded"].bytes_list.value[0]
    return stored


def train_digits(workdir: str, counts: dict, *data_flags: str) -> float:
    """2-worker MWMS training of the digits recipe through tfscale.launch; returns the seconds from
    summary.json's write to the job's exit."""
    launch = subprocess.run(
        [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--", "-m", "tfscale.train",
         "--config=configs/digits.py", f"--workdir={workdir}", *data_flags,
         "--config.distribute.backend=mwms", f"--config.data.num_train_examples={counts['train']}",
         f"--config.data.num_eval_examples={counts['validation']}", f"--config.data.image_size={IMAGE_SIZE_PX}",
         "--config.model.name=cifar_resnet8", "--config.optim.lr_per_256=1.6", "--config.train.epochs=4",
         "--config.schedule.warmup_epochs=0.5", "--config.train.eval_every_epochs=4",
         "--config.checkpoint.every_epochs=4", "--config.train.log_every_steps=22"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=600,
    )
    exited_at = time.time()
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    return exited_at - os.path.getmtime(os.path.join(workdir, layout.SUMMARY))


@pytest.fixture(scope="module")
def digits_export(digit_shards, tmp_path_factory):
    """Image folders -> shards -> 2-worker MWMS training -> `python -m tfscale.export` -> fresh-process serving.

    The folders and shards are the session's (conftest's digit_shards: write_digit_jpegs and convert_both_splits
    below, into images/ and shards/ of one folder). The export runs beside `tfscale.export` of a missing workdir
    (test_cli_reports_a_missing_workdir_in_one_line): two processes forked from one that imported tfscale.export
    once (tests/helpers/cli_batch.py)."""
    shards_dir, counts = digit_shards
    images_dir = os.path.join(os.path.dirname(shards_dir), "images")
    assert sorted(os.listdir(images_dir)) == ["train", "validation"]
    root = tmp_path_factory.mktemp("digits")
    workdir, missing_workdir = str(root / "train"), str(root / "missing")
    exit_after_summary_s = train_digits(workdir, counts, f"--config.data.data_dir={shards_dir}")
    exported, missing = run_batch([["-m", "tfscale.export", f"--workdir={workdir}"],
                                   ["-m", "tfscale.export", f"--workdir={missing_workdir}"]],
                                  preload=["tfscale.export"], cwd=REPO, env=quiet_env())
    assert exported.returncode == 0, exported.stderr[-3000:]
    script = root / "serve.py"
    script.write_text(SERVE_SCRIPT)
    served = subprocess.run(
        [sys.executable, str(script), os.path.join(workdir, "export"), os.path.join(images_dir, "validation")],
        cwd=str(root), env=quiet_env(), capture_output=True, text=True, timeout=300,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    with open(os.path.join(workdir, layout.SUMMARY)) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "export", "export.json")) as f:
        info = json.load(f)
    return {"images_dir": images_dir, "shards_dir": shards_dir, "workdir": workdir, "counts": counts,
            "summary": summary, "info": info, "served": json.loads(served.stdout.strip().splitlines()[-1]),
            "exit_after_summary_s": exit_after_summary_s, "missing_workdir": (missing_workdir, missing)}


# First of the module's readers, and alone: the digits run (made for the first reader) and the synthetic
# run it is compared with must each have the machine to themselves, or their exit times compare the load.
@pytest.mark.slow
@pytest.mark.alone
def test_the_run_ends_at_once_after_its_last_step(digits_export, tmp_path):
    """From the last step to the job's exit only the final eval and checkpoint take time: ending the
    input and writing the summary cost a few % of the run (an input whose teardown waited for tf.data's
    autotuner once cost 5-30 s on every worker), as the run measures itself in summary.json; and the
    processes exit after the summary as promptly as the same job on synthetic data."""
    summary = digits_export["summary"]
    end = summary["end_of_run_s"]
    assert set(end) == {"total", "input_release", "final_eval", "final_checkpoint"}
    assert 0 < end["final_eval"] < end["total"]
    idle_s = end["total"] - end["final_eval"] - end["final_checkpoint"]  # the input's end and the summary
    assert idle_s < 0.05 * summary["wall_time_s"], (end, summary["wall_time_s"])

    synthetic_exit_s = train_digits(str(tmp_path), digits_export["counts"], "--config.data.dataset=synthetic",
                                    "--config.data.data_dir=")
    assert digits_export["exit_after_summary_s"] < 2 * synthetic_exit_s, (digits_export["exit_after_summary_s"],
                                                                          synthetic_exit_s)


@pytest.mark.slow
def test_shards_hold_the_original_jpeg_bytes(digits_export):
    """The premise of predicting from the original files: the converter stored them unchanged."""
    validation_dir = os.path.join(digits_export["images_dir"], "validation")
    stored = stored_images(digits_export["shards_dir"], "validation")
    assert len(stored) == digits_export["counts"]["validation"] == 359
    for class_name in DIGIT_CLASSES:
        for name in os.listdir(os.path.join(validation_dir, class_name)):
            with open(os.path.join(validation_dir, class_name, name), "rb") as f:
                assert stored[name] == f.read(), name


@pytest.mark.slow
def test_served_savedmodel_reproduces_the_runs_eval_top1_exactly(digits_export):
    served, summary = digits_export["served"], digits_export["summary"]
    assert summary["num_workers"] == 2
    assert served["num_images"] == 359
    assert served["num_correct"] / served["num_images"] == summary["eval_top1"]
    assert summary["eval_top1"] > 0.7  # 10 classes: chance is 0.1 (runs here: 0.88-0.95)
    assert not served["tfscale_imported"]


@pytest.mark.slow
def test_served_outputs_are_float32_probabilities_with_named_top5(digits_export):
    served = digits_export["served"]
    assert served["dtypes"] == ["float32", "int32"]
    assert served["top5_shape"] == [359, 5]
    assert served["argmax_is_top1"] and served["top1_class_names_agree"]
    assert served["probability_sums"][0] == pytest.approx(1.0, abs=1e-5)
    assert served["probability_sums"][1] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_keras_model_loads_without_tfscale_and_agrees_with_the_savedmodel(digits_export):
    served = digits_export["served"]
    assert served["keras_layer_classes"] == ["keras"]  # core layers only
    # The SavedModel ran batches of 64 and model.keras a batch of 8: oneDNN picks kernels by batch size, so
    # float32 sums differ in their last bits (runs here: 0 to 1.2e-6); a wrong export differs by ~0.1.
    assert served["keras_max_abs_diff"] < 1e-5
    assert served["keras_argmax_agrees"]


@pytest.mark.slow
def test_export_json_and_labels(digits_export):
    info, summary, workdir = digits_export["info"], digits_export["summary"], digits_export["workdir"]
    export_dir = os.path.join(workdir, "export")
    assert info["step"] == summary["steps"] == 88
    assert info["checkpoint"] == os.path.join(workdir, layout.CHECKPOINTS, "ckpt-88")
    assert info["eval_metrics"] == {"eval_top1": summary["eval_top1"], "eval_top5": summary["eval_top5"],
                                    "eval_loss": summary["eval_loss"], "step": 88}
    assert info["class_names"] == DIGIT_CLASSES and info["num_classes"] == 10
    assert "manifest" in info["class_names_source"]
    with open(os.path.join(export_dir, "labels.txt")) as f:
        assert f.read().splitlines() == DIGIT_CLASSES
    assert info["preprocessing"]["image_size"] == IMAGE_SIZE_PX and info["preprocessing"]["augment"] == "none"
    assert info["precision"] == {"trained": "float32", "exported": "float32"}
    assert info["config"]["model"]["name"] == "cifar_resnet8"
    assert set(info["versions"]) == {"tensorflow", "keras", "python", "tfscale"}
    assert info["versions"]["tensorflow"] == tf.__version__
    for key in ("keras_model", "saved_model", "labels", "export_json"):
        assert os.path.exists(info["artifacts"][key]), key
    assert sorted(os.listdir(export_dir)) == ["export.json", "labels.txt", "model.keras", "saved_model"]


@pytest.fixture(scope="module")
def bfloat16_run(tmp_path_factory):
    """5 steps of the smoke model trained in mixed_bfloat16 (synthetic data, one process)."""
    workdir = str(tmp_path_factory.mktemp("bf16"))
    cfg = load_config("smoke", "--config.precision=mixed_bfloat16", "--config.train.epochs=0.25",
                      "--config.schedule.warmup_epochs=0.1", "--config.data.num_eval_examples=32")
    train.train_and_evaluate(cfg, workdir)
    return workdir


@pytest.fixture(scope="module")
def bfloat16_export(bfloat16_run, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("bf16_export") / "export")
    return output_dir, export.export(bfloat16_run, output_dir)


def test_bfloat16_run_exports_float32(bfloat16_export):
    output_dir, info = bfloat16_export
    assert info["precision"] == {"trained": "mixed_bfloat16", "exported": "float32"}
    assert info["class_names"] is None and "synthetic_learnable" in info["class_names_source"]
    assert sorted(os.listdir(output_dir)) == ["export.json", "model.keras", "saved_model"]  # no labels.txt

    pixels = np.random.default_rng(0).integers(0, 256, size=(3, 40, 48, 3), dtype=np.uint8)
    encoded = [tf.io.encode_jpeg(p).numpy() for p in pixels[:2]] + [tf.io.encode_png(pixels[2]).numpy()]
    loaded = tf.saved_model.load(os.path.join(output_dir, "saved_model"))
    outputs = loaded.signatures["serving_default"](images=tf.constant(encoded))
    assert outputs["probabilities"].dtype == tf.float32 and outputs["logits"].dtype == tf.float32
    assert outputs["probabilities"].shape == (3, 10) and outputs["top5_ids"].shape == (3, 5)
    np.testing.assert_allclose(outputs["probabilities"].numpy().sum(axis=1), 1.0, atol=1e-5)
    assert "top5_classes" not in outputs

    model = keras.models.load_model(os.path.join(output_dir, "model.keras"))
    assert {layer.dtype_policy.name for layer in model.layers} == {"float32"}
    # The Keras model on the pixels the SavedModel preprocesses (center crop + resize, inside the graph).
    from tfscale.data.input import preprocess

    cropped = np.stack([preprocess.eval_preprocess(tf.constant(e), image_size=32, augment="imagenet").numpy()
                        for e in encoded])
    np.testing.assert_allclose(tf.nn.softmax(model(cropped)).numpy(), outputs["probabilities"].numpy(), atol=1e-6)


def test_reexport_replaces_the_previous_export_whole(bfloat16_run, bfloat16_export, tmp_path):
    output_dir = tmp_path / "export"
    shutil.copytree(bfloat16_export[0], output_dir)  # a previous export
    (output_dir / "stale.txt").write_text("from an earlier export")
    with pytest.raises(FileNotFoundError, match="no_such_ckpt"):
        export.export(bfloat16_run, str(output_dir), checkpoint=os.path.join(bfloat16_run, "no_such_ckpt"))
    assert (output_dir / "stale.txt").exists()  # a failed export leaves the previous one alone
    info = export.export(bfloat16_run, str(output_dir))
    assert not (output_dir / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary directories left behind
    assert info["step"] == 5


def test_channels_first_run_exports_a_model_that_serves_on_cpu(tmp_path):
    """GPU recipes may train channels_first (CPUs cannot run it): the export is channels_last, same weights."""
    cfg = load_config("smoke", "--config.model.data_format=channels_first", "--config.data.num_classes=3")
    model = engine.build_model(cfg)
    rng = np.random.default_rng(0)
    for weight in model.weights:  # distinct values everywhere, so a misplaced weight cannot go unnoticed
        weight.assign(rng.uniform(0.5, 1.5, size=weight.shape).astype("float32"))
    step = tf.Variable(7, dtype=tf.int64)
    tf.train.Checkpoint(model=model, global_step=step).save(str(tmp_path / layout.CHECKPOINTS / "ckpt"))
    (tmp_path / layout.CONFIG).write_text(json.dumps(cfg.to_dict()))

    info = export.export(str(tmp_path))
    assert info["step"] == 7
    exported = keras.models.load_model(os.path.join(str(tmp_path), "export", "model.keras"))
    assert {layer.data_format for layer in exported.layers if hasattr(layer, "data_format")} == {"channels_last"}
    expected = {w.path: w.numpy() for w in model.weights}
    assert {w.path for w in exported.weights} == set(expected)
    for weight in exported.weights:
        np.testing.assert_array_equal(weight.numpy(), expected[weight.path], err_msg=weight.path)
    loaded = tf.saved_model.load(os.path.join(str(tmp_path), "export", "saved_model"))
    image = tf.io.encode_png(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8))
    assert loaded.signatures["serving_default"](images=tf.stack([image]))["probabilities"].shape == (1, 3)


def test_bad_workdirs_fail_naming_the_path(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=f"workdir {missing} does not exist"):
        export.export(missing)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/config.json does not exist"):
        export.export(str(tmp_path))
    (tmp_path / layout.CONFIG).write_text(json.dumps(load_config("smoke").to_dict()))
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {tmp_path}/checkpoints"):
        export.export(str(tmp_path))


def test_only_an_earlier_export_is_ever_replaced(tmp_path):
    precious = tmp_path / "results"
    precious.mkdir()
    (precious / "notes.txt").write_text("not an export")
    with pytest.raises(FileExistsError, match=f"output_dir {precious} exists and is not a tfscale export"):
        export.export(str(tmp_path), str(precious))
    assert (precious / "notes.txt").read_text() == "not an export"
    with pytest.raises(ValueError, match="would replace the training workdir"):
        export.export(str(tmp_path), str(tmp_path))


@pytest.mark.slow
def test_cli_reports_a_missing_workdir_in_one_line(digits_export):
    missing_workdir, result = digits_export["missing_workdir"]  # `python -m tfscale.export --workdir=<missing>`
    assert result.returncode == 1
    assert f"workdir {missing_workdir} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
