"""tfscale-doctor: a one-minute self-check of a node, one line per check. Run it first on a new cluster.

    tfscale-doctor [--only=gpus,horovod] [--json=PATH]      (python -m tfscale.doctor)
    srun --nodes=N --ntasks-per-node=1 tfscale-doctor --tasks_per_node=4     (slurm/*.sbatch: DOCTOR=1)

Each check prints PASS, FAIL or N/A and why; N/A marks what needs a GPU (or an optional package) that
this node does not have, so on a CPU machine it still runs and lists exactly what a GPU node adds.
The exit code is 1 when a check fails. `--json=PATH` writes the results.

  gpus            the GPUs TensorFlow sees, the one each local rank pins (tfscale.cluster.devices), and a node
                  whose GPUs TensorFlow cannot see (Slurm or /dev/nvidia* say there are some)
  memory-growth   on for every GPU (DALI's GPU decoding and NCCL need memory TensorFlow left free)
  all-reduce      what MultiWorkerMirroredStrategy all-reduces with here (AUTO -> NCCL on a GPU)
  horovod         built with NCCL / MPI / Gloo; a GPU rank without NCCL copies every gradient to the host
  xla-step        one XLA-compiled float32 ResNet-50 training step of tfscale's own step
  float16-step    one mixed_float16 ResNet-50 step: finite loss, finite loss scale
  dali            one batch decoded by DALI on the GPU ("mixed"; CPU decoding shown where there is none)
  gpu-bandwidth   all-reduce bus bandwidth between this node's GPUs (nccl-tests' busbw = algbw 2(n-1)/n)
  throughput      one-GPU synthetic ResNet-50 images/sec beside the figure published for that GPU

The float32 and float16 steps run on the CPU too, at a small size (they prove XLA and loss scaling
work; their speed means nothing there). Throughput runs only on a GPU.
"""

from __future__ import annotations

from tfscale import cli, errors, logs
from tfscale.cluster import horovod_start
from tfscale.config import validation

logs.quiet_tensorflow_banner(__name__)  # run as a program: TF's C++ INFO banner off, before TF is imported

import dataclasses
import importlib.metadata
import importlib.util
import io as std_io
import os
import statistics
import sys
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from tfscale import config as tfs_config
from tfscale import io
from tfscale.cluster import devices, distribute
from tfscale.data.input import loaders
from tfscale.perf import allreduce_bench, benchmark
from tfscale.training import engine

PASS, FAIL, NA = "pass", "fail", "n/a"
CHECK_NAMES = ("gpus", "memory-growth", "all-reduce", "horovod", "xla-step", "float16-step", "dali", "gpu-bandwidth",
               "throughput")  # in the order they run

# One-GPU ResNet-50 training throughput as published (docs/gpu.md "What to expect" gives the sources):
# (name in the GPU's device name, precision, per-GPU batch, images/sec, source).
PUBLISHED_1GPU = (
    ("A100", "mixed_float16", 256, 2375.0, "NVIDIA DeepLearningExamples resnet50v1.5, DGX A100 40 GB, AMP+XLA"),
    ("V100", "mixed_float16", 256, 1270.0, "NVIDIA DeepLearningExamples resnet50v1.5, DGX-1 V100 16 GB, AMP+XLA"),
    ("P100", "float32", 64, 218.0, "tf_cnn_benchmarks, DGX-1 P100, FP32 (2017)"),
)
TENSOR_CORE_CAPABILITY = (7, 0)  # Volta and newer: float16 Tensor Cores
CPU_STEP = dict(image_size=64, batch=2)  # the CPU's XLA and float16 steps: the compile is the check
GPU_STEP = dict(image_size=224, batch=64)
THROUGHPUT_WARMUP_STEPS, THROUGHPUT_STEPS = 5, 20
MIN_THROUGHPUT_BATCH = 32
BANDWIDTH_BYTES = 64 << 20  # per GPU, as a mid-sized fused gradient buffer
BANDWIDTH_CALLS = 10


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | FAIL | NA
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():4}  {self.name:14} {self.detail}"


# --- what the node has -------------------------------------------------------------------------------------


def gpu_name(gpu) -> str:
    details = tf.config.experimental.get_device_details(gpu)
    capability = details.get("compute_capability")
    return details.get("device_name", gpu.name) + (f" (sm_{capability[0]}{capability[1]})" if capability else "")


def published_figure(name: str) -> tuple | None:
    """The PUBLISHED_1GPU row whose GPU appears in `name`, e.g. 'NVIDIA A100-SXM4-40GB'; None for others."""
    return next((row for row in PUBLISHED_1GPU if row[0] in name), None)


