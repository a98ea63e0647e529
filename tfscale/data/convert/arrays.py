r"""The studies' datasets as they are distributed -> TFRecord shards: IDX files and CIFAR pickles.

    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=shards/fmnist
    tfscale-convert --format=cifar --input_dir=cifar-10-batches-py --output_dir=shards/cifar10 \
        [--validation_examples=5000] [--num_shards=16] [--seed=0]

* ``idx``: MNIST's format, also Fashion-MNIST, KMNIST and EMNIST: `*train-images-idx3-ubyte` with
  `*train-labels-idx1-ubyte`, and the test pair (`t10k-` or `test-` in the name), gzip or not.
  EMNIST stores its images transposed; they are written as stored.
* ``cifar``: the CIFAR-10 (`data_batch_1..5`, `test_batch`, `batches.meta`) or CIFAR-100 (`train`,
  `test`, `meta`; fine labels) Python pickles. They are read by an unpickler that builds nothing but
  numpy arrays, dicts, lists, numbers and strings: a file holding anything else (a pickle can call
  any function it names) is refused, naming the file, before any of it runs.

Writes three splits in the standard layout (`train-00000-of-00016`, ..., manifests): `train`, a
seeded, class-stratified `validation` split of `validation_examples` images held out of the training
set (5,000 in the CIFAR study), and `test`. Images are stored as PNG, losslessly: the pixels a model
reads are the source's bytes (a grey image decodes to three equal channels). Labels are 1-based (0
unused) as in every tfscale shard; the manifests name the classes (Fashion-MNIST's and CIFAR's own
names; digits for the rest).
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import pickle

import numpy as np
from absl import logging

from tfscale import io as tfio
from tfscale.data.convert import encode, shards, sources

FORMATS = ("idx", "cifar")
SPLITS = ("train", "validation", "test")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# --- reading --------------------------------------------------------------------------------------------------


def read_idx(path: str) -> np.ndarray:
    """An IDX file (gzip or not) as a numpy array; ValueError naming the file when it is not one."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (magic bytes {data[:4].hex()}, expected 0000 + type + rank)")
    rank = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(rank))
    dtype = np.dtype(_IDX_TYPES[data[2]])
    expected = 4 + 4 * rank + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{path}: IDX header says shape {shape} ({expected} bytes), the file holds {len(data)}")
    return np.frombuffer(data, dtype, offset=4 + 4 * rank).reshape(shape)


def _find_one(input_dir: str, patterns: tuple[str, ...], what: str) -> str:
    found = sorted({p for pattern in patterns for p in glob.glob(os.path.join(input_dir, pattern))})
    if len(found) != 1:
        raise FileNotFoundError(f"{input_dir}: expected one {what} file ({' or '.join(patterns)}), found "
                                f"{[os.path.basename(p) for p in found] or 'none'}")
    return found[0]


def _idx_pair(input_dir: str, prefixes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find_one(input_dir, tuple(f"*{p}-images-idx3-ubyte*" for p in prefixes), f"{prefixes[0]} images")
    labels_path = _find_one(input_dir, tuple(f"*{p}-labels-idx1-ubyte*" for p in prefixes), f"{prefixes[0]} labels")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{images_path} {images.shape} and {labels_path} {labels.shape} do not pair up: "
                         "expected [N, H, W] images and N labels")
    return images, labels.astype(np.int64)


def load_idx(input_dir: str) -> dict:
    """{"train": (images, labels), "test": (...), "classes": names} from an MNIST-layout directory."""
    train, test = _idx_pair(input_dir, ("train",)), _idx_pair(input_dir, ("t10k", "test"))
    num_classes = int(max(train[1].max(), test[1].max())) + 1
    fashion = "fashion" in os.path.abspath(input_dir).lower() and num_classes == len(FASHION_MNIST_CLASSES)
    classes = list(FASHION_MNIST_CLASSES) if fashion else [str(i) for i in range(num_classes)]
    return {"train": train, "test": test, "classes": classes}


