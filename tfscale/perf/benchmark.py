"""tf_cnn_benchmarks-style throughput measurement, built from the same parts as training.

    python -m tfscale.benchmark --config=configs/r50_1gpu.py --workdir=runs/bench \
        --config.benchmark.mode=synthetic [--config.benchmark.num_batches=100 ...]
    python -m tfscale.launch --num_workers=2 -- -m tfscale.benchmark --config=... --workdir=... \
        --config.distribute.backend=mwms          (or --backend=horovod ... =horovod)
    mpirun -np 4 tfscale-bench --model resnet50 --batch_size 32 --variable_update horovod --num_batches=200
                                  (tf_cnn_benchmarks' own command line: tfscale.perf.tf_cnn_flags)

Modes (`benchmark.mode`):
  synthetic  the full training step (forward, backward, gradient all-reduce, update) on one random
             batch held on the device, as tf_cnn_benchmarks' default: no input cost at all;
  train      the full training step on the configured data (`data.dataset`), input pipeline included;
             `benchmark.compare_keras_fit=True` also times Keras `model.fit` on the same model/data;
  input      the input pipeline alone, against a decode-only ceiling and Keras' image_dataset_from_directory;
  allreduce  all-reduce time, algbw and busbw per message size and for the model's gradients
             (tfscale.perf.allreduce_bench); its last line is the gradients' busbw, not images/sec.

Definitions (one place, the same on every backend). A step is timed from asking for its batch to
reading its loss on the host, so the device has finished it. The first `num_warmup_batches` steps
(tracing, autotuning, cuDNN algorithm search) are excluded from the figures and reported apart.
  per-worker images/sec  = (global batch / workers) / mean step time of that worker; the +/- is the
                           standard error of the per-step rates and jitter 1.4826 x their median
                           absolute deviation, exactly as tf_cnn_benchmarks prints them;
  total images/sec       = the sum over workers, gathered by the chief (the figure to compare with
                           published tables, the last line printed).
Breakdown (benchmark.json `breakdown_ms`, medians): `input_wait` is the time blocked on the
iterator; `compute` the rest of the step; `forward_backward` a variant of the step without
gradient all-reduce and update, on a device-resident batch; `gradient_allreduce` the step's
all-reduce run alone on gradient-sized tensors; `update_and_other` = compute - both.
"""

from __future__ import annotations

from tfscale import cli, logs
from tfscale.cluster import topology
from tfscale.config import validation
from tfscale.workdir import layout

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported
topology.bind_at_start()  # a task of the templates' step: near its GPU, before TF sizes its pools from the mask
logs.import_tensorflow_without_banner()  # a program: TensorFlow without its oneDNN notice

import copy
import json
import os
import platform
import statistics
import sys
import time

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import io
from tfscale.data.input import faults, loaders
from tfscale.model import stats
from tfscale.perf import allreduce_bench, tf_cnn_flags
from tfscale.training import callbacks as tfs_callbacks
from tfscale.training import engine

_RULE = "-" * 64
_MAD_TO_STDDEV = 1.4826  # scales a median absolute deviation to a normal standard deviation


# --- statistics -----------------------------------------------------------------------------------


def speed_stats(step_times_s, images_per_step: int) -> dict:
    """tf_cnn_benchmarks' figures for a list of step times: mean rate, its standard error, jitter."""
    times = np.asarray(step_times_s, dtype=np.float64)
    speeds = images_per_step / times
    return {
        "images_per_sec": float(images_per_step / times.mean()),
        "stderr": float(speeds.std() / np.sqrt(len(speeds))),
        "jitter": float(_MAD_TO_STDDEV * np.median(np.abs(speeds - np.median(speeds)))),
        "median_images_per_sec": float(np.median(speeds)),
        "steps": len(times),
    }


def speed_text(stats: dict) -> str:
    return f"images/sec: {stats['images_per_sec']:.1f} +/- {stats['stderr']:.1f} (jitter = {stats['jitter']:.1f})"


