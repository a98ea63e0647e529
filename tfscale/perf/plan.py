"""tfscale-plan: how fast, how efficient and how long a data-parallel job is at N GPUs, before it runs.

    tfscale-plan --config=r50_32gpu --system=p100_ib_4gpu [--gpus=1,2,4,8,16,32] [--output_dir=runs/plan]
    tfscale-plan --config=r50_32gpu --system=my_cluster.json --benchmark_json=runs/bench1/benchmark.json \
        [--allreduce_json=runs/allreduce/benchmark.json]
    tfscale-plan --config=r50_32gpu:amp --system=a100_ib_200g --gpus=32,256 --parts   # each part of the step
    tfscale-plan --published        # the model beside every published run it is checked against (docs/scaling.md)

Prints a table per GPU count (images/sec, per GPU, speedup, efficiency against 1 GPU with its 80 % band
(tfscale.planning.plan_band: the planner's errors on the runs it was checked against) and against one node,
step and all-reduce time, whether input bounds it, the wall time of the config's epochs) and writes
plan.json and plan.png to --output_dir. The model itself: tfscale.planning.plan_model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from tfscale import cli, errors, io
from tfscale.config import step_modes
from tfscale.config.names import PACK_AUTO
from tfscale.perf import scaling
from tfscale.planning import plan_band, plan_published
from tfscale.planning.plan_model import System, Workload, best_bucket_bytes, default_gpu_counts, predict
from tfscale.planning.plan_workload import auto_pack_bytes, resolve_system, workload_from_config

# --- systems from measurements ------------------------------------------------------------------------------------


def link_from_allreduce(rows: list[dict], num_replicas: int) -> tuple[float, float]:
    """(bandwidth GB/s, latency us per ring step) of the ring that gave an all-reduce benchmark's table.

    Latency from the smallest message (its time is nearly all 2(n-1) steps), bandwidth from the largest
    with that latency taken off: the two-point fit of `ring_allreduce_s` to the measurement.
    """
    smallest, largest = min(rows, key=lambda r: r["size_bytes"]), max(rows, key=lambda r: r["size_bytes"])
    steps = 2 * (num_replicas - 1)
    latency_s = smallest["time_us"] * 1e-6 / steps
    transfer_s = max(largest["time_us"] * 1e-6 - steps * latency_s, 1e-9)
    return 2 * (num_replicas - 1) / num_replicas * largest["size_bytes"] / transfer_s / 1e9, latency_s * 1e6



# --- output --------------------------------------------------------------------------------------------------


def table(rows: list[dict], epochs: float) -> str:
    lines = [f"{'GPUs':>5} {'nodes':>5} {'images/sec':>11} {'per GPU':>8} {'speedup':>8} {'eff(1 GPU)':>10} "
             f"{'80% band':>11} {'eff(node)':>9} {'step ms':>8} {'all-red ms':>10} {'exposed':>8} {'NCCL':>5} {'input':>6} {'eval+ckpt':>9} "
             f"{f'{epochs:g} epochs':>11}"]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['nodes']:>5} {r['images_per_sec']:>11.1f} {r['per_gpu_images_per_sec']:>8.1f} "
                     f"{r['speedup']:>8.2f} {r['efficiency']:>10.3f} {band(r):>11} {r['efficiency_vs_node']:>9.3f} "
                     f"{r['step_ms']:>8.1f} {r['allreduce_ms']:>10.1f} {r['exposed_ms']:>8.1f} {r['nccl_algorithm']:>5} "
                     f"{'BOUND' if r['input_bound'] else 'ok':>6} {100 * r['eval_checkpoint_share']:>8.1f}% "
                     f"{r['hours_for_epochs']:>9.1f} h")
    return "\n".join(lines)


def band(row: dict) -> str:
    """The row's efficiency band (tfscale.planning.plan_band), or "-" without one (1 GPU)."""
    low, high = row.get("efficiency_band", (1.0, 1.0))
    return "-" if row["gpus"] == 1 else f"{low:.2f}-{high:.2f}"