def _plain_dtype(spec, align=False, copy=False) -> np.dtype:
    """np.dtype as a pickle rebuilds it, refusing object dtypes (their elements would be more pickled objects)."""
    dtype = np.dtype(spec, align, copy)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"an array of Python objects (dtype {spec!r})")
    return dtype


# Everything a CIFAR-10/100 python batch references: numpy's array reconstruction (by its numpy 1 name, as
# the files were written, and numpy 2's) and dtypes. The rest of a batch is dicts, lists, ints and strings.
_CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _plain_dtype,
}


class _CifarUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds numeric arrays and plain containers only.

    A pickle can name any importable callable and call it: `pickle.load` on a file someone hands you
    runs their code. This one resolves no name outside _CIFAR_GLOBALS (and has no persistent_load).
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which no CIFAR batch holds")
        return _CIFAR_GLOBALS[module, name]


def _unpickle(path: str) -> dict:
    """A CIFAR python batch (a pickled dict) with str keys; ValueError naming the file for anything else."""
    try:
        with open(path, "rb") as f:
            # encoding="bytes": the batches are Python 2 pickles whose str keys and data load as bytes.
            loaded = _CifarUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError) as err:
        raise ValueError(f"{path} is not a CIFAR python batch, refused: {err}") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} is not a CIFAR python batch: it holds a {type(loaded).__name__}, not a dict")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in loaded.items()}


def _cifar_batch(path: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(path)
    if "data" not in batch or label_key not in batch:
        raise ValueError(f"{path} is not a CIFAR batch: it has no 'data' / {label_key!r} entries")
    # Rows are 3072 bytes: the 32x32 red plane, then green, then blue.
    images = np.asarray(batch["data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[label_key], np.int64)


def load_cifar(input_dir: str) -> dict:
    """CIFAR-10 or CIFAR-100 Python batches: {"train": (images, labels), "test": (...), "classes": names}."""
    if os.path.exists(os.path.join(input_dir, "batches.meta")):  # CIFAR-10
        parts = [_cifar_batch(os.path.join(input_dir, f"data_batch_{i}"), "labels") for i in range(1, 6)]
        train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        test = _cifar_batch(os.path.join(input_dir, "test_batch"), "labels")
        names = _unpickle(os.path.join(input_dir, "batches.meta"))["label_names"]
    elif os.path.exists(os.path.join(input_dir, "meta")):  # CIFAR-100
        train = _cifar_batch(os.path.join(input_dir, "train"), "fine_labels")
        test = _cifar_batch(os.path.join(input_dir, "test"), "fine_labels")
        names = _unpickle(os.path.join(input_dir, "meta"))["fine_label_names"]
    else:
        raise FileNotFoundError(f"{input_dir} holds neither CIFAR-10 (batches.meta, data_batch_1..5, test_batch) "
                                "nor CIFAR-100 (meta, train, test) Python batches")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return {"train": train, "test": test, "classes": classes}


LOADERS = {"idx": load_idx, "cifar": load_cifar}


# --- splitting and writing ------------------------------------------------------------------------------------


def stratified_holdout(labels: np.ndarray, num_holdout: int, seed: int) -> np.ndarray:
    """Sorted indices of `num_holdout` examples, each class held out in proportion to its size
    (largest remainders), chosen at random with `seed`."""
    if not 0 <= num_holdout < len(labels):
        raise ValueError(f"validation_examples={num_holdout} must be in [0, {len(labels)}) (the training set's size)")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quotas = counts * num_holdout / len(labels)
    taken = np.floor(quotas).astype(int)
    taken[np.argsort(-(quotas - taken), kind="stable")[:num_holdout - taken.sum()]] += 1
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, taken)]
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image, mode="L" if image.ndim == 2 else "RGB").save(out, format="PNG")
    return out.getvalue()


