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

from tfscale.config import validation
from tfscale.study import power
from tfscale.study import study as tfs_study
from tfscale.workdir import layout

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
    first = os.path.join(workdir, "runs", "lr_0.1", "seed0", layout.SUMMARY)
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
                                                  layout.SUMMARY)))
            assert summary["steps"] == 5
    config = json.load(open(os.path.join(finished_study["workdir"], "runs", "lr_0.01", "seed1", layout.CONFIG)))
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


def test_comparisons_on_known_numbers_take_the_alternative_asked_for():
    results = {"base": [{"seed": s, "eval_top1": v, "wall_time_s": 1.0} for s, v in enumerate((0.90, 0.91, 0.92))],
               "better": [{"seed": s, "eval_top1": v, "wall_time_s": 1.0} for s, v in enumerate((0.93, 0.95, 0.94))]}
    rows = tfs_study.comparison_statistics(results, [
        {"cell": "better", "against": "base", "alternative": alternative} for alternative in tfs_study.ALTERNATIVES])
    values = ([0.93, 0.95, 0.94], [0.90, 0.91, 0.92])
    for row in rows:
        assert row["top1_difference"] == pytest.approx(0.03) and row["runs"] == [3, 3]
        assert row["p"] == pytest.approx(stats.ttest_ind(*values, equal_var=False,
                                                         alternative=row["alternative"]).pvalue)
    assert [row["p"] < 0.05 for row in rows] == [False, True, True]  # less, greater, two-sided
    study = {"baseline": "base", "comparisons": [{"cell": "better", "against": "base", "alternative": "greater"}]}
    text = tfs_study.markdown(study, tfs_study.cell_statistics(results, "base"), results)
    assert f"| better | base | 3 vs 3 | +0.0300 | greater | {rows[1]['p']:.3f} |" in text


def test_a_comparison_naming_a_missing_cell_or_alternative_is_refused(tmp_path):
    bad = tmp_path / "bad.py"
    template = ("def get_study():\n    return {{'config': 'configs/smoke.py', 'cells': {{'a': [], 'b': []}}, "
                "'seeds': [0], 'baseline': 'a', 'comparisons': [{}]}}\n")
    bad.write_text(template.format("{'cell': 'c', 'against': 'a', 'alternative': 'less'}"))
    with pytest.raises(ValueError, match=r"bad.py: comparisons\[0\]: cell 'c' is not one of the cells a, b"):
        tfs_study.load_study(str(bad))
    bad.write_text(template.format("{'cell': 'b', 'against': 'a', 'alternative': 'higher'}"))
    with pytest.raises(ValueError, match=r"alternative 'higher' is not one of less, greater, two-sided"):
        tfs_study.load_study(str(bad))


def test_a_study_files_version_goes_to_get_study_and_one_without_versions_refuses_it(tmp_path):
    versioned = tmp_path / "versioned.py"
    versioned.write_text("def get_study(version=''):\n    return {'config': 'configs/smoke.py', 'seeds': [0], "
                         "'baseline': version or 'small', 'cells': {version or 'small': []}}\n")
    assert list(tfs_study.load_study(f"{versioned}:big")["cells"]) == ["big"]
    assert list(tfs_study.load_study(str(versioned))["cells"]) == ["small"]
    plain = tmp_path / "plain.py"
    plain.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'seeds': [0], 'baseline': 'a', "
                     "'cells': {'a': []}}\n")
    with pytest.raises(ValueError, match=r"plain.py: get_study\(\) takes no argument, so .*plain.py:big names no"):
        tfs_study.load_study(f"{plain}:big")


def test_a_cell_with_its_own_worker_count_runs_through_the_launcher_with_it(tmp_path):
    study_file = tmp_path / "workers.py"
    study_file.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'seeds': [0], "
                          "'baseline': 'one', 'num_workers': 2, "
                          "'cells': {'one': {'overrides': [], 'num_workers': 1}, 'two': []}}\n")
    study = tfs_study.load_study(str(study_file))
    one, two = tfs_study.cells_of(study)
    assert tfs_study.train_command(study, one, 0, "d")[1:3] == ["-m", "tfscale.train"]
    assert tfs_study.train_command(study, two, 0, "d")[1:4] == ["-m", "tfscale.launch", "--num_workers=2"]


def test_a_cell_with_its_own_seeds_runs_those_and_by_seed_runs_every_cells_first_seed_first(tmp_path):
    study_file = tmp_path / "seeds.py"
    study_file.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'seeds': [0, 1, 2], 'baseline': 'a', "
                          "'cells': {'a': [], 'reference': {'overrides': [], 'seeds': [7]}, 'c': []}}\n")
    runs = tfs_study.runs_of(tfs_study.load_study(str(study_file)))
    in_file_order = [(cell.name, seed) for cell, seed in runs]
    assert in_file_order == [("a", 0), ("a", 1), ("a", 2), ("reference", 7), ("c", 0), ("c", 1), ("c", 2)]
    assert [(cell.name, seed) for cell, seed in tfs_study.by_seed(runs)] == [
        ("a", 0), ("reference", 7), ("c", 0), ("a", 1), ("c", 1), ("a", 2), ("c", 2)]
    study_file.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'seeds': [0], 'baseline': 'a', "
                          "'cells': {'a': {'overrides': [], 'seeds': [1, 1]}}}\n")
    with pytest.raises(ValueError, match=r"seeds.py: cell a: seeds must be distinct and at least one, got \[1, 1\]"):
        tfs_study.load_study(str(study_file))


