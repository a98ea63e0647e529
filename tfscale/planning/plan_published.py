"""The published scaling runs `tfscale.perf.plan` is checked against, and the systems behind them.

`tfscale-plan --published` prints the comparison table of docs/scaling.md from this module (a test
keeps the two equal). Every number is as published, with its source; what a source does not say
(the interconnect of the thesis' cluster, the PCIe layout of Uber's servers) is an assumption
written next to the value. Nothing here is fitted to the points it is compared with: each system's
figures come from a spec sheet or NCCL's own constants, and each series' one-GPU rate is the
published one-GPU point of that series.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

from tfscale.planning import plan_model

# NCCL's constants for links it cannot measure (NVIDIA/nccl 5067397c): src/graph/topo.h PCI_BW "PCI Gen3 x16"
# and NET_BW "100Gbit", in GB/s; src/graph/tuning.cc hwLatencies, Ring / Simple protocol, in microseconds.
PCIE3_X16_GBPS = 12.0
NET_100GBIT_GBPS = 12.0
PCIE_RING_STEP_US = 5.7
NET_RING_STEP_US = 14.0
# Horovod as the 2017-2018 runs used it (horovod/horovod 8318a898, horovod/common/operations.cc): a 64 MiB
# fusion buffer (line 140) and a background cycle of 5 ms (line 1221), each gradient all-reduced as it is ready.
HOROVOD_2018 = dict(algorithm="ring", overlap="per_tensor", fusion_bytes=64 << 20, cycle_ms=5.0)

_TF_BENCHMARKS = ("tensorflow/tensorflow tensorflow/docs_src/performance/benchmarks.md @5984ffef, "
                  "'Details for Amazon EC2 Distributed (NVIDIA Tesla K80)', Training synthetic data")
_HOROVOD_16 = "horovod/horovod README.md @f7eb2177 lines 25-38 (RDMA Horovod, allreduce on GPU with NCCL)"
_HOROVOD_64 = "horovod/horovod README.md @f7eb2177 lines 40-49 (TCP Horovod, allreduce on GPU with NCCL)"
_HOROVOD_128 = "horovod/horovod docs/benchmarks.md @cd2a3ce8 lines 5-6 (32 servers x 4 Pascal GPUs)"
_HOROVOD_512 = "horovod/horovod docs/benchmarks.rst @2626dc87 lines 13-14 (128 servers x 4 Pascal GPUs)"
_THESIS = "the thesis tfscale follows: Horovod + tf_cnn_benchmarks on P100 nodes of 4 GPUs, InfiniBand"


def _system(name: str, gpus_per_node: int, inter_GBps: float, sources: dict) -> plan_model.System:
    return plan_model.System(name=name, gpus_per_node=gpus_per_node, gpu_images_per_sec=0.0,
                             intra_node_GBps=PCIE3_X16_GBPS, intra_node_latency_us=PCIE_RING_STEP_US,
                             inter_node_GBps=inter_GBps, inter_node_latency_us=NET_RING_STEP_US, sources=sources)


_PCIE_SOURCE = "PCIe Gen3 x16 between a node's GPUs: NCCL topo.h PCI_BW 12 GB/s, ring step 5.7 us (tuning.cc)"
SYSTEMS = {
    "p100_ib_4gpu": _system("p100_ib_4gpu", 4, NET_100GBIT_GBPS, {
        "gpus_per_node": _THESIS, "intra_node": _PCIE_SOURCE + " (assumed: P100 PCIe cards, no NVLink)",
        "inter_node": "EDR InfiniBand, 100 Gbit/s: NCCL topo.h NET_BW 12 GB/s (assumed: the thesis says InfiniBand)"}),
    "k80_ec2_p2_8xlarge": _system("k80_ec2_p2_8xlarge", 8, 1.25, {
        "gpus_per_node": "AWS EC2 user guide, accelerated-computing-instances.md: p2.8xlarge 8 GPUs",
        "intra_node": _PCIE_SOURCE, "inter_node": "AWS EC2 user guide: p2.8xlarge 10 Gbps (1.25 GB/s)"}),
    "pascal_roce_25g": _system("pascal_roce_25g", 4, 3.125, {
        "gpus_per_node": "Horovod docs: servers with 4 Pascal GPUs", "intra_node": _PCIE_SOURCE + " (assumed)",
        "inter_node": "Horovod docs: RoCE-capable 25 Gbit/s network (3.125 GB/s)"}),
    "pascal_tcp_40g": _system("pascal_tcp_40g", 4, 5.0, {
        "gpus_per_node": "Horovod README: servers with 4 Pascal GPUs", "intra_node": _PCIE_SOURCE + " (assumed)",
        "inter_node": "Horovod README: plain 40 Gbit/s network (5 GB/s), TCP"}),
}


# Clusters of today's GPUs to plan on (docs/scaling.md plans r50_32gpu:amp on them), from spec sheets and
# NCCL's constants, nothing calibrated: overlap_efficiency stays 1 (what the physics allows), input is not
# modelled (DALI's GPU decoding, or synthetic data), and one NIC per node (DGX A100 has eight: set
# inter_node_GBps to what yours has).
_A100_NODE = dict(
    gpus_per_node=8, gpu_images_per_sec=2375.0, intra_node_GBps=12 * 20.0, intra_node_latency_us=3.4,
    inter_node_latency_us=NET_RING_STEP_US, host_copy_GBps=2 * PCIE3_X16_GBPS)
_A100_SOURCES = {
    "gpu_images_per_sec": "NVIDIA DeepLearningExamples resnet50v1.5 README @b2e7f4a2: 1 A100 40 GB, AMP + XLA, "
                          "batch 256 (docs/gpu.md)",
    "intra_node": "A100 SXM4: 12 NVLinks x NCCL topo.h SM80_NVLINK_BW 20 GB/s; ring step 3.4 us (tuning.cc NVLink)",
    "host_copy_GBps": "PCIe Gen4 x16: twice NCCL topo.h PCI_BW (Gen3 x16, 12 GB/s)"}
REFERENCE_SYSTEMS = {
    "a100_ib_200g": plan_model.System(name="a100_ib_200g", inter_node_GBps=25.0, **_A100_NODE, sources={
        **_A100_SOURCES, "inter_node": "one HDR InfiniBand NIC per node, 200 Gbit/s (25 GB/s); ring step 14 us"}),
    "a100_eth_25g": plan_model.System(name="a100_eth_25g", inter_node_GBps=3.125, **_A100_NODE, sources={
        **_A100_SOURCES, "inter_node": "25 Gbit/s Ethernet (3.125 GB/s), NCCL's network ring step 14 us (its "
                                       "socket transport over TCP reaches less)"}),
}

@dataclasses.dataclass(frozen=True)
class Series:
    """Published runs of one model and batch on one system: (GPUs, images/sec) points, one of them 1 GPU."""

    system: str
    model: str
    per_gpu_batch: int
    implementation: dict
    images_per_sec: tuple[tuple[int, float], ...] = ()  # (GPUs, total images/sec), when published as such
    efficiencies: tuple[tuple[int, float], ...] = ()  # (GPUs, efficiency vs 1 GPU), when published as such
    one_gpu: float = 0.0  # images/sec of one GPU (the first images_per_sec point when 0)
    source: str = ""

    def published(self) -> list[tuple[int, float]]:
        """(GPUs, efficiency against one GPU) of every multi-GPU point."""
        one = self.one_gpu or dict(self.images_per_sec)[1]
        return [(n, x / (n * one)) for n, x in self.images_per_sec if n > 1] + list(self.efficiencies)


# tf_cnn_benchmarks' distributed_replicated: each node reduces its GPUs' gradients, then sends and fetches
# every variable through parameter servers spread over the nodes (2 (m-1)/m S through each node's network,
# as a ring over the nodes), variable by variable as gradients are ready, without fusion.
_HOROVOD_2018_HIERARCHICAL = {**HOROVOD_2018, "algorithm": "hierarchical"}
_PARAMETER_SERVERS = dict(algorithm="hierarchical", overlap="per_tensor", fusion_bytes=1, cycle_ms=0.0)
SERIES = (
    Series("p100_ib_4gpu", "resnet50", 32, HOROVOD_2018, source=_THESIS, images_per_sec=(
        (1, 210.15), (2, 375.41), (4, 769.49), (8, 1438.07), (16, 2812.84), (24, 3809.91), (32, 4767.74))),
    Series("p100_ib_4gpu", "resnet50", 64, HOROVOD_2018, source=_THESIS, images_per_sec=(
        (1, 234.01), (2, 424.27), (4, 856.30), (8, 1683.31), (16, 3301.11), (24, 4832.52), (32, 6210.30))),
    Series("p100_ib_4gpu", "resnet50", 128, HOROVOD_2018, source=_THESIS, images_per_sec=(
        (1, 249.28), (2, 466.31), (4, 953.63), (8, 1855.84), (16, 3646.30), (24, 5439.04), (32, 6643.48))),
    Series("k80_ec2_p2_8xlarge", "resnet50", 64, _PARAMETER_SERVERS, source=_TF_BENCHMARKS, images_per_sec=(
        (1, 52.4), (8, 378), (16, 751), (32, 1388), (64, 2744))),
    Series("k80_ec2_p2_8xlarge", "inception_v3", 64, _PARAMETER_SERVERS, source=_TF_BENCHMARKS, images_per_sec=(
        (1, 29.7), (8, 229), (16, 459), (32, 902), (64, 1783))),
    Series("k80_ec2_p2_8xlarge", "resnet152", 32, _PARAMETER_SERVERS, source=_TF_BENCHMARKS, images_per_sec=(
        (1, 19.4), (8, 146), (16, 291), (32, 565), (64, 981))),
    Series("pascal_roce_25g", "inception_v3", 64, HOROVOD_2018, source=f"{_HOROVOD_16}; {_HOROVOD_128}",
           one_gpu=134.4, images_per_sec=((16, 2022.6),), efficiencies=((128, 0.90),)),
    Series("pascal_roce_25g", "resnet101", 64, HOROVOD_2018, source=f"{_HOROVOD_16}; {_HOROVOD_128}",
           one_gpu=119.4, images_per_sec=((16, 1746.2),), efficiencies=((128, 0.90),)),
    Series("pascal_roce_25g", "vgg16", 64, HOROVOD_2018, source=f"{_HOROVOD_16}; {_HOROVOD_128}",
           one_gpu=130.9, images_per_sec=((16, 1787.4),), efficiencies=((128, 0.79),)),
    # 512 GPUs (May 2018): assumed Horovod's hierarchical all-reduce (NCCL in the node, MPI between nodes),
    # new in Horovod 0.13 a month before; a flat ring over 512 GPUs has 1022 sequential steps per message.
    Series("pascal_roce_25g", "inception_v3", 64, _HOROVOD_2018_HIERARCHICAL, source=_HOROVOD_512, one_gpu=134.4,
           efficiencies=((512, 0.90),)),
    Series("pascal_roce_25g", "resnet101", 64, _HOROVOD_2018_HIERARCHICAL, source=_HOROVOD_512, one_gpu=119.4,
           efficiencies=((512, 0.90),)),
    Series("pascal_roce_25g", "vgg16", 64, _HOROVOD_2018_HIERARCHICAL, source=_HOROVOD_512, one_gpu=130.9,
           efficiencies=((512, 0.68),)),
    Series("pascal_tcp_40g", "inception_v3", 64, HOROVOD_2018, source=_HOROVOD_64, one_gpu=148.8,
           images_per_sec=((64, 7932.1),)),
    Series("pascal_tcp_40g", "resnet101", 64, HOROVOD_2018, source=_HOROVOD_64, one_gpu=136.0,
           images_per_sec=((64, 7741.6),)),
    Series("pascal_tcp_40g", "vgg16", 64, HOROVOD_2018, source=_HOROVOD_64, one_gpu=149.6,
           images_per_sec=((64, 6084.2),)),
)


@functools.lru_cache(maxsize=None)
def model_layers(name: str) -> tuple[tuple[int, int], ...]:
    """(gradient bytes, forward FLOPs) per layer of the published runs' models, from their Keras definitions."""
    import keras

    from tfscale.model import models, stats

    builders = {
        "inception_v3": lambda: keras.applications.InceptionV3(weights=None),
        "vgg16": lambda: keras.applications.VGG16(weights=None),
    }
    model = builders[name]() if name in builders else models.create(name, num_classes=1000, input_shape=(224, 224, 3))
    return tuple(stats.layer_costs(model))


