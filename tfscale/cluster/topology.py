"""Which CPU cores each task of a node should run on: those of its GPU's NUMA node.

    python -m tfscale.cluster.topology --tasks_per_node=8      (slurm/*.sbatch: the training step's --cpu-bind)

tfscale gives local rank k the k-th GPU it sees (tfscale.cluster.devices). Slurm's `--cpu-bind=cores` places
a task's cores by its own distribution, by default alternating sockets between consecutive tasks
(block:cyclic), which ignores where GPU k is attached: on a two-socket node about half the ranks would run
their input and NCCL threads on the socket far from their GPU. Printed instead is `map_ldom:n0,n1,...`,
task k bound to the NUMA node (Slurm's "locality domain") of the k-th GPU of this job, read from sysfs.
One list serves every node of the step: the nodes of a job are assumed alike (same GPU slots).

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


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def nvidia_gpus(sysfs: str = "/sys") -> list[tuple[str, int]]:
    """(PCI address, NUMA node) of every NVIDIA GPU, in PCI bus order; NUMA node -1 where the kernel has none."""
    found = []
    for device in sorted(glob.glob(os.path.join(sysfs, "bus", "pci", "devices", "*"))):
        if _read(os.path.join(device, "vendor")) != NVIDIA_VENDOR:
            continue
        if not _read(os.path.join(device, "class")).startswith(GPU_CLASSES):
            continue  # the GPU's audio function, NVSwitches and bridges share the vendor id
        numa = _read(os.path.join(device, "numa_node"))
        found.append((os.path.basename(device), int(numa) if numa.lstrip("-").isdigit() else -1))
    return found


def device_minors(proc: str = "/proc") -> dict[int, str]:
    """Device minor number (/dev/nvidiaN) -> PCI address, as the NVIDIA driver reports them; {} without it."""
    minors = {}
    for info in glob.glob(os.path.join(proc, "driver", "nvidia", "gpus", "*", "information")):
        for line in _read(info).splitlines():
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


def cpu_bind(numa_nodes: list[int], tasks_per_node: int, node_numa_nodes: int) -> tuple[str, str]:
    """(srun --cpu-bind value, why) for `tasks_per_node` tasks, task k using GPU k of `numa_nodes`, on a node
    with `node_numa_nodes` NUMA nodes."""
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
    return "map_ldom:" + ",".join(map(str, mine)), f"each task on its GPU's NUMA node ({listed})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks_per_node", type=int, required=True, help="training tasks per node (one per GPU)")
    parser.add_argument("--root", default="/", help="where to read sys/ and proc/ from, e.g. a copy of a node's")
    args = parser.parse_args(argv)
    sysfs, proc = os.path.join(args.root, "sys"), os.path.join(args.root, "proc")
    option, why = cpu_bind(job_gpu_numa_nodes(sysfs=sysfs, proc=proc), args.tasks_per_node, numa_node_count(sysfs))
    print(f"topology: --cpu-bind={option}: {why}", file=sys.stderr)
    print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
