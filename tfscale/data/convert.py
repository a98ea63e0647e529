r"""Image folders -> TFRecord shards in the standard ImageNet layout, plus a JSON manifest.

    python tools/tfrecord_convert.py --input_dir=/data/ILSVRC/train --output_dir=/data/tfrecords \
        --split=train --num_shards=1024 [--class_order_file=synsets.txt] [--class_text_file=words.txt]
    python tools/tfrecord_convert.py --input_dir=/data/ILSVRC/val --output_dir=/data/tfrecords \
        --split=validation --num_shards=128 --labels_file=val_synsets.txt --class_order_file=synsets.txt

Input is a class-folder tree `DIR/<class>/*.jpg|jpeg|png` (any case), or a flat folder of images plus
a labels file with one class name per image in sorted file-name order (ImageNet's validation layout).

Output is what `build_imagenet_data.py` writes, so every TF ImageNet reader takes it: shards
`{split}-00000-of-01024` of tf.train.Examples with the features in FEATURE_KEYS, labels 1-based
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
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import multiprocessing
import os
import random
import re
import struct
import sys
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
from absl import app, flags, logging
from PIL import Image
from tqdm import tqdm

import tfscale
from tfscale import logs

FEATURE_KEYS = (
    "image/encoded",
    "image/format",
    "image/height",
    "image/width",
    "image/channels",
    "image/colorspace",
    "image/class/label",
    "image/class/synset",
    "image/class/text",
    "image/filename",
)
SPLITS = ("train", "validation")
LABEL_OFFSET = 1  # ImageNet convention: label = index in class order + 1; 0 is unused ("background")
JPEG_QUALITY = 95
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
# Huffman-coded sequential JPEG (SOF0 baseline, SOF1 extended): what every libjpeg build decodes.
_PASS_THROUGH_SOF_MARKERS = (0xC0, 0xC1)
# Not "{split}-manifest.json": Model Garden's `train*` and NVIDIA's `train-*` globs would read it as a
# shard (DataLossError: corrupted record at 0). That name is still read, from older conversions.
_MANIFEST_FORMAT = "manifest-{split}.json"
_LEGACY_MANIFEST_FORMAT = "{split}-manifest.json"
_STATE_FORMAT = ".{split}-convert-state.json"  # shard fingerprints while a conversion is under way
# Temporaries of shards, the state file and (legacy or current) manifests: ".<final name>.tmp-<pid>".
_TEMP_NAME = re.compile(r"^\.(?:(?P<split>[^/]+?)-(?:\d{5,}-of-\d{5,}|manifest\.json|convert-state\.json)"
                        r"|manifest-(?P<manifest_split>[^/]+)\.json)\.tmp-\d+$")
_MAX_NAMED_FILES = 10  # files listed in one error message


class Item(NamedTuple):
    """One input image and what its Example says about it."""

    path: str
    label: int  # 1-based
    synset: str
    text: str


# ----------------------------------------------------------------------------------------- inputs


def is_image_name(name: str) -> bool:
    """True for file names with an image extension we convert (case-insensitive).

    Hidden files are not images even when named like one: macOS leaves `._x.JPEG` metadata files.
    """
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _sorted_entries(directory: str) -> tuple[list[str], list[str]]:
    """(sub-directory names, file names) of `directory`, sorted, hidden entries left out."""
    dirs, files = [], []
    for entry in os.scandir(directory):
        if entry.name.startswith("."):
            continue
        (dirs if entry.is_dir() else files).append(entry.name)
    return sorted(dirs), sorted(files)


def read_lines(path: str, what: str) -> list[str]:
    """Non-empty, stripped lines of a text file; a clear error naming `what` when it is missing."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} does not exist")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def read_class_texts(path: str) -> dict[str, str]:
    """{synset: human text} from `synset<TAB>text` lines (space-separated lines work too)."""
    texts = {}
    for line in read_lines(path, "--class_text_file"):
        parts = line.split("\t", 1) if "\t" in line else line.split(None, 1)
        if len(parts) == 2:
            texts[parts[0].strip()] = parts[1].strip()
    return texts


