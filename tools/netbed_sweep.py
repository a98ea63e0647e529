#!/usr/bin/env python3
"""Scaling across two hosts whose link is known: what overlapping the all-reduce with the backward pass buys at
each link rate, measured on a test bed (tfscale/launch/netbed.py), beside tfscale-plan's prediction. Root only.

    sudo python tools/netbed_sweep.py --workdir=runs/netbed [--rates_mbit=50,200,1000,0] [--rounds=3] \
        [--config=configs/cifar_resnet20.py --per_worker_batch=32 --pack_bytes=65536] [-- --config.x.y=v ...]

Brings up a bed of two hosts, then in each round runs, on one thread per worker and synthetic data:
  - one worker alone on host 0 (the reference of the round), then one on each host at once, not communicating:
    the two hosts are one machine, and what sharing it costs two workers without any all-reduce is the
    ceiling of their efficiency (the report gives each efficiency over it too);
  - for each link rate (0: unshaped), both links shaped to it: two workers, one per host, weak scaling (each
    keeps --per_worker_batch), once sending the gradients in one message after the backward pass
    (distribute.pack_bytes=0) and once in buckets of --pack_bytes sent while it runs; XLA off, which would
    compute every gradient at once and leave nothing to overlap.
The order of the rates, and of the two modes, is reversed every other round. Each efficiency is the 2-worker
rate over twice the same round's 1-worker rate; the overlap gain is buckets minus one message, paired within a
round; the table gives each round's figures and their median.

The first round also runs tfscale's all-reduce benchmark across the bed at each rate. tfscale-plan then
predicts every point from the bed's own microbenchmarks only: that round's 1-worker rate and step-time spread
(`plan.measured_overrides`) times the ceiling's median (a host computes that much while the other host computes
too: the bed's hosts share this machine's cores), and the link's bus bandwidth and latency fitted to the
all-reduce table; nothing is fitted to the points it predicts (overlap_efficiency stays 1: the physics). Writes
WORKDIR/<run>/benchmark.json, WORKDIR/report.md and WORKDIR/report.json, and takes the bed down at the end.

With --straggler_cpu=F it measures a straggler instead: host 1 limited to F of a core (netbed.set_cpu). Per round:
one worker alone on host 0 (the reference) and alone on host 1 (the straggler's rate and step-time spread), then
at each rate two workers, one per host, one message. The planner predicts each point twice from those runs: with
its spread term (one rate for every GPU, the step-time spread of both hosts' steps pooled, the expected slowest of
2 independent draws), and told of the slow GPU (System.slowest_gpu_images_per_sec: the straggler's rate alone).
"""

import dataclasses
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
from tfscale.launch import netbed  # noqa: E402
from tfscale.perf import plan  # noqa: E402
from tfscale.planning import plan_model, plan_workload  # noqa: E402
from tfscale.workdir import layout  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/netbed", "Where the runs and the report go.")
_RATES = flags.DEFINE_list("rates_mbit", ["50", "200", "1000", "0"], "Link rates to measure, Mbit/s (0: unshaped).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of every point, back to back.", lower_bound=1)
_CONFIG = flags.DEFINE_string("config", "configs/cifar_resnet20.py", "Config to benchmark.")
_BACKEND = flags.DEFINE_enum("backend", "mwms", ["mwms", "horovod"], "Backend of the 2-worker runs.")
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 32, "Images per worker per step.")
_PACK_BYTES = flags.DEFINE_integer("pack_bytes", 65536, "Bucket size of the overlapped mode (distribute.pack_bytes).")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", 30, "Timed steps per run.")
_WARMUP = flags.DEFINE_integer("num_warmup_batches", 5, "Untimed steps per run.")
_ALLREDUCE_MAX_BYTES = flags.DEFINE_integer("allreduce_max_bytes", 4 << 20, "Largest message of the all-reduce table.")
_PREFIX = flags.DEFINE_string("prefix", "tfsweep", "The bed's prefix (tools/netbed.py).")
_STRAGGLER_CPU = flags.DEFINE_float("straggler_cpu", None, "Measure a straggler: host 1 limited to this share of a "
                                    "core (default: the overlap study).")

