"""float16 loss scaling skips a step on every replica or on none: the step checks the gradients after
their all-reduce (`Cluster.reduce_gradients`), with no collective of its own.

Only one replica's gradients overflow while every loss stays finite: the model's logits pass a
layer that is the identity forward and multiplies its gradient by a per-example factor read from
the input's last column (1.0, or inf on the poisoned replica's examples).

The two-replica scenarios run in processes of their own, with this file as their driver (`python
tests/test_fp16_consensus.py SCENARIO OUT.json`): `mirrored` must split the CPU into two devices
before TensorFlow starts, `mwms` and `horovod` need one process per worker; the tests read the
drivers' JSON and check the numbers.
"""

import copy
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, quiet_env

from tfscale.launch import launch
from tfscale.launch.rendezvous import HorovodRendezvous

NUM_FEATURES = 4
NUM_CLASSES = 3
PER_REPLICA_BATCH = 4
POISONED_REPLICA = 1
INITIAL_SCALE = 2.0**15  # Keras' LossScaleOptimizer default
WORKER_TIMEOUT_S = 120  # a hang fails the test instead of blocking it


# --- the driver (runs in the subprocesses) ----------------------------------------------------------


def _config(backend: str):
    from tfscale import config as tfs_config

    cfg = tfs_config.base_config()
    cfg.precision = "mixed_float16"
    cfg.data.num_classes = NUM_CLASSES
    cfg.data.global_batch_size = 2 * PER_REPLICA_BATCH  # two replicas in both scenarios
    cfg.optim.lr_per_256 = 3.2  # LR 0.1 for this batch: the weights visibly move in one step
    cfg.distribute.backend = backend
    cfg.distribute.num_cpu_devices = 2
    cfg.distribute.collective_timeout_s = 60.0  # a collective nobody joins fails instead of hanging
    cfg.optim.compiled_update = True  # float16 runs on GPUs, whose replicas compile the update (step_modes)
    return cfg