def read_class_order(path: str) -> list[str]:
    """Class names, one per line; duplicates would make two labels for one class, so they fail."""
    classes = read_lines(path, "--class_order_file")
    seen = set()
    for line_number, name in enumerate(classes, 1):
        if name in seen:
            raise ValueError(f"class {name!r} appears twice in --class_order_file {path} (again on line {line_number})")
        seen.add(name)
    if not classes:
        raise ValueError(f"--class_order_file {path} lists no classes")
    return classes


def list_class_tree(input_dir: str) -> dict[str, list[str]]:
    """{class folder name: sorted image paths} of an ImageNet-style tree `input_dir/<class>/*`."""
    class_names, top_files = _sorted_entries(input_dir)
    if not class_names:
        if any(is_image_name(f) for f in top_files):
            raise ValueError(f"input_dir {input_dir} holds images but no class folders; a flat folder needs "
                             "--labels_file (one class name per image, in sorted file-name order)")
        raise ValueError(f"input_dir {input_dir} is empty: expected class folders of images")
    if any(is_image_name(f) for f in top_files):
        logging.warning("ignoring images directly in %s: only class folders are converted", input_dir)
    tree = {}
    for name in class_names:
        folder = os.path.join(input_dir, name)
        subdirs, files = _sorted_entries(folder)
        images = [os.path.join(folder, f) for f in files if is_image_name(f)]
        if not images:
            hint = f" (it has {len(subdirs)} sub-folders: is input_dir one level too high?)" if subdirs else ""
            raise ValueError(f"class folder {folder} has no images (*.jpg, *.jpeg, *.png){hint}")
        if len(images) < len(files):
            logging.warning("ignoring %d non-image files in %s", len(files) - len(images), folder)
        tree[name] = images
    return tree


def list_flat_folder(input_dir: str) -> list[str]:
    """Sorted image paths directly inside `input_dir`."""
    _, files = _sorted_entries(input_dir)
    images = [os.path.join(input_dir, f) for f in files if is_image_name(f)]
    if not images:
        raise ValueError(f"input_dir {input_dir} has no images (*.jpg, *.jpeg, *.png) for --labels_file")
    return images


def _check_known_classes(names: Iterable[str], classes: list[str], where: str, class_order_file: str) -> None:
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise ValueError(f"{len(unknown)} classes of {where} are not in --class_order_file {class_order_file}: "
                         f"{', '.join(unknown[:_MAX_NAMED_FILES])}")


def gather_items(input_dir: str, *, labels_file: str | None, class_order_file: str | None,
                 class_text_file: str | None) -> tuple[list[str], list[str], list[Item]]:
    """(classes in label order, their texts, every input image in sorted path order)."""
    if labels_file:
        paths = list_flat_folder(input_dir)
        synsets = read_lines(labels_file, "--labels_file")
        if len(synsets) != len(paths):
            raise ValueError(f"--labels_file {labels_file} has {len(synsets)} labels but input_dir {input_dir} "
                             f"has {len(paths)} images: need one label per image, in sorted file-name order")
        found = sorted(set(synsets))
    else:
        tree = list_class_tree(input_dir)
        paths = [p for images in tree.values() for p in images]
        synsets = [name for name, images in tree.items() for _ in images]
        found = list(tree)
    if class_order_file:
        classes = read_class_order(class_order_file)
        _check_known_classes(found, classes, labels_file or input_dir, class_order_file)
    else:
        classes = found
    texts = read_class_texts(class_text_file) if class_text_file else {}
    class_texts = [texts.get(name, name) for name in classes]
    label_of = {name: index + LABEL_OFFSET for index, name in enumerate(classes)}
    text_of = dict(zip(classes, class_texts))
    items = [Item(path, label_of[s], s, text_of[s]) for path, s in zip(paths, synsets)]
    return classes, class_texts, items


