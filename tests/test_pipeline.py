"""tfscale.data.input.pipeline end to end: real JPEG shards -> per-worker tf.data input, as training reads it.

Workers are not processes here: each worker's dataset is built by calling the input function with the
`tf.distribute.InputContext` that `strategy.distribute_datasets_from_function` would hand it. Examples
are identified by their pixels (random-noise JPEGs, every one different): the pipeline with
augment="none" at the source size must give back exactly `tf.io.decode_jpeg` of the original bytes.
"""

import collections
import hashlib
import io
import math
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from conftest import classic_example, load_config  # noqa: E402
from PIL import Image  # noqa: E402

from tfscale.config import validation  # noqa: E402
from tfscale.config import ConfigError, base_config  # noqa: E402
from tfscale.data.convert import convert
from tfscale.data.input import assignment, faults, pipeline, shard_dir
from tfscale.data.stage import prepare, stage  # noqa: E402

SIZE_PX = 32  # every image of the converted trees is SIZE_PX x SIZE_PX
CLASSES = ("cherry", "apple", "banana")  # written unsorted on purpose: labels follow sorted names
TRAIN_PER_CLASS = (11, 10, 10)  # 31 train images: 6 shards of 5 or 6, 2 shards of 15 or 16
EVAL_PER_CLASS = (9, 8, 8)  # 25 eval images: no eval batch size used below divides it


# --------------------------------------------------------------------------------------- helpers


def context(workers=1, rank=0, local_replicas=1):
    """What distribute_datasets_from_function passes worker `rank` of `workers`."""
    return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=rank,
                                      num_replicas_in_sync=workers * local_replicas)


def digest(image) -> str:
    image = np.asarray(image)
    assert image.dtype == np.uint8
    return hashlib.sha1(image.tobytes() + str(image.shape).encode()).hexdigest()


def jpeg_bytes(pixels: np.ndarray, quality: int = 90) -> bytes:
    """Pillow's default: a baseline (sequential) RGB JPEG."""
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "JPEG", quality=quality)
    return out.getvalue()


def write_tree(root: str, per_class, seed: int) -> dict[str, bytes]:
    """root/<class>/<class>_NN.jpg of random noise; {file name: JPEG bytes}."""
    rng = np.random.default_rng(seed)
    files = {}
    for name, count in zip(CLASSES, per_class):
        os.makedirs(os.path.join(root, name))
        for i in range(count):
            fname = f"{name}_{i:02d}.jpg"
            data = jpeg_bytes(rng.integers(0, 256, (SIZE_PX, SIZE_PX, 3), dtype=np.uint8))
            with open(os.path.join(root, name, fname), "wb") as f:
                f.write(data)
            files[fname] = data
    return files


def originals(files: dict[str, bytes]) -> dict[str, tuple[str, int]]:
    """{digest of tf.io.decode_jpeg(file bytes): (file name, 0-based sorted class index)}."""
    classes = sorted(CLASSES)
    table = {}
    for fname, data in files.items():
        key = digest(tf.io.decode_jpeg(data).numpy())
        assert key not in table, "test images must all differ"
        table[key] = (fname, classes.index(fname.split("_")[0]))
    return table


def data_config(data_dir: str, **overrides):
    """base_config().data for the converted trees; overrides as keyword arguments."""
    d = base_config().data
    d.dataset = "tfrecord"
    d.data_dir = data_dir
    d.augment = "none"
    d.image_size = SIZE_PX
    d.num_classes = len(CLASSES)
    d.label_offset = 1
    d.num_train_examples = sum(TRAIN_PER_CLASS)
    d.num_eval_examples = sum(EVAL_PER_CLASS)
    d.global_batch_size = 4
    d.shuffle_buffer = 16
    d.interleave_cycle = 4
    for key, value in overrides.items():
        d[key] = value
    return d


def eval_batches(cfg, *, global_batch_size: int, num_steps: int, ctx=None):
    ds = pipeline.eval_input_fn(cfg, seed=0, global_batch_size=global_batch_size, num_steps=num_steps)(
        ctx or context())
    return list(ds.as_numpy_iterator())


