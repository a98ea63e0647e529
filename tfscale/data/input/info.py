"""What the data say about themselves, and the config counts they replace.

A run's class count and example counts are in the data when there is a tfscale-convert manifest
(`manifest-train.json`, `manifest-validation.json`) or a prepared TFDS dataset (its `dataset_info.json`:
the label feature's classes, each split's examples). base_config's counts are ImageNet-1k's
(`config.IMAGENET_1K_COUNTS`), so an ImageNet recipe pointed at other data would otherwise stop on the
first mismatch. `adopt` replaces a count that is still at ImageNet's default by the data's, with one log
line naming the value and the file it came from. A count given on the command line, or set by a recipe to
anything else, is the user's statement about the data and stays: where the data disagree the run is
refused (`check_tfds_counts` here, `shard_dir.check_against_manifest` for shards).

TFDS splits training input between workers by file (`tfds.ReadConfig(input_context=...)`): with fewer
files than workers tfds raises inside every worker's input function (measured with tensorflow-datasets
4.9.10: "Cannot shard the pipeline with given `input_context`. `num_shards=1` but
`num_input_pipelines=2`"). `check_tfds_files` refuses such a run by name before anything is built.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale import errors
from tfscale import io as tfio
from tfscale.config import IMAGENET_1K_COUNTS

COUNT_KEYS = tuple(IMAGENET_1K_COUNTS)  # num_classes, num_train_examples, num_eval_examples


class Fact(NamedTuple):
    """A count the data state, and where it was read."""

    value: int
    source: str


def facts(data_cfg: ml_collections.ConfigDict) -> dict[str, Fact]:
    """{count key: Fact} from the manifests of the run's splits or the TFDS dataset's info; {} when the data
    cannot say (synthetic data, shards from other tools, a data_dir that is not there: validation names that)."""
    data_dir = data_cfg.data_dir
    if data_cfg.dataset not in ("tfrecord", "tfds") or not data_dir:
        return {}
    if "://" not in data_dir and not os.path.isdir(data_dir):
        return {}
    if data_cfg.dataset == "tfds":
        return _tfds_facts(data_cfg) if data_cfg.tfds_name else {}
    return _manifest_facts(data_cfg)


def _manifest_facts(data_cfg: ml_collections.ConfigDict) -> dict[str, Fact]:
    found = {}
    for split, key in ((data_cfg.eval_split, "num_eval_examples"), (data_cfg.train_split, "num_train_examples")):
        where = tfio.find_manifest(data_cfg.data_dir, split)
        manifest = tfio.read_manifest_file(where) if where else None
        if manifest is None:
            continue
        found[key] = Fact(int(manifest["num_examples"]), where)
        if split == data_cfg.train_split:
            found["num_classes"] = Fact(int(manifest["num_classes"]), where)
    return found


def adopt(data_cfg: ml_collections.ConfigDict, found: dict[str, Fact], chosen: frozenset[str] = frozenset()) -> None:
    """Sets each count of `data_cfg` still at ImageNet-1k's default to the data's, logging value and source.

    `chosen`: dotted keys the user set on the command line (`cli.command_line_keys()`); those stay.
    """
    for key, fact in found.items():
        value = data_cfg[key]
        if value == fact.value or value != IMAGENET_1K_COUNTS[key] or f"data.{key}" in chosen:
            continue
        data_cfg[key] = fact.value
        logging.info("config.data.%s=%d from %s (in place of ImageNet-1k's %d, base_config's default)",
                     key, fact.value, fact.source, value)


# --- TFDS ----------------------------------------------------------------------------------------------


def tfds_builder(data_cfg: ml_collections.ConfigDict):
    """The prepared TFDS builder of `data.tfds_name` in `data.data_dir`; never downloads or prepares."""
    import tensorflow_datasets as tfds  # only needed for dataset=tfds

    try:
        builder = tfds.builder(data_cfg.tfds_name, data_dir=data_cfg.data_dir)
    except tfds.core.registered.DatasetNotFoundError as err:
        raise errors.MissingDataError(f"config.data.tfds_name={data_cfg.tfds_name!r}: no such TFDS dataset, and none "
                                      f"prepared under that name in config.data.data_dir={data_cfg.data_dir!r}") from err
    if not builder.is_prepared():
        raise errors.MissingDataError(
            f"TFDS dataset {data_cfg.tfds_name!r} is not prepared in config.data.data_dir={data_cfg.data_dir!r}; "
            "tfscale never downloads: prepare it where the data are (docs/data.md 'ImageNet through TFDS') and point data_dir at it")
    return builder


def _split_info(builder, split: str, key: str):
    try:
        return builder.info.splits[split]
    except (KeyError, ValueError) as err:
        raise errors.ConfigError(f"config.data.{key}={split!r} is not a split of TFDS dataset {builder.info.full_name} "
                                 f"(it has {', '.join(sorted(builder.info.splits))})") from err


def _label_feature(builder):
    """The dataset's `label` ClassLabel feature; errors.ConfigError when tfscale cannot train on the dataset."""
    import tensorflow_datasets as tfds

    features = builder.info.features
    label = features["label"] if "label" in features else None
    if "image" not in features or not isinstance(label, tfds.features.ClassLabel):
        raise errors.ConfigError(f"TFDS dataset {builder.info.full_name} has features {sorted(features)}: tfscale trains "
                                 "on an 'image' feature with a ClassLabel 'label'")
    return label


