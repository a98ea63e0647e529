r"""The class of each image of a flat folder (ImageNet's validation layout), from a labels file as distributed.

`--labels_file` takes any of these, told apart by their contents:

* one class name per line, one line per image in sorted file-name order (e.g. a `val_synsets.txt`);
* Kaggle's ImageNet Object Localization `LOC_val_solution.csv`: the header `ImageId,PredictionString`,
  then rows `ILSVRC2012_val_00008726,n02119789 255 142 454 329 ...` in any order. An image's class is the
  first synset of its row; rows are matched to images by file name without extension;
* the ILSVRC2012 devkit's `data/ILSVRC2012_validation_ground_truth.txt`: one ILSVRC2012_ID per line, line
  k for `ILSVRC2012_val_{k:08d}.JPEG`, with `--devkit_meta=.../data/meta.mat`. These IDs are the devkit's
  own numbering (ID 1 is n02119789, kit fox), not the sorted-synset order labels follow: meta.mat's
  `synsets` struct array maps each ID of a leaf class (num_children 0; IDs 1-1000) to its WNID.

Each reader returns the class name of every image and, for error messages, where it was read
("FILE:LINE"). Errors name the file and the line or ID: an unknown ID, a row for no image, an
image without a row, a count that does not match the images.
"""

from __future__ import annotations

import csv
import os
import re
from typing import NamedTuple

LOC_HEADER = ("ImageId", "PredictionString")
_VAL_IMAGE_NUMBER = re.compile(r"ILSVRC2012_val_(\d+)$")


class Labels(NamedTuple):
    names: list[str]  # class name of image i
    origins: list[str]  # where names[i] was read: "FILE:LINE"


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _read_text_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--labels_file {path} does not exist")
    with open(path, encoding="utf-8-sig") as f:  # -sig: a CSV saved by a spreadsheet starts with a BOM
        return f.read().splitlines()


def is_loc_csv(lines: list[str]) -> bool:
    return bool(lines) and tuple(field.strip() for field in lines[0].split(",")) == LOC_HEADER


def _check_count(path: str, num_labels: int, image_paths: list[str]) -> None:
    if num_labels != len(image_paths):
        input_dir = os.path.dirname(image_paths[0])
        raise ValueError(f"--labels_file {path} has {num_labels} labels but input_dir {input_dir} has "
                         f"{len(image_paths)} images: need one label per image, in sorted file-name order")


def _check_positions(path: str, image_paths: list[str]) -> None:
    """Line k of a positional file labels the k-th image: ILSVRC2012_val_N must be the N-th (else images are missing)."""
    for position, image in enumerate(image_paths, 1):
        match = _VAL_IMAGE_NUMBER.fullmatch(_stem(image))
        if match and int(match.group(1)) != position:
            raise ValueError(f"{image} is image {position} in sorted file-name order, but --labels_file {path} "
                             f"labels ILSVRC2012_val_{int(match.group(1)):08d} on line {int(match.group(1))}: "
                             "input_dir lacks or adds images before it")


def from_name_list(path: str, lines: list[str], image_paths: list[str]) -> Labels:
    """One class name per line (blank lines skipped), line k for the k-th image in sorted order."""
    numbered = [(number, line.strip()) for number, line in enumerate(lines, 1) if line.strip()]
    if numbered and all(name.isdigit() for _, name in numbered):
        raise ValueError(f"--labels_file {path} holds numbers (line {numbered[0][0]}: {numbered[0][1]!r}), not class "
                         "names: the devkit's ILSVRC2012_validation_ground_truth.txt needs "
                         "--devkit_meta=<devkit>/data/meta.mat to map its ILSVRC2012_IDs to synsets")
    _check_count(path, len(numbered), image_paths)
    _check_positions(path, image_paths)
    return Labels([name for _, name in numbered], [f"{path}:{number}" for number, _ in numbered])