def masked_examples(batches):
    """[(digest, label)] of the examples with mask 1, in order."""
    out = []
    for images, labels, masks in batches:
        for image, label, mask in zip(images, labels, masks):
            assert mask in (0.0, 1.0)
            if mask == 1.0:
                out.append((digest(image), int(label)))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Class trees of real JPEGs converted by tfscale's converter, once for the module.

    six/: train in 6 shards (file-level sharding over 3 workers) + validation in 3 shards.
    two/: train in 2 shards (fewer files than 3 workers: example-level sharding).
    """
    root = tmp_path_factory.mktemp("pipeline")
    train_files = write_tree(str(root / "train_images"), TRAIN_PER_CLASS, seed=1)
    eval_files = write_tree(str(root / "eval_images"), EVAL_PER_CLASS, seed=2)
    six, two = str(root / "six"), str(root / "two")
    manifests = {
        ("six", "train"): convert.convert(str(root / "train_images"), six, "train", 6, num_workers=1),
        ("six", "validation"): convert.convert(str(root / "eval_images"), six, "validation", 3, num_workers=1),
        ("two", "train"): convert.convert(str(root / "train_images"), two, "train", 2, num_workers=1),
    }
    return dict(root=root, six=six, two=two, manifests=manifests, train_files=train_files, eval_files=eval_files,
                train=originals(train_files), eval=originals(eval_files))


# ------------------------------------------------------------------------- 1. lossless round trip


def test_round_trip_is_lossless_with_sorted_class_labels(data):
    """Folder of baseline JPEGs -> convert -> eval input: the decoded original pixels, exactly."""
    n = len(data["eval_files"])
    batch = 5  # divides 25: no padding, every mask is 1
    batches = eval_batches(data_config(data["six"]), global_batch_size=batch, num_steps=n // batch)
    assert len(batches) == n // batch
    seen = []
    for images, labels, masks in batches:
        assert images.dtype == np.uint8 and images.shape == (batch, SIZE_PX, SIZE_PX, 3)
        assert labels.dtype == np.int32
        np.testing.assert_array_equal(masks, np.ones(batch))
        for image, label in zip(images, labels):
            key = digest(image)
            assert key in data["eval"], "an output image differs from decode_jpeg(original bytes)"
            fname, expected_label = data["eval"][key]
            assert label == expected_label, fname  # 0-based index in sorted class names
            seen.append(fname)
    assert sorted(seen) == sorted(data["eval_files"])  # each image once, none missing

    # Eval order is deterministic: a second pass gives the same sequence.
    again = eval_batches(data_config(data["six"]), global_batch_size=batch, num_steps=n // batch)
    assert masked_examples(again) == masked_examples(batches)


# --------------------------------------------------------------- 2. classic build_imagenet_data shards

CLASSIC_COLOURS = np.array([[220, 30, 30], [30, 200, 40], [40, 40, 220], [230, 220, 40]])  # label 1..4


@pytest.fixture(scope="module")
def classic_dir(tmp_path_factory):
    """Shards as build_imagenet_data.py writes them (1-based labels 1..4, no manifest); {split: labels}."""
    out = str(tmp_path_factory.mktemp("classic"))
    rng = np.random.default_rng(3)
    labels = {"train": [], "validation": []}
    layout = {"train": (2, 12), "validation": (1, 7)}  # (shards, examples)
    for split, (num_shards, count) in layout.items():
        writers = [tf.io.TFRecordWriter(os.path.join(out, f"{split}-{s:05d}-of-{num_shards:05d}"))
                   for s in range(num_shards)]
        for i in range(count):
            label = 1 + i % 4
            height, width = (30, 44) if i % 2 else (40, 30)  # not square: crops matter
            pixels = CLASSIC_COLOURS[label - 1] + rng.integers(-12, 13, (height, width, 3))
            jpeg = jpeg_bytes(np.clip(pixels, 0, 255).astype(np.uint8))
            writers[i % num_shards].write(
                classic_example(jpeg, height, width, label, f"n0000000{label}", f"{split}_{i}.JPEG",
                                boxes=[(0.1 * k, 0.2, 0.5 + 0.1 * k, 0.9) for k in range(i % 3)]))
            labels[split].append(label - 1)
        for w in writers:
            w.close()
    assert not any(name.endswith("manifest.json") for name in os.listdir(out))
    return out, labels


def colour_class(images: np.ndarray) -> np.ndarray:
    """Class of each image by its mean colour (robust to crop, resize, flip and JPEG error)."""
    means = images.reshape(len(images), -1, 3).mean(axis=1)
    return np.argmin(((means[:, None, :] - CLASSIC_COLOURS[None]) ** 2).sum(-1), axis=1)


def classic_config(classic, **overrides):
    settings = dict(augment="imagenet", image_size=24, num_classes=4, num_train_examples=12, num_eval_examples=7)
    return data_config(classic, **{**settings, **overrides})


def test_classic_build_imagenet_data_shards_load_unchanged(classic_dir):
    out, labels = classic_dir
    cfg = classic_config(out, global_batch_size=4, shuffle_buffer=8)
    ds = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    for images, batch_labels in ds.take(6).as_numpy_iterator():  # 24 examples: two passes of 12
        assert images.dtype == np.uint8 and images.shape == (4, 24, 24, 3)
        assert batch_labels.dtype == np.int32 and batch_labels.shape == (4,)
        np.testing.assert_array_equal(batch_labels, colour_class(images))  # stored label - 1

    n = len(labels["validation"])
    batches = eval_batches(cfg, global_batch_size=3, num_steps=math.ceil(n / 3))
    assert len(batches) == 3
    got = []
    for images, batch_labels, masks in batches:
        assert images.dtype == np.uint8 and images.shape == (3, 24, 24, 3)
        real = masks == 1
        np.testing.assert_array_equal(batch_labels[real], colour_class(images[real]))
        got += list(batch_labels[real])
    assert sorted(got) == sorted(labels["validation"])


# --------------------------------------------------------------------- 3. assignment through the pipeline


def shard_counts(manifest) -> list[int]:
    return [s["num_examples"] for s in manifest["shards"]]


def examples_assigned(counts: list[int], rank: int, workers: int, scheme: str, copies: int, level="auto") -> int:
    """Records worker `rank` reads in one pass over its share, from the manifest's shard sizes."""
    if assignment.shard_level(len(counts), workers, level) == "file":
        mine = assignment.assign(len(counts), rank=rank, num_workers=workers, scheme=scheme, copies=copies)
        return sum(counts[i] for i in mine)
    return sum(bool(assignment.worker_keeps(i, rank=rank, num_workers=workers, scheme=scheme, copies=copies))
               for i in range(sum(counts)))


