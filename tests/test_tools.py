"""Every hand-run tool and `make` target still runs: a rename that breaks one fails here, not in a user's hands.

Each make target is run as the Makefile writes it (`make -n TARGET` gives its commands) with flags appended
that shrink it to seconds (absl and ml_collections take the last value of a repeated flag), and its output is
checked for shape, not speed. Tools whose own behaviour is under test elsewhere (make_sbatch, sweep,
scaling_report, step_timeline, stage_data, local_sgd_calculator, tfrecord_convert, digits_demo) get the
`--help` check here: each starts, imports what it needs and prints its usage.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

TOOLS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "tools", "*.py")))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def docstring_head(path: str) -> str:
    """The first line of a tool's module docstring (absl prints the docstring as its help)."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    return re.search(r'^r?"""(.*)$', text, re.M).group(1).strip()


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_starts_and_prints_its_usage(tool):
    result = subprocess.run([sys.executable, tool, "--help"], cwd=REPO, env=ENV, capture_output=True, text=True,
                            timeout=120)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    # absl exits 1 after --help, argparse 0; either prints the tool's usage.
    assert result.returncode in (0, 1) and ("usage:" in output or docstring_head(tool) in output), output[-3000:]


def make_commands(target: str, **variables) -> list[list[str]]:
    """The Python commands `make TARGET` runs, as the Makefile writes them (for this venv's Python)."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    assignments = [f"VENV={venv}", *(f"{k}={v}" for k, v in variables.items())]
    printed = subprocess.run(["make", "-n", target, *assignments], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.replace("\\\n", " ")  # a recipe line continued with a backslash
    commands = [shlex.split(line) for line in printed.splitlines() if line.startswith(sys.executable + " ")]
    # the tool or program each target is for: not pip, `-c` checks or the data-making lines behind `test -d ||`
    return [c for c in commands if len(c) > 1 and c[1] != "-c" and c[1:3] != ["-m", "pip"]]


def run_target(target: str, *extra: str, timeout_s: int = 600, **variables) -> subprocess.CompletedProcess:
    (command,) = make_commands(target, **variables)
    result = subprocess.run([*command, *extra], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"{shlex.join(command)} {shlex.join(extra)}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A small real-photo JPEG tree and its TFRecord shards, made by the tools the make targets use."""
    root = tmp_path_factory.mktemp("photos")
    tree, shards = root / "tree", root / "shards"
    subprocess.run([sys.executable, "tools/make_photo_tree.py", str(tree), "--classes", "2", "--per_class", "12"],
                   cwd=REPO, env=ENV, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/tfrecord_convert.py", f"--input_dir={tree}", f"--output_dir={shards}",
                    "--split=train", "--num_shards=2"], cwd=REPO, env=ENV, check=True, capture_output=True)
    return tree, shards


@pytest.mark.slow
def test_bench_loop_prints_both_loop_lengths_and_their_ratio(tmp_path):
    output = tmp_path / "loop.json"
    result = run_target("bench-loop", "--steps=10", "--batch=8", "--rounds=1", f"--output={output}")
    figures = json.loads(output.read_text())
    assert figures["steps_per_loop_1_images_per_sec"] > 0 and figures["steps_per_loop_10_images_per_sec"] > 0
    assert figures["ratio"] > 0 and "steps_per_loop=10 =" in result.stdout


@pytest.mark.slow
def test_bench_convert_times_one_process_and_every_core(photos, tmp_path):
    tree, _ = photos
    output = tmp_path / "convert.json"
    run_target("bench-convert", f"--input_dir={tree}", "--num_shards=2", "--rounds=1", f"--output={output}")
    figures = json.loads(output.read_text())
    assert figures["one_process_images_per_sec"] > 0 and figures["all_cores_images_per_sec"] > 0
    assert figures["speedup"] > 0 and set(figures["rounds"]) == {"1", str(figures["all_cores"])}


SHORT_BENCHMARK = ("--config.benchmark.num_batches=2", "--config.benchmark.num_warmup_batches=1",
                   "--config.benchmark.rounds=1", "--config.benchmark.display_every=1")


@pytest.mark.slow
def test_bench_input_compares_the_pipelines_on_the_same_photos(photos, tmp_path):
    tree, shards = photos
    run_target("bench-input", f"--workdir={tmp_path}", f"--config.data.data_dir={shards}",
               f"--config.benchmark.image_dir={tree}", "--config.data.global_batch_size=8", *SHORT_BENCHMARK)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["mode"] == "input" and report["config"]["data"]["data_dir"] == str(shards)


@pytest.mark.slow
def test_bench_fit_times_the_loop_beside_keras_fit(tmp_path):
    result = run_target("bench-fit", f"--workdir={tmp_path}", "--config.data.global_batch_size=16", *SHORT_BENCHMARK)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["mode"] == "train" and "keras_fit" in json.dumps(report)
    assert "total images/sec:" in result.stdout


@pytest.mark.slow
def test_soak_survives_a_fault_and_ends_with_the_reference_weights(tmp_path):
    """`make soak` with one fault on a short run: the resumed run must end with the uninterrupted run's weights."""
    # One epoch (20 steps, a checkpoint every 10): the fault still lands between 3 and 18, and the resumed run must
    # still end with the reference weights and every row once; the steps themselves prove nothing more.
    result = run_target("soak", f"--workdir={tmp_path}", "--epochs=1", CYCLES=1, timeout_s=900)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["cycles"] == 1 and report["failures"] == [], result.stdout
    assert report["final"]["weights_equal"] and report["final"]["rows_unique_and_complete"], report["final"]
    # Run again over the same workdir, as a user would: the reference is reused, the soak run starts from step 0
    # (over the first one's finished run, each cycle would resume at its end and fail).
    again = run_target("soak", f"--workdir={tmp_path}", "--epochs=1", CYCLES=1, timeout_s=900)
    assert f"soak: reusing the reference run {tmp_path / 'reference'}" in again.stdout
    assert f"soak: removing the previous soak's run {tmp_path / 'run'} and its logs" in again.stdout
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["failures"] == [] and report["final"]["weights_equal"], again.stdout


@pytest.mark.slow
def test_bench_tta_runs_both_from_process_start_and_prints_the_paired_ratio(tmp_path):
    # Shrunk to 1,600 real Fashion-MNIST images and 2 epochs: the plumbing and the report, not the figures.
    result = run_target("bench-tta", f"--workdir={tmp_path}", "--rounds=1", "--epochs=2", "--train_examples=1600",
                        "--tfscale_args=--config.schedule.warmup_epochs=0.5 --config.schedule.decay_epochs=(1,)")
    (row,) = json.loads((tmp_path / "tta.json").read_text())["rounds"]
    assert (tmp_path / "tta.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curves, drawn
    assert [epoch for epoch, _ in enumerate(row["curves"]["keras"], 1)] == [1, 2]
    assert len(row["curves"]["tfscale"]) == 2  # an eval after each epoch, seconds since its process started
    assert row["target_top1"] == min(row["keras_final_top1"], row["tfscale_final_top1"]) > 0.1  # above chance
    assert 0 < row["keras_to_target_s"] <= row["keras_total_s"] and 0 < row["tfscale_to_target_s"] <= row["tfscale_total_s"]
    assert row["ratio_to_target"] == round(row["tfscale_to_target_s"] / row["keras_to_target_s"], 3)
    assert f"median over 1 rounds: time to the round's common top-1 tfscale / keras = {row['ratio_to_target']:.3f}" \
        in result.stdout
