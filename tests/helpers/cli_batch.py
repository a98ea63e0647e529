"""Several `python -m MODULE ARGS...` command lines for the price of one interpreter start.

    python tests/helpers/cli_batch.py JOBS.json

JOBS.json: {"preload": [module, ...], "runs": [{"module": M, "args": [...], "stdout": PATH, "stderr": PATH}, ...]}.
This process imports the `preload` modules once (TensorFlow's import is most of a refused command's 3 s),
then runs each command line in a process of its own, forked from this one, exactly as `python -m` runs
it: runpy executes MODULE as __main__ with sys.argv = [its file, *args], stdout and stderr go to the
run's files, and whatever the module raises (SystemExit included) ends that process through the
interpreter's own handling: the exit code, the message of sys.exit("..."), a traceback, atexit. One run
at a time, in order; one line per run on stdout: {"returncode": N}.

Forking is safe here because importing TensorFlow starts no thread (this process checks that), as
tfscale's converter relies on for its fork server (tfscale/data/convert/parallel.py). A preloaded
module is the one the command imports itself: only its import time is shared, not any state, since
nothing is run in this process before the fork.

`run_batch` (below) is the test side: one CompletedProcess per command line.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading


def _serve(jobs_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    sys.path[0] = os.getcwd()  # what `python -m` puts first, in place of this file's folder
    for module in jobs["preload"]:
        __import__(module)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1:
        sys.exit(f"cannot fork safely: the preloaded modules started {threads - 1} thread(s)")
    for job in jobs["runs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(job)  # raises out of this loop and ends the forked process: never returns
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _become(job: dict) -> None:
    """In the forked process: `python -m job["module"] *job["args"]` with its own stdout and stderr."""
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [sys.argv[0], *job["args"]]  # runpy puts the module's file in argv[0]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # the module returned: a program that ends normally


def run_batch(commands: list[list[str]], *, preload: list[str], cwd: str, env: dict,
              timeout_s: float = 600) -> list[subprocess.CompletedProcess]:
    """Every command of `commands` (the arguments after `python`: ["-m", module, *args]), one after the
    other, each its own process forked as above; one CompletedProcess (text stdout and stderr) per command."""
    with tempfile.TemporaryDirectory(prefix="cli-batch-") as scratch:
        runs = []
        for i, command in enumerate(commands):
            assert command[0] == "-m", command  # `python -m module ...` is what runpy.run_module repeats
            runs.append({"module": command[1], "args": list(command[2:]), "stdout": os.path.join(scratch, f"{i}.out"),
                         "stderr": os.path.join(scratch, f"{i}.err")})
        jobs_path = os.path.join(scratch, "jobs.json")
        with open(jobs_path, "w") as f:
            json.dump({"preload": preload, "runs": runs}, f)
        # numpy's OpenBLAS starts a thread per further core when it loads, which would make the fork unsafe;
        # with one, it starts none. The commands' TensorFlow ops do not run on OpenBLAS.
        env = {**env, "OPENBLAS_NUM_THREADS": "1"}
        server = subprocess.run([sys.executable, os.path.abspath(__file__), jobs_path], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=timeout_s)
        codes = [json.loads(line)["returncode"] for line in server.stdout.splitlines() if line.startswith("{")]
        assert server.returncode == 0 and len(codes) == len(runs), server.stdout[-3000:] + server.stderr[-3000:]
        results = []
        for command, run, code in zip(commands, runs, codes):
            with open(run["stdout"]) as out, open(run["stderr"]) as err:
                results.append(subprocess.CompletedProcess([sys.executable, *command], code, out.read(), err.read()))
        return results


if __name__ == "__main__":
    _serve(sys.argv[1])