@pytest.mark.parametrize("level,layout", [("file", "six"), ("example", "two"), ("example", "six")])
@pytest.mark.parametrize("scheme,copies,expected_readers", [
    ("disjoint", 1, 1), ("overlap", 2, 2), ("full", 3, 3), ("medium_coarse", 2, 2), ("fine_grained", 2, 2)])
def test_assignment_schemes_through_the_pipeline(data, level, layout, scheme, copies, expected_readers):
    workers = 3
    data_dir = data[layout]
    counts = shard_counts(data["manifests"][(layout, "train")])
    # Six files for 3 workers are assigned whole unless config.data.assignment_level asks for examples.
    assert assignment.shard_level(len(counts), workers, level) == level
    # One pass = exactly the assigned number of records: read files one at a time (interleave_cycle=1),
    # without shuffle buffer and in a deterministic order, so nothing of the 2nd pass comes earlier.
    cfg = data_config(data_dir, assignment=scheme, copies=copies, interleave_cycle=1, cache=False,
                      shuffle_buffer=1, deterministic=True, global_batch_size=workers,  # 1 per replica
                      assignment_level=level)
    readers = collections.defaultdict(list)
    for rank in range(workers):
        n = examples_assigned(counts, rank, workers, scheme, copies, level)
        ds = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context(workers, rank))
        got = []
        for images, labels in ds.take(n).as_numpy_iterator():
            key = digest(images[0])
            assert key in data["train"]
            assert labels[0] == data["train"][key][1]
            got.append(key)
        assert len(set(got)) == n, f"worker {rank} saw an example twice within one pass"
        for key in got:
            readers[key].append(rank)
    assert set(readers) == set(data["train"]), "some training examples are read by no worker"
    assert {len(r) for r in readers.values()} == {expected_readers}
    if scheme == "full":
        assert all(r == [0, 1, 2] for r in readers.values())


# -------------------------------------------------------------------- 4. eval exact under multi-worker


