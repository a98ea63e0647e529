#!/usr/bin/env python3
r"""The scaling table an allocation proposal asks for, measured on your cluster: one command writes the jobs.

    python tools/scaling_sweep.py --config=configs/r50_32gpu.py --nodes=1,2,4,8 --gpus_per_node=4 --backend=mwms \
        --per_gpu_batch=128 --workdir=/shared/$USER/sweep --partition=gpu --account=myproject [--submit]

Weak scaling: every point keeps --per_gpu_batch images per GPU. One job per point (make_sbatch with
--program=benchmark: synthetic steps, then the all-reduce table of the same job, benchmark.with_allreduce),
plus one GPU alone as the reference, plus a report job that runs after all of them
(`--dependency=afterany`) and writes WORKDIR/scaling.md, scaling.json and scaling.png: per node count
the GPUs, measured images/sec, tfscale-plan's prediction, speedup, efficiency against one GPU and
against one node, the time per epoch, and the gradients' all-reduce bus bandwidth. The prediction
takes the one-GPU rate and the links from the sweep's own all-reduce tables (the node's from the
one-node job, the network's from the smallest multi-node job), or from --system.

--submit runs sbatch (each point, then the report with the dependency); without it the tool writes
WORKDIR/jobs/submit.sh to do so. `--report --workdir=W` writes the report from what has finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # runs from a checkout
sys.path.insert(0, os.path.join(REPO, "tools"))

import make_sbatch  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale import errors
from tfscale.perf import plan  # noqa: E402
from tfscale.perf import scaling
from tfscale.planning import plan_model, plan_workload
from tfscale.workdir import layout

REPORT_JOB = """#!/bin/bash
#SBATCH --job-name=tfscale-sweep-report
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --time=00:20:00
#SBATCH --output={jobs}/report-%j.out
{extra}cd {tfscale_dir}
exec {python} tools/scaling_sweep.py --report --workdir={workdir}{system}
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides = [a for a in argv if a.startswith("--config.")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the job's config, e.g. configs/r50_32gpu.py[:amp]")
    parser.add_argument("--nodes", default="1,2", help="node counts, e.g. 1,2,4,8")
    parser.add_argument("--gpus_per_node", type=int, default=0, help="GPUs per node (one task each); 0: CPU tasks")
    parser.add_argument("--tasks_per_node", type=int, default=0, help="with --gpus_per_node=0: tasks per node")
    parser.add_argument("--backend", choices=("mwms", "horovod"), default="mwms")
    parser.add_argument("--launcher", choices=make_sbatch.LAUNCHERS, default="srun-pmix")
    parser.add_argument("--per_gpu_batch", type=int, default=0, help="images per GPU (default: the config's per-replica batch)")
    parser.add_argument("--num_batches", type=int, default=50, help="timed steps per point")
    parser.add_argument("--num_warmup_batches", type=int, default=10)
    parser.add_argument("--allreduce_max_bytes", type=int, default=256 << 20)
    parser.add_argument("--workdir", required=True, help="a directory every node shares: runs, jobs, the report")
    parser.add_argument("--system", default="", help="tfscale-plan's --system for the predicted column "
                        "(default: calibrated from the sweep's own runs)")
    for name in ("partition", "account", "time", "modules", "venv", "tfscale_dir"):
        parser.add_argument(f"--{name}", default=None, help=f"passed to make_sbatch --{name}")
    parser.add_argument("--submit", action="store_true", help="sbatch the jobs (else write jobs/submit.sh)")
    parser.add_argument("--report", action="store_true", help="write the report from the finished points")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    return args, overrides


def points(args) -> list[dict]:
    """The sweep's runs: one GPU (the reference) and each node count, with their GPUs and directories."""
    per_node = args.gpus_per_node or args.tasks_per_node
    if per_node < 1:
        raise ValueError("give --gpus_per_node (GPU nodes) or --tasks_per_node (CPU tasks)")
    runs = [] if per_node == 1 and 1 in map(int, args.nodes.split(",")) else [{"nodes": 1, "gpus": 1, "per_node": 1}]
    runs += [{"nodes": int(n), "gpus": int(n) * per_node, "per_node": per_node} for n in args.nodes.split(",")]
    for run in runs:
        run["name"] = f"n{run['nodes']}_g{run['gpus']}"
        run["workdir"] = os.path.join(os.path.abspath(args.workdir), "points", run["name"])
    return runs


def point_overrides(args, per_gpu_batch: int, gpus: int, overrides: list[str]) -> list[str]:
    global_batch = per_gpu_batch * gpus
    return ["--config.data.dataset=synthetic", "--config.benchmark.mode=synthetic",
            "--config.benchmark.with_allreduce=True", f"--config.data.global_batch_size={global_batch}",
            f"--config.data.num_train_examples={global_batch * 1000}",  # synthetic steps never run out
            f"--config.data.max_per_replica_batch_size={per_gpu_batch}",
            f"--config.benchmark.num_batches={args.num_batches}",
            f"--config.benchmark.num_warmup_batches={args.num_warmup_batches}",
            f"--config.benchmark.allreduce_max_bytes={args.allreduce_max_bytes}", *overrides]


def per_gpu_batch(args, overrides: list[str]) -> int:
    cfg = tfs_config.load_config_file(args.config, overrides)
    return args.per_gpu_batch or cfg.data.max_per_replica_batch_size or cfg.data.global_batch_size


def write_jobs(args, overrides: list[str]) -> list[str]:
    """One batch script per point (make_sbatch) and the report job; returns the scripts, report last."""
    batch = per_gpu_batch(args, overrides)
    jobs = os.path.join(os.path.abspath(args.workdir), "jobs")
    os.makedirs(jobs, exist_ok=True)
    scripts, runs = [], points(args)
    passthrough = [f"--{name}={getattr(args, name)}" for name in ("partition", "account", "time", "modules", "venv",
                                                                  "tfscale_dir") if getattr(args, name) is not None]
    for run in runs:
        script = os.path.join(jobs, f"{run['name']}.sbatch")
        gpus = ([f"--gpus_per_node={run['per_node']}"] if args.gpus_per_node else
                ["--gpus_per_node=0", f"--tasks_per_node={run['per_node']}"])
        code = make_sbatch.main([
            f"--config={args.config}", f"--nodes={run['nodes']}", *gpus, f"--backend={args.backend}",
            f"--launcher={args.launcher}", "--program=benchmark", f"--workdir={run['workdir']}", "--stage_dir=",
            f"--output={script}", f"--job_output={jobs}/{run['name']}-%j.out", f"--job_name=tfscale-sweep-{run['name']}",
            *passthrough, *point_overrides(args, batch, run["gpus"], overrides)])
        if code != 0:
            raise ValueError(f"make_sbatch refused the {run['name']} point (its message is above)")
        scripts.append(script)
    with open(os.path.join(args.workdir, "sweep.json"), "w") as f:
        json.dump({"config": args.config, "overrides": overrides, "per_gpu_batch": batch, "backend": args.backend,
                   "points": runs}, f, indent=1)
    venv = args.venv or sys.prefix
    extra = "".join(f"#SBATCH --{name}={getattr(args, name)}\n" for name in ("partition", "account")
                    if getattr(args, name))
    report = os.path.join(jobs, "report.sbatch")
    with open(report, "w") as f:
        f.write(REPORT_JOB.format(jobs=jobs, extra=extra, tfscale_dir=shlex.quote(args.tfscale_dir or REPO),
                                  python=shlex.quote(os.path.join(venv, "bin", "python")),
                                  workdir=shlex.quote(os.path.abspath(args.workdir)),
                                  system=f" --system={shlex.quote(args.system)}" if args.system else ""))
    return scripts + [report]


def submit(scripts: list[str], env=None) -> list[int]:
    """sbatch every point, then the report after all of them; the job ids, report last."""
    def sbatch(*args: str) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], check=True, capture_output=True, text=True, env=env)
        return int(out.stdout.strip().split(";")[0])

    ids = [sbatch(script) for script in scripts[:-1]]
    return ids + [sbatch(f"--dependency=afterany:{':'.join(map(str, ids))}", scripts[-1])]


