"""Tests for tfscale.model.schedules: LR per step for every warmup and decay, against hand-computed numbers.

Every expected value below is worked out by hand in the comment next to it (not produced by the code
under test). Pure Python: no TensorFlow, runs in well under a second.
"""

import math
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from tfscale.config import base_config, names, rules
from tfscale.model import schedules

IMAGENET_TRAIN_IMAGES = 1_281_167


def linked_lr(lr_per_256: float, global_batch_size: int) -> float:
    """config.optim.lr, the linked linear-scaling field, for this batch."""
    cfg = base_config()
    cfg.optim.lr_per_256 = lr_per_256
    cfg.data.global_batch_size = global_batch_size
    return cfg.optim.lr


def sched_cfg(**overrides) -> ml_collections.ConfigDict:
    """A schedule config with the base_config defaults, changed by `overrides`."""
    c = ml_collections.ConfigDict()
    c.warmup = "none"
    c.warmup_epochs = 5.0
    c.warmup_init_lr = 0.0
    c.warmup_granularity = "auto"
    c.decay = "constant"
    c.decay_epochs = (30, 60, 80)
    c.decay_factor = 0.1
    c.exp_decay_every_epochs = 2.4
    c.poly_power = 2.0
    c.end_lr = 0.0
    c.update(overrides)
    return c


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------------------------------
# Linear scaling rule
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lr_per_256, batch, expected", [
    (0.1, 4096, 1.6),    # 0.1 * 4096 / 256 = 0.1 * 16
    (0.1, 256, 0.1),
    (0.1, 8192, 3.2),    # Goyal et al.: 8k batch -> 3.2
    (0.1, 1024, 0.4),
    (0.2, 128, 0.1),
])
def test_scaled_lr(lr_per_256, batch, expected):
    assert linked_lr(lr_per_256, batch) == approx(expected)


def test_scaled_lr_32_gpu_recipe_is_exactly_1_6():
    assert linked_lr(0.1, 4096) == 1.6


# --------------------------------------------------------------------------------------------------
# 32-GPU ImageNet recipe (Goyal et al.): batch 4096, lr 1.6, gradual warmup 5 epochs from 0.1,
# step decay /10 at epochs 30, 60, 80, 90 epochs.
# steps_per_epoch = 1281167 // 4096 = 312 (312 * 4096 = 1,277,952; the remaining 3,215 are dropped)
# warmup_steps = 5 * 312 = 1560; boundaries at steps 30*312 = 9360, 60*312 = 18720, 80*312 = 24960;
# total_steps = 90 * 312 = 28080.
# --------------------------------------------------------------------------------------------------

GOYAL_STEPS_PER_EPOCH = 312


@pytest.fixture
def goyal_lr():
    assert IMAGENET_TRAIN_IMAGES // 4096 == GOYAL_STEPS_PER_EPOCH
    cfg = sched_cfg(warmup="gradual", warmup_epochs=5.0, warmup_init_lr=0.1, decay="step",
                    decay_epochs=(30, 60, 80), decay_factor=0.1)
    return schedules.make_schedule(cfg, base_lr=linked_lr(0.1, 4096),
                                   steps_per_epoch=GOYAL_STEPS_PER_EPOCH, total_steps=90 * 312)


@pytest.mark.parametrize("step, expected", [
    (0, 0.1),                        # warmup starts at warmup_init_lr
    (1, 0.1 + 1.5 / 1560),           # + (1.6 - 0.1) / 1560 per step = 0.100961538...
    (312, 0.4),                      # one epoch in: 0.1 + 1.5 * 312/1560 = 0.1 + 0.3
    (780, 0.85),                     # mid-warmup: 0.1 + 1.5 * 0.5
    (1559, 1.6 - 1.5 / 1560),        # last warmup step: 1.599038461538...
    (1560, 1.6),                     # end of warmup (epoch 5): target
    (5000, 1.6),
    (9359, 1.6),                     # just before epoch 30
    (9360, 0.16),                    # epoch 30: /10
    (18719, 0.16),                   # just before epoch 60
    (18720, 0.016),                  # epoch 60: /100
    (24959, 0.016),                  # just before epoch 80
    (24960, 0.0016),                 # epoch 80: /1000
    (28079, 0.0016),                 # last step of training
    (28080, 0.0016),                 # beyond the end: stays
])
def test_goyal_recipe_gradual_warmup_and_step_decay(goyal_lr, step, expected):
    assert goyal_lr(step) == approx(expected)


