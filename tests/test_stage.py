"""Staging shards to node-local storage: verification, resume, free space, one copier per node, and the
faults of a long job (a killed node, flaky reads, transient read errors, a small disk)."""

import dataclasses
import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, small_file_system

from tfscale import io as tfio
from tfscale.data.input import assignment
from tfscale.data.stage import stage, stage_copy
from tfscale.workdir import layout

SHARD_BYTES = 256 << 10


def write_shards(src_dir, split="train", num_shards=4, *, manifest=True, shard_bytes=SHARD_BYTES, seed=0,
                 manifest_name="manifest-{split}.json"):
    """Random-byte "shards" (+ a converter-style manifest named `manifest_name`); {name: content}."""
    os.makedirs(src_dir, exist_ok=True)
    rng = random.Random(f"{split}-{seed}")
    contents = {}
    for i in range(num_shards):
        name = f"{split}-{i:05d}-of-{num_shards:05d}"
        contents[name] = rng.randbytes(shard_bytes + i)  # sizes differ a little
        with open(os.path.join(src_dir, name), "wb") as f:
            f.write(contents[name])
    if manifest:
        entries = [{"name": n, "num_examples": 10, "bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()}
                   for n, c in contents.items()]
        with open(os.path.join(src_dir, manifest_name.format(split=split)), "w") as f:
            json.dump({"split": split, "num_examples": 10 * num_shards, "num_shards": num_shards,
                       "shards": entries}, f)
    return contents


def flip_bytes(path, offset=1000, count=16):
    """Same size, different content."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def shard_files(dest_dir):
    return sorted(n for n in os.listdir(dest_dir) if "-of-" in n and not n.startswith("."))


def partial_files(dest_dir):
    return sorted(n for n in os.listdir(dest_dir) if n.startswith(stage.PARTIAL_PREFIX))


@pytest.fixture
def src(tmp_path):
    """train (4 shards) and validation (2 shards), both with manifests."""
    src_dir = str(tmp_path / "shared")
    contents = {**write_shards(src_dir, "train", 4), **write_shards(src_dir, "validation", 2)}
    return src_dir, contents


def test_stages_everything_identical_with_manifests(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    report = stage.stage(src_dir, dest)
    assert shard_files(dest) == sorted(contents)
    for name, content in contents.items():
        assert read(os.path.join(dest, name)) == content
    for split in ("train", "validation"):
        name = f"manifest-{split}.json"
        assert read(os.path.join(dest, name)) == read(os.path.join(src_dir, name))
    assert report.dest_dir == dest
    assert (report.files_copied, report.files_skipped) == (6, 0)
    assert report.bytes_copied == sum(len(c) for c in contents.values())
    assert report.copied_by_this_process and report.seconds > 0 and report.mb_per_s > 0
    assert partial_files(dest) == []
    state = json.loads(read(os.path.join(dest, stage.STATE_FILE)))["files"]
    assert {n: r["sha256"] for n, r in state.items()} == {n: hashlib.sha256(c).hexdigest() for n, c in contents.items()}


def test_second_run_copies_nothing_and_trusts_the_state_file(src, tmp_path, monkeypatch):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest)

    def no_hashing(path):
        raise AssertionError(f"{path} was re-hashed although its size and mtime match the state file")

    monkeypatch.setattr(tfio, "file_sha256", no_hashing)
    report = stage.stage(src_dir, dest)
    assert (report.files_copied, report.files_skipped, report.bytes_copied) == (0, 6, 0)
    assert not report.copied_by_this_process


def test_corrupt_staged_file_is_detected_and_copied_again(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest)
    victim = os.path.join(dest, "train-00002-of-00004")
    before = os.stat(victim)
    flip_bytes(victim)
    # Real corruption comes with a new mtime; this write may land in the same timestamp tick as the copy.
    if os.stat(victim).st_mtime_ns == before.st_mtime_ns:
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert read(victim) != contents["train-00002-of-00004"]

    report = stage.stage(src_dir, dest)
    assert (report.files_copied, report.files_skipped) == (1, 5)
    assert read(victim) == contents["train-00002-of-00004"]
    assert stage.stage(src_dir, dest).files_copied == 0


def test_state_file_lost_rehashes_instead_of_copying(src, tmp_path):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest)
    os.remove(os.path.join(dest, stage.STATE_FILE))
    assert stage.stage(src_dir, dest).files_copied == 0
    with open(os.path.join(dest, stage.STATE_FILE), "w") as f:
        f.write("{not json")
    assert stage.stage(src_dir, dest).files_copied == 0


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_source_not_matching_manifest_is_an_error_and_not_staged(src, tmp_path, damage):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    bad = os.path.join(src_dir, "train-00001-of-00004")
    if damage == "flipped":
        flip_bytes(bad)
    else:
        os.truncate(bad, 1000)
    with pytest.raises(stage.StageError, match="train-00001-of-00004.*not staged"):
        stage.stage(src_dir, dest)
    assert "train-00001-of-00004" not in os.listdir(dest)
    assert partial_files(dest) == []
    state_path = os.path.join(dest, stage.STATE_FILE)
    if os.path.exists(state_path):  # other shards may have been staged meanwhile, this one not
        assert "train-00001-of-00004" not in json.loads(read(state_path))["files"]


def test_too_little_space_fails_before_copying(src, tmp_path, monkeypatch):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    monkeypatch.setattr(stage_copy, "_free_bytes", lambda path: 123_456)
    with pytest.raises(stage.StageError) as e:
        stage.stage(src_dir, dest)
    needed = sum(len(c) for c in contents.values()) + sum(
        os.path.getsize(os.path.join(src_dir, f"manifest-{s}.json")) for s in ("train", "validation"))
    message = str(e.value)
    assert f"needs {needed} bytes" in message and "123456 bytes" in message and dest in message
    assert shard_files(dest) == [] and partial_files(dest) == []
    assert not any("manifest" in n for n in os.listdir(dest))


def test_missing_src_dir_and_missing_listed_shard_are_named(src, tmp_path):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        stage.stage(str(tmp_path / "nowhere"), dest)
    os.remove(os.path.join(src_dir, "validation-00001-of-00002"))
    with pytest.raises(FileNotFoundError, match="validation-00001-of-00002 listed in .*manifest-validation.json"):
        stage.stage(src_dir, dest)


def test_files_subset_is_verified_against_the_manifest(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    flip_bytes(os.path.join(src_dir, "train-00003-of-00004"))  # not asked for: must not matter
    wanted = ["train-00000-of-00004", "validation-00001-of-00002"]
    report = stage.stage(src_dir, dest, files=wanted)
    assert shard_files(dest) == sorted(wanted)  # exactly these; manifests only when listed
    assert (report.files_copied, report.files_skipped) == (2, 0)
    assert all(read(os.path.join(dest, n)) == contents[n] for n in wanted)
    with pytest.raises(stage.StageError, match="train-00003-of-00004"):  # listed in a manifest: hash checked
        stage.stage(src_dir, dest, files=["train-00003-of-00004"])
    with pytest.raises(FileNotFoundError, match="train-00009-of-00004"):
        stage.stage(src_dir, dest, files=["train-00009-of-00004"])
    with pytest.raises(ValueError, match="plain file names"):
        stage.stage(src_dir, dest, files=["../etc/passwd"])


def test_without_manifest_stages_by_name_and_checks_size(tmp_path):
    src_dir, dest = str(tmp_path / "shared"), str(tmp_path / "local")
    contents = write_shards(src_dir, "train", 3, manifest=False)
    with open(os.path.join(src_dir, "README"), "w") as f:
        f.write("not a shard")
    report = stage.stage(src_dir, dest, splits=["train"])
    assert shard_files(dest) == sorted(contents) and "README" not in os.listdir(dest)
    assert all(read(os.path.join(dest, n)) == c for n, c in contents.items())
    assert (report.files_copied, report.files_skipped) == (3, 0)
    assert stage.stage(src_dir, dest, splits=["train"]).files_copied == 0
    with pytest.raises(FileNotFoundError, match="validation-\\*-of-\\*"):
        stage.stage(src_dir, dest, splits=["validation"])
    # A source that grew (re-written) no longer matches its staged copy's size: copied again.
    with open(os.path.join(src_dir, "train-00001-of-00003"), "ab") as f:
        f.write(b"more")
    assert stage.stage(src_dir, dest, splits=["train"]).files_copied == 1


def test_verify_size_does_not_hash(src, tmp_path, monkeypatch):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    monkeypatch.setattr(hashlib, "sha256", None)  # any hashing would fail
    report = stage.stage(src_dir, dest, verify="size")
    assert report.files_copied == 6 and all(read(os.path.join(dest, n)) == c for n, c in contents.items())


def test_temporaries_of_killed_json_and_manifest_writes_are_removed(src, tmp_path):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest)
    leftovers = [f"{stage.STATE_FILE}.tmp-999", f"{stage.SHARD_LIST_FILE}.tmp-999", ".manifest-train.json.tmp-999"]
    for name in leftovers:
        with open(os.path.join(dest, name), "w") as f:
            f.write("half")
    stage.stage(src_dir, dest)
    assert not set(leftovers) & set(os.listdir(dest))


def test_lock_timeout_is_an_error_not_a_hang(src, tmp_path):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    os.makedirs(dest)
    with open(os.path.join(dest, stage.LOCK_FILE), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another "process" (another open file description) is copying
        with pytest.raises(stage.StageError, match="timed out after .* waiting for the staging lock"):
            stage.stage(src_dir, dest, lock_timeout_s=0.3)
    assert shard_files(dest) == []


# ------------------------------------------------------------------------------- manifest names


def test_legacy_manifest_names_are_staged_and_verified(tmp_path):
    """Shard dirs converted by older tfscale versions hold `{split}-manifest.json`: still used as before."""
    src_dir, dest = str(tmp_path / "shared"), str(tmp_path / "local")
    contents = {**write_shards(src_dir, "train", 3, manifest_name="{split}-manifest.json"),
                **write_shards(src_dir, "validation", 1, manifest_name="{split}-manifest.json")}
    report = stage.stage(src_dir, dest)
    assert report.files_copied == 4 and shard_files(dest) == sorted(contents)
    for split in ("train", "validation"):
        name = f"{split}-manifest.json"
        assert read(os.path.join(dest, name)) == read(os.path.join(src_dir, name))
    flip_bytes(os.path.join(src_dir, "train-00001-of-00003"))
    with pytest.raises(stage.StageError, match="train-00001-of-00003 does not match .*train-manifest.json"):
        stage.stage(src_dir, str(tmp_path / "local2"))
    with pytest.raises(stage.StageError, match="train-00001-of-00003"):  # files= finds the legacy manifest too
        stage.stage(src_dir, str(tmp_path / "local3"), files=["train-00001-of-00003"])


def test_staging_a_reconverted_dir_drops_the_legacy_manifest_from_the_copy(tmp_path):
    """`train*` globs read a leftover `train-manifest.json` in the copy as a shard: it must go."""
    src_dir, dest = str(tmp_path / "shared"), str(tmp_path / "local")
    write_shards(src_dir, "train", 2, manifest_name="{split}-manifest.json")
    stage.stage(src_dir, dest, splits=["train"])
    assert os.path.exists(os.path.join(dest, "train-manifest.json"))
    os.rename(os.path.join(src_dir, "train-manifest.json"), os.path.join(src_dir, "manifest-train.json"))
    stage.stage(src_dir, dest, splits=["train"])
    assert sorted(n for n in os.listdir(dest) if not n.startswith(".")) == [
        "manifest-train.json", "train-00000-of-00002", "train-00001-of-00002"]


# ------------------------------------------------------------------------- per-node train shards


def node_ranks(node, tasks_per_node):
    """Block distribution, as srun and horovodrun -H host:T lay ranks out."""
    return tuple(range(node * tasks_per_node, (node + 1) * tasks_per_node))


def assigned_train_shards(num_files, ranks, num_workers, scheme, copies=1):
    """Shard names the workers `ranks` read, straight from tfscale.data.input.assignment."""
    indices = set()
    for rank in ranks:
        indices.update(assignment.assign(num_files, rank=rank, num_workers=num_workers, scheme=scheme, copies=copies))
    return {f"train-{i:05d}-of-{num_files:05d}" for i in indices}


@pytest.fixture
def src8(tmp_path):
    """8 train shards, 2 validation shards, with manifests."""
    src_dir = str(tmp_path / "shared")
    contents = {**write_shards(src_dir, "train", 8, shard_bytes=4096), **write_shards(src_dir, "validation", 2)}
    return src_dir, contents


@pytest.mark.parametrize("scheme,copies", [("disjoint", 1), ("overlap", 2), ("overlap", 3)])
def test_each_node_stages_the_train_shards_of_its_workers_and_every_eval_shard(src8, tmp_path, scheme, copies):
    src_dir, contents = src8
    eval_shards = {"validation-00000-of-00002", "validation-00001-of-00002"}
    staged = []
    for node in range(2):  # 2 nodes x 2 tasks = 4 workers
        dest = str(tmp_path / f"node{node}")
        readers = stage.Readers(node_ranks(node, 2), num_workers=4, scheme=scheme, copies=copies)
        report = stage.stage(src_dir, dest, readers=readers)
        want = assigned_train_shards(8, node_ranks(node, 2), 4, scheme, copies)
        assert set(shard_files(dest)) == want | eval_shards
        assert report.files_copied == len(want) + 2
        assert all(read(os.path.join(dest, n)) == contents[n] for n in shard_files(dest))
        assert {f"manifest-{s}.json" for s in ("train", "validation")} <= set(os.listdir(dest))
        # How workers number the files of the partial copy: all 8 source train shards, in order.
        assert stage.read_shard_list(dest, "train") == [f"train-{i:05d}-of-00008" for i in range(8)]
        assert stage.read_shard_list(dest, "validation") == sorted(eval_shards)
        staged.append(want)
    if scheme == "disjoint":
        assert staged[0] == {f"train-{i:05d}-of-00008" for i in (0, 1, 4, 5)}  # ranks 0,1: i mod 4 in {0, 1}
        assert staged[0].isdisjoint(staged[1])
    assert staged[0] | staged[1] == {n for n in contents if n.startswith("train")}  # every shard on some node


def test_full_assignment_and_fewer_files_than_workers_stage_every_train_shard(src8, tmp_path):
    src_dir, contents = src8
    report = stage.stage(src_dir, str(tmp_path / "full"), readers=stage.Readers((0, 1), 4, "full"))
    assert report.files_copied == 10 and shard_files(str(tmp_path / "full")) == sorted(contents)
    # 8 files, 16 workers: example-level assignment, every worker reads every file.
    report = stage.stage(src_dir, str(tmp_path / "example_level"), readers=stage.Readers((0, 1), 16))
    assert report.files_copied == 10 and shard_files(str(tmp_path / "example_level")) == sorted(contents)


def test_train_split_other_than_train_and_no_manifest(tmp_path):
    src_dir = str(tmp_path / "shared")
    contents = {**write_shards(src_dir, "tr", 4, manifest=False), **write_shards(src_dir, "ev", 1, manifest=False)}
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest, splits=["tr", "ev"], train_split="tr", readers=stage.Readers((3,), 4))
    assert shard_files(dest) == ["ev-00000-of-00001", "tr-00003-of-00004"]
    assert stage.read_shard_list(dest, "tr") == sorted(n for n in contents if n.startswith("tr-"))


def test_a_staged_shard_list_cannot_name_a_file_outside_the_copy(tmp_path):
    listed = tmp_path / stage.SHARD_LIST_FILE
    listed.write_text(json.dumps({"splits": {"train": ["train-00000-of-00002", "../../home/x/train-00001-of-00002"]}}))
    with pytest.raises(ValueError, match=f"{listed} lists train shard '../../home/x/train-00001-of-00002': shard "
                                         "names must be plain file names"):
        stage.read_shard_list(str(tmp_path), "train")


def test_a_second_node_layout_adds_shards_and_keeps_the_lists(src8, tmp_path):
    """A requeued job on other node counts stages what its workers now read; staged files stay valid."""
    src_dir, _ = src8
    dest = str(tmp_path / "local")
    stage.stage(src_dir, dest, readers=stage.Readers((0, 1), 4))
    report = stage.stage(src_dir, dest, readers=stage.Readers((0, 1, 2), 8))  # 8 workers: shards 0, 1, 2
    assert report.files_copied == 1 and report.files_skipped == 2 + 2  # shard 2 new; 0, 1 and eval kept
    assert stage.read_shard_list(dest, "train") == [f"train-{i:05d}-of-00008" for i in range(8)]


def test_the_workers_of_a_node_each_stage_their_share_into_the_nodes_dir(src8, tmp_path):
    """What training does with data.stage_dir: every worker stages what it reads; a node's workers take
    turns under the dir's lock, and the eval shards are copied once."""
    src_dir, contents = src8
    for node in range(2):
        dest = str(tmp_path / f"node{node}")
        reports = [stage.stage(src_dir, dest, readers=stage.Readers((rank,), 4)) for rank in node_ranks(node, 2)]
        assert set(shard_files(dest)) == assigned_train_shards(8, node_ranks(node, 2), 4, "disjoint") | {
            "validation-00000-of-00002", "validation-00001-of-00002"}
        assert [(r.files_copied, r.files_skipped) for r in reports] == [(2 + 2, 0), (2, 2)]  # eval once
        assert stage.read_shard_list(dest, "train") == sorted(n for n in contents if n.startswith("train"))


@pytest.mark.slow
def test_two_workers_on_two_nodes_stage_and_read_only_their_own_train_shards(digit_shards, tmp_path):
    """tfscale.train with data.stage_dir, 2 MWMS workers, each on its own "node": the same relative
    stage_dir from another working directory is another disk, as $TMPDIR is on every node of a cluster."""
    from conftest import quiet_env

    from tfscale.launch import launch

    shards, counts = digit_shards
    ports = launch.free_ports(2)
    procs = []
    for rank in range(2):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        env = quiet_env(**launch.worker_env(rank, 2, ports, "mwms", 1))
        command = [sys.executable, "-m", "tfscale.train", f"--config={REPO}/configs/digits.py",
                   f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={shards}", "--config.data.stage_dir=local",
                   f"--config.data.num_train_examples={counts['train']}",
                   f"--config.data.num_eval_examples={counts['validation']}", "--config.model.name=cifar_resnet8",
                   "--config.train.epochs=0.5", "--config.train.eval_every_epochs=0.5",
                   "--config.schedule.warmup_epochs=0.1", "--config.distribute.backend=mwms",
                   "--config.distribute.heartbeat_timeout_s=10"]
        procs.append(subprocess.Popen(command, cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{outputs[rank][-3000:]}"
    eval_shards = {"validation-00000-of-00001"}
    for rank in range(2):
        # Worker r of 2 reads train shard r of 2 (disjoint): the other node's shard is not there, so the
        # run succeeding shows that each worker read only the shards its node staged.
        assert set(shard_files(str(tmp_path / f"node{rank}" / "local"))) == {f"train-{rank:05d}-of-00002"} | eval_shards
    assert "staging 1 of 2 train shards: those workers 0 of 2 read (assignment disjoint)" in outputs[0]
    with open(tmp_path / "run" / layout.SUMMARY) as f:
        assert json.load(f)["eval_top1"] > 0


@pytest.mark.parametrize("spec, ranks", [("0-3", (0, 1, 2, 3)), ("0,1,2,3", (0, 1, 2, 3)), ("5", (5,)),
                                         ("8-9, 0-1", (0, 1, 8, 9)), ("2,2", (2,))])
def test_parse_ranks(spec, ranks):
    assert stage.parse_ranks(spec) == ranks


@pytest.mark.parametrize("spec", ["", "a", "3-1", "1-", "-1", "0;1"])
def test_parse_ranks_names_the_bad_part(spec):
    with pytest.raises(ValueError, match="is not a rank or a range"):
        stage.parse_ranks(spec)


def test_readers_check_their_values():
    with pytest.raises(ValueError, match=r"worker ranks \[4\] are not in \[0, num_workers=4\)"):
        stage.Readers((3, 4), 4)
    with pytest.raises(ValueError, match="copies=5"):
        stage.Readers((0,), 4, "overlap", 5)
    with pytest.raises(ValueError, match="'sideways'"):
        stage.Readers((0,), 4, "sideways")
    with pytest.raises(ValueError, match="no worker ranks"):
        stage.Readers((), 4)


# ---------------------------------------------------------------------------- real processes


def _stage_in_child(src_dir, dest, barrier, results):
    barrier.wait()  # all start together, so they really compete for the lock
    results.put(dataclasses.asdict(stage.stage(src_dir, dest)))


def _stage_and_die_midway(src_dir, dest, die_on_file):
    """A copier killed -9 in the middle of its `die_on_file`-th file, partial copy on disk."""
    real_copy_stream = stage_copy._copy_stream
    calls = []

    def dying_copy_stream(src, partial, digest, *progress):
        calls.append(src)
        if len(calls) == die_on_file:
            with open(partial, "wb") as f:
                f.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_copy_stream(src, partial, digest, *progress)

    stage_copy._copy_stream = dying_copy_stream
    stage.stage(src_dir, dest, num_threads=1)


def test_concurrent_processes_copy_each_file_once(tmp_path):
    src_dir, dest = str(tmp_path / "shared"), str(tmp_path / "local")
    contents = {**write_shards(src_dir, "train", 8, shard_bytes=2 << 20), **write_shards(src_dir, "validation", 2)}
    ctx = multiprocessing.get_context("spawn")
    num_procs = 4
    barrier, results = ctx.Barrier(num_procs), ctx.Queue()
    procs = [ctx.Process(target=_stage_in_child, args=(src_dir, dest, barrier, results)) for _ in range(num_procs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    reports = [results.get(timeout=5) for _ in procs]
    assert sum(r["copied_by_this_process"] for r in reports) == 1
    assert sum(r["files_copied"] for r in reports) == len(contents)
    waiters = [r for r in reports if not r["copied_by_this_process"]]
    assert all(r["files_skipped"] == len(contents) and r["bytes_copied"] == 0 for r in waiters)
    assert shard_files(dest) == sorted(contents) and partial_files(dest) == []
    assert all(read(os.path.join(dest, n)) == c for n, c in contents.items())


def test_a_crashed_copier_is_taken_over(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    child = multiprocessing.get_context("spawn").Process(target=_stage_and_die_midway, args=(src_dir, dest, 3))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    # 2 done, 1 half-written (a temp of the state file may be left too: it is saved while the next file copies).
    assert len(shard_files(dest)) == 2
    half_written = f"{stage.PARTIAL_PREFIX}train-00002-of-00004.{child.pid}"
    assert [n for n in partial_files(dest) if "-of-" in n] == [half_written]

    report = stage.stage(src_dir, dest, lock_timeout_s=10)  # the kernel released the dead copier's lock
    assert report.copied_by_this_process and (report.files_copied, report.files_skipped) == (4, 2)
    assert partial_files(dest) == []
    assert all(read(os.path.join(dest, n)) == c for n, c in contents.items())
    assert stage.stage(src_dir, dest).files_copied == 0


# ------------------------------------------------------------------------------------------ CLI


def tool_command(*args):
    return [sys.executable, os.path.join(REPO, "tools", "stage_data.py"), *args]


def run_tool(*args, env=None):
    return subprocess.run(tool_command(*args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_cli(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--splits=train,validation", "--verify=sha256")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == dest
    assert "copied 6 files" in done.stderr and "MB/s" in done.stderr
    assert shard_files(dest) == sorted(contents)
    again = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}")
    assert again.returncode == 0 and "already staged: 6 files" in again.stderr

    missing = str(tmp_path / "no_such_dir")
    failed = run_tool(f"--src_dir={missing}", f"--dest_dir={dest}")
    assert failed.returncode != 0 and missing in failed.stderr and "Traceback" not in failed.stderr


def test_cli_default_dest_is_under_tmpdir(src, tmp_path):
    src_dir, contents = src
    node_local = str(tmp_path / "job_tmp")
    os.makedirs(node_local)
    done = run_tool(f"--src_dir={src_dir}", "--splits=validation", env={"TMPDIR": node_local})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.path.join(node_local, "tfscale_data")
    assert shard_files(done.stdout.strip()) == ["validation-00000-of-00002", "validation-00001-of-00002"]


def test_default_stage_root(monkeypatch):
    monkeypatch.setenv("TMPDIR", "/local/job123")
    assert stage.default_stage_root() == "/local/job123"
    monkeypatch.delenv("TMPDIR")
    assert stage.default_stage_root() == "/tmp"


def test_cli_stages_a_nodes_share(src8, tmp_path):
    src_dir, _ = src8
    dest = str(tmp_path / "node1")
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_workers=4", "--worker_ranks=2-3",
                    "--assignment=overlap", "--copies=2")
    assert done.returncode == 0, done.stderr
    want = assigned_train_shards(8, (2, 3), 4, "overlap", 2)
    assert set(shard_files(dest)) == want | {"validation-00000-of-00002", "validation-00001-of-00002"}
    assert f"staging {len(want)} of 8 train shards: those workers 2,3 of 4 read (assignment overlap)" in done.stderr

    lonely = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--worker_ranks=0-1")
    assert lonely.returncode != 0 and "--num_workers and --worker_ranks go together" in lonely.stderr
    outside = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_workers=4", "--worker_ranks=3-4")
    assert outside.returncode != 0 and "[4] are not in [0, num_workers=4)" in outside.stderr
    assert "Traceback" not in lonely.stderr + outside.stderr


def test_cli_takes_splits_and_assignment_from_the_training_config(src8, tmp_path):
    """What the Slurm templates do: the training run's --config and overrides decide what a node stages."""
    src_dir, _ = src8
    config = tmp_path / "my_config.py"
    config.write_text("from tfscale.config import base_config\n\n\ndef get_config():\n    c = base_config()\n"
                      "    c.data.assignment = 'overlap'\n    c.data.eval_split = 'train'\n    return c\n")
    dest = str(tmp_path / "node0")
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_workers=4", "--worker_ranks=0",
                    f"--config={config}", "--config.data.copies=3", "--config.optim.lr_per_256=0.2")
    assert done.returncode == 0, done.stderr
    # eval_split=train: train is then also staged whole (the eval split is); no validation shards.
    assert shard_files(dest) == [f"train-{i:05d}-of-00008" for i in range(8)]
    dest = str(tmp_path / "node0b")
    config.write_text(config.read_text().replace("c.data.eval_split = 'train'", "c.data.eval_split = 'validation'"))
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_workers=4", "--worker_ranks=0",
                    f"--config={config}", "--config.data.copies=3")
    assert done.returncode == 0, done.stderr
    want = assigned_train_shards(8, (0,), 4, "overlap", 3)
    assert len(want) == 6
    assert set(shard_files(dest)) == want | {"validation-00000-of-00002", "validation-00001-of-00002"}

    both = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", f"--config={config}", "--assignment=full")
    assert both.returncode != 0 and "--assignment and --config both decide" in both.stderr


def test_cli_logs_progress_without_a_terminal(src8, tmp_path):
    src_dir, contents = src8
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={tmp_path / 'local'}", "--progress_every_s=0",
                    "--num_threads=1")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "staging progress:" in line]
    total_mb = sum(len(c) for c in contents.values()) / 1e6
    assert len(lines) >= len(contents), done.stderr  # a line per chunk and per finished file at interval 0
    assert f"10/10 files, {total_mb:.1f}/{total_mb:.1f} MB" in lines[-1] and "MB/s" in lines[-1]


# ------------------------------------------------------------------------------ faults of a real job

# There is no flaky NFS server or failing disk here, so faults are injected into the real tool: a
# sitecustomize.py on the child's PYTHONPATH wraps stage_copy._read_chunk, the one call that reads a
# source shard's bytes, and makes it fail (or stall, or return a flipped byte) for one shard. The CLI,
# the retries and their logs, the exit code and the files on disk are all real.
_FAULT_SITECUSTOMIZE = '''
import errno, json, os, time
from tfscale.data.stage import stage_copy

_FAULT = json.loads(os.environ["TFSCALE_TEST_FAULT"])  # {"shard", "kind", "times", "bytes"}
_real_read_chunk = stage_copy._read_chunk
_faults_done = 0


def _faulty_read_chunk(fin, buffer):
    global _faults_done
    if os.path.basename(fin.name) != _FAULT["shard"] or _faults_done >= _FAULT["times"]:
        return _real_read_chunk(fin, buffer)
    if _FAULT["kind"] == "flip":  # the read "succeeds" with a wrong byte; counted only when it read data
        n = _real_read_chunk(fin, buffer)
        if n:
            buffer[0] ^= 0xFF
            _faults_done += 1
        return n
    _faults_done += 1
    if _FAULT["kind"] == "stall":  # the first read gets part of the shard, the next hangs (until killed)
        if _faults_done == 1:
            return _real_read_chunk(fin, memoryview(buffer)[:_FAULT["bytes"]])
        time.sleep(600)
    code = getattr(errno, _FAULT["kind"])  # "EIO", "ESTALE", "EACCES", ...
    raise OSError(code, os.strerror(code))


stage_copy._read_chunk = _faulty_read_chunk
'''
_FAST_RETRY_S = 0.001  # --read_retry_delay_s of these tests: the backoff doubles it, a test waits ~ms


def fault_env(tmp_path, shard, kind, times, nbytes=0):
    """Environment of a tool process whose reads of `shard` fault `times` times (see _FAULT_SITECUSTOMIZE)."""
    fault_dir = tmp_path / "fault_injection"
    fault_dir.mkdir(exist_ok=True)
    (fault_dir / "sitecustomize.py").write_text(_FAULT_SITECUSTOMIZE)
    python_path = os.pathsep.join(p for p in (str(fault_dir), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": python_path,
            "TFSCALE_TEST_FAULT": json.dumps({"shard": shard, "kind": kind, "times": times, "bytes": nbytes})}


def assert_staged_copy_verifies(dest, src_dir, splits=("train", "validation")):
    """Every shard the staged manifests list is in dest under its final name, with their size and sha256;
    no temp file is left."""
    for split in splits:
        name = f"manifest-{split}.json"
        assert read(os.path.join(dest, name)) == read(os.path.join(src_dir, name))
        manifest = json.loads(read(os.path.join(dest, name)))
        for entry in manifest["shards"]:
            data = read(os.path.join(dest, entry["name"]))
            assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), entry["name"]
    assert partial_files(dest) == []


def assert_only_verified_files(dest, contents):
    """What is under a final name in dest is a whole, correct shard; no temp file is left."""
    assert all(read(os.path.join(dest, name)) == contents[name] for name in shard_files(dest))
    assert partial_files(dest) == []


def retry_lines(stderr, path):
    return [line for line in stderr.splitlines() if f"reading {path} failed" in line and "retrying in" in line]


def test_a_killed_stage_process_resumes_and_copies_only_what_is_missing(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    order = sorted(n for n in contents if n.startswith("train")) + sorted(n for n in contents if n.startswith("valid"))
    victim = order[2]  # one thread copies in plan order: the two shards before it are done when it stalls
    half_bytes = len(contents[victim]) // 2
    # The victim's first read gets half the shard, its second hangs: the SIGKILL lands mid-copy, every time.
    proc = subprocess.Popen(tool_command(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_threads=1"),
                            env={**os.environ, **fault_env(tmp_path, victim, "stall", 2, half_bytes)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        half_written = wait_for_partial(dest, victim, half_bytes, proc)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert half_written == f"{stage.PARTIAL_PREFIX}{victim}.{proc.pid}"
    assert shard_files(dest) == order[:2]
    done_before = {n: os.stat(os.path.join(dest, n)) for n in order[:2]}

    rerun = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}")
    assert rerun.returncode == 0, rerun.stderr
    assert f"copied {len(order) - 2} files" in rerun.stderr and "(2 already staged)" in rerun.stderr
    assert "partial files of an interrupted staging run" in rerun.stderr
    assert_staged_copy_verifies(dest, src_dir)
    for name, before in done_before.items():  # the same files, not copies of them made again
        after = os.stat(os.path.join(dest, name))
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name


def wait_for_partial(dest, shard, nbytes, proc, timeout_s=30.0):
    """Name of the temp file of `shard` in dest once it holds `nbytes` bytes (the copier stalls there)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        assert proc.poll() is None, f"the tool exited ({proc.returncode}) before the fault: {proc.stderr.read()}"
        if os.path.isdir(dest):
            for name in partial_files(dest):
                if shard in name and os.path.getsize(os.path.join(dest, name)) == nbytes:
                    return name
        time.sleep(0.01)
    raise AssertionError(f"no {nbytes}-byte temp file of {shard} in {dest} after {timeout_s} s")


def test_a_copy_corrupted_by_a_flaky_read_is_copied_again_once(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    victim = "train-00001-of-00004"
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}",
                    env=fault_env(tmp_path, victim, "flip", stage_copy.MISMATCH_RECOPIES))
    assert done.returncode == 0, done.stderr
    again = [line for line in done.stderr.splitlines() if "copying it again" in line]
    assert len(again) == stage_copy.MISMATCH_RECOPIES, done.stderr
    expected = hashlib.sha256(contents[victim]).hexdigest()
    assert os.path.join(src_dir, victim) in again[0] and f"expected sha256 {expected}" in again[0]
    assert f"copied {len(contents)} files" in done.stderr
    assert_staged_copy_verifies(dest, src_dir)


def test_a_copy_that_never_matches_its_manifest_fails_naming_both_checksums(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    victim = "validation-00000-of-00002"
    copies = stage_copy.MISMATCH_RECOPIES + 1
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_threads=1",
                    env=fault_env(tmp_path, victim, "flip", copies))
    assert done.returncode == 1, done.stderr
    flipped = bytes([contents[victim][0] ^ 0xFF]) + contents[victim][1:]  # what the faulty reads return
    expected, observed = hashlib.sha256(contents[victim]).hexdigest(), hashlib.sha256(flipped).hexdigest()
    error = done.stderr.strip().splitlines()[-1]
    assert os.path.join(src_dir, victim) in error and "not staged" in error
    assert f"expected sha256 {expected}" in error and f"observed {observed}" in error
    assert f"in each of {copies} copies" in error and "Traceback" not in done.stderr
    assert victim not in os.listdir(dest)
    assert_only_verified_files(dest, contents)
    assert victim not in json.loads(read(os.path.join(dest, stage.STATE_FILE)))["files"]


@pytest.mark.parametrize("errno_name", ["EIO", "ESTALE"])
def test_transient_read_errors_are_retried_with_backoff(src, tmp_path, errno_name):
    src_dir, _ = src
    dest = str(tmp_path / "local")
    victim = os.path.join(src_dir, "train-00003-of-00004")
    failures = stage_copy.READ_ATTEMPTS - 1  # the last attempt succeeds
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", f"--read_retry_delay_s={_FAST_RETRY_S}",
                    env=fault_env(tmp_path, os.path.basename(victim), errno_name, failures))
    assert done.returncode == 0, done.stderr
    lines = retry_lines(done.stderr, victim)
    assert len(lines) == failures, done.stderr
    assert all(f"({errno_name}: " in line for line in lines)
    delays_s = [float(re.search(r"retrying in (\S+) s", line).group(1)) for line in lines]
    assert delays_s == pytest.approx([_FAST_RETRY_S * 2 ** i for i in range(failures)])
    assert_staged_copy_verifies(dest, src_dir)


def test_a_read_failing_every_attempt_gives_up_naming_path_errno_and_attempts(src, tmp_path):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    victim = os.path.join(src_dir, "train-00002-of-00004")
    attempts = stage_copy.READ_ATTEMPTS
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", f"--read_retry_delay_s={_FAST_RETRY_S}",
                    "--num_threads=1", env=fault_env(tmp_path, os.path.basename(victim), "ESTALE", attempts))
    assert done.returncode == 1, done.stderr
    assert len(retry_lines(done.stderr, victim)) == attempts - 1
    error = done.stderr.strip().splitlines()[-1]
    assert f"reading {victim} failed {attempts} times" in error and "ESTALE" in error
    assert f"of {attempts} attempts" in error and "Traceback" not in done.stderr
    assert os.path.basename(victim) not in shard_files(dest)
    assert_only_verified_files(dest, contents)  # copies already under way when it failed finish, verified
    # The file system is back: the rerun copies the rest and keeps what was staged.
    staged = shard_files(dest)
    rerun = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}")
    assert rerun.returncode == 0, rerun.stderr
    assert f"copied {len(contents) - len(staged)} files" in rerun.stderr
    assert f"({len(staged)} already staged)" in rerun.stderr
    assert_staged_copy_verifies(dest, src_dir)


@pytest.mark.parametrize("errno_name", ["ENOENT", "EACCES"])
def test_other_read_errors_are_not_retried(src, tmp_path, errno_name):
    src_dir, contents = src
    dest = str(tmp_path / "local")
    victim = os.path.join(src_dir, "train-00000-of-00004")
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--num_threads=1",
                    env=fault_env(tmp_path, os.path.basename(victim), errno_name, 1))  # would succeed if retried
    assert done.returncode == 1, done.stderr
    assert retry_lines(done.stderr, victim) == []
    error = done.stderr.strip().splitlines()[-1]
    assert victim in error and os.strerror(getattr(errno, errno_name)) in error and "Traceback" not in done.stderr
    assert os.path.basename(victim) not in shard_files(dest)
    assert_only_verified_files(dest, contents)


# ------------------------------------------------------------------------------- a real small disk

TINY_DISK_BYTES = 2 << 20


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB file system (tmpfs) standing for a node-local disk too small for the shards."""
    with small_file_system(tmp_path / "tiny_disk", str(TINY_DISK_BYTES)) as mount_point:
        yield str(mount_point)


def test_a_real_disk_too_small_fails_before_copying(tiny_disk, tmp_path):
    src_dir = str(tmp_path / "shared")
    contents = write_shards(src_dir, "train", 3, shard_bytes=1 << 20)
    dest = os.path.join(tiny_disk, "local")
    done = run_tool(f"--src_dir={src_dir}", f"--dest_dir={dest}", "--splits=train")
    assert done.returncode == 1, done.stderr
    needed = sum(len(c) for c in contents.values()) + os.path.getsize(os.path.join(src_dir, "manifest-train.json"))
    free = shutil.disk_usage(tiny_disk).free  # nothing written since the check (the lock file came before it)
    assert needed > free
    error = done.stderr.strip().splitlines()[-1]
    assert f"not enough space in {dest}" in error and f"needs {needed} bytes" in error
    assert f"only {free} bytes" in error and "Traceback" not in done.stderr
    assert shard_files(dest) == [] and partial_files(dest) == []
    assert not any("manifest" in n for n in os.listdir(dest))


def test_a_full_disk_while_copying_is_not_retried(tiny_disk, tmp_path, monkeypatch, caplog):
    """ENOSPC when the disk fills anyway (another job wrote to it after the check): fail at once, cleanly."""
    src_dir = str(tmp_path / "shared")
    contents = write_shards(src_dir, "train", 3, shard_bytes=1 << 20)
    dest = os.path.join(tiny_disk, "local")
    monkeypatch.setattr(stage_copy, "_free_bytes", lambda path: 1 << 40)  # the check saw space
    with pytest.raises(OSError) as e:
        stage.stage(src_dir, dest, splits=["train"], num_threads=1)
    assert e.value.errno == errno.ENOSPC and dest in str(e.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    assert shard_files(dest) == ["train-00000-of-00003"] and partial_files(dest) == []
    assert read(os.path.join(dest, "train-00000-of-00003")) == contents["train-00000-of-00003"]
