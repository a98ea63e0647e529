"""Where a run's shards are: a split's shard list (staged copies included) and the checks against the
conversion manifest (tfscale.data.stage.stage.prepare_data_dir stages and then runs them).

TensorFlow is used only through tf.io.gfile, so shard directories on remote file systems work too.
"""

from __future__ import annotations

import os

import ml_collections
import tensorflow as tf

from tfscale import errors
from tfscale import io as tfio
from tfscale.data.input.shard_list import SHARD_LIST_FILE, read_shard_list


def list_shards(data_dir: str, split: str) -> list[str]:
    """Sorted paths of the shards of `split` in `data_dir`; a clear error when there are none.

    The files `{split}-*-of-*`, or in a staged copy every shard of the source it was staged from, present
    or not: a node's copy may hold only the train shards its workers read, and every worker must
    number the files as in the full directory to pick its own (see `require_present`).
    """
    if not tf.io.gfile.isdir(data_dir):
        raise errors.MissingDataError(f"config.data.data_dir={data_dir!r} is not a directory")
    staged = read_shard_list(data_dir, split)
    files = ([os.path.join(data_dir, name) for name in staged] if staged
             else sorted(tf.io.gfile.glob(os.path.join(data_dir, f"{split}-*-of-*"))))
    if not files:
        raise errors.MissingDataError(f"no TFRecord shards named {split}-*-of-* in {data_dir}")
    return files


def is_staged_copy(data_dir: str) -> bool:
    """A staging destination (node-local, so plain os): its shard lists may name files it does not hold."""
    return os.path.exists(os.path.join(data_dir, SHARD_LIST_FILE))


def require_present(paths: list[str], data_dir: str, what: str) -> None:
    """MissingDataError naming a shard of `paths` that a staged copy lacks (and how many it lacks).

    Elsewhere the paths come from a glob and exist: no per-file stat (slow on remote storage).
    """
    if not is_staged_copy(data_dir):
        return
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise errors.MissingDataError(
            f"{len(missing)} of the {len(paths)} shards {what} are missing in the staged copy {data_dir}, e.g. "
            f"{os.path.basename(missing[0])}: it holds the train shards of the workers it was staged for, so "
            "tools/stage_data.py --num_workers/--worker_ranks/--assignment must match the training run")


def check_against_manifest(data_cfg: ml_collections.ConfigDict, data_dir: str, split: str,
                           num_examples: int, *, allow_missing: bool = False) -> None:
    """Cross-checks config and shards with the conversion manifest, when there is one.

    allow_missing: shards that are not there are not an error (a partial staged copy); those
    that are must still have the manifest's size.
    """
    where = tfio.find_manifest(data_dir, split)
    manifest = tfio.read_manifest_file(where) if where else None
    if manifest is None:
        return  # shards from other tools: the per-example label check still guards the labels
    for key, ours, theirs in (
        ("data.num_classes", data_cfg.num_classes, manifest["num_classes"]),
        ("data.label_offset", data_cfg.label_offset, manifest["label_offset"]),
        (f"data.num_{'train' if split == data_cfg.train_split else 'eval'}_examples", num_examples,
         manifest["num_examples"]),
    ):
        if ours != theirs:
            # A config error (the run stops on a one-line FATAL naming key, value and manifest), not a traceback.
            raise errors.ConfigError(f"config.{key}={ours} but {where} says {theirs}")
    for shard in manifest["shards"]:
        path = os.path.join(data_dir, shard["name"])
        if not tf.io.gfile.exists(path):
            if allow_missing:
                continue
            raise errors.MissingDataError(f"shard {path} listed in {where} is missing")
        size = tf.io.gfile.stat(path).length
        if size != shard["bytes"]:
            raise errors.CorruptDataError(
                f"shard {path} has {size} bytes but {where} says {shard['bytes']}: truncated or corrupt; re-convert it")


def check_same_classes(data_cfg: ml_collections.ConfigDict) -> None:
    """ManifestError (a data fault) naming the first class index where the train and eval manifests disagree.

    Output i of the model is the class the TRAIN split stores as label i + label_offset. An eval split
    converted with another class order (its own --class_order_file, a labels file whose sorted names
    differ) would score every prediction against the wrong class, and eval top-1 would be silently
    wrong. Splits without a manifest (other tools' shards) cannot be compared and are not.
    """
    train, evaluation = data_cfg.train_split, data_cfg.eval_split
    paths = [tfio.find_manifest(data_cfg.data_dir, split) for split in (train, evaluation)]
    if train == evaluation or None in paths:
        return
    train_classes, eval_classes = (tfio.read_manifest_file(path).get("classes", []) for path in paths)
    if train_classes == eval_classes or not train_classes or not eval_classes:
        return
    index = next(i for i, (a, b) in enumerate(zip(train_classes + [None], eval_classes + [None])) if a != b)
    train_name, eval_name = (repr(c[index]) if index < len(c) else "no class" for c in (train_classes, eval_classes))
    raise errors.ManifestError(
        f"the {evaluation} split does not have the classes of the {train} split: class index {index} is {eval_name} "
        f"in {paths[1]} but {train_name} in {paths[0]}, so eval would score predictions against the wrong classes. "
        f"Convert {evaluation} again with --class_order_from={data_cfg.data_dir}")


def holds_only_jpeg(data_dir: str, split: str) -> bool:
    """True when the split's manifest says every record is a JPEG (shards written by tfscale-convert).

    Shards from other tools may hold PNGs or CMYK JPEGs under .JPEG names: they get the format branch.
    """
    where = tfio.find_manifest(data_dir, split)
    manifest = tfio.read_manifest_file(where) if where else None
    return bool(manifest) and manifest.get("image_format") == "jpeg"
