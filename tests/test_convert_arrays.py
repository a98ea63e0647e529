"""tfscale-convert --format=idx|cifar: the studies' datasets in their own formats -> shards, bytes-exact.

The inputs are small files written here in the real formats (IDX with its big-endian header, gzip or
not; CIFAR-10/100 Python pickles); nothing is downloaded. With Debian's dataset-fashion-mnist
installed, the real Fashion-MNIST files are converted too.
"""

import collections
import gzip
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, quiet_env

from tfscale.data.convert import arrays
from tfscale.workdir import layout

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def write_idx(path, array, compress):
    codes = {np.dtype(np.uint8): 0x08}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if compress else data)


def make_idx_dir(root, *, n_train=300, n_test=60, compress=True, prefix=""):
    rng = np.random.default_rng(1)
    os.makedirs(root, exist_ok=True)
    source = {}
    for name, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        suffix = ".gz" if compress else ""
        write_idx(os.path.join(root, f"{prefix}{name}-images-idx3-ubyte{suffix}"), images, compress)
        write_idx(os.path.join(root, f"{prefix}{name}-labels-idx1-ubyte{suffix}"), labels, compress)
        source["test" if name == "t10k" else "train"] = (images, labels)
    return source


class Python2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote CIFAR's batches: protocol 2, every str and bytes a Python 2 str
    (SHORT_BINSTRING/BINSTRING: bytes when Python 3 loads them with encoding="bytes"), numpy's globals
    under their numpy 1 module names (numpy.core.multiarray._reconstruct)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin-1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + len(data).to_bytes(4, "little") + data)
        self.memoize(obj)

    def save_numpy1_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)

    dispatch[str] = dispatch[bytes] = save_py2_str
    dispatch[type] = dispatch[type(np.add.reduce)] = save_numpy1_global


def pickle_like_python2(path, obj):
    with open(path, "wb") as f:
        Python2Pickler(f, protocol=2).dump(obj)