def read_devkit_synsets(meta_path: str) -> dict[int, str]:
    """{ILSVRC2012_ID: WNID} of the leaf classes (num_children 0) in the devkit's data/meta.mat."""
    import scipy.io  # only this input form needs it

    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"--devkit_meta {meta_path} does not exist")
    try:
        synsets = scipy.io.loadmat(meta_path, squeeze_me=True)["synsets"]
    except (ValueError, TypeError, KeyError, NotImplementedError, OSError) as err:
        raise ValueError(f"--devkit_meta {meta_path} is not the ILSVRC2012 devkit's data/meta.mat (a MATLAB file "
                         f"with a 'synsets' struct array): {type(err).__name__}: {err}") from err
    fields = set(synsets.dtype.names or ())
    missing = sorted({"ILSVRC2012_ID", "WNID", "num_children"} - fields)
    if missing:
        raise ValueError(f"--devkit_meta {meta_path}: its 'synsets' struct array lacks the field(s) {', '.join(missing)}")
    leaves = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets.ravel() if int(s["num_children"]) == 0}
    if not leaves:
        raise ValueError(f"--devkit_meta {meta_path} has no leaf classes (synsets with num_children 0)")
    return leaves


def from_ground_truth(path: str, lines: list[str], image_paths: list[str], meta_path: str) -> Labels:
    """The devkit's ground truth (one ILSVRC2012_ID per line) mapped to WNIDs through meta.mat."""
    wnid_of = read_devkit_synsets(meta_path)
    names, origins = [], []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if not text.isdigit():
            raise ValueError(f"{path}:{number}: {text!r} is not an ILSVRC2012_ID (the devkit's ground truth holds "
                             "one number per line)")
        if int(text) not in wnid_of:
            raise ValueError(f"{path}:{number}: ILSVRC2012_ID {int(text)} is not a leaf class of --devkit_meta "
                             f"{meta_path} (IDs {min(wnid_of)}-{max(wnid_of)})")
        names.append(wnid_of[int(text)])
        origins.append(f"{path}:{number}")
    _check_count(path, len(names), image_paths)
    _check_positions(path, image_paths)
    return Labels(names, origins)


def from_loc_csv(path: str, lines: list[str], image_paths: list[str]) -> Labels:
    """LOC_val_solution.csv: the first synset of each image's row, rows matched by image name."""
    rows = {}
    for number, row in enumerate(csv.reader(lines[1:]), 2):
        if not row:
            continue
        if len(row) != 2 or not row[1].split():
            raise ValueError(f"{path}:{number}: expected ImageId,PredictionString (synset x y x y ...), got {row!r}")
        image_id = row[0].strip()
        if image_id in rows:
            raise ValueError(f"{path}:{number}: {image_id} has a row already, on line {rows[image_id][1]}")
        rows[image_id] = (row[1].split()[0], number)
    missing = [image for image in image_paths if _stem(image) not in rows]
    if missing:
        raise ValueError(f"{missing[0]} has no row in --labels_file {path} ({len(missing)} of the {len(image_paths)} "
                         "images have none): ImageId is the image's file name without extension")
    if len(rows) != len(image_paths):
        stems = {_stem(image) for image in image_paths}
        extra = sorted(number for image_id, (_, number) in rows.items() if image_id not in stems)
        input_dir = os.path.dirname(image_paths[0])
        raise ValueError(f"--labels_file {path} has {len(rows)} rows but input_dir {input_dir} has {len(image_paths)} "
                         f"images: line {extra[0]} names an image that is not there")
    labels = [rows[_stem(image)] for image in image_paths]
    return Labels([synset for synset, _ in labels], [f"{path}:{number}" for _, number in labels])


def read(path: str, image_paths: list[str], devkit_meta: str | None = None) -> Labels:
    """The class of every image of `image_paths` (sorted) from `path`, in whichever form it is (module docstring)."""
    lines = _read_text_lines(path)
    if is_loc_csv(lines):
        if devkit_meta:
            raise ValueError(f"--labels_file {path} is a LOC_val_solution.csv (it names synsets): drop --devkit_meta")
        return from_loc_csv(path, lines, image_paths)
    if devkit_meta:
        return from_ground_truth(path, lines, image_paths, devkit_meta)
    return from_name_list(path, lines, image_paths)
