"""data.loader='dali': NVIDIA DALI on the same shards as tf.data, on the CPU (no GPU here).

Real JPEGs throughout: real-photo trees (tools/make_photo_tree.py) and scikit-learn's digit scans,
converted with tfscale's converter. Example identity: in the photo shards every image is its own
class, so a label names one example.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, load_config, quiet_env, read_jsonl, run_cli, without_tf_import_notices

from tfscale.config.validation import validate
from tfscale.data.convert import dali_index
from tfscale.data.input import loaders, pipeline, preprocess, shard_dir
from tfscale.errors import ConfigError
from tfscale.workdir import layout

dali = pytest.importorskip("tfscale.data.input.dali", reason="NVIDIA DALI is not installed: `make dali` (make test runs it)")

NUM_PHOTOS = 45  # one image per class; odd, so shards and worker shares differ in size


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    """{split: shard dir}: 45 real-photo JPEGs, each its own class, as 4 train shards and as 1 shard."""
    root = tmp_path_factory.mktemp("photos")
    subprocess.run([sys.executable, "tools/make_photo_tree.py", str(root / "images"), "--classes", str(NUM_PHOTOS),
                    "--per_class", "1"], cwd=REPO, check=True, capture_output=True)
    dirs = {}
    for name, split, num_shards in (("four", "train", 4), ("one", "validation", 1)):
        result = run_cli("tfscale.data.convert", f"--input_dir={root / 'images'}", f"--output_dir={root / name}",
                         f"--split={split}", f"--num_shards={num_shards}", "--num_workers=1")
        assert result.returncode == 0, result.stderr[-2000:]
        dirs[name] = str(root / name)
    return dirs


def photo_config(data_dir, loader="dali", **data):
    cfg = load_config("r50_1gpu")
    d = cfg.data
    d.update(data_dir=data_dir, loader=loader, num_classes=NUM_PHOTOS, num_train_examples=NUM_PHOTOS,
             num_eval_examples=NUM_PHOTOS, image_size=64, global_batch_size=5, shuffle_buffer=1)
    d.update(**data)
    validate(cfg)
    return cfg.data


def context(rank, workers):
    return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=rank, num_replicas_in_sync=workers)


def train_labels(data_cfg, rank, workers, num_batches):
    """Labels of worker `rank`'s first `num_batches` training batches, and the first batch."""
    iterator = iter(loaders.train_input_fn(data_cfg, seed=0, start_step=0)(context(rank, workers)))
    batches = [next(iterator) for _ in range(num_batches)]
    return np.concatenate([labels.numpy() for _, labels in batches]), batches[0]


# --- index files ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_converter_writes_the_index_dalis_own_tool_writes(photo_shards, tmp_path):
    shard = os.path.join(photo_shards["one"], "validation-00000-of-00001")
    ours = os.path.join(photo_shards["one"], "dali-index", "validation-00000-of-00001.idx")
    theirs = tmp_path / "theirs.idx"
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "tfrecord2idx"), shard, str(theirs)],
                   check=True, capture_output=True, env=quiet_env())
    assert open(ours).read() == theirs.read_text()
    assert len(open(ours).read().splitlines()) == NUM_PHOTOS


def test_stale_or_missing_index_is_rewritten_and_a_truncated_shard_named(photo_shards, tmp_path):
    data_dir = tmp_path / "shards"
    shutil.copytree(photo_shards["four"], data_dir)
    shards = sorted(str(p) for p in data_dir.glob("train-*"))
    index_dir = str(data_dir / "dali-index")
    # Shard 0 replaced by shard 1 (another size): its index no longer ends where the file does.
    shutil.copy(shards[1], shards[0])
    os.remove(dali_index.index_path(shards[2], index_dir))
    assert not dali_index.is_current(shards[0], dali_index.index_path(shards[0], index_dir))
    dali_index.ensure_indexes(shards, index_dir)
    assert open(dali_index.index_path(shards[0], index_dir)).read() == open(
        dali_index.index_path(shards[1], index_dir)).read()
    assert all(dali_index.is_current(s, dali_index.index_path(s, index_dir)) for s in shards)
    with open(shards[3], "r+b") as f:
        f.truncate(os.path.getsize(shards[3]) - 100)
    with pytest.raises(dali_index.TruncatedShard, match="train-00003-of-00004 is truncated"):
        dali_index.ensure_indexes(shards, index_dir)


