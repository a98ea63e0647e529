"""Many hosts on one machine (tfscale.launch.netbed): the bed's hosts, links and take-down; jobs across two
hosts on both backends; who reaches a job's ports, tried from another host.

The bed is network namespaces on a private bridge: it needs root (CI runs as root); elsewhere every test
here skips, saying so. All traffic stays on the bed's own subnet.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, quiet_env
from test_multiworker import DRIVER, SHORT, assert_weights_close, logged_steps, weights
from test_ports import EVERY_INTERFACE, LOOPBACK, TRAIN, addresses, listening, training

from tfscale.launch import launch, netbed

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc") and shutil.which("unshare")),
    reason="the netbed needs root and iproute2 + util-linux (ip, tc, unshare): network namespaces, veth pairs, a bridge")

PROBE = os.path.join(REPO, "tests", "helpers", "netbed_probe.py")
NETBED_TOOL = os.path.join(REPO, "tools", "netbed.py")
RATE_MBIT = 100  # each link of the module's bed, both ways
# 10 steps of global batch 32 with BatchNorm frozen (inference statistics), so that the ranks' halves give what one
# worker's whole batch gives on both backends (Horovod has no Keras 3 sync BatchNorm).
FROZEN_BN = ["--freeze_bn", *SHORT, "--config.model.sync_bn=False"]


@pytest.fixture(scope="module")
def bed():
    """Three hosts, links shaped to RATE_MBIT: hosts 0-1 run jobs, host 2 is "another host on the network"."""
    prefix = f"tfs{os.getpid() % 100000}"
    made = netbed.up(prefix, num_hosts=3, rate_mbit=RATE_MBIT)
    try:
        yield made
    finally:
        netbed.down(prefix)
    assert netbed.leftovers(prefix) == []


def on_host(bed, index, *argv, **kwargs):
    return subprocess.run(bed.host_command(index, [sys.executable, PROBE, *argv]), capture_output=True, text=True,
                          timeout=60, check=True, **kwargs).stdout


def probe_from(bed, index, targets):
    """{"address:port": "open" | "refused" | ...} as host `index` finds them."""
    return json.loads(on_host(bed, index, "connect", *targets))


def link_rate_mbit(bed, sender, receiver, num_bytes=3_000_000):
    address = bed.hosts[receiver].address
    port = 5201 + receiver
    server = subprocess.Popen(bed.host_command(receiver, [sys.executable, PROBE, "recv", address, str(port)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        on_host(bed, sender, "send", address, str(port), str(num_bytes))
        return float(server.communicate(timeout=30)[0])
    finally:
        server.kill()


def test_each_host_has_its_own_address_and_name_and_a_link_shaped_both_ways(bed):
    seen = json.loads(on_host(bed, 1, "whoami", *(host.namespace for host in bed.hosts)))
    # Its own host name, and every host's name resolves to that host's address, as on a cluster's nodes.
    assert seen["hostname"] == bed.hosts[1].namespace
    assert seen["resolves"] == {host.namespace: host.address for host in bed.hosts}
    # One route: the bed's subnet. Nothing sent on a host can leave the bed.
    assert seen["routes"] == [bed.subnet]
    assert set(netbed.qdiscs(bed).values()) == {"tbf"} and len(netbed.qdiscs(bed)) == 2 * len(bed.hosts)
    # A token bucket lets a burst of 64 KiB through at once: over 3 MB that is 2 % above the rate at most.
    # An unshaped veth here carries gigabits a second.
    for sender, receiver in ((0, 1), (1, 0)):
        measured = link_rate_mbit(bed, sender, receiver)
        assert 0.5 * RATE_MBIT < measured < 1.1 * RATE_MBIT, (sender, receiver, measured)


def test_down_after_a_killed_up_and_with_a_process_left_on_a_host_leaves_nothing(tmp_path):
    prefix = f"tfk{os.getpid() % 100000}"
    up = subprocess.Popen([sys.executable, NETBED_TOOL, "up", f"--prefix={prefix}", "--hosts=60", "--rate_mbit=50"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stray = None
    try:
        deadline = time.time() + 60
        while len([found for found in netbed.leftovers(prefix) if found.startswith("netns")]) < 3:
            assert up.poll() is None and time.time() < deadline, up.stderr.read() if up.poll() is not None else ""
            time.sleep(0.05)
        up.kill()  # kill -9 in the middle of making host 3 or so: links, qdiscs, namespaces half made
        up.wait()
        # A straggler's CPU cgroup on host 0, with a process left in it.
        half_made = netbed.set_cpu(netbed.load(prefix), 0, 0.5)
        stray = subprocess.Popen(half_made.host_command(0, ["sleep", "600"]))
        assert netbed.leftovers(prefix), "the killed up made nothing to take down"
        down = subprocess.run([sys.executable, NETBED_TOOL, "down", f"--prefix={prefix}"], capture_output=True,
                              text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert f"removed netns {prefix}-h0" in down.stdout and f"removed link {prefix}-br" in down.stdout
        assert f"removed cgroup {half_made.hosts[0].cpu_cgroup}" in down.stdout
        assert netbed.leftovers(prefix) == []
        assert stray.wait(timeout=10) == -signal.SIGKILL  # the process left on a host went with it
        again = subprocess.run([sys.executable, NETBED_TOOL, "down", f"--prefix={prefix}"], capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 0 and again.stdout == "", again.stderr
    finally:
        for proc in (up, stray):
            if proc is not None and proc.poll() is None:
                proc.kill()
        netbed.down(prefix)


def test_a_host_given_a_fifth_of_a_core_gets_a_fifth_of_a_core(bed):
    """The straggler of docs/scaling.md: every process started on the host shares its quota. A fifth, so that the
    quota, not other tests' processes on the machine's two cores, is what holds the busy loop back."""
    limited = netbed.set_cpu(bed, 2, 0.2)
    try:
        spinner = subprocess.run(limited.host_command(2, [sys.executable, PROBE, "spin", "1.5"]), capture_output=True,
                                 text=True, timeout=60, check=True)
        stat = dict(line.split() for line in open(os.path.join(limited.hosts[2].cpu_cgroup, "cpu.stat")))
    finally:
        unlimited = netbed.set_cpu(bed, 2, None)
    # CPU seconds per wall second of a busy loop: the quota's 0.2, held there by the quota: the cgroup was
    # throttled in a third or more of the ~150 periods of 10 ms.
    assert 0.1 < float(spinner.stdout) < 0.3 and int(stat["nr_throttled"]) > 50, (spinner.stdout, stat)
    cgroup = unlimited.hosts[2].cpu_cgroup  # and lifted again: cgroup v1's quota -1, or v2's "max PERIOD"
    quota_file = next(f for f in ("cpu.cfs_quota_us", "cpu.max") if os.path.exists(os.path.join(cgroup, f)))
    with open(os.path.join(cgroup, quota_file)) as f:
        assert f.read().split()[0] in ("-1", "max")


def test_the_launcher_refuses_a_missing_bed_and_more_workers_than_hosts(bed, tmp_path):
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--", "-c", "pass"]
    missing = subprocess.run([*command[:3], "--netbed=tfsnone", *command[3:]], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "no netbed 'tfsnone'" in missing.stderr, missing.stderr
    too_many = subprocess.run([*command[:3], f"--netbed={bed.prefix}", "--num_workers=4", "--", "-c", "pass"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert too_many.returncode == 2 and f"netbed '{bed.prefix}' has 3 hosts" in too_many.stderr, too_many.stderr


# ----------------------------------------------------------------------------------------------
# Jobs across hosts


@pytest.fixture(scope="module")
def one_worker_global_batch(tmp_path_factory):
    """Reference: 1 worker on this host, global batch 32, BatchNorm frozen."""
    root = tmp_path_factory.mktemp("single")
    result = subprocess.run([sys.executable, DRIVER, str(root / "w.npz"), *FROZEN_BN, f"--workdir={root / 'run'}"],
                            cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return weights(root / "w.npz"), weights(root / "w_init.npz"), logged_steps(str(root / "run"))


def launch_on_bed(bed, backend, tmp_path, *argv, num_workers=2):
    command = [sys.executable, "-m", "tfscale.launch", f"--netbed={bed.prefix}", f"--num_workers={num_workers}",
               f"--backend={backend}", "--threads_per_worker=1", "--", *argv]
    log = open(tmp_path / "launch.log", "w")
    return subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT)


def worker_sockets(launcher_pid, num_workers, timeout_s=120):
    """{worker pid: {(address, port)}} once each of the launcher's `num_workers` workers listens."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = {pid: sockets for pid, sockets in listening(launcher_pid).items() if pid != launcher_pid}
        if len(found) == num_workers:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the workers of launcher {launcher_pid} never all listened")