def _tfds_facts(data_cfg: ml_collections.ConfigDict) -> dict[str, Fact]:
    builder = tfds_builder(data_cfg)
    source = os.path.join(builder.data_dir, "dataset_info.json")
    return {
        "num_classes": Fact(_label_feature(builder).num_classes, source),
        "num_train_examples": Fact(_split_info(builder, data_cfg.train_split, "train_split").num_examples, source),
        "num_eval_examples": Fact(_split_info(builder, data_cfg.eval_split, "eval_split").num_examples, source),
    }


def check_tfds_counts(data_cfg: ml_collections.ConfigDict, found: dict[str, Fact]) -> None:
    """A TFDS run's counts must be its dataset's (shards get the same check from their manifest)."""
    if data_cfg.dataset != "tfds":
        return
    for key, fact in found.items():
        if data_cfg[key] != fact.value:
            raise errors.ConfigError(f"config.data.{key}={data_cfg[key]} but {fact.source} says {fact.value}")


def check_tfds_files(data_cfg: ml_collections.ConfigDict, num_workers: int) -> None:
    """Refuses a TFDS training split of fewer files than workers, naming split, files, workers and the ways out."""
    if data_cfg.dataset != "tfds" or num_workers <= 1:
        return
    builder = tfds_builder(data_cfg)
    num_files = len(_split_info(builder, data_cfg.train_split, "train_split").file_instructions)
    if num_files >= num_workers:
        return
    raise errors.ConfigError(
        f"config.data.train_split={data_cfg.train_split!r} of TFDS dataset {builder.info.full_name} in "
        f"{builder.data_dir} is {num_files} file(s) but this run has {num_workers} workers: TFDS splits training "
        f"input between workers by file, so a worker would read nothing (tfds refuses it). Prepare the dataset "
        f"again with at least {num_workers} files (download_config=tfds.download.DownloadConfig(num_shards="
        f"{num_workers}, ...), `tfds build --num_shards={num_workers}`), run at most {num_files} worker(s), or "
        "convert the images to TFRecord shards with tfscale-convert (fewer files than workers are split by example)")


def tfds_class_names(data_cfg: ml_collections.ConfigDict) -> tuple[list[str], str]:
    """(names of the TFDS dataset's classes, label i first, where they were read); label offset is 0 for TFDS."""
    builder = tfds_builder(data_cfg)
    return list(_label_feature(builder).names), os.path.join(builder.data_dir, "dataset_info.json")


# --- the names of a model's outputs (export) ---------------------------------------------------------


class ClassNames(NamedTuple):
    """Names of the model's outputs (names[i] is class id i), or None with the reason in `source`."""

    names: list[str] | None
    texts: list[str] | None
    source: str


def output_class_names(data_cfg: ml_collections.ConfigDict) -> ClassNames:
    """The names of a model's outputs trained on `data_cfg`'s data: from the shards' manifest or TFDS's info."""
    return _tfds_output_names(data_cfg) if data_cfg.dataset == "tfds" else _manifest_class_names(data_cfg)


def _manifest_class_names(data_cfg: ml_collections.ConfigDict) -> ClassNames:
    """Output names from the training shards' manifest; None (and why) when there are none."""
    if data_cfg.dataset != "tfrecord":
        return ClassNames(None, None, f"none: config.data.dataset={data_cfg.dataset!r} has no class names")
    where = f"conversion manifest of split {data_cfg.train_split!r} in {data_cfg.data_dir}"
    if not tf.io.gfile.isdir(data_cfg.data_dir):
        return ClassNames(None, None, f"none: config.data.data_dir={data_cfg.data_dir!r} is not a directory here")
    manifest = tfio.read_manifest(data_cfg.data_dir, data_cfg.train_split)
    if manifest is None:
        return ClassNames(None, None, f"none: no {where} (shards from another tool)")
    classes = manifest["classes"]
    texts = manifest.get("class_texts") or classes
    stored_labels = manifest.get("class_labels") or [i + manifest["label_offset"] for i in range(len(classes))]
    by_label = {label: (name, text) for label, name, text in zip(stored_labels, classes, texts)}
    # Output i of the model was trained on stored label i + label_offset.
    wanted = [i + data_cfg.label_offset for i in range(data_cfg.num_classes)]
    missing = [label for label in wanted if label not in by_label]
    if missing:
        return ClassNames(None, None, f"none: the {where} has no class for stored label {missing[0]}")
    return ClassNames([by_label[label][0] for label in wanted], [by_label[label][1] for label in wanted], where)


def _tfds_output_names(data_cfg: ml_collections.ConfigDict) -> ClassNames:
    """Output names of a run on a TFDS dataset: its label feature's names (TFDS labels are 0-based, as the outputs)."""
    try:
        names, source = tfds_class_names(data_cfg)
    except (errors.MissingDataError, errors.ConfigError) as err:
        return ClassNames(None, None, f"none: {err}")
    if len(names) != data_cfg.num_classes:
        return ClassNames(None, None, f"none: {source} names {len(names)} classes, the model has {data_cfg.num_classes}")
    return ClassNames(names, names, f"TFDS dataset info {source}")
