"""EMA of the weights (optim.ema_decay): Keras' optimizer EMA inside tfscale's loop, eval, resume, export."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, checkpoint_values, load_config, read_jsonl

from tfscale import export
from tfscale.model import ema, optim
from tfscale.training import checkpoints, engine, init_from, train
from tfscale.workdir import layout

DECAY = 0.9  # small enough that the average over 20 steps is far from the last weights
TINY = (  # 20 steps of the smoke recipe, one step per loop so callbacks see the weights of every step
    "--config.train.epochs=1.0", "--config.train.eval_every_epochs=0.5", "--config.checkpoint.every_epochs=0.5",
    "--config.train.steps_per_loop=1", "--config.data.num_eval_examples=100",
)


def tiny_config(*overrides):
    return load_config("smoke", *TINY, *overrides)


class RecordTrajectory(keras.callbacks.Callback):
    """The trainable weights and the optimizer's EMA after every step; the model and optimizer at the end."""

    def __init__(self):
        super().__init__()
        self.weights, self.averages, self.steps = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(int(logs["global_step"]))
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])
        averages = ema.ema_variables(self.model.optimizer)
        self.averages.append(None if averages is None else [v.numpy().copy() for v in averages])


class StopAtStep(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(logs["global_step"]) >= self.step:
            self.model.stop_training = True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny run with EMA and without, each recording its trajectory."""
    result = {}
    for name, decay in (("ema", DECAY), ("raw", 0.0)):
        workdir = str(tmp_path_factory.mktemp(name))
        recorder = RecordTrajectory()
        summary = train.train_and_evaluate(tiny_config(f"--config.optim.ema_decay={decay}"), workdir,
                                           extra_callbacks=[recorder])
        result[name] = workdir, summary, recorder
    return result


def recompute_ema(trajectory, decay):
    """ema_1 = w_1; ema_t = d * ema_{t-1} + (1 - d) * w_t, in float32 as Keras computes it."""
    d = np.float32(decay)
    averages, current = [], None
    for weights in trajectory:
        if current is None:
            current = [w.astype(np.float32).copy() for w in weights]
        else:
            current = [d * a + (np.float32(1) - d) * w for a, w in zip(current, weights)]
        averages.append(current)
    return averages


# --- the optimizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_make_optimizer_turns_on_keras_ema(name):
    on = optim.make_optimizer(tiny_config(f"--config.optim.name={name}", "--config.optim.ema_decay=0.999").optim,
                              learning_rate=0.1)
    assert on.use_ema and on.ema_momentum == 0.999 and not on.ema_overwrite_frequency
    assert optim.make_optimizer(tiny_config(f"--config.optim.name={name}").optim, learning_rate=0.1).use_ema is False
    # LARS hands the EMA arguments to Keras' base class, and they survive its config round trip.
    clone = type(on).from_config(on.get_config())
    assert clone.use_ema and clone.ema_momentum == 0.999


def test_ema_variables_see_through_loss_scaling_and_are_float32():
    cfg = tiny_config("--config.optim.ema_decay=0.99", "--config.precision=mixed_float16")
    with engine.precision_policy(cfg.precision):
        model = engine.build_model(cfg)
        optimizer = engine.build_optimizer(cfg, model)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and ema.is_on(optimizer)
    averages = ema.ema_variables(optimizer)
    assert len(averages) == len(model.trainable_variables)
    assert {v.dtype for v in averages} == {"float32"}
    assert [tuple(a.shape) for a in averages] == [tuple(v.shape) for v in model.trainable_variables]
    # Optimizer variables: the checkpoint (Checkpoints saves `optimizer`) holds them.
    held = {id(v) for v in optimizer.variables}
    assert all(id(a) in held for a in averages)
    off = engine.build_optimizer(tiny_config(), engine.build_model(tiny_config()))
    assert ema.ema_variables(off) is None and not ema.is_on(off)


def test_swapped_in_restores_raw_weights_even_on_error():
    cfg = tiny_config("--config.optim.ema_decay=0.9")
    model = engine.build_model(cfg)
    optimizer = engine.build_optimizer(cfg, model)
    averages = ema.ema_variables(optimizer)
    for i, average in enumerate(averages):
        average.assign(np.full(average.shape, i + 0.5, np.float32))
    raw = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped_in(model, optimizer):
            for i, v in enumerate(model.trainable_variables):
                np.testing.assert_array_equal(v.numpy(), np.full(v.shape, i + 0.5, np.float32))
            raise RuntimeError("inside")
    for v, r in zip(model.trainable_variables, raw):
        np.testing.assert_array_equal(v.numpy(), r)
    with pytest.raises(ValueError, match="ema_decay is 0"):
        with ema.swapped_in(model, engine.build_optimizer(tiny_config(), model)):
            pass


# --- in the training loop ---------------------------------------------------------------------------


@pytest.mark.slow
def test_ema_equals_numpy_recomputation_over_the_weight_trajectory(runs):
    _, _, recorder = runs["ema"]
    assert recorder.steps == list(range(1, 21))
    expected = recompute_ema(recorder.weights, DECAY)
    for step, (got, want) in enumerate(zip(recorder.averages, expected), start=1):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
    # The first update sets the average to the weights; afterwards it lags them.
    for g, w in zip(recorder.averages[0], recorder.weights[0]):
        np.testing.assert_array_equal(g, w)
    assert max(np.abs(a - w).max() for a, w in zip(recorder.averages[-1], recorder.weights[-1])) > 1e-3


def test_ema_changes_nothing_in_training(runs):
    """Same losses and the same raw weights with EMA on: the eval swaps weights in and back out exactly."""
    (ema_dir, _, with_ema), (raw_dir, _, without) = runs["ema"], runs["raw"]
    for a, b in zip(with_ema.weights, without.weights):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)

    def train_rows(workdir):
        rows = read_jsonl(os.path.join(workdir, layout.METRICS))
        return [(r["step"], r["loss"], r["lr"]) for r in rows if "loss" in r]

    assert train_rows(ema_dir) == train_rows(raw_dir)


def test_eval_reports_raw_and_ema_metrics(runs):
    (ema_dir, ema_summary, _), (raw_dir, raw_summary, _) = runs["ema"], runs["raw"]
    eval_rows = [r for r in read_jsonl(os.path.join(ema_dir, layout.METRICS)) if "eval_top1" in r]
    assert [r["step"] for r in eval_rows] == [10, 20]
    for row in eval_rows:
        assert {"eval_top1_ema", "eval_top5_ema", "eval_loss_ema"} <= set(row)
        assert 0.0 <= row["eval_top1_ema"] <= row["eval_top5_ema"] <= 1.0
    # Raw figures are those of the run without EMA (same weights); the EMA's differ.
    raw_rows = [r for r in read_jsonl(os.path.join(raw_dir, layout.METRICS)) if "eval_top1" in r]
    for row, raw_row in zip(eval_rows, raw_rows):
        assert set(raw_row) == {"step", "epoch", "eval_top1", "eval_top5", "eval_loss", "eval_examples", "time"}
        assert row["eval_loss"] == raw_row["eval_loss"] and row["eval_top1"] == raw_row["eval_top1"]
    assert eval_rows[-1]["eval_loss_ema"] != eval_rows[-1]["eval_loss"]
    for key in ("eval_top1", "eval_top5", "eval_loss"):
        assert ema_summary[key + "_ema"] == eval_rows[-1][key + "_ema"]
        assert ema_summary[key] == raw_summary[key]
    assert set(ema_summary) == set(raw_summary) | {"eval_top1_ema", "eval_top5_ema", "eval_loss_ema"}
    assert not any(key.endswith("_ema") for key in raw_summary)


def newest_checkpoint(workdir: str) -> str:
    """The prefix of the run's newest checkpoint (the model and its optimizer, EMA included, restore from it)."""
    return checkpoints.listed_checkpoints(layout.checkpoints(workdir))[0]


def test_eval_of_the_checkpoint_with_ema_swapped_in_matches_the_summary(runs):
    workdir, summary, _ = runs["ema"]
    cfg = init_from.read_run_config(workdir)
    run = engine.setup(cfg)
    model, optimizer = engine.build_model_and_optimizer(cfg, run.cluster)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        newest_checkpoint(workdir)).assert_existing_objects_matched().expect_partial()
    eval_step = engine.make_eval_step(cfg, run.cluster, model)
    with ema.swapped_in(model, optimizer):
        results = engine.evaluate(eval_step, iter(engine.eval_dataset(run)), run.steps.eval_steps)
    assert results["eval_top1"] == summary["eval_top1_ema"] and results["eval_loss"] == summary["eval_loss_ema"]


