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


def fake_node(root, gpus, minors=None, numa_nodes=2, cpu_lists=None,
              others=(("0000:c4:00.0", "0x068000"), ("0000:00:01.0", "0x060400"))):
    """`root`/sys and `root`/proc as a node's: NUMA nodes with their CPU lists (default: 64 CPUs each), NVIDIA GPUs
    (address, numa), an NVSwitch and a bridge that are not GPUs, and the driver's device minor -> address (default:
    PCI order)."""
    for n in range(numa_nodes):
        node = root / "sys" / "devices" / "system" / "node" / f"node{n}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text((cpu_lists[n] if cpu_lists else f"{64 * n}-{64 * n + 63}") + "\n")
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


def test_eight_tasks_on_a_two_socket_node_bind_themselves_to_their_gpus_numa_nodes(tmp_path):
    # Not Slurm's map_ldom, which refuses a step that does not hold the whole node (test_slurm reproduces it).
    sysfs, proc = fake_node(tmp_path, DGX_GPUS)
    option, why = topology.cpu_bind(topology.job_gpu_numa_nodes({}, sysfs, proc), 8, topology.numa_node_count(sysfs))
    assert option == "none"
    assert why.startswith("each task binds itself to its GPU's NUMA node at start, TFSCALE_CPU_BIND=gpu-numa (GPU 0 "
                          "-> NUMA 0, ") and "GPU 7 -> NUMA 1)" in why


def test_cpu_lists_as_sysfs_writes_them():
    assert topology.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert topology.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert topology.parse_cpu_list("") == []


@pytest.mark.parametrize("allowed, cpus_per_task, expected", [
    # The step holds the whole DGX-like node (2 x 64 CPUs): each of the 4 tasks of a NUMA node gets 16 of its CPUs.
    (range(128), 0, [list(range(16 * k, 16 * k + 16)) for k in range(8)]),
    # ... capped at --cpus-per-task.
    (range(128), 8, [list(range(16 * k, 16 * k + 8)) for k in range(8)]),
    # A step of 8 x 8 CPUs, Slurm having taken them 32 from each socket: 8 each, all near their GPUs.
    ([*range(0, 32), *range(64, 96)], 8, [list(range(8 * k, 8 * k + 8)) for k in range(4)]
     + [list(range(64 + 8 * k, 72 + 8 * k)) for k in range(4)]),
])
def test_each_task_gets_cpus_of_its_gpus_numa_node_shared_with_the_tasks_beside_it(allowed, cpus_per_task, expected):
    cpus_of_node = {0: list(range(64)), 1: list(range(64, 128))}
    got = [topology.task_cpus(allowed, [0, 0, 0, 0, 1, 1, 1, 1], cpus_of_node, k, 8, cpus_per_task)[0]
           for k in range(8)]
    assert got == expected
    assert all(set(cpus) <= set(cpus_of_node[0 if k < 4 else 1]) for k, cpus in enumerate(got))  # near each GPU


def test_a_step_without_cpus_near_a_gpu_shares_out_what_it_has():
    # 2 tasks, both GPUs on NUMA node 1, but the step's 2 CPUs are on node 0: as --cpu-bind=cores would, one each.
    cpus_of_node = {0: [0, 1], 1: [2, 3]}
    (first, why), (second, _) = (topology.task_cpus([0, 1], [1, 1], cpus_of_node, k, 2) for k in range(2))
    assert (first, second) == ([0], [1]) and "NUMA node 1 has 0 of the step's CPUs" in why


def test_this_nodes_task_count_from_slurms_compressed_list():
    env = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}
    assert topology.tasks_on_this_node(env) == 3
    assert topology.tasks_on_this_node({**env, "SLURM_NODEID": "1"}) == 4
    assert topology.tasks_on_this_node({"SLURM_TASKS_PER_NODE": "8"}) == 8


def test_a_task_binds_itself_once_near_its_gpu_read_from_its_own_node(tmp_path):
    # This machine's two CPUs as two NUMA nodes, GPU 0 on node 1: local task 0 goes to CPU 1, in a fresh process,
    # and a child it starts keeps its mask (the variable says bound).
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    fake_node(tmp_path, [("0000:07:00.0", 1), ("0000:87:00.0", 0)], cpu_lists=["0", "1"])
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "TFSCALE_CPU_BIND": "gpu-numa",
           "TFSCALE_TOPOLOGY_ROOT": str(tmp_path), "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
           "SLURM_NODEID": "0", "SLURM_JOB_GPUS": "0,1"}
    code = ("import os, subprocess, sys; from tfscale.cluster import topology; topology.bind_at_start(); "
            "print(sorted(os.sched_getaffinity(0)), os.environ['TFSCALE_CPU_BIND']); "
            "print(subprocess.run([sys.executable, '-c', 'from tfscale.cluster import topology; "
            "print(topology.bind_task())'], capture_output=True, text=True).stdout.strip())")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1] bound", "None"]
    assert result.stderr.startswith("topology: local task 0 bound to CPUs 1 (GPU 0's NUMA node 1: 1 of the step's CPUs")


def test_a_job_holding_some_of_the_gpus_binds_to_those_gpus_numa_nodes(tmp_path):
    # Slurm gave this job device minors 0 and 1 of 8, and this driver numbered the minors against PCI order: they
    # are the last two GPUs, on NUMA node 1 (in PCI order they would be the first two, on node 0).
    minors = {i: address for i, (address, _) in enumerate(reversed(DGX_GPUS))}
    sysfs, proc = fake_node(tmp_path, DGX_GPUS, minors=minors)
    numa = topology.job_gpu_numa_nodes({"SLURM_JOB_GPUS": "0,1"}, sysfs, proc)
    assert numa == [1, 1]
    assert topology.cpu_bind(numa, 2, topology.numa_node_count(sysfs))[1].endswith("(GPU 0 -> NUMA 1, GPU 1 -> NUMA 1)")
    # A GPU Slurm names that the driver does not know: nothing to bind by.
    assert topology.job_gpu_numa_nodes({"SLURM_JOB_GPUS": "9"}, sysfs, proc) == []


@pytest.mark.parametrize("numa, tasks, node_numa_nodes, option, why", [
    ([0, 0, 0, 0], 4, 1, "cores", "one NUMA node"),
    ([-1, -1], 2, 2, "cores", "the kernel reports no NUMA node"),
    ([], 4, 2, "cores", "no GPU found in sysfs"),
    ([0, 1], 4, 2, "cores", "4 tasks for 2 GPUs"),
    ([0, 0, 1, 1], 2, 2, "none", "GPU 1 -> NUMA 0)"),  # 2 tasks on a 4-GPU node use GPUs 0 and 1
    ([2, 2, 3, 3], 4, 4, "none", "GPU 3 -> NUMA 3)"),  # NPS2/NPS4 nodes: more NUMA nodes than sockets
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
    assert result.stdout == "none\n"
    assert result.stderr.startswith("topology: --cpu-bind=none: each task binds itself to its GPU's NUMA node")
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
              'cpu_bind\necho "$CPU_BIND $TFSCALE_CPU_BIND"\n')
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "8", "SLURM_NNODES": "1"})
    assert result.stdout == "none gpu-numa\n", result.stderr
