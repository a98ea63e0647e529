r"""Image folders -> TFRecord shards in the standard ImageNet layout, plus a JSON manifest.

    python tools/tfrecord_convert.py --input_dir=/data/ILSVRC/train --output_dir=/data/tfrecords \
        --split=train --num_shards=1024 [--class_order_file=synsets.txt] [--class_text_file=words.txt]
    python tools/tfrecord_convert.py --input_dir=/data/ILSVRC/val --output_dir=/data/tfrecords \
        --split=validation --num_shards=128 --labels_file=LOC_val_solution.csv --class_order_from=/data/tfrecords

Input is a class-folder tree `DIR/<class>/*.jpg|jpeg|png` (any case), or a flat folder of images plus
a labels file (ImageNet's validation layout): one class name per image in sorted file-name order,
Kaggle's LOC_val_solution.csv, or the devkit's ground truth with --devkit_meta (data/convert/val_labels.py).
--class_order_from takes the label order from the train split already converted, so the splits agree.

Output is what `build_imagenet_data.py` writes, so every TF ImageNet reader takes it: shards
`{split}-00000-of-01024` of tf.train.Examples with the features in encode.FEATURE_KEYS, labels 1-based
(0 unused), and `manifest-{split}.json` (classes, shard sizes and sha256, skipped files), written last.
Nothing else tfscale puts in the directory starts with a split name (temporaries and the state file
start with "."), so the split globs readers use (`train*`, `train-*`, `train-*-of-*`) see shards only.

How it works:
  1. scan: every image is fully decoded once with PIL, in parallel; undecodable files are skipped
     (or, with strict, fail the run before anything is written).
  2. plan: the decodable files are shuffled with a fixed seed and cut into shards whose sizes differ by
     at most one. Each shard gets a fingerprint of its inputs and options.
  3. write: each worker process writes whole shards under a temporary name and renames them when
     complete. Baseline RGB JPEGs are copied byte for byte; everything else (PNG, CMYK, grayscale,
     progressive, ...) is re-encoded as baseline RGB JPEG so `tf.io.decode_jpeg` reads every record.
  4. manifest, atomically, last.
A rerun (e.g. after a kill) checks every image again but rewrites only shards that are missing, not
complete, or recorded with another fingerprint; shards of unknown origin are rewritten, so stale
shards of other inputs or options are never mixed in. Files not named like ours are never touched.
Output must be a local or parallel file system (os.replace); copy to gs:// etc. afterwards.

This module is the tool: the steps and their flags. The parts live in tfscale.data.convert.sources (inputs ->
Items), tfscale.data.convert.encode (one image -> Example bytes), tfscale.data.convert.shards (shard files, plan,
fingerprints, resume state, manifest contents) and tfscale.io (atomic writes, reading manifests).
"""
from __future__ import annotations

import os

from absl import app, flags, logging

from tfscale import cli, logs
from tfscale import io as tfio
from tfscale.data.convert import arrays, encode, parallel, shards, sources

SPLITS = ("train", "validation")
# Modules the worker processes need (tensorflow: the shard writers), imported once by the fork server.
_WORKER_PRELOAD = ("tensorflow", "tfscale.data.convert.shards")


# ---------------------------------------------------------------------------------------- pipeline