def test_study_file_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'cells': {'a': []}, 'seeds': [0], "
                   "'baseline': 'b'}\n")
    with pytest.raises(ValueError, match=r"bad.py: baseline 'b' is not one of the cells a"):
        tfs_study.load_study(str(bad))
    bad.write_text("def get_study():\n    return {'config': 'configs/smoke.py'}\n")
    with pytest.raises(ValueError, match="lacks cells, seeds, baseline"):
        tfs_study.load_study(str(bad))
    # A cell's keys name the HParams dashboard's columns: an override must say which key it sets.
    bad.write_text("def get_study():\n    return {'config': 'configs/smoke.py', 'cells': {'a': ['--config.seed=1'], "
                   "'b': ['--lr=0.1']}, 'seeds': [0], 'baseline': 'a'}\n")
    with pytest.raises(ValueError, match=r"bad.py: cell b: override '--lr=0.1' is not --config.KEY=VALUE"):
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


# --- TensorBoard's HParams dashboard, from finished runs written here (no training) -------------------------------

HPARAMS_STUDY = '''
def get_study():
    return {"config": "configs/smoke.py", "overrides": ["--config.train.epochs=1"],
            "cells": {"base": ["--config.data.global_batch_size=64", "--config.optim.lr_per_256=0.1",
                               "--config.schedule.warmup=none"],
                      "big": ["--config.data.global_batch_size=256", "--config.optim.lr_per_256=1",
                              "--config.schedule.warmup=gradual", "--config.model.sync_bn=True"]},
            "seeds": [0, 1, 2], "baseline": "base"}
'''
# What each finished run trained with, as its config.json records it. big seed 0: a Slurm job's own
# --config.data.global_batch_size=512 won over the cell's 256. big seed 1 has no config.json: its values
# are the overrides' text, typed (256 an int, 1 an int made float beside 0.1, True a bool).
HPARAMS = {
    ("base", 0): {"data.global_batch_size": 64, "optim.lr_per_256": 0.1, "schedule.warmup": "none"},
    ("base", 1): {"data.global_batch_size": 64, "optim.lr_per_256": 0.1, "schedule.warmup": "none"},
    ("base", 2): {"data.global_batch_size": 64, "optim.lr_per_256": 0.1, "schedule.warmup": "none"},
    ("big", 0): {"data.global_batch_size": 512, "optim.lr_per_256": 1.0, "schedule.warmup": "gradual",
                 "model.sync_bn": True},
    ("big", 1): {"data.global_batch_size": 256, "optim.lr_per_256": 1.0, "schedule.warmup": "gradual",
                 "model.sync_bn": True},
}


def fake_summary(cell: str, seed: int) -> dict:
    """summary.json as train.py writes it (no eval_loss here: a metric no run has is not listed)."""
    return {"steps": 100 + seed, "wall_time_s": 30.5 + seed, "eval_top1": 0.61 + 0.01 * seed + 0.1 * (cell == "big"),
            "eval_top5": 0.93 + 0.01 * seed, "images_per_sec": None if (cell, seed) == ("base", 1) else 200.0 + seed,
            "num_workers": 1, "global_batch_size": HPARAMS.get((cell, seed), {}).get("data.global_batch_size", 256)}


def write_fake_run(workdir, cell: str, seed: int, *, finished: bool = True) -> None:
    run = workdir / "runs" / cell / f"seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    if (cell, seed) != ("big", 1):
        values = HPARAMS.get((cell, seed), HPARAMS[(cell, 1)])
        (run / layout.CONFIG).write_text(json.dumps({
            "seed": seed, "data": {"global_batch_size": values["data.global_batch_size"]},
            "optim": {"lr_per_256": values["optim.lr_per_256"]}, "schedule": {"warmup": values["schedule.warmup"]},
            "model": {"sync_bn": values.get("model.sync_bn", False)}}))
    if finished:
        (run / layout.SUMMARY).write_text(json.dumps(fake_summary(cell, seed)))


def fake_study(tmp_path):
    """The study file and a workdir with 5 of its 6 runs finished (big seed 2 still training)."""
    study_file = tmp_path / "hparams_study.py"
    study_file.write_text(HPARAMS_STUDY)
    workdir = tmp_path / "work"
    for cell, seed in HPARAMS:
        write_fake_run(workdir, cell, seed)
    write_fake_run(workdir, "big", 2, finished=False)
    return study_file, workdir


def read_events(directory) -> tuple[dict, dict]:
    """({hparams plugin tag: HParamsPluginData}, {scalar tag: (step, value)}) of one directory's events."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    events = event_accumulator.EventAccumulator(str(directory))
    events.Reload()
    plugin = {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
              for tag, content in events.PluginTagToContent("hparams").items()}
    scalars = {}
    for tag in events.Tags()["tensors"]:
        if tag not in plugin:
            (last,) = events.Tensors(tag)  # one value a run: its final figure
            scalars[tag] = (last.step, tensor_util.make_ndarray(last.tensor_proto).item())
    return plugin, scalars


def proto_value(value):
    """A google.protobuf Value as (kind, Python value): the dashboard's column type is the kind."""
    kind = value.WhichOneof("kind")
    return kind, getattr(value, kind)


def session_dirs(workdir) -> list[str]:
    root = workdir / "hparams"
    return sorted(str(path.parent.relative_to(root)) for path in root.glob("*/*/events.out.tfevents.study"))