@pytest.mark.parametrize("workers,local_replicas,global_batch", [
    (1, 1, 2), (2, 1, 4), (3, 1, 6), (1, 2, 4), (2, 2, 4), (3, 2, 6), (3, 1, 9),
])
def test_eval_reads_every_example_exactly_once_over_workers(data, workers, local_replicas, global_batch):
    n = len(data["eval_files"])
    assert n % global_batch
    num_steps = math.ceil(n / global_batch)
    per_replica = global_batch // (workers * local_replicas)
    cfg = data_config(data["six"])
    union = []
    for rank in range(workers):
        batches = eval_batches(cfg, global_batch_size=global_batch, num_steps=num_steps,
                               ctx=context(workers, rank, local_replicas))
        # Same number of batches on every worker: no replica waits for a batch that never comes.
        assert len(batches) == num_steps * local_replicas
        for images, labels, masks in batches:
            assert images.shape == (per_replica, SIZE_PX, SIZE_PX, 3) and masks.shape == (per_replica,)
        mine = masked_examples(batches)
        assert len(mine) in (n // workers, -(-n // workers))  # the work is balanced
        union += mine
    counts = collections.Counter(key for key, _ in union)
    assert set(counts) == set(data["eval"]) and set(counts.values()) == {1}
    for key, label in union:
        assert label == data["eval"][key][1]


# ---------------------------------------------------------------------------------------- 5. errors


def test_missing_data_dir_is_named(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"data_dir.*nowhere"):
        shard_dir.list_shards(missing, "train")
    cfg = data_config(missing)
    with pytest.raises(FileNotFoundError, match=r"data_dir.*nowhere"):
        prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25)


def test_no_shards_for_the_split_is_named(data):
    with pytest.raises(FileNotFoundError, match=r"test-\*-of-\*.*six"):
        shard_dir.list_shards(data["six"], "test")
    cfg = data_config(data["six"], eval_split="val")
    with pytest.raises(FileNotFoundError, match=r"val-\*-of-\*"):
        prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25)
    with pytest.raises(FileNotFoundError, match=r"val-\*-of-\*"):
        eval_batches(cfg, global_batch_size=5, num_steps=5)


def test_truncated_shard_with_manifest_is_named(data, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(data["six"], copy)
    victim = os.path.join(copy, "train-00002-of-00006")
    os.truncate(victim, os.path.getsize(victim) - 100)
    cfg = data_config(copy)
    with pytest.raises(ValueError, match="train-00002-of-00006") as err:
        prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25)
    assert "truncated" in str(err.value)


@pytest.mark.parametrize("key,value,theirs", [
    ("num_classes", 5, 3), ("label_offset", 0, 1), ("num_train_examples", 30, 31), ("num_eval_examples", 26, 25),
])
def test_manifest_mismatch_names_key_and_both_values(data, key, value, theirs):
    cfg = data_config(data["six"], **{key: value})
    with pytest.raises(ValueError) as err:
        prepare.prepare_data_dir(cfg, num_train_examples=cfg.num_train_examples,
                                   num_eval_examples=cfg.num_eval_examples)
    message = str(err.value)
    split = "validation" if key == "num_eval_examples" else "train"
    assert f"config.data.{key}={value}" in message and f"says {theirs}" in message
    assert os.path.join(data["six"], f"manifest-{split}.json") in message


def test_wrong_label_offset_without_manifest_fails_on_read(classic_dir):
    out, _ = classic_dir
    cfg = classic_config(out, label_offset=2)  # labels are 1-based: label 1 becomes -1
    prepare.prepare_data_dir(cfg, num_train_examples=12, num_eval_examples=7)  # no manifest: nothing to check
    train = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    with pytest.raises(tf.errors.InvalidArgumentError, match="label_offset"):
        list(train.take(6).as_numpy_iterator())
    with pytest.raises(tf.errors.InvalidArgumentError, match="label_offset"):
        eval_batches(cfg, global_batch_size=7, num_steps=1)


def test_too_few_classes_fails_on_read(classic_dir):
    out, _ = classic_dir
    cfg = classic_config(out, num_classes=3)  # labels 1..4 minus 1 reach 3
    train = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_classes=3"):
        list(train.take(6).as_numpy_iterator())
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_classes=3"):
        eval_batches(cfg, global_batch_size=7, num_steps=1)


