"""Horovod backend with real ranks on 127.0.0.1 over Gloo: averaging, MWMS equivalence, launchers, failures.

Horovod is built by `make horovod` (part of `make test`); without it these tests are skipped, saying so.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO
from test_multiworker import (DRIVER, PREEMPTED_EPOCHS, PREEMPTED_STEPS, assert_weights_close, kill_rank1_once_training,
                              logged_steps, quiet_env, read_log, shared_mwms_run, sigterm_then_resume,
                              start_two_mwms_workers, start_workers, wait_all, weights)

from tfscale import config as tfs_config
from tfscale.cluster import collectives, distribute, horovod_start
from tfscale.config import validation
from tfscale.launch import launch
from tfscale.launch.rendezvous import HorovodRendezvous
from tfscale.workdir import layout

pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# 10 steps of global batch 32 (16 per rank). BatchNorm is per rank (Horovod has no Keras 3 sync BN),
# so the reference is MWMS with per-replica BN too.
# Gradients clipped below their global norm (0.5-1.3 here), after the ranks' average as after MWMS's all-reduce.
CLIP_GLOBAL_NORM = 0.4
SHORT = ["--config=configs/smoke.py", "--config.train.epochs=0.5", "--config.schedule.warmup_epochs=0.25",
         "--config.model.zero_init_residual=False", "--config.train.log_every_steps=5",
         f"--config.optim.clip_global_norm={CLIP_GLOBAL_NORM}"]


def launch_command(num_workers, backend, *train_args):
    return [sys.executable, "-m", "tfscale.launch", f"--num_workers={num_workers}", f"--backend={backend}",
            "--threads_per_worker=1", "--", *train_args]


def run_logged(command, log_path, timeout_s=300):
    with open(log_path, "w") as log:
        return subprocess.run(command, cwd=REPO, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s).returncode


@pytest.fixture(scope="module")
def mwms_two_workers(tmp_path_factory):
    """Reference: the same job under MultiWorkerMirroredStrategy, workers started by hand (rank-named files);
    one run for tests/test_horovod_mpi.py and tests/test_multiworker.py's ghost BatchNorm check too."""
    with shared_mwms_run(tmp_path_factory, SHORT) as (root, first):
        if first:
            assert wait_all(start_two_mwms_workers(root, SHORT)) == [0, 0], read_log(root, 0)[-3000:]
    # Per-replica BatchNorm statistics are averaged every step, so the MWMS workers agree exactly too.
    assert_weights_close(weights(root / "w0.npz"), weights(root / "w1.npz"), rtol=0, atol=0)
    eval_rows = [r for r in map(json.loads, open(root / "run" / layout.METRICS)) if "eval_top1" in r]
    return weights(root / "w0.npz"), logged_steps(str(root / "run")), eval_rows[-1]


def assert_ranks_agree_and_match_mwms(root, mwms_two_workers):
    """Ranks 0 and 1 of a Horovod run in `root` (w0.npz, w1.npz, run/) equal each other and the MWMS run."""
    rank0, rank1 = weights(root / "w0.npz"), weights(root / "w1.npz")
    # Each rank trained on its own half of every global batch; the gradient average keeps them equal.
    assert_weights_close(rank0, rank1, rtol=0, atol=0)
    initial = weights(root / "w0_init.npz")
    moved = max(np.abs(w - w0).max() for w, w0 in zip(rank0, initial))
    assert moved > 5e-3  # so "equal" below is not equality of untouched initial weights

    # Same seed, same shards, same global batch: what MWMS computes, up to float summation order.
    mwms_weights, mwms_rows, mwms_eval = mwms_two_workers
    assert_weights_close(rank0, mwms_weights, rtol=2e-3, atol=2e-4)
    rows = logged_steps(str(root / "run"))
    assert [r["step"] for r in rows] == [r["step"] for r in mwms_rows] == [5, 10]
    for ours, ref in zip(rows, mwms_rows):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert ours["lr"] == pytest.approx(ref["lr"], rel=1e-6)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3) and ours["grad_norm"] > CLIP_GLOBAL_NORM
    # Eval counts every example once across ranks, with the same (averaged) BatchNorm statistics.
    eval_rows = [r for r in map(json.loads, open(root / "run" / layout.METRICS)) if "eval_top1" in r]
    assert eval_rows[-1]["eval_examples"] == 500
    assert eval_rows[-1]["eval_loss"] == pytest.approx(mwms_eval["eval_loss"], rel=1e-3)


