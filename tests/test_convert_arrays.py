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

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, quiet_env
from helpers.cli_batch import run_batch

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


def convert_command(fmt, input_dir, output_dir, *extra):
    """`python -m tfscale.data.convert ...` (the arguments after `python`), for run_batch."""
    return ["-m", "tfscale.data.convert", f"--format={fmt}", f"--input_dir={input_dir}", f"--output_dir={output_dir}",
            *extra]


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


class RunsCode:
    """What a crafted pickle can hold: an object whose unpickling calls any function with any arguments."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


# --- the command lines, run once for the whole module ------------------------------------------------------------
# Each scenario writes its inputs under its own root and returns (what its test compares against, its command
# lines). Every command runs as `python -m tfscale.data.convert ...` (or `tfscale.train`), its own process with
# its own exit code and output, forked from one process per batch that imported the modules once
# (tests/helpers/cli_batch.py): a conversion here costs ~0.3 s, TensorFlow's import ~2 s.


def _idx_exact(root, compress):
    source = make_idx_dir(root / "idx", compress=compress)
    return source, [convert_command("idx", root / "idx", root / "out", "--validation_examples=50", "--num_shards=4")]


def _seeded(root):
    make_idx_dir(root / "idx")
    return None, [convert_command("idx", root / "idx", root / f"out{i}", "--validation_examples=30", f"--seed={seed}")
                  for i, seed in enumerate((0, 0, 1))]


def _train_examples(root):
    source = make_idx_dir(root / "idx")
    return source, [convert_command("idx", root / "idx", root / "out", "--validation_examples=50",
                                    "--train_examples=100"),
                    convert_command("idx", root / "idx", root / "out2", "--validation_examples=50",
                                    "--train_examples=251")]


def _cifar_exact(root, hundred):
    source = make_cifar_dir(root / "cifar", hundred=hundred)
    return source, [convert_command("cifar", root / "cifar", root / "out", "--validation_examples=20")]


def _cifar_runs_code(root):
    make_cifar_dir(root / "cifar")
    crafted, marker = root / "cifar" / "data_batch_1", root / "marker"
    rows = np.zeros((40, 3072), np.uint8)
    # A batch in the real format, but one entry runs a shell command when loaded.
    pickle_like_python2(crafted, {"data": rows, "labels": [0] * 40, "batch_label": RunsCode(f"touch {marker}")})
    return (crafted, marker), [convert_command("cifar", root / "cifar", root / "out")]


def _bad_input(root):
    make_idx_dir(root / "idx")
    broken = root / "idx" / "train-labels-idx1-ubyte.gz"
    broken.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x01\x2c" + b"\x01" * 10))  # says 300, holds 10
    empty = root / "empty"
    empty.mkdir()
    return (broken, empty), [convert_command("idx", root / "idx", root / "out"),
                             convert_command("cifar", empty, root / "out"),
                             convert_command("idx", root / "idx", root / "out", "--split=train")]


def _idx_to_train(root):
    # The user's path: their IDX files -> shards -> a short run that reads the PNG records (the runs: TRAIN_RUNS).
    make_idx_dir(root / "idx", n_train=320, n_test=64)
    return None, [convert_command("idx", root / "idx", root / "shards", "--validation_examples=64")]


def _real_fashion_mnist(root):
    return None, [convert_command("idx", FASHION_MNIST_DIR, root / "out", "--num_shards=8")]


SCENARIOS = {
    "idx_gz": lambda root: _idx_exact(root, compress=True),
    "idx_raw": lambda root: _idx_exact(root, compress=False),
    "seeded": _seeded,
    "train_examples": _train_examples,
    "cifar10": lambda root: _cifar_exact(root, hundred=False),
    "cifar100": lambda root: _cifar_exact(root, hundred=True),
    "cifar_runs_code": _cifar_runs_code,
    "bad_input": _bad_input,
    "idx_to_train": _idx_to_train,
    **({"real_fashion_mnist": _real_fashion_mnist} if os.path.isdir(FASHION_MNIST_DIR) else {}),
}
# What `python -m tfscale.data.convert` imports by the time it writes shards (TensorFlow and PIL lazily).
CONVERT_MODULES = ["tfscale.data.convert.convert", "tensorflow", "PIL.Image"]


def train_runs(root):
    """The two training command lines on the converted IDX shards of scenario idx_to_train (in `root`)."""
    return [
        ["-m", "tfscale.train", "--config=configs/digits.py", f"--workdir={root / 'run'}",
         f"--config.data.data_dir={root / 'shards'}", "--config.data.image_size=28",
         "--config.data.num_train_examples=256", "--config.data.num_eval_examples=64", "--config.train.epochs=1",
         "--config.model.name=cifar_resnet8", "--config.data.eval_split=test", "--config.train.eval_every_epochs=1",
         "--config.schedule.warmup_epochs=0.5", "--config.data.global_batch_size=32"],
        # A config that disagrees with what was converted.
        ["-m", "tfscale.train", "--config=configs/fmnist_resnet.py", f"--workdir={root / 'bad'}",
         f"--config.data.data_dir={root / 'shards'}", "--config.data.num_train_examples=320"],
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{scenario: (its root, what it compares against, [CompletedProcess of each command line])}; the
    training runs (after every conversion) under "trains"."""
    prepared, commands = {}, []
    for name, scenario in SCENARIOS.items():
        root = tmp_path_factory.mktemp(name)
        expected, scenario_commands = scenario(root)
        prepared[name] = (root, expected, len(commands), len(commands) + len(scenario_commands))
        commands += scenario_commands
    results = run_batch(commands, preload=CONVERT_MODULES, cwd=REPO, env=quiet_env(), timeout_s=900)
    found = {name: (root, expected, results[start:end]) for name, (root, expected, start, end) in prepared.items()}
    root = prepared["idx_to_train"][0]
    if results[prepared["idx_to_train"][2]].returncode == 0:  # its test says why not, otherwise
        found["trains"] = (root, None, run_batch(train_runs(root), preload=["tfscale.training.train"], cwd=REPO,
                                                 env=quiet_env(), timeout_s=600))
    return found