def submit_script(scripts: list[str]) -> str:
    lines = ["#!/bin/bash", "# Submits the sweep's points, then its report once they have all ended.", "set -euo pipefail",
             "ids=()"]
    lines += [f"ids+=($(sbatch --parsable {shlex.quote(s)} | cut -d';' -f1))" for s in scripts[:-1]]
    lines += ['deps=$(IFS=:; echo "${ids[*]}")',
              f'sbatch --dependency=afterany:"$deps" {shlex.quote(scripts[-1])}']
    return "\n".join(lines) + "\n"


# --- the report ------------------------------------------------------------------------------------------


def measured_points(workdir: str) -> tuple[dict, list[dict]]:
    with open(os.path.join(workdir, "sweep.json")) as f:
        sweep = json.load(f)
    done = []
    for run in sweep["points"]:
        path = os.path.join(run["workdir"], layout.BENCHMARK)
        if os.path.exists(path):
            with open(path) as f:
                done.append({**run, "report": json.load(f)})
        else:
            print(f"scaling_sweep: {run['name']} has no benchmark.json (failed or not run): left out", file=sys.stderr)
    return sweep, done


def calibrated_system(done: list[dict], system_arg: str, model: str, batch: int) -> plan_model.System:
    """The plan's System: --system, else the sweep's own one-GPU rate and all-reduce tables."""
    one = next(p for p in done if p["gpus"] == 1)["report"]["total_images_per_sec"]
    if system_arg:
        system = plan_workload.resolve_system(system_arg, model, batch)
        return dataclasses.replace(system, gpu_images_per_sec=system.gpu_images_per_sec or one)
    per_node = max(p["per_node"] for p in done)
    node = next((p for p in done if p["nodes"] == 1 and p["gpus"] > 1), None)
    multi = min((p for p in done if p["nodes"] > 1), key=lambda p: p["nodes"], default=None)

    def link(point):
        report = point["report"]
        return plan.link_from_allreduce(report["allreduce"], report["num_replicas"])

    inter = link(multi) if multi else (1.0, 1.0)
    intra = link(node) if node else inter
    return plan_model.System(name="this cluster (calibrated from the sweep)", gpus_per_node=per_node,
                             gpu_images_per_sec=one, intra_node_GBps=intra[0], intra_node_latency_us=intra[1],
                             inter_node_GBps=inter[0], inter_node_latency_us=inter[1])


