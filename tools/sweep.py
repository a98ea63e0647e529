#!/usr/bin/env python3
"""Scaling on one node in one command: the benchmark at 1..N local workers, then the scaling report.

    python tools/sweep.py --workdir=runs/sweep --workers=1,2 --backends=mwms,horovod \
        [--config=configs/smoke.py --mode=synthetic --per_worker_batch=32] [-- --config.x.y=v ...]

Weak scaling: every worker keeps `--per_worker_batch` images per step, so the global batch grows
with the workers, as in the Horovod paper and tf_cnn_benchmarks tables. Each worker gets
`--threads_per_worker` threads: on a 2-core host, 1 worker x 1 thread vs 2 workers x 1 thread
isolates what multi-worker training costs (all-reduce, synchronisation). Each of `--rounds` rounds
measures every point back to back (1 worker of each backend, then 2 of each, ...; the order reversed
every other round) and computes its efficiencies within the round, so the host's drift between rounds
cancels out; the report gives each efficiency's median over rounds and its range. Writes
WORKDIR/<backend>_<N>_round<k>/benchmark.json, WORKDIR/report.md and WORKDIR/report.png.

With --ceiling (default) each round also runs, for each worker count N above one, N independent
1-worker benchmarks side by side (the first backend; WORKDIR/independent_<N>x1_round<k>/job<i>/):
they share the host as N workers do, without communicating, so their mean rate over one worker's
alone is the host's ceiling for N-worker efficiency; the report gives it beside each backend's
efficiency (WORKDIR/ceiling.json).

With --predict (default) each worker count above one also runs the all-reduce benchmark
(benchmark.mode=allreduce) right after its step benchmark, and tfscale-plan predicts that point from
the 1-worker rate and that all-reduce table alone (the link fitted as tfscale.perf.plan.link_from_allreduce
does); report.md shows predicted beside measured (docs/scaling.md).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # run from a checkout

from tfscale import config as tfs_config  # noqa: E402
from tfscale.perf import plan  # noqa: E402
from tfscale.perf import scaling
from tfscale.planning import plan_model, plan_workload
from tfscale.workdir import layout

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
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of every point, back to back; efficiencies are paired within rounds.",
                               lower_bound=1)
_PREDICT = flags.DEFINE_bool("predict", True, "Also measure the all-reduce table at each worker count > 1 and print "
                             "tfscale-plan's prediction from it and the 1-worker run beside the measurement.")
_CEILING = flags.DEFINE_bool("ceiling", True, "In every round, also run N independent 1-worker benchmarks side by side for "
                              "each N > 1 (the first backend, no communication): this host's ceiling for N-worker "
                              "efficiency.")
_ALLREDUCE_MAX_BYTES = flags.DEFINE_integer("allreduce_max_bytes", 16 << 20, "--predict: largest all-reduce message.")

_BACKEND_NAMES = ("mwms", "horovod")  # launcher and config spell them alike
_SIDE_BY_SIDE = "side_by_side"  # in the list of points: the independent 1-worker jobs of the ceiling
flags.register_validator("backends", lambda names: set(names) <= set(_BACKEND_NAMES), "--backends: mwms and/or horovod")


def config_overrides(backend: str, num_workers: int, mode: str, overrides: list[str]) -> list[str]:
    """The --config.* of one point of the sweep (weak scaling: the global batch grows with the workers)."""
    global_batch = _PER_WORKER_BATCH.value * num_workers
    return [
        f"--config.benchmark.mode={mode}", f"--config.distribute.backend={backend}",
        f"--config.data.global_batch_size={global_batch}",
        # Only so that validation accepts the batch: synthetic steps never run out of examples.
        *([f"--config.data.num_train_examples={global_batch * 1000}"] if mode in ("synthetic", "allreduce") else []),
        f"--config.benchmark.num_batches={_NUM_BATCHES.value}",
        f"--config.benchmark.num_warmup_batches={_WARMUP.value}",
        *([f"--config.benchmark.allreduce_max_bytes={_ALLREDUCE_MAX_BYTES.value}"] if mode == "allreduce" else []),
        *overrides,
    ]


def benchmark_command(backend: str, num_workers: int, workdir: str, mode: str, overrides: list[str]) -> list[str]:
    """The launcher command for one point of the sweep."""
    threads = [f"--threads_per_worker={_THREADS.value}"] if _THREADS.value else []
    return [
        sys.executable, "-m", "tfscale.launch", f"--num_workers={num_workers}", f"--backend={backend}", *threads, "--",
        "-m", "tfscale.benchmark", f"--config={_CONFIG.value}", f"--workdir={workdir}",
        *config_overrides(backend, num_workers, mode, overrides),
    ]


def measure(backend: str, num_workers: int, overrides: list[str], mode: str = "", round_number: int = 1) -> str:
    """Runs one benchmark; returns its benchmark.json path, or exits with the run's last output."""
    mode = mode or _MODE.value
    name = f"{backend}_{num_workers}" + ("_allreduce" if mode == "allreduce" else f"_round{round_number}")
    workdir = os.path.join(os.path.abspath(_WORKDIR.value), name)
    shutil.rmtree(workdir, ignore_errors=True)
    command = benchmark_command(backend, num_workers, workdir, mode, overrides)
    print(f"sweep: {name} ...", flush=True)
    result = subprocess.run(command, cwd=_REPO, capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode != 0:
        sys.exit(f"sweep: {name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    last = next(line for line in reversed(result.stdout.splitlines()) if line.strip())
    print(f"sweep: {name}: {last.split('] ')[-1]}", flush=True)
    return layout.benchmark(workdir)


def measure_side_by_side(num_workers: int, overrides: list[str], round_number: int) -> list[str]:
    """`num_workers` 1-worker benchmarks at once, each its own job: what sharing the host costs without any
    communication. Returns their benchmark.json paths."""
    backend = _BACKENDS.value[0]
    name = f"independent_{num_workers}x1_round{round_number}"
    root = os.path.join(os.path.abspath(_WORKDIR.value), name)
    shutil.rmtree(root, ignore_errors=True)
    workdirs = [os.path.join(root, f"job{i}") for i in range(num_workers)]
    print(f"sweep: {name} ...", flush=True)
    jobs = [subprocess.Popen(benchmark_command(backend, 1, workdir, _MODE.value, overrides), cwd=_REPO, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}) for workdir in workdirs]
    for job in jobs:
        _, stderr = job.communicate()
        if job.returncode != 0:
            sys.exit(f"sweep: {name} failed (exit {job.returncode}):\n{stderr[-3000:]}")
    paths = [layout.benchmark(workdir) for workdir in workdirs]
    rates = [read(path)["total_images_per_sec"] for path in paths]
    print(f"sweep: {name}: images/sec {' / '.join(f'{rate:.2f}' for rate in rates)}", flush=True)
    return paths


def ceiling_table(ceilings: dict[int, list[float]], tables: dict[str, list[dict]]) -> str:
    """Per worker count: the side-by-side runs' mean rate over the round's 1-worker rate, each round and the
    median; beside it each series' median efficiency and the share of the ceiling it reaches."""
    series = list(tables)
    lines = ["| workers | ceiling, each round | median | " + " | ".join(f"{s} efficiency (of the ceiling)" for s in series)
             + " |", "|---:|---|---:|" + "---:|" * len(series)]
    for n, per_round in sorted(ceilings.items()):
        ceiling = statistics.median(per_round)
        cells = []
        for s in series:
            efficiency = next(row["efficiency"] for row in tables[s] if row["workers"] == n)
            cells.append(f"{100 * efficiency:.1f}% ({efficiency / ceiling:.2f})")
        lines.append(f"| {n} | {' / '.join(f'{100 * c:.1f}%' for c in per_round)} | {100 * ceiling:.1f}% | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def predicted_row(backend: str, num_workers: int, one_worker: dict, allreduce: dict, overrides: list[str]) -> dict:
    """tfscale-plan's prediction of one point from the 1-worker rate and the all-reduce table at that size alone."""
    cfg = tfs_config.load_config_file(_CONFIG.value, config_overrides(backend, num_workers, _MODE.value, overrides))
    bandwidth, latency = plan.link_from_allreduce(allreduce["allreduce"], allreduce["num_replicas"])
    system = plan_model.System(
        name="loopback", gpus_per_node=num_workers, gpu_images_per_sec=one_worker["total_images_per_sec"],
        intra_node_GBps=bandwidth, intra_node_latency_us=latency, inter_node_GBps=bandwidth,
        inter_node_latency_us=latency)
    row = plan_model.predict(plan_workload.workload_from_config(cfg, per_gpu_batch=_PER_WORKER_BATCH.value), system,
                             [num_workers])[0]
    return {"backend": backend, "workers": num_workers, "link_GBps": bandwidth, "latency_us": latency,
            "predicted_images_per_sec": row["images_per_sec"], "predicted_efficiency": row["speedup"] / num_workers}


def prediction_table(rows: list[dict]) -> str:
    lines = ["| backend | workers | link (fitted) | measured images/sec | predicted | measured efficiency | predicted | "
             "error (points) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['workers']} | {r['link_GBps']:.2f} GB/s, {r['latency_us']:.0f} us/step | "
                     f"{r['measured_images_per_sec']:.1f} | {r['predicted_images_per_sec']:.1f} | "
                     f"{r['measured_efficiency']:.3f} | {r['predicted_efficiency']:.3f} | "
                     f"{100 * (r['predicted_efficiency'] - r['measured_efficiency']):+.1f} |")
    return "\n".join(lines)


def median_over_rounds(round_tables: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Per series and worker count: the median images/sec, speedup and efficiency over rounds (each computed
    within its round) and the efficiencies of all rounds."""
    merged = {}
    for series, rows in round_tables[0].items():
        merged[series] = []
        for i, row in enumerate(rows):
            in_rounds = [tables[series][i] for tables in round_tables]
            merged[series].append({**row, **{key: statistics.median(r[key] for r in in_rounds)
                                             for key in ("images_per_sec", "speedup", "efficiency")},
                                   "round_efficiencies": [r["efficiency"] for r in in_rounds]})
    return merged


def rounds_table(tables: dict[str, list[dict]]) -> str:
    lines = ["| series | workers | efficiency, each round | median | range |", "|---|---:|---|---:|---:|"]
    for series, rows in tables.items():
        for row in rows:
            efficiencies = row["round_efficiencies"]
            if row["workers"] != row["reference_workers"]:
                lines.append(f"| {series} | {row['workers']} | {' / '.join(f'{100 * e:.1f}%' for e in efficiencies)} | "
                             f"{100 * row['efficiency']:.1f}% | {100 * (max(efficiencies) - min(efficiencies)):.1f} pts |")
    return "\n".join(lines)


def main(argv):
    overrides = argv[1:]  # after `--`: more --config.x.y=v for every run
    counts = [int(n) for n in _WORKERS.value]
    if _PREDICT.value and 1 not in counts:
        sys.exit("sweep: --predict needs a 1-worker run in --workers (the plan's reference)")
    if _CEILING.value and 1 not in counts:
        sys.exit("sweep: --ceiling needs a 1-worker run in --workers (what the side-by-side runs are compared with)")
    # The side-by-side jobs of N come after the backends' N-worker points (before them in reversed rounds).
    points = [point for n in counts for point in [(n, backend) for backend in _BACKENDS.value]
              + ([(n, _SIDE_BY_SIDE)] if _CEILING.value and n > 1 else [])]
    round_paths, allreduce_paths, side_by_side = [], {}, []
    for round_index in range(_ROUNDS.value):
        paths, independent = {}, {}
        for n, backend in points if round_index % 2 == 0 else reversed(points):
            if backend == _SIDE_BY_SIDE:
                independent[n] = measure_side_by_side(n, overrides, round_number=round_index + 1)
                continue
            paths[backend, n] = measure(backend, n, overrides, round_number=round_index + 1)
            if _PREDICT.value and n > 1 and round_index == 0:  # each all-reduce table right after its step benchmark
                allreduce_paths[backend, n] = measure(backend, n, overrides, mode="allreduce")
        round_paths.append(paths)
        side_by_side.append(independent)
    tables = median_over_rounds([scaling.scaling_rows(scaling.load(list(paths.values())),
                                                      reference_workers=_REFERENCE.value) for paths in round_paths])
    workdir = os.path.abspath(_WORKDIR.value)
    title = (f"weak scaling, {_MODE.value}, {_PER_WORKER_BATCH.value} images/worker/step, "
             f"{_THREADS.value or 'default'} thread(s)/worker, median of {_ROUNDS.value} round(s)")
    report = scaling.write_report(tables, os.path.join(workdir, "report.md"), os.path.join(workdir, "report.png"), title)
    sections = ["\n## Efficiency in each round (paired within the round)\n\n" + rounds_table(tables) + "\n"]
    if any(side_by_side):
        # the mean rate of N independent jobs over the same round's 1-worker rate (of the first backend)
        one_worker = [read(paths[_BACKENDS.value[0], 1])["total_images_per_sec"] for paths in round_paths]
        ceilings = {n: [statistics.mean(read(p)["total_images_per_sec"] for p in independent[n]) / one
                        for independent, one in zip(side_by_side, one_worker)] for n in side_by_side[0]}
        sections.append("\n## Ceiling without communication: N independent 1-worker runs side by side, each at this share "
                        "of one alone\n\n" + ceiling_table(ceilings, tables) + "\n")
        with open(os.path.join(workdir, "ceiling.json"), "w") as f:
            json.dump({str(n): per_round for n, per_round in ceilings.items()}, f, indent=1)
    if allreduce_paths:
        first_round = {(r["backend"], r["num_workers"]): r for r in map(read, round_paths[0].values())}
        rows = []
        for (backend, n), path in allreduce_paths.items():
            row = predicted_row(backend, n, first_round[backend, 1], read(path), overrides)
            row["measured_images_per_sec"] = first_round[backend, n]["total_images_per_sec"]
            row["measured_efficiency"] = row["measured_images_per_sec"] / (n * first_round[backend, 1]["total_images_per_sec"])
            rows.append(row)
        sections.append("\n## Predicted (tfscale-plan from the 1-worker run and the all-reduce table) vs measured "
                        "(first round)\n\n" + prediction_table(rows) + "\n")
        with open(os.path.join(workdir, "prediction.json"), "w") as f:
            json.dump(rows, f, indent=1)
    with open(os.path.join(workdir, "report.md"), "a") as f:
        f.write("".join(sections))
    print(report + "\n" + "".join(sections))
    print(f"wrote {os.path.join(workdir, 'report.md')} and report.png")


if __name__ == "__main__":
    app.run(main)