def test_resume_is_exact(runs, tmp_path):
    """20 steps straight equal 10 steps + resume to 20: weights, EMA and every optimizer slot."""
    uninterrupted, _, _ = runs["ema"]
    workdir = str(tmp_path)
    cfg = tiny_config(f"--config.optim.ema_decay={DECAY}")
    first = train.train_and_evaluate(cfg, workdir, extra_callbacks=[StopAtStep(10)])
    assert first["steps"] == 10
    second = train.train_and_evaluate(cfg, workdir)
    assert second["steps"] == 20
    resumed, reference = checkpoint_values(workdir), checkpoint_values(uninterrupted)
    assert resumed.keys() == reference.keys()
    # The EMA variables are in the checkpoint: one more optimizer variable per trainable variable.
    raw_keys = checkpoint_values(runs["raw"][0]).keys()
    num_trainable = len(runs["ema"][2].weights[0])
    assert len(reference) == len(raw_keys) + num_trainable
    for key, value in reference.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
    for key in ("eval_top1_ema", "eval_loss_ema", "eval_top1", "eval_loss"):
        assert second[key] == runs["ema"][1][key]


# --- export -----------------------------------------------------------------------------------------


def test_export_writes_the_ema_weights(runs, tmp_path):
    workdir, summary, _ = runs["ema"]
    output_dir = str(tmp_path / "export")
    info = export.export(workdir, output_dir)
    assert info["weights"] == "ema"
    assert info["eval_metrics"] == {"eval_top1": summary["eval_top1_ema"], "eval_top5": summary["eval_top5_ema"],
                                    "eval_loss": summary["eval_loss_ema"], "step": 20}
    with open(os.path.join(output_dir, export.EXPORT_JSON)) as f:
        assert json.load(f)["weights"] == "ema"

    # The model as trained, the checkpoint's EMA swapped in: what the export must compute.
    cfg = init_from.read_run_config(workdir)
    model = engine.build_model(cfg)
    optimizer = engine.build_optimizer(cfg, model)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        newest_checkpoint(workdir)).assert_existing_objects_matched().expect_partial()
    probe = np.random.default_rng(1).integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
    raw_logits = model(probe, training=False).numpy()
    with ema.swapped_in(model, optimizer):
        ema_logits = model(probe, training=False).numpy()
    exported = keras.models.load_model(os.path.join(output_dir, export.KERAS_FILE), compile=False)
    np.testing.assert_allclose(exported(probe, training=False).numpy(), ema_logits, rtol=1e-5, atol=1e-5)
    assert np.abs(ema_logits - raw_logits).max() > 1e-3  # it is not the raw model


