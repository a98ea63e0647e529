"""What a worker process does with the GPUs and CPU cores it is given.

Each decision is a plain function of what the process sees (how many GPUs, its local rank, the
Slurm environment, its CPU affinity), so the tests hand it device lists that tfscale's CPU-only CI
never has; `prepare_gpus` applies them through `tf.config` and `distribute.setup` calls it before any
strategy exists. Importing this module does not import TensorFlow (the launcher and the converter
use `usable_cores`).

The GPU behaviour each decision relies on, read in the installed TensorFlow 2.21 sources (docs/gpu.md
lists what only a GPU run can prove):
  * memory growth: TensorFlow's BFC allocator reserves nearly all of a GPU's memory when the device is
    created, unless `set_memory_growth` was called first; DALI's GPU decoding and NCCL's buffers
    allocate outside it and then fail (DALI's docs warn of exactly this).
  * NCCL under MultiWorkerMirroredStrategy: `CommunicationImplementation.AUTO` becomes the collective's
    `communication_hint` "auto" (tensorflow/python/distribute/cross_device_utils.py:378), and the
    resolver takes NCCL only for the hint "nccl" or `collective_nccl` in the ConfigProto, which MWMS
    sets only for NCCL (core/common_runtime/collective_param_resolver_local.cc
    AssignCollectiveType; python/distribute/collective_all_reduce_strategy.py:880-885). AUTO on GPUs
    is therefore gRPC rings with GPU-host copies.
  * thread pools: TensorFlow, tf.data and DALI size their pools from the CPU affinity mask, which is
    the whole node where Slurm does not bind tasks to cores.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from absl import logging

from tfscale.errors import ConfigError

# `distribute.collective_impl` values; AUTO is resolved here, per worker.
COLLECTIVE_IMPLEMENTATIONS = ("AUTO", "NCCL", "RING")


def gpu_for_local_rank(num_gpus: int, local_rank: int, host: str = "") -> int | None:
    """The index (among the visible GPUs) of the one GPU a worker process keeps; None keeps what it sees.

    One visible GPU is the scheduler's choice (Slurm's --gpus-per-task, CUDA_VISIBLE_DEVICES); none
    means a CPU run. With several, worker `local_rank` of its host takes GPU `local_rank`: a local
    rank past the last GPU means more worker processes than GPUs on this host, and two of them would
    share one (NCCL then fails with "Duplicate GPU detected", after minutes of start-up).
    """
    if num_gpus <= 1:
        return None
    if not 0 <= local_rank < num_gpus:
        where = f"host {host}" if host else "this host"
        raise ConfigError(
            f"worker with local rank {local_rank} on {where}, which shows {num_gpus} GPUs to each worker (0-{num_gpus - 1}): "
            f"more worker processes than GPUs on the node, so two would share a GPU. Start at most {num_gpus} tasks "
            f"per node (sbatch --ntasks-per-node={num_gpus} with --gpus-per-node={num_gpus}; "
            f"tfscale.launch --num_workers <= {num_gpus})"
        )
    return local_rank


def collective_implementation(configured: str, num_gpus: int) -> str:
    """The `CommunicationImplementation` name MWMS is built with: AUTO means NCCL on a worker with a GPU.

    TensorFlow's own AUTO does not pick NCCL (module docstring). Without a GPU, AUTO stays AUTO (rings
    on the CPU; TensorFlow warns when NCCL is asked for without a GPU). RING and NCCL are kept as
    given: a user may rule NCCL out on purpose.
    """
    if configured not in COLLECTIVE_IMPLEMENTATIONS:
        raise ConfigError(f"config.distribute.collective_impl={configured!r} is not one of: "
                          f"{', '.join(COLLECTIVE_IMPLEMENTATIONS)}")
    if configured == "AUTO" and num_gpus > 0:
        return "NCCL"
    return configured


def communication_hint(implementation: str) -> str:
    """The `communication_hint` of TensorFlow's collective ops for an implementation name ("nccl", ...)."""
    return implementation.lower()


