"""Start a run from trained weights (`config.model.init_from`), and read back a finished run's model.

Sources `init_from` accepts:
  * a tfscale workdir: its `config.json` builds the source model (which may predict another number
    of classes) and its latest checkpoint in `checkpoints/` fills it;
  * a checkpoint prefix inside a workdir (`W/checkpoints/ckpt-60`): the same, with that checkpoint;
  * a `.keras` model file (e.g. `tfscale.export`'s `model.keras`);
  * a `.weights.h5` file written by `model.save_weights` for the same architecture;
  * for a keras.applications model, a Keras 2 `.h5` weights file of that application (e.g. its ImageNet
    weights, with or without the top, downloaded elsewhere: tfscale never downloads).

Weights are matched by layer name and position within the layer, which is how Keras' own weight
files index them, and copied only when the shapes agree. `init_skip_head` leaves the classifier
(`logits` layer) as freshly initialised, for fine-tuning to another `num_classes`. Anything else that
does not match is an error naming the variable, never a silent partial load. The optimizer is not
touched: its slots start at zero, as for a run from scratch.

`train.py` applies this only when the workdir has no checkpoint of its own, so resuming wins.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple

import h5py
import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale.errors import ConfigError
from tfscale.model import build
from tfscale.model import models  # noqa: F401  (registers ImageNormalization for .keras sources)
from tfscale.training import checkpoints
from tfscale.workdir import layout

HEAD_LAYER = "logits"  # the classifier of every tfscale model (models._build_classifier)
_KERAS_SUFFIX = ".keras"
_WEIGHTS_SUFFIX = ".weights.h5"

# (layer name, position among the layer's weights): how Keras' weight files index a variable.
WeightKey = tuple[str, int]
BuildModel = Callable[[ml_collections.ConfigDict], keras.Model]


# --- reading a finished run ------------------------------------------------------------------------


class RestoredRun(NamedTuple):
    """A training run's resolved config and its model with the weights of `checkpoint`."""

    cfg: ml_collections.ConfigDict
    model: keras.Model
    checkpoint: str  # the checkpoint prefix restored
    step: int  # global step of that checkpoint


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a training run wrote to `workdir/config.json`."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} does not exist or is not a directory")
    path = layout.config(workdir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: is {workdir} a tfscale training workdir?")
    with open(path) as f:
        try:
            return ml_collections.ConfigDict(json.load(f))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err


def is_checkpoint_prefix(path: str) -> bool:
    """True for a TF checkpoint prefix such as `W/checkpoints/ckpt-60` (its `.index` file exists)."""
    return tf.io.gfile.exists(path + ".index")


def workdir_of_checkpoint(prefix: str) -> str:
    """The workdir of a checkpoint prefix `W/checkpoints/ckpt-N`."""
    return os.path.dirname(os.path.dirname(os.path.abspath(prefix)))


def restore_run(workdir: str, build_model: BuildModel, checkpoint: str | None = None) -> RestoredRun:
    """Rebuilds the model of the run in `workdir` and restores `checkpoint` (default: the latest).

    `build_model(cfg)` builds the model (`tfscale.training.engine.build_model`), under whatever dtype policy is
    in force. Only the model is restored; the checkpoint's optimizer slots are not needed.
    """
    cfg = read_run_config(workdir)
    model = build_model(cfg)
    # Every model variable must come from the checkpoint, the newest usable one by default.
    checkpoint, step = checkpoints.restore_model(workdir, model, checkpoint)
    return RestoredRun(cfg, model, checkpoint, step)


# --- source weights --------------------------------------------------------------------------------


def model_weights(model: keras.Model) -> dict[WeightKey, np.ndarray]:
    """Every weight of a (flat, functional) model by layer name and position in the layer."""
    return {(layer.name, i): np.asarray(w.numpy()) for layer in model.layers for i, w in enumerate(layer.weights)}


def _h5_weights(path: str) -> dict[WeightKey, np.ndarray]:
    """Weights of a Keras 3 `.weights.h5` file, keyed by the layer names Keras records in it."""
    weights = {}

    def visit(name, group):
        if not isinstance(group, h5py.Group) or "name" not in group.attrs:
            return
        layer = group.attrs["name"]
        layer = layer.decode() if isinstance(layer, bytes) else str(layer)
        for index in sorted((k for k in group if k.isdigit()), key=int):
            key = (layer, int(index))
            if key in weights:
                raise ValueError(f"{path} holds two layers named {layer!r}: cannot tell their weights apart")
            weights[key] = np.asarray(group[index])

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    if not weights:
        raise ValueError(f"{path} holds no layer weights written by Keras 3 (model.save_weights)")
    return weights


def source_weights(path: str, build_model: BuildModel) -> dict[WeightKey, np.ndarray]:
    """The weights of an `init_from` source (see the module docstring for the kinds)."""
    if path.endswith(_KERAS_SUFFIX) and os.path.isfile(path):
        try:
            # A Lambda layer in a .keras file is Python bytecode, run when loaded, and the file may come from
            # anyone: Keras' safe mode (its default, stated so it stays) refuses it.
            return model_weights(keras.models.load_model(path, compile=False, safe_mode=True))
        except (ValueError, TypeError) as err:  # refused (unsafe or unknown objects) or not a model
            raise ConfigError(f"config.model.init_from={path!r}: Keras cannot load it safely: "
                              f"{' '.join(str(err).split())[:400]}") from err
    if path.endswith(_WEIGHTS_SUFFIX) and os.path.isfile(path):
        return _h5_weights(path)
    if os.path.isdir(path):
        return model_weights(restore_run(path, build_model).model)
    if is_checkpoint_prefix(path):
        return model_weights(restore_run(workdir_of_checkpoint(path), build_model, checkpoint=path).model)
    raise FileNotFoundError(
        f"{path} is neither a tfscale workdir, a checkpoint prefix (no {path}.index), "
        f"a {_KERAS_SUFFIX} file nor a {_WEIGHTS_SUFFIX} file"
    )


# --- loading into the model ------------------------------------------------------------------------


class LoadReport(NamedTuple):
    loaded: list[str]  # variable paths copied from the source
    skipped: list[str]  # variable paths left at their fresh initialisation (the head)
    loaded_params: int


def _display(key: WeightKey, model: keras.Model) -> str:
    """`layer/variable` for a key of the model, `layer/#i` for a key only the source has."""
    layer_name, index = key
    try:
        return model.get_layer(layer_name).weights[index].path
    except (ValueError, IndexError):
        return f"{layer_name}/#{index}"


def _check_same_variables(model: keras.Model, source: dict, targets: dict, skip_head: bool, where: str) -> None:
    """Raises when the source lacks a variable of the model or has extra ones (another architecture)."""
    outside_head = [k for k in source if not (skip_head and k[0] == HEAD_LAYER)]
    missing = [k for k in targets if k not in source and not (skip_head and k[0] == HEAD_LAYER)]
    extra = [k for k in outside_head if k not in targets]
    if missing or extra:
        detail = []
        if missing:
            detail.append(f"{len(missing)} variables of the model are not in it (first: {_display(missing[0], model)})")
        if extra:
            detail.append(f"it has {len(extra)} variables the model lacks (first: {_display(extra[0], model)})")
        raise ConfigError(f"config.model.init_from={where!r} does not fit config.model.name={model.name!r}: "
                          f"{'; '.join(detail)}")


def load_weights(model: keras.Model, source: dict[WeightKey, np.ndarray], *, skip_head: bool,
                 where: str) -> LoadReport:
    """Copies `source` into `model`; raises ConfigError (a ValueError) on a mismatch, before assigning anything."""
    if skip_head and HEAD_LAYER not in {layer.name for layer in model.layers}:
        raise ConfigError(f"config.model.init_skip_head=True but the model has no {HEAD_LAYER!r} layer")
    targets = {(layer.name, i): w for layer in model.layers for i, w in enumerate(layer.weights)}
    _check_same_variables(model, source, targets, skip_head, where)
    plan, skipped = [], []
    for key, variable in targets.items():  # model order: the first mismatch is the shallowest one
        if skip_head and key[0] == HEAD_LAYER:
            skipped.append(variable.path)
            continue
        value = source[key]
        if tuple(value.shape) != tuple(variable.shape):
            is_head = key[0] == HEAD_LAYER
            hint = " (set config.model.init_skip_head=True to re-initialise the classifier)" if is_head else ""
            raise ConfigError(f"config.model.init_from={where!r}: variable {variable.path} has shape "
                              f"{tuple(value.shape)} there but {tuple(variable.shape)} in the model{hint}")
        plan.append((variable, value))
    for variable, value in plan:
        variable.assign(value.astype(variable.dtype))
    return LoadReport([v.path for v, _ in plan], skipped, int(sum(value.size for _, value in plan)))


def apply(cfg: ml_collections.ConfigDict, model: keras.Model, build_model: BuildModel) -> LoadReport | None:
    """Initialises `model` from `cfg.model.init_from` when it is set; logs what was loaded and skipped.

    `build_model(cfg)` builds a source run's model from its config (`tfscale.training.engine.build_model`).
    """
    path = cfg.model.init_from
    if not path:
        return None
    try:
        if path.endswith(".h5") and not path.endswith(_WEIGHTS_SUFFIX) and os.path.isfile(path):
            source = model_weights(build.application_with_weights(cfg, path))
        else:
            source = source_weights(path, build_model)
    except FileNotFoundError as err:  # e.g. a source workdir without checkpoints: the user's to fix
        raise ConfigError(f"config.model.init_from={path!r}: {err}") from err
    report = load_weights(model, source, skip_head=cfg.model.init_skip_head, where=path)
    logging.info("init_from %s: loaded %d variables (%d values)%s", path, len(report.loaded), report.loaded_params,
                 f"; re-initialised {', '.join(report.skipped)}" if report.skipped else "")
    return report
