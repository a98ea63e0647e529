r"""Export a trained run for inference: a Keras model, a SavedModel serving encoded images, labels.

    python -m tfscale.export --workdir=runs/digits [--output_dir=runs/digits/export] \
        [--checkpoint=runs/digits/checkpoints/ckpt-330]

Rebuilds the model from `W/config.json`, restores the model weights of the latest checkpoint in
`W/checkpoints` (or `--checkpoint`) and writes into the output directory (default `W/export`). A run
trained with `optim.ema_decay` > 0 exports the exponential moving average of its weights (`tfscale.model.ema`:
the averaged trainable variables, BatchNorm moving statistics as they are), the weights its
`eval_*_ema` metrics were measured on; export.json's `weights` says which ("ema" or "raw"):

  model.keras    Keras 3 model: uint8 images [N, S, S, 3] (0-255 RGB, already preprocessed) -> float32
                 logits. Plain Keras: `keras.models.load_model` reads it without tfscale installed
                 (tfscale's normalisation layer is saved as `keras.layers.Normalization`, bit-identical).
  saved_model/   TensorFlow SavedModel; signature `serving_default` takes `images`, a tf.string [N] of
                 encoded JPEG/PNG/BMP/GIF files, and returns float32 `probabilities` [N, C] and `logits`,
                 int32 `top5_ids` and float32 `top5_probabilities` [N, min(5, C)], plus tf.string
                 `top5_classes` and `top5_texts` when class names are known. tfscale's eval preprocessing
                 (`data.preprocess.eval_preprocess` with the run's image size, augment and crop) runs
                 inside, so `tf.saved_model.load` alone serves it: no tfscale, no Python preprocessing.
  labels.txt     one class name per line, line i = class id i (when class names are known).
  export.json    config, checkpoint and step, which weights ("ema" or "raw"), the run's eval metrics of
                 those weights (summary.json), class names, preprocessing, versions, and the paths of
                 the artefacts.

Class names come from the conversion manifest of the training shards (`data.data_dir`), or from the
TFDS dataset's info (its label feature's names) for `data.dataset=tfds`; synthetic
data or shards without a manifest export without them (export.json says why). A run whose eval split's
manifest orders the classes otherwise is refused: its eval metrics scored the wrong labels. The
exported graph is float32 whatever precision the run trained in, and channels_last with plain
BatchNormalization (same weights), so it serves on CPUs. The output directory is replaced only when it holds an earlier export
(or nothing), and only once the new export is complete: that is built in a temporary directory next
to it and renamed into place. A single-process tool: run it once, not under tfscale.launch.
"""

from __future__ import annotations

from tfscale import logs
from tfscale.workdir import layout

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported
logs.import_tensorflow_without_banner()  # a program: TensorFlow without its oneDNN notice

import copy
import json
import os
import platform
import shutil
import tempfile
import time

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import flags, logging

import tfscale
from tfscale import cli
from tfscale.data.input import info as data_info
from tfscale.data.input import preprocess, shard_dir
from tfscale.model import ema, models
from tfscale.training import engine, init_from

SIGNATURE = "serving_default"
KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"
LABELS_FILE = "labels.txt"
EXPORT_JSON = "export.json"
_TOP_K = 5


# --- the model --------------------------------------------------------------------------------------


