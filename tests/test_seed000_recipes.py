"""configs/seed000_r50.py: the large-batch ImageNet study's six methods, exactly (LR tables per epoch)."""

import os

import pytest
from conftest import load_config, run_cli

from tfscale import config as tfs_config
from tfscale.config import validation
from tfscale.configs import seed000_r50
from tfscale.model import schedules


def lr_at_epoch_starts(method, *overrides, epochs=(0, 1, 2, 3, 4, 5, 6, 9, 10, 29, 30, 59, 60, 79, 80, 89)):
    # Any existing directory passes for the shards: nothing is read.
    cfg = load_config(f"seed000_r50:{method}", f"--config.data.data_dir={os.path.dirname(__file__)}", *overrides)
    validation.validate(cfg, num_replicas=32)
    steps = tfs_config.to_steps(cfg)
    lr = schedules.make_schedule(cfg.schedule, base_lr=cfg.optim.lr, steps_per_epoch=steps.steps_per_epoch,
                                 total_steps=steps.train_steps, num_replicas=32)
    return cfg, steps, {e: lr(e * steps.steps_per_epoch) for e in epochs}, lr


@pytest.mark.parametrize("method, table", [
    ("naive", [0.1] * 8),
    ("linear", [1.6] * 8),
    ("stepping5", [1.6 / 6, 3.2 / 6, 0.8, 6.4 / 6, 8 / 6, 1.6, 1.6, 1.6]),
    ("stepping5_32", [0.4 / 6, 0.8 / 6, 0.2, 1.6 / 6, 2 / 6, 0.4, 0.4, 0.4]),
    ("gradual5", [0.05, 0.36, 0.67, 0.98, 1.29, 1.6, 1.6, 1.6]),
    ("gradual10", [0.05, 0.205, 0.36, 0.515, 0.67, 0.825, 0.98, 1.445]),
])
def test_each_method_is_the_studys_lr_table_per_epoch(method, table):
    cfg, steps, at, lr = lr_at_epoch_starts(method)
    assert [at[e] for e in (0, 1, 2, 3, 4, 5, 6, 9)] == [pytest.approx(x, abs=1e-12) for x in table]
    peak = table[-1] if method != "gradual10" else 1.6
    assert at[10] == pytest.approx(peak) and at[29] == pytest.approx(peak)
    assert [at[e] for e in (30, 59, 60, 79, 80, 89)] == [pytest.approx(peak * f) for f in (0.1, 0.1, 0.01, 0.01,
                                                                                            0.001, 0.001)]
    # The warmup LR changes only at epoch starts (the study set it per epoch), and nothing else moved.
    assert lr(steps.steps_per_epoch + 7) == at[1]
    assert (cfg.data.global_batch_size, cfg.train.epochs, tuple(cfg.schedule.decay_epochs)) == (
        1024 if method == "stepping5_32" else 4096, 90.0, (30, 60, 80))
    assert (cfg.optim.momentum, cfg.optim.weight_decay, cfg.model.name) == (0.9, 1e-4, "resnet50")


def test_per_step_granularity_is_goyal_et_al():
    _, steps, _, lr = lr_at_epoch_starts("gradual5", "--config.schedule.warmup_granularity=step")
    half_epoch = steps.steps_per_epoch // 2
    assert lr(half_epoch) == pytest.approx(0.05 + 1.55 * half_epoch / (5 * steps.steps_per_epoch))


def test_naive_lr_stays_0_1_at_any_batch():
    cfg = load_config("seed000_r50:naive", "--config.data.global_batch_size=8192")
    assert cfg.optim.lr == pytest.approx(0.1)


@pytest.mark.slow
def test_a_missing_or_unknown_method_is_one_line(tmp_path):
    result = run_cli("tfscale.train", "--config=configs/seed000_r50.py:cosine", f"--workdir={tmp_path}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "FATAL config error: seed000_r50:cosine is not a method of this study: use one of "
        + ", ".join(seed000_r50.METHODS))
    missing = run_cli("tfscale.train", "--config=configs/seed000_r50.py", f"--workdir={tmp_path}")
    assert "seed000_r50 needs a method: seed000_r50.py:METHOD" in missing.stderr.strip().splitlines()[-1]