def horovod_host_copy_warning(num_gpus: int, nccl_built: Any) -> str | None:
    """What to warn when this rank has a GPU and Horovod cannot all-reduce on it (`hvd.nccl_built()`)."""
    if num_gpus == 0 or nccl_built:
        return None
    return ("this rank has a GPU but Horovod was built without NCCL (hvd.nccl_built() is false): every gradient "
            "all-reduce is copied to host memory and reduced by MPI/Gloo on the CPU, several times slower. Rebuild "
            "it with `make horovod-gpu` (HOROVOD_GPU_OPERATIONS=NCCL; docs/horovod.md)")


# --- GPUs the node has that TensorFlow does not see ----------------------------------------------------

# CUDA_VISIBLE_DEVICES values that hide every GPU on purpose: a CPU run on a GPU node is then the user's choice.
CPU_ON_PURPOSE = ("", "-1")


NVIDIA_MAJOR = 195  # the NVIDIA driver's character device major: /dev/nvidiaN is 195:N (195:255 is nvidiactl)


def node_gpu_evidence(env: Mapping[str, str] | None = None, dev_dir: str = "/dev", proc: str = "/proc",
                      cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(GPUs this task was given, what says so) whatever TensorFlow sees; (0, "") when nothing does.

    Slurm's GPU variables first (SLURM_GPUS_ON_NODE, set with --gpus*/--gres=gpu; SLURM_JOB_GPUS), then
    CUDA_VISIBLE_DEVICES naming devices. Outside a Slurm job, the NVIDIA driver's device files (/dev/nvidia0, ...;
    /dev/nvidiactl and /dev/nvidia-uvm are not GPUs). Inside one those files exist on every GPU node whatever the
    job asked for, so a job counts them only where its device cgroup grants them (cgroup v1's devices.list). A
    job that asked for no GPU on a GPU partition has none. `dev_dir`, `proc`, `cgroup_root`: a node's, for tests.
    """
    env = os.environ if env is None else env
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        count = env.get(key, "")
        if count.isdigit() and int(count) > 0:
            return int(count), f"{key}={count}"
    for key in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        if env.get(key, "").strip():
            return len(env[key].split(",")), f"{key}={env[key]}"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible not in CPU_ON_PURPOSE:
        return len(visible.split(",")), f"CUDA_VISIBLE_DEVICES={visible}"
    try:
        names = sorted(n for n in os.listdir(dev_dir) if n.startswith("nvidia") and n[len("nvidia"):].isdigit())
    except OSError:
        return 0, ""
    if "SLURM_JOB_ID" in env:
        granted = cgroup_granted_gpus(proc, cgroup_root)
        names = [n for n in names if int(n[len("nvidia"):]) in granted]
        if not names:
            return 0, ""
        shown = ", ".join(os.path.join(dev_dir, n) for n in names)
        return len(names), f"the job's device cgroup grants {shown}"
    if not names:
        return 0, ""
    shown = os.path.join(dev_dir, names[0]) + (f" .. {names[-1]}" if len(names) > 1 else "")
    return len(names), f"{len(names)} NVIDIA device file(s), {shown}"


def cgroup_granted_gpus(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> set[int]:
    """The /dev/nvidiaN minors this process's cgroup v1 device controller grants by name ("c 195:N rwm"); an empty
    set where it grants every device ("a *:* rwm", a site not constraining devices), or cannot be read (cgroup v2
    keeps the rules in eBPF)."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.split(":", 2)[1] == "devices")
        with open(os.path.join(cgroup_root, "devices", path.lstrip("/"), "devices.list")) as f:
            rules = f.read().split("\n")
    except (OSError, StopIteration, IndexError):
        return set()
    granted = set()
    for rule in rules:
        kind, _, rest = rule.partition(" ")
        device = rest.split(" ")[0]
        major, _, minor = device.partition(":")
        if kind == "c" and major == str(NVIDIA_MAJOR) and minor.isdigit() and int(minor) < 255:
            granted.add(int(minor))
    return granted


def hidden_gpus_problem(num_seen: int, cuda_build: bool, env: Mapping[str, str] | None = None,
                        dev_dir: str = "/dev", venv: str = "") -> str | None:
    """Why a task must not start when the node has GPUs and TensorFlow sees none (None: nothing wrong).

    Training on 32 CPUs instead of 32 GPUs runs ~100x slower and says nothing: TensorFlow's one warning
    goes to the C++ log that the sbatch templates quiet. CUDA_VISIBLE_DEVICES="" or -1 hides the GPUs
    on purpose and is respected. `cuda_build` is tf.test.is_built_with_cuda(); `venv` the environment's
    prefix, named in the message.
    """
    env = os.environ if env is None else env
    if num_seen or env.get("CUDA_VISIBLE_DEVICES", None) in CPU_ON_PURPOSE:
        return None
    expected, evidence = node_gpu_evidence(env, dev_dir)
    if not expected:
        return None
    where = f"the Python environment {venv}" if venv else "this Python environment"
    if not cuda_build:
        why = (f"{where} has a TensorFlow built without CUDA (tensorflow-cpu, e.g. the venv of `make demo` or "
               "`make test`). Point the job at a GPU environment: `make TF_EXTRA=gpu VENV=.venv-gpu venv` "
               "(+ horovod-gpu), and VENV=.venv-gpu in the job script (tools/make_sbatch.py --venv)")
    else:
        visible = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
        why = (f"{where} has TensorFlow with CUDA, but CUDA or the NVIDIA driver did not load (run with "
               f"TF_CPP_MIN_LOG_LEVEL=0 to see TensorFlow's reason; check the CUDA module and the driver; "
               f"CUDA_VISIBLE_DEVICES={visible})")
    return (f"the node has {expected} GPU(s) ({evidence}) but TensorFlow sees none: {why}. Training on the CPU "
            "instead would be ~100x slower; to do it on purpose, set CUDA_VISIBLE_DEVICES=-1")


# cuDNN and NCCL, whose pip wheels (nvidia-cudnn-cu12, nvidia-nccl-cu12) TensorFlow finds through its RUNPATH, which
# LD_LIBRARY_PATH beats: a site's `module load cudnn nccl` puts other builds first.
CUDA_LIBRARIES = ("libcudnn", "libnccl")


def foreign_cuda_libraries(env: Mapping[str, str], maps: str, prefix: str) -> list[str]:
    """cuDNN or NCCL from outside the Python environment at `prefix`: "PATH (loaded)" for a library this process
    has mapped (`maps`: /proc/self/maps), "PATH (on LD_LIBRARY_PATH)" for one the loader would find first."""
    inside = os.path.realpath(prefix) + os.sep
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith(CUDA_LIBRARIES) and not os.path.realpath(path).startswith(inside):
            found.append(f"{path} (loaded)")
    for directory in env.get("LD_LIBRARY_PATH", "").split(":"):
        if not directory or os.path.realpath(directory).startswith(inside):
            continue
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith(CUDA_LIBRARIES) and ".so" in n)
        except OSError:
            continue
        found += [f"{os.path.join(directory, n)} (on LD_LIBRARY_PATH)" for n in names]
    return list(dict.fromkeys(found))