def test_hparams_dashboard_has_every_finished_run_with_its_config_and_final_figures(tmp_path):
    study_file, workdir = fake_study(tmp_path)
    result = subprocess.run(study_command(study_file, workdir) + ["--report_only"], cwd=REPO, env=quiet_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert session_dirs(workdir) == ["base/seed0", "base/seed1", "base/seed2", "big/seed0", "big/seed1"]
    for (cell, seed), values in HPARAMS.items():
        plugin, scalars = read_events(workdir / "hparams" / cell / f"seed{seed}")
        start = plugin["_hparams_/session_start_info"].session_start_info
        kinds = {bool: "bool_value", str: "string_value", int: "number_value", float: "number_value"}
        expected = {key: (kinds[type(value)], value) for key, value in {"cell": cell, "seed": seed, **values}.items()}
        assert {key: proto_value(value) for key, value in start.hparams.items()} == expected
        summary = fake_summary(cell, seed)
        figures = {tag: (summary["steps"], pytest.approx(summary[tag], rel=1e-6))  # scalars are float32
                   for tag in ("eval_top1", "eval_top5", "wall_time_s", "images_per_sec") if summary[tag] is not None}
        assert scalars == figures
    plugin, _ = read_events(workdir / "hparams")
    experiment = plugin["_hparams_/experiment"].experiment
    domains = {info.name: [proto_value(value)[1] for value in info.domain_discrete.values]
               for info in experiment.hparam_infos}
    assert domains == {"cell": ["base", "big"], "seed": [0, 1, 2], "data.global_batch_size": [64, 256, 512],
                       "optim.lr_per_256": [0.1, 1.0], "schedule.warmup": ["gradual", "none"],
                       "model.sync_bn": [True]}
    assert [info.name.tag for info in experiment.metric_infos] == ["eval_top1", "eval_top5", "wall_time_s",
                                                                   "images_per_sec"]


def test_refreshing_the_report_rewrites_the_hparams_without_adding_rows(tmp_path):
    study_file, workdir = fake_study(tmp_path)

    def report_only():
        result = subprocess.run(study_command(study_file, workdir) + ["--report_only"], cwd=REPO, env=quiet_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]

    def files():
        return {str(path.relative_to(workdir)): path.read_bytes() for path in (workdir / "hparams").rglob("*")
                if path.is_file()}

    report_only()
    written = files()
    assert len(written) == 6  # 5 sessions + the experiment
    report_only()  # another process (another hash order for the hparams map, another pid)
    assert files() == written  # the same files, byte for byte
    study = tfs_study.load_study(str(study_file))
    # big seed 2 finishes; base seed 0 is being redone (its summary.json removed): the report follows.
    write_fake_run(workdir, "big", 2)
    os.remove(workdir / "runs" / "base" / "seed0" / layout.SUMMARY)
    tfs_study.report(study, str(workdir))
    assert session_dirs(workdir) == ["base/seed1", "base/seed2", "big/seed0", "big/seed1", "big/seed2"]
    plugin, _ = read_events(workdir / "hparams")
    infos = {info.name: info for info in plugin["_hparams_/experiment"].experiment.hparam_infos}
    assert [value.number_value for value in infos["seed"].domain_discrete.values] == [0, 1, 2]
    assert [value.string_value for value in infos["cell"].domain_discrete.values] == ["base", "big"]
    assert len(files()) == 6


# --- the committed study files (studies/): what each cell actually trains with -----------------------------------

STUDY_FILES = sorted(glob.glob(os.path.join(REPO, "studies", "*.py")))


def cell_config(path: str, cell: str):
    """The config a cell's first run trains with, parsed as tfscale.train parses it, and validated (with
    data.data_dir pointed at a directory that exists: the study's own is made by its conversion step)."""
    study = tfs_study.load_study(path)
    match = [c for c in tfs_study.cells_of(study) if c.name == cell]
    name = os.path.splitext(os.path.basename(study["config"]))[0]
    cfg = load_config(name, *tfs_study.run_overrides(study, match[0], study["seeds"][0]),
                      f"--config.data.data_dir={REPO}")
    validation.validate(cfg, num_replicas=match[0].num_workers)
    return cfg, study


@pytest.mark.parametrize("path", STUDY_FILES, ids=os.path.basename)
def test_every_cell_of_the_committed_studies_validates(path):
    study = tfs_study.load_study(path)
    assert len(study["seeds"]) >= 3
    # The shards its docstring's conversion writes, and the examples that conversion puts in them.
    converted = {"runs/fmnist12k": 12_800, "runs/fmnist55k": 55_000}
    data_dir = [o.split("=", 1)[1] for o in study["overrides"] if o.startswith("--config.data.data_dir=")]
    assert len(data_dir) == 1 and data_dir[0] in converted and data_dir[0] in study_docstring(path)
    for cell in tfs_study.cells_of(study):
        cfg, _ = cell_config(path, cell.name)
        assert cfg.data.num_train_examples == converted[data_dir[0]]


def study_docstring(path: str) -> str:
    import ast

    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read()))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "studies", "pilots", "*.py"))),
                         ids=os.path.basename)
def test_every_cell_of_the_pilots_validates_and_keeps_batchnorm_groups_of_32(path):
    """Pilots (one seed, no report) for a study's design; each BatchNorm sees 32 images at every batch."""
    study = tfs_study.load_study(path)
    for cell in tfs_study.cells_of(study):
        cfg, _ = cell_config(path, cell.name)
        assert cfg.model.bn_group_size == 32 and cfg.data.global_batch_size % 32 == 0


def lr_scaling_cell(cell: str):
    """(config, steps per epoch, LR at a step) of one cell of the LR-scaling study."""
    from tfscale.model import schedules

    cfg, _ = cell_config(os.path.join(REPO, "studies", "lr_scaling_fmnist.py"), cell)
    steps_per_epoch = cfg.data.num_train_examples // cfg.data.global_batch_size
    lr_at = schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps_per_epoch,
                                    total_steps=int(cfg.train.epochs * steps_per_epoch))
    return cfg, steps_per_epoch, lr_at


LR_SCALING_CELLS = ("b32", "linear", "stepping1", "stepping1_b256", "gradual1", "gradual2")


