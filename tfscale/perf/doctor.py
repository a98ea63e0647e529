"""tfscale-doctor: a self-check of a node, one line per check. Run it first on a new cluster.

    tfscale-doctor [--fast] [--only=gpus,horovod] [--data_dir=SHARDS] [--json=PATH]      (python -m tfscale.doctor)
    srun --nodes=N --ntasks-per-node=1 tfscale-doctor --tasks_per_node=4     (slurm/*.sbatch: DOCTOR=all)

Each check prints PASS, FAIL or N/A and why; N/A marks what needs a GPU (or an optional package) that
this node does not have, so on a CPU machine it still runs and lists exactly what a GPU node adds.
The exit code is 1 when a check fails. `--json=PATH` writes the results; `--fast` skips the three
checks that compile ResNet-50 (docs/gpu.md gives the time of each mode).

  gpus            the GPUs TensorFlow sees, the one each local rank pins (tfscale.cluster.devices), and a node
                  whose GPUs TensorFlow cannot see (Slurm or /dev/nvidia* say there are some)
  driver          the NVIDIA driver against the CUDA runtimes of TensorFlow and of the Horovod build
  memory-growth   the GPU memory the process holds after two small allocations, as the CUDA driver reports it
                  (DALI's GPU decoding and NCCL need memory TensorFlow left free)
  all-reduce      a real MultiWorkerMirroredStrategy all-reduce through tfscale's start-up: two worker processes
                  on the node (one GPU each; NCCL), or one per node in a Slurm step of several tasks (DOCTOR=all)
  horovod         built with NCCL / MPI / Gloo (a GPU rank without NCCL copies every gradient to the host), and
                  training's gradient reduction after hvd.init() (a grouped Average of 2 tensors, through the
                  fusion buffer and its scaling kernels), on the GPU where there is one
  xla-step        one XLA-compiled float32 ResNet-50 training step of tfscale's own step
  float16-step    one mixed_float16 ResNet-50 step: finite loss, finite loss scale
  dali            one batch decoded by DALI on the GPU ("mixed"; CPU decoding shown where there is none)
  gpu-bandwidth   training's all-reduce between this node's GPUs (one MWMS worker process per GPU, 64 MiB),
                  timed in-graph as nccl-tests does (busbw = algbw 2(n-1)/n), beside the rate of the slowest
                  link a ring crosses (NVLink or PCIe, from nvidia-smi and sysfs): FAIL below 40%
  throughput      one-GPU synthetic ResNet-50 images/sec beside the figure published for that GPU; with
                  --data_dir, tfscale's input pipeline on one task's share of the CPUs beside it (FAIL below 90%:
                  the input-bound node)

The float32 and float16 steps run on the CPU too, at a small size (they prove XLA and loss scaling
work; their speed means nothing there). Throughput runs only on a GPU.
"""

from __future__ import annotations

from tfscale import logs

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported
logs.import_tensorflow_without_banner()  # a program: TensorFlow without its oneDNN notice

import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from tfscale import cli, errors, io
from tfscale import config as tfs_config
from tfscale.cluster import devices, distribute, driver, horovod_start
from tfscale.perf import collective_probe, gpu_probe
from tfscale.perf.doctor_checks import CHECK_NAMES, FAIL, NA, PASS, SLOW_CHECKS, Check
from tfscale.perf.doctor_speed import check_gpu_bandwidth, check_throughput, gpu_name


CPU_STEP = dict(image_size=64, batch=2)  # the CPU's XLA and float16 steps: the compile is the check
GPU_STEP = dict(image_size=224, batch=64)
GROWTH_PROBE_BYTES = 64 << 20  # two allocations of this size: a growing allocator holds little more than them
MAX_HELD_FRACTION = 0.5  # more of the GPU held than this after them: TensorFlow reserved its pool up front


# --- the checks --------------------------------------------------------------------------------------------


def check_gpus(gpus: list, tasks_per_node: int) -> Check:
    if not gpus:
        problem = devices.hidden_gpus_problem(0, tf.test.is_built_with_cuda(), venv=sys.prefix)
        if problem:
            return Check("gpus", FAIL, problem)
        return Check("gpus", NA, "no GPU on this node (nothing in /dev/nvidia*, no SLURM_GPUS_ON_NODE), or "
                                 "CUDA_VISIBLE_DEVICES hides them")
    names = [gpu_name(g) for g in gpus]
    try:
        pins = [devices.gpu_for_local_rank(len(gpus), rank) for rank in range(tasks_per_node)]
    except errors.ConfigError as err:
        return Check("gpus", FAIL, f"{len(gpus)} GPU(s) for {tasks_per_node} tasks per node: {err}")
    mapping = ", ".join(f"rank {r} -> GPU {0 if p is None else p}" for r, p in enumerate(pins))
    return Check("gpus", PASS, f"{len(gpus)} x {names[0]}{'' if len(set(names)) == 1 else ' (mixed models!)'}; "
                               f"{tasks_per_node} local rank(s): {mapping}")