@pytest.mark.parametrize("compress", [True, False])
def test_idx_to_shards_is_bytes_exact_with_a_stratified_validation_split(runs, compress):
    root, source, (result,) = runs["idx_gz" if compress else "idx_raw"]
    assert result.returncode == 0, result.stderr[-3000:]
    classes = [str(i) for i in range(10)]
    train, validation, test = (read_split(root / "out", s) for s in ("train", "validation", "test"))
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
    manifests = {s: json.load(open(root / "out" / f"manifest-{s}.json")) for s in ("train", "validation", "test")}
    assert [manifests[s]["num_examples"] for s in ("train", "validation", "test")] == [250, 50, 60]
    assert manifests["train"]["num_shards"] == 4 and manifests["train"]["image_format"] == "png"
    assert manifests["test"]["classes"] == classes


def test_the_split_is_seeded(runs):
    root, _, results = runs["seeded"]
    held = []
    for result in results:  # seeds 0, 0, 1
        assert result.returncode == 0
        held.append(sorted(i for _, i, *_ in read_split(root / f"out{len(held)}", "validation")))
    assert held[0] == held[1] != held[2]


def test_train_examples_keeps_a_stratified_seeded_subset_of_the_rest(runs):
    root, source, (result, too_many) = runs["train_examples"]
    assert result.returncode == 0, result.stderr[-3000:]
    train, validation = read_split(root / "out", "train"), read_split(root / "out", "validation")
    assert_exact(train, source, [str(i) for i in range(10)])
    assert len(train) == 100 and len(validation) == 50
    assert not {i for _, i, *_ in train} & {i for _, i, *_ in validation}
    assert json.load(open(root / "out" / "manifest-train.json"))["num_examples"] == 100
    # Stratified: each class's share of the 100 is its share of the 250 left after the holdout, to one image.
    held = {i for _, i, *_ in validation}
    rest = collections.Counter(int(label) for i, label in enumerate(source["train"][1]) if i not in held)
    kept = collections.Counter(label - 1 for *_, label, _ in train)
    for c in range(10):
        assert abs(kept[c] - rest[c] * 100 / 250) < 1, (c, kept[c], rest[c])
    assert too_many.returncode == 1 and "train_examples=251 must be in [1, 250]" in too_many.stderr


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_pickles_to_shards_are_bytes_exact(runs, hundred):
    root, source, (result,) = runs["cifar100" if hundred else "cifar10"]
    assert result.returncode == 0, result.stderr[-3000:]
    for split in ("train", "validation", "test"):
        records = read_split(root / "out", split)
        assert_exact(records, source, source["classes"])
        assert all(pixels.shape == (32, 32, 3) for _, _, pixels, _, _ in records)
    assert json.load(open(root / "out" / "manifest-test.json"))["num_classes"] == (100 if hundred else 10)


def test_a_cifar_batch_that_would_run_code_is_refused_before_it_runs(runs):
    root, (crafted, marker), (result,) = runs["cifar_runs_code"]
    assert not marker.exists()
    assert result.returncode == 1
    assert f"{crafted} is not a CIFAR python batch, refused: it references posix.system" in result.stderr
    assert "Traceback" not in result.stderr and not os.path.exists(root / "out" / "manifest-train.json")
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


def test_bad_input_names_the_file(runs):
    root, (broken, empty), (result, not_cifar, split_flag) = runs["bad_input"]
    assert result.returncode == 1
    assert f"{broken}: IDX header says shape (300,)" in result.stderr
    assert not os.path.exists(root / "out" / "manifest-train.json")
    assert not_cifar.returncode == 1 and "holds neither CIFAR-10" in not_cifar.stderr
    assert "--split" in split_flag.stderr


def test_converted_idx_trains_through_the_cli(runs):
    # The user's path: their IDX files -> shards -> a short run that reads the PNG records.
    root, _, (converted,) = runs["idx_to_train"]
    assert converted.returncode == 0, converted.stderr[-3000:]
    _, _, (result, wrong) = runs["trains"]
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(root / "run" / layout.SUMMARY))
    assert summary["steps"] == 8 and 0.0 <= summary["eval_top1"] <= 1.0
    # A config that disagrees with what was converted stops on one line naming key, value and manifest.
    assert wrong.returncode == 1
    assert wrong.stderr.strip().splitlines()[-1] == (
        f"FATAL config error: config.data.num_train_examples=320 but {root / 'shards' / 'manifest-train.json'} "
        "says 256")


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST_DIR),
                    reason=f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist (make fashion-mnist)")
def test_real_fashion_mnist(runs):
    root, _, (result,) = runs["real_fashion_mnist"]
    assert result.returncode == 0, result.stderr[-3000:]
    manifests = {s: json.load(open(root / "out" / f"manifest-{s}.json")) for s in ("train", "validation", "test")}
    assert [manifests[s]["num_examples"] for s in ("train", "validation", "test")] == [55_000, 5_000, 10_000]
    assert manifests["train"]["classes"][0] == "T-shirt/top"
    source = arrays.load_idx(FASHION_MNIST_DIR)
    sample = read_split(root / "out", "test")[:500]
    assert_exact(sample, {"test": source["test"]}, source["classes"])