def make_cifar_dir(root, *, hundred=False, per_batch=40, n_test=30, dump=pickle_like_python2):
    """CIFAR batches as cifar-10-batches-py / cifar-100-python hold them: Python 2 pickles (str keys that load
    as bytes), 3072-byte uint8 rows, the same entries. `dump=pickle.dump`: pickled by Python 3 instead."""
    rng = np.random.default_rng(2)
    os.makedirs(root, exist_ok=True)
    num_classes, label_key = (100, "fine_labels") if hundred else (10, "labels")

    def batch(path, n):
        rows = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, num_classes, size=n).tolist()
        entries = {"data": rows, label_key: labels, "batch_label": "training batch 1 of 5",
                   "filenames": [f"image_{i:06d}.png" for i in range(n)]}
        if hundred:
            entries["coarse_labels"] = [label // 5 for label in labels]
        dump(path, entries)
        return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.array(labels)

    names = [f"class_{i}" for i in range(num_classes)]
    if hundred:
        train = batch(os.path.join(root, "train"), 5 * per_batch)
        test = batch(os.path.join(root, "test"), n_test)
        meta = ("meta", {"fine_label_names": names, "coarse_label_names": [f"super_{i}" for i in range(20)]})
    else:
        parts = [batch(os.path.join(root, f"data_batch_{i}"), per_batch) for i in range(1, 6)]
        train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        test = batch(os.path.join(root, "test_batch"), n_test)
        meta = ("batches.meta", {"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072})
    dump(os.path.join(root, meta[0]), meta[1])
    return {"train": train, "test": test, "classes": names}


def convert_cli(fmt, input_dir, output_dir, *extra):
    return subprocess.run([sys.executable, "-m", "tfscale.data.convert", f"--format={fmt}", f"--input_dir={input_dir}",
                           f"--output_dir={output_dir}", *extra], cwd=REPO, env=quiet_env(), capture_output=True,
                          text=True, timeout=300)


def read_split(output_dir, split):
    """[(source name, source index, pixels as stored, 1-based label, class text)] of every record of `split`."""
    files = sorted(tf.io.gfile.glob(os.path.join(output_dir, f"{split}-*-of-*")))
    records = []
    for serialized in tf.data.TFRecordDataset(files):
        feature = tf.train.Example.FromString(serialized.numpy()).features.feature
        source, index = feature["image/filename"].bytes_list.value[0].decode().removesuffix(".png").split("_")
        pixels = tf.io.decode_png(feature["image/encoded"].bytes_list.value[0]).numpy()
        records.append((source, int(index), pixels, feature["image/class/label"].int64_list.value[0],
                        feature["image/class/text"].bytes_list.value[0].decode()))
    return records


def assert_exact(records, source, classes):
    for origin, index, pixels, label, text in records:
        images, labels = source[origin]
        expected = images[index]
        assert pixels.shape == (expected.shape if expected.ndim == 3 else (*expected.shape, 1))
        assert pixels.reshape(expected.shape).tobytes() == expected.tobytes(), f"{origin}_{index}: pixels differ"
        assert label == labels[index] + 1 and text == classes[labels[index]]


@pytest.mark.parametrize("compress", [True, False])
def test_idx_to_shards_is_bytes_exact_with_a_stratified_validation_split(tmp_path, compress):
    source = make_idx_dir(tmp_path / "idx", compress=compress)
    result = convert_cli("idx", tmp_path / "idx", tmp_path / "out", "--validation_examples=50", "--num_shards=4")
    assert result.returncode == 0, result.stderr[-3000:]
    classes = [str(i) for i in range(10)]
    train, validation, test = (read_split(tmp_path / "out", s) for s in ("train", "validation", "test"))
    for records in (train, validation, test):
        assert_exact(records, source, classes)
    # Every training image once: in train or held out, never both; the test set whole.
    assert sorted(i for _, i, *_ in train + validation) == list(range(300))
    assert sorted(i for _, i, *_ in test) == list(range(60)) and {o for o, *_ in test} == {"test"}
    assert len(validation) == 50
    # Stratified: each class's share of the held-out 50 is its share of the 300, to the nearest image.
    counts = collections.Counter(source["train"][1].tolist())
    held = collections.Counter(label - 1 for *_, label, _ in validation)
    for c in range(10):
        assert abs(held[c] - counts[c] * 50 / 300) < 1, (c, held[c], counts[c])
    manifests = {s: json.load(open(tmp_path / "out" / f"manifest-{s}.json")) for s in ("train", "validation", "test")}
    assert [manifests[s]["num_examples"] for s in ("train", "validation", "test")] == [250, 50, 60]
    assert manifests["train"]["num_shards"] == 4 and manifests["train"]["image_format"] == "png"
    assert manifests["test"]["classes"] == classes


def test_the_split_is_seeded(tmp_path):
    make_idx_dir(tmp_path / "idx")
    held = []
    for seed in (0, 0, 1):
        out = tmp_path / f"out{len(held)}"
        assert convert_cli("idx", tmp_path / "idx", out, "--validation_examples=30", f"--seed={seed}").returncode == 0
        held.append(sorted(i for _, i, *_ in read_split(out, "validation")))
    assert held[0] == held[1] != held[2]


def test_train_examples_keeps_a_stratified_seeded_subset_of_the_rest(tmp_path):
    source = make_idx_dir(tmp_path / "idx")
    result = convert_cli("idx", tmp_path / "idx", tmp_path / "out", "--validation_examples=50", "--train_examples=100")
    assert result.returncode == 0, result.stderr[-3000:]
    train, validation = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "validation")
    assert_exact(train, source, [str(i) for i in range(10)])
    assert len(train) == 100 and len(validation) == 50
    assert not {i for _, i, *_ in train} & {i for _, i, *_ in validation}
    assert json.load(open(tmp_path / "out" / "manifest-train.json"))["num_examples"] == 100
    # Stratified: each class's share of the 100 is its share of the 250 left after the holdout, to one image.
    held = {i for _, i, *_ in validation}
    rest = collections.Counter(int(label) for i, label in enumerate(source["train"][1]) if i not in held)
    kept = collections.Counter(label - 1 for *_, label, _ in train)
    for c in range(10):
        assert abs(kept[c] - rest[c] * 100 / 250) < 1, (c, kept[c], rest[c])
    too_many = convert_cli("idx", tmp_path / "idx", tmp_path / "out2", "--validation_examples=50", "--train_examples=251")
    assert too_many.returncode == 1 and "train_examples=251 must be in [1, 250]" in too_many.stderr


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_pickles_to_shards_are_bytes_exact(tmp_path, hundred):
    source = make_cifar_dir(tmp_path / "cifar", hundred=hundred)
    result = convert_cli("cifar", tmp_path / "cifar", tmp_path / "out", "--validation_examples=20")
    assert result.returncode == 0, result.stderr[-3000:]
    for split in ("train", "validation", "test"):
        records = read_split(tmp_path / "out", split)
        assert_exact(records, source, source["classes"])
        assert all(pixels.shape == (32, 32, 3) for _, _, pixels, _, _ in records)
    assert json.load(open(tmp_path / "out" / "manifest-test.json"))["num_classes"] == (100 if hundred else 10)


class RunsCode:
    """What a crafted pickle can hold: an object whose unpickling calls any function with any arguments."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_cifar_batch_that_would_run_code_is_refused_before_it_runs(tmp_path):
    make_cifar_dir(tmp_path / "cifar")
    crafted, marker = tmp_path / "cifar" / "data_batch_1", tmp_path / "marker"
    rows = np.zeros((40, 3072), np.uint8)
    # A batch in the real format, but one entry runs a shell command when loaded.
    pickle_like_python2(crafted, {"data": rows, "labels": [0] * 40, "batch_label": RunsCode(f"touch {marker}")})

    result = convert_cli("cifar", tmp_path / "cifar", tmp_path / "out")
    assert not marker.exists()
    assert result.returncode == 1
    assert f"{crafted} is not a CIFAR python batch, refused: it references posix.system" in result.stderr
    assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "out" / "manifest-train.json")
    with open(crafted, "rb") as f:  # the premise: the file does run code when loaded as pickle.load loads it
        pickle.load(f, encoding="bytes")
    assert marker.exists()


def test_cifar_batches_load_numeric_arrays_only(tmp_path):
    # Batches pickled by Python 3 (numpy 2's module names, bytes keys) load as the originals do.
    source = make_cifar_dir(tmp_path / "py3", dump=lambda path, obj: pickle.dump(obj, open(path, "wb")))
    loaded = arrays.load_cifar(str(tmp_path / "py3"))
    assert np.array_equal(loaded["train"][0], source["train"][0]) and loaded["classes"] == source["classes"]
    # An array of Python objects would unpickle its elements: refused even when they are harmless.
    make_cifar_dir(tmp_path / "objects")
    pickle_like_python2(tmp_path / "objects" / "test_batch", {"data": np.array([1, "x"], dtype=object), "labels": [0]})
    with pytest.raises(ValueError, match=f"{tmp_path / 'objects' / 'test_batch'} is not a CIFAR python batch, "
                                         "refused: an array of Python objects"):
        arrays.load_cifar(str(tmp_path / "objects"))
    with open(tmp_path / "objects" / "test_batch", "wb") as f:
        f.write(b"\x80\x02}q\x00(U\x04data")  # cut short
    with pytest.raises(ValueError, match="test_batch is not a CIFAR python batch"):
        arrays.load_cifar(str(tmp_path / "objects"))


def test_fashion_mnist_names_its_classes(tmp_path):
    make_idx_dir(tmp_path / "fashion-mnist")
    arrays.convert_arrays("idx", str(tmp_path / "fashion-mnist"), str(tmp_path / "out"), validation_examples=10,
                          num_shards=1)
    assert json.load(open(tmp_path / "out" / "manifest-train.json"))["classes"][9] == "Ankle boot"


def test_bad_input_names_the_file(tmp_path):
    make_idx_dir(tmp_path / "idx")
    broken = tmp_path / "idx" / "train-labels-idx1-ubyte.gz"
    broken.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x01\x2c" + b"\x01" * 10))  # says 300, holds 10
    result = convert_cli("idx", tmp_path / "idx", tmp_path / "out")
    assert result.returncode == 1
    assert f"{broken}: IDX header says shape (300,)" in result.stderr
    assert not os.path.exists(tmp_path / "out" / "manifest-train.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = convert_cli("cifar", empty, tmp_path / "out")
    assert result.returncode == 1 and "holds neither CIFAR-10" in result.stderr
    assert "--split" in convert_cli("idx", tmp_path / "idx", tmp_path / "out", "--split=train").stderr


def test_converted_idx_trains_through_the_cli(tmp_path):
    # The user's path: their IDX files -> shards -> a short run that reads the PNG records.
    make_idx_dir(tmp_path / "idx", n_train=320, n_test=64)
    assert convert_cli("idx", tmp_path / "idx", tmp_path / "shards", "--validation_examples=64").returncode == 0
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.train", "--config=configs/digits.py", f"--workdir={tmp_path / 'run'}",
         f"--config.data.data_dir={tmp_path / 'shards'}", "--config.data.image_size=28",
         "--config.data.num_train_examples=256", "--config.data.num_eval_examples=64", "--config.train.epochs=1",
         "--config.model.name=cifar_resnet8", "--config.data.eval_split=test", "--config.train.eval_every_epochs=1",
         "--config.schedule.warmup_epochs=0.5", "--config.data.global_batch_size=32"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "run" / layout.SUMMARY))
    assert summary["steps"] == 8 and 0.0 <= summary["eval_top1"] <= 1.0
    # A config that disagrees with what was converted stops on one line naming key, value and manifest.
    wrong = subprocess.run(
        [sys.executable, "-m", "tfscale.train", "--config=configs/fmnist_resnet.py", f"--workdir={tmp_path / 'bad'}",
         f"--config.data.data_dir={tmp_path / 'shards'}", "--config.data.num_train_examples=320"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1
    assert wrong.stderr.strip().splitlines()[-1] == (
        f"FATAL config error: config.data.num_train_examples=320 but {tmp_path / 'shards' / 'manifest-train.json'} "
        "says 256")


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST_DIR),
                    reason=f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist (make fashion-mnist)")
def test_real_fashion_mnist(tmp_path):
    result = convert_cli("idx", FASHION_MNIST_DIR, tmp_path / "out", "--num_shards=8")
    assert result.returncode == 0, result.stderr[-3000:]
    manifests = {s: json.load(open(tmp_path / "out" / f"manifest-{s}.json")) for s in ("train", "validation", "test")}
    assert [manifests[s]["num_examples"] for s in ("train", "validation", "test")] == [55_000, 5_000, 10_000]
    assert manifests["train"]["classes"][0] == "T-shirt/top"
    source = arrays.load_idx(FASHION_MNIST_DIR)
    sample = read_split(tmp_path / "out", "test")[:500]
    assert_exact(sample, {"test": source["test"]}, source["classes"])
