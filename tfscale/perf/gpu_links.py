"""What a node's GPU links should carry: the all-reduce bus bandwidth that tfscale-doctor's gpu-bandwidth check
holds its measurement against.

Where each figure comes from:
- which GPU pairs NVLink joins, and how many links: `nvidia-smi topo -m` ("NV12" between two GPUs; PIX, PXB,
  PHB, NODE or SYS where the path is PCIe, SYS crossing the sockets' interconnect);
- each link's speed and which links are down: `nvidia-smi nvlink -s` ("Link 0: 25 GB/s", "Link 3: <inactive>");
  the speed is one direction's (NVLink 2-4: 25 GB/s a link, 12 links on an A100 = 300 GB/s each way);
- each GPU's PCIe link: sysfs `max_link_speed` and `max_link_width` of the GPU's PCI device (what the slot
  negotiates at full load; the current speed drops while the GPU idles).

A ring all-reduce moves 2(n-1)/n of the message through every GPU's slowest link each way, so its bus
bandwidth (nccl-tests' busbw) approaches that link's one-way rate: NCCL reaches about 75-90 % of it for large
messages on NVLink and PCIe alike (NVIDIA/nccl-tests doc/PERFORMANCE.md explains busbw). The GPUs are
joined by NVLink when a ring through all of them exists on NVLink alone (NCCL builds its rings from NVLink
first); otherwise the ring crosses PCIe and its slowest PCIe link bounds it.

GPU index k is the k-th NVIDIA GPU in PCI bus order, as nvidia-smi numbers them and as CUDA numbers them with
CUDA_DEVICE_ORDER=PCI_BUS_ID (which the sbatch templates export). The standard library only.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import subprocess
from typing import Callable

from tfscale.cluster import topology

# GT/s of a PCIe generation's lane -> bytes per transfer after line coding (8b/10b up to gen 2, 128b/130b after).
_PCIE_CODING = ((5.0, 8 / 10), (float("inf"), 128 / 130))


@dataclasses.dataclass(frozen=True)
class NodeLinks:
    paths: dict[tuple[int, int], str]  # (GPU i, GPU j) -> nvidia-smi topo -m's entry: "NV12", "PIX", "SYS", ...
    nvlinks: dict[int, tuple[list[float], int]]  # GPU -> (GB/s one way of each active link, links inactive)
    pcie_gbps: dict[int, float]  # GPU -> its PCIe link's GB/s one way
    pcie_links: dict[int, str]  # GPU -> "16.0 GT/s x16", as sysfs gives it


def pcie_gbps(speed: str, width: int) -> float:
    """GB/s one way of a PCIe link: sysfs max_link_speed ("16.0 GT/s PCIe") x lanes, after line coding."""
    match = re.match(r"\s*([\d.]+)\s*GT/s", speed)
    if not match or width < 1:
        return 0.0
    rate = float(match.group(1))
    coding = next(factor for limit, factor in _PCIE_CODING if rate <= limit)
    return rate * coding * width / 8


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m` -> {(i, j): entry} for every GPU pair i != j (NIC rows and columns left out)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    header = next((tokens for tokens in lines if tokens and tokens[0] == "GPU0"), None)
    if header is None:
        return {}
    gpus = [int(token[3:]) for token in itertools.takewhile(lambda t: re.fullmatch(r"GPU\d+", t), header)]
    paths = {}
    for tokens in lines:
        if len(tokens) > len(gpus) and re.fullmatch(r"GPU\d+", tokens[0]) and tokens is not header:
            i = int(tokens[0][3:])
            paths.update({(i, j): entry for j, entry in zip(gpus, tokens[1:]) if j != i})
    return paths


def parse_nvlink_status(text: str) -> dict[int, tuple[list[float], int]]:
    """`nvidia-smi nvlink -s` -> {GPU: (GB/s of each active link, number of inactive links)}."""
    links: dict[int, tuple[list[float], int]] = {}
    gpu = None
    for line in text.splitlines():
        header = re.match(r"GPU (\d+):", line.strip())
        if header:
            gpu = int(header.group(1))
            links[gpu] = ([], 0)
            continue
        link = re.match(r"Link \d+:\s*(.*)", line.strip())
        if gpu is None or not link:
            continue
        speeds, inactive = links[gpu]
        rate = re.match(r"([\d.]+)\s*GB/s", link.group(1))
        links[gpu] = (speeds + [float(rate.group(1))], inactive) if rate else (speeds, inactive + 1)
    return links


def nvlink_count(entry: str) -> int:
    """Links of a topo -m entry: "NV12" -> 12; a PCIe path -> 0."""
    match = re.fullmatch(r"NV(\d+)", entry)
    return int(match.group(1)) if match else 0


def nvlink_ring(paths: dict[tuple[int, int], str], gpus: list[int]) -> bool:
    """Whether one ring through all of `gpus` runs on NVLink alone (a Hamiltonian cycle of NVLink pairs)."""
    if len(gpus) < 2:
        return False
    joined = {g: {h for h in gpus if h != g and nvlink_count(paths.get((g, h), ""))} for g in gpus}
    if len(gpus) == 2:
        return bool(joined[gpus[0]])
    first = gpus[0]

    def extend(path: list[int]) -> bool:
        if len(path) == len(gpus):
            return first in joined[path[-1]]
        return any(extend(path + [nxt]) for nxt in joined[path[-1]] if nxt not in path)

    return extend([first])


def nvlink_gbps(links: NodeLinks, gpu: int, gpus: list[int]) -> float:
    """GB/s one way that `gpu` can send to the other `gpus` over NVLink: its links to them, at most its active
    links (behind an NVSwitch every pair shows all of a GPU's links), at their speed."""
    speeds, _ = links.nvlinks.get(gpu, ([], 0))
    if not speeds:
        return 0.0
    to_peers = sum(nvlink_count(links.paths.get((gpu, peer), "")) for peer in gpus if peer != gpu)
    return min(to_peers, len(speeds)) * sum(speeds) / len(speeds)


def expected_busbw(links: NodeLinks, gpus: list[int]) -> tuple[float, str] | None:
    """(GB/s, how it was derived): the one-way rate of the slowest link a ring through `gpus` crosses, or None
    when the topology does not say (no nvidia-smi, GPUs it does not list)."""
    if nvlink_ring(links.paths, gpus):
        per_gpu = {g: nvlink_gbps(links, g, gpus) for g in gpus}
        slowest = min(per_gpu, key=per_gpu.get)
        if per_gpu[slowest] <= 0:
            return None
        speeds, _ = links.nvlinks[slowest]
        used = round(per_gpu[slowest] / (sum(speeds) / len(speeds)))
        return per_gpu[slowest], f"NVLink ring, GPU {slowest}: {used} link(s) x {sum(speeds) / len(speeds):g} GB/s"
    rates = [links.pcie_gbps.get(g, 0.0) for g in gpus]
    if not rates or min(rates) <= 0:
        return None
    slowest = gpus[rates.index(min(rates))]
    sockets = any(links.paths.get((g, h)) == "SYS" for g in gpus for h in gpus if g != h)
    return min(rates), (f"PCIe ring, GPU {slowest}: {links.pcie_links.get(slowest, '')} = {min(rates):.1f} GB/s"
                        + (", crossing the sockets' interconnect (SYS)" if sockets else ""))


def degraded_nvlinks(links: NodeLinks, gpus: list[int]) -> list[str]:
    """GPUs of `gpus` with fewer active NVLinks than another of them: a link down (NVLink boards are built
    symmetric), named as nvidia-smi nvlink -s shows it."""
    active = {g: len(links.nvlinks[g][0]) for g in gpus if g in links.nvlinks}
    most = max(active.values(), default=0)
    return [f"GPU {g}: {count} of {count + links.nvlinks[g][1]} NVLinks active (others have {most})"
            for g, count in sorted(active.items()) if count < most]


def _nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, or "" where it is missing or fails (a node without the driver's tools)."""
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def read_node_links(root: str = "/", nvidia_smi: Callable[..., str] = _nvidia_smi) -> NodeLinks:
    """This node's GPU links: nvidia-smi's topology and NVLink status, sysfs' PCIe links under `root`."""
    pcie, described = {}, {}
    for index, (address, _) in enumerate(topology.nvidia_gpus(os.path.join(root, "sys"))):
        device = os.path.join(root, "sys", "bus", "pci", "devices", address)
        speed = topology.read_text(os.path.join(device, "max_link_speed"))
        width = topology.read_text(os.path.join(device, "max_link_width"))
        if speed and width.isdigit():
            pcie[index] = pcie_gbps(speed, int(width))
            described[index] = f"{speed.removesuffix(' PCIe')} x{width}"
    return NodeLinks(parse_topology(nvidia_smi("topo", "-m")), parse_nvlink_status(nvidia_smi("nvlink", "-s")),
                     pcie, described)
