"""What a node's GPU links should carry, and tfscale-doctor's gpu-bandwidth verdict against it: the topology read
from nvidia-smi's output as real nodes print it (injected) and a fake sysfs, and training's all-reduce measured
between real worker processes."""

import re

import pytest
from test_topology import DGX_GPUS, fake_node

from tfscale.perf import doctor_speed, gpu_links
from tfscale.perf.doctor_checks import FAIL, PASS

# nvidia-smi topo -m of a DGX A100: every pair through the NVSwitches, with its NICs listed beside the GPUs.
DGX_A100_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
""" + "".join(
    f"GPU{i}\t" + "\t".join(" X " if j == i else "NV12" for j in range(8))
    + f"\tPXB\tSYS\t{'0-63' if i < 4 else '64-127'}\t{i // 4}\t\tN/A\n" for i in range(8)) + """\
NIC0\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# A DGX-1 with V100s: the hybrid cube-mesh, six links a GPU, some pairs with no NVLink at all.
DGX1_ROWS = [["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"],
             ["NV1", "X", "NV2", "NV1", "SYS", "NV2", "SYS", "SYS"],
             ["NV1", "NV2", "X", "NV2", "SYS", "SYS", "NV1", "SYS"],
             ["NV2", "NV1", "NV2", "X", "SYS", "SYS", "SYS", "NV1"],
             ["NV2", "SYS", "SYS", "SYS", "X", "NV1", "NV1", "NV2"],
             ["SYS", "NV2", "SYS", "SYS", "NV1", "X", "NV2", "NV1"],
             ["SYS", "SYS", "NV1", "SYS", "NV1", "NV2", "X", "NV2"],
             ["SYS", "SYS", "SYS", "NV1", "NV2", "NV1", "NV2", "X"]]
DGX1_TOPO = "\t" + "\t".join(f"GPU{j}" for j in range(8)) + "\tCPU Affinity\tNUMA Affinity\n" + "".join(
    f"GPU{i}\t" + "\t".join(row) + f"\t{'0-19' if i < 4 else '20-39'}\t{i // 4}\n" for i, row in enumerate(DGX1_ROWS))

# Four PCIe GPUs, two on each socket, no NVLink: nvidia-smi nvlink -s prints no links.
PCIE_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tSYS\tSYS\t0-15\t0
GPU1\tPIX\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tPIX\t16-31\t1
GPU3\tSYS\tSYS\tPIX\t X \t16-31\t1
"""


def nvlink_status(links_per_gpu: list[int], speed: str, inactive: dict[int, int] | None = None) -> str:
    """nvidia-smi nvlink -s as it prints a node: each GPU's links, `inactive` of them "<inactive>"."""
    text = ""
    for gpu, count in enumerate(links_per_gpu):
        down = (inactive or {}).get(gpu, 0)
        text += f"GPU {gpu}: NVIDIA A100-SXM4-40GB (UUID: GPU-{gpu:08d})\n"
        text += "".join(f"\t Link {k}: {'<inactive>' if k >= count - down else speed + ' GB/s'}\n"
                        for k in range(count))
    return text


def links(topo: str, nvlinks: str, pcie: dict[int, tuple[str, int]]) -> gpu_links.NodeLinks:
    return gpu_links.NodeLinks(gpu_links.parse_topology(topo), gpu_links.parse_nvlink_status(nvlinks),
                               {g: gpu_links.pcie_gbps(s, w) for g, (s, w) in pcie.items()},
                               {g: f"{s.removesuffix(' PCIe')} x{w}" for g, (s, w) in pcie.items()})


GEN4_X16 = {g: ("16.0 GT/s PCIe", 16) for g in range(8)}
DGX_A100 = links(DGX_A100_TOPO, nvlink_status([12] * 8, "25"), GEN4_X16)
DGX1 = links(DGX1_TOPO, nvlink_status([6] * 8, "25.781"), {g: ("8.0 GT/s PCIe", 16) for g in range(8)})
PCIE_BOX = links(PCIE_TOPO, "", {0: ("8.0 GT/s PCIe", 16), 1: ("8.0 GT/s PCIe", 16), 2: ("8.0 GT/s PCIe", 8),
                                 3: ("8.0 GT/s PCIe", 16)})


