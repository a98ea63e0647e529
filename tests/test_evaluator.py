"""A run's checkpoints evaluated by a process of their own (`tfscale-train --mode=eval`, `continuous_eval`), as
Model Garden's modes and Keras' SidecarEvaluator do, and training without evals (`--mode=train`)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, read_jsonl, run_cli

from tfscale.workdir import layout


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    result = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def test_eval_in_a_fresh_process_gives_the_runs_own_final_eval(finished_run):
    result = run_cli("tfscale.train", "--mode=eval", f"--workdir={finished_run}")  # no --config: the run's own
    assert result.returncode == 0, result.stderr[-3000:]
    final = [row for row in read_jsonl(finished_run / layout.METRICS) if "eval_top1" in row][-1]
    (row,) = read_jsonl(finished_run / "evaluations.jsonl")
    assert (row["step"], row["checkpoint"], row["split"]) == (60, "ckpt-60", "validation")
    for key in ("eval_top1", "eval_top5", "eval_loss", "eval_examples"):
        assert row[key] == final[key], key  # the same weights, data and step: the same figures, exactly
    assert (f"eval of ckpt-60 (step 60) on validation: top-1 {final['eval_top1']:.4f}  top-5 {final['eval_top5']:.4f}  "
            f"loss {final['eval_loss']:.4f}  (500 examples)") in result.stdout
    # A named, older checkpoint; the TensorBoard validation run gets the evaluator's points beside training's.
    again = run_cli("tfscale.train", "--mode=eval", f"--workdir={finished_run}",
                    f"--checkpoint={finished_run / 'checkpoints' / 'ckpt-40'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(finished_run / "evaluations.jsonl")] == [60, 40]
    validation = finished_run / "tensorboard" / "validation"
    assert list(validation.glob("*.evaluator")) and list(validation.glob("*.v2"))  # the evaluator's, training's
    assert (finished_run / layout.CURVES).read_bytes()[:4] == b"\x89PNG"  # the training run drew its curves


def test_eval_of_a_workdir_without_a_run_names_it(tmp_path):
    result = run_cli("tfscale.train", "--mode=eval", f"--workdir={tmp_path}")
    assert result.returncode == 1
    assert f"no checkpoints in {tmp_path}: has the run saved one yet?" in result.stderr


@pytest.mark.slow
def test_a_side_car_evaluator_follows_a_two_worker_run_and_stops_after_its_last_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    # Started first, it waits for the run; the run itself evaluates nothing (--mode=train).
    command = [sys.executable, "-m", "tfscale.train", "--mode=continuous_eval", f"--workdir={workdir}", "--timeout_s=240"]
    side_car = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    training = run_cli("tfscale.launch", "--num_workers=2", "--", "-m", "tfscale.train", "--mode=train",
                       "--config=configs/smoke.py", f"--workdir={workdir}", "--config.checkpoint.every_epochs=1")
    assert training.returncode == 0, training.stderr[-3000:]
    stdout, stderr = side_car.communicate(timeout=300)
    assert side_car.returncode == 0, stderr[-3000:]
    assert not [row for row in read_jsonl(workdir / layout.METRICS) if "eval_top1" in row]  # --mode=train
    summary = json.loads((workdir / layout.SUMMARY).read_text())
    assert summary["num_workers"] == 2 and "eval_top1" not in summary
    rows = read_jsonl(workdir / "evaluations.jsonl")
    steps = [row["step"] for row in rows]
    # Checkpoints at 20, 40, 60; one that a newer one overtook between two polls may be skipped, the last never.
    assert steps == sorted(set(steps)) and set(steps) <= {20, 40, 60} and steps[-1] == 60, steps
    assert rows[-1]["eval_examples"] == 500 and rows[-1]["eval_top1"] > 0.3  # the trained model, above chance
    assert stdout.strip().splitlines()[-1].startswith("eval of ckpt-60 (step 60) on validation: top-1 ")
