"""tfscale.study on a tiny grid (2 cells x 2 seeds of the smoke config): runs, table, p-values, plot, resume."""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, load_config, quiet_env
from scipy import stats

from tfscale import study as tfs_study

STUDY_FILE = '''
def get_study():
    return {
        "config": "configs/smoke.py",
        "overrides": ["--config.train.epochs=0.25", "--config.schedule.warmup_epochs=0.1",
                      "--config.train.eval_every_epochs=0.25", "--config.checkpoint.every_epochs=0.25"],
        "cells": {
            "lr_0.1": {"overrides": ["--config.optim.lr_per_256=0.8"], "plot_values": {"lr": 0.1, "method": "sgd"}},
            "lr_0.01": {"overrides": ["--config.optim.lr_per_256=0.08"], "plot_values": {"lr": 0.01, "method": "sgd"}},
        },
        "seeds": [0, 1],
        "baseline": "lr_0.1",
        "plot": {"x": "lr", "series": "method", "x_label": "learning rate"},
        "title": "smoke study",
    }
'''


def study_command(study_file, workdir):
    return [sys.executable, "-m", "tfscale.study", str(study_file), f"--workdir={workdir}"]


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    """The study killed after its first run, then rerun to the end (what a preempted study job does)."""
    root = tmp_path_factory.mktemp("study")
    study_file = root / "tiny_study.py"
    study_file.write_text(STUDY_FILE)
    workdir = root / "work"
    first = os.path.join(workdir, "runs", "lr_0.1", "seed0", "summary.json")
    proc = subprocess.Popen(study_command(study_file, workdir), cwd=REPO, env=quiet_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not os.path.exists(first):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the study and the run under way
    proc.wait()
    first_mtime = os.path.getmtime(first)
    rerun = subprocess.run(study_command(study_file, workdir), cwd=REPO, env=quiet_env(), capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return {"workdir": workdir, "log": rerun.stderr, "first_mtime": first_mtime, "first": first}


@pytest.mark.slow
def test_a_killed_study_resumes_skipping_finished_runs(finished_study):
    assert "skipping lr_0.1 seed 0: finished" in finished_study["log"]
    assert "running lr_0.1 seed 1" in finished_study["log"]
    assert os.path.getmtime(finished_study["first"]) == finished_study["first_mtime"]
    for cell in ("lr_0.1", "lr_0.01"):
        for seed in (0, 1):
            summary = json.load(open(os.path.join(finished_study["workdir"], "runs", cell, f"seed{seed}",
                                                  "summary.json")))
            assert summary["steps"] == 5
    config = json.load(open(os.path.join(finished_study["workdir"], "runs", "lr_0.01", "seed1", "config.json")))
    assert config["seed"] == 1 and config["optim"]["lr_per_256"] == 0.08


@pytest.mark.slow
def test_table_and_p_values_match_scipy(finished_study):
    report = json.load(open(os.path.join(finished_study["workdir"], "study.json")))
    runs = report["runs"]
    baseline = [r["eval_top1"] for r in runs["lr_0.1"]]
    low = [r["eval_top1"] for r in runs["lr_0.01"]]
    cells = report["cells"]
    assert cells["lr_0.01"]["runs"] == cells["lr_0.1"]["runs"] == 2
    assert cells["lr_0.01"]["top1_mean"] == pytest.approx(sum(low) / 2)
    assert cells["lr_0.01"]["top1_std"] == pytest.approx(abs(low[0] - low[1]) / math.sqrt(2))
    expected = stats.ttest_ind(low, baseline, equal_var=False, alternative="less").pvalue
    if math.isnan(expected):  # equal accuracies in both cells: scipy says nan, and so do we
        assert math.isnan(cells["lr_0.01"]["p_lower_than_baseline"])
    else:
        assert cells["lr_0.01"]["p_lower_than_baseline"] == pytest.approx(expected)
    assert math.isnan(cells["lr_0.1"]["p_lower_than_baseline"])
    table = open(os.path.join(finished_study["workdir"], "study.md")).read()
    assert "| lr_0.01 | 2 |" in table and "one-tailed Welch t-test" in table
    assert f"0: {low[0]:.4f}, 1: {low[1]:.4f}" in table


@pytest.mark.slow
def test_plot_is_a_png(finished_study):
    with open(os.path.join(finished_study["workdir"], "study.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_statistics_on_known_numbers():
    results = {"base": [{"seed": s, "eval_top1": v, "wall_time_s": 10.0} for s, v in enumerate((0.90, 0.91, 0.92))],
               "worse": [{"seed": s, "eval_top1": v, "wall_time_s": 12.0} for s, v in enumerate((0.80, 0.82, 0.81))]}
    table = tfs_study.cell_statistics(results, "base")
    assert table["worse"]["top1_mean"] == pytest.approx(0.81) and table["worse"]["top1_std"] == pytest.approx(0.01)
    assert table["worse"]["p_lower_than_baseline"] == pytest.approx(
        stats.ttest_ind([0.80, 0.82, 0.81], [0.90, 0.91, 0.92], equal_var=False, alternative="less").pvalue)
    assert table["worse"]["p_lower_than_baseline"] < 0.001


def test_study_file_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'cells': {'a': []}, 'seeds': [0], "
                   "'baseline': 'b'}\n")
    with pytest.raises(ValueError, match=r"bad.py: baseline 'b' is not one of the cells a"):
        tfs_study.load_study(str(bad))
    bad.write_text("def get_study():\n    return {'config': 'configs/smoke.py'}\n")
    with pytest.raises(ValueError, match="lacks cells, seeds, baseline"):
        tfs_study.load_study(str(bad))


def test_runs_are_numbered_cells_by_seeds_and_printed_for_array_tasks(tmp_path):
    study_file = tmp_path / "tiny_study.py"
    study_file.write_text(STUDY_FILE)
    study = tfs_study.load_study(str(study_file))
    assert [(cell.name, seed) for cell, seed in tfs_study.runs_of(study)] == [
        ("lr_0.1", 0), ("lr_0.1", 1), ("lr_0.01", 0), ("lr_0.01", 1)]
    printed = subprocess.run(study_command(study_file, tmp_path / "work") + ["--run_index=2", "--print_run"],
                             cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout.splitlines() == [
        "configs/smoke.py", str(tmp_path / "work" / "runs" / "lr_0.01" / "seed0"), "--config.train.epochs=0.25",
        "--config.schedule.warmup_epochs=0.1", "--config.train.eval_every_epochs=0.25",
        "--config.checkpoint.every_epochs=0.25", "--config.optim.lr_per_256=0.08", "--config.seed=0"]
    assert not (tmp_path / "work" / "runs").exists()  # printing runs nothing
    beyond = subprocess.run(study_command(study_file, tmp_path / "work") + ["--run_index=4", "--print_run"],
                            cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=120)
    assert beyond.returncode == 1 and "run index 4 is out of range: the study has 4 runs (0-3)" in beyond.stderr


def test_a_shared_point_starts_every_line_it_names():
    study = {"cells": {"b32": {"overrides": [], "plot_values": {"batch": 32, "method": ["naive", "linear"]}},
                       "naive_b256": {"overrides": [], "plot_values": {"batch": 256, "method": "naive"}},
                       "linear_b256": {"overrides": [], "plot_values": {"batch": 256, "method": "linear"}}},
             "plot": {"x": "batch", "series": "method"}}
    row = {"runs": 3, "top1_std": 0.01}
    table = {name: {**row, "top1_mean": mean} for name, mean in (("b32", 0.9), ("naive_b256", 0.8),
                                                                   ("linear_b256", 0.85))}
    assert tfs_study.plot_series(study, table) == {"naive": [(32, 0.9, 0.01), (256, 0.8, 0.01)],
                                                   "linear": [(32, 0.9, 0.01), (256, 0.85, 0.01)]}


# --- the committed study files (studies/): what each cell actually trains with -----------------------------------

STUDY_FILES = sorted(glob.glob(os.path.join(REPO, "studies", "*.py")))


def cell_config(path: str, cell: str):
    """The config a cell's first run trains with, parsed as tfscale.train parses it, and validated (with
    data.data_dir pointed at a directory that exists: the study's own is made by its conversion step)."""
    from tfscale import config as tfs_config

    study = tfs_study.load_study(path)
    match = [c for c in tfs_study.cells_of(study) if c.name == cell]
    name = os.path.splitext(os.path.basename(study["config"]))[0]
    cfg = load_config(name, *tfs_study.run_overrides(study, match[0], study["seeds"][0]),
                      f"--config.data.data_dir={REPO}")
    tfs_config.validate(cfg, num_replicas=int(study.get("num_workers", 1)))
    return cfg, study


@pytest.mark.parametrize("path", STUDY_FILES, ids=os.path.basename)
def test_every_cell_of_the_committed_studies_validates(path):
    study = tfs_study.load_study(path)
    assert len(study["seeds"]) >= 3
    # The shards its docstring's conversion writes: --train_examples=12800, read from runs/fmnist12k.
    assert "--config.data.data_dir=runs/fmnist12k" in study["overrides"]
    for cell in tfs_study.cells_of(study):
        cfg, _ = cell_config(path, cell.name)
        assert cfg.data.num_train_examples == 12_800


def test_lr_scaling_cells_train_with_the_lrs_their_method_names():
    from tfscale import schedules

    path = os.path.join(REPO, "studies", "lr_scaling_fmnist.py")

    def lr_table(cell):
        cfg, _ = cell_config(path, cell)
        steps_per_epoch = cfg.data.num_train_examples // cfg.data.global_batch_size
        lr_at = schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps_per_epoch,
                                        total_steps=int(cfg.train.epochs * steps_per_epoch))
        return steps_per_epoch, lr_at

    # Steps per epoch shrink 32-fold, as from 1 to 32 GPUs at a fixed per-GPU batch.
    assert [lr_table(cell)[0] for cell in ("b32", "linear_b256", "linear_b1024")] == [400, 50, 12]
    base = lr_table("b32")[1]
    assert base(0) == pytest.approx(0.025) and base(4 * 400) == pytest.approx(0.0025)  # no warmup; /10 at epoch 4
    assert lr_table("naive_b1024")[1](0) == pytest.approx(0.025)  # the baseline's LR, unscaled
    assert lr_table("linear_b1024")[1](0) == pytest.approx(0.8)  # x32, from the first step
    stepping = lr_table("stepping_b1024")[1]
    assert [stepping(s) for s in (0, 11, 12, 23, 24)] == pytest.approx([0.8 / 3, 0.8 / 3, 1.6 / 3, 1.6 / 3, 0.8])
    gradual = lr_table("gradual_b1024")[1]
    assert gradual(0) == pytest.approx(0.025) and gradual(24) == pytest.approx(0.8)  # from the baseline's LR
    assert 0.025 < gradual(12) < 0.8 and gradual(12) == pytest.approx((0.025 + 0.8) / 2)
