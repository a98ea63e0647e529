"""tfscale under a REAL Slurm (Debian's slurmctld/slurmd/munge, a private cluster of two nodes started by
tools/slurm_testbed.sh): scripts from tools/make_sbatch.py submitted with sbatch, 2 CPU tasks per job.

The two nodes are two hosts of a test bed (tfscale.launch.netbed: network namespaces, each with its own
address, host name and local disk): each node's slurmd, and so every task it starts, runs in its host, and a
job on both nodes talks across addresses as on a cluster.

Covered: MWMS (TF_CONFIG derived from Slurm's environment by tfscale), MWMS steps that use part of a
two-node allocation (two at once, one per node),
Horovod over Gloo launched by horovodrun inside the job, Horovod over MPI launched by `srun --mpi=pmix`
(Debian's OpenMPI 4.1 + PMIx 4.2; also across the two-node partition), a study as a job array (one task per run),
preemption (SIGTERM to the batch shell as `--signal=B:TERM@T` delivers it ->
forwarded to the tasks -> checkpoint, exit 75 -> `scontrol requeue` -> resumed run completes), and
staging TFRecord shards to a node-local directory before a TFRecord recipe trains on the copy. Not coverable here: GPUs
(--gpus-per-node lines are checked in test_make_sbatch.py only).

Without Slurm, or without root to install and run it, every test here is skipped with the reason.
"""

import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import REPO
from PIL import Image
from test_topology import fake_node

from tfscale.cluster import distribute
from tfscale.launch import netbed
from tfscale.workdir import layout

TESTBED = os.path.join(REPO, "tools", "slurm_testbed.sh")
MAKE_SBATCH = os.path.join(REPO, "tools", "make_sbatch.py")
JOB_TIMEOUT_S = 240  # one short job on 2 busy cores takes ~30-60 s; the requeued one ~2x that
# Waits for a job look at the job-completion log's size every EVENT_POLL_S (a stat) and read the job's
# runs (sacct) as soon as it grows, i.e. when a run of some job ended, else every POLL_INTERVAL_S; a
# training's metrics file is read every EVENT_POLL_S; squeue (an RPC to slurmctld) every QUEUE_POLL_S.
POLL_INTERVAL_S = 0.5
EVENT_POLL_S = 0.05
QUEUE_POLL_S = 0.1
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"}
# Short smoke runs: 20 steps of global batch 32 on 2 tasks x 1 CPU.
SHORT = ["--config.train.epochs=1", "--config.train.log_every_steps=5"]


# ------------------------------------------------------------------------------------------ testbed


def slurm_unavailable_reason() -> str | None:
    """Why a private Slurm cannot run here, or None; installs Debian's packages when root and missing."""
    if os.geteuid() != 0:
        return "the private Slurm testbed needs root (SlurmUser=root, munged as user munge, apt-get install)"
    if all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return None
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install slurmctld slurmd slurm-client munge"
    result = subprocess.run([TESTBED, "install"], capture_output=True, text=True, timeout=600)
    if result.returncode:
        return f"installing Slurm with apt-get failed: {result.stderr.strip()[-500:]}"
    return None