def step_line(step: int, stats: dict, loss: float) -> str:
    """One display line as tf_cnn_benchmarks prints it: step, running rate figures, loss."""
    return f"{step}\t{speed_text(stats)}\t{loss:.3f}"


# --- the timed steps ------------------------------------------------------------------------------


def _device_batch(cluster, input_fn):
    """One batch of `input_fn`, already on every replica's device; reused by every synthetic step."""
    return next(iter(cluster.distribute_dataset(input_fn)))


def make_batch_step(cfg, cluster, model, optimizer):
    """The training step the loop runs (engine), on a given (distributed) batch instead of an iterator;
    returns [this worker's mean loss, its mean top-1, 0].

    The loss is this worker's own, as tf_cnn_benchmarks prints its own: the training loop sums the
    losses over the job once per loop, so summing them every step here would time an all-reduce that
    training does not make.
    """
    replica_step = engine.make_replica_step(cfg, cluster, model, optimizer)
    no_stop = tf.constant(0.0)
    # A worker's sums are its shares of the global batch's mean loss and top-1: 1 / workers of each on average.
    to_worker_mean = tf.constant([float(cluster.size), float(cluster.size), 1.0])

    @tf.function(autograph=False)  # as training's step (engine.STEP_FUNCTIONS_WITHOUT_AUTOGRAPH)
    def batch_step(batch):
        return engine.run_replica_step(cluster, replica_step, *batch, no_stop) * to_worker_mean

    return batch_step


def make_forward_backward_step(cfg, cluster, model, optimizer):
    """The step without gradient all-reduce and update: what each device computes on its own."""
    loss_and_grads = engine.make_loss_and_grads(cfg, cluster, model, optimizer)

    def replica_fn(images, labels):
        shares, grads = loss_and_grads(images, labels)
        # One element of every gradient, so none is pruned, at no cost worth measuring.
        return shares[0] + tf.add_n([tf.reshape(g, [-1])[0] for g in grads])

    @tf.function(autograph=False)
    def forward_backward(batch):
        # Local results only: reducing them across workers would add a collective to the figure.
        return cluster.strategy.experimental_local_results(cluster.strategy.run(replica_fn, args=batch))

    return forward_backward


def run_steps(cfg, next_batch, batch_step, callback_list, per_worker_batch: int, is_chief: bool) -> dict:
    """Runs warm-up + timed steps; prints the display lines (chief); returns per-step times and losses."""
    bench = cfg.benchmark
    total_steps = bench.num_warmup_batches + bench.num_batches
    input_wait_s, compute_s, step_s, losses = [], [], [], []
    if is_chief:
        print("Step\tImg/sec\ttotal_loss", flush=True)
    callback_list.on_train_begin({"global_step": 0})
    for index in range(total_steps):
        callback_list.on_train_batch_begin(index, {"global_step": index})
        start = time.perf_counter()
        batch = next_batch()
        fetched = time.perf_counter()
        loss = float(batch_step(batch)[0])  # reading the loss waits for the whole step
        done = time.perf_counter()
        input_wait_s.append(fetched - start)
        compute_s.append(done - fetched)
        step_s.append(input_wait_s[-1] + compute_s[-1])  # the sum benchmark.json lets readers recompute
        losses.append(loss)
        callback_list.on_train_batch_end(index, {"loss": loss, "global_step": index + 1})
        timed_step = index + 1 - bench.num_warmup_batches
        if timed_step == 0 and is_chief:
            print(f"Done warm up ({bench.num_warmup_batches} steps, first step {1000 * (compute_s[0] + input_wait_s[0]):.0f} ms)")
        if timed_step >= 1 and is_chief and (timed_step == 1 or timed_step % bench.display_every == 0
                                             or timed_step == bench.num_batches):
            timed = step_s[bench.num_warmup_batches:]
            print(step_line(timed_step, speed_stats(timed, per_worker_batch), loss), flush=True)
    callback_list.on_train_end({"global_step": total_steps})
    return {"input_wait_s": input_wait_s, "compute_s": compute_s, "step_s": step_s, "losses": losses}


