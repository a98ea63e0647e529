"""Reading conversion inputs: a class-folder tree, or a flat folder plus a labels file -> `Item`s.

    DIR/<class>/*.jpg|jpeg|png        (any case; ImageNet's train layout)
    DIR/*.jpg + --labels_file         (ImageNet val: a class per image; the forms ImageNet's labels come in
                                       are read by tfscale.data.convert.val_labels)

Labels follow the ImageNet convention: 1 + the class's index in label order (sorted class names, the
order of --class_order_file, or the train split's with --class_order_from); 0 is unused. Nothing here opens an image: checking and encoding
them is tfscale.data.convert.encode's job.
"""

from __future__ import annotations

import os
from typing import Iterable, NamedTuple

from absl import logging

from tfscale.data.convert import val_labels

LABEL_OFFSET = 1  # ImageNet convention: label = index in class order + 1; 0 is unused ("background")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
MAX_NAMED_FILES = 10  # files listed in one error message


class Item(NamedTuple):
    """One input image and what its Example says about it."""

    path: str
    label: int  # 1-based
    synset: str
    text: str


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


def _check_known_classes(names: Iterable[str], classes: list[str], where: str, order_source: str,
                         origins: list[str] | None = None) -> None:
    """Every class name must be one of `classes` (the label order); origins[i]: where names[i] was read."""
    names, known = list(names), set(classes)
    unknown = [i for i, name in enumerate(names) if name not in known]
    if unknown:
        first = f"{origins[unknown[0]]}: " if origins else ""
        distinct = sorted({names[i] for i in unknown})
        raise ValueError(f"{first}{len(distinct)} classes of {where} are not in {order_source}: "
                         f"{', '.join(distinct[:MAX_NAMED_FILES])}")


def read_class_order_from(shard_dir: str) -> tuple[list[str], list[str]]:
    """(classes, texts) of the train split converted into `shard_dir`, in its label order."""
    from tfscale import io as tfio  # TF-free

    path = tfio.find_manifest(shard_dir, "train")
    if path is None:
        raise FileNotFoundError(f"--class_order_from {shard_dir} holds no {tfio.MANIFEST_FORMAT.format(split='train')}: "
                                "convert the train split there first")
    manifest = tfio.read_manifest_file(path)
    classes = manifest.get("classes")
    if not classes:
        raise ValueError(f"--class_order_from: {path} names no classes")
    return classes, manifest.get("class_texts") or classes


def gather_items(input_dir: str, *, labels_file: str | None, class_order_file: str | None,
                 class_text_file: str | None, devkit_meta: str | None = None,
                 class_order_from: str | None = None) -> tuple[list[str], list[str], list[Item]]:
    """(classes in label order, their texts, every input image in sorted path order).

    The label order: `class_order_from`'s train manifest, else `class_order_file`, else sorted names.
    Texts: `class_text_file`, else the train manifest's, else the class names.
    """
    if class_order_file and class_order_from:
        raise ValueError("give --class_order_file or --class_order_from, not both: they both set the label order")
    if devkit_meta and not labels_file:
        raise ValueError("--devkit_meta maps the ILSVRC2012_IDs of a --labels_file (the devkit's ground truth): "
                         "give that too")
    origins = None
    if labels_file:
        paths = list_flat_folder(input_dir)
        synsets, origins = val_labels.read(labels_file, paths, devkit_meta)
        found = sorted(set(synsets))
    else:
        tree = list_class_tree(input_dir)
        paths = [p for images in tree.values() for p in images]
        synsets = [name for name, images in tree.items() for _ in images]
        found = list(tree)
    classes, manifest_texts = found, {}
    if class_order_from:
        classes, ordered_texts = read_class_order_from(class_order_from)
        manifest_texts = dict(zip(classes, ordered_texts))
        order_source = f"the train classes of --class_order_from {class_order_from}"
    elif class_order_file:
        classes = read_class_order(class_order_file)
        order_source = f"--class_order_file {class_order_file}"
    if class_order_from or class_order_file:
        _check_known_classes(synsets if origins else found, classes, labels_file or input_dir, order_source, origins)
    texts = read_class_texts(class_text_file) if class_text_file else manifest_texts
    class_texts = [texts.get(name, name) for name in classes]
    label_of = {name: index + LABEL_OFFSET for index, name in enumerate(classes)}
    text_of = dict(zip(classes, class_texts))
    items = [Item(path, label_of[s], s, text_of[s]) for path, s in zip(paths, synsets)]
    return classes, class_texts, items