class Slurm:
    """A running testbed: its environment (SLURM_CONF), its nodes, and the sbatch/sacct/scancel calls the tests need."""

    def __init__(self, root: str):
        self.root = root
        self.env = {**os.environ, "SLURM_CONF": os.path.join(root, "slurm.conf"), "TF_CPP_MIN_LOG_LEVEL": "2",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("TF_CONFIG", None)  # jobs must take their cluster from Slurm
        self.node = self.run("sinfo", "-h", "-p", "debug", "-N", "-o", "%N").split()[0]  # the default partition's

    def run(self, *command, timeout_s=30) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
        return result.stdout

    def submit(self, script, **env) -> int:
        """sbatch `script`, the job's environment this testbed's plus `env`; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", str(script)], env={**self.env, **env}, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"sbatch {script}: {result.stderr}"
        return int(result.stdout.strip().split(";")[0])

    def runs(self, job_id: int) -> list[tuple[str, str]]:
        """(state, exit code) of each finished run of the job, from the job-completion log (`sacct -c`)."""
        out = self.run("sacct", "-c", "-j", str(job_id), "-n", "-P", "-o", "state,exitcode")
        return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]

    def completions(self) -> int:
        """The size of the job-completion log that `sacct -c` reads: it grows whenever a run of a job ends."""
        try:
            return os.stat(os.path.join(self.root, "log", "jobcomp.txt")).st_size
        except FileNotFoundError:
            return 0

    def sleep_until_completion(self, seen: int, timeout_s: float = POLL_INTERVAL_S) -> None:
        """Returns once the job-completion log is no longer `seen` bytes long, or after `timeout_s`."""
        deadline = time.time() + timeout_s
        while self.completions() == seen and time.time() < deadline:
            time.sleep(EVENT_POLL_S)

    def wait(self, job_id: int, timeout_s: float = JOB_TIMEOUT_S) -> list[tuple[str, str]]:
        """Waits until the job (and any requeued rerun) has ended; returns all its runs.

        Not `sbatch --wait`: it polls at doubling intervals up to 32 s (a 12 s job returned after 42 s
        here), which would double these tests' time. Requeued runs are logged as PENDING.
        """
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            seen = self.completions()  # before sacct reads the log: a run ending meanwhile is not missed
            runs = self.runs(job_id)
            if runs and runs[-1][0] in TERMINAL_STATES:
                return runs
            self.sleep_until_completion(seen)
        self.run("scancel", str(job_id))
        raise AssertionError(f"job {job_id} still not finished after {timeout_s:.0f} s (cancelled); runs: {runs}")


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    # Not pytest's tmp_path: munged (user munge) must traverse to its socket, and pytest's dirs are 0700.
    root = tempfile.mkdtemp(prefix="tfscale-slurm-", dir="/tmp")
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"the Slurm testbed's nodes are hosts of a netbed, which needs {', '.join(missing)} "
                    "(iproute2, util-linux)")
    bed = netbed.up(f"tfsl{os.getpid() % 10000}", num_hosts=2)
    env = {**os.environ, "SLURM_TESTBED_NETBED": bed.prefix}
    try:
        started = subprocess.run([TESTBED, "start", root], env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, f"testbed did not start: {started.stderr}\n{logs(root)}"
        yield Slurm(root)
    finally:
        subprocess.run([TESTBED, "stop", root], capture_output=True, text=True, timeout=120)
        netbed.down(bed.prefix)


def logs(root: str) -> str:
    texts = []
    slurmd_logs = sorted(glob.glob(os.path.join(root, "log", "slurmd-*.log")))  # one per node
    for path in [os.path.join(root, "log", "slurmctld.log"), *slurmd_logs, os.path.join(root, "munge", "munged.log")]:
        if os.path.exists(path):
            texts.append(f"--- {os.path.relpath(path, root)}\n" + open(path).read()[-2000:])
    return "\n".join(texts)


# --------------------------------------------------------------------------------------------- jobs


# Where a job's 2 tasks run: both on the default partition's node, or one on each node of `pair`, with both of
# its node's CPUs (the two nodes are one machine's 2 cores: a task each on CPU 0 would share it).
ONE_NODE = ("--nodes=1", "--tasks_per_node=2", "--cpus_per_task=1")
TWO_NODES = ("--nodes=2", "--tasks_per_node=1", "--cpus_per_task=2", "--partition=pair")


def make_script(tmp_path, backend: str, *extra: str, config: str = "configs/smoke.py", nodes=ONE_NODE) -> str:
    """tools/make_sbatch.py for 2 CPU tasks (`nodes`: ONE_NODE or TWO_NODES), workdir tmp_path/run, job log
    tmp_path/job-<id>.out."""
    script = tmp_path / "job.sbatch"
    result = subprocess.run(
        [sys.executable, MAKE_SBATCH, f"--config={config}", *nodes, "--gpus_per_node=0", f"--backend={backend}",
         "--time=00:10:00",
         f"--workdir={tmp_path / 'run'}", f"--output={script}", f"--job_output={tmp_path}/job-%j.out", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"submit with: sbatch {script}" in result.stdout
    return str(script)


def job_log(tmp_path, job_id: int) -> str:
    path = tmp_path / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""


def summary(tmp_path, run: str = "run") -> dict:
    return json.loads((tmp_path / run / layout.SUMMARY).read_text())


def default_port_base(job_id: int, step_id: int) -> int:
    """MWMS ports of a Slurm step with distribute.port_base=0: blocks of 8 in 20000-39999, 4 steps per job."""
    return 20000 + 8 * ((4 * job_id + step_id % 4) % 2500)


def logged_steps(tmp_path) -> list[int]:
    path = tmp_path / "run" / layout.METRICS
    if not path.exists():
        return []
    return [row["step"] for row in map(json.loads, path.read_text().splitlines()) if "loss" in row]


def assert_ranks_on_both_nodes(slurm, text: str) -> None:
    """Rank 0 on the first node of `pair`, rank 1 on the second, each under its own host name."""
    first, second = pair_partition_or_skip(slurm)
    assert re.search(rf"tfscale worker rank=0/2 .*host={first} ", text), text[-4000:]
    assert re.search(rf"tfscale worker rank=1/2 .*host={second} ", text), text[-4000:]


def assert_completed_once(slurm, tmp_path, job_id: int) -> str:
    runs = slurm.wait(job_id)
    text = job_log(tmp_path, job_id)
    assert runs == [("COMPLETED", "0:0")], f"runs {runs}\n{text[-4000:]}"
    return text


# -------------------------------------------------------------------------------------------- tests


def test_expand_hostlist_matches_scontrol():
    """tfscale's host-list expansion against Slurm's own (`scontrol show hostnames` needs only a config file)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (Debian: slurm-client)")
    forms = ["gpu[01-04,07]", "node[001-003]", "a[9-11],b[098-101]", "n[01-3],m[1,02]", "rack[1-2]-n[01-02]",
             "r[1-2]n[3,5],login", "x[1-2],y,z[7]"]
    with tempfile.TemporaryDirectory() as conf_dir:
        conf = os.path.join(conf_dir, "slurm.conf")
        with open(conf, "w") as f:
            f.write("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n")
        for form in forms:
            result = subprocess.run(["scontrol", "show", "hostnames", form], capture_output=True, text=True,
                                    env={**os.environ, "SLURM_CONF": conf}, timeout=30)
            assert result.returncode == 0, result.stderr
            assert distribute.expand_hostlist(form) == result.stdout.split(), form


# A 4-task job on gpu[01-02] (2 per node) whose `srun -n 2` step runs on gpu02 only: what srun puts
# in the environment of the step's second task.
PARTIAL_STEP_ENV = {
    "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODELIST": "gpu[01-02]",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "gpu02", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
}


def test_step_variables_win_over_the_job_allocation():
    """`srun -n 2` inside a 4-task allocation is a 2-worker cluster on the step's node."""
    from tfscale.config import base_config

    tf_config = distribute._resolve_tf_config(base_config().distribute, PARTIAL_STEP_ENV)
    base = distribute.slurm_port_base(PARTIAL_STEP_ENV)
    assert tf_config == {"cluster": {"worker": [f"gpu02:{base}", f"gpu02:{base + 1}"]},
                         "task": {"type": "worker", "index": 1}}
    assert distribute.slurm_num_tasks(PARTIAL_STEP_ENV) == 2
    assert distribute.local_rank_from_env(PARTIAL_STEP_ENV) == 1


def test_step_spread_over_nodes_and_job_level_fallback():
    step_env = {**PARTIAL_STEP_ENV, "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    workers = distribute.slurm_tf_config(step_env, port_base=30000)["cluster"]["worker"]
    assert workers == ["gpu01:30000", "gpu02:30000"]
    # Without step variables (a launcher other than srun): the whole allocation, 4 workers.
    job_env = {k: v for k, v in PARTIAL_STEP_ENV.items() if not k.startswith("SLURM_STEP")}
    workers = distribute.slurm_tf_config(job_env, port_base=30000)["cluster"]["worker"]
    assert workers == ["gpu01:30000", "gpu01:30001", "gpu02:30000", "gpu02:30001"]


def test_one_task_step_in_a_larger_job_is_a_single_worker():
    """e.g. a one-task srun (or the batch step) of a 4-task job: no cluster to wait for."""
    from tfscale.config import base_config

    env = {**PARTIAL_STEP_ENV, "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert distribute._resolve_tf_config(base_config().distribute, env) is None


def test_step_errors_name_the_step_variables():
    with pytest.raises(ValueError, match=r"SLURM_STEP_NUM_TASKS=3 but SLURM_STEP_NODELIST / "
                                         r"SLURM_STEP_TASKS_PER_NODE hold 2 task slots"):
        distribute.slurm_tf_config({**PARTIAL_STEP_ENV, "SLURM_STEP_NUM_TASKS": "3"}, port_base=0)
    mismatch = re.escape("SLURM_STEP_NODELIST=gpu02 has 1 hosts but SLURM_STEP_TASKS_PER_NODE=1(x2) describes 2")
    with pytest.raises(ValueError, match=mismatch):
        distribute.slurm_tf_config({**PARTIAL_STEP_ENV, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, port_base=0)
    with pytest.raises(ValueError, match="SLURM_PROCID=2 is not a rank of the 2 tasks"):
        distribute.slurm_tf_config({**PARTIAL_STEP_ENV, "SLURM_PROCID": "2"}, port_base=0)


def step_ports(job_id: int, step_id: int, tasks_per_node: int = distribute.PORTS_PER_SLURM_STEP) -> set[int]:
    base = distribute.slurm_port_base({"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": str(step_id)})
    return set(range(base, base + tasks_per_node))


def test_default_ports_of_concurrent_steps_and_neighbouring_jobs_are_disjoint():
    """Two steps of one job on one node, or jobs with nearby ids sharing a node, must not bind the same port."""
    steps = range(distribute.CONCURRENT_SLURM_STEPS)
    blocks = [step_ports(job_id, step) for job_id in range(100_000, 100_625) for step in steps]
    assert len(set().union(*blocks)) == sum(map(len, blocks))  # no port in two blocks
    assert all(20000 <= port < 40000 for block in blocks for port in block)
    assert all(20000 <= min(step_ports(job_id, step)) for job_id in (0, 2**32 - 1) for step in (0, 2**32 - 2))
    # An explicit distribute.port_base wins over the derived one.
    assert distribute.slurm_tf_config(PARTIAL_STEP_ENV, port_base=30000)["cluster"]["worker"][0] == "gpu02:30000"


@pytest.mark.slow
def test_mwms_job_two_tasks(slurm, tmp_path):
    # The node's sys/ and proc/ as the template's topology command and each task read them: this node's two CPUs as
    # two NUMA nodes, GPU 0 hanging off NUMA node 1 (CPU 1), GPU 1 off node 0 (CPU 0).
    fake_node(tmp_path / "node", [("0000:07:00.0", 1), ("0000:87:00.0", 0)], cpu_lists=["0", "1"])
    job_id = slurm.submit(make_script(tmp_path, "mwms", *SHORT, "--doctor=gpus,all-reduce"),
                          TFSCALE_TOPOLOGY_ROOT=str(tmp_path / "node"))
    text = assert_completed_once(slurm, tmp_path, job_id)
    # The doctor ran on the node first: gpus needs a GPU (N/A); all-reduce ran two MWMS workers on the node.
    assert "tfscale-doctor on each of 1 nodes" in text
    assert re.search(r"^N/A +gpus +no GPU on this node", text, re.M) and "summary: 1 pass, 0 fail, 1 n/a" in text
    assert re.search(r"^PASS +all-reduce +between 2 processes on this node: 2 workers all-reduced", text, re.M)
    # Two NUMA nodes: the step ran with --cpu-bind=none and each task bound itself to its GPU's NUMA node, the
    # reverse of Slurm's order (cores would give task 0 CPU 0); each worker sizes its threads to its one core.
    assert "topology: --cpu-bind=none: each task binds itself to its GPU's NUMA node" in text
    assert "topology: local task 0 bound to CPUs 1 (GPU 0's NUMA node 1: 1 of the step's CPUs there" in text
    assert "topology: local task 1 bound to CPUs 0 (GPU 1's NUMA node 0: 1 of the step's CPUs there" in text
    topology = [line for line in text.splitlines() if "tfscale worker rank=" in line]
    assert len(topology) == 2 and all(line.endswith(" cores=1") for line in topology), topology
    result = summary(tmp_path)
    assert result["steps"] == 20 and result["num_workers"] == 2 and result["num_replicas"] == 2
    assert logged_steps(tmp_path) == [5, 10, 15, 20]
    assert "SLURM_RESTART_COUNT=0" in text and "nothing to stage" in text
    # The cluster came from Slurm's variables (the training srun is the job's step 1, after the doctor's step 0;
    # distribute.port_base=0).
    host = slurm.node
    port = default_port_base(job_id, step_id=1)
    assert f"tfscale cluster from Slurm job {job_id} step 1: workers {host}:{port},{host}:{port + 1}\n" in text
    assert "rank=0/2" in text and "rank=1/2" in text and "backend=mwms" in text


PARTIAL_NODE_JOB = """#!/bin/bash
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
#SBATCH --output={out}/job-%j.out
cd {repo}
srun --cpus-per-task=1 --cpu-bind=map_ldom:0 true
echo "map_ldom step: $?"
TFSCALE_CPU_BIND=gpu-numa TFSCALE_TOPOLOGY_ROOT={node} srun --cpus-per-task=1 --cpu-bind=none {python} -c '
import os; from tfscale.cluster import topology; topology.bind_at_start(); print("mask", sorted(os.sched_getaffinity(0)))'
echo "self-bound step: $?"
"""


def test_map_ldom_cannot_launch_on_part_of_a_node_and_a_task_binding_itself_can(slurm, tmp_path):
    """Why the templates do not use Slurm's map_ldom: a step holding 1 of the node's 2 CPUs (as 8 tasks of 8 CPUs
    on a node of 128 do) is refused by slurmd (task/affinity lllp_distribution: "Entire node must be allocated").
    The same step with --cpu-bind=none starts, Slurm binding it to its one CPU, and the task's own binding keeps to
    it when its GPU's NUMA node holds none of the step's CPUs."""
    node = tmp_path / "node"
    fake_node(node, [("0000:07:00.0", 1)], cpu_lists=["0", "1"])
    script = tmp_path / "partial.sbatch"
    script.write_text(PARTIAL_NODE_JOB.format(out=tmp_path, repo=REPO, python=sys.executable, node=node))
    job_id = slurm.submit(script)
    text = assert_completed_once(slurm, tmp_path, job_id)
    assert "Entire node must be allocated for map_ldom" in text and re.search(r"^map_ldom step: [1-9]", text, re.M), text
    assert "self-bound step: 0" in text, text
    (mask,) = re.findall(r"^mask \[(\d)\]$", text, re.M)  # one CPU: the step's own, wherever Slurm allocated it
    near = "CPUs 1 (GPU 0's NUMA node 1" if mask == "1" else "CPUs 0 (NUMA node 1 has 0 of the step's CPUs"
    assert f"topology: local task 0 bound to {near}" in text, text


UNBOUND_JOB = """#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
#SBATCH --output={out}/job-%j.out
cd {repo}
srun --cpu-bind={bind} {python} -c 'import os; from tfscale.cluster import devices
print("task", os.environ["SLURM_PROCID"], "affinity", devices.affinity_cores(), "usable", devices.usable_cores())'
"""


@pytest.mark.parametrize("bind, affinity", [("none", 2), ("cores", 1)])
def test_a_task_sizes_its_threads_to_slurm_cpus_per_task_bound_or_not(slurm, tmp_path, bind, affinity):
    # A site that does not bind (--cpu-bind=none) leaves each task the whole node (2 CPUs here); tfscale still
    # sizes its input threads to the task's share.
    script = tmp_path / "unbound.sbatch"
    script.write_text(UNBOUND_JOB.format(out=tmp_path, repo=REPO, python=sys.executable, bind=bind))
    job_id = slurm.submit(script)
    text = assert_completed_once(slurm, tmp_path, job_id)
    assert sorted(re.findall(r"^task \d affinity (\d) usable (\d)$", text, re.M)) == [(str(affinity), "1")] * 2, text


@pytest.mark.slow
def test_scaling_sweep_on_one_and_two_nodes_writes_the_report(slurm, tmp_path):
    # tools/scaling_sweep.py through real sbatch: a benchmark job per node count (1 task per node here: the one-node
    # job is the one-"GPU" reference), then the report job after both (--dependency=afterany). Horovod over
    # srun --mpi=pmix: the test bed's two nodes are one host, where two MWMS workers of a node count would both
    # take the node's first port.
    pair_partition_or_skip(slurm)
    horovod_with_mpi_or_skip(slurm)
    workdir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "scaling_sweep.py"), "--config=configs/smoke.py", "--nodes=1,2",
         "--gpus_per_node=0", "--tasks_per_node=1", "--backend=horovod", "--launcher=srun-pmix", f"--workdir={workdir}",
         "--partition=pair",
         "--time=00:10:00", "--num_batches=10", "--num_warmup_batches=3", "--allreduce_max_bytes=65536", "--submit"],
        cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report_job = int(re.search(r"the report: job (\d+)", result.stdout).group(1))
    assert slurm.wait(report_job) == [("COMPLETED", "0:0")], (workdir / "jobs").glob("*.out")
    rows = json.loads((workdir / "scaling.json").read_text())["rows"]
    assert [(r["nodes"], r["gpus"]) for r in rows] == [(1, 1), (2, 2)]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[1]["images_per_sec"] > 0
    assert all(r["predicted_images_per_sec"] > 0 and r["gradient_busbw_GBps"] > 0 for r in rows[1:])
    text = (workdir / "scaling.md").read_text()
    assert "| nodes | GPUs | images/sec | predicted | speedup | efficiency (1 GPU) |" in text
    assert re.search(r"^\| 2 \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", text, re.M), text
    assert (workdir / "scaling.png").stat().st_size > 10_000


# Two MWMS trainings at once in one 4-task job on the testbed's two nodes: each an `srun --nodes=1
# --ntasks=2` step, i.e. part of the allocation (--exact: a step gets only the CPUs it asks for).
# The wrapper prints what the step is, then becomes the training process.
PARTIAL_STEPS_JOB = """#!/bin/bash
#SBATCH --partition=pair
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:10:00
#SBATCH --output={out}/job-%j.out
set -euo pipefail
cd {repo}
export OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=2
echo "job: SLURM_NTASKS=$SLURM_NTASKS SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
pids=()
for run in a b; do
  srun --nodes=1 --ntasks=2 --exact --cpus-per-task=1 --output="{out}/step-$run.out" bash -c \\
    'echo "step $SLURM_STEP_ID: $SLURM_STEP_NUM_TASKS tasks on $SLURM_STEP_NODELIST, started $(date +%s.%N)"
     exec "$@"' \\
    step {python} -m tfscale.train --config=configs/smoke.py --workdir="{out}/run-$run" \\
    --config.distribute.backend=mwms {short} &
  pids+=($!)
done
code=0
for pid in "${{pids[@]}}"; do
  wait "$pid" || code=$?
done
exit "$code"
"""


def pair_partition_or_skip(slurm) -> list[str]:
    """The nodes of the testbed's two-node partition (skips the test on a host without one)."""
    nodes = slurm.run("sinfo", "-h", "-p", "pair", "-N", "-o", "%N").split()
    if len(nodes) != 2:
        pytest.skip("the testbed has no two-node partition `pair` (a host named localhost gets none)")
    return nodes


DOCTOR_STEP_JOB = """#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
#SBATCH --output={out}/job-%j.out
cd {repo}
srun --ntasks=2 {python} -m tfscale.doctor --only=all-reduce
"""


@pytest.mark.slow
def test_the_doctor_in_a_slurm_step_of_two_tasks_all_reduces_across_them(slurm, tmp_path):
    """What DOCTOR=all runs on N nodes (one doctor task per node), here as 2 tasks of one step on the testbed's
    one host: each task's MWMS worker takes its cluster and ports from the doctor's own Slurm step, as training
    derives them. (The testbed's two-node partition shares one host, where one task per node would give both
    workers the same port.)"""
    script = tmp_path / "doctor.sbatch"
    script.write_text(DOCTOR_STEP_JOB.format(out=tmp_path, repo=REPO, python=sys.executable))
    job_id = slurm.submit(script)
    runs = slurm.wait(job_id)
    text = job_log(tmp_path, job_id)
    assert runs == [("COMPLETED", "0:0")], text[-4000:]
    passes = re.findall(r"^PASS +all-reduce +across the 2 tasks of this Slurm step: 2 workers all-reduced with AUTO "
                        r"\(TensorFlow's rings\) on CPU:0: sum 3, expected 3", text, re.M)
    assert len(passes) == 2, text[-4000:]  # one line from each task's doctor


@pytest.mark.slow
def test_mwms_steps_using_part_of_a_two_node_allocation(slurm, tmp_path):
    """Each step's cluster is its 2 tasks on its node, not the job's 4 on 2 nodes; concurrent steps of one
    job (here on one real host) get disjoint default ports."""
    nodes = pair_partition_or_skip(slurm)
    script = tmp_path / "steps.sbatch"
    script.write_text(PARTIAL_STEPS_JOB.format(out=tmp_path, repo=REPO, python=sys.executable, short=" ".join(SHORT)))
    job_id = slurm.submit(script)
    runs = slurm.wait(job_id)
    text = job_log(tmp_path, job_id)
    step_logs = {run: (tmp_path / f"step-{run}.out").read_text() for run in "ab"
                 if (tmp_path / f"step-{run}.out").exists()}
    assert runs == [("COMPLETED", "0:0")], f"runs {runs}\n{text[-2000:]}\n" + "\n".join(
        f"--- step {run}\n{log[-3000:]}" for run, log in step_logs.items())
    node_list = slurm.run("scontrol", "show", "hostlist", ",".join(nodes)).strip()  # a,b or a compact h[0-1]
    assert f"job: SLURM_NTASKS=4 SLURM_JOB_NODELIST={node_list}" in text
    steps = {}  # run -> (step id, node, start time)
    for run, log in step_logs.items():
        found = set(re.findall(r"step (\d+): 2 tasks on (\S+), started ([\d.]+)", log))
        assert len(found) == 2, log[-3000:]  # one line per task, same step and node
        step_id, node = {(step, node) for step, node, _ in found}.pop()
        steps[run] = int(step_id), node, max(float(started) for _, _, started in found)
        port = default_port_base(job_id, int(step_id))
        assert f"tfscale cluster from Slurm job {job_id} step {step_id}: workers {node}:{port},{node}:{port + 1}\n" \
            in log, log[-3000:]
        assert "rank=0/2" in log and "rank=1/2" in log
        result = summary(tmp_path, f"run-{run}")
        assert result["steps"] == 20 and result["num_workers"] == 2 and result["num_replicas"] == 2
        config = json.loads((tmp_path / f"run-{run}" / layout.CONFIG).read_text())
        assert config["distribute"]["backend"] == "mwms"
    assert sorted(node for _, node, _ in steps.values()) == sorted(nodes)
    assert sorted(step_id for step_id, _, _ in steps.values()) == [0, 1]
    # The two trainings overlapped: both had started before the first finished (its summary.json).
    finished = [os.path.getmtime(tmp_path / f"run-{run}" / layout.SUMMARY) for run in "ab"]
    assert max(started for _, _, started in steps.values()) < min(finished)


@pytest.mark.slow
def test_horovod_gloo_job_two_ranks(slurm, tmp_path):
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    script = make_script(tmp_path, "horovod", "--launcher=horovodrun-gloo", "--gloo_iface=lo", *SHORT)
    job_id = slurm.submit(script)
    text = assert_completed_once(slurm, tmp_path, job_id)
    result = summary(tmp_path)
    assert result["steps"] == 20 and result["num_workers"] == 2
    assert "backend=horovod" in text and "rank=1/2" in text
    assert "horovodrun --gloo -np 2 -H " in text  # the host list built from scontrol show hostnames


# ------------------------------------------------------------------------------------- preemption

PREEMPT_AT_STEP = 20  # SIGTERM once a run has logged this step, after its first checkpoint (every epoch)
# 100 steps: long enough to be interrupted mid-run (the SIGTERM reaches the tasks ~0.1-0.2 s after step 20
# is logged, a few steps later; 80 steps take >= 2 s even on an idle machine).
PREEMPTED_EPOCHS, PREEMPTED_STEPS = 5, 100
# The preemption tests' jobs: launcher -> (the test that reads the job, make_sbatch's backend and launcher).
# MWMS and Horovod over srun --mpi=pmix across the two nodes; horovodrun with Gloo on `lo` on one.
PREEMPTED_JOBS = {
    "mwms": ("test_sigterm_before_time_limit_requeues_and_resumes", ("mwms",), TWO_NODES),
    "horovodrun": ("test_horovodrun_sigterm_requeues_and_resumes",
                   ("horovod", "--launcher=horovodrun-gloo", "--gloo_iface=lo"), ONE_NODE),
    "srun-pmix": ("test_horovod_srun_pmix_sigterm_requeues_and_resumes", ("horovod",), TWO_NODES),  # default launcher
}


@dataclasses.dataclass
class Preempted:
    """A preemption test's job: its directory (script, run/, job log), its id, and what stopped the wait for
    PREEMPT_AT_STEP other than the step itself."""
    path: pathlib.Path
    job_id: int
    runs_before_step: list = dataclasses.field(default_factory=list)  # its runs, when it ended before the step
    started: float | None = None  # when its job log appeared
    timed_out: bool = False


def skipped(check) -> bool:
    try:
        check()
    except pytest.skip.Exception:
        return True
    return False


@pytest.fixture(scope="module")
def preempted(slurm, tmp_path_factory, request) -> dict[str, Preempted]:
    """launcher -> the job of each preemption test selected in this session (and not skipped), submitted
    together; each job's batch shell gets SIGTERM once its first run logged PREEMPT_AT_STEP.

    Made for the first reader, which is so over the 90 s budget (docs/testing.md): it waits for all three jobs
    to be preempted. The node runs one of them at a time, so each runs as it would alone; but while one waits
    out its requeue delay (AuthInfo cred_expire + 1 s) another one runs instead of the node idling."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    skip_checks = {"horovodrun": lambda: pytest.importorskip("horovod.tensorflow"),
                   "srun-pmix": lambda: horovod_with_mpi_or_skip(slurm)}
    jobs = {}
    for launcher, (test, options, nodes) in PREEMPTED_JOBS.items():
        if test not in selected or skipped(skip_checks.get(launcher, lambda: None)):
            continue
        path = tmp_path_factory.mktemp(f"preempted-{launcher}")
        script = make_script(path, *options, f"--config.train.epochs={PREEMPTED_EPOCHS}",
                             "--config.train.log_every_steps=5", nodes=nodes)
        jobs[launcher] = Preempted(path, slurm.submit(script))
    preempt_at_step(slurm, list(jobs.values()), PREEMPT_AT_STEP)
    return jobs


def preempt_at_step(slurm, jobs: list[Preempted], step: int, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """SIGTERM to the batch shell only (what `#SBATCH --signal=B:TERM@T` does before the time limit) of each
    job once its run has logged `step`; a job that ended before, or logged no such step `timeout_s` after it
    started (or after all the jobs' turns), is noted instead."""
    queue_deadline = time.time() + timeout_s * len(jobs)
    waiting = list(jobs)
    checked = None  # the job-completion log's size when the jobs' runs were last read
    while waiting:
        for job in list(waiting):
            if any(s >= step for s in logged_steps(job.path)):
                slurm.run("scancel", "--batch", "--signal=TERM", str(job.job_id))
                # Its rerun queues behind the other jobs' first runs (Slurm's FIFO priority would put it first):
                # one of those runs while it waits out its requeue delay.
                slurm.run("scontrol", "update", f"JobId={job.job_id}", "Nice=1000")
                waiting.remove(job)
            elif job.started is None and (job.path / f"job-{job.job_id}.out").exists():
                job.started = time.time()
            elif time.time() > (queue_deadline if job.started is None else job.started + timeout_s):
                job.timed_out = True
                waiting.remove(job)
        if waiting and slurm.completions() != checked:  # first, and whenever a run of some job has ended since
            checked = slurm.completions()
            for job in list(waiting):
                job.runs_before_step = slurm.runs(job.job_id)
                if job.runs_before_step:
                    waiting.remove(job)
        time.sleep(EVENT_POLL_S)


def assert_preempted_then_resumed(slurm, job: Preempted, total_steps: int) -> int:
    """Checks the requeue after the SIGTERM and the resume; returns the step the first run stopped at."""
    tmp_path, job_id = job.path, job.job_id
    step = PREEMPT_AT_STEP
    assert not job.runs_before_step, f"job ended before step {step}: {job.runs_before_step}\n" \
        f"{job_log(tmp_path, job_id)[-3000:]}"
    assert not job.timed_out, f"no step {step} after {JOB_TIMEOUT_S} s\n{job_log(tmp_path, job_id)[-3000:]}"
    runs = slurm.wait(job_id)
    text = job_log(tmp_path, job_id)
    # The first run ends requeued (logged as PENDING); the rerun completes.
    assert [state for state, _ in runs] == ["PENDING", "COMPLETED"] and runs[-1][1] == "0:0", f"{runs}\n{text[-5000:]}"
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text
    assert f"requeueing job {job_id} (restart 1)" in text
    resumed = re.findall(r"resumed from \S+/ckpt-(\d+) at step (\d+)", text)
    assert len(resumed) == 1 and resumed[0][0] == resumed[0][1], text[-5000:]
    stopped_at = int(resumed[0][1])
    assert 20 <= stopped_at < total_steps
    assert f"checkpoint saved at step {stopped_at}" in text
    steps = logged_steps(tmp_path)
    assert steps == sorted(set(steps)) and steps[-1] == total_steps  # resumed, nothing logged twice
    assert summary(tmp_path)["steps"] == total_steps
    return stopped_at


@pytest.mark.slow
def test_sigterm_before_time_limit_requeues_and_resumes(slurm, preempted):
    job = preempted["mwms"]
    stopped_at = assert_preempted_then_resumed(slurm, job, total_steps=PREEMPTED_STEPS)
    text = job_log(job.path, job.job_id)
    assert "training step exited with 75" in text  # srun passed on the tasks' "checkpoint saved" code
    # Across the two nodes' addresses, in both runs: each node's worker named in the cluster Slurm gave.
    assert_ranks_on_both_nodes(slurm, text)
    first, second = pair_partition_or_skip(slurm)
    assert len(re.findall(rf"tfscale cluster from Slurm job {job.job_id} step \d+: workers {first}:\d+,{second}:\d+\n",
                          text)) >= 2, text[-5000:]  # the first run and the rerun
    assert text.count(f"checkpoint saved at step {stopped_at};") == 2, text[-5000:]  # both workers, the same step


@pytest.mark.slow
def test_horovodrun_sigterm_requeues_and_resumes(slurm, preempted):
    """horovodrun reports 1, not the ranks' 75, after passing SIGTERM on: the script requeues anyway."""
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    assert_preempted_then_resumed(slurm, preempted["horovodrun"], total_steps=PREEMPTED_STEPS)


def horovod_with_mpi_or_skip(slurm) -> None:
    """Skips unless Horovod is built with MPI and this Slurm has the pmix plugin."""
    hvd = pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    if not hvd.mpi_built():
        pytest.skip("Horovod is built without MPI: `make mpi` (apt-get install openmpi-bin libopenmpi-dev), "
                    "then `make horovod`")
    if "pmix" not in slurm.run("srun", "--mpi=list").split():
        pytest.skip("this Slurm has no pmix MPI plugin (`srun --mpi=list`)")


@pytest.mark.slow
def test_horovod_srun_pmix_job_two_ranks(slurm, tmp_path):
    """The template's default launcher: one Horovod rank per Slurm task, MPI wired up by PMIx, no horovodrun."""
    horovod_with_mpi_or_skip(slurm)
    job_id = slurm.submit(make_script(tmp_path, "horovod", *SHORT))  # --launcher=srun-pmix is the default
    text = assert_completed_once(slurm, tmp_path, job_id)
    result = summary(tmp_path)
    assert result["steps"] == 20 and result["num_workers"] == 2 and result["num_replicas"] == 2
    assert logged_steps(tmp_path) == [5, 10, 15, 20]
    assert "launching 2 Horovod ranks: srun --mpi=pmix " in text
    assert "horovod: 2 ranks, MPI controller" in text and "rank=0/2" in text and "rank=1/2" in text


@pytest.mark.slow
def test_horovod_srun_pmix_sigterm_requeues_and_resumes(slurm, preempted):
    """The batch shell's SIGTERM reaches every rank (scancel --signal=TERM): both save one step and exit 75,
    srun passes 75 on, the job requeues itself and the rerun resumes."""
    horovod_with_mpi_or_skip(slurm)
    job = preempted["srun-pmix"]
    stopped_at = assert_preempted_then_resumed(slurm, job, total_steps=PREEMPTED_STEPS)
    text = job_log(job.path, job.job_id)
    assert "training step exited with 75" in text
    assert text.count(f"checkpoint saved at step {stopped_at};") == 2, text[-5000:]  # both ranks, the same step
    assert_ranks_on_both_nodes(slurm, text)


PMIX_PROBE = """
import os
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
total = float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum))
print(f"rank {hvd.rank()}/{hvd.size()} on {os.environ['SLURMD_NODENAME']} sum {total:g}", flush=True)
"""


@pytest.mark.slow
def test_srun_pmix_spans_the_two_node_partition(slurm):
    """Each emulated node's slurmd runs its own PMIx server (its own TmpFS, see tools/slurm_testbed.sh)."""
    horovod_with_mpi_or_skip(slurm)
    nodes = pair_partition_or_skip(slurm)
    out = slurm.run("srun", "--partition=pair", "--nodes=2", "--ntasks=2", "--mpi=pmix", sys.executable, "-c",
                    PMIX_PROBE, timeout_s=120)
    found = sorted(re.findall(r"^rank (\d)/(\d) on (\S+) sum (\S+)$", out, re.MULTILINE))
    assert [(rank, size, total) for rank, size, _, total in found] == [("0", "2", "3"), ("1", "2", "3")], out
    assert sorted(node for _, _, node, _ in found) == sorted(nodes), out  # one rank on each node


# ------------------------------------------------------------------------------------------ studies

TINY_STUDY = """
def get_study():
    return {"config": "configs/smoke.py",
            "overrides": ["--config.train.epochs=0.25", "--config.schedule.warmup_epochs=0.1",
                          "--config.train.eval_every_epochs=0.25", "--config.checkpoint.every_epochs=0.25"],
            "cells": {"fast": ["--config.optim.lr_per_256=0.8"], "slow": ["--config.optim.lr_per_256=0.08"]},
            "seeds": [0, 1], "baseline": "fast"}
"""


def wait_for_array(slurm, job_id: int, tasks: int, log_glob: str) -> list[str]:
    """Waits until no task of array `job_id` is queued or running; returns the tasks' job logs."""
    deadline = time.time() + JOB_TIMEOUT_S
    while slurm.run("squeue", "-h", "-j", str(job_id)).strip():
        if time.time() > deadline:
            slurm.run("scancel", str(job_id))
            raise AssertionError(f"array {job_id} not finished after {JOB_TIMEOUT_S} s (cancelled)")
        time.sleep(QUEUE_POLL_S)
    logs_ = [open(path).read() for path in sorted(glob.glob(log_glob))]
    assert len(logs_) == tasks, f"{len(logs_)} task logs, expected {tasks}"
    return logs_


@pytest.mark.slow
def test_study_as_a_job_array_runs_every_cell_and_seed_and_skips_finished_runs(slurm, tmp_path):
    study_file = tmp_path / "tiny_study.py"
    study_file.write_text(TINY_STUDY)
    script = tmp_path / "study.sbatch"
    result = subprocess.run(
        [sys.executable, MAKE_SBATCH, f"--study={study_file}", "--nodes=1", "--gpus_per_node=0", "--tasks_per_node=1",
         "--cpus_per_task=1", "--backend=mwms", "--time=00:10:00", f"--workdir={tmp_path / 'study'}",
         f"--output={script}", f"--job_output={tmp_path}/job-%A_%a.out"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a job array of 4 runs (2 cells x 2 seeds)" in result.stdout
    job_id = slurm.submit(script)
    texts = wait_for_array(slurm, job_id, 4, str(tmp_path / f"job-{job_id}_*.out"))
    for text in texts:
        assert "training step exited with 0" in text, text[-3000:]
    # Task K ran the study's run K (cells in file order x seeds), each in its own workdir, with its overrides.
    for index, (cell, seed, lr_per_256) in enumerate([("fast", 0, 0.8), ("fast", 1, 0.8), ("slow", 0, 0.08),
                                                     ("slow", 1, 0.08)]):
        run = tmp_path / "study" / "runs" / cell / f"seed{seed}"
        assert f"array task {index} trains" in texts[index] and str(run) in texts[index]
        config = json.loads((run / layout.CONFIG).read_text())
        assert config["seed"] == seed and config["optim"]["lr_per_256"] == lr_per_256
        assert json.loads((run / layout.SUMMARY).read_text())["steps"] == 5
    # The tasks refreshed the report as they ended: the last one saw all four runs.
    report = json.loads((tmp_path / "study" / "study.json").read_text())
    assert [report["cells"][cell]["runs"] for cell in ("fast", "slow")] == [2, 2]
    # Resubmitted (a lost or cancelled array, or a new seed list): finished runs are not trained again.
    mtimes = sorted(os.path.getmtime(p) for p in glob.glob(str(tmp_path / "study" / "runs" / "*" / "*" / layout.SUMMARY)))
    again = slurm.submit(script)
    for text in wait_for_array(slurm, again, 4, str(tmp_path / f"job-{again}_*.out")):
        assert "run finished already" in text and "training step exited" not in text, text[-3000:]
    assert sorted(os.path.getmtime(p) for p in glob.glob(str(tmp_path / "study" / "runs" / "*" / "*" / layout.SUMMARY))) == mtimes


# ---------------------------------------------------------------------------------------- staging

CLASSES = ("circle", "square")
TRAIN_PER_CLASS, EVAL_PER_CLASS = 16, 8


def write_image_tree(root, per_class: int, seed: int) -> None:
    """root/<class>/*.jpg: 32x32 JPEGs, a bright or dark square per class (learnable, tiny)."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        os.makedirs(os.path.join(root, name))
        for i in range(per_class):
            pixels = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
            pixels[8:24, 8:24] += np.uint8(150 * label + 40)
            Image.fromarray(pixels, "RGB").save(os.path.join(root, name, f"{i:02d}.jpg"), "JPEG", quality=90)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Shards written by tfscale's converter: train in 2 shards, validation in 1, with manifests."""
    from tfscale.data.convert import convert

    root = tmp_path_factory.mktemp("slurm_data")
    write_image_tree(str(root / "train_images"), TRAIN_PER_CLASS, seed=1)
    write_image_tree(str(root / "eval_images"), EVAL_PER_CLASS, seed=2)
    out = str(root / "shards")
    convert.convert(str(root / "train_images"), out, "train", 2, num_workers=1)
    convert.convert(str(root / "eval_images"), out, "validation", 1, num_workers=1)
    return out


def node_local(slurm, node: str, path: str) -> str:
    """`path` as node `node` sees it (its local disk is mounted in its slurmd's mount namespace only)."""
    with open(os.path.join(slurm.root, f"slurmd-{node}.pid")) as f:
        return f"/proc/{int(f.read())}/root{path}"


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.slow
def test_staging_step_copies_shards_and_training_reads_the_copy(slurm, tmp_path, shards):
    """A TFRecord recipe (the CIFAR one, shrunk to the tiny shards) run as make_sbatch writes it on two nodes: no
    dataset override, the shards staged to each node's own local disk, each node's worker reads its node's copy."""
    stage_dir = os.path.join(slurm.root, "local", f"data-{tmp_path.name}")  # a tmpfs of each node's own
    script = make_script(
        tmp_path, "mwms", f"--data_dir={shards}", f"--stage_dir={stage_dir}", "--config.data.num_classes=2",
        f"--config.data.num_train_examples={2 * TRAIN_PER_CLASS}", f"--config.data.num_eval_examples={2 * EVAL_PER_CLASS}",
        "--config.data.global_batch_size=8", "--config.train.epochs=1", "--config.train.log_every_steps=2",
        "--config.schedule.decay=cosine",  # the recipe's steps at epochs 91 and 136 lie beyond 1 epoch
        "--config.model.name=cifar_resnet8",  # the recipe's data path; a smaller model keeps the job short
        config="configs/cifar_resnet20.py", nodes=TWO_NODES,
    )
    job_id = slurm.submit(script)
    text = assert_completed_once(slurm, tmp_path, job_id)
    assert_ranks_on_both_nodes(slurm, text)
    names = ["train-00000-of-00002", "train-00001-of-00002", "validation-00000-of-00001"]
    # Shards + manifests; not dali-index/, which DALI writes in a copy when it reads one.
    converted = sorted(name for name in os.listdir(shards)
                       if not name.startswith(".") and os.path.isfile(os.path.join(shards, name)))
    assert set(names) < set(converted)
    # Each node holds its own copy, seen through its slurmd's mount namespace; this host's directory stays empty.
    assert not os.path.exists(stage_dir)
    staged = {node: node_local(slurm, node, stage_dir) for node in pair_partition_or_skip(slurm)}
    for node, directory in staged.items():
        # Every eval shard, and the train shard of its own worker (rank r reads train shard r of 2).
        assert "validation-00000-of-00001" in os.listdir(directory) and \
            len([n for n in os.listdir(directory) if n.startswith("train-")]) == 1, (node, os.listdir(directory))
        for name in os.listdir(directory):
            if not name.startswith(".") and os.path.isfile(os.path.join(directory, name)):
                assert sha256(os.path.join(directory, name)) == sha256(os.path.join(shards, name)), (node, name)
    assert {n for d in staged.values() for n in os.listdir(d) if n.startswith("train-")} == set(names[:2])
    assert len(re.findall(rf"staged {re.escape(shards)} -> {re.escape(stage_dir)}: copied \d+ files", text)) == 2, \
        text[-3000:]
    # Training read TFRecords (the recipe's own dataset), from the staged copy (not the shared one), all of it.
    config = json.loads((tmp_path / "run" / layout.CONFIG).read_text())
    assert config["data"]["dataset"] == "tfrecord"
    assert config["data"]["data_dir"] == stage_dir
    eval_rows = [json.loads(r) for r in (tmp_path / "run" / layout.METRICS).read_text().splitlines() if "eval_top1" in r]
    assert eval_rows[-1]["eval_examples"] == 2 * EVAL_PER_CLASS
    assert summary(tmp_path)["steps"] == 4 and summary(tmp_path)["num_workers"] == 2