def foreign_cuda_warning(env: Mapping[str, str] | None = None, maps_path: str = "/proc/self/maps",
                         prefix: str = sys.prefix) -> str | None:
    """The start-up warning of a CUDA build when `foreign_cuda_libraries` finds any (None: the venv's own only)."""
    env = os.environ if env is None else env
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        maps = ""
    found = foreign_cuda_libraries(env, maps, prefix)
    if not found:
        return None
    return (f"cuDNN/NCCL from outside the Python environment {prefix}: {', '.join(found[:4])}"
            f"{f' and {len(found) - 4} more' if len(found) > 4 else ''}. LD_LIBRARY_PATH beats the pip wheels' "
            "RUNPATH, so TensorFlow may load a cuDNN older than it was built with, or skip the GPUs: with a pip venv "
            "load no cuda/cudnn/nccl module (the job script's MODULES: MPI only)")


def require_visible_gpus(env: Mapping[str, str] | None = None) -> None:
    """Raises ConfigError (`hidden_gpus_problem`) before a worker connects anywhere: what TensorFlow sees. A CUDA
    build also warns of cuDNN or NCCL from outside the environment (`foreign_cuda_warning`)."""
    import tensorflow as tf

    num_seen = len(tf.config.list_physical_devices("GPU"))
    problem = hidden_gpus_problem(num_seen, tf.test.is_built_with_cuda(), env, venv=sys.prefix)
    if problem:
        raise ConfigError(problem)
    foreign = foreign_cuda_warning(env) if tf.test.is_built_with_cuda() else None
    if foreign:
        logging.warning("%s", foreign)


