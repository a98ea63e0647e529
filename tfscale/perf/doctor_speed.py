"""tfscale-doctor's speed checks: the all-reduce bandwidth between a node's GPUs beside what their links
should carry, and one GPU's ResNet-50 training rate beside the figure published for that GPU and beside what
the node's input pipeline delivers.
"""

from __future__ import annotations

import os
import statistics

import tensorflow as tf

from tfscale.perf import allreduce_bench, collective_probe, gpu_links, gpu_probe
from tfscale.perf.doctor_checks import FAIL, NA, PASS, Check

# One-GPU ResNet-50 training throughput as published (docs/gpu.md "What to expect" gives the sources):
# (name in the GPU's device name, precision, per-GPU batch, images/sec, source).
PUBLISHED_1GPU = (
    ("A100", "mixed_float16", 256, 2375.0, "NVIDIA DeepLearningExamples resnet50v1.5, DGX A100 40 GB, AMP+XLA"),
    ("V100", "mixed_float16", 256, 1270.0, "NVIDIA DeepLearningExamples resnet50v1.5, DGX-1 V100 16 GB, AMP+XLA"),
    ("P100", "float32", 64, 218.0, "tf_cnn_benchmarks, DGX-1 P100, FP32 (2017)"),
)
TENSOR_CORE_CAPABILITY = (7, 0)  # Volta and newer: float16 Tensor Cores
THROUGHPUT_WARMUP_STEPS, THROUGHPUT_STEPS = 5, 20
MIN_THROUGHPUT_BATCH = 32
BANDWIDTH_BYTES = 64 << 20  # per GPU, as a mid-sized fused gradient buffer
BANDWIDTH_CALLS = 10
# Bus bandwidth below this share of the slowest link's one-way rate fails. nccl-tests reaches 75-90 % of it
# for large messages; TensorFlow's dispatch and a 64 MiB message cost some of that, NCCL that does not use the
# links (P2P off, a container without IPC, traffic through host memory or sockets) costs far more.
BANDWIDTH_SHARE = 0.4
# One task's input below this share of its GPU's synthetic step rate: the GPU waits for data every step.
INPUT_SHARE = 0.9
INPUT_WARMUP_BATCHES, INPUT_BATCHES = 5, 20


def gpu_name(gpu) -> str:
    details = tf.config.experimental.get_device_details(gpu)
    capability = details.get("compute_capability")
    return details.get("device_name", gpu.name) + (f" (sm_{capability[0]}{capability[1]})" if capability else "")


def published_figure(name: str) -> tuple | None:
    """The PUBLISHED_1GPU row whose GPU appears in `name`, e.g. 'NVIDIA A100-SXM4-40GB'; None for others."""
    return next((row for row in PUBLISHED_1GPU if row[0] in name), None)


def check_gpu_bandwidth(gpus: list, port_base: int = 0, links: gpu_links.NodeLinks | None = None,
                        message_bytes: int = BANDWIDTH_BYTES) -> Check:
    """Training's all-reduce between the node's GPUs: one MWMS worker process per GPU (as training runs them),
    `message_bytes` through `Cluster.reduce_gradients`, beside what the GPUs' links should carry (`links`: read
    from nvidia-smi and sysfs when not given)."""
    if len(gpus) < 2:
        return Check("gpu-bandwidth", NA, f"needs 2 or more GPUs on the node (this one: {len(gpus)})")
    envs = collective_probe.local_mwms_envs(len(gpus), port_base and port_base + 2, num_workers=len(gpus))
    results = collective_probe.run_probes(envs, "mwms", "AUTO", timed=(message_bytes, BANDWIDTH_CALLS))
    failed = [f"worker {i}: {r.detail}" for i, r in enumerate(results) if not r.ok]
    if failed:
        return Check("gpu-bandwidth", FAIL, f"{len(gpus)} worker processes, one per GPU, failed: " + "; ".join(failed))
    seconds = max(r.seconds_per_all_reduce for r in results)  # the slowest worker's: every step waits for it
    algbw, busbw = allreduce_bench.bus_bandwidth(message_bytes, seconds, len(gpus))
    measured = (f"{results[0].implementation} all-reduce of {message_bytes >> 20} MiB between {len(gpus)} worker "
                f"processes, one per GPU, as training runs ({BANDWIDTH_CALLS} chained in one graph call, as "
                f"nccl-tests times them): {seconds * 1e3:.2f} ms, algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s")
    links = gpu_links.read_node_links() if links is None else links
    return bandwidth_verdict(measured, busbw, links, list(range(len(gpus))))


