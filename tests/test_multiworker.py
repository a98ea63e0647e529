"""Multi-worker training with real processes on 127.0.0.1: agreement, equivalence, preemption, failures.

Slurm host lists and rank resolution are unit-tested at the bottom without processes.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, quiet_env
from helpers.shared_runs import shared_run

from tfscale.cluster import distribute
from tfscale.launch import launch
from tfscale.workdir import layout

DRIVER = os.path.join(REPO, "tests", "helpers", "train_and_dump.py")
# 10 steps of global batch 32 (16 per worker); sync BN makes 2 x 16 compute what 1 x 32 computes.
# Gradients are clipped below their global norm (0.5-1.3 in these steps): clipping each worker's half
# before the all-reduce instead of the sum would not give what one worker with the whole batch computes.
CLIP_GLOBAL_NORM = 0.4
SHORT = ["--config=configs/smoke.py", "--config.train.epochs=0.5", "--config.schedule.warmup_epochs=0.25",
         "--config.model.sync_bn=True", "--config.model.zero_init_residual=False",
         "--config.train.log_every_steps=5", f"--config.optim.clip_global_norm={CLIP_GLOBAL_NORM}"]


def start_workers(args, num_workers, log_dir, backend="mwms", endpoint=None, **env_extra):
    """One process per worker with the environment the launcher would give it (but no launcher, which
    would stop the others itself when one fails). `endpoint`: Horovod's rendezvous port; for MWMS
    free loopback ports are chosen."""
    ports = launch.free_ports(num_workers) if backend == "mwms" else endpoint
    procs = []
    for rank in range(num_workers):
        env = quiet_env(**launch.worker_env(rank, num_workers, ports, backend, 1), **env_extra)
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, ports


def kill_rank1_once_training(procs, workdir, log_dir):
    """Waits for the first logged step, kills rank 1 (-9); returns rank 0's exit code and how long it
    took to exit after the kill. Every process is gone afterwards."""
    try:
        deadline = time.time() + 180
        while not logged_steps(workdir):
            assert all(p.poll() is None for p in procs) and time.time() < deadline, read_log(log_dir, 0)[-3000:]
            time.sleep(0.2)
        procs[1].kill()
        killed_at = time.time()
        code = procs[0].wait(timeout=120)
        return code, time.time() - killed_at
    finally:
        for p in procs:
            p.kill()


def shared_mwms_run(tmp_path_factory, args):
    """(directory, first) for a run of DRIVER with `args` on two MWMS workers, made once per pytest run for
    every test file that asks with the same arguments (tests/helpers/shared_runs.py): the first caller makes
    it with `start_two_mwms_workers(directory, args)`, later ones read it."""
    return shared_run(tmp_path_factory, "mwms-two-workers-" + hashlib.sha256("\n".join(args).encode()).hexdigest()[:16])


def start_two_mwms_workers(root, args):
    """DRIVER with `args` on two MWMS workers, started by hand: each writes its final weights to root/w0.npz,
    root/w1.npz and its log to root/rank0.log, root/rank1.log; the chief's workdir is root/run."""
    procs, _ = start_workers([DRIVER, str(root / "w{rank}.npz"), *args, f"--workdir={root / 'run'}",
                              "--config.distribute.backend=mwms"], 2, str(root))
    return procs


def wait_all(procs, timeout_s=300):
    return [p.wait(timeout=timeout_s) for p in procs]


def read_log(log_dir, rank):
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        return f.read()