def namespace_of(pid):
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_two_hosts_equal_one_worker_with_the_global_batch(bed, backend, tmp_path, one_worker_global_batch):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    workdir = tmp_path / "run"
    launcher = launch_on_bed(bed, backend, tmp_path, DRIVER, str(tmp_path / "w{rank}.npz"), *FROZEN_BN,
                             f"--workdir={workdir}", f"--config.distribute.backend={backend}")
    try:
        if backend == "mwms":
            # Exposure, tried from host 2 while the job runs on hosts 0-1 (docs/security.md's table): each worker's
            # TensorFlow server is on every interface, and another host on the network reaches it.
            sockets = worker_sockets(launcher.pid, 2)
            assert all(len(found) == 1 for found in sockets.values()) and addresses(sockets) <= EVERY_INTERFACE, sockets
            address = {host.namespace: host.address for host in bed.hosts}
            targets = [f"{address[namespace_of(pid)]}:{port}" for pid, found in sockets.items() for _, port in found]
            assert set(probe_from(bed, 2, targets).values()) == {"open"}, (targets, sockets)
        assert launcher.wait(timeout=300) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    finally:
        launcher.kill()
    log = (tmp_path / "launch.log").read_text()
    # Each worker on its own host, under that host's name.
    assert f"host={bed.hosts[0].namespace}" in log and f"host={bed.hosts[1].namespace}" in log, log[-4000:]

    rank0, rank1 = weights(tmp_path / "w0.npz"), weights(tmp_path / "w1.npz")
    assert_weights_close(rank0, rank1, rtol=0, atol=0)  # identical on both hosts
    reference, initial, reference_rows = one_worker_global_batch
    assert max(np.abs(w - w0).max() for w, w0 in zip(rank0, initial)) > 5e-3  # training moved them
    # 2 hosts x 16 = 1 worker x 32, up to the float summation order of the all-reduce (as on loopback).
    assert_weights_close(rank0, reference, rtol=2e-3, atol=2e-4)
    rows = logged_steps(str(workdir))
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows] == [5, 10]
    for ours, ref in zip(rows, reference_rows):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-3)