def check_driver(gpus: list, node_driver: str | None = None, runtimes: dict[str, str] | None = None) -> Check:
    """The node's NVIDIA driver against the CUDA runtimes of TensorFlow and Horovod (`tfscale.cluster.driver`)."""
    node_driver = driver.installed_driver() if node_driver is None else node_driver
    runtimes = cuda_runtimes() if runtimes is None else runtimes
    if not node_driver:
        return Check("driver", NA, "no NVIDIA driver loaded (/proc/driver/nvidia/version)")
    problems = driver.driver_problems(node_driver, runtimes)
    if problems:
        return Check("driver", FAIL, "; ".join(problems) + ": update the driver, or rebuild with `make horovod-gpu` "
                                                          "(docs/horovod.md, 'Which driver')")
    needs = ", ".join(f"{what} CUDA {version}" for what, version in runtimes.items())
    return Check("driver", PASS, f"NVIDIA driver {node_driver} runs {needs or 'no CUDA code here'}")


def cuda_runtimes() -> dict[str, str]:
    """{what: CUDA version} of the CUDA code in this environment: TensorFlow's wheel, Horovod's build record."""
    runtimes = {}
    tf_cuda = tf.sysconfig.get_build_info().get("cuda_version", "")
    if tf_cuda:
        runtimes[f"TensorFlow {tf.__version__}"] = tf_cuda
    spec = importlib.util.find_spec("horovod")
    if spec and spec.submodule_search_locations:
        record = driver.horovod_build_record(list(spec.submodule_search_locations)[0])
        if record.get("cuda_runtime"):
            runtimes[f"Horovod {record.get('horovod', '')}".strip()] = record["cuda_runtime"]
    return runtimes


def memory_growth_verdict(gpu: int, free_bytes: int, total_bytes: int) -> Check:
    """The driver's free memory on `gpu` after two small allocations: reserved up front or grown as needed."""
    held = total_bytes - free_bytes
    detail = f"GPU {gpu}: the process holds {held / 2**30:.2f} of {total_bytes / 2**30:.1f} GiB after two " \
             f"{GROWTH_PROBE_BYTES >> 20} MiB allocations"
    if held > MAX_HELD_FRACTION * total_bytes:
        return Check("memory-growth", FAIL, f"{detail}: TensorFlow reserved the GPU's memory up front (memory growth "
                                            "is off), so DALI's decoder and NCCL's buffers would run out of memory")
    return Check("memory-growth", PASS, f"{detail}: TensorFlow allocates as it goes")