def example_bytes(image: np.ndarray, label: int, classes: list[str], filename: str) -> bytes:
    """A tf.train.Example with the standard feature keys; the image as PNG, the label 1-based."""
    item = sources.Item(path=filename, label=label + sources.LABEL_OFFSET, synset=classes[label], text=classes[label])
    grey = image.ndim == 2
    return encode.example_bytes(png_bytes(image), image.shape[0], image.shape[1], item, image_format=b"PNG",
                                channels=1 if grey else 3, colorspace=b"Grayscale" if grey else b"RGB")


def write_split(output_dir: str, split: str, images: np.ndarray, labels: np.ndarray, indices: np.ndarray,
                classes: list[str], num_shards: int, *, source: str, seed: int, input_dir: str) -> dict:
    """Shards of `images[indices]` in a seeded shuffled order, then the manifest (last); returns it.

    Each record's file name is `{source}_{index}.png`: which source set ("train" or "test") and
    which position in it, so a record can be traced back to the array it came from.
    """
    import tensorflow as tf

    order = np.random.default_rng(seed).permutation(indices)
    infos = []
    for shard_index, part in enumerate(np.array_split(order, num_shards)):
        path = os.path.join(output_dir, shards.shard_name(split, shard_index, num_shards))
        with tfio.replaced_on_success(path) as temp, tf.io.TFRecordWriter(temp) as writer:
            for i in part:
                writer.write(example_bytes(images[i], int(labels[i]), classes, f"{source}_{int(i):06d}.png"))
        infos.append(shards.shard_info(path, len(part), inputs_sha256=""))
    manifest = shards.build_manifest(split, classes, classes, infos, [], resize_shorter=0, seed=seed,
                                     input_dir=input_dir, image_format="png", tool="tfscale.data.arrays")
    shards.write_manifest(output_dir, split, manifest)
    return manifest


def convert_arrays(fmt: str, input_dir: str, output_dir: str, *, validation_examples: int = 5000,
                   train_examples: int = 0, num_shards: int = 16, seed: int = 0) -> dict[str, dict]:
    """`fmt` files in `input_dir` -> train / validation / test shards in `output_dir`; the manifests by split.

    `train_examples` > 0 keeps a stratified, seeded subset of that many of the training images left after
    the validation holdout (small-scale studies); the validation and test splits stay whole."""
    if fmt not in LOADERS:
        raise ValueError(f"--format={fmt!r} is not one of: {', '.join(FORMATS)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    input_dir, output_dir = os.path.abspath(input_dir), os.path.abspath(output_dir)
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"input_dir {input_dir} does not exist or is not a directory")
    data = LOADERS[fmt](input_dir)
    (train_images, train_labels), (test_images, test_labels) = data["train"], data["test"]
    held_out = stratified_holdout(train_labels, validation_examples, seed)
    kept = np.setdiff1d(np.arange(len(train_labels)), held_out)
    if train_examples:
        if not 0 < train_examples <= len(kept):
            raise ValueError(f"train_examples={train_examples} must be in [1, {len(kept)}] (the training images "
                             f"left after holding out validation_examples={validation_examples})")
        if train_examples < len(kept):  # the complement of a stratified holdout is a stratified subset
            kept = np.setdiff1d(kept, kept[stratified_holdout(train_labels[kept], len(kept) - train_examples, seed)])
    os.makedirs(output_dir, exist_ok=True)
    parts = {"train": ("train", train_images, train_labels, kept),
             "validation": ("train", train_images, train_labels, held_out),
             "test": ("test", test_images, test_labels, np.arange(len(test_labels)))}
    manifests = {}
    for split, (source, images, labels, indices) in parts.items():
        if not len(indices):
            continue
        # Shards in proportion to the split's size, at least one each.
        split_shards = max(1, min(len(indices), round(num_shards * len(indices) / len(kept))))
        manifests[split] = write_split(output_dir, split, images, labels, indices, data["classes"], split_shards,
                                       source=source, seed=seed, input_dir=input_dir)
        logging.info("wrote %d %s examples of %d classes in %d shards to %s", len(indices), split,
                     len(data["classes"]), split_shards, output_dir)
    return manifests
