"""The performance model behind `tfscale-plan`: a data-parallel job's step time at N GPUs, from first principles.

Pure Python, no fitted parameters but one per system (`System.overlap_efficiency`); docs/scaling.md gives
each formula and its source, tests/test_plan.py checks them against hand-computed values.

  compute     T_c = B / X_1: the per-GPU batch over one GPU's images/sec (tfscale-bench, or published)
  gradients   S = the bytes of the model's trainable weights (half of it with float16 on Horovod's wire)
  all-reduce  a ring over the N GPUs (NCCL): 2(N-1)/N S/bw + 2(N-1) lat, with bw and lat those of the
              slowest link the ring crosses (the node's network once the job spans nodes, else the link
              between GPUs: nccl-tests' busbw), NCCL's latency per step; `hierarchical` (Horovod's):
              reduce-scatter and all-gather in the node, MPI's all-reduce between the nodes
  overlap     gradients become ready in reverse layer order during the backward pass (2/3 of T_c, each
              layer's share in proportion to its FLOPs). Implementations that all-reduce tensor by tensor
              (Horovod's DistributedOptimizer, tf_cnn_benchmarks) start when a cycle ends, fusing what is
              ready up to the fusion buffer, one all-reduce at a time; tfscale's step all-reduces the
              whole gradient list after the backward pass (nothing hides) under XLA or with
              distribute.pack_bytes=0, else in buckets of pack_bytes as MWMS packs and PyTorch DDP buckets
              go: a bucket when its last gradient is ready, after the bucket before it. Of what could
              hide, the share `overlap_efficiency` does: the one constant per system, calibrated on one
              stated run
  input       one GPU gets at most cores-per-GPU x decode-rate images/sec, a node at most its storage
              read rate / image size
  update      without optim.compiled_update, Keras' update launches its ops variable by variable: each
              costs a kernel launch (System.op_launch_us)
  step        T = max(T_c + exposed all-reduce + update, B / input rate), X_N = N B / T
"""

from __future__ import annotations

import dataclasses
import math
import statistics

# The backward pass costs twice the forward (two matrix products per forward one), so 2/3 of a step.
BACKWARD_SHARE = 2 / 3
# NCCL's tuner: latency of one ring all-reduce call before its steps (src/graph/tuning.cc baseLatencies,
# Ring / Simple, NVIDIA/nccl 5067397c); the per-step latencies are each System's.
NCCL_BASE_LATENCY_US = 8.4
# NCCL's tree all-reduce, Simple protocol, as its tuner models it (src/graph/tuning.cc, NVIDIA/nccl 01afd20a,
# ncclTopoTuneModel and ncclTopoGetAlgoTime): latency 2 ((g-1) x 28 us + log2(m) x 50 us) for g GPUs on each of
# m nodes (hwLat Tree/Simple, PCIe or NVLink and network; baseLat Tree/Simple 0); bandwidth half of
# min(0.9 busbw, 80 GB/s over > 2 nodes, else 110), times a correction by message size below 256 MiB.
TREE_INTRA_LATENCY_US, TREE_NET_LATENCY_US = 28.0, 50.0
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9)  # 64 B .. 128 MiB
# "nccl": whichever of ring and tree NCCL's tuner finds faster for the message (NCCL >= 2.4 picks trees).
ALGORITHMS = ("ring", "hierarchical", "tree", "nccl")
OVERLAPS = ("none", "per_tensor", "buckets")