def test_nvidia_smi_topology_is_read_pair_by_pair_without_the_nics():
    paths = gpu_links.parse_topology(DGX_A100_TOPO)
    assert len(paths) == 8 * 7 and set(paths.values()) == {"NV12"}
    assert gpu_links.parse_topology(PCIE_TOPO)[(0, 1)] == "PIX" and gpu_links.parse_topology(PCIE_TOPO)[(1, 2)] == "SYS"
    assert gpu_links.parse_topology("No devices were found") == {}


def test_nvlink_status_counts_active_links_with_their_speed_and_inactive_ones():
    status = gpu_links.parse_nvlink_status(nvlink_status([6, 6], "25.781", inactive={1: 2}))
    assert status == {0: ([25.781] * 6, 0), 1: ([25.781] * 4, 2)}


@pytest.mark.parametrize("speed, width, gbps", [
    ("8.0 GT/s PCIe", 16, 15.75), ("16.0 GT/s PCIe", 16, 31.51), ("32.0 GT/s PCIe", 16, 63.02),
    ("5.0 GT/s PCIe", 16, 8.0), ("8.0 GT/s PCIe", 8, 7.88), ("Unknown", 16, 0.0),
])
def test_pcie_rate_one_way_after_line_coding(speed, width, gbps):
    assert gpu_links.pcie_gbps(speed, width) == pytest.approx(gbps, abs=0.01)


@pytest.mark.parametrize("node, gpus, gbps, how", [
    # Behind NVSwitches every pair shows all 12 of a GPU's links: the GPU's 12 x 25 GB/s, not 7 x 12 links.
    ("dgx_a100", range(8), 300.0, "NVLink ring, GPU 0: 12 link(s) x 25 GB/s"),
    ("dgx_a100", [2, 5], 300.0, "NVLink ring, GPU 2: 12 link(s) x 25 GB/s"),
    # The cube-mesh: a ring through all 8 on NVLink exists though 0-5 has none; each GPU's 6 links carry it.
    ("dgx1", range(8), 154.686, "NVLink ring, GPU 0: 6 link(s) x 25.781 GB/s"),
    ("dgx1", [0, 1, 2, 3], 103.124, "NVLink ring, GPU 0: 4 link(s) x 25.781 GB/s"),  # 2 of each GPU's 6 leave the quad
    ("dgx1", [0, 5], 15.75, "PCIe ring, GPU 0: 8.0 GT/s x16 = 15.8 GB/s, crossing the sockets' interconnect (SYS)"),
    ("pcie", range(4), 7.88, "PCIe ring, GPU 2: 8.0 GT/s x8 = 7.9 GB/s, crossing the sockets' interconnect (SYS)"),
    ("pcie", [0, 1], 15.75, "PCIe ring, GPU 0: 8.0 GT/s x16 = 15.8 GB/s"),
])
def test_expected_bus_bandwidth_is_the_slowest_link_a_ring_crosses(node, gpus, gbps, how):
    node_links = {"dgx_a100": DGX_A100, "dgx1": DGX1, "pcie": PCIE_BOX}[node]
    rate, said = gpu_links.expected_busbw(node_links, list(gpus))
    assert rate == pytest.approx(gbps, abs=0.01)
    assert said == how


def test_a_node_nvidia_smi_does_not_describe_is_not_judged():
    assert gpu_links.expected_busbw(gpu_links.NodeLinks({}, {}, {}, {}), [0, 1]) is None


MEASURED = "NCCL all-reduce of 64 MiB between 8 worker processes"


@pytest.mark.parametrize("busbw, status, said", [
    (231.0, PASS, "0.77x of 300.0 GB/s (NVLink ring, GPU 0: 12 link(s) x 25 GB/s)"),
    (120.0, PASS, "0.40x of 300.0 GB/s"),  # at the share
    (11.0, FAIL, "0.04x of 300.0 GB/s (NVLink ring, GPU 0: 12 link(s) x 25 GB/s): below 40%, so NCCL is not using the "
                 "links. Run with NCCL_DEBUG=INFO to see its transport (P2P/SHM/NET), check NCCL_P2P_DISABLE"),
])
def test_the_verdict_fails_below_the_stated_share_of_the_links_rate(busbw, status, said):
    check = doctor_speed.bandwidth_verdict(MEASURED, busbw, DGX_A100, list(range(8)))
    assert check.status == status
    assert check.detail.startswith(f"{MEASURED}; {said}")