def logged_steps(workdir):
    path = os.path.join(workdir, layout.METRICS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def weights(path):
    with np.load(path) as data:
        return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def assert_weights_close(a, b, rtol, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def one_worker_global_batch(tmp_path_factory):
    """Reference: 1 worker, 1 replica, global batch 32."""
    root = tmp_path_factory.mktemp("single")
    result = subprocess.run(
        [sys.executable, DRIVER, str(root / "w.npz"), *SHORT, f"--workdir={root / 'run'}"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return weights(root / "w.npz"), logged_steps(str(root / "run"))


@pytest.mark.slow
def test_two_workers_agree_and_equal_one_worker_with_the_global_batch(tmp_path, one_worker_global_batch):
    workdir = str(tmp_path / "run")
    # The gradients all-reduced in 64 KiB buckets (the smoke model's 315 KB in 6), the last layer's first, and
    # applied by the compiled update (a GPU replica's default) where the reference runs Keras' (a CPU's).
    args = lambda rank: [DRIVER, str(tmp_path / f"w{rank}.npz"), *SHORT, f"--workdir={workdir}",  # noqa: E731
                         "--config.distribute.backend=mwms", "--config.distribute.pack_bytes=65536",
                         "--config.optim.compiled_update=True"]
    ports = launch.free_ports(2)
    procs = [
        subprocess.Popen([sys.executable, *args(rank)], cwd=REPO,
                         env=quiet_env(**launch.worker_env(rank, 2, ports, "mwms", 1)),
                         stdout=open(tmp_path / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT)
        for rank in range(2)
    ]
    assert wait_all(procs) == [0, 0], read_log(tmp_path, 0)[-3000:] + read_log(tmp_path, 1)[-3000:]

    rank0, rank1 = weights(tmp_path / "w0.npz"), weights(tmp_path / "w1.npz")
    # Each worker trained on its own half of every batch; after the all-reduce they hold the same weights.
    assert_weights_close(rank0, rank1, rtol=0, atol=0)
    reference_weights, reference_rows = one_worker_global_batch
    # ...and what one worker computes with the whole batch of 32. Float sums run in another order
    # (BN variance over two halves, gradient all-reduce), which 10 steps at LR 0.1 amplify to ~6e-5;
    # training itself moved the weights by ~1e-2, so the tolerance below still tells right from wrong.
    initial = weights(tmp_path / "w0_init.npz")
    moved = max(np.abs(w - w0).max() for w, w0 in zip(rank0, initial))
    assert moved > 5e-3
    assert_weights_close(rank0, reference_weights, rtol=2e-3, atol=2e-4)
    rows = logged_steps(workdir)
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows] == [5, 10]
    for ours, ref in zip(rows, reference_rows):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-3)
        # The norm of the averaged gradient, clipped at these steps on both runs.
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3) and ours["grad_norm"] > CLIP_GLOBAL_NORM
    summary = json.load(open(os.path.join(workdir, layout.SUMMARY)))
    assert summary["num_workers"] == 2 and summary["num_replicas"] == 2
    # Only the chief wrote: one topology line per worker, progress lines only in rank 0's log.
    assert "rank=1/2" in read_log(tmp_path, 1) and "step 10/10" not in read_log(tmp_path, 1)
    assert "step 10/10" in read_log(tmp_path, 0)


@pytest.mark.slow
def test_mirrored_two_cpu_devices_equals_one_device(tmp_path, one_worker_global_batch):
    result = subprocess.run(
        [sys.executable, DRIVER, str(tmp_path / "w.npz"), *SHORT, f"--workdir={tmp_path / 'run'}",
         "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas=2" in result.stderr
    assert_weights_close(weights(tmp_path / "w.npz"), one_worker_global_batch[0], rtol=2e-3, atol=2e-4)


@pytest.mark.slow
def test_ghost_batch_norm_on_one_device_equals_replicas_with_their_own_batch_norm(tmp_path, tmp_path_factory,
                                                                                 one_worker_global_batch):
    """One device with the global batch of 32 in BatchNorm groups of 16 computes what 2 replicas of 16 with
    per-replica BatchNorm compute (moving statistics included): how a study keeps the batch each BatchNorm
    sees fixed while the global batch grows, without a replica per group."""
    per_replica_bn = [arg for arg in SHORT if arg != "--config.model.sync_bn=True"]  # BatchNorm per replica: the default
    result = subprocess.run(
        [sys.executable, DRIVER, str(tmp_path / "ghost.npz"), *per_replica_bn, "--config.model.bn_group_size=16",
         f"--workdir={tmp_path / 'ghost'}"], cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # The replicas: 2 MWMS workers, the run tests/test_horovod.py compares Horovod with (the same arguments).
    # MirroredStrategy's 2 CPU replicas end with these weights bit for bit (measured).
    with shared_mwms_run(tmp_path_factory, per_replica_bn) as (root, first):
        if first:
            assert wait_all(start_two_mwms_workers(root, per_replica_bn)) == [0, 0], read_log(root, 0)[-3000:]
    ghost, replicas = weights(tmp_path / "ghost.npz"), weights(root / "w0.npz")
    assert_weights_close(ghost, replicas, rtol=2e-3, atol=2e-4)
    # BatchNorm over all 32 (the one-worker reference, sync BN) is another computation: the check can fail.
    with pytest.raises(AssertionError):
        assert_weights_close(ghost, one_worker_global_batch[0], rtol=2e-3, atol=2e-4)


def first_errors(output: str, lines: int = 30) -> str:
    """Every rank's first error lines, then the end: a peer's "Horovod has been shut down" tail
    otherwise hides the error of the rank that went first."""
    errors = [line for line in output.splitlines() if re.search(r"Error|error|exited|rank \d+ .*code", line)]
    return "\n".join(errors[:lines]) + "\n...\n" + output[-1500:]


# The preempted runs: 100 steps of the smoke recipe (5 epochs of 20). SIGTERM comes once step 20 is
# logged, and a stop takes a loop of 5 steps (a world sync of 8 under local SGD): the 80 steps left
# (3-7 s of training on an idle machine, by backend) keep the run from ending before the signal.
PREEMPTED_EPOCHS = 5
PREEMPTED_STEPS = 100


def sigterm_then_resume(command, workdir, log_dir, train_steps=200) -> int:
    """Runs `command` (a 2-worker launch of `train_steps` steps), sends the launcher SIGTERM after step 20,
    checks that both workers checkpoint the same step and exit 75, reruns it to the end; returns that step."""
    log = open(os.path.join(log_dir, "first.log"), "w")
    launcher = subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT)
    first_log = lambda: open(os.path.join(log_dir, "first.log")).read()  # noqa: E731
    deadline = time.time() + 180
    while not any(r["step"] >= 20 for r in logged_steps(workdir)):
        assert launcher.poll() is None and time.time() < deadline, first_log()[-3000:]
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)  # what Slurm sends before the kill
    assert launcher.wait(timeout=120) == 75, first_log()[-3000:]
    saved = [int(line.split("checkpoint saved at step ")[1].split(";")[0]) for line in first_log().splitlines()
             if "checkpoint saved at step" in line]
    assert len(saved) == 2 and saved[0] == saved[1], f"both workers must stop at the same step: {saved}"
    stopped_at = saved[0]
    assert 20 <= stopped_at < train_steps
    assert os.path.exists(os.path.join(workdir, layout.CHECKPOINTS, f"ckpt-{stopped_at}.index"))

    second = subprocess.run(command, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    assert second.returncode == 0, first_errors(second.stdout)
    assert f"resumed from {os.path.join(workdir, layout.CHECKPOINTS, f'ckpt-{stopped_at}')}" in second.stdout
    steps = [r["step"] for r in logged_steps(workdir)]
    assert steps == sorted(set(steps)) and steps[-1] == train_steps  # nothing repeated, finished
    assert json.load(open(os.path.join(workdir, layout.SUMMARY)))["steps"] == train_steps
    return stopped_at


@pytest.mark.slow
def test_sigterm_saves_checkpoint_then_relaunch_finishes(tmp_path):
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1", "--",
               "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
               "--config.distribute.backend=mwms", f"--config.train.epochs={PREEMPTED_EPOCHS}",
               "--config.train.log_every_steps=5"]
    sigterm_then_resume(command, workdir, str(tmp_path), train_steps=PREEMPTED_STEPS)


@pytest.mark.slow
def test_killed_worker_ends_the_other_within_the_heartbeat_timeout(tmp_path):
    workdir = str(tmp_path / "run")
    procs, _ = start_workers(
        ["-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}", "--config.train.epochs=500",
         "--config.distribute.backend=mwms", "--config.distribute.heartbeat_timeout_s=5",
         "--config.train.log_every_steps=5"],
        2, str(tmp_path),
    )
    code, elapsed_s = kill_rank1_once_training(procs, workdir, tmp_path)
    assert code != 0
    assert elapsed_s < 60, f"survivor took {elapsed_s:.0f} s to notice"
    assert "task:1" in read_log(tmp_path, 0)  # TF names the dead worker
    print(f"survivor exited with {code} {elapsed_s:.1f} s after its peer was killed")


# Worker 0 waits this long for a peer that never answers; what it then says does not depend on how long.
CONNECT_TIMEOUT_S = 2


@pytest.mark.slow
def test_wrong_peer_address_fails_preflight_naming_it(tmp_path):
    port_self, port_nobody = launch.free_ports(2)
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{port_self}", f"127.0.0.1:{port_nobody}"]},
                 "task": {"type": "worker", "index": 0}}
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={tmp_path}",
         "--config.distribute.backend=mwms", f"--config.distribute.connect_timeout_s={CONNECT_TIMEOUT_S}"],
        cwd=REPO, env=quiet_env(TF_CONFIG=json.dumps(tf_config)), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert time.time() - started < 60
    assert f"no answer from: worker 1 at 127.0.0.1:{port_nobody}" in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, layout.CHECKPOINTS))  # nothing trained, nothing written