def _gradient_scaled_model():
    """A linear classifier whose logits' gradient is multiplied by the input's last column."""
    import keras
    import tensorflow as tf

    @tf.custom_gradient
    def scale_gradient(logits, factor):
        return tf.identity(logits), lambda upstream: (upstream * factor, tf.zeros_like(factor))

    class GradientScaledLinear(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(NUM_CLASSES)

        def call(self, inputs, training=False):
            logits = self.dense(inputs[:, :-1])
            return scale_gradient(logits, tf.cast(inputs[:, -1:], logits.dtype))

    model = GradientScaledLinear()
    model(np.zeros([1, NUM_FEATURES + 1], np.float32))
    return model


def _build(cfg, cluster, reduced_gradients: bool):
    """The model and its optimizer (loss-scaled under float16), initialised alike on every call (seed 0)."""
    import keras

    from tfscale.training import engine

    keras.utils.set_random_seed(0)
    with cluster.strategy.scope():
        model = _gradient_scaled_model()
        optimizer = engine.build_optimizer(cfg, model, reduced_gradients=reduced_gradients)
    return model, optimizer


def _batch(strategy, step: int, poisoned: bool, first_replica: int):
    """Per-replica (inputs, labels) of `step`; the poisoned replica's gradient factor is inf.
    `first_replica`: the job-wide index of this process's first replica (a Horovod rank's strategy
    numbers its one replica 0)."""
    import tensorflow as tf

    def replica_batch(context):
        replica = first_replica + context.replica_id_in_sync_group
        rng = np.random.default_rng([step, replica])
        inputs = rng.normal(size=[PER_REPLICA_BATCH, NUM_FEATURES + 1]).astype(np.float32)
        inputs[:, -1] = np.inf if poisoned and replica == POISONED_REPLICA else 1.0
        labels = rng.integers(0, NUM_CLASSES, PER_REPLICA_BATCH)
        return tf.constant(inputs), tf.constant(labels)

    return strategy.experimental_distribute_values_from_function(replica_batch)


class _Trainer:
    """tfscale's own replica step (`engine.make_replica_step`) on the model, and what it leaves behind."""

    def __init__(self, cfg, cluster, reduced_gradients: bool = True):
        import tensorflow as tf

        from tfscale.training import engine

        self.cluster = cluster
        self.first_replica = cluster.rank if cluster.backend == "horovod" else 0
        self.model, self.optimizer = _build(cfg, cluster, reduced_gradients)
        replica_step = engine.make_replica_step(cfg, cluster, self.model, self.optimizer)
        variables = self.model.trainable_variables

        @tf.function
        def train_step(inputs, labels):
            # The job's loss, as a loop returns it after its last step.
            return cluster.sum_over_processes(engine.run_replica_step(cluster, replica_step, inputs, labels,
                                                                      tf.constant(0.0)))

        @tf.function
        def read_weights():  # each replica's own copy, read inside the replicas
            return cluster.strategy.run(lambda: [tf.identity(v.value) for v in variables])

        self._step, self._read = train_step, read_weights

    def step(self, step: int, poisoned: bool = False) -> dict:
        loss = self._step(*self._batch(step, poisoned)).numpy()[0]  # [loss, top-1, stopping]
        return {"loss": float(loss), **self.state()}

    def _batch(self, step: int, poisoned: bool):
        return _batch(self.cluster.strategy, step, poisoned, self.first_replica)

    def collectives_per_step(self) -> int:
        """All-reduces in the traced step (the gradients' and the loss's), counted in its graph."""
        graph = self._step.get_concrete_function(*self._batch(0, False)).graph.as_graph_def()
        nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
        return sum(node.op.startswith("CollectiveReduce") or node.op.startswith("HorovodAllreduce")
                   or node.op.startswith("HorovodGroupedAllreduce") for node in nodes)

    def state(self) -> dict:
        per_variable = [self.cluster.strategy.experimental_local_results(w) for w in self._read()]
        per_replica = zip(*per_variable)  # this process's replicas, each with all its weights
        return {
            "weights": [np.concatenate([np.ravel(w) for w in replica]).tolist() for replica in per_replica],
            "scale": float(self.optimizer.dynamic_scale.numpy()) if hasattr(self.optimizer, "dynamic_scale") else None,
            "iterations": int(self.optimizer.iterations.numpy()),
        }


def _as_keras_sums(cluster):
    """`cluster` and optimizer as Keras' `fit` has them: each replica hands its own gradients to the
    optimizer, which checks them for inf/NaN before it sums them."""
    import dataclasses

    from tfscale.cluster.collectives import StrategyCollectives

    class KerasSums(StrategyCollectives):
        def reduce_gradients(self, grads):
            return grads

    return dataclasses.replace(cluster, _collectives=KerasSums(cluster.strategy))


def run_mirrored() -> dict:
    """Two CPU replicas: poisoned step then clean step, the same without agreement, and a clean reference."""
    from tfscale.cluster import distribute
    from tfscale.training import engine

    cfg = _config("mirrored")
    cluster = distribute.setup(cfg.distribute)
    with engine.precision_policy(cfg.precision):
        fixed = _Trainer(cfg, cluster)
        fixed_run = [fixed.state(), fixed.step(0, poisoned=True), fixed.step(1)]
        keras_cfg = copy.deepcopy(cfg)
        keras_cfg.optim.compiled_update = False  # Keras' own apply_gradients, as in fit
        unfixed = _Trainer(keras_cfg, _as_keras_sums(cluster), reduced_gradients=False)
        unfixed_run = [unfixed.state(), unfixed.step(0, poisoned=True)]
        reference = _Trainer(cfg, cluster)  # step 1's batch alone, from the same initial weights
        reference_run = [reference.state(), reference.step(1)]
    return {"replicas": cluster.num_replicas, "fixed": fixed_run, "unfixed": unfixed_run, "reference": reference_run}


def run_workers(backend: str) -> dict:
    """One replica per worker: clean, poisoned (worker 1's gradients only), clean, clean; and the
    collectives a float16 step and a float32 step run."""
    from tfscale.cluster import distribute
    from tfscale.training import engine

    cfg = _config(backend)
    cluster = distribute.setup(cfg.distribute)
    with engine.precision_policy(cfg.precision):
        trainer = _Trainer(cfg, cluster)
        run = [trainer.state()] + [trainer.step(i, poisoned=(i == 1)) for i in range(4)]
        collectives = {"mixed_float16": trainer.collectives_per_step()}
    cfg.precision = "float32"
    with engine.precision_policy(cfg.precision):
        collectives["float32"] = _Trainer(cfg, cluster).collectives_per_step()
    return {"rank": cluster.rank, "replicas": cluster.num_replicas, "run": run, "collectives": collectives}


# --- the tests ---------------------------------------------------------------------------------------


def start_driver(scenario, out, log, **env_extra):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), scenario, str(out)], cwd=REPO,
                            env=quiet_env(**env_extra), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(procs, logs):
    """Waits (bounded) for every driver; kills them all on a hang or a failure and shows the logs."""
    deadline = time.time() + WORKER_TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            p.kill()
    tails = "\n".join(f"--- {log}\n{open(log).read()[-3000:]}" for log in logs)
    assert codes is not None, f"drivers still running after {WORKER_TIMEOUT_S}s (hang)\n{tails}"
    assert codes == [0] * len(procs), tails