@pytest.fixture
def truncated_classic(classic_dir, tmp_path):
    """A copy of the classic shards (no manifest) whose validation shard lost its second half."""
    out, _ = classic_dir
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    victim = os.path.join(copy, "validation-00000-of-00001")
    os.truncate(victim, os.path.getsize(victim) // 2)
    return copy


def test_truncated_shard_without_manifest_is_an_error(truncated_classic):
    """No manifest, so nothing checks sizes up front: reading must still fail, never stop early quietly."""
    cfg = classic_config(truncated_classic)
    prepare.prepare_data_dir(cfg, num_train_examples=12, num_eval_examples=7)  # passes: nothing to compare with
    with pytest.raises(tf.errors.DataLossError, match="truncated record"):
        eval_batches(cfg, global_batch_size=7, num_steps=1)


def test_truncated_shard_is_named_when_found(truncated_classic, classic_dir):
    """tf.data reports only a byte offset; tfscale's scan names the shard (training does this on error)."""
    bad = faults.truncated_shards(shard_dir.list_shards(truncated_classic, "validation"))
    assert len(bad) == 1 and "validation-00000-of-00001" in bad[0] and "runs past the end" in bad[0]
    assert faults.truncated_shards(shard_dir.list_shards(classic_dir[0], "validation")) == []
    cfg = classic_config(truncated_classic)
    with pytest.raises(tf.errors.DataLossError) as err:
        eval_batches(cfg, global_batch_size=7, num_steps=1)
    explained = pipeline.explain_read_error(err.value, cfg, truncated_classic, "validation", rank=0, num_workers=1)
    assert isinstance(explained, faults.CorruptDataError)
    assert "validation-00000-of-00001" in str(explained) and "truncated record" in str(explained)


# ------------------------------------------------------------------------------------------ 6. staging


def test_prepare_data_dir_stages_once(data, tmp_path):
    local = str(tmp_path / "local")
    cfg = data_config(data["six"], stage_dir=local)
    staged = prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25)
    assert staged == local
    expected = sorted(n for n in os.listdir(data["six"]) if "-of-" in n or n.startswith("manifest-"))
    assert len(expected) == 6 + 3 + 2
    assert sorted(n for n in os.listdir(local) if not n.startswith(".")) == expected
    for name in expected:
        with open(os.path.join(local, name), "rb") as a, open(os.path.join(data["six"], name), "rb") as b:
            assert a.read() == b.read(), name

    def fingerprint():
        return {n: (os.stat(os.path.join(local, n)).st_ino, os.stat(os.path.join(local, n)).st_mtime_ns)
                for n in expected}

    before = fingerprint()
    assert prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25) == local
    assert fingerprint() == before  # nothing copied (a copy is a new file renamed into place)

    # and the staged copy is what the input functions read
    batches = eval_batches(data_config(staged), global_batch_size=5, num_steps=5)
    assert sorted(k for k, _ in masked_examples(batches)) == sorted(data["eval"])


def test_truncated_source_is_not_staged(data, tmp_path):
    copy = str(tmp_path / "shared")
    shutil.copytree(data["six"], copy)
    victim = os.path.join(copy, "validation-00001-of-00003")
    os.truncate(victim, os.path.getsize(victim) - 10)
    local = str(tmp_path / "local")
    cfg = data_config(copy, stage_dir=local)
    with pytest.raises(stage.StageError, match="validation-00001-of-00003.*truncated"):
        prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25)
    assert not os.path.exists(os.path.join(local, "validation-00001-of-00003"))
    assert not os.path.exists(os.path.join(local, "manifest-validation.json"))


@pytest.fixture(scope="module")
def eight(data):
    """The train images in 8 shards, validation in 3: 4 workers read whole train files."""
    out = str(data["root"] / "eight")
    manifest = convert.convert(str(data["root"] / "train_images"), out, "train", 8, num_workers=1)
    convert.convert(str(data["root"] / "eval_images"), out, "validation", 3, num_workers=1)
    return out, manifest


def first_examples(data_dir, rank, workers, n, **overrides):
    """Digests of the first n training examples worker `rank` reads, in order."""
    cfg = data_config(data_dir, **overrides)
    ds = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context(workers, rank))
    return [digest(images[0]) for images, _ in ds.take(n).as_numpy_iterator()]