def test_gradual_warmup_is_linear_per_step(goyal_lr):
    lrs = np.array([goyal_lr(s) for s in range(1561)])
    np.testing.assert_allclose(np.diff(lrs), 1.5 / 1560, rtol=1e-9)


# --------------------------------------------------------------------------------------------------
# Warmups
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("epoch, expected", [
    (0, 0.26667),    # 1.6 * 1/6
    (1, 0.53333),    # 1.6 * 2/6
    (2, 0.8),        # 1.6 * 3/6
    (3, 1.06667),    # 1.6 * 4/6
    (4, 1.33333),    # 1.6 * 5/6
    (5, 1.6),        # warmup over
    (6, 1.6),
])
def test_stepping_warmup_is_constant_within_each_epoch(epoch, expected):
    steps_per_epoch = 10
    lr = schedules.make_schedule(sched_cfg(warmup="stepping", warmup_epochs=5.0), base_lr=1.6,
                                 steps_per_epoch=steps_per_epoch, total_steps=100)
    for batch in range(steps_per_epoch):
        assert lr(epoch * steps_per_epoch + batch) == pytest.approx(expected, abs=5e-6)


def test_stepping_warmup_exact_values():
    lr = schedules.make_schedule(sched_cfg(warmup="stepping", warmup_epochs=5.0), base_lr=1.6,
                                 steps_per_epoch=4, total_steps=40)
    per_epoch = [lr(4 * e) for e in range(7)]
    # 1.6 * k / 6 = 4k / 15
    assert per_epoch == [approx(4 / 15), approx(8 / 15), approx(12 / 15), approx(16 / 15),
                         approx(20 / 15), approx(1.6), approx(1.6)]


# The large-batch ImageNet study's tables (32 GPUs x 128, LR 0.1 per 256 -> 1.6; the 1-GPU LR 0.05).
EPOCH_TABLES = {
    "gradual": [0.05, 0.36, 0.67, 0.98, 1.29, 1.6, 1.6],
    "stepping": [1.6 * k / 6 for k in range(1, 6)] + [1.6, 1.6],  # 0.2667 ... 1.3333, then 1.6
}


@pytest.mark.parametrize("warmup", ["gradual", "stepping"])
def test_epoch_granularity_changes_the_lr_once_per_epoch_exactly_as_the_study(warmup):
    steps_per_epoch = 7
    lr = schedules.make_schedule(sched_cfg(warmup=warmup, warmup_epochs=5.0, warmup_init_lr=0.05,
                                           warmup_granularity="epoch"),
                                 base_lr=1.6, steps_per_epoch=steps_per_epoch, total_steps=100)
    for epoch, expected in enumerate(EPOCH_TABLES[warmup]):
        within_epoch = [lr(epoch * steps_per_epoch + batch) for batch in range(steps_per_epoch)]
        assert within_epoch == [pytest.approx(expected, abs=1e-12)] * steps_per_epoch


def test_step_granularity_is_goyal_et_al_per_step():
    # Gradual: linear per step from 0.05 to 1.6 over 5 x 4 = 20 steps; stepping: its staircase's line.
    gradual = schedules.make_schedule(sched_cfg(warmup="gradual", warmup_epochs=5.0, warmup_init_lr=0.05,
                                                warmup_granularity="step"),
                                      base_lr=1.6, steps_per_epoch=4, total_steps=40)
    assert [gradual(s) for s in range(0, 21, 5)] == [approx(x) for x in (0.05, 0.4375, 0.825, 1.2125, 1.6)]
    assert gradual(1) == approx(0.05 + 1.55 / 20)
    stepping = schedules.make_schedule(sched_cfg(warmup="stepping", warmup_epochs=5.0, warmup_granularity="step"),
                                       base_lr=1.6, steps_per_epoch=4, total_steps=40)
    assert [stepping(s) for s in (0, 1, 2, 4, 19, 20)] == [
        approx(1.6 * x / 6) for x in (1, 1.25, 1.5, 2, 5.75)] + [approx(1.6)]
    # auto keeps each warmup's own granularity: gradual per step, stepping per epoch.
    auto = schedules.make_schedule(sched_cfg(warmup="stepping", warmup_epochs=5.0), base_lr=1.6,
                                   steps_per_epoch=4, total_steps=40)
    assert auto(1) == auto(3) == approx(1.6 / 6)


