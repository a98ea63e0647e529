"""Which CPU cores each task of a node should run on: those of its GPU's NUMA node.

    python -m tfscale.cluster.topology --tasks_per_node=8      (slurm/*.sbatch: the training step's --cpu-bind)

tfscale gives local rank k the k-th GPU it sees (tfscale.cluster.devices). Slurm's `--cpu-bind=cores` places
a task's cores by its own distribution, by default alternating sockets between consecutive tasks
(block:cyclic), which ignores where GPU k is attached: on a two-socket node about half the ranks would run
their input and NCCL threads on the socket far from their GPU. Slurm's own NUMA binding (`map_ldom`) is no
way out: for a step that does not hold the whole node (the templates' 4-8 tasks of 8 CPUs on nodes of 48-256
hardware threads) slurmd refuses to launch it ("Entire node must be allocated for map_ldom", SchedMD/slurm
src/plugins/task/affinity/dist_tasks.c, lllp_distribution: every explicit binding but none, map_cpu and
mask_cpu needs whole_nodes), and since Slurm 22.05 `srun --cpus-per-task` implies `--exact`.

So on a node of several NUMA nodes the command prints `none`, and the templates export
TFSCALE_CPU_BIND=gpu-numa: with `--cpu-bind=none` slurmd binds every task to the step's CPUs on its node
(the same lllp_distribution: a partial node's `none` becomes a mask of the allocated CPUs), and each task, at
start and before TensorFlow sizes its thread pools, narrows its own mask (`bind_task`): to the CPUs of its
GPU's NUMA node among those, shared out between the tasks whose GPUs hang off that node, read from its own
node's sysfs. One NUMA node, no GPU or no topology: `cores`, Slurm's cores of its own per task.

GPU order is CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID, which the sbatch templates export: PCI bus order,
as nvidia-smi and sysfs list them (CUDA's default, fastest first, matches it only for identical GPUs).
The job's GPUs are SLURM_JOB_GPUS (device minor numbers, /dev/nvidiaN), mapped to PCI addresses through the
driver's /proc/driver/nvidia/gpus/*/information. The standard library only: no TensorFlow here.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Mapping

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # PCI display controller classes: VGA (workstations), 3D (data-centre GPUs)


def read_text(path: str) -> str:
    """A sysfs or procfs file's text, stripped; "" where it is missing or unreadable."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def nvidia_gpus(sysfs: str = "/sys") -> list[tuple[str, int]]:
    """(PCI address, NUMA node) of every NVIDIA GPU, in PCI bus order; NUMA node -1 where the kernel has none."""
    found = []
    for device in sorted(glob.glob(os.path.join(sysfs, "bus", "pci", "devices", "*"))):
        if read_text(os.path.join(device, "vendor")) != NVIDIA_VENDOR:
            continue
        if not read_text(os.path.join(device, "class")).startswith(GPU_CLASSES):
            continue  # the GPU's audio function, NVSwitches and bridges share the vendor id
        numa = read_text(os.path.join(device, "numa_node"))
        found.append((os.path.basename(device), int(numa) if numa.lstrip("-").isdigit() else -1))
    return found


def device_minors(proc: str = "/proc") -> dict[int, str]:
    """Device minor number (/dev/nvidiaN) -> PCI address, as the NVIDIA driver reports them; {} without it."""
    minors = {}
    for info in glob.glob(os.path.join(proc, "driver", "nvidia", "gpus", "*", "information")):
        for line in read_text(info).splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Device Minor" and value.strip().isdigit():
                minors[int(value)] = os.path.basename(os.path.dirname(info)).lower()
    return minors


def job_gpu_numa_nodes(env: Mapping[str, str] | None = None, sysfs: str = "/sys", proc: str = "/proc") -> list[int]:
    """The NUMA node of each GPU this job has on the node, in the order its tasks see them (local rank k -> k)."""
    env = os.environ if env is None else env
    gpus = nvidia_gpus(sysfs)
    job = env.get("SLURM_JOB_GPUS", "") or env.get("SLURM_STEP_GPUS", "")
    if not job:
        return [numa for _, numa in gpus]
    numa_of = dict(gpus)
    minors = device_minors(proc) or {i: address for i, (address, _) in enumerate(gpus)}  # minors follow PCI order
    addresses = [minors.get(int(m)) for m in job.split(",") if m.strip().isdigit()]
    if None in addresses:
        return []  # a GPU Slurm names that the driver does not: nothing to decide from
    return [numa_of.get(address, -1) for address in sorted(addresses)]  # CUDA_DEVICE_ORDER=PCI_BUS_ID


def numa_node_count(sysfs: str = "/sys") -> int:
    """NUMA nodes the kernel shows (/sys/devices/system/node/nodeN); 1 where it shows none."""
    return max(1, len(glob.glob(os.path.join(sysfs, "devices", "system", "node", "node[0-9]*"))))


SELF_BIND_ENV = "TFSCALE_CPU_BIND"  # "gpu-numa": each task binds itself at start (bind_task); the templates set it
SELF_BIND = "gpu-numa"
ROOT_ENV = "TFSCALE_TOPOLOGY_ROOT"  # where a task reads sys/ and proc/ (default /): a copy of a node's, for tests


