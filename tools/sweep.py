#!/usr/bin/env python3
"""Scaling on one node in one command: the benchmark at 1..N local workers, then the scaling report.

    python tools/sweep.py --workdir=runs/sweep --workers=1,2 --backends=mwms,horovod \
        [--config=configs/smoke.py --mode=synthetic --per_worker_batch=32] [-- --config.x.y=v ...]

Weak scaling: every worker keeps `--per_worker_batch` images per step, so the global batch grows
with the workers, as in the Horovod paper and tf_cnn_benchmarks tables. Each worker gets
`--threads_per_worker` threads: on a 2-core host, 1 worker x 1 thread vs 2 workers x 1 thread
isolates what multi-worker training costs (all-reduce, synchronisation). Backends are measured
interleaved (1 worker of each, then 2 of each, ...), so a slow moment of the host does not favour
one. Writes WORKDIR/<backend>_<N>/benchmark.json, WORKDIR/report.md and WORKDIR/report.png.
"""

import os
import shutil
import subprocess
import sys

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # run from a checkout

from tfscale import scaling  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/sweep", "Where the runs and the report go.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker counts to measure.")
_BACKENDS = flags.DEFINE_list("backends", ["mwms"], "Backends to compare: mwms, horovod.")
_CONFIG = flags.DEFINE_string("config", "configs/smoke.py", "Config to benchmark.")
_MODE = flags.DEFINE_enum("mode", "synthetic", ["synthetic", "train"], "benchmark.mode of every run.")
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 32, "Images per worker per step.")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", 60, "Timed steps per run.")
_WARMUP = flags.DEFINE_integer("num_warmup_batches", 10, "Untimed steps per run.")
_THREADS = flags.DEFINE_integer("threads_per_worker", 1, "Threads per worker (0: the launcher's default).")
_REFERENCE = flags.DEFINE_integer("reference", None, "Worker count of the reference (default: the smallest).")

_BACKEND_NAMES = ("mwms", "horovod")  # launcher and config spell them alike
flags.register_validator("backends", lambda names: set(names) <= set(_BACKEND_NAMES), "--backends: mwms and/or horovod")


def benchmark_command(backend: str, num_workers: int, workdir: str, overrides: list[str]) -> list[str]:
    """The launcher command for one point of the sweep."""
    global_batch = _PER_WORKER_BATCH.value * num_workers
    threads = [f"--threads_per_worker={_THREADS.value}"] if _THREADS.value else []
    return [
        sys.executable, "-m", "tfscale.launch", f"--num_workers={num_workers}", f"--backend={backend}", *threads, "--",
        "-m", "tfscale.benchmark", f"--config={_CONFIG.value}", f"--workdir={workdir}",
        f"--config.benchmark.mode={_MODE.value}", f"--config.distribute.backend={backend}",
        f"--config.data.global_batch_size={global_batch}",
        # Only so that validation accepts the batch: synthetic steps never run out of examples.
        *([f"--config.data.num_train_examples={global_batch * 1000}"] if _MODE.value == "synthetic" else []),
        f"--config.benchmark.num_batches={_NUM_BATCHES.value}",
        f"--config.benchmark.num_warmup_batches={_WARMUP.value}",
        *overrides,
    ]


def measure(backend: str, num_workers: int, overrides: list[str]) -> str:
    """Runs one benchmark; returns its benchmark.json path, or exits with the run's last output."""
    workdir = os.path.join(os.path.abspath(_WORKDIR.value), f"{backend}_{num_workers}")
    shutil.rmtree(workdir, ignore_errors=True)
    command = benchmark_command(backend, num_workers, workdir, overrides)
    print(f"sweep: {backend} x {num_workers} worker(s) ...", flush=True)
    result = subprocess.run(command, cwd=_REPO, capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode != 0:
        sys.exit(f"sweep: {backend} x {num_workers} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    total = next(line for line in reversed(result.stdout.splitlines()) if "total images/sec:" in line)
    print(f"sweep: {backend} x {num_workers}: {total.split('] ')[-1]}", flush=True)
    return os.path.join(workdir, "benchmark.json")


def main(argv):
    overrides = argv[1:]  # after `--`: more --config.x.y=v for every run
    paths = [measure(backend, int(n), overrides) for n in _WORKERS.value for backend in _BACKENDS.value]
    tables = scaling.scaling_rows(scaling.load(paths), reference_workers=_REFERENCE.value)
    workdir = os.path.abspath(_WORKDIR.value)
    title = (f"weak scaling, {_MODE.value}, {_PER_WORKER_BATCH.value} images/worker/step, "
             f"{_THREADS.value or 'default'} thread(s)/worker")
    print(scaling.write_report(tables, os.path.join(workdir, "report.md"), os.path.join(workdir, "report.png"), title))
    print(f"wrote {os.path.join(workdir, 'report.md')} and report.png")


if __name__ == "__main__":
    app.run(main)