# --- the checks --------------------------------------------------------------------------------------------


def check_gpus(gpus: list, tasks_per_node: int) -> Check:
    if not gpus:
        problem = devices.hidden_gpus_problem(0, tf.test.is_built_with_cuda(), venv=sys.prefix)
        if problem:
            return Check("gpus", FAIL, problem)
        return Check("gpus", NA, "no GPU on this node (nothing in /dev/nvidia*, no SLURM_GPUS_ON_NODE), or "
                                 "CUDA_VISIBLE_DEVICES hides them")
    names = [gpu_name(g) for g in gpus]
    try:
        pins = [devices.gpu_for_local_rank(len(gpus), rank) for rank in range(tasks_per_node)]
    except errors.ConfigError as err:
        return Check("gpus", FAIL, f"{len(gpus)} GPU(s) for {tasks_per_node} tasks per node: {err}")
    mapping = ", ".join(f"rank {r} -> GPU {0 if p is None else p}" for r, p in enumerate(pins))
    return Check("gpus", PASS, f"{len(gpus)} x {names[0]}{'' if len(set(names)) == 1 else ' (mixed models!)'}; "
                               f"{tasks_per_node} local rank(s): {mapping}")


def check_memory_growth(gpus: list) -> Check:
    if not gpus:
        return Check("memory-growth", NA, "needs a GPU")
    off = [g.name for g in gpus if not tf.config.experimental.get_memory_growth(g)]
    if off:
        return Check("memory-growth", FAIL, f"off for {', '.join(off)}: TensorFlow would reserve their memory")
    return Check("memory-growth", PASS, f"on for all {len(gpus)} GPU(s): TensorFlow allocates as it goes")


def check_all_reduce(gpus: list, configured: str) -> Check:
    chosen = devices.collective_implementation(configured, len(gpus))
    if not gpus:
        return Check("all-reduce", NA, f"collective_impl={configured} -> {chosen}: TensorFlow's rings without a GPU "
                                       "(NCCL needs one)")
    status = PASS if chosen == "NCCL" else FAIL
    return Check("all-reduce", status, f"MultiWorkerMirroredStrategy all-reduces with {chosen} "
                                       f"(config.distribute.collective_impl={configured})")