def scan_images(paths: list[str], num_workers: int, pool) -> list[tuple[str | None, int, int]]:
    """encode.scan_file of every path, in order, with a progress bar."""
    # Chunks amortise inter-process traffic; small enough that every worker gets several.
    chunksize = max(1, min(64, len(paths) // (4 * num_workers)))
    results = []
    with parallel.progress(len(paths), "check images") as bar:
        for result in parallel.map_ordered(pool, encode.scan_file, paths, chunksize):
            results.append(result)
            bar.update(1)
    return results


def drop_unreadable(items: list[sources.Item], scans: list[tuple],
                    strict: bool) -> tuple[list[sources.Item], list[dict]]:
    """(decodable items, manifest `skipped` entries); with strict, any unreadable file is an error."""
    skipped = [{"path": item.path, "reason": scan[0]} for item, scan in zip(items, scans) if scan[0]]
    if skipped and strict:
        named = sources.MAX_NAMED_FILES
        listed = "\n  ".join(f"{s['path']}: {s['reason']}" for s in skipped[:named])
        more = f"\n  ... and {len(skipped) - named} more" if len(skipped) > named else ""
        raise ValueError(f"--strict: {len(skipped)} unreadable images, nothing written:\n  {listed}{more}")
    for s in skipped:
        logging.warning("skipping unreadable image %s: %s", s["path"], s["reason"])
    return [item for item, scan in zip(items, scans) if not scan[0]], skipped


def _check_arguments(input_dir: str, split: str, num_shards: int, resize_shorter: int,
                     num_workers: int | None) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
    if resize_shorter < 0:
        raise ValueError(f"resize_shorter must be >= 0 (0: keep sizes), got {resize_shorter}")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"input_dir {input_dir} does not exist or is not a directory")


def _check_shard_count(num_shards: int, num_images: int, input_dir: str, after: str = "") -> None:
    if num_shards > num_images:
        raise ValueError(f"num_shards={num_shards} is more than the {num_images} images{after} in {input_dir}: "
                         "every shard needs at least one image")


def convert(input_dir: str, output_dir: str, split: str, num_shards: int, *, labels_file: str | None = None,
            class_order_file: str | None = None, class_text_file: str | None = None, resize_shorter: int = 0,
            strict: bool = False, num_workers: int | None = None, seed: int = 0, devkit_meta: str | None = None,
            class_order_from: str | None = None) -> dict:
    """Converts an image folder into `num_shards` TFRecord shards plus a manifest; returns the manifest.

    Args:
      input_dir: class-folder tree `input_dir/<class>/*.jpg|png`, or a flat folder with `labels_file`.
      output_dir: where shards `{split}-00000-of-{num_shards:05d}` and `manifest-{split}.json` go;
        created if needed. Other files in it are never touched.
      split: "train" or "validation" (the shard-name prefix).
      num_shards: number of shards; at most the number of images.
      labels_file: the class of each image of a flat `input_dir`: one class name per line, one line per
        image sorted by name; or LOC_val_solution.csv; or the devkit's ground truth with `devkit_meta`
        (tfscale.data.convert.val_labels).
      class_order_file: class names, one per line, in label order (label = line index + 1). Default:
        sorted class folder names (tree) or sorted distinct names of `labels_file`.
      class_text_file: `synset<TAB>text` lines; classes without one get their name as text (or, with
        `class_order_from`, the train split's text).
      devkit_meta: the ILSVRC2012 devkit's data/meta.mat, mapping the ground truth's IDs to synsets.
      class_order_from: a shard directory holding the converted train split: its classes, in its label
        order, are this split's (so validation labels match the model's outputs). Not with class_order_file.
      resize_shorter: shrink images whose shorter side exceeds this many pixels to it; 0: never.
      strict: unreadable images fail the run (before anything is written) instead of being skipped.
      num_workers: worker processes (default: the CPUs available); 1 runs everything in-process.
      seed: seed of the shuffle that spreads classes over shards.

    With num_workers > 1 a script calling this needs the usual `if __name__ == "__main__":` guard:
    worker processes import the main module, as with any multiprocessing start method but fork.
    """
    _check_arguments(input_dir, split, num_shards, resize_shorter, num_workers)
    input_dir, output_dir = os.path.abspath(input_dir), os.path.abspath(output_dir)
    classes, class_texts, items = sources.gather_items(input_dir, labels_file=labels_file,
                                                       class_order_file=class_order_file,
                                                       class_text_file=class_text_file, devkit_meta=devkit_meta,
                                                       class_order_from=class_order_from)
    _check_shard_count(num_shards, len(items), input_dir)
    num_workers = min(num_workers or parallel.default_num_workers(), len(items))
    logging.info("converting %d images of %d classes in %s into %d %s shards in %s with %d workers",
                 len(items), len(classes), input_dir, num_shards, split, output_dir, num_workers)

    pool = parallel.process_pool(num_workers, _WORKER_PRELOAD) if num_workers > 1 else None
    try:
        scans = scan_images([item.path for item in items], num_workers, pool)
        file_stats = {item.path: (size_bytes, mtime_ns) for item, (_, size_bytes, mtime_ns) in zip(items, scans)}
        items, skipped = drop_unreadable(items, scans, strict)
        _check_shard_count(num_shards, len(items), input_dir, after=" that decode")
        os.makedirs(output_dir, exist_ok=True)
        shard_infos = shards.write_shards(output_dir, split, shards.plan_shards(items, num_shards, seed), file_stats,
                                          input_dir, resize_shorter, pool)
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)

    manifest = shards.build_manifest(split, classes, class_texts, shard_infos, skipped, resize_shorter=resize_shorter,
                                     seed=seed, input_dir=input_dir)
    shards.write_manifest(output_dir, split, manifest)
    tfio.remove_quietly(shards.state_path(output_dir, split))
    shards.warn_about_other_shards(output_dir, split, [s["name"] for s in shard_infos])
    logging.info("wrote %s: %d examples in %d shards, %d images skipped", tfio.manifest_path(output_dir, split),
                 manifest["num_examples"], num_shards, len(skipped))
    return manifest