def test_warmup_granularity_errors_name_the_value():
    with pytest.raises(ValueError, match="warmup_granularity='batch' is not one of: auto, step, epoch"):
        rules.check_schedule(sched_cfg(warmup="gradual", warmup_granularity="batch"), total_epochs=10)
    with pytest.raises(ValueError, match="warmup_granularity='epoch' does not apply to warmup='horovod'"):
        rules.check_schedule(sched_cfg(warmup="horovod", warmup_granularity="epoch"), total_epochs=10)


@pytest.mark.parametrize("step, expected", [
    # base 0.8, 8 replicas, 2 warmup epochs of 100 steps -> warmup_steps 200.
    # Horovod: lr = 0.8/8 * (epoch * 7 / 2 + 1), epoch = current_epoch + (batch + 1) / 100.
    (0, 0.1035),     # epoch 0.01: 0.1 * (1 + 0.035)
    (49, 0.275),     # epoch 0.50: 0.1 * (1 + 1.75)
    (99, 0.45),      # epoch 1.00: 0.1 * (1 + 3.5)
    (149, 0.625),    # epoch 1.50: 0.1 * (1 + 5.25)
    (199, 0.8),      # epoch 2.00: 0.1 * (1 + 7) -> reaches base_lr on the last warmup batch
    (200, 0.8),      # after warmup: constant decay
    (1000, 0.8),
])
def test_horovod_warmup_from_lr_over_size_to_lr(step, expected):
    lr = schedules.make_schedule(sched_cfg(warmup="horovod", warmup_epochs=2.0), base_lr=0.8,
                                 steps_per_epoch=100, total_steps=1000, num_replicas=8)
    assert lr(step) == approx(expected)


def test_horovod_warmup_starts_one_batch_above_lr_over_size():
    # With many steps per epoch the first LR is lr/size to within one batch's increment.
    lr = schedules.make_schedule(sched_cfg(warmup="horovod", warmup_epochs=5.0), base_lr=1.6,
                                 steps_per_epoch=312, total_steps=28080, num_replicas=32)
    # 1.6/32 * (1 + 31 / 1560) = 0.05 * 1.019871794...
    assert lr(0) == approx(0.05 * (1 + 31 / 1560))
    assert lr(1559) == approx(1.6)


def test_horovod_warmup_on_one_replica_is_no_warmup():
    lr = schedules.make_schedule(sched_cfg(warmup="horovod", warmup_epochs=2.0), base_lr=0.8,
                                 steps_per_epoch=100, total_steps=1000, num_replicas=1)
    assert [lr(s) for s in (0, 50, 199, 200)] == [0.8, 0.8, 0.8, 0.8]


def test_no_warmup_ignores_warmup_epochs():
    lr = schedules.make_schedule(sched_cfg(warmup="none", warmup_epochs=5.0, warmup_init_lr=0.01),
                                 base_lr=0.4, steps_per_epoch=10, total_steps=100)
    assert lr(0) == 0.4 and lr(49) == 0.4


def test_zero_warmup_epochs_means_no_warmup():
    lr = schedules.make_schedule(sched_cfg(warmup="gradual", warmup_epochs=0.0, warmup_init_lr=0.0),
                                 base_lr=0.4, steps_per_epoch=10, total_steps=100)
    assert lr(0) == 0.4


