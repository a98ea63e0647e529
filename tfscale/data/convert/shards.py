"""Writing a conversion's shards: plan, fingerprints, temp + rename, resume state, manifest contents.

Names in an output directory (everything but shards and the manifest starts with "."):
  `{split}-00000-of-01024`            a shard, complete (written under a temporary name, then renamed)
  `.{name}.tmp-{pid}`                 the temporary of a shard, the state file or a manifest
  `.{split}-convert-state.json`       {shard name: inputs_sha256} of the finished shards of a run
  `dali-index/{name}.idx`             the shard's index for DALI's reader (tfscale.data.convert.dali_index)
  `manifest-{split}.json`             tfscale.io; written last, by tfscale.data.convert.convert
A shard is reused by a rerun only when it is complete and its recorded fingerprint (inputs_sha256:
input files, labels and options) is the one planned; shards of unknown origin are rewritten.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re

from absl import logging

import tfscale
from tfscale import io as tfio
from tfscale.data.convert import dali_index, parallel
from tfscale.data.convert.encode import JPEG_QUALITY, encode_image, example_bytes
from tfscale.data.convert.sources import LABEL_OFFSET, Item

_STATE_FORMAT = ".{split}-convert-state.json"  # shard fingerprints while a conversion is under way


# -------------------------------------------------------------------------------------------- plan


def shard_name(split: str, index: int, num_shards: int) -> str:
    return f"{split}-{index:05d}-of-{num_shards:05d}"


def state_path(output_dir: str, split: str) -> str:
    """The state file of a conversion of `split` that is under way (or was killed)."""
    return os.path.join(output_dir, _STATE_FORMAT.format(split=split))


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


# ------------------------------------------------------------------------------------------ shards


def count_records(path: str) -> int | None:
    """Number of records in a TFRecord file by walking its length headers; None if it is truncated."""
    spans, complete = tfio.tfrecord_spans(path)
    return len(spans) if complete else None


def shard_info(path: str, num_examples: int, inputs_sha256: str) -> dict:
    """The manifest entry of a finished shard."""
    return {"name": os.path.basename(path), "num_examples": num_examples, "bytes": os.path.getsize(path),
            "sha256": tfio.file_sha256(path), "inputs_sha256": inputs_sha256}


def write_shard(path: str, items: list[Item], resize_shorter: int, inputs_sha256: str) -> dict:
    """Writes one whole shard to a temporary name, renames it to `path` when complete; runs in workers.

    A killed writer leaves only `.{name}.tmp-<pid>`, never a half shard under the final name.
    """
    import tensorflow as tf

    with tfio.replaced_on_success(path) as temp:
        with tf.io.TFRecordWriter(temp) as writer:
            for item in items:
                try:
                    jpeg, height_px, width_px = encode_image(item.path, resize_shorter)
                except Exception as e:  # decodable at scan time: the file changed under us
                    raise RuntimeError(f"cannot convert {item.path} (it decoded during the scan): {e}") from e
                writer.write(example_bytes(jpeg, height_px, width_px, item))
    return shard_info(path, len(items), inputs_sha256)


def reusable_shard_info(path: str, num_examples: int, inputs_sha256: str) -> dict | None:
    """The manifest entry of an existing, complete shard at `path`, or None when it must be rewritten."""
    if not os.path.isfile(path) or count_records(path) != num_examples:
        return None
    return shard_info(path, num_examples, inputs_sha256)


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
    done = {info["name"]: info for info in parallel.run_unordered(pool, reusable_shard_info, candidates) if info}

    def save_state():  # only shards whose final file exists, so a kill at any point leaves a true record
        tfio.write_json(state_path(output_dir, split),
                        {"inputs_sha256": {n: i["inputs_sha256"] for n, i in done.items()}}, indent=1)

    save_state()
    # They would describe shards about to change; the legacy one also sits in readers' split globs.
    tfio.remove_quietly(tfio.manifest_path(output_dir, split))
    tfio.remove_quietly(tfio.legacy_manifest_path(output_dir, split))
    todo = [(p, items, resize_shorter, fp) for p, items, fp in zip(paths, planned, fingerprints)
            if os.path.basename(p) not in done]
    if done:
        logging.info("reusing %d complete shards; writing %d", len(done), len(todo))
    with parallel.progress(sum(len(t[1]) for t in todo), f"write {len(todo)} shards") as bar:
        for info in parallel.run_unordered(pool, write_shard, todo):
            done[info["name"]] = info
            save_state()
            bar.update(info["num_examples"])
    return [done[os.path.basename(p)] for p in paths]


# ---------------------------------------------------------------------------- the rest of the dir


def remove_temp_files(output_dir: str, split: str) -> list[str]:
    """Deletes temporaries a killed conversion of `split` left behind (only our own names)."""
    split_glob = glob.escape(split)
    finals = (f"{split_glob}-[0-9]*-of-[0-9]*", tfio.MANIFEST_FORMAT.format(split=split_glob),
              tfio.LEGACY_MANIFEST_FORMAT.format(split=split_glob), _STATE_FORMAT.format(split=split_glob))
    removed = sorted(os.path.basename(path) for final in finals for path in tfio.temp_files(output_dir, final))
    for name in removed:
        tfio.remove_quietly(os.path.join(output_dir, name))
    if removed:
        logging.info("removed %d temporary files of an interrupted conversion: %s", len(removed), ", ".join(removed))
    return removed


def previous_fingerprints(output_dir: str, split: str) -> dict[str, str]:
    """{shard name: inputs_sha256} of shards known to be on disk: from an interrupted run, else the manifest.

    Tolerant on purpose: an unreadable record only means its shards are rewritten.
    """
    for path in (state_path(output_dir, split), tfio.manifest_path(output_dir, split),
                 tfio.legacy_manifest_path(output_dir, split)):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if "shards" in data and isinstance(data["shards"], list):  # a manifest
            return {s["name"]: s.get("inputs_sha256") for s in data["shards"]}
        return dict(data.get("inputs_sha256", {}))
    return {}  # shards of unknown origin are rewritten, never trusted


def warn_about_other_shards(output_dir: str, split: str, names: list[str]) -> None:
    """Shards of another shard count are left alone, but readers globbing `{split}-*-of-*` see them."""
    pattern, ours = re.compile(rf"^{re.escape(split)}-\d{{5,}}-of-\d{{5,}}$"), set(names)
    others = sorted(n for n in os.listdir(output_dir) if pattern.match(n) and n not in ours)
    if others:
        logging.warning("%s also holds %d other %s shards (e.g. %s), left untouched; readers that glob "
                        "%s-*-of-* will read them too: delete them if they are stale",
                        output_dir, len(others), split, others[0], split)


def write_manifest(output_dir: str, split: str, manifest: dict) -> None:
    """The last step of a conversion: the shards' DALI index files (data.loader=dali), then the manifest."""
    dali_index.write_for_shards(output_dir, [shard["name"] for shard in manifest["shards"]])
    tfio.write_json(tfio.manifest_path(output_dir, split), manifest, indent=1)


def build_manifest(split: str, classes: list[str], class_texts: list[str], shards: list[dict], skipped: list[dict],
                   *, resize_shorter: int, seed: int, input_dir: str, image_format: str = "jpeg",
                   tool: str = "tfscale.data.convert") -> dict:
    """The `manifest-{split}.json` contents; `tfscale.io.read_manifest` returns them.

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
        # "jpeg": every record is a baseline RGB JPEG (encode.py), readers skip format checks; "png": lossless (arrays.py).
        "image_format": image_format,
        "input_dir": input_dir,
        "tool": tool,
        "tool_version": tfscale.__version__,
    }
