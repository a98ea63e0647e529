"""The training loop end to end: workdir files, resume, learning, failures."""

import json
import os
import re
import time

import numpy as np
import pytest
import tensorflow as tf
from conftest import checkpoint_values, load_config, read_jsonl, run_cli, stop_at_step, without_tf_import_notices

from tfscale.training import train
from tfscale.workdir import layout


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One uninterrupted smoke run (60 steps) shared by the tests below."""
    workdir = str(tmp_path_factory.mktemp("smoke"))
    summary = train.train_and_evaluate(load_config("smoke"), workdir)
    return workdir, summary


def test_workdir_has_every_public_file(smoke_run):
    workdir, summary = smoke_run
    assert {"config.json", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "curves.png"} <= set(
        os.listdir(workdir))
    assert os.listdir(os.path.join(workdir, layout.TENSORBOARD))
    with open(os.path.join(workdir, layout.SUMMARY)) as f:
        on_disk = json.load(f)
    assert on_disk == summary
    for key in ("steps", "wall_time_s", "images_per_sec", "eval_top1", "eval_top5", "num_workers", "global_batch_size"):
        assert key in on_disk
    assert on_disk["steps"] == 60 and on_disk["global_batch_size"] == 32 and on_disk["num_workers"] == 1
    with open(os.path.join(workdir, layout.CONFIG)) as f:
        assert json.load(f)["model"]["name"] == "cifar_resnet8"


def test_metrics_rows(smoke_run):
    rows = read_jsonl(os.path.join(smoke_run[0], layout.METRICS))
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_top1" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    for row in train_rows:
        assert set(row) == {"step", "epoch", "loss", "top1", "lr", "images_per_sec", "time"}
        assert row["images_per_sec"] > 0 and 0 <= row["top1"] <= 1
    # Every row, eval rows too, carries its wall-clock time (Unix seconds), in the order written.
    times = [r["time"] for r in rows]
    assert times == sorted(times) and time.time() - 3600 < times[0]
    assert train_rows[2]["epoch"] == 1.5
    # eval every 1.5 epochs = 30 steps; 500 examples counted exactly despite the padded last batch
    assert [r["step"] for r in eval_rows] == [30, 60]
    assert all(r["eval_examples"] == 500 for r in eval_rows)
    assert 0.0 <= eval_rows[-1]["eval_top1"] <= eval_rows[-1]["eval_top5"] <= 1.0


def test_tensorboard_has_train_and_validation_runs_with_shared_tags(smoke_run):
    # Read back as TensorBoard reads them: two runs whose curves of a tag overlay (Keras' train/ and validation/).
    from tensorboard.backend.event_processing import event_accumulator

    root = os.path.join(smoke_run[0], layout.TENSORBOARD)
    rows = read_jsonl(os.path.join(smoke_run[0], layout.METRICS))
    runs = {}
    for run in ("train", "validation"):
        events = event_accumulator.EventAccumulator(os.path.join(root, run), size_guidance={"tensors": 0})
        events.Reload()
        runs[run] = {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
                     for tag in events.Tags()["tensors"]}
    assert {"loss", "top1", "lr", "images_per_sec", "epoch"} == set(runs["train"])
    assert {"loss", "top1", "top5", "examples", "epoch"} == set(runs["validation"])
    assert runs["train"]["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows if "loss" in r]
    assert runs["train"]["top1"] == [(r["step"], pytest.approx(r["top1"])) for r in rows if "loss" in r]
    assert runs["validation"]["top1"] == [(r["step"], pytest.approx(r["eval_top1"])) for r in rows if "eval_top1" in r]
    assert runs["validation"]["loss"] == [(r["step"], pytest.approx(r["eval_loss"])) for r in rows if "eval_loss" in r]


def test_curves_png_draws_the_runs_own_metrics(smoke_run):
    from PIL import Image

    from tfscale.workdir import curves

    with Image.open(layout.curves(smoke_run[0])) as image:  # drawn by the run, after its last eval
        assert image.format == "PNG" and image.size == (990, 630)
    # Every point of metrics.jsonl in its panel: 6 logged steps, 2 evals (train and validation beside each other).
    assert curves.draw(smoke_run[0]) == {"loss": 6, "eval_loss": 2, "top1": 6, "eval_top1": 2, "lr": 6,
                                         "images_per_sec": 6}


def test_learnable_task_learns(smoke_run):
    rows = read_jsonl(os.path.join(smoke_run[0], layout.METRICS))
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.75 * losses[0], losses
    top1s = [r["top1"] for r in rows if "loss" in r]  # training top-1 of each logged step's batch of 32
    assert top1s[-1] > top1s[0] + 0.2, top1s
    # 10 classes: chance is 0.1
    assert smoke_run[1]["eval_top1"] > 0.3


def test_training_top1_counts_the_largest_logit_against_the_class_or_the_largest_soft_target():
    from tfscale.training import engine

    logits = tf.constant([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 1.0, 5.0], [4.0, 0.0, 1.0]])
    assert engine.top1_hits(tf.constant([0, 1, 0, 2]), logits).numpy().tolist() == [1, 1, 0, 0]
    mixed = tf.constant([[0.7, 0.3, 0.0], [0.4, 0.6, 0.0], [0.0, 0.55, 0.45], [0.6, 0.0, 0.4]])  # MixUp's targets
    assert engine.top1_hits(mixed, logits).numpy().tolist() == [1, 1, 0, 1]


def test_lr_follows_warmup_then_cosine(smoke_run):
    lrs = {r["step"]: r["lr"] for r in read_jsonl(os.path.join(smoke_run[0], layout.METRICS)) if "lr" in r}
    # lr 0.1 (0.8 per 256 x 32); 10 warmup steps; cosine to 0 over steps 10..60. A row logs the LR
    # of the step just taken, i.e. lr(step - 1).
    assert lrs[10] == pytest.approx(0.1 * 9 / 10)
    assert lrs[60] == pytest.approx(0.05 * (1 + np.cos(np.pi * 49 / 50)), rel=1e-6)


@pytest.mark.slow
def test_interrupted_run_resumes_exactly(smoke_run, tmp_path):
    """Stopped at step 25, then rerun: same steps, same final weights and optimizer state.

    A callback's stop takes effect at the end of a loop of steps: loops of 5 end at step 25. The rerun
    uses the default loop length, which changes nothing in what is computed."""
    workdir = str(tmp_path)
    first = train.train_and_evaluate(load_config("smoke", "--config.train.steps_per_loop=5"), workdir,
                                     extra_callbacks=[stop_at_step(25)])
    assert first["steps"] == 25
    second = train.train_and_evaluate(load_config("smoke"), workdir)
    assert second["steps"] == 60

    rows = read_jsonl(os.path.join(workdir, layout.METRICS))
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [10, 20, 30, 40, 50, 60]  # nothing repeated, nothing skipped
    reference = {r["step"]: r for r in read_jsonl(os.path.join(smoke_run[0], layout.METRICS)) if "loss" in r}
    for row in rows:
        if "loss" in row:
            assert row["loss"] == pytest.approx(reference[row["step"]]["loss"], rel=1e-4, abs=1e-5)
            assert row["lr"] == pytest.approx(reference[row["step"]]["lr"], rel=1e-6)  # same point of the LR curve

    resumed, uninterrupted = checkpoint_values(workdir), checkpoint_values(smoke_run[0])
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        np.testing.assert_allclose(resumed[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert second["eval_top1"] == pytest.approx(smoke_run[1]["eval_top1"], abs=0.01)


def test_nonfinite_loss_stops_with_step_number(tmp_path):
    cfg = load_config("smoke", "--config.optim.lr_per_256=1e12", "--config.schedule.warmup=none")
    with pytest.raises(FloatingPointError, match=r"loss is (nan|inf) at step \d+"):
        train.train_and_evaluate(cfg, str(tmp_path))
    # nothing was written after the loss went bad: no summary claims a finished run
    assert not os.path.exists(os.path.join(tmp_path, layout.SUMMARY))


@pytest.mark.slow
def test_cli_trains_then_resumes_instead_of_restarting(tmp_path):
    workdir = str(tmp_path / "run")
    first = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
                    "--config.train.progress_every_s=0")  # every eval batch says how far the eval is
    assert first.returncode == 0, first.stderr[-3000:]
    assert "eval at step 60" in first.stderr
    # No silent minutes: the first step's tracing and compiling is one line before the first logged step, and an
    # eval says how far it is (here after every batch; by default every 30 s).
    lines = first.stderr.splitlines()
    compiled = [i for i, line in enumerate(lines) if re.search(r"\] step 1 ran in [\d.]+ s: the training loop traced "
                                                               r"and compiled \(XLA off\), the input's first batch read", line)]
    first_logged = next(i for i, line in enumerate(lines) if re.search(r"\] step 10/60 ", line))
    assert len(compiled) == 1 and compiled[0] < first_logged, first.stderr[-3000:]
    for step in (30, 60):
        progress = [line for line in lines if re.search(rf"\] eval at step {step}: \d+/16 batches in \d+ s, eta ", line)]
        assert len(progress) == 15, progress  # all but the last batch
    # jit_compile's default decided as Keras' compile decides it, and the update's by the replicas, said, recorded.
    assert "config.jit_compile=auto -> False: the replicas are CPUs" in first.stderr
    assert "config.optim.compiled_update=auto -> False: the replicas are CPUs" in first.stderr
    with open(os.path.join(workdir, layout.CONFIG)) as f:
        recorded = json.load(f)
    assert recorded["jit_compile"] is False and recorded["optim"]["compiled_update"] is False
    # Each message once (absl's line, not TensorFlow's own `INFO:tensorflow:` copy); steps with an ETA.
    assert "INFO:tensorflow:" not in first.stderr
    printed = without_tf_import_notices(first.stderr)
    records = [line.split(" ", 3)[3] for line in printed.splitlines() if re.match(r"[IWEF]\d{4} \S+ +\d+ ", line)]
    assert len(records) == len(set(records)), records  # file:line] message, without time and thread
    step_lines = [line for line in first.stderr.splitlines() if re.search(r"\] step \d+/60 ", line)]
    assert len(step_lines) == 6 and all(re.search(r"  eta \d+:\d\d:\d\d$", line) for line in step_lines), step_lines
    with open(os.path.join(workdir, layout.METRICS)) as f:
        rows_after_first = f.read()

    second = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "ckpt-60" in second.stderr
    assert "training already complete at step 60" in second.stderr
    with open(os.path.join(workdir, layout.METRICS)) as f:
        assert f.read() == rows_after_first  # no step trained twice


def test_cli_unknown_key_is_a_clear_error(tmp_path):
    result = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={tmp_path}", "--config.optim.lrr=1")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert "unknown config key" in last_line and "--config.optim.lrr=1" in last_line and '"lr"' in last_line
    assert not os.listdir(tmp_path)  # nothing written


def test_an_eval_says_how_far_it_is_only_when_it_runs_long():
    from tfscale.training import engine

    said = []
    one_batch = lambda iterator: tf.constant([0.5, 1.0, 2.0, 4.0])  # noqa: E731 - loss sum, top-1, top-5, examples
    results = engine.evaluate(one_batch, None, 5, progress_every_s=3600, say=said.append)
    assert said == [] and results["eval_examples"] == 20 and results["eval_top1"] == 0.25
    engine.evaluate(one_batch, None, 5, progress_every_s=0, say=said.append)
    assert [text.split(" batches")[0] for text in said] == ["1/5", "2/5", "3/5", "4/5"]
    assert all(re.fullmatch(r"\d/5 batches in \d+ s, eta \d+:\d\d:\d\d", text) for text in said), said
