"""Who can reach a running job: the ports each local launch path opens, read from the kernel's socket tables.

Each path starts 2 workers of configs/smoke.py on this host; once they train, every listening TCP socket
of the launcher and its descendants is read from /proc (the process's fds against /proc/net/tcp{,6}) and
checked against docs/security.md's table: loopback where tfscale chooses the address, every interface
where TensorFlow, Horovod's horovodrun or OpenMPI choose it.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, quiet_env

from tfscale.launch import launch

pytestmark = pytest.mark.slow

EVERY_INTERFACE = {"0.0.0.0", "::"}
LOOPBACK = {"127.0.0.1", "::1"}
TRAIN = ["-m", "tfscale.train", "--config=configs/smoke.py", "--config.train.epochs=50"]


def _listening_inodes(pid: int | str = "self") -> dict[str, tuple[str, int]]:
    """{socket inode: (address, port)} of every listening TCP socket in the network namespace of `pid`."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    return found


def _process_tree(pid: int) -> list[int]:
    pids = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    pids += _process_tree(child)
        except FileNotFoundError:
            continue
    return pids


def listening(root_pid: int) -> dict[int, set[tuple[str, int]]]:
    """{pid: {(address, port)}} of the listening sockets of `root_pid` and its descendants (each read from
    the tables of its own network namespace: a test bed's host has its own)."""
    found = {}
    for pid in _process_tree(root_pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            inodes = _listening_inodes(pid)
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.setdefault(pid, set()).add(inodes[target[8:-1]])
    return found


@contextlib.contextmanager
def training(command, tmp_path, name):
    """Starts `command` and yields (its process, {pid: sockets} of its tree) once the first step is logged; kills
    the whole tree on leaving. The output goes to tmp_path/NAME.log."""
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while " step " not in log_path.read_text():
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        yield proc, listening(proc.pid)
    finally:
        for pid in reversed(_process_tree(proc.pid)):  # tfscale.launch's workers run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def run_until_training(command, tmp_path, name):
    """Starts `command`, waits for its first logged step, returns ({pid: sockets}, launcher pid, output)."""
    with training(command, tmp_path, name) as (proc, sockets):
        pass
    return sockets, proc.pid, (tmp_path / f"{name}.log").read_text()


def addresses(sockets: dict[int, set[tuple[str, int]]], pids=None) -> set[str]:
    return {address for pid, found in sockets.items() if pids is None or pid in pids for address, _ in found}


def test_mwms_workers_listen_on_every_interface_and_the_launcher_says_so(tmp_path):
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1", "--", *TRAIN,
               f"--workdir={tmp_path / 'run'}"]
    sockets, launcher_pid, output = run_until_training(command, tmp_path, "mwms")
    workers = [pid for pid in sockets if pid != launcher_pid]
    # One TensorFlow gRPC server a worker (TensorFlow binds "0.0.0.0:port": grpc_server_lib.cc), nothing else.
    assert len(workers) == 2 and launcher_pid not in sockets, sockets
    assert all(len(sockets[pid]) == 1 and addresses(sockets, [pid]) <= EVERY_INTERFACE for pid in workers), sockets
    said = f"tfscale.launch: {launch.MWMS_REACHABLE}" in output
    assert said == launch.has_other_interfaces(), output[-3000:]


def test_horovod_through_tfscale_launch_keeps_every_port_on_loopback(tmp_path):
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1",
               "--backend=horovod", "--", *TRAIN, f"--workdir={tmp_path / 'run'}"]
    sockets, launcher_pid, output = run_until_training(command, tmp_path, "horovod")
    # The launcher's rendezvous server, for the whole run; Gloo (HOROVOD_GLOO_IFACE=lo) and tfscale's
    # heartbeat listen only while the ranks connect.
    assert set(sockets) == {launcher_pid} and addresses(sockets) <= LOOPBACK, sockets
    assert launch.MWMS_REACHABLE not in output


def test_horovodrun_gloo_rendezvous_listens_on_every_interface(tmp_path):
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               "--network-interfaces", "lo", sys.executable, *TRAIN, f"--workdir={tmp_path / 'run'}",
               "--config.distribute.backend=horovod"]
    sockets, launcher_pid, _ = run_until_training(command, tmp_path, "horovodrun")
    # Horovod's own RendezvousServer binds '' (horovod/runner/util/network.py find_port), in horovodrun.
    assert set(sockets) == {launcher_pid} and addresses(sockets) <= EVERY_INTERFACE, sockets


def test_mpirun_listens_on_every_interface_even_with_loopback_selected(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (`make mpi`)")
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    command = ["mpirun", "--allow-run-as-root", "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo",
               "-np", "2", sys.executable, *TRAIN, f"--workdir={tmp_path / 'run'}", "--config.distribute.backend=horovod"]
    sockets, launcher_pid, _ = run_until_training(command, tmp_path, "mpirun")
    ranks = [pid for pid in sockets if pid != launcher_pid]
    # OpenMPI's own listeners (mpirun's runtime, each rank's TCP transport) bind every interface; the
    # *_if_include parameters choose the interfaces that carry traffic, not the bind address.
    assert len(ranks) == 2 and addresses(sockets, ranks) & EVERY_INTERFACE, sockets
    assert addresses(sockets, [launcher_pid]) & EVERY_INTERFACE, sockets
