"""The rules for keys whose meaning spans several values: which data each worker reads
(`data.assignment`, `data.copies`), the LR schedule (`schedule.*`) and local SGD (`distribute.sync` and
its periods and households). Each check raises ValueError naming the key and the bad value; the run's
modules that take the same values (the assignment patterns, the schedules, the sync plan) read their
meaning here too, so validation and the run cannot disagree. Pure Python, no TensorFlow.
"""

from __future__ import annotations

from tfscale.config.names import ASSIGNMENT_SCHEMES, DECAYS, SYNC_MODES, WARMUP_GRANULARITIES, WARMUPS

# data.assignment schemes that read `data.copies` (disjoint reads 1 copy, full M).
_TAKES_COPIES = ("coarse", "medium_coarse", "fine_grained", "overlap")


def check_assignment(scheme: str, copies: int, num_workers: int) -> None:
    """ValueError naming the bad value: unknown scheme, num_workers < 1, copies outside [1, M], or
    (coarse) copies that do not divide the workers. `copies` is ignored by `disjoint` and `full`."""
    if scheme not in ASSIGNMENT_SCHEMES:
        raise ValueError(f"assignment scheme {scheme!r} is not one of {ASSIGNMENT_SCHEMES}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if scheme not in _TAKES_COPIES:
        return
    if isinstance(copies, bool) or not isinstance(copies, int):
        raise ValueError(f"copies must be an int, got {copies!r}")
    if not 1 <= copies <= num_workers:
        raise ValueError(f"copies={copies} must be in [1, num_workers={num_workers}] for scheme {scheme!r} "
                         f"(1 = disjoint, {num_workers} = full)")
    if scheme == "coarse" and num_workers % copies:
        divisors = [c for c in range(1, num_workers + 1) if num_workers % c == 0]
        raise ValueError(f"copies={copies} must divide num_workers={num_workers} for scheme 'coarse' (groups of "
                         f"C workers hold equal data): use one of {divisors}, or medium_coarse / fine_grained")


def num_copies(scheme: str, copies: int, num_workers: int) -> int:
    """C: how many workers read each item (1 for disjoint, M for full)."""
    check_assignment(scheme, copies, num_workers)
    return {"disjoint": 1, "full": num_workers}.get(scheme, copies)


def num_households(households: int, num_replicas: int) -> int:
    """H: `distribute.households`, or one household per worker when it is 0."""
    return households or num_replicas


def check_local_sgd(cfg, num_replicas: int | None = None) -> None:
    """ValueError naming the key and value of a local-SGD setting tfscale cannot run."""
    dist = cfg.distribute
    if dist.sync not in SYNC_MODES:
        raise ValueError(f"config.distribute.sync={dist.sync!r} is not one of: {', '.join(SYNC_MODES)}")
    for key in ("sync_period", "household_period"):
        if dist[key] < 1:
            raise ValueError(f"config.distribute.{key} must be >= 1, got {dist[key]}")
    if dist.households < 0:
        raise ValueError(f"config.distribute.households must be >= 0 (0: every worker its own), got {dist.households}")
    if dist.post_local_after_epochs < 0:
        raise ValueError(f"config.distribute.post_local_after_epochs must be >= 0, got {dist.post_local_after_epochs}")
    if dist.sync != "local_sgd":
        return
    if dist.sync_period % dist.household_period:
        raise ValueError(f"config.distribute.household_period={dist.household_period} must divide "
                         f"config.distribute.sync_period={dist.sync_period} (household averages fall between world syncs)")
    refused = {
        "precision": (cfg.precision == "mixed_float16", cfg.precision,
                      "float16 loss scaling decides skipped steps per worker; use float32 or mixed_bfloat16"),
        "model.sync_bn": (cfg.model.sync_bn, cfg.model.sync_bn,
                          "synchronized BatchNorm all-reduces every step; local SGD averages BatchNorm at world syncs"),
        "optim.ema_decay": (cfg.optim.ema_decay > 0, cfg.optim.ema_decay,
                            "the weight EMA is not averaged between workers (untested); set it to 0"),
    }
    for key, (is_refused, value, why) in refused.items():
        if is_refused:
            raise ValueError(f"config.{key}={value!r} does not go with config.distribute.sync='local_sgd': {why}")
    if dist.households not in (0, 1) and dist.backend not in ("mwms", "horovod"):
        raise ValueError(f"config.distribute.households={dist.households} needs backend mwms or horovod "
                         f"(group all-reduces between workers), not {dist.backend!r}")
    if num_replicas is not None and num_replicas % num_households(dist.households, num_replicas):
        raise ValueError(f"config.distribute.households={dist.households} must divide the {num_replicas} replicas "
                         "(households are equal groups of consecutive workers)")


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def unknown_schedule_choice(key: str, value, choices) -> str:
    return f"config.schedule.{key}={value!r} is not one of: {', '.join(choices)}"


def require_schedule_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(unknown_schedule_choice(key, value, choices))


def _check_warmup(schedule_cfg, total_epochs: float) -> None:
    require_schedule_choice("warmup", schedule_cfg.warmup, WARMUPS)
    require_schedule_choice("warmup_granularity", getattr(schedule_cfg, "warmup_granularity", "auto"), WARMUP_GRANULARITIES)
    if getattr(schedule_cfg, "warmup_granularity", "auto") == "epoch" and schedule_cfg.warmup == "horovod":
        raise ValueError("config.schedule.warmup_granularity='epoch' does not apply to warmup='horovod' (Horovod's "
                         "callback changes the LR every batch); use 'step'")
    if schedule_cfg.warmup == "none":
        return  # warmup_epochs is ignored, so a leftover default must not fail a short run
    warmup_epochs = schedule_cfg.warmup_epochs
    if not warmup_epochs >= 0:
        raise ValueError(f"config.schedule.warmup_epochs must be >= 0, got {warmup_epochs}")
    if warmup_epochs >= total_epochs:
        raise ValueError(
            f"config.schedule.warmup_epochs={warmup_epochs} must be shorter than "
            f"config.train.epochs={total_epochs}: warmup longer than training"
        )


def _check_decay(schedule_cfg, total_epochs: float) -> None:
    require_schedule_choice("decay", schedule_cfg.decay, DECAYS)
    if schedule_cfg.decay == "step":
        boundaries = tuple(schedule_cfg.decay_epochs)
        for earlier, later in zip((0,) + boundaries, boundaries):
            if not later > earlier:
                raise ValueError(
                    f"config.schedule.decay_epochs={boundaries} must be positive and strictly increasing "
                    f"(absolute epochs), but {later} follows {earlier}"
                )
        if boundaries and boundaries[-1] > total_epochs:
            raise ValueError(
                f"config.schedule.decay_epochs={boundaries} has boundary {boundaries[-1]} beyond "
                f"config.train.epochs={total_epochs}: that decay would never happen. Give boundaries within the "
                "run (--config.schedule.decay_epochs='(...)'), or fractions of the epochs that follow "
                "train.epochs (--config.schedule.decay_epochs='()' --config.schedule.decay_fractions='(...)')"
            )
    if schedule_cfg.decay == "exponential" and not schedule_cfg.exp_decay_every_epochs > 0:
        raise ValueError(
            f"config.schedule.exp_decay_every_epochs must be > 0 for decay='exponential', "
            f"got {schedule_cfg.exp_decay_every_epochs}"
        )


def check_schedule(schedule_cfg, *, total_epochs: float) -> None:
    """Raises ValueError naming the key and the bad value; returns None for a usable schedule.

    Checks: warmup/decay names; 0 <= warmup_epochs < total_epochs (skipped for warmup 'none', which
    ignores warmup_epochs); step boundaries positive, strictly increasing and <= total_epochs;
    exp_decay_every_epochs > 0 for the exponential decay.
    """
    _check_warmup(schedule_cfg, total_epochs)
    _check_decay(schedule_cfg, total_epochs)