# --------------------------------------------------------------------------------------------- CLI


_FLAG_NAMES = ("format", "input_dir", "output_dir", "split", "num_shards", "labels_file", "devkit_meta",
               "class_order_file", "class_order_from", "class_text_file", "resize_shorter", "strict", "num_workers",
               "seed", "validation_examples", "train_examples")


def _define_flags() -> None:
    """Flags exist only when the tool runs: importing this module (the input pipeline does) adds none."""
    if "input_dir" in flags.FLAGS:
        return
    flags.DEFINE_enum("format", "folder", ("folder", *arrays.FORMATS), "folder: an image folder (below); idx: "
                      "MNIST-layout IDX files (Fashion-MNIST, KMNIST, EMNIST); cifar: CIFAR-10/100 Python batches. "
                      "idx and cifar write train, validation and test shards at once (tfscale.data.convert.arrays).")
    flags.DEFINE_string("input_dir", None, "Class-folder tree DIR/<class>/*.jpg|png, or a flat folder "
                        "of images with --labels_file; or the idx/cifar files.")
    flags.DEFINE_string("output_dir", None, "Where shards and manifest-{split}.json go (created if needed).")
    flags.DEFINE_enum("split", None, SPLITS, "Shard-name prefix (folder format).")
    flags.DEFINE_integer("num_shards", None, "Number of shards (ImageNet: 1024 train, 128 validation); idx/cifar: "
                         "of the train split (default 16), the others in proportion.")
    flags.DEFINE_integer("validation_examples", 5000, "idx/cifar: training images held out as the validation "
                         "split, stratified by class with --seed.")
    flags.DEFINE_integer("train_examples", 0, "idx/cifar: keep a subset of this many training images (after the "
                         "validation holdout), stratified by class with --seed; 0: all.")
    flags.DEFINE_string("labels_file", None, "For a flat folder: one class name per image, in sorted "
                        "file-name order; or Kaggle's LOC_val_solution.csv; or the devkit's "
                        "ILSVRC2012_validation_ground_truth.txt with --devkit_meta.")
    flags.DEFINE_string("devkit_meta", None, "The ILSVRC2012 devkit's data/meta.mat: maps the ILSVRC2012_IDs of "
                        "a ground-truth --labels_file to synsets.")
    flags.DEFINE_string("class_order_file", None, "Class names in label order, one per line "
                        "(label = line index + 1). Default: sorted class names.")
    flags.DEFINE_string("class_order_from", None, "A shard directory holding the converted train split: use its "
                        "classes in its label order (and its class texts), so this split's labels match train's.")
    flags.DEFINE_string("class_text_file", None, "synset<TAB>human text lines (synset_words.txt); default "
                        "text: the class name.")
    flags.DEFINE_integer("resize_shorter", 0, "Shrink images whose shorter side exceeds this (px); 0: never.")
    flags.DEFINE_bool("strict", False, "Fail on unreadable images instead of skipping them.")
    flags.DEFINE_integer("num_workers", None, "Worker processes (default: available CPUs).")
    flags.DEFINE_integer("seed", 0, "Seed of the shuffle that spreads classes over shards.")
    flags.mark_flags_as_required(["input_dir", "output_dir"])
    cli.make_key_flags(_FLAG_NAMES)


def _convert_from_flags(f: flags.FlagValues) -> None:
    if f.format != "folder":
        if f.split is not None:
            raise app.UsageError(f"--format={f.format} writes the train, validation and test splits at once: drop --split")
        arrays.convert_arrays(f.format, f.input_dir, f.output_dir, validation_examples=f.validation_examples,
                              train_examples=f.train_examples, num_shards=f.num_shards or 16, seed=f.seed)
        return
    missing = [f"--{name}" for name in ("split", "num_shards") if f[name].value is None]
    if missing:
        raise app.UsageError(f"{' and '.join(missing)} must be given to convert an image folder")
    convert(f.input_dir, f.output_dir, f.split, f.num_shards, labels_file=f.labels_file,
            class_order_file=f.class_order_file, class_text_file=f.class_text_file,
            resize_shorter=f.resize_shorter, strict=f.strict, num_workers=f.num_workers, seed=f.seed,
            devkit_meta=f.devkit_meta, class_order_from=f.class_order_from)


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-convert` and tools/tfrecord_convert.py."""
    logs.quiet_tensorflow_banner()  # TensorFlow is imported later, by the shard writers
    cli.run_tool(_convert_from_flags, define_flags=_define_flags, argv=argv)


if __name__ == "__main__":
    run()