def bandwidth_verdict(measured: str, busbw: float, links: gpu_links.NodeLinks, gpus: list[int]) -> Check:
    """FAIL below BANDWIDTH_SHARE of the slowest link's rate (`gpu_links.expected_busbw`), or with NVLinks down;
    PASS, saying it was not judged, where the topology is unknown."""
    expected = gpu_links.expected_busbw(links, gpus)
    degraded = gpu_links.degraded_nvlinks(links, gpus)
    if expected is None:
        return Check("gpu-bandwidth", PASS, f"{measured}; not judged: nvidia-smi and sysfs did not say how the GPUs "
                                            "are linked")
    rate, how = expected
    text = f"{measured}; {busbw / rate:.2f}x of {rate:.1f} GB/s ({how})"
    if busbw < BANDWIDTH_SHARE * rate:
        return Check("gpu-bandwidth", FAIL, f"{text}: below {BANDWIDTH_SHARE:.0%}, so NCCL is not using the links. "
                                            "Run with NCCL_DEBUG=INFO to see its transport (P2P/SHM/NET), check "
                                            "NCCL_P2P_DISABLE and NCCL_P2P_LEVEL, `nvidia-smi topo -p2p r`, and "
                                            "PCIe ACS/IOMMU settings")
    if degraded:
        return Check("gpu-bandwidth", FAIL, f"{text}; NVLinks down: {'; '.join(degraded)} (nvidia-smi nvlink -s)")
    return Check("gpu-bandwidth", PASS, text)


def task_cpus(tasks_per_node: int) -> int:
    """The CPUs one training task of the node gets: this process's, shared by `tasks_per_node` tasks."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, tasks_per_node))


def input_verdict(input_rate: float, step_rate: float, data_dir: str, threads: int) -> tuple[str, str]:
    """(PASS or FAIL, why): FAIL when one task's input delivers less than INPUT_SHARE of what its GPU's step takes."""
    share = input_rate / step_rate
    text = (f"input from {data_dir}: {input_rate:.0f} images/sec on {threads} CPU(s), {share:.2f}x the step "
            "(tfscale's ImageNet pipeline: decode, crop, flip, 224 px)")
    if share < INPUT_SHARE:
        return FAIL, (f"{text}: below {INPUT_SHARE:.0%}, so the GPU waits for data. Stage the shards to node-local disk "
                      "(make_sbatch stages by default), give each task more CPUs (--cpus_per_task), or decode on the "
                      "GPU (data.loader=dali)")
    return PASS, text


def check_throughput(cluster, gpus: list, data_dir: str = "", tasks_per_node: int = 1) -> Check:
    """One GPU's synthetic ResNet-50 rate beside the published one; with `data_dir`, the node's input beside it."""
    if not gpus:
        return Check("throughput", NA, "needs a GPU (published ResNet-50 figures are per GPU)")
    name = gpu_name(gpus[0])
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0))
    row = published_figure(name)
    precision = row[1] if row else ("mixed_float16" if tuple(capability) >= TENSOR_CORE_CAPABILITY else "float32")
    batch = row[2] if row else 128
    out_of_memory = []
    while True:  # the published batch may not fit this GPU's memory with Keras 3's ResNet-50: halve it, say so
        try:
            result = gpu_probe.resnet50_steps(cluster, precision, 224, batch, THROUGHPUT_STEPS, THROUGHPUT_WARMUP_STEPS)
            break
        except tf.errors.ResourceExhaustedError:
            if batch <= MIN_THROUGHPUT_BATCH:
                raise
            out_of_memory.append(batch)
            batch //= 2
    rate = batch / statistics.mean(result["step_s"])
    detail = f"{rate:.0f} images/sec ({name}, {precision}+XLA, batch {batch}, synthetic data)"
    if out_of_memory:
        detail += f" (batch {', '.join(map(str, out_of_memory))} ran out of GPU memory)"
    if row:
        detail += f"; published {row[3]:.0f} ({row[4]}): {rate / row[3]:.2f}x"
    else:
        detail += "; no published figure for this GPU in tfscale's table"
    if not data_dir:
        return Check("throughput", PASS, detail + "; input not timed (--data_dir=SHARDS times it)")
    threads = task_cpus(tasks_per_node)
    input_rate = gpu_probe.input_images_per_sec(data_dir, batch, threads, INPUT_WARMUP_BATCHES, INPUT_BATCHES)
    status, verdict = input_verdict(input_rate, rate, data_dir, threads)
    return Check("throughput", status, f"{detail}; {verdict}")
