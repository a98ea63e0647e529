"""Reading conversion inputs: a class-folder tree, or a flat folder plus a labels file -> `Item`s.

    DIR/<class>/*.jpg|jpeg|png        (any case; ImageNet's train layout)
    DIR/*.jpg + --labels_file         (one class name per image in sorted file-name order; ImageNet val)

Labels follow the ImageNet convention: 1 + the class's index in label order (sorted class names, or
the order of --class_order_file); 0 is unused. Nothing here opens an image: checking and encoding
them is tfscale.data.encode's job.
"""

from __future__ import annotations

import os
from typing import Iterable, NamedTuple

from absl import logging

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


def _check_known_classes(names: Iterable[str], classes: list[str], where: str, class_order_file: str) -> None:
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise ValueError(f"{len(unknown)} classes of {where} are not in --class_order_file {class_order_file}: "
                         f"{', '.join(unknown[:MAX_NAMED_FILES])}")


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
