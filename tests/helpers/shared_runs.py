"""A reference run made once per pytest run and read by every test file that needs it.

Several files compare with the same multi-process run: the two MWMS workers that tests/test_horovod.py
and tests/test_horovod_mpi.py hold Horovod against are the replicas of tests/test_multiworker.py's ghost
BatchNorm check too. Each file keeps its own fixture and can run alone; through `shared_run` the first
one of a pytest run makes the run and the others read its files. Under pytest-xdist (`make test`: two
workers, whole files each) the directory is the run's basetemp, where both workers' own basetemps are,
and a file lock makes the second worker wait for the first one's run instead of starting another."""

import contextlib
import fcntl
import os
import shutil


def run_root(tmp_path_factory):
    """This pytest run's temporary directory, shared by its xdist workers (pytest-of-USER/pytest-N;
    a worker's own is pytest-N/popen-gwK); without xdist, the basetemp itself. A new one every run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def shared_run(tmp_path_factory, name):
    """Yields (directory, True) to the first caller in this pytest run, which makes the run in it, and
    (directory, False) to every later one, once the first has finished. A caller that fails leaves an
    empty directory to the next one, which makes the run again."""
    root = run_root(tmp_path_factory) / "shared-runs"
    root.mkdir(exist_ok=True)
    directory, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            yield directory, False
            return
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        yield directory, True
        done.touch()