def test_nvlinks_down_fail_even_at_a_passing_rate():
    degraded = links(DGX_A100_TOPO, nvlink_status([12] * 8, "25", inactive={3: 2}), GEN4_X16)
    check = doctor_speed.bandwidth_verdict(MEASURED, 231.0, degraded, list(range(8)))
    assert check.status == FAIL
    assert check.detail.endswith("NVLinks down: GPU 3: 10 of 12 NVLinks active (others have 12) (nvidia-smi nvlink -s)")


def test_without_a_topology_the_measurement_passes_and_says_it_was_not_judged():
    check = doctor_speed.bandwidth_verdict(MEASURED, 5.0, gpu_links.NodeLinks({}, {}, {}, {}), [0, 1])
    assert check.status == PASS and check.detail.endswith("not judged: nvidia-smi and sysfs did not say how the GPUs "
                                                          "are linked")


def test_a_nodes_links_are_read_from_nvidia_smi_and_its_pci_devices(tmp_path):
    fake_node(tmp_path, DGX_GPUS)
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    for index, (address, _) in enumerate(DGX_GPUS):
        (devices / address / "max_link_speed").write_text("16.0 GT/s PCIe\n")
        (devices / address / "max_link_width").write_text("8\n" if index == 5 else "16\n")
    said = {("topo", "-m"): DGX_A100_TOPO, ("nvlink", "-s"): nvlink_status([12] * 8, "25")}
    node = gpu_links.read_node_links(str(tmp_path), nvidia_smi=lambda *args: said[args])
    assert node.pcie_links[0] == "16.0 GT/s x16" and node.pcie_gbps[5] == pytest.approx(15.75, abs=0.01)
    assert gpu_links.expected_busbw(node, list(range(8)))[0] == 300.0
    # Without nvidia-smi's NVLink view the same node is judged by its slowest PCIe link.
    without = gpu_links.read_node_links(str(tmp_path), nvidia_smi=lambda *args: "")
    assert gpu_links.expected_busbw(without, list(range(8))) == (
        pytest.approx(15.75, abs=0.01), "PCIe ring, GPU 5: 16.0 GT/s x8 = 15.8 GB/s")


def test_the_check_times_trainings_all_reduce_between_one_worker_process_per_gpu():
    # Two GPUs declared to the check, linked as a DGX A100's; this machine's two workers have no GPU, so they run
    # tfscale's start-up, MWMS and training's reduce_gradients on the CPU (TensorFlow's rings through gRPC),
    # which must fail against NVLink's rate: the check measures the processes, not the topology.
    check = doctor_speed.check_gpu_bandwidth(["GPU:0", "GPU:1"], links=DGX_A100, message_bytes=1 << 20)
    assert check.status == FAIL, check.detail
    match = re.match(r"AUTO all-reduce of 1 MiB between 2 worker processes, one per GPU, as training runs \(10 chained "
                     r"in one graph call, as nccl-tests times them\): ([\d.]+) ms, algbw ([\d.]+) GB/s, busbw ([\d.]+) "
                     r"GB/s; ([\d.]+)x of 300.0 GB/s \(NVLink ring, GPU 0: 12 link\(s\) x 25 GB/s\): below 40%",
                     check.detail)
    assert match, check.detail
    ms, algbw, busbw, share = map(float, match.groups())
    assert 0 < ms < 5000
    assert busbw == algbw  # 2 replicas: busbw = algbw x 2(n-1)/n = algbw
    assert algbw == pytest.approx((1 << 20) / (ms / 1e3) / 1e9, abs=0.0051)  # printed to 0.01 GB/s
    assert share == pytest.approx(busbw / 300.0, abs=0.006)