# ------------------------------------------------------------------------------------------ images


def check_image(path: str) -> str | None:
    """Why PIL cannot fully decode the file at `path`, or None when it can."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file (0 bytes)"
        with Image.open(path) as img:
            img.load()  # open() reads only the header; truncation and bad data show up here
    except Exception as e:  # PIL reports bad data as OSError, SyntaxError, ValueError, struct.error, ...
        return f"cannot decode: {type(e).__name__}: {e}"
    return None


def _scan_file(path: str) -> tuple[str | None, int, int]:
    """(reason it is unreadable or None, size in bytes, mtime in ns) of one image; runs in workers."""
    reason = check_image(path)
    stat = os.stat(path)
    return reason, stat.st_size, stat.st_mtime_ns


def jpeg_sof_marker(data: bytes) -> int | None:
    """The start-of-frame marker (0xC0 baseline, 0xC2 progressive, ...) of JPEG `data`, or None."""
    pos = 2  # after SOI
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length field
            pos += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn, not DHT/JPG/DAC
            return marker
        else:
            pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    return None


def can_pass_through(img: Image.Image, data: bytes) -> bool:
    """True when `data` is an 8-bit, sequential, RGB JPEG: bytes every TF JPEG decoder reads as is.

    Decided by the decoded format and mode, never the extension (ImageNet has a PNG named .JPEG and
    22 CMYK JPEGs). Progressive/arithmetic/12-bit JPEGs are re-encoded: PIL may read some of them
    where a reader's libjpeg build does not.
    """
    return img.format == "JPEG" and img.mode == "RGB" and jpeg_sof_marker(data) in _PASS_THROUGH_SOF_MARKERS


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB pixels of any PIL image; transparency is composited over white, as viewers show it."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I"):  # 16-bit grayscale PNG: convert("RGB") would clip it to white
        gray = np.asarray(img, dtype=np.float64) / 257.0
        return Image.fromarray(np.clip(np.rint(gray), 0, 255).astype(np.uint8)).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")  # L, P, CMYK, YCbCr, 1, ...


def resized_size(width_px: int, height_px: int, shorter_px: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shorter_px` and the aspect ratio kept."""
    scale = shorter_px / min(width_px, height_px)
    return max(1, round(width_px * scale)), max(1, round(height_px * scale))


def encode_image(path: str, resize_shorter: int = 0) -> tuple[bytes, int, int]:
    """(JPEG bytes, height, width) to store for the image at `path`.

    Baseline RGB JPEGs that need no resizing come back byte for byte: no generation loss, no time
    spent. Everything else is decoded, made RGB, shrunk if its shorter side exceeds `resize_shorter`
    (0: never) and encoded as baseline JPEG at quality JPEG_QUALITY.
    """
    with open(path, "rb") as f:
        data = f.read()
    with Image.open(io.BytesIO(data)) as img:
        width_px, height_px = img.size
        shrink = 0 < resize_shorter < min(width_px, height_px)
        if not shrink and can_pass_through(img, data):
            return data, height_px, width_px
        rgb = to_rgb(img)
        if shrink:
            # reducing_gap: a fast box reduction first, LANCZOS for the last factor 3 (visually identical).
            rgb = rgb.resize(resized_size(width_px, height_px, resize_shorter), Image.Resampling.LANCZOS,
                             reducing_gap=3.0)
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=JPEG_QUALITY)  # baseline, 4:2:0, as ImageNet's own JPEGs
    return out.getvalue(), rgb.height, rgb.width


# ----------------------------------------------------------------------------------------- records