def report_rows(sweep: dict, done: list[dict], system: plan_model.System) -> list[dict]:
    cfg = tfs_config.load_config_file(sweep["config"], sweep["overrides"])
    workload = plan_workload.workload_from_config(cfg, per_gpu_batch=sweep["per_gpu_batch"])
    one = next(p for p in done if p["gpus"] == 1)["report"]["total_images_per_sec"]
    node = next((p for p in done if p["nodes"] == 1 and p["gpus"] == p["per_node"]), None)
    rows = []
    for point in sorted(done, key=lambda p: p["gpus"]):
        measured = point["report"]["total_images_per_sec"]
        predicted = plan_model.predict(workload, system, [point["gpus"]])[0]["images_per_sec"]
        rows.append({
            "nodes": point["nodes"], "gpus": point["gpus"], "images_per_sec": measured,
            "predicted_images_per_sec": predicted, "speedup": measured / one, "efficiency": measured / (one * point["gpus"]),
            "efficiency_vs_node": ((measured / node["report"]["total_images_per_sec"]) / (point["gpus"] / node["gpus"])
                                   if node else None),
            "hours_per_epoch": workload.num_train_examples / measured / 3600,
            "gradient_busbw_GBps": point["report"]["model_gradients"]["busbw_GBps"],
        })
    return rows


def markdown(rows: list[dict], title: str, system: plan_model.System) -> str:
    lines = [f"# {title}", "", "| nodes | GPUs | images/sec | predicted | speedup | efficiency (1 GPU) | "
             "efficiency (1 node) | hours per epoch | gradient all-reduce busbw |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs_node = f"{r['efficiency_vs_node']:.3f}" if r["efficiency_vs_node"] is not None else "-"
        lines.append(f"| {r['nodes']} | {r['gpus']} | {r['images_per_sec']:.1f} | {r['predicted_images_per_sec']:.1f} | "
                     f"{r['speedup']:.2f} | {r['efficiency']:.3f} | {vs_node} | {r['hours_per_epoch']:.3g} | "
                     f"{r['gradient_busbw_GBps']:.3f} GB/s |")
    lines += ["", f"Predicted: tfscale-plan on {system.name}: one GPU {system.gpu_images_per_sec:.1f} images/sec, "
                  f"{system.intra_node_GBps:.3g} GB/s and {system.intra_node_latency_us:.3g} us/step in a node, "
                  f"{system.inter_node_GBps:.3g} GB/s and {system.inter_node_latency_us:.3g} us/step between nodes.",
              "", "![scaling](scaling.png)"]
    return "\n".join(lines) + "\n"


def write_report(workdir: str, system_arg: str = "") -> str:
    sweep, done = measured_points(workdir)
    if not any(p["gpus"] == 1 for p in done):
        raise ValueError(f"{workdir}: the one-GPU reference point has no benchmark.json")
    cfg_name = make_sbatch.config_name(sweep["config"])
    model = tfs_config.load_config_file(sweep["config"], sweep["overrides"]).model.name
    system = calibrated_system(done, system_arg, model, sweep["per_gpu_batch"])
    rows = report_rows(sweep, done, system)
    title = f"Weak scaling of {cfg_name} ({sweep['backend']}, {sweep['per_gpu_batch']} images per GPU)"
    with open(os.path.join(workdir, "scaling.json"), "w") as f:
        json.dump({"title": title, "rows": rows, "system": dataclasses.asdict(system)}, f, indent=1)
    series = [scaling.Point("measured", r["gpus"], r["images_per_sec"]) for r in rows]
    series += [scaling.Point("predicted (tfscale-plan)", r["gpus"], r["predicted_images_per_sec"]) for r in rows]
    scaling.plot(scaling.scaling_rows(series, reference_workers=1), os.path.join(workdir, "scaling.png"), title)
    text = markdown(rows, title, system)
    with open(os.path.join(workdir, "scaling.md"), "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.report:
            print(write_report(os.path.abspath(args.workdir), args.system))
            return 0
        if not args.config:
            raise ValueError("--config is required (or --report)")
        scripts = write_jobs(args, overrides)
    except (ValueError, errors.ConfigError) as err:
        print(f"scaling_sweep: {err}", file=sys.stderr)
        return 2
    if args.submit:
        ids = submit(scripts)
        print(f"submitted {len(ids) - 1} point(s) {', '.join(map(str, ids[:-1]))}; the report: job {ids[-1]} "
              f"(afterany), writes {os.path.join(os.path.abspath(args.workdir), 'scaling.md')}")
    else:
        path = os.path.join(os.path.abspath(args.workdir), "jobs", "submit.sh")
        with open(path, "w") as f:
            f.write(submit_script(scripts))
        os.chmod(path, 0o755)
        print(f"wrote {len(scripts) - 1} point job(s) and the report job; submit with: bash {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