def cpu_bind(numa_nodes: list[int], tasks_per_node: int, node_numa_nodes: int) -> tuple[str, str]:
    """(srun --cpu-bind value, why) for `tasks_per_node` tasks, task k using GPU k of `numa_nodes`, on a node
    with `node_numa_nodes` NUMA nodes. "none": the tasks bind themselves near their GPUs (`bind_task`)."""
    if node_numa_nodes < 2:
        return "cores", "one NUMA node: each task on cores of its own"
    if tasks_per_node < 1 or not numa_nodes:
        return "cores", "no GPU found in sysfs: each task on cores of its own"
    if tasks_per_node > len(numa_nodes):
        return "cores", f"{tasks_per_node} tasks for {len(numa_nodes)} GPUs: tfscale refuses that at start-up"
    mine = numa_nodes[:tasks_per_node]
    if min(mine) < 0:
        return "cores", "the kernel reports no NUMA node for the GPUs: each task on cores of its own"
    listed = ", ".join(f"GPU {k} -> NUMA {n}" for k, n in enumerate(mine))
    return "none", f"each task binds itself to its GPU's NUMA node at start, {SELF_BIND_ENV}={SELF_BIND} ({listed})"


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" (sysfs cpulist) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    return cpus


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    runs, cpus = [], sorted(cpus)
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_cpus(sysfs: str = "/sys") -> dict[int, list[int]]:
    """NUMA node -> its CPUs (/sys/devices/system/node/nodeN/cpulist)."""
    found = {}
    for node in glob.glob(os.path.join(sysfs, "devices", "system", "node", "node[0-9]*")):
        found[int(os.path.basename(node)[4:])] = parse_cpu_list(read_text(os.path.join(node, "cpulist")))
    return found


def task_cpus(allowed, gpu_numa: list[int], cpus_of_node: dict[int, list[int]], local_rank: int,
              local_tasks: int, cpus_per_task: int = 0) -> tuple[list[int], str]:
    """(the CPUs of local rank `local_rank`, why): of `allowed` (the step's CPUs on this node), those of its GPU's
    NUMA node, shared out in contiguous runs between the local tasks whose GPUs hang off that node (at most
    `cpus_per_task` each, 0: no cap). Where the step has fewer CPUs on that node than tasks using it: the step's
    CPUs shared out between all local tasks, which is what `--cpu-bind=cores` would give."""
    allowed = sorted(allowed)
    node = gpu_numa[local_rank] if 0 <= local_rank < len(gpu_numa) else -1
    near = [cpu for cpu in allowed if cpu in set(cpus_of_node.get(node, ()))]
    peers = [rank for rank in range(local_tasks) if rank < len(gpu_numa) and gpu_numa[rank] == node]
    if node >= 0 and local_rank in peers and len(near) >= len(peers):
        chunk = _share(near, len(peers), peers.index(local_rank), cpus_per_task)
        return chunk, f"GPU {local_rank}'s NUMA node {node}: {len(near)} of the step's CPUs there, for {len(peers)} task(s)"
    chunk = _share(allowed, local_tasks, local_rank, cpus_per_task)
    where = f"NUMA node {node} has {len(near)} of the step's CPUs" if node >= 0 else "no NUMA node known for its GPU"
    return chunk, f"{where}: a share of the step's {len(allowed)} CPUs instead"


def _share(cpus: list[int], parts: int, index: int, cap: int) -> list[int]:
    """Part `index` of `cpus` cut into `parts` contiguous runs of near-equal length, its first `cap` (0: all)."""
    start, stop = len(cpus) * index // parts, len(cpus) * (index + 1) // parts
    chunk = cpus[start:stop] or cpus[index % len(cpus):index % len(cpus) + 1]
    return chunk[:cap] if cap > 0 else chunk


def tasks_on_this_node(env: Mapping[str, str]) -> int:
    """This node's task count in the step, from SLURM_STEP_TASKS_PER_NODE ("4(x2),3") and SLURM_NODEID."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        count, _, repeat = part.partition("(x")
        if count.isdigit():
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else 1


def bind_task(env: Mapping[str, str] | None = None) -> str | None:
    """With TFSCALE_CPU_BIND=gpu-numa (the templates' step on a node of several NUMA nodes): narrows this task's CPU
    mask near its GPU (`task_cpus`) and returns the line that says so; None when not asked to. Run before
    TensorFlow, tf.data or DALI size a thread pool from the mask."""
    env = os.environ if env is None else env
    if env.get(SELF_BIND_ENV) != SELF_BIND:
        return None  # not asked, or bound already (by this process, or by the parent whose mask it inherited)
    root = env.get(ROOT_ENV, "/")
    sysfs, proc = os.path.join(root, "sys"), os.path.join(root, "proc")
    local_rank = int(env.get("SLURM_LOCALID", "0") or 0)
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    cpus, why = task_cpus(os.sched_getaffinity(0), job_gpu_numa_nodes(env, sysfs, proc), numa_cpus(sysfs), local_rank,
                          tasks_on_this_node(env), int(per_task) if per_task.isdigit() else 0)
    os.sched_setaffinity(0, cpus)
    return f"topology: local task {local_rank} bound to CPUs {format_cpu_list(cpus)} ({why})"


def bind_at_start() -> None:
    """`bind_task` for a program's start (the training and benchmark commands), once per process tree."""
    line = bind_task()
    if line:
        os.environ[SELF_BIND_ENV] = "bound"
        print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks_per_node", type=int, required=True, help="training tasks per node (one per GPU)")
    parser.add_argument("--root", default=os.environ.get(ROOT_ENV, "/"),
                        help=f"where to read sys/ and proc/ from, e.g. a copy of a node's (default: ${ROOT_ENV}, else /)")
    args = parser.parse_args(argv)
    sysfs, proc = os.path.join(args.root, "sys"), os.path.join(args.root, "proc")
    option, why = cpu_bind(job_gpu_numa_nodes(sysfs=sysfs, proc=proc), args.tasks_per_node, numa_node_count(sysfs))
    print(f"topology: --cpu-bind={option}: {why}", file=sys.stderr)
    print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