@pytest.mark.parametrize("scheme,copies,tasks_per_node", [("disjoint", 1, 2), ("overlap", 2, 1)])
def test_a_nodes_partial_copy_trains_like_the_full_dir(data, eight, tmp_path, scheme, copies, tasks_per_node):
    """4 workers, T per node: each node stages its workers' train shards; they read exactly what they
    would read from the full directory, and a worker of another node is told what is missing.
    (overlap with 2 copies: a node of workers 0 and 1 would need every shard, so one worker per node.)"""
    src, manifest = eight
    workers = 4
    # Whole passes in a fixed order (as in the assignment test), one example per replica.
    reading = dict(assignment=scheme, copies=copies, interleave_cycle=1, cache=False, shuffle_buffer=1,
                   deterministic=True, global_batch_size=workers)
    for node in range(2):
        ranks = tuple(range(node * tasks_per_node, (node + 1) * tasks_per_node))
        local = str(tmp_path / f"node{node}")
        staged = prepare.prepare_data_dir(data_config(src, stage_dir=local, **reading), num_train_examples=31,
                                            num_eval_examples=25, worker_ranks=ranks, num_workers=workers)
        assert staged == local
        want = {f"train-{i:05d}-of-00008" for rank in ranks
                for i in assignment.assign(8, rank=rank, num_workers=workers, scheme=scheme, copies=copies)}
        assert {n for n in os.listdir(local) if n.startswith("train-")} == want and len(want) < 8
        for rank in ranks:
            n = examples_assigned(shard_counts(manifest), rank, workers, scheme, copies)
            got = first_examples(local, rank, workers, 2 * n, **reading)
            assert got == first_examples(src, rank, workers, 2 * n, **reading)  # same files, same order
            assert len(set(got)) == n and set(got) <= set(data["train"])
        stranger = (node + 1) * tasks_per_node % workers  # the next node's first worker
        with pytest.raises(FileNotFoundError, match=rf"worker {stranger} of 4 reads are missing in the staged copy"):
            first_examples(local, stranger, workers, 1, **reading)
        # Evaluation reads every example, from the eval shards every node holds.
        batches = eval_batches(data_config(local), global_batch_size=5, num_steps=5)
        assert sorted(k for k, _ in masked_examples(batches)) == sorted(data["eval"])


def test_partial_copy_still_checks_what_it_holds(eight, tmp_path):
    src, _ = eight
    local = str(tmp_path / "local")
    cfg = data_config(src, stage_dir=local)
    prepare.prepare_data_dir(cfg, num_train_examples=31, num_eval_examples=25, worker_ranks=(0,), num_workers=4)
    assert prepare.prepare_data_dir(data_config(local), num_train_examples=31, num_eval_examples=25) == local
    os.remove(os.path.join(local, "validation-00001-of-00003"))  # eval shards are never optional
    with pytest.raises(FileNotFoundError, match="validation-00001-of-00003"):
        prepare.prepare_data_dir(data_config(local), num_train_examples=31, num_eval_examples=25)
    os.truncate(os.path.join(local, "train-00004-of-00008"), 100)  # a shard it holds, damaged after staging
    with pytest.raises(ValueError, match="train-00004-of-00008 has 100 bytes"):
        prepare.prepare_data_dir(data_config(local), num_train_examples=31, num_eval_examples=25)


# --------------------------------------------------------------------------------------------- 7. TFDS

TFDS_NAME = "tfscale_tiny_shapes"
TFDS_SPLITS = {"train": 12, "validation": 21}


