"""The workdir's guards without TensorFlow: the lock, the resume-config check, metrics trimming, whole-line appends.

The same behaviours through real training processes are in tests/test_reliability.py.
"""

import json
import os
import socket
import subprocess
import sys
import time

import ml_collections
import pytest
from conftest import read_jsonl, small_file_system

from tfscale import errors, io
from tfscale.config import ConfigError, base_config
from tfscale.workdir import guards, layout


def resume_cfg(allow=False, stale_after_s=120.0):
    return ml_collections.ConfigDict({"allow_config_changes": allow, "lock_stale_after_s": stale_after_s})


def write_lock(path, **holder):
    with open(os.path.join(path, layout.LOCK), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                   "slurm_job_id": "", "slurm_restart_count": "0", **holder}, f)


@pytest.fixture
def live_pid():
    """A process of this host that stays alive during the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_second_holder_is_refused_naming_host_and_pid(tmp_path, live_pid):
    write_lock(tmp_path, pid=live_pid, slurm_job_id="4242")
    with pytest.raises(guards.WorkdirBusy, match=rf"in use by pid {live_pid} on host {socket.gethostname()}, "
                                                  r"Slurm job 4242, since \d{4}-"):
        guards.acquire(str(tmp_path), stale_after_s=120)
    assert json.load(open(tmp_path / layout.LOCK))["pid"] == live_pid  # the holder's lock untouched


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, pid=dead.pid)
    lock = guards.acquire(str(tmp_path), stale_after_s=120)
    assert json.load(open(tmp_path / layout.LOCK))["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(tmp_path / layout.LOCK)


def test_lock_of_an_exited_process_nobody_reaped_is_taken_over(tmp_path):
    """A worker whose launcher was killed is reparented; an init that never reaps leaves it a zombie."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not waited for until the end
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.02)
        os.kill(zombie.pid, 0)  # signal 0 still finds it
        write_lock(tmp_path, pid=zombie.pid)
        guards.acquire(str(tmp_path), stale_after_s=120).release()
    finally:
        zombie.wait()


def test_other_hosts_lock_is_taken_over_only_when_stale(tmp_path):
    write_lock(tmp_path, host="node-that-died", pid=1)
    with pytest.raises(guards.WorkdirBusy, match="node-that-died"):
        guards.acquire(str(tmp_path), stale_after_s=60)
    old = time.time() - 61
    os.utime(tmp_path / layout.LOCK, (old, old))
    guards.acquire(str(tmp_path), stale_after_s=60).release()


def test_requeued_slurm_job_takes_over_its_earlier_runs_lock(tmp_path):
    write_lock(tmp_path, host="other-node", pid=1, slurm_job_id="77", slurm_restart_count="0")
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
    guards.acquire(str(tmp_path), stale_after_s=600, env=env).release()
    write_lock(tmp_path, host="other-node", pid=1, slurm_job_id="78", slurm_restart_count="0")
    with pytest.raises(guards.WorkdirBusy, match="Slurm job 78"):  # another job: still refused
        guards.acquire(str(tmp_path), stale_after_s=600, env=env)


def test_live_lock_is_kept_fresh(tmp_path):
    lock = guards.acquire(str(tmp_path), stale_after_s=120)
    path = tmp_path / layout.LOCK
    os.utime(path, (0, 0))
    lock.keep_fresh(every_s=0.05)
    time.sleep(0.5)
    assert time.time() - os.stat(path).st_mtime < 5
    lock.release()


def test_release_leaves_a_lock_that_another_job_took(tmp_path):
    lock = guards.acquire(str(tmp_path), stale_after_s=120)
    write_lock(tmp_path, host="elsewhere", pid=5)
    lock.release()
    assert json.load(open(tmp_path / layout.LOCK))["host"] == "elsewhere"


def smoke_dict(**changes):
    cfg = base_config()
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        (cfg[section] if section else cfg)[name] = value
    return cfg.to_dict()


def resumable(tmp_path, cfg_dict):
    os.makedirs(tmp_path / layout.CHECKPOINTS)
    (tmp_path / layout.CHECKPOINTS / "checkpoint").write_text('model_checkpoint_path: "ckpt-20"\n')
    io.write_json(str(tmp_path / layout.CONFIG), cfg_dict)


def test_result_changing_keys_are_refused_listing_each(tmp_path):
    resumable(tmp_path, smoke_dict())
    changed = smoke_dict(**{"model.name": "resnet18", "optim.lr_per_256": 0.2, "train.log_every_steps": 7})
    with pytest.raises(ConfigError) as refused:
        guards.claim(str(tmp_path), changed, resume_cfg())
    message = str(refused.value)
    assert "config.model.name: 'resnet50' -> 'resnet18'" in message
    assert "config.optim.lr_per_256: 0.1 -> 0.2" in message and "config.optim.lr: 0.1 -> 0.2" in message  # linked
    assert "log_every_steps" not in message  # safe: not listed among the refused
    assert json.load(open(tmp_path / layout.CONFIG)) == json.loads(json.dumps(smoke_dict()))  # nothing written
    assert not os.path.exists(tmp_path / layout.LOCK) and not os.path.exists(tmp_path / layout.HISTORY)