@pytest.mark.parametrize("cell", LR_SCALING_CELLS)
def test_every_lr_scaling_cell_has_32_images_a_replica_and_the_theses_set_up(cell):
    """The batch grows by replicas, as GPUs are added in the thesis: every BatchNorm sees 32 images."""
    cfg, steps_per_epoch, _ = lr_scaling_cell(cell)
    assert cfg.model.bn_group_size == 32 and cfg.data.global_batch_size % 32 == 0
    assert cfg.optim.weight_decay == 1e-4 and cfg.schedule.warmup_granularity == "epoch"
    assert cfg.data.num_train_examples == 55_000 and cfg.train.epochs == 9
    assert cfg.schedule.decay_epochs == (3, 6, 8)  # 30/60/80 of 90
    if cfg.data.global_batch_size == 1024:
        assert steps_per_epoch * cfg.train.epochs >= 400  # hundreds of steps at the largest batch


def test_lr_scaling_cells_train_with_the_lrs_of_the_theses_experiments():
    assert [lr_scaling_cell(c)[1] for c in ("b32", "stepping1_b256", "linear")] == [1718, 214, 53]
    _, spe, base = lr_scaling_cell("b32")
    assert base(0) == pytest.approx(0.05) and base(3 * spe) == pytest.approx(0.005)  # 1 replica; /10 at epoch 3
    assert lr_scaling_cell("linear")[2](0) == pytest.approx(1.6)  # x32, from the first step (Exp 5)
    _, spe, stepping = lr_scaling_cell("stepping1")
    assert [stepping(s) for s in (0, spe - 1, spe)] == pytest.approx([0.8, 0.8, 1.6])  # per epoch (Exp 6)
    _, spe, stepping = lr_scaling_cell("stepping1_b256")
    assert [stepping(s) for s in (0, spe)] == pytest.approx([0.2, 0.4])  # a quarter of the batch (Exp 7)
    _, spe, gradual = lr_scaling_cell("gradual1")
    assert [gradual(s) for s in (0, spe - 1, spe)] == pytest.approx([0.05, 0.05, 1.6])  # from 1 replica's LR (Exp 8)
    _, spe, gradual = lr_scaling_cell("gradual2")
    assert [gradual(s) for s in (0, spe, 2 * spe, 3 * spe)] == pytest.approx([0.05, 0.825, 1.6, 0.16])  # Exp 9


HOUSEHOLD_CELLS = [f"households_sh{sh}_lw{lw}" for lw in (4, 8, 16) for sh in (4, 1)]