def test_export_of_a_run_without_ema_says_raw(runs):
    workdir, summary, _ = runs["raw"]
    assert export.weights_exported(init_from.read_run_config(workdir)) == "raw"
    assert export._run_metrics(workdir, 20, "raw") == {"eval_top1": summary["eval_top1"],
                                                      "eval_top5": summary["eval_top5"],
                                                      "eval_loss": summary["eval_loss"], "step": 20}


# --- under mirrored with 2 CPU devices (a process of its own: the CPU must be split before TF starts) -----

MIRRORED_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import keras, numpy as np
    from conftest import load_config
    from tfscale.model import ema
    from tfscale.training import train

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights, self.replicas_equal, self.mirrored, self.updates = [], [], True, 0

        def on_train_batch_end(self, batch, logs=None):
            # A float16 step skipped by loss scaling is no update: the average stays; record applied ones.
            updates = int(ema.base_optimizer(self.model.optimizer).iterations.numpy())
            if updates > self.updates:
                self.weights.append([v.numpy() for v in self.model.trainable_variables])
            self.updates = updates
            averages = ema.ema_variables(self.model.optimizer)
            per_replica = [[x.numpy() for x in a.value.values] for a in averages]
            self.mirrored &= all(len(copies) == 2 for copies in per_replica)
            self.replicas_equal.append(all(np.array_equal(c[0], c[1]) for c in per_replica))
            self.last = [c[0] for c in per_replica]

    overrides = sys.argv[2:]
    cfg = load_config("smoke", "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2",
                      *overrides)
    record = Record()
    summary = train.train_and_evaluate(cfg, sys.argv[1], extra_callbacks=[record])
    d = np.float32(cfg.optim.ema_decay)
    average = [w.copy() for w in record.weights[0]]
    for weights in record.weights[1:]:
        average = [d * a + (np.float32(1) - d) * w for a, w in zip(average, weights)]
    error = max(float(np.abs(a - b).max()) for a, b in zip(average, record.last))
    lag = max(float(np.abs(a - w).max()) for a, w in zip(record.last, record.weights[-1]))
    print(json.dumps({"replicas_equal": record.replicas_equal, "mirrored": record.mirrored, "error": error,
                      "lag": lag, "updates": len(record.weights), "num_replicas": summary["num_replicas"],
                      "has_ema_eval": "eval_top1_ema" in summary}))
""")


@pytest.mark.parametrize("overrides", [(), ("--config.precision=mixed_float16", "--config.optim.name=lars")],
                         ids=["float32-sgd", "float16-lars"])
@pytest.mark.slow
def test_mirrored_two_devices_updates_ema_identically_on_both_replicas(tmp_path, overrides):
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED_SCRIPT, str(tmp_path), *TINY, f"--config.optim.ema_decay={DECAY}",
         "--config.train.epochs=0.5", "--config.schedule.warmup_epochs=0.1", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["num_replicas"] == 2 and report["mirrored"]
    assert len(report["replicas_equal"]) == 10 and all(report["replicas_equal"])
    assert report["updates"] >= 5
    assert report["error"] < 1e-6  # the numpy recomputation over the recorded weights
    assert report["lag"] > 1e-4  # the average moved with the weights but is not them
    assert report["has_ema_eval"]
