"""Horovod built with MPI and launched the way clusters launch it: `mpirun` (OpenMPI) with 2 ranks on one host.

Needs OpenMPI (Debian: `apt-get install openmpi-bin libopenmpi-dev`, which `make mpi` / `make test` runs) and
a Horovod built with it (`make horovod` after that; `horovodrun --check-build` lists MPI). Without them the
process tests are skipped, saying so. `srun --mpi=pmix` under Slurm: tests/test_slurm.py.

Measured here (OpenMPI 4.1.4): a rank killed with kill -9 ends mpirun (137) about 2 s later; SIGTERM to both
ranks -> both checkpoint one step and exit 75, mpirun reports 75. SIGTERM to mpirun itself is not forwarded
(OpenMPI refuses `-mca ess_base_forward_signals SIGTERM`): mpirun waits `odls_base_sigkill_timeout` (1 s),
sends the ranks SIGTERM, waits as long again, then SIGKILL, and exits 1; see docs/horovod.md.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from test_horovod import SHORT, assert_ranks_agree_and_match_mwms, mwms_two_workers  # noqa: F401  (a fixture)
from test_multiworker import DRIVER, PREEMPTED_EPOCHS, PREEMPTED_STEPS, logged_steps, quiet_env

from tfscale.cluster import horovod_start
from tfscale.workdir import layout

hvd = pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")

MPIRUN = shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(
    MPIRUN is None or not hvd.mpi_built(),
    reason="needs OpenMPI's mpirun and Horovod built with MPI: `make mpi` (apt-get install openmpi-bin "
           "libopenmpi-dev), then `make horovod`",
)


def mpirun(*command, num_ranks=2):
    """What a user runs: 2 ranks on this host, unbound (TensorFlow sizes its own thread pools), the
    environment passed on (-x is only needed for other hosts; listed to show the cluster form)."""
    return [MPIRUN, "--allow-run-as-root", "-np", str(num_ranks), "--oversubscribe", "-bind-to", "none",
            "-map-by", "slot", "-x", "PATH", "-x", "PYTHONUNBUFFERED", *command]


def start(command, log_path):
    return subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def ranks_of(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the processes mpirun started on this host (its children)."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in children:
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(item.split(b"=")[1])] = int(pid)
    return ranks


def running(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for init to reap it has ended)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_step(launcher, workdir, step, log_path, timeout_s=180):
    deadline = time.time() + timeout_s
    while not any(r["step"] >= step for r in logged_steps(workdir)):
        assert launcher.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.2)


@needs_mpi
@pytest.mark.slow
def test_mpirun_ranks_agree_and_match_mwms(tmp_path, mwms_two_workers):  # noqa: F811
    log_path = tmp_path / "mpirun.log"
    command = mpirun(sys.executable, DRIVER, str(tmp_path / "w{rank}.npz"), *SHORT, f"--workdir={tmp_path / 'run'}",
                     "--config.distribute.backend=horovod")
    assert start(command, log_path).wait(timeout=300) == 0, open(log_path).read()[-4000:]
    log = open(log_path).read()
    assert "horovod: 2 ranks, MPI controller" in log and "rank=1/2" in log
    assert "at the rendezvous" not in log  # no Gloo rendezvous under mpirun
    # MPI's all-reduce, Gloo's (tests/test_horovod.py) and MWMS's agree up to float summation order.
    assert_ranks_agree_and_match_mwms(tmp_path, mwms_two_workers)
    assert json.load(open(tmp_path / "run" / layout.SUMMARY))["num_workers"] == 2


@needs_mpi
@pytest.mark.slow
def test_mpirun_killed_rank_ends_the_job(tmp_path):
    workdir, log_path = str(tmp_path / "run"), tmp_path / "mpirun.log"
    launcher = start(mpirun(sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
                            "--config.train.epochs=500", "--config.distribute.backend=horovod",
                            "--config.train.log_every_steps=5"), log_path)
    try:
        wait_for_step(launcher, workdir, 5, log_path)
        ranks = ranks_of(launcher)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.time()
        code = launcher.wait(timeout=120)
        elapsed_s = time.time() - killed_at
    finally:
        launcher.kill()
    log = open(log_path).read()
    assert code == 128 + signal.SIGKILL, log[-3000:]
    assert elapsed_s < 30, f"mpirun took {elapsed_s:.0f} s to end the job"
    assert "mpirun noticed that process rank 1 with PID 0 on node" in log and "exited on signal 9 (Killed)" in log
    gone_by = time.time() + 1  # rank 0 may take a moment to end after mpirun exits, not longer
    while running(ranks[0]) and time.time() < gone_by:
        time.sleep(0.05)
    assert not running(ranks[0]), "rank 0 outlived mpirun"
    print(f"mpirun exited with {code} {elapsed_s:.1f} s after rank 1 was killed")


@needs_mpi
@pytest.mark.slow
def test_sigterm_to_the_ranks_checkpoints_both_then_mpirun_reruns_to_the_end(tmp_path):
    """SIGTERM to every rank (what `scancel --signal=TERM` does to srun tasks, or a site's preemption to all
    processes): both stop at one step, save, exit 75, and mpirun reports 75; the same command resumes."""
    workdir, log_path = str(tmp_path / "run"), tmp_path / "first.log"
    command = mpirun(sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
                     "--config.distribute.backend=horovod", f"--config.train.epochs={PREEMPTED_EPOCHS}",
                     "--config.train.log_every_steps=5")
    launcher = start(command, log_path)
    try:
        wait_for_step(launcher, workdir, 20, log_path)
        ranks = ranks_of(launcher)
        assert sorted(ranks) == [0, 1], ranks
        for pid in ranks.values():
            os.kill(pid, signal.SIGTERM)
        code = launcher.wait(timeout=120)
    finally:
        launcher.kill()
    log = open(log_path).read()
    assert code == 75, log[-3000:]
    saved = [int(line.split("checkpoint saved at step ")[1].split(";")[0]) for line in log.splitlines()
             if "checkpoint saved at step" in line]
    assert len(saved) == 2 and saved[0] == saved[1], f"both ranks must stop at the same step: {saved}"
    assert 20 <= saved[0] < PREEMPTED_STEPS and os.path.exists(
        os.path.join(workdir, layout.CHECKPOINTS, f"ckpt-{saved[0]}.index"))

    second = subprocess.run(command, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"resumed from {os.path.join(workdir, layout.CHECKPOINTS, f'ckpt-{saved[0]}')}" in second.stdout
    steps = [r["step"] for r in logged_steps(workdir)]
    assert steps == sorted(set(steps)) and steps[-1] == PREEMPTED_STEPS


# --- without processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("env, size", [
    ({"HOROVOD_SIZE": "2", "SLURM_STEP_NUM_TASKS": "1"}, 2),  # horovodrun --gloo inside a one-task srun
    ({"OMPI_COMM_WORLD_SIZE": "2", "SLURM_NTASKS": "4"}, 2),  # mpirun inside a 4-task job (from the batch step)
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, 2),  # srun --mpi=pmix
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 1),  # the batch step itself: no launcher says how many ranks
    ({}, 1),  # python -m tfscale.train alone
])
def test_horovod_size_agreeing_with_the_launcher_passes(env, size):
    horovod_start.check_horovod_size(size, env, "MPI")


def test_srun_tasks_that_horovod_sees_as_separate_jobs_are_stopped():
    """`srun -n 2` of a Gloo-only Horovod: each task is rank 0 of 1 (measured), and would train alone."""
    with pytest.raises(RuntimeError, match=r"SLURM_STEP_NUM_TASKS=2 processes were started but Horovod \(Gloo "
                                           r"controller\) sees 1 rank\(s\).*built without MPI"):
        horovod_start.check_horovod_size(1, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, "Gloo")
    with pytest.raises(RuntimeError, match=r"OMPI_COMM_WORLD_SIZE=4 .* sees 2 rank"):
        horovod_start.check_horovod_size(2, {"OMPI_COMM_WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "2"}, "MPI")
