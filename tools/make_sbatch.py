#!/usr/bin/env python3
r"""Write a ready-to-submit Slurm batch script for a tfscale run from slurm/{mwms,horovod}.sbatch.

    python tools/make_sbatch.py --config=configs/r50_32gpu.py --nodes=8 --gpus_per_node=4 --backend=mwms \
        --data_dir=/shared/imagenet/tfrecords [--stage_dir='$TMPDIR/imagenet'] \
        --partition=gpu --account=myproject --time=24:00:00 --workdir=/shared/runs/r50 \
        [--output=r50_32gpu.sbatch] [--config.optim.lr_per_256=0.1 ...]
    sbatch r50_32gpu.sbatch

One task per GPU: nodes x gpus_per_node replicas, which must divide the config's global batch (the
check is tfscale.config.validation.validate's, so a bad split fails here, naming the nearest valid batch sizes,
instead of minutes into a queued job). CPU-only nodes: --gpus_per_node=0 --tasks_per_node=T.
`--config.x.y=v` overrides are validated with the config and passed on to every task unchanged.

Data: a config that reads files (the ImageNet and CIFAR recipes: data.dataset=tfrecord) needs
--data_dir, the shards on a file system every node reads; make_sbatch checks it exists here and
validates the config with it. The job copies the shards to --stage_dir on each node (node-local
disk) and trains with data.data_dir pointing at that copy; --stage_dir='' reads --data_dir in place.
`--backend=horovod` adds `--launcher=srun-pmix` (MPI builds, default) or `horovodrun-gloo`.

Studies: `--study=studies/lr_scaling_fmnist.py` instead of --config writes a job array, one task per
run of the study (cells x seeds, `#SBATCH --array=0-N`, at most --array_parallel at once), every task
with the nodes and GPUs asked for here. Every cell is validated now; task K trains the study's run K
in WORKDIR/runs/<cell>/seed<k>, skips it when finished, and refreshes WORKDIR/study.md when it ends.
`--config.x.y=v` overrides given here apply to every run and win over the study file's.
The study file's relative paths (config, data) are relative to --tfscale_dir, where the tasks start.

The script is the template with its #SBATCH lines and its EDIT HERE block filled in; everything else
(staging, NCCL/Horovod presets, SIGTERM forwarding, requeue) is the template's, documented there.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys

from tfscale import errors
from tfscale.config import validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # runs from a checkout too, without `pip install -e .`
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # validation imports TensorFlow; keep its chatter out

TEMPLATES = {"mwms": os.path.join(REPO, "slurm", "mwms.sbatch"),
             "horovod": os.path.join(REPO, "slurm", "horovod.sbatch")}
LAUNCHERS = ("srun-pmix", "horovodrun-gloo")
FILE_DATASETS = ("tfrecord", "tfds")  # config.data.dataset values read from config.data.data_dir
DEFAULT_VENV = sys.prefix  # the environment running make_sbatch: after `make demo` that is the CPU venv
DEFAULT_GPU_CPUS_PER_TASK = 8  # input pipeline threads per GPU: JPEG decoding needs several cores
_SBATCH_LINE = re.compile(r"^#{1,2}SBATCH\s+--([\w-]+)(?:=(.*))?$")
_EDIT_BEGIN, _EDIT_END = "# =====", "# ====="  # the EDIT HERE block sits between two such rulers


class UsageError(ValueError):
    """The requested job cannot be written; the message says which option or key and why."""


# --------------------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """make_sbatch's own options, and the `--config.x.y=v` overrides (in order)."""
    overrides = [a for a in argv if a.startswith("--config.")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="config file, e.g. configs/r50_32gpu.py (or --study)")
    parser.add_argument("--study", help="a tfscale.study file: a job array with one task per run (cell x seed)")
    parser.add_argument("--array_parallel", type=int, default=0,
                        help="--study: at most this many array tasks at once (0: as many as the queue allows)")
    parser.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    parser.add_argument("--gpus_per_node", type=int, required=True, help="GPUs per node (one task each); 0: CPU-only")
    parser.add_argument("--tasks_per_node", type=int, help="tasks per node; default: gpus_per_node (needed with 0 GPUs)")
    parser.add_argument("--backend", choices=sorted(TEMPLATES), required=True, help="mwms (tf.distribute) or horovod")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="srun-pmix", help="horovod: how ranks start")
    parser.add_argument("--gpu_request", choices=("per_node", "per_task"), default="per_node",
                        help="--gpus-per-node=G (tasks see the node's GPUs; NCCL P2P works) or --gpus-per-task=1")
    parser.add_argument("--cpus_per_task", type=int, help=f"default: {DEFAULT_GPU_CPUS_PER_TASK} with GPUs, 1 without")
    parser.add_argument("--time", default="24:00:00", help="time limit per run (a requeued job gets it again)")
    parser.add_argument("--partition", help="Slurm partition; default: leave the placeholder commented out")
    parser.add_argument("--account", help="Slurm account; default: leave the placeholder commented out")
    parser.add_argument("--job_name", help="default: tfscale-<config name>-<backend>")
    parser.add_argument("--job_output", help="#SBATCH --output (the job's log); default: tfscale-%%x-%%j.out, "
                        "tfscale-%%x-%%A_%%a.out for a study's array")
    parser.add_argument("--signal_lead_s", type=int, default=300,
                        help="SIGTERM this many seconds before the time limit: enough to finish a step and checkpoint")
    parser.add_argument("--workdir", help="run directory on a shared file system; default: <tfscale_dir>/runs/<config name>")
    parser.add_argument("--data_dir", default="",
                        help="TFRecord shards on a shared file system (tfrecord configs need it); '' = the config's")
    parser.add_argument("--stage_dir", default="${TMPDIR:-/tmp}/tfscale_data",
                        help="node-local staging directory (expanded on the node); '' reads data_dir in place")
    parser.add_argument("--modules", default="", help="environment modules to load, e.g. 'openmpi/4.1' (a pip venv "
                        "brings its own CUDA, cuDNN and NCCL: a site's modules of them would shadow the venv's)")
    parser.add_argument("--gloo_iface", default="", help="horovodrun-gloo: network interface (e.g. ib0)")
    parser.add_argument("--program", choices=("train", "benchmark"), default="train",
                        help="what every task runs: tfscale.train, or tfscale.benchmark (its mode from --config.benchmark.mode)")
    parser.add_argument("--doctor", default="", help="'all' or a list of tfscale-doctor checks (e.g. gpus,horovod) "
                        "to run on every node before training; a failed check stops the job. '' skips it")
    parser.add_argument("--tfscale_dir", default=REPO, help="tfscale checkout on the cluster; default: this one")
    parser.add_argument("--venv", default=DEFAULT_VENV, help="Python environment on the cluster; default: this one "
                        "(GPU jobs need a tensorflow[and-cuda] one: make TF_EXTRA=gpu VENV=.venv-gpu venv)")
    parser.add_argument("--output", help="script to write; default: tfscale-<config name>-<backend>-<N>x<T>.sbatch")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    if bool(args.config) == bool(args.study):
        raise UsageError("give either --config (one run) or --study (a job array over the study's runs)")
    return args, overrides