def tfds_image(split: str, index: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * len(split) + index)
    return rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A tiny TFDS dataset built and prepared locally (no download); registered once per module."""
    import tensorflow_datasets as tfds

    class TfscaleTinyShapes(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Image(shape=(16, 16, 3)),
                    "label": tfds.features.ClassLabel(num_classes=3),
                }),
                supervised_keys=("image", "label"),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in TFDS_SPLITS}

        def _generate_examples(self, split):
            for i in range(TFDS_SPLITS[split]):
                yield f"{split}-{i}", {"image": tfds_image(split, i), "label": i % 3}

    assert TfscaleTinyShapes.name == TFDS_NAME
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    TfscaleTinyShapes(data_dir=data_dir).download_and_prepare()
    return data_dir


def tfds_config(data_dir, **overrides):
    settings = dict(dataset="tfds", tfds_name=TFDS_NAME, label_offset=0, image_size=16, num_classes=3,
                    num_train_examples=12, num_eval_examples=TFDS_SPLITS["validation"])
    return data_config(data_dir, **{**settings, **overrides})


def tfds_expected(split: str) -> dict[str, int]:
    return {digest(tfds_image(split, i)): i % 3 for i in range(TFDS_SPLITS[split])}


def test_tfds_train_input(tfds_dir):
    expected = tfds_expected("train")
    cfg = tfds_config(tfds_dir, global_batch_size=4, shuffle_buffer=1)  # no mixing of passes: 3 batches = 1 pass
    assert prepare.prepare_data_dir(cfg, num_train_examples=12, num_eval_examples=21) == tfds_dir
    train = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    seen = []
    for images, labels in train.take(6).as_numpy_iterator():  # two passes
        assert images.dtype == np.uint8 and images.shape == (4, 16, 16, 3)
        assert labels.dtype == np.int32
        assert [expected[digest(im)] for im in images] == list(labels)  # lossless PNG, label 0-based
        seen += [digest(im) for im in images]
    assert sorted(seen[:12]) == sorted(seen[12:]) == sorted(expected)  # each pass: every example once


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_tfds_eval_reads_every_example_exactly_once(tfds_dir, workers):
    """Workers number TFDS examples alike (default data.deterministic=False must not reorder them)."""
    expected = sorted(tfds_expected("validation").items())
    cfg = tfds_config(tfds_dir)
    batch = 2 * workers
    num_steps = math.ceil(len(expected) / batch)
    for _ in range(4):  # each dataset is a fresh chance for a non-deterministic order to show
        union = []
        for rank in range(workers):
            batches = eval_batches(cfg, global_batch_size=batch, num_steps=num_steps, ctx=context(workers, rank))
            assert len(batches) == num_steps
            union += masked_examples(batches)
        assert sorted(union) == expected


@pytest.mark.parametrize("name", [TFDS_NAME, "mnist"])  # ours, and a catalog dataset never prepared here
def test_tfds_never_downloads(tfds_dir, tmp_path, name):
    empty = tmp_path / "empty"
    cfg = tfds_config(str(empty), tfds_name=name)
    with pytest.raises(FileNotFoundError, match=f"{name}.*never downloads"):
        pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    with pytest.raises(FileNotFoundError, match=f"{name}.*never downloads"):
        eval_batches(cfg, global_batch_size=2, num_steps=1)
    assert not empty.exists() or not any(empty.iterdir())  # nothing fetched, nothing written


# ------------------------------------------------------------------------------- 8. batch augmentation


@pytest.mark.parametrize("name", ["mixup", "cutmix"])
def test_mixing_batch_augmentation_gives_soft_labels(data, name):
    cfg = data_config(data["six"], batch_augment=name, global_batch_size=8)
    ds = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    rows = []
    for images, labels in ds.take(2).as_numpy_iterator():
        assert images.dtype == np.uint8 and images.shape == (8, SIZE_PX, SIZE_PX, 3)
        assert labels.dtype == np.float32 and labels.shape == (8, 3)
        assert (labels >= 0).all()
        np.testing.assert_allclose(labels.sum(axis=1), 1.0, rtol=1e-5)
        rows += list(labels)
    assert any(np.count_nonzero(row > 1e-6) > 1 for row in rows), "no label was mixed in 16 examples"


def test_randaugment_keeps_uint8_images_and_int_labels(data):
    cfg = data_config(data["six"], batch_augment="randaugment", global_batch_size=4)
    ds = pipeline.train_input_fn(cfg, seed=0, start_step=0)(context())
    for images, labels in ds.take(2).as_numpy_iterator():
        assert images.dtype == np.uint8 and images.shape == (4, SIZE_PX, SIZE_PX, 3)
        assert labels.dtype == np.int32 and labels.shape == (4,)
        assert set(labels) <= {0, 1, 2}


# ------------------------------------------------------------------------------------- 9. determinism


def first_batches(cfg, *, seed=0, start_step=0, num=2):
    ds = pipeline.train_input_fn(cfg, seed=seed, start_step=start_step)(context())
    return list(ds.take(num).as_numpy_iterator())


def test_deterministic_order_and_resume_reshuffles(data):
    cfg = data_config(data["six"], deterministic=True, global_batch_size=8)
    first, second = first_batches(cfg), first_batches(cfg)
    for (im_a, lab_a), (im_b, lab_b) in zip(first, second):
        np.testing.assert_array_equal(im_a, im_b)
        np.testing.assert_array_equal(lab_a, lab_b)
    resumed = first_batches(cfg, start_step=100)
    assert [digest(im) for im in resumed[0][0]] != [digest(im) for im in first[0][0]]
    other_seed = first_batches(cfg, seed=1)
    assert [digest(im) for im in other_seed[0][0]] != [digest(im) for im in first[0][0]]


def test_deterministic_order_with_random_crops(classic_dir):
    """The knob promises a reproducible *order*: with the default imagenet augmentation the sequence of
    examples (seen here through their labels) repeats, though the random crops themselves do not."""
    out, _ = classic_dir
    cfg = classic_config(out, deterministic=True, shuffle_buffer=12, global_batch_size=12)
    labels = [[list(b[1]) for b in first_batches(cfg, num=2)] for _ in range(2)]
    assert labels[0] == labels[1]


def test_autotune_is_off_unless_asked_for_and_its_ram_budget_needs_it():
    """tf.data's autotuner is off by default (its model thread stalls an input's teardown under tf.distribute);
    data.autotune turns it on, with data.ram_budget_mb; a RAM budget without it would do nothing and is refused."""
    data_cfg = base_config().data
    assert pipeline.tf_data_options(data_cfg).autotune.enabled is False
    data_cfg.autotune, data_cfg.ram_budget_mb = True, 512
    options = pipeline.tf_data_options(data_cfg)
    assert options.autotune.enabled is True and options.autotune.ram_budget == 512 << 20
    with pytest.raises(ConfigError, match=r"config.data.ram_budget_mb=512 budgets tf.data's autotuner, "
                       r"which is off: add --config.data.autotune=True"):
        validation.validate(load_config("smoke", "--config.data.ram_budget_mb=512"))


def test_index_shuffle_draws_every_record_once_per_pass_in_a_new_order(data, tmp_path):
    """data.shuffle='index' (the default): every pass a new permutation of the worker's records, read by
    offset from the shards' index files (written again when missing): each record once per pass, the
    records the shuffle buffer's path reads, another order every pass and for another seed."""
    copy = str(tmp_path / "six")
    shutil.copytree(data["six"], copy)
    shutil.rmtree(os.path.join(copy, "dali-index"))  # shards from another tool: indexed on first use
    n = sum(TRAIN_PER_CLASS)

    def stream(seed, **overrides):
        cfg = data_config(copy, deterministic=True, global_batch_size=1, **overrides)
        batches = pipeline.train_input_fn(cfg, seed=seed, start_step=0)(context()).take(3 * n).as_numpy_iterator()
        return [digest(images[0]) for images, _ in batches]

    first = stream(seed=0)
    assert len(os.listdir(os.path.join(copy, "dali-index"))) == 6
    passes = [first[i * n:(i + 1) * n] for i in range(3)]
    assert all(sorted(p) == sorted(data["train"]) for p in passes)  # each record exactly once a pass
    assert passes[0] != passes[1] and passes[1] != passes[2]
    assert stream(seed=0) == first and stream(seed=1)[:n] != passes[0]
    buffered = stream(seed=0, shuffle="buffer", shuffle_buffer=n)
    assert set(buffered) == set(data["train"]) and buffered != first


def test_a_shard_changed_after_indexing_is_named_by_the_index_read(data, tmp_path):
    from tfscale.data.input import record_index

    copy = str(tmp_path / "six")
    shutil.copytree(data["six"], copy)
    shards = shard_dir.list_shards(copy, "train")
    spans = record_index.load_spans(shards, os.path.join(copy, "dali-index"))
    with open(shards[0], "r+b") as f:
        f.truncate(os.path.getsize(shards[0]) // 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{shards[0]}: no \d+-byte record at byte \d+, where "
                       "its index file puts one: the shard was cut short or rewritten after it was indexed"):
        list(record_index.shuffled_records(spans, seed=0, deterministic=True).take(spans.count))