# Each system's one calibration run, (model, batch per GPU, GPUs): its first multi-node point of a middle
# series. It sets the system's overlap_efficiency and is left out of the error statistics.
CALIBRATION = {
    "p100_ib_4gpu": ("resnet50", 64, 8),
    "k80_ec2_p2_8xlarge": ("resnet50", 64, 16),
    "pascal_roce_25g": ("resnet101", 64, 16),
    "pascal_tcp_40g": ("resnet101", 64, 64),
}


def _series_inputs(series: Series) -> tuple[plan_model.Workload, plan_model.System]:
    one = series.one_gpu or dict(series.images_per_sec)[1]
    system = dataclasses.replace(SYSTEMS[series.system], gpu_images_per_sec=one)
    workload = plan_model.Workload(model=series.model, per_gpu_batch=series.per_gpu_batch,
                                   layers=model_layers(series.model), **series.implementation)
    return workload, system


def calibrated_systems() -> dict[str, plan_model.System]:
    """SYSTEMS with overlap_efficiency set from each one's CALIBRATION run."""
    systems = {}
    for name, (model, batch, gpus) in CALIBRATION.items():
        series = next(s for s in SERIES if (s.system, s.model, s.per_gpu_batch) == (name, model, batch))
        workload, system = _series_inputs(series)
        efficiency = dict(series.published())[gpus]
        value = plan_model.calibrate_overlap(workload, system, gpus, efficiency)
        systems[name] = dataclasses.replace(SYSTEMS[name], overlap_efficiency=round(value, 3), calibration=(
            f"{model}, batch {batch}, {gpus} GPUs: published efficiency {efficiency:.3f}"))
    return systems