def load_config(path: str, overrides: list[str]):
    """The config file with `--config.x=y` overrides, parsed exactly as `tfscale.train` parses them."""
    from tfscale import config as tfs_config

    try:
        return tfs_config.load_config_file(path, overrides)
    except errors.ConfigError as err:
        raise UsageError(str(err)) from err


# ----------------------------------------------------------------------------------------- checks


def tasks_per_node(args: argparse.Namespace) -> int:
    """One task per GPU; on CPU-only nodes the number asked for."""
    if args.nodes < 1:
        raise UsageError(f"--nodes={args.nodes} must be >= 1")
    if args.gpus_per_node < 0:
        raise UsageError(f"--gpus_per_node={args.gpus_per_node} must be >= 0")
    if args.gpus_per_node == 0:
        if not args.tasks_per_node or args.tasks_per_node < 1:
            raise UsageError("--gpus_per_node=0 (CPU-only) needs --tasks_per_node >= 1")
        return args.tasks_per_node
    if args.tasks_per_node not in (None, args.gpus_per_node):
        raise UsageError(f"--tasks_per_node={args.tasks_per_node} with --gpus_per_node={args.gpus_per_node}: "
                         "tfscale runs one task per GPU, so they must be equal")
    return args.gpus_per_node


def validation_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The overrides the tasks will run with: the user's, plus the backend and data dir the script sets."""
    for override in overrides:
        if override.startswith("--config.distribute.backend="):
            raise UsageError(f"{override}: the backend is chosen with --backend (mwms or horovod)")
    extra = [f"--config.distribute.backend={args.backend}"]
    if args.data_dir:
        extra.append(f"--config.data.data_dir={data_dir_path(args.data_dir)}")
    return [*overrides, *extra]