MODES = {"one message": 0, "buckets": None}  # None: --pack_bytes


def overrides(num_workers: int, pack_bytes: int, mode: str, extra: list[str]) -> list[str]:
    global_batch = _PER_WORKER_BATCH.value * num_workers
    return [f"--config.benchmark.mode={mode}", f"--config.distribute.backend={_BACKEND.value}",
            f"--config.data.global_batch_size={global_batch}", f"--config.data.num_train_examples={global_batch * 1000}",
            f"--config.benchmark.num_batches={_NUM_BATCHES.value}",
            f"--config.benchmark.num_warmup_batches={_WARMUP.value}", f"--config.distribute.pack_bytes={pack_bytes}",
            f"--config.benchmark.allreduce_max_bytes={_ALLREDUCE_MAX_BYTES.value}", "--config.jit_compile=False", *extra]


def measure(bed: netbed.Bed, name: str, num_workers: int, pack_bytes: int, extra: list[str], mode="synthetic") -> dict:
    """One benchmark on the bed's first `num_workers` hosts; returns its benchmark.json."""
    workdir = os.path.join(os.path.abspath(_WORKDIR.value), name)
    shutil.rmtree(workdir, ignore_errors=True)
    command = [sys.executable, "-m", "tfscale.launch", f"--netbed={bed.prefix}", f"--num_workers={num_workers}",
               f"--backend={_BACKEND.value}", "--threads_per_worker=1", "--", "-m", "tfscale.benchmark",
               f"--config={_CONFIG.value}", f"--workdir={workdir}", *overrides(num_workers, pack_bytes, mode, extra)]
    result = subprocess.run(command, cwd=_REPO, capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode != 0:
        sys.exit(f"netbed_sweep: {name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(layout.benchmark(workdir)) as f:
        report = json.load(f)
    if mode == "synthetic":
        print(f"netbed_sweep: {name}: {report['total_images_per_sec']:.1f} images/sec", flush=True)
    return report


def read_reports(paths: list[str]) -> list[dict]:
    """Each benchmark.json, parsed."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def measure_on_hosts(bed: netbed.Bed, name: str, hosts: list[int], extra: list[str]) -> list[dict]:
    """A 1-worker benchmark on each of `hosts` at once, no communication; returns their benchmark.json."""
    root = os.path.join(os.path.abspath(_WORKDIR.value), name)
    shutil.rmtree(root, ignore_errors=True)
    jobs = []
    for host in hosts:
        workdir = os.path.join(root, f"host{host}")
        command = [sys.executable, "-m", "tfscale.benchmark", f"--config={_CONFIG.value}", f"--workdir={workdir}",
                   *overrides(1, 0, "synthetic", extra)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
               "TF_NUM_INTEROP_THREADS": "1"}
        jobs.append((subprocess.Popen(bed.host_command(host, command), cwd=_REPO, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True), workdir))
    reports = []
    for job, workdir in jobs:
        _, stderr = job.communicate()
        if job.returncode != 0:
            sys.exit(f"netbed_sweep: {name} failed (exit {job.returncode}):\n{stderr[-3000:]}")
        reports += read_reports([layout.benchmark(workdir)])
    rates = [report["total_images_per_sec"] for report in reports]
    print(f"netbed_sweep: {name}: {' / '.join(f'{rate:.1f}' for rate in rates)} images/sec", flush=True)
    return reports


def measure_side_by_side(bed: netbed.Bed, name: str, extra: list[str]) -> float:
    """A 1-worker benchmark on each host at once, no communication; returns their mean rate."""
    return statistics.mean(report["total_images_per_sec"] for report in measure_on_hosts(bed, name, [0, 1], extra))


def predict(one_worker_json: str, allreduce_json: str, pack_bytes: int, extra: list[str], **system_fields) -> float:
    """tfscale-plan's efficiency of 2 workers, one per host, from the bed's microbenchmarks alone (`system_fields`
    replace what the 1-worker report gives); against the model's 1 worker of that report."""
    cfg = tfs_config.load_config_file(_CONFIG.value, overrides(2, pack_bytes, "synthetic", extra))
    workload = plan_workload.workload_from_config(cfg, per_gpu_batch=_PER_WORKER_BATCH.value)
    measured = plan.measured_overrides(one_worker_json, allreduce_json, workload)
    system = plan_model.System(
        name="netbed", gpus_per_node=1, gpu_images_per_sec=measured["gpu_images_per_sec"],
        intra_node_GBps=measured["intra_node_GBps"], intra_node_latency_us=measured["intra_node_latency_us"],
        inter_node_GBps=measured["intra_node_GBps"], inter_node_latency_us=measured["intra_node_latency_us"],
        step_time_cv=measured.get("step_time_cv", 0.0))
    one = plan_model.predict_point(workload, system, 1)["images_per_sec"]
    return plan_model.predict_point(workload, dataclasses.replace(system, **system_fields), 2)["images_per_sec"] / (2 * one)


def rate_tag(rate: float | None) -> str:
    """The rate in a run's directory name."""
    return "unshaped" if rate is None else f"{rate:g}mbit"


def rate_name(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def run_rounds(bed: netbed.Bed, rates: list, extra: list[str]) -> tuple[dict, list, dict]:
    """{(rate, mode): [efficiency of each round]}, [the ceiling of each round] and, for the first round,
    {rate: (1-worker json, all-reduce json)}."""
    efficiencies, ceilings, microbenchmarks = {}, [], {}
    root = os.path.abspath(_WORKDIR.value)
    for round_index in range(_ROUNDS.value):
        tag = f"round{round_index + 1}"
        bed = netbed.set_rate(bed, None)  # one worker alone sends nothing: its link does not matter
        alone = measure(bed, f"one_worker_{tag}", 1, 0, extra)["total_images_per_sec"]
        ceilings.append(measure_side_by_side(bed, f"side_by_side_{tag}", extra) / alone)
        ordered = rates if round_index % 2 == 0 else list(reversed(rates))
        for rate in ordered:
            bed = netbed.set_rate(bed, rate)
            modes = list(MODES.items()) if round_index % 2 == 0 else list(reversed(MODES.items()))
            for mode, pack in modes:
                pack = _PACK_BYTES.value if pack is None else pack
                name = f"two_{rate_tag(rate)}_{'buckets' if pack else 'one'}_{tag}"
                report = measure(bed, name, 2, pack, extra)
                efficiencies.setdefault((rate, mode), []).append(report["total_images_per_sec"] / (2 * alone))
            if round_index == 0:
                name = f"allreduce_{rate_tag(rate)}"
                measure(bed, name, 2, 0, extra, mode="allreduce")
                microbenchmarks[rate] = (layout.benchmark(os.path.join(root, f"one_worker_{tag}")),
                                         layout.benchmark(os.path.join(root, name)))
    return efficiencies, ceilings, microbenchmarks


def table(rates: list, efficiencies: dict, ceilings: list, predicted: dict) -> str:
    ceiling = statistics.median(ceilings)
    lines = [f"Ceiling (two 1-worker runs side by side, each at this share of one alone): "
             f"{' / '.join(f'{100 * c:.1f}%' for c in ceilings)} (median {100 * ceiling:.1f}%).", "",
             "| link | one message: efficiency each round (median; of the ceiling) | buckets: each round (median; of the "
             "ceiling) | overlap gain, paired (median) | predicted: one message / buckets / gain | error (points): "
             "one / buckets / gain |", "|---|---|---|---|---|---|"]
    for rate in rates:
        one, buckets = efficiencies[rate, "one message"], efficiencies[rate, "buckets"]
        gains = [b - o for o, b in zip(one, buckets)]
        p_one, p_buckets = predicted[rate]
        m_one, m_buckets, m_gain = statistics.median(one), statistics.median(buckets), statistics.median(gains)
        cells = [" / ".join(f"{100 * e:.1f}%" for e in values) + f" ({100 * statistics.median(values):.1f}%; "
                 f"{statistics.median(e / c for e, c in zip(values, ceilings)):.2f})" for values in (one, buckets)]
        lines.append(f"| {rate_name(rate)} | {cells[0]} | {cells[1]} | "
                     f"{' / '.join(f'{100 * g:+.1f}' for g in gains)} ({100 * m_gain:+.1f} pts) | "
                     f"{100 * p_one:.1f}% / {100 * p_buckets:.1f}% / {100 * (p_buckets - p_one):+.1f} pts | "
                     f"{100 * (p_one - m_one):+.1f} / {100 * (p_buckets - m_buckets):+.1f} / "
                     f"{100 * ((p_buckets - p_one) - m_gain):+.1f} |")
    return "\n".join(lines)


def pooled_cv(reports: list[dict]) -> float:
    """System.step_time_cv of the timed steps of these 1-worker runs together: the spread across their hosts."""
    steps = []
    for report in reports:
        per_step = report["steps_ms"]  # every step, warm-up first
        steps += [wait + compute for wait, compute in zip(per_step["input_wait"], per_step["compute"])
                  ][report["num_warmup_batches"]:]
    return plan.step_time_cv(statistics.quantiles(steps, n=10)[-1], statistics.median(steps))


def run_straggler_rounds(bed: netbed.Bed, rates: list, extra: list[str]) -> tuple[dict, list, dict]:
    """Host 1 limited to --straggler_cpu of a core: {rate: [efficiency of each round]}, [the straggler's rate over
    host 0's, each round] and, for the first round, {rate: (host 0's, host 1's and the all-reduce's benchmark.json)}."""
    efficiencies, shares, microbenchmarks = {}, [], {}
    root = os.path.abspath(_WORKDIR.value)
    for round_index in range(_ROUNDS.value):
        tag = f"round{round_index + 1}"
        bed = netbed.set_cpu(netbed.set_rate(bed, None), 1, _STRAGGLER_CPU.value)
        alone = measure_on_hosts(bed, f"alone_host0_{tag}", [0], extra)[0]
        slowed = measure_on_hosts(bed, f"alone_host1_{tag}", [1], extra)[0]
        shares.append(slowed["total_images_per_sec"] / alone["total_images_per_sec"])
        for rate in rates if round_index % 2 == 0 else list(reversed(rates)):
            bed = netbed.set_rate(bed, rate)
            report = measure(bed, f"straggler_{rate_tag(rate)}_{tag}", 2, 0, extra)
            efficiencies.setdefault(rate, []).append(report["total_images_per_sec"] / (2 * alone["total_images_per_sec"]))
            if round_index == 0:  # the link's own microbenchmark, without the straggler
                bed = netbed.set_cpu(bed, 1, None)
                name = f"allreduce_{rate_tag(rate)}"
                measure(bed, name, 2, 0, extra, mode="allreduce")
                bed = netbed.set_cpu(bed, 1, _STRAGGLER_CPU.value)
                microbenchmarks[rate] = tuple(layout.benchmark(os.path.join(root, run)) for run in (
                    f"alone_host0_{tag}/host0", f"alone_host1_{tag}/host1", name))
    return efficiencies, shares, microbenchmarks


def predict_overlap(one_worker_json: str, allreduce_json: str, ceiling: float, extra: list[str]) -> tuple[float, float]:
    """(one message, buckets): the planner's efficiency with each host computing at the `ceiling` share of one
    worker alone, what a host keeps while the other computes too (the bed's hosts share this machine's cores; a
    cluster's nodes do not), against one worker alone."""
    (alone,) = read_reports([one_worker_json])
    busy_rate = ceiling * alone["total_images_per_sec"]
    return tuple(predict(one_worker_json, allreduce_json, pack, extra, gpu_images_per_sec=busy_rate)
                 for pack in (0, _PACK_BYTES.value))


def predict_straggler(alone_json: str, slowed_json: str, allreduce_json: str, extra: list[str]) -> tuple[float, float]:
    """(the planner's spread term: host 0's rate for every GPU, the step-time spread of both hosts' steps pooled;
    the planner told of its slowest GPU: host 0's rate and spread, host 1's rate as slowest_gpu_images_per_sec),
    each as efficiency against host 0 alone."""
    alone, slowed = read_reports([alone_json, slowed_json])
    return (predict(alone_json, allreduce_json, 0, extra, step_time_cv=pooled_cv([alone, slowed])),
            predict(alone_json, allreduce_json, 0, extra, slowest_gpu_images_per_sec=slowed["total_images_per_sec"]))


def straggler_table(rates: list, efficiencies: dict, shares: list, predicted: dict) -> str:
    lines = [f"The straggler alone runs at {' / '.join(f'{100 * share:.1f}%' for share in shares)} of host 0's rate.",
             "", "| link | efficiency each round (median) | predicted: spread term / slowest GPU | error (points): "
             "spread term / slowest GPU |", "|---|---|---|---|"]
    for rate in rates:
        measured = statistics.median(efficiencies[rate])
        term, slowest = predicted[rate]
        lines.append(f"| {rate_name(rate)} | {' / '.join(f'{100 * e:.1f}%' for e in efficiencies[rate])} "
                     f"({100 * measured:.1f}%) | {100 * term:.1f}% / {100 * slowest:.1f}% | "
                     f"{100 * (term - measured):+.1f} / {100 * (slowest - measured):+.1f} |")
    return "\n".join(lines)


def straggler_main(bed: netbed.Bed, rates: list, extra: list[str]) -> tuple[str, dict]:
    efficiencies, shares, microbenchmarks = run_straggler_rounds(bed, rates, extra)
    netbed.down(_PREFIX.value)
    predicted = {rate: predict_straggler(*microbenchmarks[rate], extra) for rate in rates}
    title = (f"2 hosts x 1 worker x 1 thread, host 1 limited to {_STRAGGLER_CPU.value:g} of a core, {_CONFIG.value} "
             f"at {_PER_WORKER_BATCH.value} images/worker/step, {_BACKEND.value}, one message, XLA off; "
             f"{_ROUNDS.value} round(s)")
    report = f"# A straggler on a test bed\n\n{title}\n\n{straggler_table(rates, efficiencies, shares, predicted)}\n"
    return report, {"title": title, "straggler_shares": shares, "rows": [
        {"rate_mbit": rate, "efficiency": efficiencies[rate], "predicted_spread_term": predicted[rate][0],
         "predicted_slowest_gpu": predicted[rate][1]} for rate in rates]}


def overlap_main(bed: netbed.Bed, rates: list, extra: list[str]) -> tuple[str, dict]:
    efficiencies, ceilings, microbenchmarks = run_rounds(bed, rates, extra)
    netbed.down(_PREFIX.value)
    ceiling = statistics.median(ceilings)
    predicted = {rate: predict_overlap(*microbenchmarks[rate], ceiling, extra) for rate in rates}
    title = (f"2 hosts x 1 worker x 1 thread, {_CONFIG.value} at {_PER_WORKER_BATCH.value} images/worker/step, "
             f"{_BACKEND.value}, buckets of {_PACK_BYTES.value} bytes, XLA off; {_ROUNDS.value} round(s)")
    report = f"# Overlap on a test bed\n\n{title}\n\n{table(rates, efficiencies, ceilings, predicted)}\n"
    return report, {"title": title, "ceilings": ceilings, "rows": [
        {"rate_mbit": rate, "one_message": efficiencies[rate, "one message"], "buckets": efficiencies[rate, "buckets"],
         "predicted_one_message": predicted[rate][0], "predicted_buckets": predicted[rate][1]} for rate in rates]}


def main(argv):
    extra = argv[1:]
    rates = [None if float(rate) == 0 else float(rate) for rate in _RATES.value]
    os.makedirs(_WORKDIR.value, exist_ok=True)
    netbed.down(_PREFIX.value)  # what a killed earlier sweep left
    bed = netbed.up(_PREFIX.value, num_hosts=2)
    try:
        study = straggler_main if _STRAGGLER_CPU.value else overlap_main
        report, data = study(bed, rates, extra)
    finally:
        netbed.down(_PREFIX.value)
    with open(os.path.join(_WORKDIR.value, "report.md"), "w") as f:
        f.write(report)
    with open(os.path.join(_WORKDIR.value, "report.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(report)
    print(f"wrote {os.path.join(_WORKDIR.value, 'report.md')}")


if __name__ == "__main__":
    app.run(main)
