"""tfscale-doctor's speed checks: the all-reduce bandwidth between a node's GPUs, and one GPU's ResNet-50
training rate beside the figure published for that GPU and beside what the node's input pipeline delivers.
"""

from __future__ import annotations

import os
import statistics

import tensorflow as tf

from tfscale.perf import allreduce_bench, gpu_probe
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


def check_gpu_bandwidth(gpus: list) -> Check:
    if len(gpus) < 2:
        return Check("gpu-bandwidth", NA, f"needs 2 or more GPUs on the node (this one: {len(gpus)})")
    names = [f"/gpu:{i}" for i in range(len(gpus))]
    seconds = gpu_probe.allreduce_seconds(names, BANDWIDTH_BYTES, BANDWIDTH_CALLS, tf.distribute.NcclAllReduce())
    algbw, busbw = allreduce_bench.bus_bandwidth(BANDWIDTH_BYTES, seconds, len(gpus))
    return Check("gpu-bandwidth", PASS, f"NCCL all-reduce of {BANDWIDTH_BYTES >> 20} MiB over {len(gpus)} GPUs "
                                        f"({BANDWIDTH_CALLS} in one graph call, as nccl-tests times them): "
                                        f"{seconds * 1e3:.2f} ms, algbw {algbw:.1f} GB/s, busbw {busbw:.1f} GB/s")


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