def compare() -> list[dict]:
    """Every published multi-GPU point beside the model's prediction for it."""
    systems, rows = calibrated_systems(), []
    for series in SERIES:
        workload, system = _series_inputs(series)
        system = dataclasses.replace(systems[series.system], gpu_images_per_sec=system.gpu_images_per_sec)
        for gpus, efficiency in series.published():
            predicted = plan_model.predict(workload, system, [gpus])[0]["efficiency"]
            rows.append({"system": series.system, "model": series.model, "batch": series.per_gpu_batch, "gpus": gpus,
                         "published": efficiency, "predicted": predicted, "error_points": 100 * (predicted - efficiency),
                         "calibration": CALIBRATION[series.system] == (series.model, series.per_gpu_batch, gpus)})
    return rows


def markdown(rows: list[dict]) -> str:
    systems = calibrated_systems()
    lines = ["| system | overlap_efficiency | calibrated on |", "|---|---|---|"]
    lines += [f"| {name} | {s.overlap_efficiency:.3f} | {s.calibration} |" for name, s in systems.items()]
    lines += ["", "| system | model | batch/GPU | GPUs | published efficiency | predicted | error (points) |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        error = "(calibration)" if r["calibration"] else f"{r['error_points']:+.1f}"
        lines.append(f"| {r['system']} | {r['model']} | {r['batch']} | {r['gpus']} | {r['published']:.3f} | "
                     f"{r['predicted']:.3f} | {error} |")
    errors = [abs(r["error_points"]) for r in rows if not r["calibration"]]
    lines += ["", f"{len(errors)} points (the {len(systems)} calibration runs left out): median absolute error "
                  f"{statistics.median(errors):.1f} efficiency points, worst {max(errors):.1f}."]
    return "\n".join(lines)