def example_bytes(jpeg: bytes, height_px: int, width_px: int, item: Item) -> bytes:
    """A serialized tf.train.Example with exactly the FEATURE_KEYS, as build_imagenet_data.py writes."""
    import tensorflow as tf  # imported where needed: listing and checking inputs stay fast

    def _bytes(value: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def _int64(value: int):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    feature = {
        "image/encoded": _bytes(jpeg),
        "image/format": _bytes(b"JPEG"),
        "image/height": _int64(height_px),
        "image/width": _int64(width_px),
        "image/channels": _int64(3),
        "image/colorspace": _bytes(b"RGB"),
        "image/class/label": _int64(item.label),
        "image/class/synset": _bytes(item.synset.encode("utf-8")),
        "image/class/text": _bytes(item.text.encode("utf-8")),
        "image/filename": _bytes(os.path.basename(item.path).encode("utf-8")),
    }
    # deterministic=True sorts the feature map: identical bytes from every process and every run.
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(deterministic=True)


def count_records(path: str) -> int | None:
    """Number of records in a TFRecord file by walking its length headers; None if it is truncated."""
    size_bytes = os.path.getsize(path)
    count, pos = 0, 0
    with open(path, "rb") as f:
        while pos < size_bytes:
            header = f.read(8)
            if len(header) < 8:
                return None
            pos += 8 + 4 + struct.unpack("<Q", header)[0] + 4  # length, its crc, data, data crc
            if pos > size_bytes:
                return None
            f.seek(pos)
            count += 1
    return count


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shard_info(path: str, num_examples: int, inputs_sha256: str) -> dict:
    """The manifest entry of a finished shard."""
    return {"name": os.path.basename(path), "num_examples": num_examples, "bytes": os.path.getsize(path),
            "sha256": file_sha256(path), "inputs_sha256": inputs_sha256}


def write_shard(path: str, items: list[Item], resize_shorter: int, inputs_sha256: str) -> dict:
    """Writes one whole shard to a temporary name, renames it to `path` when complete; runs in workers.

    A killed writer leaves only `.{name}.tmp-<pid>`, never a half shard under the final name.
    """
    import tensorflow as tf

    temp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with tf.io.TFRecordWriter(temp) as writer:
            for item in items:
                try:
                    jpeg, height_px, width_px = encode_image(item.path, resize_shorter)
                except Exception as e:  # decodable at scan time: the file changed under us
                    raise RuntimeError(f"cannot convert {item.path} (it decoded during the scan): {e}") from e
                writer.write(example_bytes(jpeg, height_px, width_px, item))
        os.replace(temp, path)
    except BaseException:
        _remove_quietly(temp)
        raise
    return shard_info(path, len(items), inputs_sha256)


def reusable_shard_info(path: str, num_examples: int, inputs_sha256: str) -> dict | None:
    """The manifest entry of an existing, complete shard at `path`, or None when it must be rewritten."""
    if not os.path.isfile(path) or count_records(path) != num_examples:
        return None
    return shard_info(path, num_examples, inputs_sha256)


# -------------------------------------------------------------------------------------------- plan


def shard_name(split: str, index: int, num_shards: int) -> str:
    return f"{split}-{index:05d}-of-{num_shards:05d}"


def plan_shards(items: list[Item], num_shards: int, seed: int) -> list[list[Item]]:
    """`items` shuffled with `seed` (so every shard mixes classes), cut into sizes differing by <= 1."""
    order = list(items)
    random.Random(seed).shuffle(order)  # Python's Random: same order on every platform and version
    n = len(order)
    return [order[i * n // num_shards:(i + 1) * n // num_shards] for i in range(num_shards)]


def inputs_sha256(items: list[Item], file_stats: dict[str, tuple[int, int]], input_dir: str,
                  resize_shorter: int) -> str:
    """Fingerprint of everything a shard's bytes depend on: files (path, size, mtime), labels, options."""
    digest = hashlib.sha256(json.dumps([tfscale.__version__, JPEG_QUALITY, resize_shorter]).encode())
    for item in items:
        size_bytes, mtime_ns = file_stats[item.path]
        record = [os.path.relpath(item.path, input_dir), size_bytes, mtime_ns, item.label, item.synset, item.text]
        digest.update(json.dumps(record).encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ output files


def manifest_path(output_dir: str, split: str) -> str:
    """Where `convert` writes the manifest of `split`."""
    return os.path.join(output_dir, _MANIFEST_FORMAT.format(split=split))


def legacy_manifest_path(output_dir: str, split: str) -> str:
    """Where older tfscale versions wrote it (split globs match it: read, never written)."""
    return os.path.join(output_dir, _LEGACY_MANIFEST_FORMAT.format(split=split))


def find_manifest(output_dir: str, split: str) -> str | None:
    """Path of the manifest of `split` in `output_dir` (local or gs://...): current name first; None if none."""
    import tensorflow as tf  # tf.io.gfile: data dirs may be remote

    for path in (manifest_path(output_dir, split), legacy_manifest_path(output_dir, split)):
        if tf.io.gfile.exists(path):
            return path
    return None


def read_manifest(output_dir: str, split: str) -> dict | None:
    """The manifest `convert` wrote for `split` in `output_dir` (local or gs://...), None if there is none."""
    import tensorflow as tf

    path = find_manifest(output_dir, split)
    if path is None:
        return None
    with tf.io.gfile.GFile(path, "r") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest {path} is not valid JSON: {e}") from e


def _write_json_atomically(path: str, obj: dict) -> None:
    """Readers see the old file or the whole new one, never a partial write."""
    temp = os.path.join(os.path.dirname(path), f".{os.path.basename(path).lstrip('.')}.tmp-{os.getpid()}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        _remove_quietly(temp)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_temp_files(output_dir: str, split: str) -> list[str]:
    """Deletes temporaries a killed conversion of `split` left behind (only our own names)."""
    removed = []
    for name in sorted(os.listdir(output_dir)):
        match = _TEMP_NAME.match(name)
        if match and split in (match.group("split"), match.group("manifest_split")):
            _remove_quietly(os.path.join(output_dir, name))
            removed.append(name)
    if removed:
        logging.info("removed %d temporary files of an interrupted conversion: %s", len(removed), ", ".join(removed))
    return removed


def previous_fingerprints(output_dir: str, split: str) -> dict[str, str]:
    """{shard name: inputs_sha256} of shards known to be on disk: from an interrupted run, else the manifest."""
    state_path = os.path.join(output_dir, _STATE_FORMAT.format(split=split))
    for path in (state_path, manifest_path(output_dir, split), legacy_manifest_path(output_dir, split)):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if "shards" in data and isinstance(data["shards"], list):  # a manifest
            return {s["name"]: s.get("inputs_sha256") for s in data["shards"]}
        return dict(data.get("inputs_sha256", {}))
    return {}  # shards of unknown origin are rewritten, never trusted


def _warn_about_other_shards(output_dir: str, split: str, names: list[str]) -> None:
    """Shards of another shard count are left alone, but readers globbing `{split}-*-of-*` see them."""
    pattern, ours = re.compile(rf"^{re.escape(split)}-\d{{5,}}-of-\d{{5,}}$"), set(names)
    others = sorted(n for n in os.listdir(output_dir) if pattern.match(n) and n not in ours)
    if others:
        logging.warning("%s also holds %d other %s shards (e.g. %s), left untouched; readers that glob "
                        "%s-*-of-* will read them too: delete them if they are stale",
                        output_dir, len(others), split, others[0], split)


# ------------------------------------------------------------------------------------- parallelism


def default_num_workers() -> int:
    """CPUs this process may use (a Slurm allocation, not the whole node), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _process_pool(num_workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """Workers forked from a server process that imported TensorFlow once.

    Not plain fork: the caller may hold TensorFlow/BLAS threads whose locks a child would inherit
    mid-use. Not spawn: every worker would import TensorFlow again (~5 s each).
    """
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        context.set_forkserver_preload(["tensorflow", "tfscale.data.convert"])
    return concurrent.futures.ProcessPoolExecutor(max_workers=num_workers, mp_context=context)


def _map_ordered(pool, fn: Callable, args: list, chunksize: int) -> Iterator:
    """fn(a) for a in args, in order: in worker processes, or inline when pool is None."""
    return pool.map(fn, args, chunksize=chunksize) if pool else map(fn, args)


def _run_unordered(pool, fn: Callable, arg_tuples: list[tuple]) -> Iterator:
    """fn(*args) for each tuple, yielded as they finish; inline when pool is None."""
    if pool is None:
        yield from (fn(*args) for args in arg_tuples)
        return
    futures = [pool.submit(fn, *args) for args in arg_tuples]
    try:
        for future in concurrent.futures.as_completed(futures):
            yield future.result()
    finally:  # on an error, start no further shards; running ones finish or are killed with us
        for future in futures:
            future.cancel()


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


# ---------------------------------------------------------------------------------------- pipeline


def scan_images(paths: list[str], num_workers: int, pool) -> list[tuple[str | None, int, int]]:
    """_scan_file of every path, in order, with a progress bar."""
    # Chunks amortise inter-process traffic; small enough that every worker gets several.
    chunksize = max(1, min(64, len(paths) // (4 * num_workers)))
    results = []
    with _progress(len(paths), "check images") as bar:
        for result in _map_ordered(pool, _scan_file, paths, chunksize):
            results.append(result)
            bar.update(1)
    return results


def drop_unreadable(items: list[Item], scans: list[tuple], strict: bool) -> tuple[list[Item], list[dict]]:
    """(decodable items, manifest `skipped` entries); with strict, any unreadable file is an error."""
    skipped = [{"path": item.path, "reason": scan[0]} for item, scan in zip(items, scans) if scan[0]]
    if skipped and strict:
        listed = "\n  ".join(f"{s['path']}: {s['reason']}" for s in skipped[:_MAX_NAMED_FILES])
        more = f"\n  ... and {len(skipped) - _MAX_NAMED_FILES} more" if len(skipped) > _MAX_NAMED_FILES else ""
        raise ValueError(f"--strict: {len(skipped)} unreadable images, nothing written:\n  {listed}{more}")
    for s in skipped:
        logging.warning("skipping unreadable image %s: %s", s["path"], s["reason"])
    return [item for item, scan in zip(items, scans) if not scan[0]], skipped


def write_shards(output_dir: str, split: str, planned: list[list[Item]], file_stats: dict, input_dir: str,
                 resize_shorter: int, pool) -> list[dict]:
    """Writes the planned shards that are not already on disk; returns every shard's manifest entry.

    A shard is reused when its file is complete and was written from the same inputs and options
    (same fingerprint, recorded in a state file while writing and in the manifest afterwards).
    """
    num_shards = len(planned)
    paths = [os.path.join(output_dir, shard_name(split, i, num_shards)) for i in range(num_shards)]
    fingerprints = [inputs_sha256(items, file_stats, input_dir, resize_shorter) for items in planned]
    known = previous_fingerprints(output_dir, split)
    remove_temp_files(output_dir, split)

    candidates = [(p, len(items), fp) for p, items, fp in zip(paths, planned, fingerprints)
                  if known.get(os.path.basename(p)) == fp]
    done = {info["name"]: info for info in _run_unordered(pool, reusable_shard_info, candidates) if info}
    state_path = os.path.join(output_dir, _STATE_FORMAT.format(split=split))

    def save_state():  # only shards whose final file exists, so a kill at any point leaves a true record
        _write_json_atomically(state_path, {"inputs_sha256": {n: i["inputs_sha256"] for n, i in done.items()}})

    save_state()
    # They would describe shards about to change; the legacy one also sits in readers' split globs.
    _remove_quietly(manifest_path(output_dir, split))
    _remove_quietly(legacy_manifest_path(output_dir, split))
    todo = [(p, items, resize_shorter, fp) for p, items, fp in zip(paths, planned, fingerprints)
            if os.path.basename(p) not in done]
    if done:
        logging.info("reusing %d complete shards; writing %d", len(done), len(todo))
    with _progress(sum(len(t[1]) for t in todo), f"write {len(todo)} shards") as bar:
        for info in _run_unordered(pool, write_shard, todo):
            done[info["name"]] = info
            save_state()
            bar.update(info["num_examples"])
    return [done[os.path.basename(p)] for p in paths]


def build_manifest(split: str, classes: list[str], class_texts: list[str], shards: list[dict], skipped: list[dict],
                   *, resize_shorter: int, seed: int, input_dir: str) -> dict:
    """The `manifest-{split}.json` contents; `read_manifest` returns them.

    classes[i] is the class the model's output i stands for; its examples carry the stored label
    class_labels[i] = i + label_offset (explicit, so export and other tools need not know the offset).
    """
    return {
        "split": split,
        "num_examples": sum(s["num_examples"] for s in shards),
        "num_shards": len(shards),
        "num_classes": len(classes),
        "label_offset": LABEL_OFFSET,
        "classes": classes,  # in label order, for every input form (class tree, labels file, class order file)
        "class_labels": [index + LABEL_OFFSET for index in range(len(classes))],  # stored label of classes[i]
        "class_texts": class_texts,  # class_texts[i] belongs to classes[i]
        "shards": shards,
        "skipped": skipped,
        "resize_shorter": resize_shorter,
        "seed": seed,
        "jpeg_quality": JPEG_QUALITY,
        "input_dir": input_dir,
        "tool": "tfscale.data.convert",
        "tool_version": tfscale.__version__,
    }


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
            strict: bool = False, num_workers: int | None = None, seed: int = 0) -> dict:
    """Converts an image folder into `num_shards` TFRecord shards plus a manifest; returns the manifest.

    Args:
      input_dir: class-folder tree `input_dir/<class>/*.jpg|png`, or a flat folder with `labels_file`.
      output_dir: where shards `{split}-00000-of-{num_shards:05d}` and `manifest-{split}.json` go;
        created if needed. Other files in it are never touched.
      split: "train" or "validation" (the shard-name prefix).
      num_shards: number of shards; at most the number of images.
      labels_file: one class name per line, one line per image of a flat `input_dir`, sorted by name.
      class_order_file: class names, one per line, in label order (label = line index + 1). Default:
        sorted class folder names (tree) or sorted distinct names of `labels_file`.
      class_text_file: `synset<TAB>text` lines; classes without one get their name as text.
      resize_shorter: shrink images whose shorter side exceeds this many pixels to it; 0: never.
      strict: unreadable images fail the run (before anything is written) instead of being skipped.
      num_workers: worker processes (default: the CPUs available); 1 runs everything in-process.
      seed: seed of the shuffle that spreads classes over shards.

    With num_workers > 1 a script calling this needs the usual `if __name__ == "__main__":` guard:
    worker processes import the main module, as with any multiprocessing start method but fork.
    """
    _check_arguments(input_dir, split, num_shards, resize_shorter, num_workers)
    input_dir, output_dir = os.path.abspath(input_dir), os.path.abspath(output_dir)
    classes, class_texts, items = gather_items(input_dir, labels_file=labels_file,
                                               class_order_file=class_order_file, class_text_file=class_text_file)
    _check_shard_count(num_shards, len(items), input_dir)
    num_workers = min(num_workers or default_num_workers(), len(items))
    logging.info("converting %d images of %d classes in %s into %d %s shards in %s with %d workers",
                 len(items), len(classes), input_dir, num_shards, split, output_dir, num_workers)

    pool = _process_pool(num_workers) if num_workers > 1 else None
    try:
        scans = scan_images([item.path for item in items], num_workers, pool)
        file_stats = {item.path: (size_bytes, mtime_ns) for item, (_, size_bytes, mtime_ns) in zip(items, scans)}
        items, skipped = drop_unreadable(items, scans, strict)
        _check_shard_count(num_shards, len(items), input_dir, after=" that decode")
        os.makedirs(output_dir, exist_ok=True)
        shards = write_shards(output_dir, split, plan_shards(items, num_shards, seed), file_stats, input_dir,
                              resize_shorter, pool)
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)

    manifest = build_manifest(split, classes, class_texts, shards, skipped, resize_shorter=resize_shorter, seed=seed,
                              input_dir=input_dir)
    _write_json_atomically(manifest_path(output_dir, split), manifest)
    _remove_quietly(os.path.join(output_dir, _STATE_FORMAT.format(split=split)))
    _warn_about_other_shards(output_dir, split, [s["name"] for s in shards])
    logging.info("wrote %s: %d examples in %d shards, %d images skipped", manifest_path(output_dir, split),
                 manifest["num_examples"], num_shards, len(skipped))
    return manifest


# --------------------------------------------------------------------------------------------- CLI


_FLAG_NAMES = ("input_dir", "output_dir", "split", "num_shards", "labels_file", "class_order_file",
               "class_text_file", "resize_shorter", "strict", "num_workers", "seed")


def _define_flags() -> None:
    """Flags exist only when the tool runs: importing this module (the input pipeline does) adds none."""
    if "input_dir" in flags.FLAGS:
        return
    flags.DEFINE_string("input_dir", None, "Class-folder tree DIR/<class>/*.jpg|png, or a flat folder "
                        "of images with --labels_file.")
    flags.DEFINE_string("output_dir", None, "Where shards and manifest-{split}.json go (created if needed).")
    flags.DEFINE_enum("split", None, SPLITS, "Shard-name prefix.")
    flags.DEFINE_integer("num_shards", None, "Number of shards (ImageNet: 1024 train, 128 validation).")
    flags.DEFINE_string("labels_file", None, "For a flat folder: one class name per image, in sorted "
                        "file-name order.")
    flags.DEFINE_string("class_order_file", None, "Class names in label order, one per line "
                        "(label = line index + 1). Default: sorted class names.")
    flags.DEFINE_string("class_text_file", None, "synset<TAB>human text lines (synset_words.txt); default "
                        "text: the class name.")
    flags.DEFINE_integer("resize_shorter", 0, "Shrink images whose shorter side exceeds this (px); 0: never.")
    flags.DEFINE_bool("strict", False, "Fail on unreadable images instead of skipping them.")
    flags.DEFINE_integer("num_workers", None, "Worker processes (default: available CPUs).")
    flags.DEFINE_integer("seed", 0, "Seed of the shuffle that spreads classes over shards.")
    flags.mark_flags_as_required(["input_dir", "output_dir", "split", "num_shards"])
    for name in _FLAG_NAMES:  # --helpshort lists the main module's key flags: make these ones
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def _main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    try:
        convert(f.input_dir, f.output_dir, f.split, f.num_shards, labels_file=f.labels_file,
                class_order_file=f.class_order_file, class_text_file=f.class_text_file,
                resize_shorter=f.resize_shorter, strict=f.strict, num_workers=f.num_workers, seed=f.seed)
    except (ValueError, OSError) as e:  # bad input: one clear line, no traceback
        logging.error("%s", e)
        return 1
    return 0


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-convert` and tools/tfrecord_convert.py."""
    logs.quiet_tensorflow_banner()  # TensorFlow is imported later, by the shard writers
    _define_flags()
    app.run(_main, argv=argv)


if __name__ == "__main__":
    run()