def check_memory_growth(gpus: list) -> Check:
    if not gpus:
        return Check("memory-growth", NA, "needs a GPU")
    with tf.device("/gpu:0"):  # the first creates TensorFlow's allocator, the second grows it
        tensors = [tf.ones([GROWTH_PROBE_BYTES // 4]) for _ in range(2)]
    [t.numpy()[:1] for t in tensors]
    free, total = gpu_probe.gpu_memory_bytes(0)
    return memory_growth_verdict(0, free, total)


def check_all_reduce(gpus: list, configured: str, port_base: int = 0) -> Check:
    """A real MultiWorkerMirroredStrategy all-reduce through tfscale's start-up path: two worker processes on
    this node (one GPU each), or, in a Slurm step of several tasks (DOCTOR=all), one worker per task, across
    the nodes, on the ports training derives for a step."""
    chosen = devices.collective_implementation(configured, len(gpus))
    tasks = collective_probe.in_multi_task_step()
    if tasks:
        where, envs = f"across the {tasks} tasks of this Slurm step", [dict(os.environ)]
    else:
        where, envs = "between 2 processes on this node", collective_probe.local_mwms_envs(len(gpus), port_base)
    results = collective_probe.run_probes(envs, "mwms", configured)
    failed = [f"worker {i}: {r.detail}" for i, r in enumerate(results) if not r.ok]
    if failed:
        return Check("all-reduce", FAIL, f"MWMS all-reduce {where} failed: " + "; ".join(failed))
    return all_reduce_verdict(where, results[0].detail, configured, chosen, results[0].implementation, len(gpus),
                              bool(tasks))


def all_reduce_verdict(where: str, detail: str, configured: str, chosen: str, ran: str, num_gpus: int,
                       in_step: bool) -> Check:
    """PASS when workers with GPUs ran NCCL: what the live strategy ran (`ran`, from the probe), not what the
    config asked for (`chosen`), which decides nothing at run time."""
    note = "" if num_gpus else " (no GPU: TensorFlow's rings; NCCL needs one)"
    single_gpu = num_gpus == 1 and not in_step
    if single_gpu:
        note = " (one GPU cannot serve two NCCL ranks: both ran on the CPU)"
    status = PASS if ran == "NCCL" or not num_gpus or single_gpu else FAIL
    if status == FAIL:
        note = (f": GPU workers ran {ran or 'an unknown implementation'}, not NCCL (their gradients would go through "
                "host memory)")
    return Check("all-reduce", status, f"{where}: {detail}; collective_impl={configured} -> {chosen}{note}")


def check_horovod(gpus: list) -> Check:
    try:
        hvd = horovod_start.import_horovod()
    except ImportError as err:
        if importlib.util.find_spec("horovod") is None:
            return Check("horovod", NA, "Horovod is not installed (optional: `make horovod`; `make horovod-gpu` "
                                        "builds it with NCCL)")
        return Check("horovod", FAIL, errors.one_line(err))  # installed, but it does not load into this TensorFlow
    built = [name for name, flag in (("NCCL", hvd.nccl_built()), ("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()))
             if flag]
    detail = f"Horovod {importlib.metadata.version('horovod')} built with {', '.join(built) or 'nothing'}"
    problem = devices.horovod_host_copy_warning(len(gpus), hvd.nccl_built())
    if problem:
        return Check("horovod", FAIL, f"{detail}: {problem}")
    # Training's own grouped Average after hvd.init(), on the GPU where there is one: where a build's CUDA runtime
    # that the driver refuses, a broken NCCL, or the fusion buffer's kernels (which one tensor summed never
    # launches) fail, shows (the process aborts).
    ((ok, probe_detail, _, _),) = collective_probe.run_probes([collective_probe.horovod_env()], "horovod")
    if not ok:
        return Check("horovod", FAIL, f"{detail}, but training's grouped all-reduce after hvd.init() failed: "
                                      f"{probe_detail}")
    detail += f"; {probe_detail}"
    missing_nccl = not gpus and not hvd.nccl_built()
    return Check("horovod", PASS, detail + (" (NCCL matters on GPU nodes: `make horovod-gpu`)" if missing_nccl else ""))


def check_xla_step(cluster, gpus: list) -> Check:
    size = GPU_STEP if gpus else CPU_STEP
    result = gpu_probe.resnet50_steps(cluster, "float32", size["image_size"], size["batch"], num_steps=1)
    where = f"{len(gpus) and 'GPU' or 'CPU'}, batch {size['batch']} at {size['image_size']} px"
    if not np.isfinite(result["losses"][0]):
        return Check("xla-step", FAIL, f"loss {result['losses'][0]} ({where})")
    return Check("xla-step", PASS, f"compiled and ran in {result['first_step_s']:.1f} s, loss {result['losses'][0]:.3f} "
                                   f"({where})")


def check_float16_step(cluster, gpus: list) -> Check:
    size = GPU_STEP if gpus else CPU_STEP
    result = gpu_probe.resnet50_steps(cluster, "mixed_float16", size["image_size"], size["batch"], num_steps=2)
    loss, scale = result["losses"][-1], result["loss_scale"]
    detail = f"loss {loss:.3f}, loss scale {scale:g} ({len(gpus) and 'GPU' or 'CPU'}, batch {size['batch']})"
    ok = np.isfinite(loss) and scale is not None and np.isfinite(scale) and scale >= 1
    return Check("float16-step", PASS if ok else FAIL, detail)


def check_dali(gpus: list) -> Check:
    try:
        import nvidia.dali as dali
    except ImportError:
        return Check("dali", NA, "NVIDIA DALI is not installed (optional: `make dali`)")
    if not gpus:
        shape = gpu_probe.dali_decode_batch("cpu", None)
        return Check("dali", NA, f"GPU decoding needs a GPU (DALI {dali.__version__} decoded a batch {shape} on the CPU, "
                                 "read through its TensorFlow plugin)")
    shape = gpu_probe.dali_decode_batch("mixed", 0)
    return Check("dali", PASS, f"DALI {dali.__version__} decoded a batch {shape} on GPU 0 (nvJPEG), read through its "
                               "TensorFlow plugin")


# --- running them --------------------------------------------------------------------------------------------


def run_checks(tasks_per_node: int = 0, collective_impl: str = "AUTO", only: list[str] | None = None,
               fast: bool = False, port_base: int = 0, data_dir: str = "") -> list[Check]:
    """The checks (all, or those named in `only`; `fast` leaves out SLOW_CHECKS), in order; one that raises is a
    FAIL naming the error, and the others still run."""
    steps: list[tuple[str, Callable[[], Check]]] = [  # called after the set-up below
        ("gpus", lambda: check_gpus(gpus, tasks_per_node or max(1, len(gpus)))),
        ("driver", lambda: check_driver(gpus)),
        ("memory-growth", lambda: check_memory_growth(gpus)),
        ("all-reduce", lambda: check_all_reduce(gpus, collective_impl, port_base)),
        ("horovod", lambda: check_horovod(gpus)),
        ("xla-step", lambda: check_xla_step(cluster, gpus)),
        ("float16-step", lambda: check_float16_step(cluster, gpus)),
        ("dali", lambda: check_dali(gpus)),
        ("gpu-bandwidth", lambda: check_gpu_bandwidth(gpus, port_base)),
        ("throughput", lambda: check_throughput(cluster, gpus, data_dir, tasks_per_node or 1)),
    ]
    assert tuple(name for name, _ in steps) == CHECK_NAMES
    unknown = set(only or ()) - set(CHECK_NAMES)
    if unknown:
        raise app.UsageError(f"--only: no check named {', '.join(sorted(unknown))} (checks: {', '.join(CHECK_NAMES)})")
    # one_device: memory growth on, first; a node whose GPUs TensorFlow cannot see is the gpus check's finding
    cluster = distribute.setup(tfs_config.base_config().distribute, allow_hidden_gpus=True)
    gpus = tf.config.list_physical_devices("GPU")
    checks = []
    for name, run in steps:
        if (only and name not in only) or (fast and name in SLOW_CHECKS):
            continue
        try:
            check = run()
        except Exception as err:  # noqa: BLE001 - a check that crashes is the finding
            check = Check(name, FAIL, f"{type(err).__name__}: {errors.one_line(err)[:400]}")
        print(check.line(), flush=True)
        checks.append(check)
    return checks


def summary_line(checks: list[Check]) -> str:
    counts = {status: sum(c.status == status for c in checks) for status in (PASS, FAIL, NA)}
    line = f"summary: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[NA]} n/a"
    not_applicable = [c.name for c in checks if c.status == NA]
    return line + (f" ({', '.join(not_applicable)})" if not_applicable else "")


# Distributions named in the first line: which TensorFlow wheel (tensorflow-cpu on a GPU node is a finding).
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "keras", "horovod", "nvidia-dali-cuda120", "nvidia-nccl-cu12")


def versions_line() -> str:
    found = []
    for name in _DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"Python {sys.version.split()[0]}, " + ", ".join(found)


def _define_flags() -> None:
    flags.DEFINE_integer("tasks_per_node", 0, "Training tasks per node to map to GPUs (0: one per GPU).")
    flags.DEFINE_string("collective_impl", "AUTO", "config.distribute.collective_impl to resolve.")
    flags.DEFINE_string("json", "", "Also write the results to this JSON file.")
    flags.DEFINE_list("only", [], "Run only these checks (comma-separated names; default: all).")
    flags.DEFINE_integer("port_base", 0, "The all-reduce check's two worker ports on this node: port_base and the "
                         "next one, gpu-bandwidth's the ones after them (0: free ports; in a Slurm step, the "
                         "all-reduce check takes the step's own, as training derives them).")
    flags.DEFINE_string("data_dir", "", "TFRecord shards of the training data: throughput also times tfscale's input "
                        "pipeline on one task's share of the CPUs, and fails when it cannot feed the GPU.")
    flags.DEFINE_bool("fast", False, f"Skip the checks that compile ResNet-50 ({', '.join(SLOW_CHECKS)}).")


def _doctor(f: flags.FlagValues) -> None:
    logs.configure()
    logging.set_verbosity(logging.WARNING)  # one line per check; tfscale's INFO lines would bury them
    print(f"tfscale-doctor on {os.uname().nodename}: {versions_line()}", flush=True)
    checks = run_checks(f.tasks_per_node, f.collective_impl, f.only, f.fast, f.port_base, f.data_dir)
    print(summary_line(checks), flush=True)
    if f.json:
        io.write_json(f.json, {"host": os.uname().nodename, "checks": [dataclasses.asdict(c) for c in checks]})
    sys.exit(1 if any(c.status == FAIL for c in checks) else 0)


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-doctor` and `python -m tfscale.perf.doctor`."""
    cli.run_tool(_doctor, define_flags=_define_flags, errors=(), argv=argv)


if __name__ == "__main__":
    run()