def prepare_gpus(local_rank: int | None, host: str = "", api: Any = None) -> list:
    """Keeps this worker's GPU (`local_rank` given and several visible), then turns memory growth on.

    Must run before TensorFlow creates its GPU devices, i.e. before any strategy or op: `distribute.setup`
    calls it first, for every backend. Returns the GPUs this process keeps. `api` is `tf.config` (tests
    pass an object with the same three calls and GPUs this machine does not have).
    """
    if api is None:
        import tensorflow as tf

        api = tf.config
    gpus = list(api.list_physical_devices("GPU"))
    keep = None if local_rank is None else gpu_for_local_rank(len(gpus), local_rank, host)
    try:
        if keep is not None:
            api.set_visible_devices(gpus[keep], "GPU")
            gpus = [gpus[keep]]
        for gpu in gpus:
            api.experimental.set_memory_growth(gpu, True)
    except RuntimeError as err:  # "Physical devices cannot be modified after being initialized"
        raise RuntimeError(f"GPU settings must be made before TensorFlow initialises its devices ({err}): call "
                           "distribute.setup() before running any TensorFlow op") from err
    return gpus


# --- CPU cores -------------------------------------------------------------------------------------------


def affinity_cores() -> int:
    """Cores in this process's CPU affinity mask (Slurm's binding, taskset), else os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cores(env: Mapping[str, str] | None = None, affinity: int | None = None) -> int:
    """Cores this process's own thread pools (tf.data, DALI, the converter) should size themselves to.

    The affinity mask, capped by SLURM_CPUS_PER_TASK in a Slurm job: where the site does not bind
    tasks to cores (no --cpu-bind, TaskPlugin without affinity), every task's mask is the whole node
    and G tasks per node would each start threads for all of it.
    """
    env = os.environ if env is None else env
    affinity = affinity_cores() if affinity is None else affinity
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        return min(affinity, int(per_task))
    return affinity


def describe_cores(env: Mapping[str, str] | None = None, affinity: int | None = None) -> str:
    """The cores of `usable_cores` for the topology line, saying when Slurm left the task unbound."""
    affinity = affinity_cores() if affinity is None else affinity
    cores = usable_cores(env, affinity)
    if cores < affinity:
        return f"{cores} (SLURM_CPUS_PER_TASK; the task is not bound to cores and sees {affinity}: srun --cpu-bind=cores)"
    return str(cores)


def input_thread_cap(env: Mapping[str, str] | None = None, affinity: int | None = None) -> int | None:
    """The thread count to impose on tf.data (`usable_cores`) when it is below the affinity mask, else None."""
    affinity = affinity_cores() if affinity is None else affinity
    cores = usable_cores(env, affinity)
    return cores if cores < affinity else None