@pytest.mark.slow
def test_horovod_through_tfscale_launch_on_one_host_is_unreachable_from_another(bed, tmp_path):
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    # The whole job, launcher included, on host 0; host 2 tries every port its processes listen on.
    command = bed.host_command(0, [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1",
                                   "--backend=horovod", "--", *TRAIN, f"--workdir={tmp_path / 'run'}"])
    with training(command, tmp_path, "launch") as (launcher, sockets):
        assert set(sockets) == {launcher.pid} and addresses(sockets) <= LOOPBACK, sockets
        ports = [port for found in sockets.values() for _, port in found]
        from_another_host = probe_from(bed, 2, [f"{bed.hosts[0].address}:{port}" for port in ports])
        on_the_host = probe_from(bed, 0, [f"127.0.0.1:{port}" for port in ports])
    assert set(from_another_host.values()) == {"refused"}, from_another_host
    assert set(on_the_host.values()) == {"open"}, on_the_host  # the probe does reach what is there to reach
    assert launch.MWMS_REACHABLE not in (tmp_path / "launch.log").read_text()


@pytest.mark.slow
def test_bench_netbed_measures_both_modes_beside_the_prediction(tmp_path):
    """`make bench-netbed` shrunk to one round at one rate: the table's shape, not its figures (docs/scaling.md)."""
    from test_tools import run_target

    prefix = f"tfw{os.getpid() % 100000}"
    result = run_target("bench-netbed", "--rates_mbit=100", "--rounds=1", "--num_batches=3", "--num_warmup_batches=1",
                        "--allreduce_max_bytes=262144", f"--workdir={tmp_path}", f"--prefix={prefix}")
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = report["rows"]
    assert row["rate_mbit"] == 100 and len(row["one_message"]) == len(row["buckets"]) == len(report["ceilings"]) == 1
    assert all(0 < e < 1.5 for e in (*row["one_message"], *row["buckets"], *report["ceilings"]))
    assert 0 < row["predicted_one_message"] <= 1 and 0 < row["predicted_buckets"] <= 1
    assert "| 100 Mbit/s |" in result.stdout and "Ceiling (two 1-worker runs side by side" in result.stdout
    assert netbed.leftovers(prefix) == []  # the sweep took its bed down


def test_the_straggler_sweep_measures_and_predicts_each_rate(tmp_path):
    """tools/netbed_sweep.py --straggler_cpu shrunk to one round at one rate: the table's shape, not its figures."""
    prefix = f"tfq{os.getpid() % 100000}"
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "netbed_sweep.py"), "--straggler_cpu=0.5",
                             "--rates_mbit=100", "--rounds=1", "--num_batches=3", "--num_warmup_batches=1",
                             "--allreduce_max_bytes=262144", f"--workdir={tmp_path}", f"--prefix={prefix}"],
                            cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = report["rows"]
    assert row["rate_mbit"] == 100 and len(row["efficiency"]) == len(report["straggler_shares"]) == 1
    assert all(0 < e < 1.5 for e in (*row["efficiency"], *report["straggler_shares"]))
    assert 0 < row["predicted_spread_term"] <= 1 and 0 < row["predicted_slowest_gpu"] <= 1
    assert "| 100 Mbit/s |" in result.stdout and "The straggler alone runs at" in result.stdout
    assert netbed.leftovers(prefix) == []  # the sweep took its bed down, the straggler's cgroup with it
