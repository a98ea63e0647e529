"""Faults a long cluster job meets, through real training processes: what happens, what is printed, what is kept.

Each test drives `tfscale.launch` (2 workers on 127.0.0.1 unless the row is about another count)
with tests/helpers/train_and_dump.py, which is `tfscale.train` plus fault options (stop, SIGTERM at
an exact point). The matrix these rows belong to is docs/reliability.md; start-up faults are in
tests/test_startup_faults.py, staging faults in tests/test_stage.py.
"""

import concurrent.futures
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from conftest import REPO, checkpoint_values, classic_example, load_config, quiet_env, read_jsonl, small_file_system

from tfscale.model import schedules
from tfscale.workdir import layout

DRIVER = os.path.join(REPO, "tests", "helpers", "train_and_dump.py")
# The smoke recipe: 20 steps an epoch of global batch 32, eval every 30 steps, checkpoint every 20.
SMOKE = ["--config=configs/smoke.py", "--config.train.log_every_steps=10"]

pytestmark = pytest.mark.slow


def launch_command(tmp_path, workdir_, num_workers, *args, backend="mwms", faults=(), launcher=()):
    """`launcher`: more tfscale.launch flags (before the `--`)."""
    weights = os.path.join(tmp_path, "w{rank}.npz")  # the driver's own file per worker
    return [sys.executable, "-m", "tfscale.launch", f"--num_workers={num_workers}", "--threads_per_worker=1",
            f"--backend={backend}", *launcher, "--", DRIVER, weights, *faults, *SMOKE, f"--workdir={workdir_}",
            f"--config.distribute.backend={backend}", *args]


def launch(tmp_path, workdir_, num_workers, *args, backend="mwms", faults=(), launcher=(), timeout_s=300):
    """Runs the launch to its end; CompletedProcess with stdout and stderr in `.stdout`."""
    command = launch_command(tmp_path, workdir_, num_workers, *args, backend=backend, faults=faults, launcher=launcher)
    return subprocess.run(command, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout_s)


def rows(workdir_, kind="loss"):
    path = os.path.join(workdir_, layout.METRICS)
    return [r for r in read_jsonl(path) if kind in r] if os.path.exists(path) else []


def steps_of(workdir_, kind="loss"):
    return [r["step"] for r in rows(workdir_, kind)]


def summary(workdir_):
    with open(os.path.join(workdir_, layout.SUMMARY)) as f:
        return json.load(f)


def saved_steps(output):
    return [int(line.split("checkpoint saved at step ")[1].split(";")[0]) for line in output.splitlines()
            if "checkpoint saved at step" in line]


def latest_checkpoint_step(workdir_):
    path = os.path.join(workdir_, layout.CHECKPOINTS, "checkpoint")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(f.readline().split('"ckpt-')[1].split('"')[0])


def data_file(workdir_, step):
    return os.path.join(workdir_, layout.CHECKPOINTS, f"ckpt-{step}.data-00000-of-00001")