def published_points(workload: Workload, system: System) -> tuple[list[tuple[int, float]], str]:
    """([(GPUs, efficiency)], source) measured and published for this model, per-GPU batch and system; ([], "")
    where none was (tfscale.planning.plan_published.SERIES)."""
    for series in plan_published.SERIES:
        if (series.system, series.model, series.per_gpu_batch) == (system.name, workload.model, workload.per_gpu_batch):
            return [point for point in series.published() if point[0] > 1], series.source
    return [], ""


def plot(rows: list[dict], path: str, title: str, published: list[tuple[int, float]] = ()) -> None:
    """Throughput and efficiency against GPUs: the prediction, its 80 % band, and what was measured and
    published for the same model, batch and system where there is such a run."""
    gpus = [r["gpus"] for r in rows]
    with scaling.two_panel_png(path, title, figsize=(10, 4)) as (speed, eff):
        speed.plot(gpus, [r["images_per_sec"] for r in rows], "o-", label="predicted")
        one_gpu = rows[0]["images_per_sec"] / rows[0]["speedup"]
        speed.plot(gpus, [g * one_gpu for g in gpus], "k:", label="linear")
        speed.set(xlabel="GPUs", ylabel="images/sec", xscale="log", yscale="log", title="throughput")
        low, high = zip(*(r.get("efficiency_band", (1.0, 1.0)) for r in rows))
        eff.fill_between(gpus, low, high, alpha=0.2, label="80% band of the prediction")
        eff.plot(gpus, [r["efficiency"] for r in rows], "o-", label="vs 1 GPU, predicted")
        eff.plot(gpus, [r["efficiency_vs_node"] for r in rows], "s--", label="vs 1 node, predicted")
        if published:
            eff.plot(*zip(*published), "kx", markersize=8, label="vs 1 GPU, published run")
        eff.set(xlabel="GPUs", ylabel="efficiency", xscale="log", ylim=(0, 1.1), title="scaling efficiency")