# --- the heartbeat timeout: private TensorFlow API, checked ----------------------------------------

# A one-worker MWMS cluster from an explicit TF_CONFIG (the path that sets the heartbeat timeout),
# then a collective on it. argv[1] "hide" makes the coordination protobuf unimportable, as on a
# TensorFlow that moved it: setup must warn once and carry on with TensorFlow's default.
COORDINATION_SCRIPT = r"""
import json, sys
from tensorflow.python.eager import context
from tfscale.cluster import connect
from tfscale.cluster import distribute
from tfscale.config import base_config
if sys.argv[1] == "hide":
    for name in connect._COORDINATION_CONFIG_MODULES:
        sys.modules[name] = None  # `import name` now raises ImportError
configured = []
real_configure = connect._configure_coordination_service
connect._configure_coordination_service = lambda *args: configured.append(real_configure(*args)) or configured[-1]
cfg = base_config().distribute
cfg.backend, cfg.heartbeat_timeout_s = "mwms", 7.0
tf_config = {"cluster": {"worker": [f"127.0.0.1:{sys.argv[2]}"]}, "task": {"type": "worker", "index": 0}}
cluster = distribute.setup(cfg, env={"TF_CONFIG": json.dumps(tf_config)})
configured.append(real_configure(tf_config, 7.0))  # a second time: no second warning
service = context.context().coordination_service
print(json.dumps({"configured": configured, "size": cluster.size, "gathered": cluster.gather_per_worker([3.0]),
                  "heartbeat_ms": service.heartbeat_timeout_in_ms if service else None}))
"""


