"""The local launcher: worker environment, prefixed output, failure propagation, signals, clean-up.

Workers are a tiny helper script (no TensorFlow), so the whole file runs in a few seconds.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tfscale.launch import launch, rendezvous

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One worker script for every scenario: `worker.py MODE STATE_DIR [ARG]`. Each worker writes its pid
# to STATE_DIR/pid.<rank> so tests can check that nothing survives the launcher.
WORKER = textwrap.dedent(
    r"""
    import json, os, signal, subprocess, sys, time

    mode, state_dir = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else None
    rank = int(os.environ["TFSCALE_LOCAL_RANK"])
    size = int(os.environ["TFSCALE_LOCAL_SIZE"])

    def write(name, text):
        tmp = os.path.join(state_dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(state_dir, name))  # readers never see a half-written file

    def wait_for(names, timeout_s=15):
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(os.path.join(state_dir, n)) for n in names):
            if time.monotonic() > deadline:
                sys.exit("timed out waiting for " + ", ".join(names))
            time.sleep(0.02)

    def on_term(signum, frame):
        write(f"term.{rank}", "")
        sys.exit(42)

    if mode in ("term", "ignore_term_rank1"):
        if mode == "term" or rank != 1:
            signal.signal(signal.SIGTERM, on_term)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write(f"pid.{rank}", str(os.getpid()))

    if mode == "report":
        tf_config = json.loads(os.environ["TF_CONFIG"])
        print(json.dumps({
            "rank": tf_config["task"]["index"], "type": tf_config["task"]["type"],
            "workers": tf_config["cluster"]["worker"], "local_rank": rank, "local_size": size,
            "threads": [os.environ.get(v) for v in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                                                     "TF_NUM_INTEROP_THREADS")],
        }))
        print(f"to stderr from {rank}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    elif mode == "fail":  # rank 1 fails once everyone (and rank 0's grandchild) is up; others sleep
        if rank == 0:
            grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            write("pid.grandchild", str(grandchild.pid))
        if rank == 1:
            wait_for([f"pid.{r}" for r in range(size)] + ["pid.grandchild"])
            print("rank 1 failing", flush=True)
            sys.exit(int(arg))
        time.sleep(60)
    elif mode == "sigkill":
        if rank == 1:
            wait_for([f"pid.{r}" for r in range(size)])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif mode == "orphan":  # rank 0: any program; rank 1: a tfscale program stuck where SIGTERM cannot stop it
        if rank == 1:
            from tfscale.launch import launcher_death

            assert launcher_death.follow_launcher()
            signal.signal(signal.SIGTERM, lambda *_: write("term.1", ""))
            grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            write("pid.grandchild", str(grandchild.pid))
        write(f"ready.{rank}", "")
        time.sleep(60)
    elif mode in ("term", "ignore_term_rank1"):
        write(f"ready.{rank}", "")
        if mode == "ignore_term_rank1" and rank == 0:  # fail once rank 1 ignores SIGTERM
            wait_for([f"ready.{r}" for r in range(size)])
            sys.exit(5)
        time.sleep(60)
    """
)


@pytest.fixture
def worker(tmp_path):
    """(path of the worker script, state dir)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    state = tmp_path / "state"
    state.mkdir()
    return str(script), str(state)


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not reaped by an init that never reaps) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def pids(state_dir: str) -> dict[str, int]:
    return {
        name: int(open(os.path.join(state_dir, name)).read())
        for name in os.listdir(state_dir)
        if name.startswith("pid.") and not name.endswith(".tmp")
    }


def assert_all_gone(state_dir: str, expected: int):
    found = pids(state_dir)
    assert len(found) == expected, found
    survivors = {name: pid for name, pid in found.items() if alive(pid)}
    assert not survivors, f"processes outlived the launcher: {survivors}"


def wait_for_files(paths, timeout_s=15):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.02)


def run_launcher(*args, **popen_kwargs):
    """`python -m tfscale.launch args...` as a separate process (needed to signal the launcher itself)."""
    popen_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen_kwargs}
    return subprocess.Popen([sys.executable, "-m", "tfscale.launch", *args], cwd=REPO, text=True, **popen_kwargs)


# --- environment ----------------------------------------------------------------------------------