def assert_finite(weights):
    assert np.all(np.isfinite(weights)), weights


@pytest.mark.slow
def test_mirrored_replicas_skip_together_when_one_overflows(tmp_path):
    out, log = tmp_path / "mirrored.json", tmp_path / "mirrored.log"
    finish([start_driver("mirrored", out, log)], [log])
    result = json.loads(out.read_text())
    assert result["replicas"] == 2
    init, skipped, clean = result["fixed"]

    # Checked before the sum (Keras' fit), replica 0's clean check decides for both: replica 1's inf is summed in.
    unfixed = result["unfixed"][1]
    assert np.isfinite(unfixed["loss"])  # only the gradients overflowed
    assert unfixed["iterations"] == 1 and unfixed["scale"] == INITIAL_SCALE
    assert all(np.isnan(w).any() for w in unfixed["weights"])

    # Checked after it, both replicas skip: no weight moves, the scale halves once, the step is not counted.
    assert np.isfinite(skipped["loss"])
    assert skipped["iterations"] == 0 and skipped["scale"] == INITIAL_SCALE / 2
    for replica_weights in skipped["weights"]:
        assert_finite(replica_weights)
        assert replica_weights == init["weights"][0]

    # The next clean step applies on both replicas, exactly as step 1 alone from the same weights
    # (the halved scale is a power of two, so the unscaled gradients are the same numbers).
    assert clean["iterations"] == 1 and clean["scale"] == INITIAL_SCALE / 2
    assert clean["weights"][0] == clean["weights"][1]
    assert_finite(clean["weights"][0])
    moved = np.abs(np.subtract(clean["weights"][0], init["weights"][0])).max()
    assert moved > 1e-3
    reference = result["reference"][1]
    assert reference["iterations"] == 1 and reference["scale"] == INITIAL_SCALE
    np.testing.assert_allclose(clean["weights"][0], reference["weights"][0], rtol=1e-6, atol=1e-7)


def start_workers(backend, tmp_path):
    """The driver as two workers of `backend`; returns their JSON results, rank 0's first."""
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    rendezvous = HorovodRendezvous(2) if backend == "horovod" else None
    address = rendezvous.port if rendezvous else launch.free_ports(2)
    try:
        procs = [start_driver(backend, outs[rank], logs[rank], **launch.worker_env(rank, 2, address, backend, 1))
                 for rank in range(2)]
        finish(procs, logs)  # both exit: neither waits in an all-reduce the other skipped
    finally:
        if rendezvous:
            rendezvous.stop()
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_workers_skip_together_when_one_overflows(tmp_path, backend):
    runs = start_workers(backend, tmp_path)
    assert [r["rank"] for r in runs] == [0, 1] and runs[0]["replicas"] == 2
    run0, run1 = runs[0]["run"], runs[1]["run"]

    for before, after in zip(run0, run1):  # the same state on both workers after every step
        assert before == after
    init, first, skipped, second, third = run0
    assert [s["iterations"] for s in run0] == [0, 1, 1, 2, 3]
    assert [s["scale"] for s in run0] == [INITIAL_SCALE, INITIAL_SCALE, INITIAL_SCALE / 2,
                                          INITIAL_SCALE / 2, INITIAL_SCALE / 2]
    assert skipped["weights"] == first["weights"]  # worker 1's overflow skipped the update on both
    assert np.isfinite(skipped["loss"])
    for state in (first, second, third):
        assert_finite(state["weights"][0])
    assert first["weights"] != init["weights"] and third["weights"] != second["weights"] != first["weights"]

    # The decision takes no collective of its own: a float16 step runs the float32 step's all-reduces
    # (the gradients' and the loss's).
    for run in runs:
        assert run["collectives"]["mixed_float16"] == run["collectives"]["float32"] >= 2


if __name__ == "__main__":
    SCENARIOS = {"mirrored": run_mirrored, "mwms": lambda: run_workers("mwms"),
                 "horovod": lambda: run_workers("horovod")}
    with open(sys.argv[2], "w") as f:
        json.dump(SCENARIOS[sys.argv[1]](), f)
