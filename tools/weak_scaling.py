#!/usr/bin/env python3
"""Weak scaling on one machine: per-step time of 1 vs N local workers, measured in one run.

Each worker keeps the same per-replica batch and gets `--threads_per_worker` threads, so on a
2-core host 1 worker x 1 thread vs 2 workers x 1 thread isolates what multi-worker costs (gradient
all-reduce over loopback, synchronisation). Efficiency = (X_N / N) / X_1 with X = images/sec.

    python tools/weak_scaling.py --workdir=runs/weak_scaling [--workers=1,2] [--backends=mwms,horovod]

Several backends are measured in the same run, interleaved (1 worker of each, then 2 of each, ...),
so a slow moment of the host does not favour one of them.
"""

import json
import os
import subprocess
import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", "runs/weak_scaling", "Where the runs go.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker counts to measure.")
_BACKENDS = flags.DEFINE_list("backends", ["mwms"], "Backends to compare: mwms, horovod.")
_CONFIG = flags.DEFINE_string("config", "configs/smoke.py", "Config to train.")
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 32, "Images per worker per step.")
_STEPS = flags.DEFINE_integer("steps", 120, "Training steps per run (the first log interval is excluded).")
_THREADS = flags.DEFINE_integer("threads_per_worker", 1, "Threads per worker.")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DISTRIBUTE = {"mwms": "multi_worker", "horovod": "horovod"}
flags.register_validator("backends", lambda names: set(names) <= set(_DISTRIBUTE), "--backends: mwms and/or horovod")


def measure(backend: str, num_workers: int) -> dict:
    workdir = os.path.join(os.path.abspath(_WORKDIR.value), f"{backend}_{num_workers}")
    global_batch = _PER_WORKER_BATCH.value * num_workers
    subprocess.run(["rm", "-rf", workdir], check=True)
    command = [
        sys.executable, "-m", "tfscale.launch", f"--num_workers={num_workers}", f"--backend={backend}",
        f"--threads_per_worker={_THREADS.value}", "--", "-m", "tfscale.train", f"--config={_CONFIG.value}",
        f"--workdir={workdir}", "--config.data.dataset=synthetic", f"--config.data.global_batch_size={global_batch}",
        f"--config.data.num_train_examples={global_batch * _STEPS.value}", "--config.train.epochs=1.0",
        "--config.schedule.warmup_epochs=0.1", f"--config.train.log_every_steps={_STEPS.value // 6}",
        f"--config.distribute.backend={_DISTRIBUTE[backend]}", "--config.checkpoint.every_epochs=1.0",
    ]
    subprocess.run(command, check=True, cwd=_REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    with open(os.path.join(workdir, "summary.json")) as f:
        images_per_sec = json.load(f)["images_per_sec"]
    return {"backend": backend, "workers": num_workers, "global_batch_size": global_batch, "images_per_sec": images_per_sec,
            "step_time_ms": round(1000 * global_batch / images_per_sec, 1)}


def main(argv):
    backends = _BACKENDS.value
    rows = [measure(backend, int(n)) for n in _WORKERS.value for backend in backends]
    print(f"weak scaling, {_PER_WORKER_BATCH.value} images/worker/step, {_THREADS.value} thread(s)/worker")
    print(f"{'backend':>8} {'workers':>8} {'images/sec':>11} {'step ms':>8} {'efficiency':>10}")
    for backend in backends:
        own = [row for row in rows if row["backend"] == backend]
        base = own[0]
        for row in own:
            per_worker, base_per_worker = row["images_per_sec"] / row["workers"], base["images_per_sec"] / base["workers"]
            row["efficiency"] = round(per_worker / base_per_worker, 3)
            print(f"{backend:>8} {row['workers']:>8} {row['images_per_sec']:>11.1f} {row['step_time_ms']:>8.1f} "
                  f"{row['efficiency']:>10.1%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    app.run(main)
