"""Test driver: trains like `python -m tfscale.train`, then saves this worker's final weights.

    python tests/helpers/train_and_dump.py WEIGHTS.npz --config=... --workdir=... [--config.x=y ...]

Every worker writes its own file (and WEIGHTS_init.npz before the first step, WEIGHTS_steps.json: a digest of
its weights after every step), so tests can compare the weights each worker ends up with
(the chief's checkpoint alone cannot show that the workers agree). `{rank}` in WEIGHTS.npz becomes the
Horovod rank, for launchers (horovodrun, mpirun, srun) that start every rank with the same arguments.
`--freeze_bn` (first after WEIGHTS.npz) trains with BatchNorm frozen: no batch-size dependence left,
so runs that split a batch differently (gradient accumulation) must compute the same update.

Faults at exact points, for tests/test_reliability.py (each option right after WEIGHTS.npz, any order):
  --stop_after_step=N         every worker ends the run at the end of the loop holding step N (checkpointed)
  --sigterm_at_step=N:RANK    worker RANK sends itself SIGTERM after step N's callbacks (right before the
                              checkpoint save of a checkpoint step: Python runs the handler at once)
  --sigterm_in_eval=RANK      worker RANK sends itself SIGTERM twice when the first evaluation begins
  --hang_at=PHASE:RANK        worker RANK stops in PHASE (preflight: before the cluster's first all-reduce;
                              restore: before restoring; eval: when the first evaluation begins), creates
                              WEIGHTS_hanging-PHASE and sleeps, for a test to kill it there (kill -9)
"""

import hashlib
import json
import os
import signal
import sys
import time

import keras
import numpy as np

from tfscale import cli
from tfscale.cluster import connect
from tfscale.training import checkpoints, engine, train


class DumpWeights(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path
        self.digests = {}

    def on_train_begin(self, logs=None):
        np.savez(self.path.replace(".npz", "_init.npz"), *[v.numpy() for v in self.model.weights])

    def on_train_batch_end(self, batch, logs=None):
        # A digest of this worker's weights after each step (with train.steps_per_loop=1, exactly that
        # step's): tests compare workers bit for bit between and after local-SGD syncs.
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in self.model.weights)).hexdigest()
        self.digests[int(logs["global_step"])] = digest

    def on_train_end(self, logs=None):
        np.savez(self.path, *[v.numpy() for v in self.model.weights])
        with open(self.path.replace(".npz", "_steps.json"), "w") as f:
            json.dump(self.digests, f)


class Faults(keras.callbacks.Callback):
    """The fault options above, as a callback on the worker of rank `rank`."""

    def __init__(self, rank, stop_after_step=None, sigterm_at_step=None, sigterm_in_eval=None):
        super().__init__()
        self.rank, self.stop_after_step = rank, stop_after_step
        self.sigterm_at_step, self.sigterm_in_eval = sigterm_at_step, sigterm_in_eval
        self.evals = 0

    def on_train_batch_end(self, batch, logs=None):
        step = int(logs["global_step"])
        if self.stop_after_step is not None and step >= self.stop_after_step:
            self.model.stop_training = True
        if self.sigterm_at_step and self.sigterm_at_step == (step, self.rank):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_test_begin(self, logs=None):
        self.evals += 1
        if self.evals == 1 and self.sigterm_in_eval == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # Slurm may signal a task twice
        if self.evals == 1 and HANG_AT == ("eval", self.rank):
            hang("eval")


def hang(phase):
    """Marks that this worker reached `phase` (the file holds its pid), then waits to be killed."""
    with open(OUTPUT.replace(".npz", f"_hanging-{phase}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def hang_before(phase, function):
    """`function`, preceded by a hang on the worker that --hang_at names for `phase`."""
    def wrapped(*args, **kwargs):
        hang(phase)
        return function(*args, **kwargs)
    return wrapped


def pop_fault_options(argv) -> dict:
    options = {}
    while len(argv) > 1 and argv[1].split("=")[0] in ("--stop_after_step", "--sigterm_at_step", "--sigterm_in_eval"):
        name, _, value = argv.pop(1)[2:].partition("=")
        options[name] = tuple(int(v) for v in value.split(":")) if ":" in value else int(value)
    return options


def pop_hang_at(argv):
    if len(argv) > 1 and argv[1].startswith("--hang_at="):
        phase, _, rank = argv.pop(1).split("=")[1].partition(":")
        return phase, int(rank)
    return None


def build_model_with_frozen_bn(cfg, build_model=engine.build_model):
    model = build_model(cfg)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False  # Keras 3: inference-mode statistics, no moving-average updates
    return model


def launcher_rank(env) -> str:
    """This process's rank as its launcher numbered it: horovodrun / tfscale.launch, mpirun, an MWMS TF_CONFIG,
    then srun (`srun --mpi=pmix` tasks get PMIX_RANK and SLURM_PROCID, no OMPI_*)."""
    for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in env:
            return env[key]
    if "TF_CONFIG" in env:
        return str(json.loads(env["TF_CONFIG"]).get("task", {}).get("index", 0))
    return env.get("PMIX_RANK", env.get("SLURM_PROCID", "0"))


def main(cfg, workdir):
    faults = [Faults(int(RANK), **FAULTS)] if FAULTS or HANG_AT else []
    train.main(cfg, workdir, extra_callbacks=[DumpWeights(OUTPUT), *faults])  # SIGTERM: exit code 75, as the CLI


if __name__ == "__main__":
    RANK = launcher_rank(os.environ)
    OUTPUT = sys.argv.pop(1).replace("{rank}", RANK)
    FAULTS = pop_fault_options(sys.argv)
    HANG_AT = pop_hang_at(sys.argv)
    if HANG_AT == ("preflight", int(RANK)):
        connect.preflight_all_reduce = hang_before("preflight", connect.preflight_all_reduce)
    if HANG_AT == ("restore", int(RANK)):
        checkpoints.Checkpoints.restore_or_init = hang_before("restore", checkpoints.Checkpoints.restore_or_init)
    if sys.argv[1] == "--freeze_bn":
        sys.argv.pop(1)
        engine.build_model = build_model_with_frozen_bn
    cli.run_cli(main, workdir_help="workdir")
