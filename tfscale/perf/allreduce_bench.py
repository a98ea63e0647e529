"""`benchmark.mode=allreduce`: all-reduce time and bandwidth per message size, in nccl-tests' convention.

    tfscale-launch --num_workers=2 -- -m tfscale.benchmark --config=configs/r50_32gpu.py --workdir=runs/ar \
        --config.benchmark.mode=allreduce [--config.benchmark.allreduce_max_bytes=268435456 ...]

The question it answers on a new cluster: is the interconnect the problem? Every worker all-reduces
float32 tensors of `allreduce_min_bytes` .. `allreduce_max_bytes` (times `allreduce_factor` each
step), then the configured model's own gradient list as one training step sends it, through the
very call the step makes (`Cluster.reduce_gradients`: MWMS with its communication
options, Horovod with its fusion settings). Figures, as nccl-tests defines them
(NVIDIA/nccl-tests doc/PERFORMANCE.md): for S bytes per replica in t seconds over n replicas,

    algbw = S / t          busbw = algbw * 2 (n - 1) / n

busbw is comparable across replica counts: the bandwidth of the slowest link a ring all-reduce
crosses. t is the median over the iterations after warm-up; the chief prints the table and writes
it to benchmark.json (`allreduce`). The figures calibrate `tfscale-plan` (docs/scaling.md).
"""

from __future__ import annotations

import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

FLOAT32_BYTES = 4
# Iterations per size: the configured count, but no more than this many bytes per size in all, and at least 3.
_BYTES_PER_SIZE = 1 << 30
_MIN_ITERATIONS = 3
MAX_CHAINED_CALLS = 20  # sums of ones grow by the replica count each call: 16**20 stays finite in float32


def bus_bandwidth(message_bytes: float, seconds: float, num_replicas: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) of one all-reduce of `message_bytes` per replica."""
    algbw = message_bytes / seconds / 1e9
    return algbw, algbw * 2 * (num_replicas - 1) / num_replicas if num_replicas > 1 else 0.0


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*factor, ... up to max (whole float32 elements), as nccl-tests' -b/-e/-f."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size // FLOAT32_BYTES * FLOAT32_BYTES)
        size *= factor
    return sizes


def iterations(size_bytes: int, configured: int) -> int:
    return max(_MIN_ITERATIONS, min(configured, _BYTES_PER_SIZE // max(size_bytes, 1)))


def timed_calls(fn, num_warmup: int, num_timed: int, *args) -> list[float]:
    """Seconds of each timed call `fn(*args)` after `num_warmup` untimed ones (tracing, warm-up), each call's
    results copied to the host (the device, and any collective, has finished)."""
    for _ in range(num_warmup):
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
    seconds = []
    for _ in range(num_timed):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
        seconds.append(time.perf_counter() - start)
    return seconds


def make_allreduce(cluster, variables):
    """A tf.function all-reducing `variables`' values on every replica as the training step reduces gradients."""

    def replica_fn():
        # A Keras variable is read through the tf.Variable it wraps (`.value`), as the step reads gradients.
        values = [tf.identity(v.value if isinstance(v, keras.Variable) else v) for v in variables]
        reduced = cluster.reduce_gradients(values)
        return tf.add_n([tf.reshape(r, [-1])[0] for r in reduced])  # keeps every result alive, at no cost

    @tf.function(autograph=False)
    def allreduce():
        return cluster.strategy.experimental_local_results(cluster.strategy.run(replica_fn))

    return allreduce


def chained_seconds(cluster, message_bytes: int, num_calls: int) -> float:
    """Seconds per all-reduce of `message_bytes` per replica through training's own call
    (`Cluster.reduce_gradients`), timed as nccl-tests times them: `num_calls` all-reduces back to back in one
    graph call, each on the last one's result (so they run in order, nothing between them), on a buffer filled
    once, after one untimed call (tracing, the communicators). One host sync is shared by all of them."""
    num_calls = min(num_calls, MAX_CHAINED_CALLS)
    with cluster.strategy.scope():
        buffer = tf.Variable(tf.ones([message_bytes // FLOAT32_BYTES]), trainable=False)  # one copy per replica

    def replica_fn():
        value = buffer.read_value()
        for _ in range(num_calls):
            (value,) = cluster.reduce_gradients([value])
        return value[:1]  # four bytes to the host, not the buffer

    @tf.function(autograph=False)
    def chained():
        return cluster.strategy.experimental_local_results(cluster.strategy.run(replica_fn))

    (seconds,) = timed_calls(chained, 1, 1)
    return seconds / num_calls


def measure(cluster, variables, num_bytes: int, bench_cfg) -> dict:
    """One row of the table: `variables` all-reduced together."""
    fn = make_allreduce(cluster, variables)
    count = iterations(num_bytes, bench_cfg.num_batches)
    seconds = statistics.median(timed_calls(fn, max(1, min(bench_cfg.num_warmup_batches, count)), count))
    algbw, busbw = bus_bandwidth(num_bytes, seconds, cluster.num_replicas)
    return {"size_bytes": num_bytes, "tensors": len(variables), "iterations": count, "time_us": seconds * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": busbw}


def run_sizes(cluster, bench_cfg) -> list[dict]:
    """The table over message sizes; every worker runs the same sizes in the same order (a collective)."""
    rows = []
    for size in message_sizes(bench_cfg.allreduce_min_bytes, bench_cfg.allreduce_max_bytes, bench_cfg.allreduce_factor):
        with cluster.strategy.scope():
            buffer = tf.Variable(tf.ones([size // FLOAT32_BYTES]), trainable=False)
        rows.append(measure(cluster, [buffer], size, bench_cfg))
        del buffer
    return rows


def run_model_gradients(cluster, model, bench_cfg) -> dict:
    """The step's own all-reduce: every trainable variable's shape, as one training step sends them."""
    num_bytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)
    return measure(cluster, list(model.trainable_variables), num_bytes, bench_cfg)


def measure_all(cluster, model, bench_cfg) -> dict:
    """The table over message sizes, then the model's gradients: a benchmark report's `allreduce` and
    `model_gradients` (plus what reduced them)."""
    return {"allreduce": run_sizes(cluster, bench_cfg), "model_gradients": run_model_gradients(cluster, model, bench_cfg),
            "all_reduce": cluster.all_reduce}


def print_report(report: dict) -> None:
    print(table(report["allreduce"], report["model_gradients"], header=(
        f"all-reduce over {report['num_replicas']} replicas ({report['num_workers']} workers, {report['backend']}: "
        f"{report['all_reduce']}), float32, median time per size:")), flush=True)


def table(rows: list[dict], model_row: dict | None, header: str) -> str:
    lines = [header, f"{'size(B)':>12} {'tensors':>8} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    for row in rows + ([model_row] if model_row else []):
        lines.append(f"{row['size_bytes']:>12} {row['tensors']:>8} {row['iterations']:>6} {row['time_us']:>12.1f} "
                     f"{row['algbw_GBps']:>12.3f} {row['busbw_GBps']:>12.3f}")
    if model_row:
        lines[-1] += "   <- the model's gradients, as one step sends them"
    return "\n".join(lines)