def data_dir_path(data_dir: str) -> str:
    """--data_dir as the job sees it: absolute, unless it is a URL (gs://...)."""
    return data_dir if "://" in data_dir else os.path.abspath(data_dir)


def check_data_request(cfg, args: argparse.Namespace, overrides: list[str]) -> None:
    """Where the tasks' data comes from, in make_sbatch's terms; checked before `validate`, whose messages
    name config keys, not the make_sbatch options that set them."""
    for override in overrides:
        if override.startswith("--config.data.stage_dir="):
            raise UsageError(f"{override}: the job script stages the data itself; use --stage_dir")
        if args.data_dir and override.startswith("--config.data.data_dir="):
            raise UsageError(f"--data_dir and {override} are both given: --data_dir is staged to --stage_dir on "
                             "every node, --config.data.data_dir is read in place; give one")
    if cfg.data.dataset in FILE_DATASETS and not cfg.data.data_dir:
        raise UsageError(f"{args.config} trains on config.data.dataset={cfg.data.dataset!r}, which needs its "
                         "files: pass --data_dir=DIR (the shards on a file system every node can read; the job "
                         "stages them to --stage_dir on each node first)")
    if args.data_dir and "://" not in args.data_dir and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data_dir={args.data_dir} is not a directory here: make_sbatch checks the data before "
                         "the job queues, so run it where the shared file system is mounted")
    if args.data_dir and args.stage_dir and cfg.data.dataset == "tfds":
        raise UsageError("staging copies TFRecord shards; a TFDS data_dir is read in place: add --stage_dir=''")


def venv_tensorflow(venv: str) -> tuple[str, bool] | None:
    """(TensorFlow's distribution name, whether it is a CUDA build) as installed in `venv`'s own site-packages,
    read from its files (the venv's Python need not run here); None when the venv has no TensorFlow of its own
    (absent here, or TensorFlow from a cluster module through --system-site-packages)."""
    for site in sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))):
        build_info = os.path.join(site, "tensorflow", "python", "platform", "build_info.py")
        if not os.path.isfile(build_info):
            continue
        cpu_wheel = glob.glob(os.path.join(site, "tensorflow_cpu-*.dist-info"))
        with open(build_info) as f:
            cuda_build = "('is_cuda_build', True)" in f.read()
        return ("tensorflow-cpu" if cpu_wheel else "tensorflow"), cuda_build
    return None