@pytest.mark.parametrize("cell", HOUSEHOLD_CELLS)
def test_every_households_cell_keeps_the_effective_batch_and_reads_its_household_shards(cell):
    """The thesis's Table 5.1 set-up, scaled: 4 households of 2 workers, effective batch 128 at the unscaled
    LR 0.1, and households reading S_H different shards (S_H = 4: disjoint; S_H = 1: each reads everything)."""
    from tfscale.data.input import assignment
    from tfscale.training import local_sgd

    shards, sync_period = (int(part[2:]) for part in cell.split("_")[1:])
    cfg, study = cell_config(os.path.join(REPO, "studies", "assignment_households_fmnist.py"), cell)
    workers = next(c.num_workers for c in tfs_study.cells_of(study) if c.name == cell)
    assert (workers, cfg.distribute.households, cfg.distribute.household_period) == (8, 4, 1)
    assert cfg.distribute.sync == "local_sgd" and cfg.distribute.sync_period == sync_period
    local_batch = cfg.data.global_batch_size // workers
    assert local_sgd.effective_batch(local_batch, num_workers=8, households=4,
                                     sync_period=sync_period) == pytest.approx(128, abs=2)
    assert cfg.optim.lr == pytest.approx(0.1)
    reads = assignment.membership(cfg.data.num_train_examples, num_workers=8, scheme=cfg.data.assignment,
                                  copies=cfg.data.copies)
    household_reads = reads.reshape(4, 2, -1).any(axis=1)  # households of consecutive workers
    assert household_reads.sum(axis=0).tolist() == [4 // shards] * cfg.data.num_train_examples  # each image
    assert len({row.tobytes() for row in household_reads}) == shards  # S_H different household shards


# --- the committed reports (docs/studies/): their tables are the runner's, from their study.json -------------------


def report_of(study_file: str) -> str:
    """The report a study file's docstring names (docs/studies/NAME.md)."""
    import re

    reports = re.findall(r"docs/studies/[\w.-]+\.md", study_docstring(study_file))
    assert len(set(reports)) == 1, f"{study_file} names {reports}"
    return os.path.join(REPO, reports[0])


REPORTED_STUDIES = [path for path in STUDY_FILES if os.path.exists(report_of(path).removesuffix(".md") + ".json")]


def same_numbers(a, b) -> bool:
    """Equal JSON values, nan equal to nan (a cell with one run has no std)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_numbers(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_every_committed_study_has_its_report_data_committed():
    assert REPORTED_STUDIES == STUDY_FILES


@pytest.mark.parametrize("path", REPORTED_STUDIES, ids=os.path.basename)
def test_a_committed_reports_tables_are_what_the_runner_writes_from_its_study_json(path):
    report = report_of(path)
    with open(report.removesuffix(".md") + ".json") as f:
        stored = json.load(f)
    # The stored runs are this study file's: its cells, overrides and seeds, every run finished.
    assert same_numbers(stored["study"], json.loads(json.dumps(tfs_study.load_study(path))))
    assert all([run["seed"] for run in stored["runs"][cell.name]] == list(cell.seeds)
               for cell in tfs_study.cells_of(stored["study"]))
    # The per-cell figures and the comparisons are those the runs give ...
    results = stored["runs"]
    assert same_numbers(stored["cells"], tfs_study.cell_statistics(results, stored["study"]["baseline"]))
    assert same_numbers(stored.get("comparisons", []),
                        tfs_study.comparison_statistics(results, stored["study"].get("comparisons", [])))
    # ... and the report holds the runner's tables from them, in the study file's order, unedited.
    with open(report) as f:
        assert tfs_study.tables_from_json(stored) in f.read()


# --- the committed reports' per-finding tables: the theses' figures and the studies' ----------------------------------

# The theses' own tables, read-only beside the repository (CI copies ../shared there); the figures the per-finding
# tables quote are copied below, and checked against it where it exists.
SEED_TABLES = os.path.join(os.path.dirname(REPO), "shared", "seed_tables.md")

# The LR-scaling thesis (ResNet-50, ImageNet, top-1 in %, one run a configuration): each figure with the table of
# seed_tables.md it is in and what its line there says (the row: GPUs, LR, global batch).
LR_THESIS = {
    "naive, 1 GPU": ("73.286", "Table 10,", "| 1 | 128 |"),  # naive scaling, LR 0.1 at every batch
    "naive, 32 GPUs": ("69.006", "Table 10,", "| 32 | 4096 |"),
    "1 GPU": ("75.028", "Table 11,", "1 GPU, lr 0.05, bs 128"),  # LSR without warmup
    "linear": ("73.078", "Table 11,", "32 GPUs, lr 1.6, global 4096"),
    "stepping 5": ("74.662", "Table 12,", "| 32 | 1.6 | 4096 |"),  # 5-epoch stepping warmup, Horovod
    "stepping 5, 32 a GPU": ("74.766", "Table 13,", "32 GPUs, lr 0.4, global 1024"),  # per-GPU batch 32
    "gradual 5": ("74.298", "Table 14,", "| 32 | 1.6 | 4096 |"),  # 5-epoch gradual warmup
    "gradual 10": ("74.638", "Table 15,", "32 GPUs, lr 1.6, 4096"),  # 10-epoch gradual warmup
}
# The data-assignment thesis (ResNet-20, CIFAR-10, top-1 in %, mean and std of 5 runs), seed_tables.md's tables:
TABLE_B1 = [("91.16", "0.27"), ("91.31", "0.22"), ("91.36", "0.23"), ("91.43", "0.28"), ("91.52", "0.11")]  # M = 1-16
TABLE_B2 = [("91.42", "0.24"), ("91.76", "0.23"), ("91.40", "0.21"), ("91.70", "0.12"), ("91.45", "0.46"),  # E2.2
            ("91.77", "0.31"), ("91.26", "0.20"), ("91.36", "0.32"), ("91.41", "0.34"), ("91.34", "0.15"),
            ("91.52", "0.23"), ("91.42", "0.23"), ("91.40", "0.33")]
TABLE_B3 = {"| 128 |": ("91.52",), "| 4096 |": ("83.60", "84.44"),  # E2.3: disjoint at 128; disjoint, full at 4096
            "The t-test gives p": ("0.059",)}  # full against disjoint at 4096
TABLE_5_1 = {32: ("88.29", "89.26", "89.27"), 64: ("87.77", "88.95", "88.64"),  # H = 8, S_H = 8 / 2 / 1, means
             128: ("87.26", "88.29", "88.08")}
TABLE_5_2 = {32: ("0.014", "0.007"), 64: ("0.0113", "0.0375"), 128: ("0.001", "0.0065")}  # p, S_H = 2 / 1

# Decimal settings a regime cell may name (LRs, weight decays, epochs between world syncs): the rest are figures.
REGIME_SETTINGS = {"lr_scaling.md": {"0.05", "0.1", "0.4", "0.825", "1.6", "16.5"},
                   "assignment_households.md": {"0.1", "1e-4", "5e-4", "0.6", "2.7", "0.09", "0.55"},
                   "assignment_local_sgd.md": {"0.1", "1e-4", "5e-4"}}
VERDICTS = ("reproduced", "consistent with", "not reproduced", "not comparable", "not run")  # docs/studies.md
PER_FINDING_COLUMNS = ["finding", "the thesis", "this study", "regime (the thesis / this study)", "test", "verdict"]


def decimal_figures(text: str) -> set[str]:
    """The decimal figures a table cell quotes ('+' dropped, '-' kept), table numbers ('Table 5.1') aside."""
    import re

    text = re.sub(r"Tables? [A-Z]?\d+\.\d+(?: and [A-Z]?\d+\.\d+)?", "Table", text)
    return {f.lstrip("+") for f in re.findall(r"(?<![\w.])[-+]?(?:\d+\.\d+(?:e-\d+)?|\d+e-\d+)", text)}


def per_finding_table(report: str) -> list[dict]:
    with open(os.path.join(REPO, "docs", "studies", report)) as f:
        section = f.read().split("\n## Per finding\n", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert header == PER_FINDING_COLUMNS and set(rows[0]) == {"---"}
    return [dict(zip(header, row, strict=True)) for row in rows[1:]]


def flat(table) -> set[str]:
    """The figures of a copied table (a list or dict of tuples)."""
    return {figure for row in (table.values() if isinstance(table, dict) else table) for figure in row}


def p_text(p: float) -> str:
    """A p-value as the reports print it: 0.026, or 7.8e-4 under 0.001."""
    if p >= 0.001:
        return f"{p:.3f}"
    mantissa, exponent = f"{p:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def points(difference: float) -> str:
    return f"{100 * difference:.2f}"  # a difference of top-1 fractions, in points of top-1


def anova_from_means(table: list[tuple[str, str]], runs: int = 5) -> float:
    """A one-way ANOVA's p from a table's means and stds (the thesis gives no per-run values)."""
    means, stds = ([float(row[i]) for row in table] for i in (0, 1))
    grand = sum(means) / len(means)
    between = runs * sum((m - grand) ** 2 for m in means) / (len(means) - 1)
    within = sum((runs - 1) * s ** 2 for s in stds) / (len(means) * (runs - 1))
    return stats.f.sf(between / within, len(means) - 1, len(means) * (runs - 1))


class StoredStudy:
    """A committed study.json's runs, and the figures the per-finding tables give from them."""

    def __init__(self, report: str):
        with open(os.path.join(REPO, "docs", "studies", report.removesuffix(".md") + ".json")) as f:
            self.runs = {cell: [run["eval_top1"] for run in runs] for cell, runs in json.load(f)["runs"].items()}

    def mean(self, cell: str) -> float:
        return sum(self.runs[cell]) / len(self.runs[cell])

    def mean_std(self, cell: str) -> set[str]:
        values = self.runs[cell]
        return {f"{self.mean(cell):.4f}", f"{stats.tstd(values):.4f}"}

    def welch(self, cell: str, against: str, alternative: str) -> str:
        return p_text(stats.ttest_ind(self.runs[cell], self.runs[against], equal_var=False,
                                      alternative=alternative).pvalue)

    def difference(self, cell: str, against: str) -> str:
        return points(self.mean(cell) - self.mean(against))


def lr_scaling_findings(study: StoredStudy) -> list[tuple]:
    """(finding, verdict, thesis figures, study figures) of lr_scaling.md's rows, in order."""
    t = {name: figure for name, (figure, *_) in LR_THESIS.items()}

    def against(a: str, b: str) -> set[str]:  # two of the thesis's single runs and their difference
        return {t[a], t[b], f"{float(t[a]) - float(t[b]):.2f}"}

    def power_at_thesis(cell: str, other: str, a: str, b: str, alternative: str) -> set[str]:
        """The test's power at the thesis's difference (a - b) and the cells' pooled SD, both as printed."""
        sd = power.pooled_sd([study.runs[cell], study.runs[other]])
        at_thesis = power.t_test_power((float(t[a]) - float(t[b])) / 100, sd, 5, alternative)
        return {f"{at_thesis:.2f}", points(sd)}

    b32 = study.runs["b32"][0]
    linear_sd = stats.tstd(study.runs["linear"])
    b32_power = power.one_sample_t_power((float(t["linear"]) - float(t["1 GPU"])) / 100, linear_sd, 5, "less")
    assert all(math.isfinite(v) and v > 0.1 for v in study.runs["linear"])  # no run diverged: 10 classes
    return [
        ("Exp 4:", "not run", {t["naive, 1 GPU"], t["naive, 32 GPUs"]}, set()),
        ("Exp 5:", "reproduced", {t["linear"]}, study.mean_std("linear")),
        ("Exp 5 against the 1-GPU run", "reproduced", against("linear", "1 GPU"),
         {f"{b32:.4f}", points(study.mean("linear") - b32),
          p_text(stats.ttest_1samp(study.runs["linear"], b32, alternative="less").pvalue),
          f"{b32_power:.2f}", points(linear_sd)}),
        ("Exp 6 against Exp 5", "reproduced", against("stepping 5", "linear"),
         study.mean_std("stepping1") | study.mean_std("linear")
         | {study.difference("stepping1", "linear"), study.welch("stepping1", "linear", "greater")}
         | power_at_thesis("stepping1", "linear", "stepping 5", "linear", "greater")
         | {p_text(min(1.0, 7 * stats.ttest_ind(study.runs["stepping1"], study.runs["linear"], equal_var=False,
                                                alternative="greater").pvalue))}),  # Bonferroni over the 7 tests
        ("Exp 8 against Exp 5", "not comparable", against("gradual 5", "linear"),
         study.mean_std("gradual1") | {study.difference("gradual1", "linear"),
                                       study.welch("gradual1", "linear", "greater")}
         | power_at_thesis("gradual1", "linear", "gradual 5", "linear", "greater")),
        ("Exp 9 against Exp 5", "not comparable", against("gradual 10", "linear"),
         study.mean_std("gradual2") | {study.difference("gradual2", "linear"),
                                       study.welch("gradual2", "linear", "greater")}
         | power_at_thesis("gradual2", "linear", "gradual 10", "linear", "greater")),
        ("Exp 9 against Exp 8", "not comparable", against("gradual 10", "gradual 5"),
         {study.difference("gradual2", "gradual1"), study.welch("gradual2", "gradual1", "two-sided")}
         | power_at_thesis("gradual2", "gradual1", "gradual 10", "gradual 5", "two-sided")),
        ("Exp 8 against Exp 6", "not comparable", against("gradual 5", "stepping 5"),
         {study.difference("gradual1", "stepping1"), study.welch("gradual1", "stepping1", "two-sided")}
         | power_at_thesis("gradual1", "stepping1", "gradual 5", "stepping 5", "two-sided")),
        ("Exp 7 against Exp 6", "not comparable", against("stepping 5, 32 a GPU", "stepping 5"),
         study.mean_std("stepping1_b256") | {study.difference("stepping1_b256", "stepping1"),
                                             study.welch("stepping1_b256", "stepping1", "two-sided")}
         | power_at_thesis("stepping1_b256", "stepping1", "stepping 5, 32 a GPU", "stepping 5", "two-sided")),
    ]


def households_findings(study: StoredStudy) -> list[tuple]:
    """(finding, verdict, thesis figures, study figures) of assignment_households.md's rows, in order."""
    workers = ["m1", "m2", "m4", "m8"]
    e1_means = [study.mean(cell) for cell in workers]
    slope = stats.linregress([math.log2(int(cell[1:])) for cell in workers for _ in study.runs[cell]],
                             [v for cell in workers for v in study.runs[cell]])
    schemes = ["m8", *(f"{scheme}_c{c}" for c in (2, 4) for scheme in ("coarse", "medium_coarse", "fine_grained"))]
    b2_means = [float(mean) for mean, _ in TABLE_B2]
    households = [f"households_sh{sh}_lw{lw}" for lw in (4, 8, 16) for sh in (4, 1)]
    sd = power.pooled_sd([study.runs[cell] for cell in households])
    gain = 0.008  # about the smallest of the thesis's gains from overlap (0.82 points), as a fraction
    gain_power = power.t_test_power(gain, sd, 5, "greater")  # 5 runs a cell
    smallest_drop = min(float(a) - float(b) for a, b in zip(TABLE_5_1[32], TABLE_5_1[128])) / 100
    drop_power = power.t_test_power(-smallest_drop, sd, 5, "less")
    # E1's ANOVA corrected over the report's 7 declared tests, without m8's lowest seed, on ranks; its power
    # against a spread of means the size of Table B.1's (M = 1-8)
    e1_runs = [study.runs[cell] for cell in workers]
    e1_p = stats.f_oneway(*e1_runs).pvalue
    e1_sd = power.pooled_sd(e1_runs)
    b1_spread = power.means_spread([float(mean) for mean, _ in TABLE_B1[:4]]) / 100
    e1_more = {p_text(min(1.0, 7 * e1_p)), p_text(stats.f_oneway(*e1_runs[:3], sorted(study.runs["m8"])[1:]).pvalue),
               p_text(stats.kruskal(*e1_runs).pvalue), points(e1_sd),
               f"{power.anova_power(b1_spread, e1_sd, cells=4, runs_per_cell=5):.2f}"}
    # E2.2's ANOVA: its power against a spread of means the size of Table B.2's, and a pairwise test's at 0.5 points
    e22_sd = power.pooled_sd([study.runs[cell] for cell in schemes])
    e22_anova = power.anova_power(power.means_spread(b2_means) / 100, e22_sd, cells=len(schemes), runs_per_cell=5)
    e22_more = {f"{e22_anova:.2f}", "0.5", f"{power.t_test_power(0.005, e22_sd, 5):.2f}", points(e22_sd)}
    e32 = set()
    for lw in (4, 8, 16):
        overlap, disjoint = f"households_sh1_lw{lw}", f"households_sh4_lw{lw}"
        bound = stats.ttest_ind(study.runs[overlap], study.runs[disjoint], equal_var=False,
                                alternative="less").confidence_interval(0.95).high
        e32 |= study.mean_std(overlap) | study.mean_std(disjoint) | {
            study.difference(overlap, disjoint), points(bound), study.welch(overlap, disjoint, "greater")}
    return [
        ("E1:", "not reproduced",
         {*flat(TABLE_B1), f"{float(TABLE_B1[4][0]) - float(TABLE_B1[0][0]):.2f}",
          f"{float(TABLE_B1[3][0]) - float(TABLE_B1[0][0]):.2f}",
          p_text(anova_from_means(TABLE_B1)), p_text(anova_from_means(TABLE_B1[:4]))},
         set().union(*(study.mean_std(cell) for cell in workers))
         | {points(max(e1_means) - min(e1_means)), points(slope.slope), p_text(slope.pvalue),
            p_text(e1_p)} | e1_more),
        ("E2.2:", "consistent with",
         {f"{min(b2_means):.2f}", f"{max(b2_means):.2f}", p_text(anova_from_means(TABLE_B2))},
         set().union(*(study.mean_std(cell) for cell in schemes))
         | {p_text(stats.f_oneway(*(study.runs[cell] for cell in schemes)).pvalue)} | e22_more),
        ("E3.2 (its E3.2.4):", "not comparable", flat(TABLE_5_1) | flat(TABLE_5_2),
         e32 | {f"{100 * gain:.1f}", f"{gain_power:.2f}", points(sd)}),
        ("Rarer world syncs", "reproduced",
         {*TABLE_5_1[32], *TABLE_5_1[128], *(f"{float(b) - float(a):.2f}" for a, b in zip(TABLE_5_1[32],
                                                                                        TABLE_5_1[128]))},
         {item for sh in (4, 1) for item in (study.difference(f"households_sh{sh}_lw16", f"households_sh{sh}_lw4"),
                                             study.welch(f"households_sh{sh}_lw16", f"households_sh{sh}_lw4",
                                                         "less"))}
         | {f"{drop_power:.2f}", points(sd)}),
    ]


def local_sgd_findings(study: StoredStudy) -> list[tuple]:
    """(finding, verdict, thesis figures, study figures) of assignment_local_sgd.md's rows, in order."""
    assignments = ("disjoint", "overlap", "full")
    b2_means = [float(mean) for mean, _ in TABLE_B2]
    gains = [float(overlap) - float(means[0]) for means in TABLE_5_1.values() for overlap in means[1:]]
    by_period = {period: [v for a in assignments for v in study.runs[f"{a}_{period}"]]
                 for period in ("sync", "local8", "local64")}

    def mean(values):
        return sum(values) / len(values)

    # Two-sided pairwise power at 0.5 and 1 point, the ANOVA's against Table B.2's spread: SD pooled over the 9 cells
    sd = power.pooled_sd(list(study.runs.values()))
    pairwise = {f"{power.t_test_power(difference, sd, 3):.2f}" for difference in (0.005, 0.01)} | {"0.5", points(sd)}
    anova = power.anova_power(power.means_spread(b2_means) / 100, sd, cells=3, runs_per_cell=3)

    fewer_syncs = set()
    for period, shorter in (("local8", "sync"), ("local64", "local8")):
        fewer_syncs |= {f"{mean(by_period[period]):.4f}", points(mean(by_period[period]) - mean(by_period[shorter])),
                        p_text(stats.ttest_ind(by_period[period], by_period[shorter], equal_var=False,
                                               alternative="less").pvalue)}
    return [
        ("E1:", "not run", {mean for mean, _ in TABLE_B1}, set()),
        ("E2.1 and E2.2:", "consistent with", {f"{min(b2_means):.2f}", f"{max(b2_means):.2f}"},
         set().union(*(study.mean_std(f"{a}_sync") for a in assignments))
         | {p_text(stats.f_oneway(*(study.runs[f"{a}_sync"] for a in assignments)).pvalue), f"{anova:.2f}"}
         | pairwise),
        ("E2.3:", "not run", flat(TABLE_B3), set()),
        ("E3.1: disjoint against full", "consistent with", set(),
         {item for period in ("local8", "local64") for item in (
             *study.mean_std(f"disjoint_{period}"), *study.mean_std(f"full_{period}"),
             study.welch(f"disjoint_{period}", f"full_{period}", "two-sided"))}
         | pairwise | {points(power.detectable_difference(sd, 3))}),
        ("E3.1: rarer syncs", "reproduced", set(), fewer_syncs | {f"{mean(by_period['sync']):.4f}"}),
        ("E3.1: the drop grows", "not run", set(), set()),
        ("E3.2.4:", "not run", {f"{min(gains):.2f}", f"{max(gains):.2f}", min(flat(TABLE_5_2), key=float),
                                max(flat(TABLE_5_2), key=float)}, set()),
    ]


PER_FINDING = {"lr_scaling.md": lr_scaling_findings, "assignment_households.md": households_findings,
               "assignment_local_sgd.md": local_sgd_findings}


@pytest.mark.parametrize("report", sorted(PER_FINDING))
def test_a_reports_per_finding_table_quotes_the_theses_tables_and_its_study_json(report):
    """Every figure in the per-finding table is the thesis's (from its tables, as seed_tables.md gives them) or
    recomputes from the committed study.json; each row has a regime, the test behind it and one of four verdicts."""
    import re

    rows = per_finding_table(report)
    expected = PER_FINDING[report](StoredStudy(report))
    assert [row["finding"].startswith(finding) for row, (finding, *_) in zip(rows, expected)] == [True] * len(rows)
    assert len(rows) == len(expected)
    for row, (finding, verdict, thesis, study) in zip(rows, expected):
        assert re.match("|".join(sorted(VERDICTS, key=len, reverse=True)), row["verdict"])[0] == verdict, finding
        assert decimal_figures(row["finding"] + row["verdict"]) == set(), finding
        assert decimal_figures(row["the thesis"]) == thesis, finding
        assert decimal_figures(row["this study"] + " " + row["test"]) == study, finding
        assert decimal_figures(row["regime (the thesis / this study)"]) <= REGIME_SETTINGS[report], finding
        assert (row["test"] == "-") == (verdict == "not run"), finding


def seed_table(text: str, table: str) -> list[str]:
    """The lines of the one bullet of seed_tables.md that names a table ('Table 12,', 'Table B.1', 'Table 5.1**'), up to
    the next bullet at its level or above."""
    lines = text.splitlines()

    def bullet_indent(line: str) -> int | None:
        return len(line) - len(line.lstrip()) if line.lstrip().startswith("- ") else None

    (start,) = [i for i, line in enumerate(lines) if table in line and bullet_indent(line) is not None]
    end = next((j for j in range(start + 1, len(lines))
                if bullet_indent(lines[j]) is not None and bullet_indent(lines[j]) <= bullet_indent(lines[start])),
               len(lines))
    return lines[start:end]


def test_the_copied_thesis_figures_are_those_of_seed_tables():
    """The per-finding test's copies of the theses' figures, each found in its table's row of
    ../shared/seed_tables.md."""
    import re

    if not os.path.exists(SEED_TABLES):
        pytest.skip(f"{SEED_TABLES} is not beside the repository")
    with open(SEED_TABLES) as f:
        text = f.read()

    def in_row(table: str, row: str, *figures: str) -> bool:
        return any(row in line and all(re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", line)
                                       for figure in figures) for line in seed_table(text, table))

    for name, (figure, table, row) in LR_THESIS.items():
        assert in_row(table, row, f"{figure} %"), name
    for workers, (mean, std) in zip((1, 2, 4, 8, 16), TABLE_B1):
        assert in_row("Table B.1", f"| {workers} |", f"{mean} ± {std}"), workers
    assert all(in_row("Table B.2", "|", f"{mean} ± {std}") for mean, std in TABLE_B2)
    for row, figures in TABLE_B3.items():
        assert in_row("Table B.3", row, *figures), row
    for lw, means in TABLE_5_1.items():
        assert any(re.match(rf"\s*\| {lw} \| \**{means[0]} ± [\d.]+\** \| \**{means[1]} ± [\d.]+\** \| "
                            rf"\**{means[2]} ± ", line) for line in seed_table(text, "Table 5.1**")), lw
    for lw, ps in TABLE_5_2.items():
        assert any(re.match(rf"\s*\| {lw} \| \**{ps[0]}\** \| \**{ps[1]}\** \|", line)
                   for line in seed_table(text, "Table 5.2**")), lw


@pytest.mark.parametrize("path", [*sorted(glob.glob(os.path.join(REPO, "docs", "studies", "*.md"))), *STUDY_FILES],
                         ids=os.path.basename)
def test_no_report_or_study_file_calls_a_thesis_figure_missing(path):
    """The theses quote every figure the studies set beside (seed_tables.md has them all): none is 'not quoted'."""
    with open(path) as f:
        text = " ".join(f.read().split()).lower()
    assert [phrase for phrase in ("not quoted", "quotes no", "no figure", "figures are not", "figure is not")
            if phrase in text] == []