def truncate_to_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def wait_for(condition, proc, what, timeout_s=180):
    deadline = time.time() + timeout_s
    while not condition():
        assert proc.poll() is None, f"process ended (code {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def trained_40(tmp_path_factory):
    """A 2-worker run stopped after 40 steps (checkpoints 20 and 40, eval at 30): copy it, don't change it."""
    root = tmp_path_factory.mktemp("trained_40")
    result = launch(root, root / "run", 2, faults=["--stop_after_step=40"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert latest_checkpoint_step(root / "run") == 40
    return root / "run"


def copy_of(trained, tmp_path):
    destination = tmp_path / "run"
    shutil.copytree(trained, destination)
    return destination


# --- 1. a checkpoint that cannot be read ----------------------------------------------------------


def test_unreadable_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(trained_40, tmp_path):
    run = copy_of(trained_40, tmp_path)
    truncate_to_half(data_file(run, 40))  # as a node crash can leave a file on a parallel file system
    result = launch(tmp_path, run, 2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"skipping checkpoint {run}/checkpoints/ckpt-40: it cannot be restored" in result.stdout
    assert f"resumed from {run}/checkpoints/ckpt-20 at step 20" in result.stdout
    assert steps_of(run) == [10, 20, 30, 40, 50, 60]  # 30 and 40 logged again, once
    assert steps_of(run, "eval_top1") == [30, 60] and summary(run)["steps"] == 60


def test_no_usable_checkpoint_stops_naming_each_and_deletes_nothing(trained_40, tmp_path):
    run = copy_of(trained_40, tmp_path)
    for step in (20, 40):
        truncate_to_half(data_file(run, step))
    before = {name: os.path.getsize(run / layout.CHECKPOINTS / name) for name in os.listdir(run / layout.CHECKPOINTS)}
    result = launch(tmp_path, run, 2)
    assert result.returncode == 1, result.stdout[-3000:]
    assert (f"no usable checkpoint in {run}/checkpoints: {run}/checkpoints/ckpt-40 (" in result.stdout
            and f"; {run}/checkpoints/ckpt-20 (" in result.stdout and "Nothing was deleted" in result.stdout)
    assert "Traceback" not in result.stdout
    assert {name: os.path.getsize(run / layout.CHECKPOINTS / name) for name in os.listdir(run / layout.CHECKPOINTS)} == before


def test_files_a_killed_save_leaves_are_ignored(trained_40, tmp_path):
    """What kill -9 during a save leaves (TensorFlow lists a checkpoint only once its files are whole)."""
    run = copy_of(trained_40, tmp_path)
    os.makedirs(run / layout.CHECKPOINTS / "ckpt-60_temp")
    (run / layout.CHECKPOINTS / "ckpt-60_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 1000)
    (run / layout.CHECKPOINTS / "ckpt-60.data-00000-of-00001").write_bytes(b"\0" * 1000)  # merged part-way, no index
    result = launch(tmp_path, run, 2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from {run}/checkpoints/ckpt-40 at step 40" in result.stdout
    assert summary(run)["steps"] == 60 and latest_checkpoint_step(run) == 60


def test_chief_killed_in_the_middle_of_a_save_resumes_from_the_checkpoint_before(tmp_path):
    """A real kill -9 while TensorFlow writes ckpt-20 (ResNet-18's 86 MB take long enough to be caught), from
    the host copy of an asynchronous save (checkpoint.async_save, the default) while the steps go on."""
    run = tmp_path / "run"
    # 30 steps (ResNet-18's are slow on a CPU), a checkpoint every 10: the save of step 20 is a mid-run one.
    command = [sys.executable, "-m", "tfscale.train", *SMOKE, f"--workdir={run}", "--config.model.name=resnet18",
               "--config.train.epochs=1.5", "--config.checkpoint.every_epochs=0.5"]
    proc = subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(run / layout.CHECKPOINTS / "ckpt-20_temp"), proc, "the save of step 20", timeout_s=300)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert latest_checkpoint_step(run) == 10  # ckpt-20 was never listed
    rerun = subprocess.run(command, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/ckpt-10 at step 10" in rerun.stderr
    assert summary(run)["steps"] == 30 and steps_of(run) == [10, 20, 30]


# --- 2. disk full ---------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB file system to fill."""
    with small_file_system(tmp_path / "disk", "8m") as mount_point:
        yield mount_point


def fill(directory, leave_bytes=0):
    """Fills the file system of `directory` (another job's output), leaving about `leave_bytes`."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (b"\0" * (1 << 16), b"\0" * (1 << 12)):
            try:
                while os.write(fd, chunk) == len(chunk):
                    pass
            except OSError:  # ENOSPC
                pass
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave_bytes))
    finally:
        os.close(fd)
    return path


def start(tmp_path, run, num_workers, *args, faults=()):
    log = open(tmp_path / f"launch-{time.time()}.log", "w+")
    proc = subprocess.Popen(launch_command(tmp_path, run, num_workers, *args, faults=faults), cwd=REPO,
                            env=quiet_env(), stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def finish(proc, log, timeout_s=300):
    code = proc.wait(timeout=timeout_s)
    log.seek(0)
    return code, log.read()


def test_full_disk_names_the_path_and_keeps_every_earlier_file(small_disk, tmp_path):
    run = small_disk / "run"
    # 1. The checkpoint at step 40 finds the disk full (no log row before it: the save is the first write).
    proc, log = start(tmp_path, run, 2, "--config.train.log_every_steps=1000", "--config.train.eval_every_epochs=10")
    wait_for(lambda: latest_checkpoint_step(run) == 20, proc, "the checkpoint of step 20")
    filler = fill(small_disk, leave_bytes=64 << 10)
    code, output = finish(proc, log)
    assert code == 74, output[-3000:]
    assert f"could not write {run}/checkpoints/ckpt-40: " in output and "MiB free of 8.0 MiB" in output
    assert latest_checkpoint_step(run) == 20 and not [n for n in os.listdir(run / layout.CHECKPOINTS) if "ckpt-40" in n]

    # 2. Resumed with space for its start, a metrics row finds the disk full: the file keeps whole lines.
    os.remove(filler)
    proc, log = start(tmp_path, run, 1, "--config.train.log_every_steps=5", "--config.train.eval_every_epochs=10")
    wait_for(lambda: steps_of(run)[-1:] == [25], proc, "the resumed run's first row")
    fill(small_disk)
    code, output = finish(proc, log)
    assert code == 74, output[-3000:]
    # A row's bytes may still fit in the last page of metrics.jsonl: then TensorBoard's or the next
    # checkpoint's write is the one that fails.
    assert re.search(rf"could not write {run}/(metrics.jsonl|tensorboard/train|tensorboard/validation|"
                     rf"checkpoints/ckpt-40): .*No space left on "
                     r"device.* \(0\.\d MiB free of 8\.0 MiB on that file system\); exit code 74", output)
    with open(run / layout.METRICS) as f:
        text = f.read()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())

    # 3. Space again: the run finishes from its last checkpoint, no step logged twice.
    os.remove(run.parent / "filler")
    result = launch(tmp_path, run, 1, "--config.train.log_every_steps=5", "--config.train.eval_every_epochs=10")
    assert result.returncode == 0, result.stdout[-3000:]
    assert steps_of(run) == sorted(set(steps_of(run))) and steps_of(run)[-1] == 60
    assert summary(run)["steps"] == 60


# --- 3. config changed between runs ---------------------------------------------------------------


def test_changed_recipe_is_refused_on_every_worker_and_safe_changes_are_recorded(trained_40, tmp_path):
    run = copy_of(trained_40, tmp_path)
    with open(run / layout.CONFIG) as f:
        config_before = f.read()
    refused = launch(tmp_path, run, 2, "--config.optim.lr_per_256=1.6", "--config.data.global_batch_size=64")
    assert refused.returncode == 1, refused.stdout[-3000:]
    assert ("config.data.global_batch_size: 32 -> 64; config.optim.lr: 0.1 -> 0.4; config.optim.lr_per_256: 0.8 -> 1.6"
            in refused.stdout)
    assert "[rank 1]" in refused.stdout and "the chief (rank 0) refused the workdir (exit code 1)" in refused.stdout
    assert open(run / layout.CONFIG).read() == config_before and latest_checkpoint_step(run) == 40

    safe = launch(tmp_path, run, 2, "--config.train.epochs=4", "--config.checkpoint.max_to_keep=5")
    assert safe.returncode == 0, safe.stdout[-3000:]
    [change] = read_jsonl(run / layout.HISTORY)
    assert change["changes"] == {"checkpoint.max_to_keep": {"from": 3, "to": 5}, "train.epochs": {"from": 3.0, "to": 4.0}}
    assert summary(run)["steps"] == 80

    forced = launch(tmp_path, run, 2, "--config.train.epochs=5", "--config.checkpoint.max_to_keep=5",
                    "--config.optim.weight_decay=0.0", "--config.resume.allow_config_changes=True")
    assert forced.returncode == 0, forced.stdout[-3000:]
    assert read_jsonl(run / layout.HISTORY)[-1]["forced"] is True and summary(run)["steps"] == 100


# --- 4 + 5. two jobs in one workdir; a killed job's lock and replayed rows --------------------------


def test_second_job_is_refused_and_a_killed_jobs_lock_and_replayed_rows_are_cleared(tmp_path):
    run = tmp_path / "run"
    long_run = ["--config.train.epochs=500", "--config.checkpoint.every_epochs=2"]  # checkpoints every 40 steps
    first, log = start(tmp_path, run, 2, *long_run)
    wait_for(lambda: latest_checkpoint_step(run) >= 40, first, "the first checkpoint")
    holder = json.load(open(run / layout.LOCK))
    config_before = open(run / layout.CONFIG).read()

    started = time.time()
    second = launch(tmp_path, run, 1, *long_run)
    assert second.returncode == 73, second.stdout[-3000:]
    assert f"in use by pid {holder['pid']} on host {socket.gethostname()}" in second.stdout
    print(f"second job refused after {time.time() - started:.1f} s")
    assert first.poll() is None and open(run / layout.CONFIG).read() == config_before  # the first job unharmed

    # kill -9 the chief between two checkpoints, with rows logged after the last one
    wait_for(lambda: steps_of(run) and steps_of(run)[-1] % 40 == 10, first, "a row after a checkpoint")
    os.kill(holder["pid"], signal.SIGKILL)
    finish(first, log)
    last_checkpoint, last_row = latest_checkpoint_step(run), steps_of(run)[-1]
    assert last_row > last_checkpoint
    epochs = last_checkpoint // 20 + 1  # one more epoch than the checkpoint holds

    third = launch(tmp_path, run, 2, f"--config.train.epochs={epochs}", "--config.checkpoint.every_epochs=2")
    assert third.returncode == 0, third.stdout[-3000:]
    assert f"taking over the workdir lock of pid {holder['pid']} on host {socket.gethostname()}" in third.stdout
    assert f"its process {holder['pid']} on this host no longer exists" in third.stdout
    assert f"metrics.jsonl: resuming at step {last_checkpoint}, dropped" in third.stdout
    logged = rows(run)
    assert [r["step"] for r in logged] == list(range(10, epochs * 20 + 1, 10))  # each step once
    assert all(a["time"] <= b["time"] for a, b in zip(logged, logged[1:]))  # wall clock on every row
    assert not os.path.exists(run / layout.LOCK)  # released at the end


# --- 9. SIGTERM during a checkpoint save, during eval, twice ----------------------------------------


def test_sigterm_at_a_save_and_twice_during_eval_gives_one_checkpoint_each_and_exit_75(tmp_path):
    run = tmp_path / "run"
    # rank 1 is signalled right before the save of step 20: the save completes, the next loop stops at 30
    first = launch(tmp_path, run, 2, faults=["--sigterm_at_step=20:1"])
    assert first.returncode == 75, first.stdout[-3000:]
    assert saved_steps(first.stdout) == [30, 30] and latest_checkpoint_step(run) == 30
    assert steps_of(run, "eval_top1") == []  # stopped at 30 before its eval

    # the rerun first runs the eval of step 30 that was missed; rank 0 gets SIGTERM twice during it. Its first
    # loop is one step (the one whose compile time a line reports), so both save at 31.
    second = launch(tmp_path, run, 2, faults=["--sigterm_in_eval=0"])
    assert second.returncode == 75, second.stdout[-3000:]
    assert saved_steps(second.stdout) == [31, 31] and latest_checkpoint_step(run) == 31
    assert second.stdout.count("SIGTERM: saving a checkpoint after this step") == 1  # the repeat is harmless

    third = launch(tmp_path, run, 2)
    assert third.returncode == 0, third.stdout[-3000:]
    assert steps_of(run) == [10, 20, 30, 40, 50, 60] and steps_of(run, "eval_top1") == [30, 60]


# --- 12. the launcher killed ---------------------------------------------------------------------


def children_of(pid):
    """Pids of the live processes whose parent is `pid` (a zombie counts as gone)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_launcher_killed_mid_training_takes_its_workers_with_a_checkpoint_and_the_rerun_resumes(tmp_path):
    """kill -9 of tfscale-launch (the OOM killer, a closed terminal): every worker ends within the grace
    period, checkpointing at one step, its last lines in the launcher's log file; the same command resumes."""
    run = tmp_path / "run"
    proc, log = start(tmp_path, run, 2)
    try:
        wait_for(lambda: latest_checkpoint_step(run) == 20, proc, "the checkpoint of step 20")
        workers = children_of(proc.pid)
        proc.kill()
        proc.wait()
        killed_at = time.time()
        assert len(workers) == 2, workers
        while any(alive(pid) for pid in workers) and time.time() < killed_at + 60:
            time.sleep(0.05)
        gone_after_s = time.time() - killed_at
    finally:
        for pid in children_of(proc.pid) + [p for p in workers if alive(p)]:
            os.kill(pid, signal.SIGKILL)
    assert not [pid for pid in workers if alive(pid)], f"workers alive {gone_after_s:.0f} s after the launcher died"
    print(f"both workers gone {gone_after_s:.1f} s after kill -9 of the launcher")
    _, output = finish(proc, log)
    assert output.count(f"tfscale: the launcher (pid {proc.pid}) is gone; stopping this worker with SIGTERM") == 2
    assert "SIGTERM: saving a checkpoint after this step" in output and "sending SIGKILL" not in output
    stopped_at = saved_steps(output)[-1]
    assert 20 < stopped_at < 60 and saved_steps(output).count(stopped_at) == 2, output[-3000:]
    assert latest_checkpoint_step(run) == stopped_at and not os.path.exists(run / layout.LOCK)

    rerun = launch(tmp_path, run, 2)  # the same command
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"resumed from {run}/checkpoints/ckpt-{stopped_at} at step {stopped_at}" in rerun.stdout
    assert steps_of(run) == [10, 20, 30, 40, 50, 60] and summary(run)["steps"] == 60


# --- 11. requeued on fewer or more workers --------------------------------------------------------


@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_resume_on_fewer_then_more_workers_continues_step_lr_and_data(tmp_path, backend):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow", reason="Horovod is not built (make horovod)")
    run = tmp_path / "run"
    for num_workers, stop in ((2, 20), (1, 40), (2, None)):
        result = launch(tmp_path, run, num_workers, backend=backend,
                        faults=[f"--stop_after_step={stop}"] if stop else [])
        assert result.returncode == 0, result.stdout[-3000:]
        assert f"replicas={num_workers}" in result.stdout
        if num_workers != 2 or stop is None:
            assert f"resumed from {run}/checkpoints/ckpt-{40 if stop is None else 20} at step" in result.stdout
    cfg = load_config("smoke")
    lr = schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=20, total_steps=60, num_replicas=2)
    logged = rows(run)
    assert [r["step"] for r in logged] == [10, 20, 30, 40, 50, 60]
    for row in logged:  # the LR of the step just taken: the schedule continued across worker counts
        assert row["lr"] == pytest.approx(lr(row["step"] - 1), rel=1e-6)
    final = summary(run)
    assert final["steps"] == 60 and final["num_workers"] == 2 and final["global_batch_size"] == 32
    with np.load(tmp_path / "w0.npz") as w0, np.load(tmp_path / "w1.npz") as w1:
        for key in w0.files:
            np.testing.assert_array_equal(w0[key], w1[key])  # the workers agree after the resume

    refused = launch(tmp_path, run, 3, backend=backend, faults=["--stop_after_step=80"], timeout_s=180)
    assert refused.returncode == 1
    assert "config.data.global_batch_size=32 cannot be split evenly over 3 replicas" in refused.stdout


# --- 6. corrupt image inside a valid shard -------------------------------------------------------


def jpeg_as(image, mode, fmt):
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).convert(mode).save(buffer, fmt)
    return buffer.getvalue()


def write_shards(photo_dir, out_dir, split, num_shards, bad=None):
    """Classic (build_imagenet_data.py-style, no manifest) shards of a photo tree, examples round-robin;
    `bad`: {(shard, record index in it): encoded bytes} put in place of those records' images."""
    import tensorflow as tf

    synsets = sorted(os.listdir(photo_dir))
    examples = [(label, synset, name) for label, synset in enumerate(synsets, start=1)
                for name in sorted(os.listdir(os.path.join(photo_dir, synset)))]
    shards = [[] for _ in range(num_shards)]
    for i, (label, synset, name) in enumerate(examples):
        image = tf.io.decode_image(open(os.path.join(photo_dir, synset, name), "rb").read(), channels=3).numpy()
        shard = shards[i % num_shards]
        # Formats other converters leave under .JPEG names: CMYK JPEGs, PNGs (valid: they must train).
        encoded = jpeg_as(image, "CMYK", "JPEG") if i % 7 == 3 else jpeg_as(image, "RGB", "PNG" if i % 7 == 5 else "JPEG")
        encoded = (bad or {}).get((i % num_shards, len(shard)), encoded)
        shard.append(classic_example(encoded, image.shape[0], image.shape[1], label, synset, name, []))
    for index, records in enumerate(shards):
        with tf.io.TFRecordWriter(os.path.join(out_dir, f"{split}-{index:05d}-of-{num_shards:05d}")) as writer:
            for record in records:
                writer.write(record)
    return len(examples)


@pytest.fixture(scope="module")
def shards_with_bad_images(tmp_path_factory):
    """Real-photo shards whose framing is whole: train shard 1 holds a JPEG cut short (record 2) and
    bytes that are no image (record 4); a second directory's validation shard holds a bad record too."""
    from test_shard_layouts import make_photo_tree

    root = tmp_path_factory.mktemp("bad_images")
    good = open(os.path.join(make_photo_tree(root / "train", 8, seed=4), sorted(os.listdir(root / "train"))[0],
                             sorted(os.listdir(os.path.join(root / "train", sorted(os.listdir(root / "train"))[0])))[0]),
                "rb").read()
    bad = {(1, 2): good[: len(good) // 2], (1, 4): b"this is not an image" * 20}
    train_dir, eval_bad_dir = root / "shards", root / "shards_bad_eval"
    os.makedirs(train_dir), os.makedirs(eval_bad_dir)
    num_train = write_shards(root / "train", train_dir, "train", 2, bad=bad)
    num_eval = write_shards(make_photo_tree(root / "val", 5, seed=5), train_dir, "validation", 1)
    write_shards(root / "train", eval_bad_dir, "train", 2)
    write_shards(root / "val", eval_bad_dir, "validation", 1, bad={(0, 6): good[:300]})
    return {"train_bad": train_dir, "eval_bad": eval_bad_dir, "num_train": num_train, "num_eval": num_eval}


# For the launches a corrupt image ends: the other worker may be waiting in a collective its failed peer never
# joins, where it cannot act on the launcher's SIGTERM, and then waits out the launcher's whole grace period
# (10 s by default) before the SIGKILL; nothing here reads how that worker ends.
SHORT_GRACE = ["--grace_period_s=1"]


def on_shards(data, data_dir, *extra):
    return ["--config.data.dataset=tfrecord", f"--config.data.data_dir={data_dir}", "--config.data.label_offset=1",
            f"--config.data.num_train_examples={data['num_train']}", f"--config.data.num_eval_examples={data['num_eval']}",
            "--config.data.num_classes=3", "--config.data.global_batch_size=8", "--config.data.shuffle_buffer=4",
            "--config.train.epochs=3", "--config.train.log_every_steps=3", "--config.train.eval_every_epochs=3",
            *extra]


def test_corrupt_train_image_stops_naming_shard_and_record_or_is_skipped_and_counted(shards_with_bad_images, tmp_path):
    data = shards_with_bad_images
    shard = data["train_bad"] / "train-00001-of-00002"
    stopped = launch(tmp_path, tmp_path / "run", 2, *on_shards(data, data["train_bad"]), launcher=SHORT_GRACE)
    assert stopped.returncode == 65, stopped.stdout[-3000:]
    assert f"corrupt image: {shard}: record 2 (" in stopped.stdout and f"; {shard}: record 4 (" in stopped.stdout
    assert "--config.data.skip_corrupt_images=True" in stopped.stdout
    assert "Traceback" not in "".join(line for line in stopped.stdout.splitlines() if line.startswith("[rank 1]"))

    skipped = launch(tmp_path, tmp_path / "run", 2, *on_shards(data, data["train_bad"]),
                     "--config.data.skip_corrupt_images=True")
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    final = summary(tmp_path / "run")
    # Worker 1 reads shard 1 once per pass, 3 passes at least: the record that is no image fails every
    # time; the JPEG cut short only when the step's random crop reaches below the cut (records prepared
    # ahead of the last step count too, several passes of so small a shard).
    assert final["steps"] == 3 * data["num_train"] // 8 and final["corrupt_images_skipped"] >= 3
    counts = [r["corrupt_images_skipped"] for r in rows(tmp_path / "run")]
    assert counts == sorted(counts) and counts[0] >= 1 and "corrupt image(s) skipped so far" in skipped.stdout
    assert final["eval_top1"] >= 0  # eval of every validation image (CMYK and PNG among them) ran


def test_corrupt_eval_image_always_stops_naming_it(shards_with_bad_images, tmp_path):
    data = shards_with_bad_images
    result = launch(tmp_path, tmp_path / "run", 2, *on_shards(data, data["eval_bad"]),
                    "--config.data.skip_corrupt_images=True", launcher=SHORT_GRACE)
    assert result.returncode == 65, result.stdout[-3000:]
    assert f"corrupt image: {data['eval_bad']}/validation-00000-of-00001: record 6 (" in result.stdout
    assert "Evaluation never skips an image" in result.stdout


def test_corrupt_image_read_by_dali_stops_naming_shard_and_record(shards_with_bad_images, tmp_path):
    """DALI names the first image it cannot decode by byte offset; the run names every bad record, as with tf.data."""
    pytest.importorskip("tfscale.data.input.dali", reason="NVIDIA DALI is not installed: `make dali` (make test runs it)")
    data = shards_with_bad_images
    shard = data["train_bad"] / "train-00001-of-00002"
    stopped = launch(tmp_path, tmp_path / "run", 2, *on_shards(data, data["train_bad"]), "--config.data.loader=dali",
                     launcher=SHORT_GRACE)
    assert stopped.returncode == 65, stopped.stdout[-3000:]
    assert f"corrupt image: {shard}: record 2 (" in stopped.stdout and f"; {shard}: record 4 (" in stopped.stdout
    assert "--config.data.loader=tfdata --config.data.skip_corrupt_images=True (DALI cannot skip them)" in stopped.stdout
    result = launch(tmp_path, tmp_path / "eval_run", 2, *on_shards(data, data["eval_bad"]), "--config.data.loader=dali",
                    launcher=SHORT_GRACE)
    assert result.returncode == 65, result.stdout[-3000:]
    assert f"corrupt image: {data['eval_bad']}/validation-00000-of-00001: record 6 (" in result.stdout


# --- 10. kill -9 of a worker in the pre-flight all-reduce, during restore, during eval ---------------


@pytest.fixture
def uninterrupted_60(tmp_path):
    """A 2-worker smoke run of 60 steps that nothing interrupts, started at once: it runs while the test waits
    out its survivors' timeouts. Calling it waits for the run and returns the values of its final checkpoint."""
    root = tmp_path / "uninterrupted"
    os.makedirs(root)
    proc, log = start(root, root / "run", 2)

    def final_checkpoint():
        code, output = finish(proc, log)
        assert code == 0, output[-3000:]
        return checkpoint_values(root / "run")

    yield final_checkpoint
    if proc.poll() is None:  # the test failed before it read the run
        proc.kill()
        proc.wait()


def test_worker_killed_in_preflight_restore_or_eval_ends_the_job_in_bounded_time_and_resume_is_exact(
        uninterrupted_60, tmp_path):
    """No launcher here: the survivor must notice by itself (as under srun), within the timeouts."""
    from test_multiworker import read_log, start_workers

    run = tmp_path / "run"
    detect = ["--config.distribute.heartbeat_timeout_s=5", "--config.distribute.connect_timeout_s=30"]
    exit_times = {}
    # eval: at step 30, after the checkpoint of step 20; restore: the rerun, from that checkpoint
    for phase in ("preflight", "eval", "restore"):
        procs, _ = start_workers([DRIVER, str(tmp_path / "w{rank}.npz"), f"--hang_at={phase}:1", *SMOKE,
                                  f"--workdir={run}", "--config.distribute.backend=mwms", *detect], 2, tmp_path)
        try:
            marker = tmp_path / f"w1_hanging-{phase}"
            wait_for(lambda: marker.exists() and marker.read_text(), procs[0], f"rank 1 stopping in {phase}")
            procs[1].kill()
            killed_at = time.time()
            code = procs[0].wait(timeout=120)
            exit_times[phase] = time.time() - killed_at
        finally:
            for proc in procs:
                proc.kill()
        assert code != 0, read_log(tmp_path, 0)[-3000:]
        assert exit_times[phase] < 60, f"{phase}: the survivor took {exit_times[phase]:.0f} s to exit"
        exit_times[phase] = f"{exit_times[phase]:.1f} s (exit {code})"
    print(f"survivor exited after kill -9 of rank 1: {exit_times}")

    final = launch(tmp_path, run, 2, *detect)
    assert final.returncode == 0, final.stdout[-3000:]
    assert f"resumed from {run}/checkpoints/ckpt-20 at step 20" in final.stdout
    assert steps_of(run) == [10, 20, 30, 40, 50, 60] and steps_of(run, "eval_top1") == [30, 60]
    resumed, uninterrupted = checkpoint_values(run), uninterrupted_60()
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():  # the same weights and slots as without the kills
        np.testing.assert_allclose(resumed[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


# --- 13. a hung peer -----------------------------------------------------------------------------

# How long the job waits for the stopped worker: the value the kill -9 test above, test_multiworker and
# test_startup_faults run their workers with (tfscale's own heartbeat then beats every second).
HEARTBEAT_TIMEOUT_S = 5
LAUNCHER_GRACE_S = 1  # the launcher SIGKILLs the stopped worker this long after the other one ended
# What detection may take beyond the timeout: TensorFlow's coordination service and tfscale's heartbeat both
# check a few times per timeout, then the error path runs on a loaded 2-core host.
HUNG_PEER_MARGIN_S = 12


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's worker `rank` (Linux /proc: its children and their TFSCALE_LOCAL_RANK)."""
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        with open(f"/proc/{launcher_pid}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                with open(f"/proc/{pid}/environ", "rb") as env:
                    if f"TFSCALE_LOCAL_RANK={rank}".encode() in env.read().split(b"\0"):
                        return pid
    raise AssertionError(f"no worker {rank} under launcher {launcher_pid}")


def hung_peer_command(backend, run):
    return [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1",
            f"--backend={backend}", f"--grace_period_s={LAUNCHER_GRACE_S}", "--", "-m", "tfscale.train", *SMOKE,
            f"--workdir={run}", "--config.train.epochs=3", "--config.checkpoint.every_epochs=0.5",
            f"--config.distribute.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]


def run_hung_peer_job(backend, stopped, root, both_ended):
    """A job whose worker `stopped` gets SIGSTOP once the first checkpoint is listed, timed from the SIGSTOP to
    the launcher's end; then, once `both_ended` (a barrier with the job beside it) is passed, the same command
    again. Returns what the test reads."""
    run = root / "run"
    command = hung_peer_command(backend, run)
    log_path = root / "hung.log"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT)
            stopped_pid = None
            try:
                wait_for(lambda: latest_checkpoint_step(run) >= 10, proc, "the first checkpoint")
                stopped_pid = worker_pid(proc.pid, stopped)
                os.kill(stopped_pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
                code = proc.wait(timeout=HEARTBEAT_TIMEOUT_S + LAUNCHER_GRACE_S + 120)
                elapsed_s = time.monotonic() - stopped_at
            finally:
                proc.kill()
                if stopped_pid is not None:
                    try:
                        os.kill(stopped_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    except BaseException:
        both_ended.abort()  # the job beside it need not wait for this one
        raise
    job = types.SimpleNamespace(run=run, code=code, elapsed_s=elapsed_s, output=log_path.read_text(),
                                saved=latest_checkpoint_step(run))
    try:
        both_ended.wait(timeout=600)
    except threading.BrokenBarrierError:
        pass  # the other job failed: its own test says how
    job.rerun = subprocess.run(command, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=300)
    return job


@pytest.fixture(scope="module")
def hung_peer_jobs(tmp_path_factory):
    """The jobs of the test below, {(backend, stopped worker): future of `run_hung_peer_job`}. A backend's two
    jobs run side by side, so that one waits out its timeout while the other one trains, not on an idle host;
    their reruns start once both jobs have ended, so no rerun runs beside a job's timed end. Made for the first
    test that reads it, which is so over the 90 s budget (docs/testing.md): four jobs and their four reruns."""
    try:
        import horovod.tensorflow  # noqa: F401
        backends = ["mwms", "horovod"]
    except ImportError:
        backends = ["mwms"]  # the Horovod rows skip
    jobs = {}
    for backend in backends:
        both_ended = threading.Barrier(2)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # leaves once both are done
            for stopped in (1, 0):
                root = tmp_path_factory.mktemp(f"hung-{backend}-{stopped}")
                jobs[backend, stopped] = pool.submit(run_hung_peer_job, backend, stopped, root, both_ended)
    return jobs


@pytest.mark.parametrize("backend, stopped", [("mwms", 1), ("horovod", 1), ("mwms", 0), ("horovod", 0)])
def test_a_hung_peer_ends_the_job_in_bounded_time_with_one_line_and_the_rerun_resumes(backend, stopped,
                                                                                     hung_peer_jobs):
    """SIGSTOP of one worker mid-training (a hung node, not a dead one; worker 0 also hosts MWMS's coordination
    service and writes the checkpoints): the other ends within the heartbeat timeout plus a margin, with exit
    code 69 and one line naming the stopped worker, the timeout and the last checkpoint; the checkpoint reads
    back and the rerun resumes from it."""
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    job = hung_peer_jobs[backend, stopped].result()  # raises what failed in the job
    run, code, elapsed_s, output, saved = job.run, job.code, job.elapsed_s, job.output, job.saved
    assert code == 69, output[-3000:]
    print(f"{backend}: the job ended {elapsed_s:.1f} s after worker {stopped} stopped (exit {code})")
    assert elapsed_s < HEARTBEAT_TIMEOUT_S + LAUNCHER_GRACE_S + HUNG_PEER_MARGIN_S, output[-3000:]
    survivor = 1 - stopped
    said = [line for line in output.splitlines() if line.startswith(f"[rank {survivor}]") and "stopped answering" in line]
    assert len(said) == 1, output[-3000:]
    assert f"worker {stopped} " in said[0] and (
        f"stopped answering: no heartbeat for distribute.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S} s" in said[0]), said
    assert f"The last checkpoint is step {saved} " in said[0] and "rerun the same command to resume" in said[0]
    assert said[0].endswith("(exit code 69)") and "Traceback" not in output
    # The checkpoint it named is whole: the same command resumes from it and finishes.
    rerun = job.rerun
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"resumed from {run / layout.CHECKPOINTS / f'ckpt-{saved}'}" in rerun.stdout
    assert summary(run)["steps"] == 60
