"""Start-up faults of a multi-worker (MWMS) job: each named, within `distribute.connect_timeout_s`, exit 69;
and the data faults any run finds before its first step: one FATAL line naming the file, exit 65 or 66.

Real processes on 127.0.0.1, each worker given its TF_CONFIG by the test as srun or a user would:
a worker that never starts (leader or not), a peer address whose port nobody listens on, this
worker's port already in use, a host name that does not resolve; then the watchdog that backs up
TensorFlow's own registration timeout, and `tfscale.launch` passing the code through.
Exit code 69 is sysexits' EX_UNAVAILABLE (`errors.EXIT_CLUSTER_UNAVAILABLE`), never 137, which
reads as the out-of-memory killer.
"""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, quiet_env

from tfscale.launch import launch
from tfscale.workdir import layout

EXIT_CLUSTER_UNAVAILABLE = 69
# Both workers of the wrong-port test must register within this, each after its own start-up on a busy machine.
CONNECT_TIMEOUT_S = 5
# Where a worker never starts, no wait is long enough for it: the shortest timeout proves the same, and the
# start-up of the one worker that runs comes before the timeout begins (it is in MARGIN_S).
MISSING_PEER_TIMEOUT_S = 1
# Python + TensorFlow start-up on a busy 2-core machine, the ~5 s a non-leader's registration takes
# beyond the timeout (TF 2.21), and the peer probe: "within the timeout" means within this much more.
MARGIN_S = 25
# The faults caught before connecting must not wait for the connect timeout: it is set far above this.
AT_ONCE_S = 45