def test_free_ports_are_distinct_and_bindable():
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4
    import socket

    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_worker_env_mwms():
    env = launch.worker_env(2, 3, [1111, 2222, 3333], "mwms", 4)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"]},
        "task": {"type": "worker", "index": 2},
    }
    assert env["TFSCALE_LOCAL_RANK"] == "2" and env["TFSCALE_LOCAL_SIZE"] == "3"
    assert env["OMP_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == env["TF_NUM_INTEROP_THREADS"] == "4"
    assert not any(key.startswith("HOROVOD_") for key in env)
    assert "OMP_NUM_THREADS" not in launch.worker_env(0, 1, [1111], "mwms", None)


def test_worker_env_horovod_rank1_of_2():
    env = launch.worker_env(1, 2, 29500, "horovod", 1)
    assert "TF_CONFIG" not in env
    expected = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "29500",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "127.0.0.1",
        "TFSCALE_LOCAL_RANK": "1",
        "TFSCALE_LOCAL_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    assert expected.items() <= env.items()


def test_worker_env_rejects_bad_endpoints():
    with pytest.raises(ValueError):
        launch.worker_env(0, 2, [1111], "mwms", 1)  # one port for two workers
    with pytest.raises(ValueError):
        launch.worker_env(0, 2, [1111, 2222], "horovod", 1)
    with pytest.raises(ValueError):
        launch.worker_env(0, 2, [1111, 2222], "nccl", 1)


def test_default_threads_split_the_cores(monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    assert launch.default_threads_per_worker(2) == 1
    assert launch.default_threads_per_worker(1) == 2
    assert launch.default_threads_per_worker(3) == 1  # at least one


# --- running jobs ---------------------------------------------------------------------------------


def test_three_workers_get_a_cluster_and_prefixed_output(worker, capsys):
    script, state = worker
    code = launch.launch([script, "report", state], num_workers=3, threads_per_worker=2)
    out, err = capsys.readouterr()
    assert code == 0, err

    reports = {}
    for line in out.splitlines():
        if line.endswith("}"):
            prefix, _, payload = line.partition("] ")
            reports[int(prefix.removeprefix("[rank "))] = json.loads(payload)
    assert sorted(reports) == [0, 1, 2]
    workers = reports[0]["workers"]
    assert len(workers) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    assert len({w.rsplit(":", 1)[1] for w in workers}) == 3  # distinct ports
    for prefix_rank, report in reports.items():
        assert report["rank"] == report["local_rank"] == prefix_rank  # task index == TFSCALE_LOCAL_RANK
        assert report["type"] == "worker" and report["workers"] == workers and report["local_size"] == 3
        assert report["threads"] == ["2", "2", "2"]
    for rank in range(3):
        assert f"[rank {rank}] to stderr from {rank}\n" in err  # stderr goes to stderr, prefixed
        assert f"[rank {rank}] no newline at the end\n" in out  # an unterminated last line is kept
    assert_all_gone(state, expected=3)


def test_default_threads_are_set(worker, capsys, monkeypatch):
    script, state = worker
    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    assert launch.launch([script, "report", state], num_workers=2) == 0
    out = capsys.readouterr().out
    threads = [json.loads(line.partition("] ")[2])["threads"] for line in out.splitlines() if line.endswith("}")]
    assert threads == [["1", "1", "1"]] * 2


def test_env_is_inherited(tmp_path, capsys):
    code = launch.launch(
        ["-c", "import os; print(os.environ['TFSCALE_TEST_VAR'], os.environ['TFSCALE_LOCAL_RANK'])"],
        num_workers=2, env={**os.environ, "TFSCALE_TEST_VAR": "inherited"},
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "[rank 0] inherited 0" in out and "[rank 1] inherited 1" in out


def test_failure_stops_the_job_with_the_first_code(worker, capsys):
    script, state = worker
    start_s = time.monotonic()
    code = launch.launch([script, "fail", state, "3"], num_workers=3, grace_period_s=5)
    elapsed_s = time.monotonic() - start_s
    out, err = capsys.readouterr()
    assert code == 3, err
    assert elapsed_s < 20, elapsed_s  # the sleepers (60 s) were stopped, not waited for
    assert "tfscale.launch: rank 1 exited with code 3; stopping the other 2 worker(s)" in err
    assert "[rank 1] rank 1 failing" in out
    assert_all_gone(state, expected=4)  # 3 workers + rank 0's grandchild


def test_worker_killed_by_signal_gives_128_plus_signal(worker, capsys):
    script, state = worker
    code = launch.launch([script, "sigkill", state], num_workers=2, grace_period_s=5)
    err = capsys.readouterr().err
    assert code == 137
    assert "rank 1 exited with code 137 (killed by SIGKILL); stopping the other 1 worker(s)" in err
    assert_all_gone(state, expected=2)


def test_worker_ignoring_sigterm_is_killed_after_grace(worker, capsys):
    script, state = worker
    start_s = time.monotonic()
    code = launch.launch([script, "ignore_term_rank1", state], num_workers=2, grace_period_s=1)
    elapsed_s = time.monotonic() - start_s
    err = capsys.readouterr().err
    assert code == 5, err  # rank 0's failure, not the SIGKILL that followed
    assert 1 <= elapsed_s < 20, elapsed_s
    assert "rank 1 still running 1 s after being stopped; sending SIGKILL" in err
    assert not os.path.exists(os.path.join(state, "term.1"))
    assert_all_gone(state, expected=2)


def test_sigterm_to_launcher_is_forwarded(worker):
    script, state = worker
    proc = run_launcher("--num_workers=2", "--grace_period_s=10", "--", script, "term", state)
    try:
        wait_for_files([os.path.join(state, f"ready.{r}") for r in range(2)])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 42, err  # the workers' own exit code after checkpointing
    assert "received SIGTERM; forwarding it to 2 worker(s)" in err
    for rank in range(2):
        assert os.path.exists(os.path.join(state, f"term.{rank}"))
    assert_all_gone(state, expected=2)


def test_sigint_to_launcher_is_forwarded(worker):
    script, state = worker
    proc = run_launcher("--num_workers=2", "--grace_period_s=10", "--", script, "term", state)
    try:
        wait_for_files([os.path.join(state, f"ready.{r}") for r in range(2)])
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the workers are in their own sessions, so only this reaches them
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    # The workers get SIGINT itself (not SIGTERM): Python's KeyboardInterrupt kills them by SIGINT.
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT; forwarding it to 2 worker(s)" in err
    assert not any(os.path.exists(os.path.join(state, f"term.{r}")) for r in range(2))
    assert_all_gone(state, expected=2)


def test_workers_end_when_the_launcher_is_killed(worker, tmp_path):
    """kill -9 of the launcher (the OOM killer, a closed terminal): no worker outlives it for long, and
    a worker's last lines reach the launcher's log file."""
    script, state = worker
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        proc = run_launcher("--num_workers=2", "--grace_period_s=1", "--", script, "orphan", state,
                            stdout=log, stderr=log)
    try:
        wait_for_files([os.path.join(state, name) for name in ("ready.0", "ready.1", "pid.grandchild")])
        proc.kill()
        proc.wait()
        killed_at = time.monotonic()
        found = pids(state)
        deadline = killed_at + 15
        while any(alive(pid) for pid in found.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone_after_s = time.monotonic() - killed_at
    finally:
        for pid in pids(state).values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert_all_gone(state, expected=3)  # both workers and rank 1's subprocess
    print(f"every worker gone {gone_after_s:.1f} s after the launcher was killed")
    assert os.path.exists(os.path.join(state, "term.1"))  # SIGTERM first: a tfscale worker checkpoints on it
    text = log_path.read_text()
    assert f"[rank 1] tfscale: the launcher (pid {proc.pid}) is gone; stopping this worker with SIGTERM" in text
    assert "[rank 1] tfscale: still running 1 s after its launcher died; sending SIGKILL to its process group" in text
    assert "[rank 0] tfscale" not in text  # a program that does not follow the launcher just gets SIGTERM


# --- command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--num_workers=0", "--", "-c", "pass"],
        ["--num_workers=2"],
        ["--num_workers=2", "--"],
        ["--", "-c", "pass"],
        ["--num_workers=2", "--backend=nccl", "--", "-c", "pass"],
        ["--num_workers=2", "--threads_per_worker=0", "--", "-c", "pass"],
    ],
)
def test_usage_errors_exit_2(args, capsys):
    assert launch.main(args) == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_exit_code_and_usage_error_as_a_process():
    proc = run_launcher("--num_workers=2", "--", "-c", "import os, sys; sys.exit(int(os.environ['TFSCALE_LOCAL_RANK']) * 7)")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 7, err
    assert "rank 1 exited with code 7" in err
    proc = run_launcher("--num_workers=0", "--", "-c", "pass")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "--num_workers must be >= 1" in err


def test_launcher_does_not_import_tensorflow():
    code = "import sys, tfscale.launch.launch; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


# --- horovod --------------------------------------------------------------------------------------


def test_horovod_missing_gives_clear_error(monkeypatch, tmp_path, capsys):
    # As if not installed, even when it is and other tests already imported parts of it.
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")] + ["horovod"]:
        monkeypatch.setitem(sys.modules, name, None)
    marker = tmp_path / "started"
    argv = ["-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(launch.LaunchError, match=r"backend horovod needs Horovod: .*`make horovod`"):
        launch.launch(argv, num_workers=2, backend="horovod")
    assert launch.main(["--num_workers=2", "--backend=horovod", "--", *argv]) == 1
    assert rendezvous.HOROVOD_MISSING in capsys.readouterr().err
    assert not marker.exists()  # nothing was started


def test_horovod_missing_cli():
    # A fresh interpreter in which `import horovod` fails, whether or not it is installed here.
    code = ("import sys; sys.modules['horovod'] = None; from tfscale.launch import launch; "
            "sys.exit(launch.main(['--num_workers=2', '--backend=horovod', '--', '-c', 'pass']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert rendezvous.HOROVOD_MISSING in proc.stderr


def test_horovod_job_drops_inherited_tf_config():
    env = launch._child_env({"TF_CONFIG": "{}", "PATH": "/bin"}, launch.worker_env(0, 1, 1234, "horovod", 1), "horovod")
    assert "TF_CONFIG" not in env and env["PATH"] == "/bin" and env["HOROVOD_RANK"] == "0"


def fake_horovod(monkeypatch) -> dict:
    """Installs a stand-in for horovod's runner modules; returns what the launcher did with them."""
    import types

    calls = {}

    import threading

    class RendezvousHTTPServer:
        def __init__(self, address, handler, verbose):
            calls["address"], calls["verbose"] = address, verbose
            self.server_address = (address[0], 45678)
            self._stopped = threading.Event()

        def serve_forever(self):
            calls["started"] = True
            self._stopped.wait()

        def init(self, host_alloc_plan):
            calls["plan"] = host_alloc_plan

        def shutdown(self):
            calls["stopped"] = True
            self._stopped.set()

    modules = {name: types.ModuleType(name) for name in (
        "horovod", "horovod.runner", "horovod.runner.common", "horovod.runner.common.util",
        "horovod.runner.common.util.hosts", "horovod.runner.http", "horovod.runner.http.http_server")}
    modules["horovod.runner.http.http_server"].RendezvousHTTPServer = RendezvousHTTPServer
    modules["horovod.runner.http.http_server"].RendezvousHandler = object
    modules["horovod.runner.common.util.hosts"].parse_hosts = lambda hosts: ("parsed", hosts)
    modules["horovod.runner.common.util.hosts"].get_host_assignments = lambda hosts, num_proc: (hosts, num_proc)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_horovod_job_runs_a_rendezvous_server(monkeypatch, capsys):
    calls = fake_horovod(monkeypatch)
    code = launch.launch(
        ["-c", "import os; print(os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT'], os.environ['HOROVOD_RANK'], "
               "'TF_CONFIG' in os.environ)"],
        num_workers=2, backend="horovod", env={**os.environ, "TF_CONFIG": "{}"},
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "[rank 0] 45678 0 False" in out and "[rank 1] 45678 1 False" in out
    # One host, 127.0.0.1, with a slot per worker: the name must match HOROVOD_HOSTNAME's scope.
    assert calls["plan"] == (("parsed", "127.0.0.1:2"), 2)
    assert calls["stopped"]
    assert calls["address"] == ("127.0.0.1", 0)  # loopback only: nobody on another host reaches it


@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_launcher_sets_the_config_backend_of_tfscale_programs(backend):
    for program in ("tfscale.train", "tfscale.benchmark"):
        argv = ["-m", program, "--config=configs/smoke.py"]
        assert launch.with_backend(argv, backend) == [*argv, f"--config.distribute.backend={backend}"]
        agreeing = [*argv, f"--config.distribute.backend={backend}"]
        assert launch.with_backend(agreeing, backend) == agreeing  # said once, not twice
    other = ["some_script.py", "--flag"]
    assert launch.with_backend(other, backend) == other  # not ours: left alone


def test_launcher_refuses_a_contradicting_backend_override():
    code = launch.main(["--num_workers=2", "--backend=horovod", "--", "-m", "tfscale.train",
                        "--config.distribute.backend=mwms"])
    assert code == 2  # refused before anything started
    with pytest.raises(ValueError, match=r"--backend=horovod but .*backend=mwms.*--backend=mwms"):
        launch.with_backend(["-m", "tfscale.train", "--config.distribute.backend=mwms"], "horovod")