def breakdown_ms(cfg, cluster, model, optimizer, batch, steps: dict) -> dict:
    """Medians of where a step's time goes (see the module docstring for the definitions)."""
    num_calls = cfg.benchmark.breakdown_batches
    warm = slice(cfg.benchmark.num_warmup_batches, None)
    forward_backward = make_forward_backward_step(cfg, cluster, model, optimizer)
    # The step's gradient all-reduce alone, on tensors of the gradients' shapes (the weights).
    allreduce = allreduce_bench.make_allreduce(cluster, model.trainable_variables)
    result = {
        "input_wait": statistics.median(steps["input_wait_s"][warm]),
        "compute": statistics.median(steps["compute_s"][warm]),
        # two untimed calls each: tracing and warm-up
        "forward_backward": statistics.median(allreduce_bench.timed_calls(forward_backward, 2, num_calls, batch)),
        "gradient_allreduce": statistics.median(allreduce_bench.timed_calls(allreduce, 2, num_calls)),
    }
    result["update_and_other"] = result["compute"] - result["forward_backward"] - result["gradient_allreduce"]
    return {key: round(1000 * value, 3) for key, value in result.items()}


def _benchmark_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` for the run: synthetic mode replaces the configured data with random images."""
    cfg = copy.deepcopy(cfg)  # keeps each key's type (jit_compile takes 'auto' or a bool)
    if cfg.benchmark.mode in ("synthetic", "allreduce"):
        if cfg.data.dataset != "synthetic":
            logging.info("benchmark.mode=%s: random images instead of config.data.dataset=%r", cfg.benchmark.mode,
                         cfg.data.dataset)
        cfg.data.dataset, cfg.data.loader = "synthetic", "tfdata"
        cfg.data.data_dir = cfg.data.stage_dir = cfg.data.tfds_name = ""
    return cfg


def versions() -> dict:
    found = {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__}
    for name, module in (("horovod", "horovod"), ("dali", "nvidia.dali")):  # reported when this run imported it
        found[name] = getattr(sys.modules.get(module), "__version__", None)
    return found


def host_info() -> dict:
    """Where a figure was measured: host, cores, visible devices."""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "devices": [d.name for d in tf.config.list_logical_devices()],
        "gpus": [tf.config.experimental.get_device_details(g).get("device_name", g.name)
                 for g in tf.config.list_physical_devices("GPU")],
    }


def _gather_rates(cluster, steps: dict, per_worker_batch: int, warmup: int) -> list[dict]:
    """Every worker's rate with and without warm-up, gathered in rank order (a collective)."""
    step_s = steps["step_s"]
    timed_ms = [1000 * s for s in step_s[warmup:]]
    # The spread of a worker's step times is what stragglers cost at scale: tfscale-plan reads p50 and p90.
    p50, p90, p99 = (float(np.percentile(timed_ms, q)) for q in (50, 90, 99))
    own = [speed_stats(step_s[warmup:], per_worker_batch)["images_per_sec"],
           speed_stats(step_s, per_worker_batch)["images_per_sec"], p50, p90, p99]
    rows = cluster.gather_per_worker(own)
    return [{"rank": rank, "images_per_sec": round(r[0], 2), "images_per_sec_incl_warmup": round(r[1], 2),
             "median_step_ms": round(r[2], 3), "p90_step_ms": round(r[3], 3), "p99_step_ms": round(r[4], 3)}
            for rank, r in enumerate(rows)]


def _batch_source(cfg, cluster, input_fn):
    """`next_batch()`: the same device-resident batch every step (synthetic mode) or the next input batch."""
    if cfg.benchmark.mode == "synthetic":
        device_batch = _device_batch(cluster, input_fn)
        return lambda: device_batch
    iterator = iter(cluster.distribute_dataset(input_fn))
    return lambda: next(iterator)


def run_step_benchmark(cfg: ml_collections.ConfigDict, workdir: str) -> tuple[dict, bool]:
    """Modes synthetic and train: times the training step on every worker; (report, is this the chief)."""
    run = engine.setup(cfg)
    cluster = run.cluster
    with engine.precision_policy(cfg.precision):
        model, optimizer = engine.build_model_and_optimizer(cfg, cluster)
        input_fn = loaders.train_input_fn(cfg.data, seed=cfg.seed, start_step=0, data_dir=run.data_dir)
        fit_comparison = None
        if cfg.benchmark.compare_keras_fit:
            from tfscale.perf import keras_fit  # model.fit and its second model only when asked for

            fit_comparison = keras_fit.compare_keras_fit(cfg, cluster, model, optimizer, input_fn)
        next_batch = _batch_source(cfg, cluster, input_fn)
        profiler = tfs_callbacks.profiler_callbacks(cfg.profile_steps, layout.tensorboard(workdir),
                                                    is_chief=cluster.is_chief)
        per_worker_batch = cfg.data.global_batch_size // cluster.size
        steps = run_steps(cfg, next_batch, make_batch_step(cfg, cluster, model, optimizer),
                          keras.callbacks.CallbackList(profiler, model=model), per_worker_batch, cluster.is_chief)
        breakdown = breakdown_ms(cfg, cluster, model, optimizer, next_batch(), steps)
    per_worker = _gather_rates(cluster, steps, per_worker_batch, cfg.benchmark.num_warmup_batches)
    report = _step_report(cfg, cluster, steps, per_worker, breakdown, fit_comparison)
    report["model_size"] = stats.describe(model)  # parameters, gradient bytes, FLOPs: what tfscale-plan sends
    if cfg.benchmark.with_allreduce:  # a scaling sweep's point: the all-reduce table of the same job too

        report.update(allreduce_bench.measure_all(cluster, model, cfg.benchmark))
    return report, cluster.is_chief


def _step_report(cfg, cluster, steps: dict, per_worker: list[dict], breakdown: dict, fit_comparison) -> dict:
    warmup = cfg.benchmark.num_warmup_batches
    step_s = steps["step_s"]
    own = speed_stats(step_s[warmup:], cfg.data.global_batch_size // cluster.size)
    report = {
        "mode": cfg.benchmark.mode,
        "model": cfg.model.name,
        "backend": cluster.backend,
        "num_workers": cluster.size,
        "num_replicas": cluster.num_replicas,
        "global_batch_size": cfg.data.global_batch_size,
        "per_worker_batch_size": cfg.data.global_batch_size // cluster.size,
        "num_warmup_batches": warmup,
        "num_batches": cfg.benchmark.num_batches,
        "precision": cfg.precision,
        "total_images_per_sec": round(sum(w["images_per_sec"] for w in per_worker), 2),
        "total_images_per_sec_incl_warmup": round(sum(w["images_per_sec_incl_warmup"] for w in per_worker), 2),
        "chief": {key: round(value, 3) for key, value in own.items()},
        "per_worker": per_worker,
        "step_time_ms": {
            "mean": round(1000 * statistics.mean(step_s[warmup:]), 3),
            "median": round(1000 * statistics.median(step_s[warmup:]), 3),
            "first": round(1000 * step_s[0], 3),
        },
        "steps_ms": {  # the chief's, every step including warm-up (the first is usually the slowest); unrounded,
            # so the printed figures can be recomputed from them exactly
            "input_wait": [1000 * t for t in steps["input_wait_s"]],
            "compute": [1000 * t for t in steps["compute_s"]],
        },
        "losses": steps["losses"],
        "breakdown_ms": breakdown,
        "versions": versions(),
        "host": host_info(),
    }
    if fit_comparison:
        report["keras_fit_comparison"] = fit_comparison
    return report


def print_step_summary(report: dict) -> None:
    chief = report["chief"]
    print(_RULE)
    print(f"{speed_text(chief)}  [per worker, {chief['steps']} steps after {report['num_warmup_batches']} warm-up]")
    print(f"with warm-up steps: total images/sec {report['total_images_per_sec_incl_warmup']:.2f} "
          f"(first step {report['step_time_ms']['first']:.0f} ms)")
    parts = "  ".join(f"{k} {v:.1f}" for k, v in report["breakdown_ms"].items())
    print(f"step breakdown, ms (median): {parts}")
    print(_RULE)
    print(f"total images/sec: {report['total_images_per_sec']:.2f}", flush=True)  # the last line, as documented


def write_report(workdir: str, report: dict, cfg: ml_collections.ConfigDict) -> str:
    os.makedirs(workdir, exist_ok=True)
    path = layout.benchmark(workdir)
    io.write_json(path, {**report, "config": cfg.to_dict()})
    return path


def run_benchmark(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs `cfg.benchmark.mode`; the chief prints the report and writes workdir/benchmark.json."""
    cfg = _benchmark_config(cfg)
    if cfg.benchmark.mode == "input":
        return run_input_benchmark(cfg, workdir)
    if cfg.benchmark.mode == "allreduce":
        return run_allreduce_benchmark(cfg, workdir)
    report, is_chief = run_step_benchmark(cfg, workdir)
    if is_chief:
        path = write_report(workdir, report, cfg)
        if "keras_fit_comparison" in report:
            from tfscale.perf import keras_fit

            keras_fit.print_fit_report(report["keras_fit_comparison"], cfg)
        if "allreduce" in report:

            allreduce_bench.print_report(report)
        print_step_summary(report)
        logging.info("benchmark report: %s", path)
    return report


def run_allreduce_benchmark(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
    """Mode allreduce: every worker all-reduces each message size, then the model's gradients; the chief reports."""

    run = engine.setup(cfg)
    cluster = run.cluster
    with engine.precision_policy(cfg.precision), cluster.strategy.scope():
        model = engine.build_model(cfg)  # only its variables' shapes: what one step all-reduces
    report = {"mode": "allreduce", "model": cfg.model.name, "backend": cluster.backend, "num_workers": cluster.size,
              "num_replicas": cluster.num_replicas, **allreduce_bench.measure_all(cluster, model, cfg.benchmark),
              "versions": versions(), "host": host_info()}
    if cluster.is_chief:
        write_report(workdir, report, cfg)
        allreduce_bench.print_report(report)
        print("-" * 64)
        row = report["model_gradients"]
        print(f"model gradients ({cfg.model.name}, {row['size_bytes'] / 1e6:.1f} MB): busbw {row['busbw_GBps']:.3f} GB/s",
              flush=True)
    return report


def run_input_benchmark(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
    """Mode input: tfscale's input pipeline against the baselines, one process, no model."""
    from tfscale.perf import baselines  # the pipelines tfscale's input is compared with

    validation.validate(cfg)
    if cfg.data.dataset != "tfrecord":
        raise ValueError("config.benchmark.mode='input' needs config.data.dataset='tfrecord' and data_dir")
    report = {"mode": "input", **baselines.compare_input_pipelines(cfg), "versions": versions(), "host": host_info()}
    write_report(workdir, report, cfg)
    baselines.print_input_report(report)
    print(json.dumps({k: v for k, v in report.items() if k.endswith("images_per_sec")}))
    return report


def main(cfg: ml_collections.ConfigDict, workdir: str) -> None:
    """The CLI's work: the benchmark; a data fault ends it with one FATAL line and its exit code."""
    with faults.fatal_on_data_faults():
        run_benchmark(cfg, workdir)


def run():
    """Console-script entry point (`tfscale-bench`); a tf_cnn_benchmarks command line is translated first
    (tfscale.perf.tf_cnn_flags)."""
    sys.argv = tf_cnn_flags.tfscale_argv(sys.argv)
    cli.run_cli(main, workdir_help="Directory for benchmark.json (and a profiler trace).")


if __name__ == "__main__":
    run()