def test_safe_changes_are_recorded_and_forced_ones_marked(tmp_path):
    resumable(tmp_path, smoke_dict())
    safe = smoke_dict(**{"train.epochs": 120.0, "data.stage_dir": "/tmp/local", "checkpoint.max_to_keep": 5})
    guards.claim(str(tmp_path), safe, resume_cfg()).release()
    forced = smoke_dict(**{"train.epochs": 120.0, "data.stage_dir": "/tmp/local", "checkpoint.max_to_keep": 5,
                           "seed": 3, "resume.allow_config_changes": True})
    guards.claim(str(tmp_path), forced, resume_cfg(allow=True)).release()
    first, second = read_jsonl(tmp_path / layout.HISTORY)
    assert first["changes"] == {"checkpoint.max_to_keep": {"from": 3, "to": 5}, "data.stage_dir": {"from": "", "to": "/tmp/local"},
                                "train.epochs": {"from": 90.0, "to": 120.0}} and not first["forced"]
    assert second["changes"] == {"seed": {"from": 0, "to": 3}, "resume.allow_config_changes": {"from": False, "to": True}}
    assert second["forced"] and "time" in second
    assert json.load(open(tmp_path / layout.CONFIG))["seed"] == 3


def test_fresh_run_may_change_anything(tmp_path):
    io.write_json(str(tmp_path / layout.CONFIG), smoke_dict())  # a run that never checkpointed
    guards.claim(str(tmp_path), smoke_dict(**{"model.name": "resnet18"}), resume_cfg()).release()
    assert not os.path.exists(tmp_path / layout.HISTORY)


def test_unreadable_config_json_of_a_resumable_run_is_named(tmp_path):
    resumable(tmp_path, smoke_dict())
    (tmp_path / layout.CONFIG).write_text("{half")
    with pytest.raises(ConfigError, match=r"config\.json cannot be read"):
        guards.claim(str(tmp_path), smoke_dict(), resume_cfg())


def test_metrics_are_trimmed_to_the_resume_step_and_a_torn_line_dropped(tmp_path):
    path = tmp_path / layout.METRICS
    rows = [{"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}, {"step": 20, "eval_top1": 0.3}, {"step": 30, "loss": 1.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 40, "lo')
    kept = guards.trim_metrics(str(tmp_path), start_step=20)
    assert kept == rows[:3] and read_jsonl(path) == rows[:3]
    assert guards.trim_metrics(str(tmp_path), start_step=20) == rows[:3]  # idempotent
    assert guards.trim_metrics(str(tmp_path / "nothing-here"), start_step=5) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system to fill."""
    with small_file_system(tmp_path / "disk", "64k") as mount_point:
        yield mount_point


def test_append_on_a_full_disk_keeps_whole_lines_and_names_the_path(tiny_disk):
    path = tiny_disk / layout.METRICS
    line = json.dumps({"step": 1, "loss": 1.0, "pad": "x" * 900})
    with pytest.raises(errors.WriteError) as full:
        for _ in range(200):  # 180 KiB into 64 KiB
            io.append_line(str(path), line)
    assert f"could not write {path}: No space left on device" in str(full.value)
    assert "MiB free of 0.1 MiB" in str(full.value)
    text = path.read_text()
    assert text.endswith("\n") and all(json.loads(row) for row in text.splitlines())


def test_atomic_write_on_a_full_disk_keeps_the_old_file(tiny_disk):
    path = str(tiny_disk / layout.SUMMARY)
    io.write_json(path, {"steps": 10})
    with pytest.raises(errors.WriteError, match=f"could not write {path}: No space left on device"):
        io.write_json(path, {"pad": "x" * 200_000})
    assert json.load(open(path)) == {"steps": 10} and os.listdir(tiny_disk) == [layout.SUMMARY]


def test_a_workdir_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "file").write_text("")  # a file where the workdir should be
    with pytest.raises(errors.WriteError, match=f"could not write {tmp_path}/file/lock.json: "):
        guards.claim(str(tmp_path / "file"), smoke_dict(), resume_cfg())


def test_a_key_newer_than_the_checkpointed_run_resumes_at_its_default_and_is_refused_otherwise(tmp_path):
    old = smoke_dict()
    del old["optim"]["clip_global_norm"]  # config.json of a run from before the key existed
    resumable(tmp_path, old)
    guards.claim(str(tmp_path), smoke_dict(), resume_cfg()).release()  # at its default (0: off) it changes nothing
    assert not os.path.exists(tmp_path / layout.HISTORY)
    with pytest.raises(ConfigError, match=r"config\.optim\.clip_global_norm: 0\.0 -> 1\.0"):
        guards.claim(str(tmp_path), smoke_dict(**{"optim.clip_global_norm": 1.0}), resume_cfg())