def test_fractional_warmup_epochs_round_to_whole_steps():
    # 0.25 epochs * 10 steps = 2.5 -> round() -> 2 warmup steps: 0.0, 0.5, then 1.0
    lr = schedules.make_schedule(sched_cfg(warmup="gradual", warmup_epochs=0.25, warmup_init_lr=0.0),
                                 base_lr=1.0, steps_per_epoch=10, total_steps=100)
    assert [lr(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]


# --------------------------------------------------------------------------------------------------
# Decays
# --------------------------------------------------------------------------------------------------


def test_step_decay_uses_absolute_epochs_with_a_warmup():
    # steps_per_epoch 10, warmup 5 epochs (50 steps), boundaries at epochs 30/60/80 = steps 300/600/800
    lr = schedules.make_schedule(
        sched_cfg(warmup="gradual", warmup_epochs=5.0, decay="step", decay_epochs=(30, 60, 80),
                  decay_factor=0.5), base_lr=2.0, steps_per_epoch=10, total_steps=900)
    expected = {50: 2.0, 299: 2.0, 300: 1.0, 599: 1.0, 600: 0.5, 799: 0.5, 800: 0.25, 899: 0.25}
    assert {s: lr(s) for s in expected} == {s: approx(v) for s, v in expected.items()}


def test_step_decay_fractional_boundary_hits_its_exact_step():
    # boundary 2.4 epochs at 100 steps/epoch = step 240
    lr = schedules.make_schedule(sched_cfg(decay="step", decay_epochs=(2.4,), decay_factor=0.1),
                                 base_lr=1.0, steps_per_epoch=100, total_steps=500)
    assert (lr(239), lr(240)) == (1.0, approx(0.1))


@pytest.mark.parametrize("step, expected", [
    # base 1.0 -> end 0.0 over steps 0..100, no warmup
    (0, 1.0),
    (25, 0.5 * (1 + math.sqrt(0.5))),   # cos(pi/4) = sqrt(2)/2 -> 0.853553390...
    (50, 0.5),                          # midpoint: cos(pi/2) = 0
    (75, 0.5 * (1 - math.sqrt(0.5))),   # 0.146446609...
    (100, 0.0),
    (150, 0.0),                         # clamped after total_steps
])
def test_cosine_decay(step, expected):
    lr = schedules.make_schedule(sched_cfg(decay="cosine", end_lr=0.0), base_lr=1.0,
                                 steps_per_epoch=10, total_steps=100)
    assert lr(step) == approx(expected)


@pytest.mark.parametrize("step, expected", [
    # warmup 1 epoch = 10 steps, cosine over steps 10..110 from 2.0 to 0.2
    (5, 1.0),      # gradual warmup from 0: 2.0 * 5/10
    (10, 2.0),     # starts at base_lr when the warmup ends
    (60, 1.1),     # midpoint: 0.2 + 1.8 / 2
    (110, 0.2),    # end_lr at total_steps
    (200, 0.2),
])
def test_cosine_decay_spans_post_warmup_steps(step, expected):
    lr = schedules.make_schedule(
        sched_cfg(warmup="gradual", warmup_epochs=1.0, warmup_init_lr=0.0, decay="cosine", end_lr=0.2),
        base_lr=2.0, steps_per_epoch=10, total_steps=110)
    assert lr(step) == approx(expected)


@pytest.mark.parametrize("step, expected", [
    # MLPerf-style: gradual warmup from 0 over 2 epochs = 20 steps; poly power 2 over steps 20..120
    (0, 0.0),
    (10, 1.0),                 # 2.0 * 10/20
    (20, 2.0),                 # end of warmup: base_lr
    (45, 2.0 * 0.75 ** 2),     # t = 25/100 -> 1.125
    (70, 0.5),                 # midpoint: 2.0 * (1 - 0.5)^2
    (120, 0.0),                # end_lr at total_steps
    (130, 0.0),                # clamped
])
def test_polynomial_decay(step, expected):
    lr = schedules.make_schedule(
        sched_cfg(warmup="gradual", warmup_epochs=2.0, warmup_init_lr=0.0, decay="polynomial",
                  poly_power=2.0, end_lr=0.0),
        base_lr=2.0, steps_per_epoch=10, total_steps=120)
    assert lr(step) == approx(expected)


@pytest.mark.parametrize("power, step, expected", [
    (2.0, 70, 0.575),   # 0.1 + (2.0 - 0.1) * 0.25
    (1.0, 70, 1.05),    # 0.1 + 1.9 * 0.5 (linear)
    (2.0, 120, 0.1),
    (2.0, 500, 0.1),
])
def test_polynomial_decay_end_lr_and_power(power, step, expected):
    lr = schedules.make_schedule(
        sched_cfg(warmup="gradual", warmup_epochs=2.0, decay="polynomial", poly_power=power, end_lr=0.1),
        base_lr=2.0, steps_per_epoch=10, total_steps=120)
    assert lr(step) == approx(expected)


@pytest.mark.parametrize("step, expected", [
    # 0.256 * 0.97 ** floor(epoch / 2.4), 100 steps/epoch -> a period is 240 steps
    (0, 0.256),
    (239, 0.256),
    (240, 0.24832),        # 0.256 * 0.97
    (479, 0.24832),
    (480, 0.2408704),      # 0.256 * 0.9409
    (719, 0.2408704),
    (720, 0.233644288),    # 0.256 * 0.912673
])
def test_exponential_decay(step, expected):
    lr = schedules.make_schedule(
        sched_cfg(decay="exponential", decay_factor=0.97, exp_decay_every_epochs=2.4),
        base_lr=0.256, steps_per_epoch=100, total_steps=10_000)
    assert lr(step) == approx(expected)


def test_exponential_decay_decimal_period_boundaries():
    # Period 0.1 epochs at 10 steps/epoch = 1 step: each step halves. In floats 0.3 / 0.1 is
    # 2.9999999999999996, so a naive floor would halve only twice at step 3.
    lr = schedules.make_schedule(
        sched_cfg(decay="exponential", decay_factor=0.5, exp_decay_every_epochs=0.1),
        base_lr=1.0, steps_per_epoch=10, total_steps=100)
    assert [lr(s) for s in range(8)] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125]


