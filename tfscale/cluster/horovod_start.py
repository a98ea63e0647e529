"""Starting Horovod for a run: its knobs from the config, `hvd.init`, a rank count the launcher agrees with,
this rank's GPU, and a pre-flight all-reduce (`init_horovod`). distribute.setup builds the Cluster on it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ml_collections
import tensorflow as tf
from absl import logging

from tfscale.cluster import devices, driver, heartbeat
from tfscale.config import HOROVOD_INSTALL_HINT
from tfscale.errors import ConfigError


def import_horovod():
    """horovod.tensorflow, or an error that says how to get a working one."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ImportError(f"distribute.backend=horovod but Horovod is not installed: {HOROVOD_INSTALL_HINT}") from err
    except tf.errors.NotFoundError as err:  # its C++ ops do not load into this TensorFlow
        raise ImportError(
            f"Horovod was built against another TensorFlow than {tf.__version__} ({err}); {HOROVOD_INSTALL_HINT}"
        ) from err
    return hvd


def check_driver(hvd, proc: str = "/proc") -> None:
    """Refuses a Horovod build whose CUDA runtime this node's driver cannot run, before hvd.init(): its first CUDA
    call would otherwise throw inside a TensorFlow op thread and abort every rank (docs/horovod.md 'Which driver')."""
    problems = driver.horovod_driver_problems(os.path.dirname(os.path.dirname(hvd.__file__)), proc)
    if problems:
        raise ConfigError(f"{problems[0]}: every rank would abort at its first GPU all-reduce. Update the driver, or "
                          "rebuild Horovod with `make horovod-gpu` (clang over CUDA 12, or a CUDA 12 module loaded)")


def _horovod_environment(dist_cfg: ml_collections.ConfigDict, env: dict) -> dict[str, str]:
    """Horovod's knobs from the config; hvd.init() reads them from the environment."""
    knobs = {}
    if dist_cfg.horovod_fusion_bytes:
        knobs["HOROVOD_FUSION_THRESHOLD"] = str(dist_cfg.horovod_fusion_bytes)
    if dist_cfg.horovod_cycle_time_ms:
        knobs["HOROVOD_CYCLE_TIME"] = f"{dist_cfg.horovod_cycle_time_ms:g}"
    if "HOROVOD_GLOO_TIMEOUT_SECONDS" not in env:
        # Gloo's rendezvous waits this long for every rank, then fails instead of hanging.
        knobs["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(max(1, int(dist_cfg.connect_timeout_s)))
    return knobs


def _wants_process_sets(dist_cfg: ml_collections.ConfigDict) -> bool:
    return dist_cfg.sync == "local_sgd" and dist_cfg.households > 1


def preflight_horovod(hvd) -> None:
    """Every rank contributes 1; anything but the rank count means the job is broken."""
    total = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="tfscale_preflight"))
    if total != hvd.size():
        raise RuntimeError(f"pre-flight all-reduce counted {total} Horovod ranks, expected {hvd.size()}")


# Where a launcher says how many ranks it started, first match wins: horovodrun / tfscale.launch,
# mpirun (also inside a Slurm job, whose SLURM_* the ranks inherit), an srun step.
LAUNCHER_SIZE_KEYS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def check_horovod_size(size: int, env: dict, controller: str) -> None:
    """Fails when Horovod sees fewer ranks than the launcher started.

    The silent way Horovod breaks under a cluster launcher: `srun -n 2` of a Gloo-only Horovod (or
    of an MPI one without `--mpi=pmix`) gives every task a job of its own (rank 0 of 1), and each
    would train alone and write the same checkpoints.
    """
    found = next(((key, env[key]) for key in LAUNCHER_SIZE_KEYS if key in env), None)
    if found is None or int(found[1]) == size:
        return
    key, value = found
    hint = ("Horovod was built without MPI (`horovodrun --check-build`): install OpenMPI (mpicc on PATH), "
            "rerun `make horovod`" if controller != "MPI" else
            "start the ranks with `srun --mpi=pmix` (the MPI plugin of this Slurm that OpenMPI speaks)")
    raise RuntimeError(f"{key}={value} processes were started but Horovod ({controller} controller) sees {size} "
                       f"rank(s): they would each train alone. {hint}; or use horovodrun --gloo "
                       "(slurm/horovod.sbatch LAUNCHER=horovodrun-gloo)")


def init_horovod(dist_cfg: ml_collections.ConfigDict, env: dict) -> tuple[Any, int]:
    """(horovod.tensorflow initialised with the config's knobs, every rank answering; GPUs this rank keeps: 0 or 1)."""
    hvd = import_horovod()
    check_driver(hvd)
    knobs = _horovod_environment(dist_cfg, env)
    os.environ.update(knobs)
    timeout_s = knobs.get("HOROVOD_GLOO_TIMEOUT_SECONDS", env.get("HOROVOD_GLOO_TIMEOUT_SECONDS"))
    if timeout_s and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:  # a Gloo launcher (horovodrun --gloo, tfscale.launch)
        # Gloo aborts the process (SIGABRT) naming the missing rank numbers; this line says why.
        logging.info("horovod: waiting up to %s s for every rank at the rendezvous (distribute.connect_timeout_s)", timeout_s)
    if _wants_process_sets(dist_cfg):
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # households are registered once every rank is known
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    controller = "MPI" if hvd.mpi_enabled() else "Gloo"
    check_horovod_size(hvd.size(), env, controller)
    if hvd.rank() == 0:
        logging.info("horovod: %d ranks, %s controller", hvd.size(), controller)
    gpus = devices.prepare_gpus(hvd.local_rank(), host=socket.gethostname())
    host_copies = devices.horovod_host_copy_warning(len(gpus), hvd.nccl_built())
    if host_copies:
        logging.warning("horovod: %s", host_copies)
    preflight_horovod(hvd)
    heartbeat.start(hvd, dist_cfg.heartbeat_timeout_s)
    return hvd, len(gpus)