def write_outputs(output_dir: str, workload: Workload, system: System, rows: list[dict], title: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    summary = {k: v for k, v in dataclasses.asdict(workload).items() if k != "layers"}
    summary["gradient_bytes"] = workload.gradient_bytes
    io.write_json(os.path.join(output_dir, "plan.json"),
                  {"workload": summary, "system": dataclasses.asdict(system), "rows": rows})
    plot(rows, os.path.join(output_dir, "plan.png"), title, published_points(workload, system)[0])


def describe(workload: Workload, system: System) -> str:
    when = {"per_tensor": "tensor by tensor as gradients become ready",
            "buckets": f"in buckets of {workload.fusion_bytes / 2**20:g} MiB as they fill"}.get(
        workload.overlap, "after the backward pass")
    return (f"{workload.model}, {workload.per_gpu_batch} images per GPU, {workload.gradient_bytes / 1e6:.1f} MB of "
            f"gradients ({workload.algorithm} all-reduce {when}); {system.name}: {system.gpus_per_node} GPUs per node, "
            f"1 GPU {system.gpu_images_per_sec:g} images/sec, {system.intra_node_GBps:g} GB/s in a node, "
            f"{system.inter_node_GBps:g} GB/s between nodes")


def bucket_advice(cfg, workload: Workload, system: System, num_gpus: int) -> str:
    """The distribute.pack_bytes that hides the most all-reduce at `num_gpus` GPUs (a config without XLA)."""
    size, exposed_s = best_bucket_bytes(workload, system, num_gpus)
    if cfg.jit_compile:
        return (f"jit_compile=True: every gradient is ready only when the XLA step ends, so none is sent sooner; "
                f"without XLA, distribute.pack_bytes={size} would leave {exposed_s * 1e3:.1f} ms of all-reduce exposed "
                f"at {num_gpus} GPUs (plan that config with its own one-GPU rate, and take the faster)")
    return f"distribute.pack_bytes={size} exposes the least all-reduce at {num_gpus} GPUs: {exposed_s * 1e3:.1f} ms a step"



def fail(message: str) -> None:
    sys.exit(f"tfscale-plan: {message}")


# --- the command line ----------------------------------------------------------------------------------------



def measured_overrides(benchmark_json: str, allreduce_json: str, workload: Workload | None = None) -> dict:
    """System fields from tfscale-bench reports: the one-GPU rate, and the link the all-reduce table shows.
    With `workload`, the benchmark must have run its model at its batch per GPU."""
    overrides = {}
    if benchmark_json:
        report = _read_report(benchmark_json, "total_images_per_sec")
        if workload is not None:
            _check_same_step(benchmark_json, report, workload)
        if report["num_replicas"] != 1:
            raise ValueError(f"--benchmark_json={benchmark_json} ran on {report['num_replicas']} replicas; "
                             "the plan's reference is one GPU (run tfscale-bench with one worker)")
        overrides["gpu_images_per_sec"] = report["total_images_per_sec"]
        worker = report["per_worker"][0]
        if worker.get("p90_step_ms"):  # the GPU's step-time spread: what stragglers cost at N GPUs
            overrides["step_time_cv"] = step_time_cv(worker["p90_step_ms"], worker["median_step_ms"])
    if allreduce_json:
        report = _read_report(allreduce_json, "allreduce")
        bandwidth, latency = link_from_allreduce(report["allreduce"], report["num_replicas"])
        overrides.update(intra_node_GBps=bandwidth, intra_node_latency_us=latency)
    return overrides


def step_time_cv(p90_ms: float, median_ms: float) -> float:
    """System.step_time_cv from a step-time distribution's p90 and median: a normal's p90 is 1.2816 sigma above."""
    return max(0.0, p90_ms / median_ms - 1) / 1.2816


def _check_same_step(path: str, report: dict, workload: Workload) -> None:
    ran = (report.get("model"), report.get("per_worker_batch_size"))
    if ran != (workload.model, workload.per_gpu_batch):
        raise ValueError(f"--benchmark_json={path} ran {ran[0]} at {ran[1]} images per GPU; the plan is of "
                         f"{workload.model} at {workload.per_gpu_batch} (set --per_gpu_batch, or benchmark that config)")


def _read_report(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: {err}") from None
    if key not in report:
        raise ValueError(f"{path} is not a tfscale-bench report with {key!r} (benchmark.mode "
                         f"{'allreduce' if key == 'allreduce' else 'synthetic or train'})")
    return report


def run_plan(cfg, flags_) -> list[dict]:
    step_modes.resolve(cfg, on_gpus=True)  # as a GPU worker will: XLA decides whether buckets overlap
    if cfg.distribute.pack_bytes == PACK_AUTO:  # as the job would decide it at the largest count planned
        cfg.distribute.plan_system = cfg.distribute.plan_system or flags_.system
        largest = max([int(n) for n in flags_.gpus] or [flags_.max_gpus])
        per_gpu_batch = flags_.per_gpu_batch or cfg.data.max_per_replica_batch_size or cfg.data.global_batch_size
        cfg.distribute.pack_bytes, why = auto_pack_bytes(cfg, largest, per_gpu_batch)
        print(f"tfscale-plan: distribute.pack_bytes=auto -> {cfg.distribute.pack_bytes}: {why}")
    workload = workload_from_config(cfg, per_gpu_batch=flags_.per_gpu_batch)
    system = resolve_system(flags_.system, workload.model, workload.per_gpu_batch)
    overrides = measured_overrides(flags_.benchmark_json, flags_.allreduce_json, workload)
    if flags_.gpu_images_per_sec:
        overrides["gpu_images_per_sec"] = flags_.gpu_images_per_sec
    if flags_.slowest_gpu_images_per_sec:
        overrides["slowest_gpu_images_per_sec"] = flags_.slowest_gpu_images_per_sec
    system = dataclasses.replace(system, **overrides)
    if system.gpu_images_per_sec <= 0:
        raise ValueError(f"no one-GPU images/sec for {workload.model} at {workload.per_gpu_batch} per GPU on "
                         f"{system.name}: give --gpu_images_per_sec, or --benchmark_json from a one-GPU tfscale-bench run")
    counts = [int(n) for n in flags_.gpus] or default_gpu_counts(system.gpus_per_node, flags_.max_gpus)
    rows = plan_band.attach(predict(workload, system, counts))
    title = describe(workload, system)
    print(f"tfscale-plan: {title}")
    if flags_.parts:
        from tfscale.planning import plan_parts

        print(plan_parts.table(cfg.precision, workload, system, counts))
        return rows
    print(table(rows, workload.epochs))
    print(bucket_advice(cfg, workload, system, max(counts)))
    if flags_.output_dir:
        write_outputs(flags_.output_dir, workload, system, rows,
                      f"{workload.model}, {workload.per_gpu_batch} images per GPU, on {system.name}")
        print(f"wrote {os.path.join(flags_.output_dir, 'plan.json')} and plan.png")
    return rows


def main(argv) -> None:
    from absl import app, flags

    from tfscale.planning import plan_published

    del argv
    values = flags.FLAGS
    if values.published:
        print(plan_published.markdown(plan_published.compare()))
        print()
        print(plan_band.markdown(plan_band.held_out()))
        return
    if values.config is None:
        raise app.UsageError("--config is required (or --published)")
    try:
        run_plan(values.config, values)
    except (ValueError, errors.ConfigError) as err:
        fail(str(err))


def define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, cli.config_help("The job to plan"), lock_config=True)
    flags.DEFINE_string("system", "p100_ib_4gpu", "A cluster: a JSON file of tfscale.planning.plan_model.System's fields, or "
                        "one of the named systems (tfscale.planning.plan_published: SYSTEMS, REFERENCE_SYSTEMS).")
    flags.DEFINE_list("gpus", [], "GPU counts to predict (default: 1, 2, .. a node, then doubling to --max_gpus).")
    flags.DEFINE_integer("max_gpus", 64, "Largest GPU count of the default list.")
    flags.DEFINE_integer("per_gpu_batch", 0, "Images per GPU (default: the config's max_per_replica_batch_size, "
                         "else its global batch).")
    flags.DEFINE_float("gpu_images_per_sec", 0.0, "One GPU's images/sec at that batch (overrides the system's).")
    flags.DEFINE_float("slowest_gpu_images_per_sec", 0.0, "The images/sec of a GPU or node of the job that is slower "
                       "every step (tfscale-bench on it): every step waits for it.")
    flags.DEFINE_string("benchmark_json", "", "A one-GPU tfscale-bench benchmark.json: its images/sec.")
    flags.DEFINE_string("allreduce_json", "", "A tfscale-bench allreduce benchmark.json: the link between GPUs.")
    flags.DEFINE_string("output_dir", "", "Write plan.json and plan.png here.")
    flags.DEFINE_bool("parts", False, "Print what each part of the step is worth at each GPU count: the plan with the "
                      "skip's consensus, the compiled update, asynchronous checkpoints and bucketed overlap off, then on.")
    flags.DEFINE_bool("published", False, "Print the model beside the published runs it is checked against.")


def run():
    """Console-script entry point (`tfscale-plan`)."""
    from absl import app

    from tfscale import config as tfs_config

    cli.define_key_flags(define_flags)  # --help lists them under a console script too
    cli.adopt_usage(__name__)
    sys.argv = [tfs_config.resolve_config_arg(arg) for arg in sys.argv]
    app.run(main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    run()