def test_constant_decay():
    lr = schedules.make_schedule(sched_cfg(decay="constant"), base_lr=0.3, steps_per_epoch=10,
                                 total_steps=100)
    assert [lr(s) for s in (0, 50, 99, 100, 1000)] == [0.3] * 5


# --------------------------------------------------------------------------------------------------
# Properties every schedule must have
# --------------------------------------------------------------------------------------------------

ALL_COMBINATIONS = [(w, d) for w in names.WARMUPS for d in names.DECAYS]


def _cfg_for(warmup, decay):
    return sched_cfg(warmup=warmup, warmup_epochs=3.0, warmup_init_lr=0.01, decay=decay,
                     decay_epochs=(6, 9), decay_factor=0.5, exp_decay_every_epochs=2.0, end_lr=0.001)


@pytest.mark.parametrize("warmup, decay", ALL_COMBINATIONS)
def test_resumed_run_continues_the_same_curve(warmup, decay):
    steps_per_epoch, total_steps, restart_step = 7, 84, 31
    kwargs = dict(base_lr=0.8, steps_per_epoch=steps_per_epoch, total_steps=total_steps, num_replicas=4)
    one_go = schedules.make_schedule(_cfg_for(warmup, decay), **kwargs)
    curve = [one_go(s) for s in range(total_steps + 1)]
    # A restarted job builds a new schedule from the same config and carries on at the checkpoint step.
    resumed = schedules.make_schedule(_cfg_for(warmup, decay), **kwargs)
    assert [resumed(s) for s in range(restart_step, total_steps + 1)] == curve[restart_step:]


@pytest.mark.parametrize("warmup, decay", ALL_COMBINATIONS)
def test_returns_plain_float_for_numpy_steps(warmup, decay):
    lr = schedules.make_schedule(_cfg_for(warmup, decay), base_lr=0.8, steps_per_epoch=7, total_steps=84)
    for step in (np.int64(0), np.int32(40), 84):
        assert type(lr(step)) is float


@pytest.mark.parametrize("warmup", ["gradual", "stepping", "horovod"])
def test_warmup_never_exceeds_target_and_hands_over_to_base_lr(warmup):
    lr = schedules.make_schedule(_cfg_for(warmup, "constant"), base_lr=0.8, steps_per_epoch=7,
                                 total_steps=84, num_replicas=4)
    warmup_lrs = [lr(s) for s in range(21)]  # 3 epochs * 7 steps
    assert all(0 < x <= 0.8 + 1e-12 for x in warmup_lrs)
    assert warmup_lrs == sorted(warmup_lrs)
    assert lr(21) == 0.8


def test_negative_step_is_rejected():
    lr = schedules.make_schedule(sched_cfg(), base_lr=0.1, steps_per_epoch=10, total_steps=100)
    with pytest.raises(ValueError, match="-1"):
        lr(-1)