def check_venv(args: argparse.Namespace) -> str:
    """A GPU job's --venv must hold a CUDA build of TensorFlow: with tensorflow-cpu every task trains on the CPU
    (~100x slower; the job would stop at start-up, after queueing). Returns what was checked, for the summary."""
    if not args.gpus_per_node:
        return ""
    venv = os.path.abspath(args.venv)
    found = venv_tensorflow(venv)
    if found is None:
        return f"--venv={venv}: no TensorFlow in its site-packages here, not checked"
    name, cuda_build = found
    if not cuda_build:
        given = "" if args.venv != DEFAULT_VENV else " (the default: the Python running make_sbatch)"
        raise UsageError(f"--venv={venv}{given} has {name}, a TensorFlow without CUDA: the job's "
                         f"{args.gpus_per_node} GPUs per node would sit idle while every task trains on the CPU. "
                         "Build a GPU environment (make TF_EXTRA=gpu VENV=.venv-gpu venv, and horovod-gpu for "
                         "--backend=horovod) and pass --venv=.venv-gpu, or --gpus_per_node=0 for a CPU job")
    return f"--venv={venv}: {name} with CUDA"


def check_config(cfg, nodes: int, tasks: int) -> None:
    """tfscale.config.validation.validate, then again for the job's replica count (one replica per task): errors
    about the split name it, the others are the config's alone."""
    try:
        validation.validate(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from err
    replicas = nodes * tasks
    try:
        validation.validate(cfg, num_replicas=replicas)
    except ValueError as err:
        raise UsageError(f"{nodes} nodes x {tasks} tasks = {replicas} replicas: {err}") from err


# ---------------------------------------------------------------------------------------- content


def job_stem(args: argparse.Namespace) -> str:
    """The default job name's and workdir's stem: the config's name, or study_<name> for a study (both PATH[:ARG])."""
    if args.study:
        return "study_" + config_name(args.study)
    return config_name(args.config)


def config_name(path: str) -> str:
    """`configs/r50_32gpu.py` -> r50_32gpu; `configs/r50_32gpu.py:amp` -> r50_32gpu_amp, so that the GPU
    variant's default job name and workdir are not the float32 recipe's."""
    path, _, variant = path.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return f"{name}_{variant}" if variant else name


def sbatch_options(args: argparse.Namespace, tasks: int, num_runs: int = 0) -> dict[str, str | None]:
    """#SBATCH option -> value ("" for a bare flag, None to delete the template's line); `num_runs` > 0:
    a job array with one task per study run."""
    gpus = args.gpus_per_node
    cpus = args.cpus_per_task or (DEFAULT_GPU_CPUS_PER_TASK if gpus else 1)
    options = {
        "job-name": args.job_name or f"tfscale-{job_stem(args)}-{args.backend}",
        "nodes": str(args.nodes),
        "ntasks-per-node": str(tasks),
        "gpus-per-node": str(gpus) if gpus and args.gpu_request == "per_node" else None,
        "gpus-per-task": "1" if gpus and args.gpu_request == "per_task" else None,
        "cpus-per-task": str(cpus),
        "time": args.time,
        "output": args.job_output or ("tfscale-%x-%A_%a.out" if args.study else "tfscale-%x-%j.out"),
        "signal": f"B:TERM@{args.signal_lead_s}",
        "requeue": "",
    }
    if num_runs:
        options["array"] = f"0-{num_runs - 1}" + (f"%{args.array_parallel}" if args.array_parallel else "")
    # Absent: the template's commented-out placeholder line stays as it is.
    if args.partition:
        options["partition"] = args.partition
    if args.account:
        options["account"] = args.account
    return options


def edit_values(args: argparse.Namespace, overrides: list[str]) -> dict[str, str]:
    """EDIT HERE variable -> bash right-hand side (already quoted)."""
    workdir = args.workdir or os.path.join(args.tfscale_dir, "runs", job_stem(args))
    values = {
        "MODULES": double_quote(args.modules),
        "TFSCALE_DIR": double_quote(os.path.abspath(args.tfscale_dir)),
        "VENV": double_quote(os.path.abspath(args.venv)),
        "CONFIG": double_quote(os.path.abspath(args.config)),
        "CONFIG_OVERRIDES": "(" + " ".join(shlex.quote(o) for o in overrides) + ")",
        "WORKDIR": double_quote(os.path.abspath(workdir)),
        "STUDY": double_quote(os.path.abspath(args.study) if args.study else ""),
        "DATA_DIR": double_quote(data_dir_path(args.data_dir) if args.data_dir else ""),
        "STAGE_DIR": double_quote(args.stage_dir),
        "DOCTOR": double_quote(args.doctor),
        "PROGRAM": double_quote(args.program),
    }
    if args.backend == "horovod":
        values["LAUNCHER"] = double_quote(args.launcher)
        values["GLOO_IFACE"] = double_quote(args.gloo_iface)
    return values


def double_quote(value: str) -> str:
    """A bash double-quoted word: $VARIABLES still expand on the node (e.g. $TMPDIR), nothing else does."""
    return '"' + re.sub(r'(["\\`])', r"\\\1", value) + '"'


# -------------------------------------------------------------------------------------- rendering


def render_header(lines: list[str], options: dict[str, str | None]) -> list[str]:
    """The template's lines with its #SBATCH options set/deleted; options it lacks go after its last one."""
    out, seen, last_sbatch = [], set(), -1
    for line in lines:
        match = _SBATCH_LINE.match(line)
        if match and match.group(1) in options:
            key = match.group(1)
            seen.add(key)
            if options[key] is None:
                continue
            line = f"#SBATCH --{key}" + (f"={options[key]}" if options[key] else "")
        if match:
            last_sbatch = len(out)
        out.append(line)
    missing = [f"#SBATCH --{k}" + (f"={v}" if v else "") for k, v in options.items() if k not in seen and v is not None]
    return out[: last_sbatch + 1] + missing + out[last_sbatch + 1:]


def render_edit_block(lines: list[str], values: dict[str, str]) -> list[str]:
    """Sets `NAME=value` in the EDIT HERE block, keeping each line's comment; every NAME must exist there."""
    begin = next(i for i, line in enumerate(lines) if line.startswith(_EDIT_BEGIN) and "EDIT HERE" in line)
    end = next(i for i in range(begin + 1, len(lines)) if lines[i].startswith(_EDIT_END))
    out, found = list(lines), set()
    for i in range(begin + 1, end):
        name, sep, rest = lines[i].partition("=")
        if sep and name in values:
            comment = rest[rest.index("  # "):] if "  # " in rest else ""
            out[i] = f"{name}={values[name]}{comment}"
            found.add(name)
    missing = sorted(set(values) - found)
    if missing:
        raise UsageError(f"the template has no {', '.join(missing)} in its EDIT HERE block: template and tool disagree")
    return out


CPU_JOB_LINE = "# export CUDA_VISIBLE_DEVICES=-1"


def render_cpu_job(lines: list[str]) -> list[str]:
    """A CPU job (--gpus_per_node=0): the template's commented-out CUDA_VISIBLE_DEVICES=-1 export switched on, so that
    a GPU venv on a GPU partition's node trains on the CPU as asked, not refused for the GPUs the job was not given."""
    if not any(line.startswith(CPU_JOB_LINE) for line in lines):
        raise UsageError(f"the template has no '{CPU_JOB_LINE}' line: template and tool disagree")
    return [line[2:] if line.startswith(CPU_JOB_LINE) else line for line in lines]


def render(template: str, options: dict[str, str | None], values: dict[str, str], cpu_job: bool = False) -> str:
    lines = render_edit_block(render_header(template.splitlines(), options), values)
    return "\n".join(render_cpu_job(lines) if cpu_job else lines) + "\n"


def check_bash_syntax(path: str) -> None:
    """`bash -n`: the generated file must at least parse (a quoting slip would only show on the cluster)."""
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    if result.returncode:
        raise UsageError(f"generated {path} does not parse as bash: {result.stderr.strip()}")


# ------------------------------------------------------------------------------------------- main


def study_cells(args: argparse.Namespace) -> tuple[int, list[tuple[str, list[str]]]]:
    """--study: the number of runs, and (cell, overrides of its first seed) to validate; sets args.config to
    the study's. Without --study: no runs, and the single config with no extra overrides."""
    if not args.study:
        return 0, [("", [])]
    from tfscale.study import study as tfs_study

    try:
        study = tfs_study.load_study(args.study)
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from err
    args.config = study["config"]
    counts = {cell.num_workers for cell in tfs_study.cells_of(study)}
    if len(counts) > 1:  # a task's workers are the job's GPUs, the same for every task of the array
        raise UsageError(f"study {args.study}: its cells train with different worker counts ("
                         + ", ".join(f"{c.name}: {c.num_workers}" for c in tfs_study.cells_of(study))
                         + "), and a job array gives every task the same nodes and GPUs: write one job "
                         "array per worker count, from a study file holding only those cells")
    # Each cell validated with its first seed: seeds change no key that validation checks.
    cells = [(cell.name, tfs_study.run_overrides(study, cell, cell.seeds[0])) for cell in tfs_study.cells_of(study)]
    seeds = sorted({len(cell.seeds) for cell in tfs_study.cells_of(study)})
    args.study_shape = (f"{len(cells)} cells x {seeds[0]} seeds" if len(seeds) == 1
                        else f"{len(cells)} cells, {seeds[0]}-{seeds[-1]} seeds each")
    return len(tfs_study.runs_of(study)), cells


def check_doctor(doctor: str) -> None:
    """--doctor is '', 'all' or names of tfscale-doctor's checks."""
    from tfscale.perf.doctor_checks import CHECK_NAMES as check_names  # not doctor itself: it imports TensorFlow

    unknown = [name for name in doctor.split(",") if name and name != "all" and name not in check_names]
    if unknown or ("all" in doctor.split(",") and doctor != "all"):
        raise UsageError(f"--doctor={doctor!r}: use 'all' or checks among {', '.join(check_names)}")


def make_script(argv: list[str]) -> tuple[str, str]:
    """Validates the request (every cell of a study), writes the script; returns (path, one-line summary)."""
    args, overrides = parse_args(argv)
    tasks = tasks_per_node(args)
    check_doctor(args.doctor)
    venv_checked = check_venv(args)
    num_runs, cells = study_cells(args)
    if args.study and any(o.startswith("--config.seed=") for o in overrides):
        raise UsageError("--config.seed with --study: the study file's seeds set each run's seed")
    for cell, cell_overrides in cells:
        try:
            # The job's own overrides come last and win, as in the job script.
            cfg = load_config(args.config, validation_overrides(args, [*cell_overrides, *overrides]))
            check_data_request(cfg, args, [*cell_overrides, *overrides])
            check_config(cfg, args.nodes, tasks)
        except UsageError as err:
            raise UsageError(f"study {args.study}, cell {cell}: {err}" if cell else str(err)) from err
    with open(TEMPLATES[args.backend]) as f:
        text = render(f.read(), sbatch_options(args, tasks, num_runs), edit_values(args, overrides),
                      cpu_job=not args.gpus_per_node)
    path = args.output or f"tfscale-{job_stem(args)}-{args.backend}-{args.nodes}x{tasks}.sbatch"
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    check_bash_syntax(path)
    replicas = args.nodes * tasks
    device = "GPU" if args.gpus_per_node else "CPU task"
    if num_runs:
        summary = (f"a job array of {num_runs} runs ({args.study_shape}), each on "
                   f"{args.nodes} nodes x {tasks} {device}s = {replicas} replicas, backend {args.backend}")
    else:
        summary = (f"{args.nodes} nodes x {tasks} {device}s = {replicas} replicas, "
                   f"{cfg.data.global_batch_size // replicas} images per replica per step "
                   f"(global batch {cfg.data.global_batch_size}), backend {args.backend}")
    return path, summary + (f"; {venv_checked}" if venv_checked else "")


def main(argv: list[str] | None = None) -> int:
    try:
        path, summary = make_script(sys.argv[1:] if argv is None else argv)
    except UsageError as err:
        print(f"make_sbatch: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {summary}")
    print(f"submit with: sbatch {shlex.quote(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