def _inference_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`cfg` with the training-only model choices undone; the variables keep their shapes.

    channels_first convolutions do not run on CPUs, and synchronized BatchNormalization only matters
    for training batch statistics.
    """
    cfg = copy.deepcopy(cfg)  # keeps each key's type (jit_compile takes 'auto' or a bool)
    cfg.model.data_format = "channels_last"
    cfg.model.sync_bn = False
    return cfg


def weights_exported(cfg: ml_collections.ConfigDict) -> str:
    """Which weights an export of the run holds: "ema" when it kept an EMA (`optim.ema_decay` > 0), else "raw"."""
    return "ema" if float(cfg.optim.get("ema_decay", 0.0) or 0.0) > 0.0 else "raw"


def _swap_in_ema(run: init_from.RestoredRun) -> None:
    """Replaces the trainable variables of `run.model` by their EMA from the checkpoint's optimizer.

    The optimizer is rebuilt as the run built it (LossScaleOptimizer and all, so its checkpoint entries
    line up); every one of its variables, the averages among them, must be in the checkpoint.
    """
    optimizer = engine.build_optimizer(run.cfg, run.model)
    status = tf.train.Checkpoint(optimizer=optimizer).restore(run.checkpoint)
    status.assert_existing_objects_matched().expect_partial()
    count = ema.copy_into(run.model, optimizer)
    logging.info("exporting the EMA of the weights (optim.ema_decay=%g): %d variables", run.cfg.optim.ema_decay, count)


def restore_for_inference(workdir: str, checkpoint: str | None = None) -> init_from.RestoredRun:
    """The run's model in float32, channels_last, with the checkpoint's weights; `cfg` is the run's own.

    The checkpoint is restored into the model as trained (a checkpoint addresses layers by their
    position, which channels_first's extra transpose shifts), then copied by layer name. With
    `optim.ema_decay` > 0 the weights are the EMA (`weights_exported`).
    """
    with engine.precision_policy("float32"):
        run = init_from.restore_run(workdir, engine.build_model, checkpoint)
        if weights_exported(run.cfg) == "ema":
            _swap_in_ema(run)
        model = engine.build_model(_inference_config(run.cfg))
        init_from.load_weights(model, init_from.model_weights(run.model), skip_head=False, where=run.checkpoint)
    return run._replace(model=model)


def _variance_with_exact_sqrt(stddev: float) -> float:
    """A float32 variance whose float32 square root is exactly float32(stddev).

    keras.layers.Normalization divides by sqrt(variance); with this variance it divides by the very
    same float32 as tfscale's ImageNormalization, so the two layers give identical outputs.
    """
    target = np.float32(stddev)
    variance = np.float32(np.float64(target) ** 2)
    for _ in range(16):  # the rounded square lands within an ulp or two of the right value
        root = np.sqrt(variance)
        if root == target:
            return float(variance)
        variance = np.nextafter(variance, np.float32(np.inf) if root < target else np.float32(0))
    raise ValueError(f"no float32 variance has the square root {target}")


def core_keras_model(model: keras.Model) -> keras.Model:
    """A copy of `model` made of Keras core layers only, with the same weights and outputs."""

    def clone_layer(layer):
        if isinstance(layer, models.ImageNormalization):
            return keras.layers.Normalization(
                mean=list(layer.mean_rgb), variance=[_variance_with_exact_sqrt(s) for s in layer.stddev_rgb],
                name=layer.name,
            )
        return layer.__class__.from_config(layer.get_config())

    clone = keras.models.clone_model(model, clone_function=clone_layer)
    for layer in model.layers:
        clone.get_layer(layer.name).set_weights(layer.get_weights())
    return clone


def _check_same_outputs(model: keras.Model, clone: keras.Model, image_size: int) -> None:
    """The core-layer copy must compute exactly what the trained model computes."""
    probe = np.random.default_rng(0).integers(0, 256, size=(2, image_size, image_size, 3), dtype=np.uint8)
    expected = model(probe, training=False).numpy()
    got = clone(probe, training=False).numpy()
    if not np.array_equal(expected, got):
        raise AssertionError(f"the core-Keras copy of the model differs by up to {np.abs(expected - got).max()}")


# --- the SavedModel ---------------------------------------------------------------------------------


def serving_function(model: keras.Model, data_cfg: ml_collections.ConfigDict, names: data_info.ClassNames):
    """tf.function: encoded images tf.string [N] -> the outputs listed in the module docstring."""
    image_size = data_cfg.image_size
    top_k = min(_TOP_K, data_cfg.num_classes)

    def preprocess_one(encoded):
        # Exactly what the eval input pipeline does to each example (data/input/pipeline.py eval_input_fn).
        return preprocess.eval_preprocess(
            encoded, image_size=image_size, augment=data_cfg.augment, crop_fraction=data_cfg.eval_crop_fraction
        )

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="images")], autograph=False)
    def serve(images):
        pixels = tf.map_fn(preprocess_one, images,
                           fn_output_signature=tf.TensorSpec([image_size, image_size, 3], tf.uint8))
        logits = tf.cast(model(pixels, training=False), tf.float32)
        probabilities = tf.nn.softmax(logits)
        top = tf.math.top_k(probabilities, k=top_k)
        outputs = {"probabilities": probabilities, "logits": logits, "top5_ids": top.indices,
                   "top5_probabilities": top.values}
        if names.names is not None:
            outputs["top5_classes"] = tf.gather(tf.constant(names.names), top.indices)
            outputs["top5_texts"] = tf.gather(tf.constant(names.texts), top.indices)
        return outputs

    return serve


def write_saved_model(model: keras.Model, data_cfg: ml_collections.ConfigDict, names: data_info.ClassNames, path: str) -> None:
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(SIGNATURE, serving_function(model, data_cfg, names))
    archive.write_out(path, verbose=False)


# --- export.json ------------------------------------------------------------------------------------


def _run_metrics(workdir: str, step: int, weights: str = "raw") -> dict | None:
    """The run's final eval metrics from summary.json, or None when there is none.

    `weights="ema"`: the metrics of the EMA weights (summary.json's `eval_*_ema`), under the same keys.
    """
    path = layout.summary(workdir)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    suffix = "_ema" if weights == "ema" else ""
    metrics = {key: summary[key + suffix] for key in ("eval_top1", "eval_top5", "eval_loss") if key + suffix in summary}
    if weights == "ema" and not metrics:
        logging.warning("summary.json has no eval metrics of the EMA weights (eval_top1_ema ...); export.json "
                        "records none")
    metrics["step"] = summary.get("steps")
    if metrics["step"] != step:
        logging.warning("summary.json's metrics are of step %s, the exported checkpoint is of step %d",
                        metrics["step"], step)
    return metrics


def _versions() -> dict:
    return {"tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version(),
            "tfscale": tfscale.__version__}


def export_info(run: init_from.RestoredRun, workdir: str, output_dir: str, names: data_info.ClassNames) -> dict:
    """The contents of export.json."""
    cfg = run.cfg
    outputs = {
        "probabilities": f"float32 [N, {cfg.data.num_classes}] softmax",
        "logits": f"float32 [N, {cfg.data.num_classes}]",
        "top5_ids": f"int32 [N, {min(_TOP_K, cfg.data.num_classes)}] class ids, most probable first",
        "top5_probabilities": "float32, the probabilities of top5_ids",
    }
    if names.names is not None:
        outputs["top5_classes"] = "string, class names of top5_ids (labels.txt)"
        outputs["top5_texts"] = "string, class descriptions of top5_ids"
    weights = weights_exported(cfg)
    return {
        "workdir": os.path.abspath(workdir),
        "checkpoint": os.path.abspath(run.checkpoint),
        "step": run.step,
        "weights": weights,
        "eval_metrics": _run_metrics(workdir, run.step, weights),
        "num_classes": cfg.data.num_classes,
        "class_names": names.names,
        "class_texts": names.texts,
        "class_names_source": names.source,
        "preprocessing": {
            "function": "tfscale.data.input.preprocess.eval_preprocess (inside the SavedModel)",
            "image_size": cfg.data.image_size, "augment": cfg.data.augment,
            "eval_crop_fraction": cfg.data.eval_crop_fraction,
            **({"note": f"config.data.dataset={cfg.data.dataset!r}: training generated pixels directly, "
                        "without this preprocessing"} if cfg.data.dataset.startswith("synthetic") else {}),
        },
        "precision": {"trained": cfg.precision, "exported": "float32"},
        "serving": {"signature": SIGNATURE, "inputs": {"images": "string [N], encoded JPEG/PNG/BMP/GIF files"},
                    "outputs": outputs},
        "keras_model": {"input": f"uint8 [N, {cfg.data.image_size}, {cfg.data.image_size}, 3] preprocessed images",
                        "output": "float32 logits", "needs_tfscale": False},
        "artifacts": {
            "keras_model": os.path.join(output_dir, KERAS_FILE),
            "saved_model": os.path.join(output_dir, SAVED_MODEL_DIR),
            "labels": os.path.join(output_dir, LABELS_FILE) if names.names is not None else None,
            "export_json": os.path.join(output_dir, EXPORT_JSON),
        },
        "versions": _versions(),
        "config": cfg.to_dict(),
        "created_unix_s": round(time.time(), 3),
    }


# --- writing ----------------------------------------------------------------------------------------


def _write_artifacts(run: init_from.RestoredRun, names: data_info.ClassNames, info: dict, directory: str) -> None:
    clone = core_keras_model(run.model)
    _check_same_outputs(run.model, clone, run.cfg.data.image_size)
    clone.save(os.path.join(directory, KERAS_FILE))
    write_saved_model(run.model, run.cfg.data, names, os.path.join(directory, SAVED_MODEL_DIR))
    if names.names is not None:
        with open(os.path.join(directory, LABELS_FILE), "w", encoding="utf-8") as f:
            f.writelines(name + "\n" for name in names.names)
    with open(os.path.join(directory, EXPORT_JSON), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


def _check_replaceable(output_dir: str, workdir: str) -> None:
    """Only an earlier export may be replaced: `--output_dir` pointing at anything else is a typo."""
    if output_dir == workdir or workdir.startswith(output_dir + os.sep):
        raise ValueError(f"output_dir {output_dir} would replace the training workdir {workdir}")
    is_export = os.path.exists(os.path.join(output_dir, EXPORT_JSON))
    if os.path.exists(output_dir) and os.listdir(output_dir) and not is_export:
        raise FileExistsError(f"output_dir {output_dir} exists and is not a tfscale export (no {EXPORT_JSON}); "
                              "refusing to replace it")


def _replace_directory(new_dir: str, output_dir: str) -> None:
    """Moves the finished `new_dir` to `output_dir`; a previous export there is removed only afterwards."""
    old_dir = None
    if os.path.exists(output_dir):
        old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.old-", dir=os.path.dirname(output_dir))
        os.replace(output_dir, os.path.join(old_dir, "export"))
    os.replace(new_dir, output_dir)
    if old_dir:
        shutil.rmtree(old_dir, ignore_errors=True)


def export(workdir: str, output_dir: str | None = None, checkpoint: str | None = None) -> dict:
    """Exports the run in `workdir` into `output_dir` (default `workdir/export`); returns export.json's contents."""
    workdir = os.path.abspath(workdir)
    output_dir = os.path.abspath(output_dir or layout.export(workdir))
    _check_replaceable(output_dir, workdir)
    data_cfg = init_from.read_run_config(workdir).data
    if data_cfg.dataset == "tfrecord":  # labels.txt would name the train split's classes: eval must agree
        shard_dir.check_same_classes(data_cfg)
    run = restore_for_inference(workdir, checkpoint)
    names = data_info.output_class_names(run.cfg.data)
    if names.names is None:
        logging.warning("exporting without class names: %s", names.source)
    info = export_info(run, workdir, output_dir, names)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    # Same file system as output_dir, so the final rename is atomic; removed on any failure.
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
    try:
        with engine.precision_policy("float32"):
            _write_artifacts(run, names, info, scratch)
        _replace_directory(scratch, output_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logging.info("exported step %d of %s to %s", run.step, workdir, output_dir)
    return info


# --- CLI --------------------------------------------------------------------------------------------


def _define_flags() -> None:
    if "output_dir" in flags.FLAGS:  # another tool in this process defined them already
        return
    flags.DEFINE_string("workdir", None, "Training workdir (config.json, checkpoints/, summary.json).")
    flags.DEFINE_string("output_dir", None, "Where to write the export (default: WORKDIR/export); replaced "
                        "as a whole when the new export is complete.")
    flags.DEFINE_string("checkpoint", None, "Checkpoint prefix to export (default: the latest in WORKDIR/checkpoints).")
    flags.mark_flags_as_required(["workdir"])


def _export_from_flags(f: flags.FlagValues) -> None:
    logs.configure()
    info = export(f.workdir, f.output_dir, f.checkpoint)
    print(json.dumps({"output_dir": os.path.dirname(info["artifacts"]["export_json"]), "step": info["step"],
                      "weights": info["weights"], "eval_metrics": info["eval_metrics"],
                      "class_names": info["class_names_source"]}))


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-export` and `python -m tfscale.export`."""
    cli.run_tool(_export_from_flags, define_flags=_define_flags, errors=(*cli.INPUT_ERRORS, tf.errors.OpError),
                 argv=argv)


if __name__ == "__main__":
    run()