def test_make_schedule_rejects_unknown_names_and_bad_counts():
    with pytest.raises(ValueError, match="'linear'"):
        schedules.make_schedule(sched_cfg(warmup="linear"), base_lr=0.1, steps_per_epoch=10, total_steps=100)
    with pytest.raises(ValueError, match="'cos'"):
        schedules.make_schedule(sched_cfg(decay="cos"), base_lr=0.1, steps_per_epoch=10, total_steps=100)
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        schedules.make_schedule(sched_cfg(), base_lr=0.1, steps_per_epoch=0, total_steps=100)


def test_accepts_any_object_with_the_attributes():
    class Plain:
        warmup, warmup_epochs, warmup_init_lr = "gradual", 1.0, 0.0
        decay, decay_epochs, decay_factor = "step", (2,), 0.1
        exp_decay_every_epochs, poly_power, end_lr = 1.0, 2.0, 0.0

    lr = schedules.make_schedule(Plain(), base_lr=1.0, steps_per_epoch=4, total_steps=12)
    assert [lr(s) for s in (0, 2, 4, 8)] == [0.0, 0.5, 1.0, approx(0.1)]
    rules.check_schedule(Plain(), total_epochs=3)


def test_module_does_not_import_tensorflow_or_keras():
    code = ("import sys, tfscale.model.schedules; "
            "bad = [m for m in ('tensorflow', 'keras') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# check()
# --------------------------------------------------------------------------------------------------


def test_check_accepts_the_default_recipes():
    rules.check_schedule(sched_cfg(warmup="gradual", decay="step"), total_epochs=90.0)
    for warmup, decay in ALL_COMBINATIONS:
        rules.check_schedule(_cfg_for(warmup, decay), total_epochs=12.0)


def test_check_accepts_base_config_schedule():
    from tfscale import config

    c = config.base_config()
    rules.check_schedule(c.schedule, total_epochs=c.train.epochs)


@pytest.mark.parametrize("overrides, total_epochs, must_mention", [
    (dict(warmup="linear"), 90, ["'linear'", "none", "gradual", "stepping", "horovod"]),
    (dict(decay="cos"), 90, ["'cos'", "constant", "step", "cosine", "polynomial", "exponential"]),
    (dict(warmup="gradual", warmup_epochs=-1.0), 90, ["warmup_epochs", "-1.0"]),
    (dict(warmup="gradual", warmup_epochs=90.0), 90, ["90.0", "90", "warmup longer than training"]),
    (dict(warmup="stepping", warmup_epochs=12.0), 10.5, ["12.0", "10.5", "warmup longer than training"]),
    (dict(decay="step", decay_epochs=(60, 30, 80)), 90, ["(60, 30, 80)", "30 follows 60"]),
    (dict(decay="step", decay_epochs=(30, 30, 80)), 90, ["(30, 30, 80)", "30 follows 30"]),
    (dict(decay="step", decay_epochs=(0, 30)), 90, ["(0, 30)"]),
    (dict(decay="step", decay_epochs=(30, 60, 100)), 90, ["(30, 60, 100)", "100", "90"]),
    (dict(decay="exponential", exp_decay_every_epochs=0.0), 90, ["exp_decay_every_epochs", "0.0"]),
    (dict(decay="exponential", exp_decay_every_epochs=-2.4), 90, ["exp_decay_every_epochs", "-2.4"]),
])
def test_check_errors_name_the_bad_value(overrides, total_epochs, must_mention):
    with pytest.raises(ValueError) as excinfo:
        rules.check_schedule(sched_cfg(**overrides), total_epochs=total_epochs)
    for text in must_mention:
        assert text in str(excinfo.value), (text, str(excinfo.value))


@pytest.mark.parametrize("overrides", [
    dict(warmup="none", warmup_epochs=100.0),          # ignored without a warmup
    dict(decay="step", decay_epochs=(30, 60, 90)),     # a boundary at the last epoch is allowed
    dict(decay="step", decay_epochs=()),               # no boundaries = constant
    dict(decay="cosine", exp_decay_every_epochs=0.0),  # only the exponential decay reads it
    dict(decay="constant", decay_epochs=(80, 30)),     # only the step decay reads the boundaries
])
def test_check_accepts_unused_or_edge_values(overrides):
    rules.check_schedule(sched_cfg(**overrides), total_epochs=90)
