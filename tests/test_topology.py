"""Each task's cores on its GPU's NUMA node: the decision from a node's sysfs (fake trees of real layouts), the
command the sbatch templates run, and the rendered scripts' training steps."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from tfscale.cluster import topology
from test_make_sbatch import R50_32GPU, generate
from test_make_sbatch import gpu_venv  # noqa: F401 - autouse: make_sbatch reads a GPU venv

# A DGX-A100-like node: 8 GPUs, 4 on each socket's NUMA node (0 and 1), and non-GPU NVIDIA functions beside them.
DGX_GPUS = [("0000:07:00.0", 0), ("0000:0f:00.0", 0), ("0000:47:00.0", 0), ("0000:4e:00.0", 0),
            ("0000:87:00.0", 1), ("0000:90:00.0", 1), ("0000:b7:00.0", 1), ("0000:bd:00.0", 1)]


def fake_node(root, gpus, minors=None, numa_nodes=2,
              others=(("0000:c4:00.0", "0x068000"), ("0000:00:01.0", "0x060400"))):
    """`root`/sys and `root`/proc as a node's: NUMA nodes, NVIDIA GPUs (address, numa), an NVSwitch and a bridge
    that are not GPUs, and the driver's device minor -> address (default: PCI order)."""
    for n in range(numa_nodes):
        (root / "sys" / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    devices = root / "sys" / "bus" / "pci" / "devices"
    for address, numa in gpus:
        d = devices / address
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "numa_node").write_text(f"{numa}\n")
    for address, pci_class in others:
        d = devices / address
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n" if pci_class == "0x068000" else "0x8086\n")
        (d / "class").write_text(pci_class + "\n")
        (d / "numa_node").write_text("1\n")
    for minor, address in (minors or {i: address for i, (address, _) in enumerate(gpus)}).items():
        info = root / "proc" / "driver" / "nvidia" / "gpus" / address / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ:   \t\t 91\nDevice Minor: \t {minor}\n")
    return str(root / "sys"), str(root / "proc")


def test_only_nvidia_gpus_count_in_pci_order_with_their_numa_node(tmp_path):
    sysfs, proc = fake_node(tmp_path, list(reversed(DGX_GPUS)))
    assert topology.nvidia_gpus(sysfs) == DGX_GPUS  # the NVSwitch (class 0x0680) and the bridge are left out
    assert topology.job_gpu_numa_nodes({}, sysfs, proc) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_eight_tasks_on_a_two_socket_node_are_bound_to_their_gpus_numa_nodes(tmp_path):
    sysfs, proc = fake_node(tmp_path, DGX_GPUS)
    option, why = topology.cpu_bind(topology.job_gpu_numa_nodes({}, sysfs, proc), 8, topology.numa_node_count(sysfs))
    assert option == "map_ldom:0,0,0,0,1,1,1,1"
    assert why.startswith("each task on its GPU's NUMA node (GPU 0 -> NUMA 0, ") and "GPU 7 -> NUMA 1)" in why


def test_a_job_holding_some_of_the_gpus_binds_to_those_gpus_numa_nodes(tmp_path):
    # Slurm gave this job device minors 0 and 1 of 8, and this driver numbered the minors against PCI order: they
    # are the last two GPUs, on NUMA node 1 (in PCI order they would be the first two, on node 0).
    minors = {i: address for i, (address, _) in enumerate(reversed(DGX_GPUS))}
    sysfs, proc = fake_node(tmp_path, DGX_GPUS, minors=minors)
    numa = topology.job_gpu_numa_nodes({"SLURM_JOB_GPUS": "0,1"}, sysfs, proc)
    assert numa == [1, 1]
    assert topology.cpu_bind(numa, 2, topology.numa_node_count(sysfs))[0] == "map_ldom:1,1"
    # A GPU Slurm names that the driver does not know: nothing to bind by.
    assert topology.job_gpu_numa_nodes({"SLURM_JOB_GPUS": "9"}, sysfs, proc) == []


@pytest.mark.parametrize("numa, tasks, node_numa_nodes, option, why", [
    ([0, 0, 0, 0], 4, 1, "cores", "one NUMA node"),
    ([-1, -1], 2, 2, "cores", "the kernel reports no NUMA node"),
    ([], 4, 2, "cores", "no GPU found in sysfs"),
    ([0, 1], 4, 2, "cores", "4 tasks for 2 GPUs"),
    ([0, 0, 1, 1], 2, 2, "map_ldom:0,0", "GPU 1 -> NUMA 0"),  # 2 tasks on a 4-GPU node use GPUs 0 and 1
    ([2, 2, 3, 3], 4, 4, "map_ldom:2,2,3,3", "GPU 3 -> NUMA 3"),  # NPS2/NPS4 nodes: more NUMA nodes than sockets
])
def test_the_binding_follows_the_gpus_numa_nodes_where_the_node_has_several(numa, tasks, node_numa_nodes, option, why):
    chosen, reason = topology.cpu_bind(numa, tasks, node_numa_nodes)
    assert chosen == option and why in reason


def test_the_command_the_templates_run_prints_the_option_alone(tmp_path):
    fake_node(tmp_path, DGX_GPUS)
    result = subprocess.run([sys.executable, "-m", "tfscale.cluster.topology", "--tasks_per_node=8",
                             f"--root={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "map_ldom:0,0,0,0,1,1,1,1\n"
    assert result.stderr.startswith("topology: --cpu-bind=map_ldom:0,0,0,0,1,1,1,1: each task on its GPU's NUMA")
    # This machine: no NVIDIA GPU in its sysfs.
    here = subprocess.run([sys.executable, "-m", "tfscale.cluster.topology", "--tasks_per_node=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert here.stdout == "cores\n"


@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_the_rendered_script_binds_its_training_step_to_the_gpus_numa_nodes(tmp_path, backend):
    fake_node(tmp_path, DGX_GPUS)
    text = generate(tmp_path, f"--config={R50_32GPU}", "--nodes=1", "--gpus_per_node=8", f"--backend={backend}",
                    "--config.data.dataset=synthetic", "--config.data.global_batch_size=1024")
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in text  # GPU k in PCI order, as sysfs lists them
    sruns = [line for line in text.splitlines() if '--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in line]
    assert sruns and all('--cpu-bind="$CPU_BIND"' in line for line in sruns), sruns
    # The script's own cpu_bind function, run by bash as the job would on a DGX-like node with 8 tasks. PYTHON
    # names a shell function that reads the fake node's sys/ and proc/ (bash runs a function a variable names).
    function = text[text.index("cpu_bind() {"):]
    function = function[: function.index("\n}\n") + 3]
    script = (f'node_python() {{ {sys.executable} "$@" --root={tmp_path}; }}\nPYTHON=node_python\n{function}'
              'cpu_bind\necho "$CPU_BIND"\n')
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "8", "SLURM_NNODES": "1"})
    assert result.stdout == "map_ldom:0,0,0,0,1,1,1,1\n", result.stderr