@dataclasses.dataclass(frozen=True)
class System:
    """A cluster as the model sees it. Bandwidths are GB/s (1e9 bytes) in one direction."""

    name: str
    gpus_per_node: int
    gpu_images_per_sec: float  # X_1: one GPU, this model, batch and precision (measured or published)
    intra_node_GBps: float  # busbw of an all-reduce among one node's GPUs (NVLink, PCIe)
    intra_node_latency_us: float  # per ring step inside a node
    inter_node_GBps: float  # one node's network (what a ring crossing nodes is limited by)
    inter_node_latency_us: float  # per ring step once the ring crosses nodes
    cpu_cores_per_gpu: float = 0.0  # input: cores decoding for each GPU (0: input not modelled, synthetic data)
    cpu_cores_per_node: float = 0.0  # input: a node's cores, shared by the GPUs the job uses on it (0: cpu_cores_per_gpu)
    decode_images_per_sec_per_core: float = 0.0  # input: JPEG decode + augment rate of one core
    read_MBps_per_node: float = 0.0  # input: what a node reads from storage (0: not limiting)
    image_bytes: float = 110e3  # input: mean encoded image (ImageNet's JPEGs: ~110 KB)
    # The one calibration constant: the share of the all-reduce time spent while the backward pass runs that
    # it hides (1: all of it, the physics; 0: none, as if the GPU waited for every message). How well a
    # framework overlaps, with NCCL's kernels taking SMs and memory bandwidth from the backward pass, is
    # the part no spec sheet gives: calibrated on one stated run per system (docs/scaling.md).
    overlap_efficiency: float = 1.0
    calibration: str = ""  # where overlap_efficiency comes from
    # Stragglers: the spread of one GPU's step time, sigma / mean (0: not modelled). From tfscale-bench on
    # this GPU: (p90 - p50) / (1.2816 p50), a normal distribution's p90 lying 1.2816 sigma above its median.
    step_time_cv: float = 0.0
    # A straggler: the images/sec of one GPU (or node) that is slower every step, not now and then (an older card,
    # a throttled or shared node; 0: none). A synchronous step waits for it whatever the others' spread, which a
    # spread of independent draws cannot express (docs/scaling.md, "A straggler on the bed").
    slowest_gpu_images_per_sec: float = 0.0
    # The update: what launching one GPU kernel outside XLA costs (CUDA's launch latency, a few microseconds;
    # a small elementwise kernel takes about as long to run), paid by each op of an update Keras applies
    # variable by variable (Workload.update_ops).
    op_launch_us: float = 5.0
    host_copy_GBps: float = 12.0  # checkpoint: device to host copy (PCIe Gen3 x16, NCCL topo.h PCI_BW)
    storage_write_MBps: float = 500.0  # checkpoint: what the chief writes to the shared file system
    sources: dict = dataclasses.field(default_factory=dict)  # field -> where its value comes from


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step computes and sends."""

    model: str
    per_gpu_batch: int
    layers: tuple[tuple[int, int], ...]  # (gradient bytes, forward FLOPs per image) per layer, forward order
    algorithm: str = "ring"  # ALGORITHMS
    overlap: str = "none"  # OVERLAPS
    fusion_bytes: int = 0  # all-reduces of at most this many bytes (0: one message per ready set / step)
    cycle_ms: float = 1.0  # per_tensor: how often ready tensors are collected (Horovod's cycle time)
    wire_factor: float = 1.0  # bytes on the wire per gradient byte (0.5: float16 compression)
    # Bytes of the step's other all-reduces, none of which hides (tfscale makes none).
    step_collectives: tuple[int, ...] = ()
    # Bytes of all-reduces once per `steps_per_loop` steps (tfscale: the steps' losses with the stop flag,
    # BatchNorm's moving statistics).
    loop_collectives: tuple[int, ...] = ()
    steps_per_loop: int = 1
    num_train_examples: int = 1_281_167
    epochs: float = 90.0
    # Between the steps: an eval of `num_eval_examples` every `eval_every_epochs`, a checkpoint of `state_bytes`
    # (weights, optimizer slots, BatchNorm statistics) every `checkpoint_every_epochs` (0: none).
    num_eval_examples: int = 50_000
    eval_every_epochs: float = 0.0
    checkpoint_every_epochs: float = 0.0
    state_bytes: int = 0
    async_checkpoint: bool = True  # the step waits for a host copy only, not for the file system
    num_variables: int = 0  # trainable variables
    # Ops the update runs outside XLA, each a kernel launch after the all-reduce (0: optim.compiled_update,
    # one XLA call).
    update_ops: int = 0

    @property
    def gradient_bytes(self) -> int:
        return sum(size for size, _ in self.layers)


# --- all-reduce cost ---------------------------------------------------------------------------------------


def ring_allreduce_s(size_bytes: float, n: int, bandwidth_GBps: float, latency_us: float) -> float:
    """Seconds of a ring all-reduce of `size_bytes` per rank over `n` ranks (nccl-tests' PERFORMANCE.md)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * size_bytes / (bandwidth_GBps * 1e9) + 2 * (n - 1) * latency_us * 1e-6


def allreduce_s(size_bytes: float, num_gpus: int, system: System, algorithm: str = "ring") -> float:
    """Seconds to all-reduce `size_bytes` per GPU over `num_gpus` GPUs packed `gpus_per_node` to a node.

    Latency as NCCL's own tuner counts it (src/graph/tuning.cc, ring): a base latency per call, then
    each of the 2(N-1) steps at the intra-node latency, but the 2(nodes-1) steps that cross nodes at
    the network's.
    """
    if num_gpus <= 1 or size_bytes <= 0:
        return 0.0
    nodes = math.ceil(num_gpus / system.gpus_per_node)
    base_s = NCCL_BASE_LATENCY_US * 1e-6
    if algorithm == "nccl":
        return min(allreduce_s(size_bytes, num_gpus, system, "ring"), allreduce_s(size_bytes, num_gpus, system, "tree"))
    if algorithm == "tree":
        return _tree_allreduce_s(size_bytes, num_gpus, nodes, system)
    if algorithm == "ring" or nodes == 1:  # one ring through every GPU: its steps wait for the slowest link
        bandwidth = system.intra_node_GBps if nodes == 1 else min(system.intra_node_GBps, system.inter_node_GBps)
        inter_steps = 2 * (nodes - 1)
        latency_s = ((2 * (num_gpus - 1) - inter_steps) * system.intra_node_latency_us
                     + inter_steps * system.inter_node_latency_us) * 1e-6
        return base_s + ring_allreduce_s(size_bytes, num_gpus, bandwidth, 0.0) + latency_s
    if algorithm != "hierarchical":
        raise ValueError(f"all-reduce algorithm {algorithm!r} is not one of: {', '.join(ALGORITHMS)}")
    # Reduce-scatter and all-gather in the node move (g-1)/g of S each: one ring all-reduce's worth. Between
    # the nodes an MPI all-reduce of S (Horovod's hierarchical mode): Rabenseifner's reduce-scatter + all-gather,
    # 2 (m-1)/m S / bw + 2 log2(m) latencies (Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), section 4.5).
    in_node = ring_allreduce_s(size_bytes, system.gpus_per_node, system.intra_node_GBps, system.intra_node_latency_us)
    between = (ring_allreduce_s(size_bytes, nodes, system.inter_node_GBps, 0.0)
               + 2 * math.ceil(math.log2(nodes)) * system.inter_node_latency_us * 1e-6)
    return base_s + in_node + between


def _tree_allreduce_s(size_bytes: float, num_gpus: int, nodes: int, system: System) -> float:
    """NCCL's tree all-reduce (see TREE_INTRA_LATENCY_US): a double binary tree between the nodes, a chain in each."""
    per_node = num_gpus / nodes
    latency_s = 2 * ((per_node - 1) * TREE_INTRA_LATENCY_US + math.log2(nodes) * TREE_NET_LATENCY_US) * 1e-6
    bus_GBps = system.intra_node_GBps if nodes == 1 else min(system.intra_node_GBps, system.inter_node_GBps)
    algorithm_GBps = 0.5 * min(0.9 * bus_GBps, 80.0 if nodes > 2 else 110.0)
    log_size = int(math.log2(max(size_bytes / 64, 1)))
    if log_size < len(TREE_CORRECTION):
        algorithm_GBps *= TREE_CORRECTION[log_size]
    return latency_s + size_bytes / (algorithm_GBps * 1e9)


def nccl_choice(size_bytes: float, num_gpus: int, system: System) -> str:
    """The all-reduce algorithm NCCL's tuner would pick for one message of `size_bytes`: "ring" or "tree"."""
    ring, tree = (allreduce_s(size_bytes, num_gpus, system, a) for a in ("ring", "tree"))
    return "tree" if tree < ring else "ring"


def buckets(sizes: list[int], fusion_bytes: int) -> list[int]:
    """Fused message sizes: consecutive tensors packed up to `fusion_bytes` (0: all in one)."""
    if not fusion_bytes:
        return [sum(sizes)] if sizes else []
    fused, current = [], 0
    for size in sizes:
        if current and current + size > fusion_bytes:
            fused.append(current)
            current = 0
        current += size
    return fused + ([current] if current else [])


def exposed_allreduce_s(workload: Workload, system: System, num_gpus: int, compute_s: float) -> tuple[float, float]:
    """(all-reduce seconds in all, seconds of it not hidden behind the backward pass) for one step."""
    wire = [size * workload.wire_factor for size, _ in reversed(workload.layers)]  # the backward pass's order
    cost = lambda size: allreduce_s(size, num_gpus, system, workload.algorithm)  # noqa: E731
    if num_gpus == 1:
        return 0.0, 0.0
    others = (sum(cost(size) for size in workload.step_collectives)
              + sum(cost(size) for size in workload.loop_collectives) / workload.steps_per_loop)
    if workload.overlap == "none":  # after the backward pass, fused messages one after another
        total = sum(cost(size) for size in buckets(wire, workload.fusion_bytes)) + others
        return total, total
    if workload.overlap == "per_tensor":
        total, tail = _per_tensor_timeline(workload, wire, cost, compute_s)
    elif workload.overlap == "buckets":
        total, tail = _bucket_timeline(workload, wire, cost, compute_s)
    else:
        raise ValueError(f"overlap {workload.overlap!r} is not one of: {', '.join(OVERLAPS)}")
    return total + others, tail + (1 - system.overlap_efficiency) * (total - tail) + others


def _ready_times(workload: Workload, compute_s: float) -> tuple[float, list[float]]:
    """(backward seconds, when each layer's gradients are ready in the backward pass's order)."""
    backward_s = BACKWARD_SHARE * compute_s
    flops = [f for _, f in reversed(workload.layers)]
    total_flops = sum(flops) or 1
    ready, done = [], 0.0
    for f in flops:  # a layer's gradients are ready once the backward pass has gone through it
        done += backward_s * f / total_flops
        ready.append(done)
    return backward_s, ready


def _bucket_timeline(workload: Workload, wire: list[float], cost, compute_s: float) -> tuple[float, float]:
    """(all-reduce seconds in all, seconds of it after the backward pass) when buckets of `fusion_bytes`, filled
    in the backward pass's order, each go once their last gradient is ready and the bucket before is sent."""
    backward_s, ready = _ready_times(workload, compute_s)
    network_free, total, first = 0.0, 0.0, 0
    for size in buckets(wire, workload.fusion_bytes):
        last, filled = first, wire[first]
        while filled < size:  # the tensors `buckets` packed into this one
            last += 1
            filled += wire[last]
        network_free = max(ready[last], network_free) + cost(size)
        total += cost(size)
        first = last + 1
    return total, max(0.0, network_free - backward_s)


def _per_tensor_timeline(workload: Workload, wire: list[float], cost, compute_s: float) -> tuple[float, float]:
    """(all-reduce seconds in all, seconds of it after the backward pass) when tensors go as they are ready."""
    backward_s, ready = _ready_times(workload, compute_s)
    cycle_s = workload.cycle_ms * 1e-3
    network_free, sent, total = 0.0, 0, 0.0
    tick = cycle_s or ready[0]
    while sent < len(wire):  # every cycle: what is ready goes out, fused, each message after the previous
        ready_now = [wire[i] for i in range(sent, len(wire)) if ready[i] <= tick]
        for size in buckets(ready_now, workload.fusion_bytes):
            start = max(tick, network_free)
            network_free = start + cost(size)
            total += cost(size)
        sent += len(ready_now)
        # No cycle (cycle_ms=0): each tensor goes as soon as it is ready.
        tick = tick + cycle_s if cycle_s else (ready[sent] if sent < len(wire) else tick)
    return total, max(0.0, network_free - backward_s)


# --- the prediction ------------------------------------------------------------------------------------------


def input_images_per_sec(system: System, num_gpus: int | None = None) -> float:
    """What the CPU and storage can feed one GPU of a `num_gpus` job (inf where not modelled): a node's cores
    and storage are shared by the job's GPUs on it, so a node fills up as GPUs are added."""
    on_node = min(num_gpus or system.gpus_per_node, system.gpus_per_node)
    cores = system.cpu_cores_per_node / on_node if system.cpu_cores_per_node else system.cpu_cores_per_gpu
    limits = []
    if cores and system.decode_images_per_sec_per_core:
        limits.append(cores * system.decode_images_per_sec_per_core)
    if system.read_MBps_per_node:
        limits.append(system.read_MBps_per_node * 1e6 / system.image_bytes / on_node)
    return min(limits) if limits else math.inf


# Ops Keras' apply_gradients adds outside XLA per trainable variable, counted in a traced ResNet-50 step (161
# variables, perf.step_ops.ops_outside_xla): 2,342 against 60 with optim.compiled_update under mixed_float16
# (finite checks, unscaling, loss-scale bookkeeping), 1,509 against 60 without loss scaling.
KERAS_UPDATE_OPS_PER_VARIABLE = {"loss_scaled": (2342 - 60) / 161, "plain": (1509 - 60) / 161}


def keras_update_ops(precision: str, num_variables: int) -> int:
    """The ops Keras' update launches outside XLA each step for `num_variables` variables."""
    kind = "loss_scaled" if precision == "mixed_float16" else "plain"
    return round(KERAS_UPDATE_OPS_PER_VARIABLE[kind] * num_variables)


# Eval runs the forward pass only: a third of a training step's FLOPs per image (BACKWARD_SHARE).
EVAL_SPEEDUP = 1 / (1 - BACKWARD_SHARE)


def between_steps_s(workload: Workload, system: System, num_gpus: int) -> tuple[float, float]:
    """(seconds of one eval, seconds one checkpoint stops the steps) at `num_gpus` GPUs.

    Eval: each GPU its share of the eval set at EVAL_SPEEDUP x its training rate. Checkpoint: with
    asynchronous saving the host copy of the state; otherwise the chief's write, which every worker waits
    for (MWMS saves collectively).
    """
    eval_s = workload.num_eval_examples / (num_gpus * system.gpu_images_per_sec * EVAL_SPEEDUP)
    rate = system.host_copy_GBps * 1e9 if workload.async_checkpoint else system.storage_write_MBps * 1e6
    return eval_s, workload.state_bytes / rate


def slowest_of(num_gpus: int) -> float:
    """z_N: the expected largest of N independent standard normal draws, E[max] = integral of
    x N phi(x) Phi(x)^(N-1) dx (the order statistic's density), integrated numerically. A synchronous step
    waits for the slowest of its N GPUs' compute: T_c (1 + cv z_N)."""
    if num_gpus <= 1:
        return 0.0
    normal, step = statistics.NormalDist(), 0.002
    points = (-8.0 + i * step for i in range(int(16.0 / step) + 1))
    return sum(x * num_gpus * normal.pdf(x) * normal.cdf(x) ** (num_gpus - 1) for x in points) * step


def predict_point(workload: Workload, system: System, num_gpus: int) -> dict:
    batch = workload.per_gpu_batch
    # The mean step's compute, or with stragglers the slowest GPU's (each GPU's time drawn independently).
    compute_s = batch / system.gpu_images_per_sec * (1 + system.step_time_cv * slowest_of(num_gpus))
    if num_gpus > 1 and system.slowest_gpu_images_per_sec:
        compute_s = max(compute_s, batch / system.slowest_gpu_images_per_sec)
    allreduce_total_s, exposed_s = exposed_allreduce_s(workload, system, num_gpus, compute_s)
    input_s = batch / input_images_per_sec(system, num_gpus)
    update_s = workload.update_ops * system.op_launch_us * 1e-6
    step_s = max(compute_s + exposed_s + update_s, input_s)
    images_per_sec = num_gpus * batch / step_s
    epoch_s = workload.num_train_examples / images_per_sec
    eval_s, checkpoint_s = between_steps_s(workload, system, num_gpus)
    between_s = ((eval_s / workload.eval_every_epochs if workload.eval_every_epochs else 0.0)
                 + (checkpoint_s / workload.checkpoint_every_epochs if workload.checkpoint_every_epochs else 0.0))
    return {"gpus": num_gpus, "nodes": math.ceil(num_gpus / system.gpus_per_node), "images_per_sec": images_per_sec,
            "per_gpu_images_per_sec": images_per_sec / num_gpus, "step_ms": step_s * 1e3,
            "compute_ms": compute_s * 1e3, "allreduce_ms": allreduce_total_s * 1e3, "exposed_ms": exposed_s * 1e3,
            "update_ms": update_s * 1e3, "input_bound": input_s > compute_s + exposed_s + update_s,
            "eval_checkpoint_share": between_s / (epoch_s + between_s),
            # What NCCL picks for the step's largest gradient message (the algorithm "nccl" compares both).
            "nccl_algorithm": nccl_choice(max(buckets([s * workload.wire_factor for s, _ in workload.layers],
                                                      workload.fusion_bytes), default=0), num_gpus, system)
            if num_gpus > 1 else "-",
            "hours_for_epochs": workload.epochs * (epoch_s + between_s) / 3600}


def predict(workload: Workload, system: System, gpu_counts: list[int]) -> list[dict]:
    """One row per GPU count: images/sec, speedup and efficiency against 1 GPU and against one full node."""
    rows = [predict_point(workload, system, n) for n in gpu_counts]
    one = predict_point(workload, system, 1)["images_per_sec"]
    node = predict_point(workload, system, system.gpus_per_node)["images_per_sec"]
    for row in rows:
        row["speedup"] = row["images_per_sec"] / one
        row["efficiency"] = row["speedup"] / row["gpus"]
        # E_G = (X_G / X_ref) / (G / G_ref) with the reference one node of G_ref GPUs.
        row["efficiency_vs_node"] = (row["images_per_sec"] / node) / (row["gpus"] / system.gpus_per_node)
    return rows


def calibrate_overlap(workload: Workload, system: System, num_gpus: int, efficiency: float) -> float:
    """The overlap_efficiency at which the model gives `efficiency` at `num_gpus` (clipped to [0, 1]).

    The exposed time is linear in it (`exposed_allreduce_s`), so one measured point determines it.
    """
    compute_s = workload.per_gpu_batch / system.gpu_images_per_sec
    full = dataclasses.replace(system, overlap_efficiency=1.0)
    total, tail = exposed_allreduce_s(workload, full, num_gpus, compute_s)
    never_hidden = exposed_allreduce_s(workload, dataclasses.replace(system, overlap_efficiency=0.0), num_gpus,
                                       compute_s)[1]
    if never_hidden <= tail:
        return 1.0
    exposed = compute_s / efficiency - compute_s  # the step time the point implies, less the compute
    return min(1.0, max(0.0, (never_hidden - exposed) / (never_hidden - tail)))


BUCKET_CANDIDATES = tuple(1 << k for k in range(20, 29))  # 1 MiB .. 256 MiB


def best_bucket_bytes(workload: Workload, system: System, num_gpus: int) -> tuple[int, float]:
    """(distribute.pack_bytes, exposed all-reduce seconds) of the bucket size that exposes least at `num_gpus`
    GPUs: small buckets start sooner, each pays NCCL's per-call latency; the smallest of equals wins."""
    compute_s = workload.per_gpu_batch / system.gpu_images_per_sec
    exposed = {size: exposed_allreduce_s(dataclasses.replace(workload, overlap="buckets", fusion_bytes=size), system,
                                         num_gpus, compute_s)[1] for size in BUCKET_CANDIDATES}
    best = min(exposed.values())
    size = min(size for size, seconds in exposed.items() if seconds <= best * 1.001)
    return size, exposed[size]


def default_gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """1, 2, 4, ... up to a node, then whole nodes doubling: 1, 2, 4, 8, 16, ... max_gpus."""
    counts, n = [], 1
    while n < gpus_per_node and n <= max_gpus:
        counts.append(n)
        n *= 2
    n = gpus_per_node
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    return sorted(set(counts + ([max_gpus] if max_gpus not in counts else [])))
