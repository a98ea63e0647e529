"""Measurements tfscale-doctor makes on a node's devices: the memory TensorFlow's process holds on a GPU as the
CUDA driver reports it, tfscale's ResNet-50 step, the rate of its ImageNet input pipeline on the node's CPUs,
and a batch decoded by DALI.

Each returns numbers; tfscale.perf.doctor turns them into PASS/FAIL. They run on CPU devices too (the tests),
except `gpu_memory_bytes`, which needs a GPU and TensorFlow's CUDA runtime.
"""

from __future__ import annotations

import ctypes
import io as std_io
import os
import time

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from tfscale import config as tfs_config
from tfscale.config import validation
from tfscale.data.input import info, loaders
from tfscale.perf import baselines, benchmark
from tfscale.training import engine


def gpu_memory_bytes(device_index: int) -> tuple[int, int]:
    """(free, total) bytes of GPU `device_index` as the CUDA driver reports them (cudaMemGetInfo), through the
    CUDA runtime TensorFlow already loaded: what the process holds, reserved pool included, unlike
    tf.config.experimental.get_memory_info, which counts only the tensors in it."""
    cudart = ctypes.CDLL("libcudart.so.12")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    for call, args in (("cudaSetDevice", (device_index,)), ("cudaMemGetInfo", (ctypes.byref(free), ctypes.byref(total)))):
        status = getattr(cudart, call)(*args)
        if status:
            raise RuntimeError(f"{call} returned CUDA error {status}")
    return free.value, total.value


def _step_config(precision: str, image_size: int, batch: int) -> ml_collections.ConfigDict:
    cfg = tfs_config.base_config()
    cfg.data.dataset, cfg.data.image_size, cfg.data.global_batch_size = "synthetic", image_size, batch
    cfg.precision, cfg.jit_compile = precision, True
    validation.validate(cfg)
    return cfg


def resnet50_steps(cluster, precision: str, image_size: int, batch: int, num_steps: int,
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


def input_images_per_sec(data_dir: str, per_gpu_batch: int, threads: int, warmup_batches: int,
                         timed_batches: int) -> float:
    """images/sec of one task's training input: the ResNet-50 ImageNet recipe's pipeline (configs/r50_1gpu.py:
    decode, random-resized crop, flip, 224 px) reading the TFRecord shards in `data_dir` with a private pool of
    `threads` threads, as a worker with that share of the node's CPUs reads them."""
    from tfscale.configs import r50_1gpu

    cfg = r50_1gpu.get_config()
    cfg.data.data_dir, cfg.data.global_batch_size, cfg.data.private_threads = data_dir, per_gpu_batch, threads
    info.adopt(cfg.data, info.facts(cfg.data))  # the shards' own counts and classes
    validation.validate(cfg)
    return baselines.dataset_images_per_sec(baselines.tfscale_input(cfg), warmup_batches=warmup_batches,
                                            timed_batches=timed_batches)


def jpeg_batch(count: int = 8) -> list[np.ndarray]:
    from PIL import Image

    rng = np.random.default_rng(0)
    encoded = []
    for _ in range(count):
        buffer = std_io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        encoded.append(np.frombuffer(buffer.getvalue(), np.uint8))
    return encoded


def dali_decode_batch(device: str, device_id: int | None) -> tuple[int, ...]:
    """A batch of JPEGs decoded by DALI on `device` ("mixed": the GPU) and read through DALI's TensorFlow plugin
    (`DALIDataset`, as data.loader=dali reads), files from a temporary directory: the batch's shape."""
    import tempfile

    import nvidia.dali.plugin.tf as dali_tf
    from nvidia.dali import fn, pipeline_def, types

    jpegs = jpeg_batch()
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "0"))
        for i, jpeg in enumerate(jpegs):
            jpeg.tofile(os.path.join(root, "0", f"{i}.jpg"))

        @pipeline_def(batch_size=len(jpegs), num_threads=2, device_id=device_id)
        def decode():
            encoded, label = fn.readers.file(file_root=root)
            return fn.decoders.image(encoded, device=device, output_type=types.RGB).cpu(), label

        with tf.device("/cpu:0"):
            dataset = dali_tf.DALIDataset(pipeline=decode(), batch_size=len(jpegs), num_threads=2, device_id=device_id,
                                          output_shapes=((len(jpegs), 96, 128, 3), (len(jpegs), 1)),
                                          output_dtypes=(tf.uint8, tf.int32), fail_on_device_mismatch=device_id is None)
            images, _ = next(iter(dataset))
    return tuple(images.shape)