def test_an_index_folder_that_cannot_be_made_is_a_config_error_naming_it(photo_shards, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    data_cfg = photo_config(photo_shards["four"], dali_index_dir=str(tmp_path / "a_file" / "index"))
    with pytest.raises(ConfigError, match=r"cannot create the DALI index folder .*a_file/index.*dali_index_dir"):
        train_labels(data_cfg, 0, 1, 1)


# --- training batches -------------------------------------------------------------------------------------------


def test_batches_have_tfdatas_shapes_dtypes_and_labels(photo_shards):
    data_cfg = photo_config(photo_shards["four"])
    labels, (images, batch_labels) = train_labels(data_cfg, 0, 1, NUM_PHOTOS // 5)
    assert images.shape == (5, 64, 64, 3) and images.dtype == tf.uint8
    assert batch_labels.shape == (5,) and batch_labels.dtype == tf.int32
    # One epoch of one worker: every example once (labels are example ids, 1-based in the shards).
    assert sorted(labels) == list(range(NUM_PHOTOS))
    assert images.numpy().std() > 10  # real photo pixels, not a blank placeholder


@pytest.mark.parametrize("shards", ["four", "one"])
def test_disjoint_two_workers_see_each_example_once_per_epoch_like_tfdata(photo_shards, shards):
    """4 shards: whole files per worker, the files tf.data's workers read. 1 shard: examples split by DALI.

    Without a shuffle buffer DALI reads a worker's files in order, so its first pass is exact; tf.data's
    parallel interleave starts the next pass before the last file of this one ends, so the reference
    is the set of examples in the files tf.data assigns.
    """
    cfg = {"four": {}, "one": {"train_split": "validation"}}[shards] | {"global_batch_size": 10}  # 5 per worker
    dali_cfg = photo_config(photo_shards[shards], **cfg)
    tfdata_cfg = photo_config(photo_shards[shards], "tfdata", **cfg)
    seen = {}
    for rank in (0, 1):
        files, _, _ = dali.reader_files(dali_cfg, shard_dir.list_shards(photo_shards[shards], dali_cfg.train_split),
                                        rank, 2)
        indexes = dali_index.ensure_indexes(files, dali_index.index_dir(photo_shards[shards]))
        share = dali_index.num_records(indexes) if shards == "four" else dali.shard_size(NUM_PHOTOS, rank, 2)
        # Batches of 5 do not end with the epoch: read whole batches past it, keep the epoch's share.
        labels, _ = train_labels(dali_cfg, rank, 2, -(-share // 5))
        seen[rank] = labels[:share]
        assert len(set(seen[rank])) == share, f"worker {rank} saw an example twice within an epoch"
        if shards == "four":  # the examples of the files tf.data's worker `rank` reads
            all_files = shard_dir.list_shards(photo_shards[shards], "train")
            tfdata_files = pipeline.worker_files(all_files, tfdata_cfg, rank, 2)
            parse = lambda record: preprocess.parse_example(record, label_offset=1)[1]  # noqa: E731
            assert set(seen[rank]) == {int(label) for label in tf.data.TFRecordDataset(tfdata_files).map(parse)}
    assert not set(seen[0]) & set(seen[1])
    assert sorted([*seen[0], *seen[1]]) == list(range(NUM_PHOTOS))


def test_a_nodes_staged_copy_gets_its_own_indexes_and_serves_only_its_workers(photo_shards, tmp_path):
    """tfscale-stage copies worker 1's shards (of 2) without indexes: DALI writes them in the copy."""
    from tfscale.data.stage import stage

    dest = str(tmp_path / "staged")
    stage.stage(photo_shards["four"], dest, splits=("train",), readers=stage.Readers((1,), 2))
    data_cfg = photo_config(dest, global_batch_size=10)
    labels, _ = train_labels(data_cfg, 1, 2, 2)  # worker 1's files: shards 1 and 3
    assert sorted(os.listdir(os.path.join(dest, "dali-index"))) == ["train-00001-of-00004.idx",
                                                                    "train-00003-of-00004.idx"]
    assert len(set(labels[:10])) == 10
    with pytest.raises(FileNotFoundError, match="2 of the 2 shards worker 0 of 2 reads are missing in the staged copy"):
        train_labels(data_cfg, 0, 2, 1)


def test_schemes_dali_cannot_split_by_example_are_refused_by_name(photo_shards):
    data_cfg = photo_config(photo_shards["one"], train_split="validation", assignment="coarse", copies=2)
    with pytest.raises(ConfigError, match="assignment='coarse' assigns single examples.*only disjoint and full"):
        train_labels(data_cfg, 0, 4, 1)
    # With enough files, every scheme is the tf.data assignment of whole files.
    data_cfg = photo_config(photo_shards["four"], assignment="medium_coarse", copies=2)
    files, shard_id, num_shards = dali.reader_files(data_cfg, shard_dir.list_shards(photo_shards["four"], "train"), 1, 4)
    assert [os.path.basename(f)[:11] for f in files] == ["train-00001", "train-00002"]
    assert (shard_id, num_shards) == (0, 1)


def test_decoded_pixels_agree_with_tfdata(photo_shards):
    """augment=none train and imagenet eval centre crop: same example, pixels within a few levels."""
    for augment in ("none", "imagenet"):
        images = {}
        for loader in ("dali", "tfdata"):
            data_cfg = photo_config(photo_shards["one"], loader, augment=augment, eval_split="validation")
            ds = loaders.eval_input_fn(data_cfg, seed=0, global_batch_size=5, num_steps=NUM_PHOTOS // 5)(context(0, 1))
            images[loader] = np.concatenate([batch[0].numpy() for batch in ds]).astype(np.float32)
        difference = np.abs(images["dali"] - images["tfdata"])
        assert difference.mean() < 2.0, (augment, difference.mean())  # ~1.0 measured; another example: ~50
        assert np.median(difference) <= 1.0


# --- evaluation -------------------------------------------------------------------------------------------------


def test_eval_is_deterministic_and_counts_every_example_once(photo_shards):
    data_cfg = photo_config(photo_shards["four"], eval_split="train", global_batch_size=4)
    num_steps = -(-NUM_PHOTOS // 4)  # 12 steps of 4 (2 per worker) hold 48 slots for 45 examples
    seen = []
    for rank in (0, 1):
        input_fn = loaders.eval_input_fn(data_cfg, seed=0, global_batch_size=4, num_steps=num_steps)
        runs = [[tuple(t.numpy() for t in batch) for batch in input_fn(context(rank, 2))] for _ in range(2)]
        assert len(runs[0]) == num_steps
        for first, second in zip(*runs):  # same images, labels and masks, in the same order
            assert all(np.array_equal(a, b) for a, b in zip(first, second))
        masks = np.concatenate([b[2] for b in runs[0]])
        labels = np.concatenate([b[1] for b in runs[0]])
        assert masks.sum() == dali.shard_size(NUM_PHOTOS, rank, 2)
        assert set(np.unique(masks)) <= {0.0, 1.0} and (masks[:int(masks.sum())] == 1).all()
        seen.extend(labels[masks == 1])
    assert sorted(seen) == list(range(NUM_PHOTOS))


@pytest.mark.slow
def test_two_workers_reading_different_dali_batches_end_with_identical_weights(photo_shards, tmp_path):
    """2 MWMS workers, each its own shards through DALI (disjoint files): the all-reduce keeps them equal."""
    from test_multiworker import assert_weights_close, weights

    result = subprocess.run(
        [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1", "--",
         os.path.join(REPO, "tests", "helpers", "train_and_dump.py"), str(tmp_path / "w{rank}.npz"),
         "--config=configs/smoke.py", f"--workdir={tmp_path / 'run'}", "--config.distribute.backend=mwms",
         "--config.data.dataset=tfrecord", f"--config.data.data_dir={photo_shards['four']}",
         "--config.data.loader=dali", "--config.data.label_offset=1", f"--config.data.num_classes={NUM_PHOTOS}",
         f"--config.data.num_train_examples={NUM_PHOTOS}", f"--config.data.num_eval_examples={NUM_PHOTOS}",
         "--config.data.eval_split=train", "--config.data.global_batch_size=10", "--config.train.epochs=4"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, without_tf_import_notices(result.stdout[-3000:] + result.stderr[-3000:])
    final = [weights(tmp_path / f"w{rank}.npz") for rank in (0, 1)]
    assert_weights_close(final[0], final[1], rtol=0, atol=0)
    initial = weights(tmp_path / "w0_init.npz")
    assert max(float(np.abs(a - b).max()) for a, b in zip(final[0], initial)) > 1e-3  # it trained


# --- set-up errors ----------------------------------------------------------------------------------------------


def test_config_refuses_what_the_dali_pipeline_does_not_do(photo_shards):
    for data, message in ((dict(augment="cifar"), "augment='cifar' is not implemented"),
                          (dict(batch_augment="mixup"), "batch_augment='mixup' does not work"),
                          (dict(skip_corrupt_images=True), "skip_corrupt_images=True does not work"),
                          (dict(dali_decode="gpu"), "dali_decode")):
        with pytest.raises(ConfigError, match=message):
            photo_config(photo_shards["four"], **data)
    data_cfg = photo_config(photo_shards["four"], dali_decode="mixed")  # a valid choice: no GPU is checked later
    with pytest.raises(ConfigError, match="dali_decode='mixed' decodes on a GPU and this process sees none"):
        train_labels(data_cfg, 0, 1, 1)


_HIDE_DALI = """
import importlib.abc, sys
class _NoDali(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.dali" or name.startswith("nvidia.dali."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoDali())
"""


def test_missing_dali_stops_the_run_naming_make_dali(photo_shards, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_DALI)
    env = {**quiet_env(), "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.train", "--config=configs/r50_1gpu.py", f"--workdir={tmp_path / 'run'}",
         f"--config.data.data_dir={photo_shards['four']}", "--config.data.loader=dali",
         "--config.data.global_batch_size=4"],  # the recipe's 256 exceeds the shards' 45 examples: refused first
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "config.data.loader='dali' but nvidia.dali is not installed" in result.stderr
    assert "`make dali`" in result.stderr
    assert not os.path.exists(tmp_path / "run" / layout.CHECKPOINTS)


# --- training ---------------------------------------------------------------------------------------------------


def train_digits(workdir, shards, counts, loader, backend="mwms") -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.launch", "--num_workers=2", f"--backend={backend}", "--", "-m", "tfscale.train",
         "--config=configs/digits.py", f"--workdir={workdir}", f"--config.data.data_dir={shards}",
         f"--config.distribute.backend={backend}", f"--config.data.loader={loader}",
         f"--config.data.num_train_examples={counts['train']}",
         f"--config.data.num_eval_examples={counts['validation']}",
         "--config.data.image_size=32", "--config.model.name=cifar_resnet8", "--config.optim.lr_per_256=0.8",
         "--config.train.epochs=10", "--config.schedule.warmup_epochs=1", "--config.train.eval_every_epochs=10",
         "--config.checkpoint.every_epochs=10", "--config.train.log_every_steps=100"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, without_tf_import_notices(result.stdout[-3000:] + result.stderr[-3000:])
    return json.load(open(os.path.join(workdir, layout.SUMMARY)))


@pytest.mark.slow
def test_two_worker_training_with_dali_converges_like_tfdata(digit_shards, tmp_path):
    shards, counts = digit_shards
    summaries = {loader: train_digits(tmp_path / loader, shards, counts, loader) for loader in ("dali", "tfdata")}
    if importlib.util.find_spec("horovod"):  # make test builds it; the DALI input is the same under Horovod
        summaries["dali_horovod"] = train_digits(tmp_path / "dali_horovod", shards, counts, "dali", "horovod")
    print({run: (s["eval_top1"], s["images_per_sec"]) for run, s in summaries.items()})
    for loader in summaries:
        evals = [row for row in read_jsonl(tmp_path / loader / layout.METRICS) if "eval_top1" in row]
        assert [row["eval_examples"] for row in evals] == [counts["validation"]]  # every held-out scan once
        assert summaries[loader]["num_workers"] == 2
    assert summaries["dali"]["steps"] == summaries["tfdata"]["steps"]
    assert summaries["dali"]["eval_top1"] > 0.85
    assert abs(summaries["dali"]["eval_top1"] - summaries["tfdata"]["eval_top1"]) < 0.06
    if "dali_horovod" in summaries:
        assert abs(summaries["dali_horovod"]["eval_top1"] - summaries["tfdata"]["eval_top1"]) < 0.06