def run_coordination_script(mode):
    [port] = launch.free_ports(1)
    result = subprocess.run([sys.executable, "-c", COORDINATION_SCRIPT, mode, str(port)], cwd=REPO,
                            env=quiet_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_heartbeat_timeout_is_set_through_the_private_api_on_this_tensorflow():
    out, stderr = run_coordination_script("installed")
    assert out["configured"][0] is True and out["heartbeat_ms"] == 7000
    assert out["size"] == 1 and out["gathered"] == [[3.0]]
    assert "heartbeat_timeout_s is not applied" not in stderr


def test_missing_coordination_api_warns_once_and_setup_continues():
    out, stderr = run_coordination_script("hide")
    assert out["configured"] == [False, False]
    assert out["size"] == 1 and out["gathered"] == [[3.0]]  # the cluster came up and its collectives work
    assert out["heartbeat_ms"] != 7000  # MWMS configured the service itself, with TensorFlow's default
    warning = f"TensorFlow {distribute.tf.__version__} does not offer the private coordination-service API"
    assert stderr.count(warning) == 1, stderr[-3000:]
    assert stderr.count("dead-worker detection uses TensorFlow's default heartbeat timeout "
                        "(distribute.heartbeat_timeout_s is not applied)") == 1


# --- cluster resolution, no processes ---------------------------------------------------------------


@pytest.mark.parametrize("hostlist, expected", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
    ("nid[001-002]-ib", ["nid001-ib", "nid002-ib"]),
    # Forms checked against Slurm 22.05's `scontrol show hostnames` (tests/test_slurm.py compares more).
    ("node[001-003]", ["node001", "node002", "node003"]),
    ("a[9-11]", ["a9", "a10", "a11"]),
    ("n[01-3]", ["n01", "n02", "n03"]),  # the first number's padding applies to the whole range
    ("n[1,02]", ["n1", "n02"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("r[1-2]n[3,5],login", ["r1n3", "r1n5", "r2n3", "r2n5", "login"]),
])
def test_expand_hostlist(hostlist, expected):
    assert distribute.expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist, message", [
    ("n[2-1]", "'2-1' is not a range"),
    ("n[]", "'' is not a range"),
    ("n[a-b]", "'a-b' is not a range"),
    ("n[1-2", "'[' without ']'"),
    ("n[1-[2]]", "nested"),
])
def test_expand_hostlist_rejects_malformed_lists_naming_them(hostlist, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        distribute.expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert distribute.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert distribute.expand_tasks_per_node("4") == [4]


def test_slurm_tf_config_blocks_tasks_by_node():
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4",
           "SLURM_PROCID": "3", "SLURM_JOB_ID": "1234"}
    tf_config = distribute.slurm_tf_config(env, port_base=0)
    # Default ports: a block of 8 from the job and step ids, 20000 + 8 * ((4 * 1234 + 0) % 2500).
    assert tf_config["cluster"]["worker"] == ["gpu01:39488", "gpu01:39489", "gpu02:39488", "gpu02:39489"]
    assert tf_config["task"] == {"type": "worker", "index": 3}
    assert distribute.slurm_tf_config(env, port_base=30000)["cluster"]["worker"][0] == "gpu01:30000"
    with pytest.raises(ValueError, match="SLURM_NTASKS=5"):
        distribute.slurm_tf_config({**env, "SLURM_NTASKS": "5"}, port_base=0)


def test_local_rank_sources():
    assert distribute.local_rank_from_env({"SLURM_LOCALID": "3"}) == 3
    assert distribute.local_rank_from_env({"TFSCALE_LOCAL_RANK": "1", "SLURM_LOCALID": "3"}) == 1
    assert distribute.local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert distribute.local_rank_from_env({}) == 0