@pytest.mark.slow
def test_horovod_ranks_agree_and_match_mwms(tmp_path, mwms_two_workers):
    root = tmp_path
    # The gradients in 64 KiB buckets (6 grouped all-reduces a step) equal MWMS's one all-reduce.
    command = launch_command(2, "horovod", DRIVER, str(root / "w{rank}.npz"), *SHORT, f"--workdir={root / 'run'}",
                             "--config.distribute.backend=horovod", "--config.distribute.pack_bytes=65536")
    assert run_logged(command, root / "launch.log") == 0, open(root / "launch.log").read()[-4000:]
    assert_ranks_agree_and_match_mwms(root, mwms_two_workers)
    log = open(root / "launch.log").read()
    assert "backend=horovod replicas=2" in log and "rank=1/2" in log
    # Rank 0 alone writes checkpoints and prints progress.
    assert os.path.exists(root / "run" / layout.CHECKPOINTS / "ckpt-10.index")
    assert "[rank 1]" not in "".join(line for line in log.splitlines(True) if "step 10/10" in line)
    summary = json.load(open(root / "run" / layout.SUMMARY))
    assert summary["num_workers"] == 2 and summary["num_replicas"] == 2


@pytest.mark.slow
def test_horovodrun_launches_training(tmp_path):
    workdir = tmp_path / "run"
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", "--network-interfaces", "lo",
               sys.executable, "-m", "tfscale.train", *SHORT, f"--workdir={workdir}",
               "--config.distribute.backend=horovod"]
    code = run_logged(command, tmp_path / "horovodrun.log")
    text = open(tmp_path / "horovodrun.log").read()
    assert code == 0, text[-4000:]
    assert "rank=0/2" in text and "rank=1/2" in text
    assert json.load(open(workdir / layout.SUMMARY))["num_workers"] == 2


@pytest.mark.slow
def test_sigterm_stops_both_ranks_at_one_step_then_resume_finishes(tmp_path):
    workdir = str(tmp_path / "run")
    command = launch_command(2, "horovod", "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
                             "--config.distribute.backend=horovod", f"--config.train.epochs={PREEMPTED_EPOCHS}",
                             "--config.train.log_every_steps=5")
    sigterm_then_resume(command, workdir, str(tmp_path), train_steps=PREEMPTED_STEPS)


@pytest.mark.slow
def test_killed_rank_ends_the_other_without_hanging(tmp_path):
    workdir = str(tmp_path / "run")
    rendezvous = HorovodRendezvous(2)
    procs, _ = start_workers(
        ["-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}", "--config.train.epochs=500",
         "--config.distribute.backend=horovod", "--config.train.log_every_steps=5"],
        2, str(tmp_path), backend="horovod", endpoint=rendezvous.port,
    )
    try:
        code, elapsed_s = kill_rank1_once_training(procs, workdir, tmp_path)
    finally:
        rendezvous.stop()
    assert code != 0, read_log(tmp_path, 0)[-3000:]
    assert elapsed_s < 60, f"survivor took {elapsed_s:.0f} s to notice"
    # The survivor's failing op is Horovod's all-reduce; the message after it depends on timing
    # ("Horovod has been shut down" or Gloo's connection error); the op sits in the loop of steps, the
    # gradients' in the name scope gradient_all_reduce.
    assert re.search(r"node (while/)?(gradient_all_reduce/)?Horovod\w*Allreduce", read_log(tmp_path, 0)), \
        read_log(tmp_path, 0)[-3000:]
    print(f"survivor exited with {code} {elapsed_s:.1f} s after its peer was killed")


# --- without processes ------------------------------------------------------------------------------


def test_missing_horovod_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)  # makes `import horovod.tensorflow` fail
    with pytest.raises(ImportError, match="make horovod"):
        horovod_start.import_horovod()