def check_horovod(gpus: list) -> Check:
    try:
        hvd = horovod_start.import_horovod()
    except ImportError as err:
        if importlib.util.find_spec("horovod") is None:
            return Check("horovod", NA, "Horovod is not installed (optional: `make horovod`; `make horovod-gpu` "
                                        "builds it with NCCL)")
        return Check("horovod", FAIL, errors.one_line(err))  # installed, but it does not load into this TensorFlow
    built = [name for name, flag in (("NCCL", hvd.nccl_built()), ("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()))
             if flag]
    detail = f"Horovod {importlib.metadata.version('horovod')} built with {', '.join(built) or 'nothing'}"
    problem = devices.horovod_host_copy_warning(len(gpus), hvd.nccl_built())
    if problem:
        return Check("horovod", FAIL, f"{detail}: {problem}")
    missing_nccl = not gpus and not hvd.nccl_built()
    return Check("horovod", PASS, detail + (" (NCCL matters on GPU nodes: `make horovod-gpu`)" if missing_nccl else ""))


def _step_config(precision: str, image_size: int, batch: int) -> tfs_config.ml_collections.ConfigDict:
    cfg = tfs_config.base_config()
    cfg.data.dataset, cfg.data.image_size, cfg.data.global_batch_size = "synthetic", image_size, batch
    cfg.precision, cfg.jit_compile = precision, True
    validation.validate(cfg)
    return cfg


def run_resnet50_steps(cluster, precision: str, image_size: int, batch: int, num_steps: int,
                       warmup_steps: int = 0) -> dict:
    """tfscale's XLA-compiled ResNet-50 training step on one synthetic batch: losses, step times, loss scale."""
    cfg = _step_config(precision, image_size, batch)
    keras.backend.clear_session()  # the previous check's model and optimizer: their GPU memory is reused
    with engine.precision_policy(precision):
        model, optimizer = engine.build_model_and_optimizer(cfg, cluster)
        input_fn = loaders.train_input_fn(cfg.data, seed=0, start_step=0, data_dir="")
        batch_on_device = next(iter(cluster.distribute_dataset(input_fn)))
        step = benchmark.make_batch_step(cfg, cluster, model, optimizer)
        losses, seconds = [], []
        for _ in range(warmup_steps + num_steps):
            start = time.perf_counter()
            losses.append(float(step(batch_on_device)[0]))  # reading the loss waits for the step
            seconds.append(time.perf_counter() - start)
    scale = float(optimizer.dynamic_scale) if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    return {"losses": losses, "step_s": seconds[warmup_steps:], "first_step_s": seconds[0], "loss_scale": scale}


def check_xla_step(cluster, gpus: list) -> Check:
    size = GPU_STEP if gpus else CPU_STEP
    result = run_resnet50_steps(cluster, "float32", size["image_size"], size["batch"], num_steps=1)
    where = f"{len(gpus) and 'GPU' or 'CPU'}, batch {size['batch']} at {size['image_size']} px"
    if not np.isfinite(result["losses"][0]):
        return Check("xla-step", FAIL, f"loss {result['losses'][0]} ({where})")
    return Check("xla-step", PASS, f"compiled and ran in {result['first_step_s']:.1f} s, loss {result['losses'][0]:.3f} "
                                   f"({where})")


def check_float16_step(cluster, gpus: list) -> Check:
    size = GPU_STEP if gpus else CPU_STEP
    result = run_resnet50_steps(cluster, "mixed_float16", size["image_size"], size["batch"], num_steps=2)
    loss, scale = result["losses"][-1], result["loss_scale"]
    detail = f"loss {loss:.3f}, loss scale {scale:g} ({len(gpus) and 'GPU' or 'CPU'}, batch {size['batch']})"
    ok = np.isfinite(loss) and scale is not None and np.isfinite(scale) and scale >= 1
    return Check("float16-step", PASS if ok else FAIL, detail)


def _jpeg_batch(count: int = 8) -> list[np.ndarray]:
    from PIL import Image

    rng = np.random.default_rng(0)
    encoded = []
    for _ in range(count):
        buffer = std_io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        encoded.append(np.frombuffer(buffer.getvalue(), np.uint8))
    return encoded


def dali_decode_batch(device: str, device_id: int | None) -> tuple[int, ...]:
    """Decodes a batch of JPEGs with DALI on `device` ("mixed": the GPU); the batch's shape."""
    from nvidia.dali import fn, pipeline_def, types

    jpegs = _jpeg_batch()

    @pipeline_def(batch_size=len(jpegs), num_threads=2, device_id=device_id, exec_dynamic=True)
    def decode():
        return fn.decoders.image(fn.external_source(source=lambda: jpegs, batch=True), device=device,
                                 output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (images,) = pipe.run()
    if device == "mixed":
        images = images.as_cpu()
    return tuple(images.as_tensor().shape())


def check_dali(gpus: list) -> Check:
    try:
        import nvidia.dali as dali
    except ImportError:
        return Check("dali", NA, "NVIDIA DALI is not installed (optional: `make dali`)")
    if not gpus:
        shape = dali_decode_batch("cpu", None)
        return Check("dali", NA, f"GPU decoding needs a GPU (DALI {dali.__version__} decoded a batch {shape} on the CPU)")
    shape = dali_decode_batch("mixed", 0)
    return Check("dali", PASS, f"DALI {dali.__version__} decoded a batch {shape} on GPU 0 (nvJPEG)")


def allreduce_seconds(device_names: list[str], message_bytes: int, num_calls: int,
                      cross_device_ops: tf.distribute.CrossDeviceOps | None = None) -> float:
    """Median seconds of one all-reduce of `message_bytes` per device, MirroredStrategy over `device_names`."""
    strategy = tf.distribute.MirroredStrategy(device_names, cross_device_ops=cross_device_ops)
    elements = message_bytes // 4

    @tf.function
    def all_reduce():
        def replica():
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([elements]))[0]
        return strategy.experimental_local_results(strategy.run(replica))

    all_reduce()  # trace, and NCCL's communicator set-up
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        [t.numpy() for t in all_reduce()]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_gpu_bandwidth(gpus: list) -> Check:
    if len(gpus) < 2:
        return Check("gpu-bandwidth", NA, f"needs 2 or more GPUs on the node (this one: {len(gpus)})")
    names = [f"/gpu:{i}" for i in range(len(gpus))]
    seconds = allreduce_seconds(names, BANDWIDTH_BYTES, BANDWIDTH_CALLS, tf.distribute.NcclAllReduce())
    algbw, busbw = allreduce_bench.bus_bandwidth(BANDWIDTH_BYTES, seconds, len(gpus))
    return Check("gpu-bandwidth", PASS, f"NCCL all-reduce of {BANDWIDTH_BYTES >> 20} MiB over {len(gpus)} GPUs: "
                                        f"{seconds * 1e3:.2f} ms, algbw {algbw:.1f} GB/s, busbw {busbw:.1f} GB/s")


def check_throughput(cluster, gpus: list) -> Check:
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
            result = run_resnet50_steps(cluster, precision, 224, batch, THROUGHPUT_STEPS, THROUGHPUT_WARMUP_STEPS)
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
    return Check("throughput", PASS, detail)


# --- running them --------------------------------------------------------------------------------------------


def run_checks(tasks_per_node: int = 0, collective_impl: str = "AUTO", only: list[str] | None = None) -> list[Check]:
    """The checks (all, or those named in `only`), in order; one that raises is a FAIL naming the error,
    and the others still run."""
    steps: list[tuple[str, Callable[[], Check]]] = [  # called after the set-up below
        ("gpus", lambda: check_gpus(gpus, tasks_per_node or max(1, len(gpus)))),
        ("memory-growth", lambda: check_memory_growth(gpus)),
        ("all-reduce", lambda: check_all_reduce(gpus, collective_impl)),
        ("horovod", lambda: check_horovod(gpus)),
        ("xla-step", lambda: check_xla_step(cluster, gpus)),
        ("float16-step", lambda: check_float16_step(cluster, gpus)),
        ("dali", lambda: check_dali(gpus)),
        ("gpu-bandwidth", lambda: check_gpu_bandwidth(gpus)),
        ("throughput", lambda: check_throughput(cluster, gpus)),
    ]
    assert tuple(name for name, _ in steps) == CHECK_NAMES
    unknown = set(only or ()) - set(CHECK_NAMES)
    if unknown:
        raise app.UsageError(f"--only: no check named {', '.join(sorted(unknown))} (checks: {', '.join(CHECK_NAMES)})")
    # one_device: memory growth on, first; a node whose GPUs TensorFlow cannot see is the gpus check's finding
    cluster = distribute.setup(tfs_config.base_config().distribute, allow_hidden_gpus=True)
    gpus = tf.config.list_physical_devices("GPU")
    checks = []
    for name, run in steps:
        if only and name not in only:
            continue
        try:
            check = run()
        except Exception as err:  # noqa: BLE001 - a check that crashes is the finding
            check = Check(name, FAIL, f"{type(err).__name__}: {errors.one_line(err)[:400]}")
        print(check.line(), flush=True)
        checks.append(check)
    return checks


def summary_line(checks: list[Check]) -> str:
    counts = {status: sum(c.status == status for c in checks) for status in (PASS, FAIL, NA)}
    line = f"summary: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[NA]} n/a"
    not_applicable = [c.name for c in checks if c.status == NA]
    return line + (f" ({', '.join(not_applicable)})" if not_applicable else "")


# Distributions named in the first line: which TensorFlow wheel (tensorflow-cpu on a GPU node is a finding).
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "keras", "horovod", "nvidia-dali-cuda120", "nvidia-nccl-cu12")


def versions_line() -> str:
    found = []
    for name in _DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"Python {sys.version.split()[0]}, " + ", ".join(found)


def _define_flags() -> None:
    flags.DEFINE_integer("tasks_per_node", 0, "Training tasks per node to map to GPUs (0: one per GPU).")
    flags.DEFINE_string("collective_impl", "AUTO", "config.distribute.collective_impl to resolve.")
    flags.DEFINE_string("json", "", "Also write the results to this JSON file.")
    flags.DEFINE_list("only", [], "Run only these checks (comma-separated names; default: all).")


def _doctor(f: flags.FlagValues) -> None:
    logs.configure()
    logging.set_verbosity(logging.WARNING)  # one line per check; tfscale's INFO lines would bury them
    print(f"tfscale-doctor on {os.uname().nodename}: {versions_line()}", flush=True)
    checks = run_checks(f.tasks_per_node, f.collective_impl, f.only)
    print(summary_line(checks), flush=True)
    if f.json:
        io.write_json(f.json, {"host": os.uname().nodename, "checks": [dataclasses.asdict(c) for c in checks]})
    sys.exit(1 if any(c.status == FAIL for c in checks) else 0)


def run(argv: list[str] | None = None) -> None:
    """Entry point of `tfscale-doctor` and `python -m tfscale.perf.doctor`."""
    cli.run_tool(_doctor, define_flags=_define_flags, errors=(), argv=argv)


if __name__ == "__main__":
    run()