def tf_config(addresses, index):
    return json.dumps({"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}})


def addresses_of(ports):
    return [f"127.0.0.1:{port}" for port in ports]


def train_command(workdir, connect_timeout_s=CONNECT_TIMEOUT_S, *overrides):
    return [sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
            "--config.distribute.backend=mwms", f"--config.distribute.connect_timeout_s={connect_timeout_s}",
            *overrides]


def start(command, config):
    """One worker with TF_CONFIG `config`; returns (process, start time)."""
    proc = subprocess.Popen(command, cwd=REPO, env=quiet_env(TF_CONFIG=config), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, time.time()


def finish(proc, started, timeout_s=180):
    """(exit code, seconds since start, stderr) of a worker started by `start`."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    return proc.returncode, time.time() - started, stderr


def run_worker(command, config, timeout_s=180):
    return finish(*start(command, config), timeout_s=timeout_s)


def assert_unavailable(code, elapsed_s, stderr, within_s, *named):
    assert code == EXIT_CLUSTER_UNAVAILABLE, stderr[-3000:]
    assert elapsed_s < within_s, f"took {elapsed_s:.1f} s (limit {within_s} s)"
    for text in named:
        assert text in stderr, stderr[-3000:]
    assert "Stopping this worker (exit code 69)." in stderr
    assert "Traceback" not in stderr  # one named line, not a stack


@pytest.mark.slow
@pytest.mark.parametrize("started", [0, 1], ids=["worker-1-missing", "leader-missing"])
def test_worker_that_never_starts_is_named_within_the_connect_timeout(tmp_path, started):
    """2-worker TF_CONFIG, one worker started: TensorFlow's registration timeout ends it, the probe names the other."""
    addresses = addresses_of(launch.free_ports(2))
    missing = 1 - started
    code, elapsed_s, stderr = run_worker(train_command(tmp_path / "run", MISSING_PEER_TIMEOUT_S),
                                         tf_config(addresses, started))
    assert_unavailable(code, elapsed_s, stderr, MISSING_PEER_TIMEOUT_S + MARGIN_S,
                       f"the cluster did not come up within distribute.connect_timeout_s={MISSING_PEER_TIMEOUT_S}s",
                       f"no answer from: worker {missing} at {addresses[missing]} (Connection refused)")
    assert not (tmp_path / "run" / layout.CHECKPOINTS).exists()  # nothing trained, nothing written
    print(f"worker {started} alone: exit {code} after {elapsed_s:.1f} s")


@pytest.mark.slow
def test_wrong_peer_port_is_named_on_both_workers(tmp_path):
    """Both workers start, but rank 0's TF_CONFIG gives worker 1 a port nobody listens on.

    The cluster registers (workers register by task name, not address), then rank 0's pre-flight
    all-reduce cannot reach worker 1: rank 0 names the wrong address; rank 1 loses its leader and
    names it. (A wrong port with the peer not started is the case above.)
    """
    port_0, port_1, port_nobody = launch.free_ports(3)
    right = addresses_of([port_0, port_1])
    wrong = addresses_of([port_0, port_nobody])
    command = train_command(tmp_path / "run", CONNECT_TIMEOUT_S, "--config.distribute.heartbeat_timeout_s=5")
    workers = [start(command, tf_config(wrong, 0)), start(command, tf_config(right, 1))]
    (code_0, elapsed_0, stderr_0), (code_1, elapsed_1, stderr_1) = [finish(*worker) for worker in workers]
    assert_unavailable(code_0, elapsed_0, stderr_0, CONNECT_TIMEOUT_S + MARGIN_S,
                       "the cluster did not come up: the pre-flight all-reduce failed",
                       f"no answer from: worker 1 at 127.0.0.1:{port_nobody} (Connection refused)")
    # Rank 1 learns of it when its leader is gone: the heartbeat (5 s), not the connect timeout, bounds it.
    assert_unavailable(code_1, elapsed_1, stderr_1, CONNECT_TIMEOUT_S + MARGIN_S + 10,
                       f"no answer from: worker 0 at 127.0.0.1:{port_0}")
    print(f"rank 0: exit {code_0} after {elapsed_0:.1f} s; rank 1: exit {code_1} after {elapsed_1:.1f} s")


@pytest.mark.slow
def test_own_port_in_use_fails_at_once_naming_it(tmp_path):
    """This worker's TF_CONFIG port is taken (a leftover process): named before TensorFlow tries to bind it."""
    ports = launch.free_ports(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", ports[0]))
        squatter.listen()
        code, elapsed_s, stderr = run_worker(train_command(tmp_path / "run", 300), tf_config(addresses_of(ports), 0))
    assert_unavailable(code, elapsed_s, stderr, AT_ONCE_S,
                       f"this worker's port {ports[0]} (worker 0 at 127.0.0.1:{ports[0]} in the cluster spec) "
                       "is already in use by another process")
    print(f"port in use: exit {code} after {elapsed_s:.1f} s")


@pytest.mark.slow
def test_unresolvable_host_fails_at_once_naming_it(tmp_path):
    """A host name in the cluster spec that does not resolve: named before connecting, not after the timeout."""
    ports = launch.free_ports(2)
    addresses = [f"127.0.0.1:{ports[0]}", f"nosuchhost.invalid:{ports[1]}"]
    code, elapsed_s, stderr = run_worker(train_command(tmp_path / "run", 300), tf_config(addresses, 0))
    assert_unavailable(code, elapsed_s, stderr, AT_ONCE_S,
                       f"the cluster spec has addresses no worker can connect to: worker 1 at nosuchhost.invalid:"
                       f"{ports[1]}: host name 'nosuchhost.invalid' does not resolve")
    print(f"unresolvable host: exit {code} after {elapsed_s:.1f} s")


# distribute.setup alone (no data, no model). argv[1] "no_tf_timeout": TensorFlow's registration
# barrier is not set, as on a TensorFlow without it, so the leader would wait forever and only the
# watchdog can end it. With TFSCALE_LOCAL_RANK == argv[2], the worker sleeps instead of connecting
# (a worker that never got as far as TensorFlow).
SETUP_SCRIPT = r"""
import os, sys, time
from tfscale.cluster import connect
from tfscale.cluster import distribute
from tfscale.config import base_config
if os.environ.get("TFSCALE_LOCAL_RANK") == sys.argv[2]:
    time.sleep(600)
if sys.argv[1] == "no_tf_timeout":
    connect._register_with_barrier = lambda: None
cfg = base_config().distribute
cfg.backend, cfg.connect_timeout_s = "mwms", float(sys.argv[3])
distribute.setup(cfg)
print("cluster up")
"""


@pytest.mark.slow
def test_watchdog_ends_a_hung_connect_with_exit_69(tmp_path):
    """Where TensorFlow does not time out (the leader without the registration barrier), the watchdog
    names the silent worker at connect_timeout_s and the C-level signal handler exits 69, not SIGKILL's 137."""
    addresses = addresses_of(launch.free_ports(2))
    code, elapsed_s, stderr = run_worker(
        [sys.executable, "-c", SETUP_SCRIPT, "no_tf_timeout", "none", str(MISSING_PEER_TIMEOUT_S)],
        tf_config(addresses, 0))
    assert_unavailable(code, elapsed_s, stderr, MISSING_PEER_TIMEOUT_S + MARGIN_S,
                       f"the cluster did not come up within distribute.connect_timeout_s={MISSING_PEER_TIMEOUT_S}s "
                       f"(the watchdog stepped in after {MISSING_PEER_TIMEOUT_S}s)",
                       f"no answer from: worker 1 at {addresses[1]} (Connection refused)")
    assert "did not exit on signal" not in stderr  # no SIGKILL was needed
    print(f"watchdog: exit {code} after {elapsed_s:.1f} s")


@pytest.mark.slow
def test_launcher_exits_69_and_says_why():
    """Under tfscale.launch rank 1 never connects: rank 0's 69 is the job's code, and the launcher names it."""
    from tfscale import errors

    assert errors.EXIT_CLUSTER_UNAVAILABLE == EXIT_CLUSTER_UNAVAILABLE  # the one definition, launcher and workers
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--grace_period_s=2", "--",
         "-c", SETUP_SCRIPT, "tf_timeout", "1", str(MISSING_PEER_TIMEOUT_S)],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=180,
    )
    elapsed_s = time.time() - started
    assert result.returncode == EXIT_CLUSTER_UNAVAILABLE, result.stderr[-3000:]
    assert elapsed_s < MISSING_PEER_TIMEOUT_S + MARGIN_S, f"took {elapsed_s:.1f} s"
    assert "[rank 0] " in result.stderr and "no answer from: worker 1 at 127.0.0.1:" in result.stderr
    assert "tfscale.launch: rank 0 exited with code 69; stopping the other 1 worker(s)" in result.stderr
    assert ("tfscale.launch: exit code 69 (EX_UNAVAILABLE): a worker was not there. Either the cluster did not come "
            "up (the workers' 'tfscale pre-flight:' lines above name the workers, ports or host names at fault)"
            in result.stderr)
    print(f"launcher: exit {result.returncode} after {elapsed_s:.1f} s")


# --- data faults found at start-up: one FATAL line each, a documented exit code, nothing written ---------------


def _digits_run(shards, counts, workdir):
    return subprocess.run(
        [sys.executable, "-m", "tfscale.train", "--config=configs/digits.py", f"--workdir={workdir}",
         f"--config.data.data_dir={shards}", f"--config.data.num_train_examples={counts['train']}",
         f"--config.data.num_eval_examples={counts['validation']}"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fault, exit_code, line", [
    ("manifest_not_json", 65, "FATAL data error: manifest {shards}/manifest-train.json is not valid JSON: "),
    ("no_validation_split", 66, "FATAL data error: no TFRecord shards named validation-*-of-* in {shards} (exit code 66)"),
    ("shard_cut_short", 65, "FATAL data error: shard {shards}/train-00001-of-00002 has 100 bytes but "),
])
def test_a_data_fault_at_start_up_is_one_fatal_line_with_its_exit_code(digit_shards, tmp_path, fault, exit_code,
                                                                       line):
    source, counts = digit_shards
    shards = tmp_path / "shards"
    shutil.copytree(source, shards)
    if fault == "manifest_not_json":
        (shards / "manifest-train.json").write_text('{"shards": [')  # a copy cut short
    elif fault == "no_validation_split":
        for path in shards.glob("*validation*"):
            path.unlink()
    else:
        with open(shards / "train-00001-of-00002", "r+b") as f:
            f.truncate(100)
    workdir = tmp_path / "run"
    result = _digits_run(shards, counts, workdir)
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert line.format(shards=shards) in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (workdir / layout.CHECKPOINTS).exists()