def test_horovod_knobs_reach_the_environment():
    dist = tfs_config.base_config().distribute
    assert horovod_start._horovod_environment(dist, {}) == {"HOROVOD_GLOO_TIMEOUT_SECONDS": "300"}
    dist.horovod_fusion_bytes = 64 * 2**20
    dist.horovod_cycle_time_ms = 3.5
    knobs = horovod_start._horovod_environment(dist, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"})
    assert knobs == {"HOROVOD_FUSION_THRESHOLD": str(64 * 2**20), "HOROVOD_CYCLE_TIME": "3.5"}


def test_sync_bn_with_horovod_is_refused():
    cfg = tfs_config.base_config()
    cfg.data.dataset = "synthetic"
    cfg.distribute.backend = "horovod"
    cfg.model.sync_bn = True
    with pytest.raises(ValueError, match="model.sync_bn=True needs a tf.distribute backend"):
        validation.validate(cfg)


def test_horovod_rank_loss_is_averaged_over_its_own_batch():
    cluster = distribute.Cluster(backend="horovod", strategy=None, rank=0, size=4, local_rank=0, num_replicas=4,
                                 host="h", all_reduce="Gloo",
                                 _collectives=collectives.HorovodCollectives(hvd=object(), strategy=None))
    assert cluster.loss_batch_size(256) == 64
    assert not cluster.saving_is_collective
    mwms = distribute.Cluster(backend="mwms", strategy=None, rank=0, size=4, local_rank=0, num_replicas=4,
                              host="h", all_reduce="RING", _collectives=collectives.StrategyCollectives(strategy=None))
    assert mwms.loss_batch_size(256) == 256 and mwms.saving_is_collective


# --- porting a Horovod model.fit script -------------------------------------------------------------
FIT = os.path.join(REPO, "tests", "helpers", "horovod_fit.py")


def fit_run(tmp_path, mode):
    out = str(tmp_path / f"{mode}_{{rank}}.npz")
    if mode == "single":
        command = [sys.executable, FIT, out, "--mode=single"]
    else:
        command = launch_command(2, "horovod", FIT, out, f"--mode={mode}")
    assert run_logged(command, tmp_path / f"{mode}.log", timeout_s=180) == 0, open(tmp_path / f"{mode}.log").read()[-3000:]
    results = []
    for rank in range(1 if mode == "single" else 2):
        path = out.replace("{rank}", str(rank))
        results.append((weights(path), json.load(open(path.replace(".npz", ".json")))))
    return results


@pytest.mark.slow
def test_ported_fit_script_averages_like_one_process_with_the_global_batch(tmp_path):
    [(reference, reference_logs)] = fit_run(tmp_path, "single")
    (rank0, logs0), (rank1, logs1) = fit_run(tmp_path, "averaging")
    assert logs0["optimizer"] == "AveragingSGD"
    # Ranks started from different random weights and fitted different rows: broadcast + averaging
    # make them equal, and equal to one process fitting both halves as one batch.
    assert_weights_close(rank0, rank1, rtol=0, atol=0)
    assert_weights_close(rank0, reference, rtol=1e-5, atol=1e-6)
    # MetricAverage: every rank reports the job's epoch loss, which is the single process's loss.
    assert logs0["loss"] == logs1["loss"]
    np.testing.assert_allclose(logs0["loss"], reference_logs["loss"], rtol=1e-5)

    # Control: the same script without averaging (hvd.DistributedOptimizer on Keras 3) drifts apart.
    (plain0, _), (plain1, _) = fit_run(tmp_path, "plain")
    assert max(np.abs(a - b).max() for a, b in zip(plain0, plain1)) > 1e-3


def test_learning_rate_warmup_matches_horovods_callback():
    from types import SimpleNamespace

    import keras

    from tfscale.training import callbacks

    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    net.compile(optimizer=keras.optimizers.SGD(0.123), loss="mse")
    warmup = callbacks.LearningRateWarmup(SimpleNamespace(size=4), initial_lr=0.8, warmup_epochs=2, steps_per_epoch=2)
    net.fit(np.zeros((12, 2)), np.zeros((12, 1)), batch_size=2, epochs=1, verbose=0, callbacks=[warmup, Record()])
    # Horovod: lr = lr0 / size * (epoch * (size - 1) / warmup_epochs + 1), epoch counted after the batch.
    expected = [0.8 / 4 * ((s + 1) / 2 * 3 / 2 + 1) for s in range(4)]
    np.testing.assert_allclose(seen[:4], expected, rtol=1e-6)
    assert seen[3] == pytest.approx(0.8)
    assert seen[4:] == [pytest.approx(0.8)] * 2  # left alone after the warmup


# Rank 0 waits this long for a rank that never starts; what it then says does not depend on how long.
CONNECT_TIMEOUT_S = 2


@pytest.mark.slow
def test_missing_rank_fails_within_the_connect_timeout(tmp_path):
    rendezvous = HorovodRendezvous(2)
    started = time.time()
    try:  # rank 1 of 2 never starts
        result = subprocess.run(
            [sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={tmp_path}",
             "--config.distribute.backend=horovod", f"--config.distribute.connect_timeout_s={CONNECT_TIMEOUT_S}"],
            cwd=REPO, env=quiet_env(**launch.worker_env(0, 2, rendezvous.port, "horovod", 1)),
            capture_output=True, text=True, timeout=120,
        )
    finally:
        rendezvous.stop()
    elapsed_s = time.time() - started
    assert result.returncode == -signal.SIGABRT  # Gloo aborts; a shell reports 134
    assert elapsed_s < 60, f"took {elapsed_s:.0f} s"
    assert (f"waiting up to {CONNECT_TIMEOUT_S} s for every rank at the rendezvous (distribute.connect_timeout_s)"
            in result.stderr)
    assert f"Wait timeout after {CONNECT_TIMEOUT_S} seconds for key(s): 1" in result.stderr  # names the missing rank
