"""The workdir's guards: one job at a time, a config that stays the run's, a metrics log without replays.

Only the chief calls these (`train.py` shares its verdict with the other workers):

  lock = workdir.claim(path, cfg_dict, resume_cfg)   # refuses a second job, or a changed recipe
  workdir.trim_metrics(path, start_step)             # after restore: drop rows the resumed run replays
  ...
  lock.release()

**The lock** is `lock.json` (host, pid, Slurm job, start time), created atomically with a hard link,
so that of two jobs starting at once one wins, also on NFS. A live holder refreshes its mtime; a
second job is refused naming the holder's host and pid. A lock is taken over, with a warning, when
its holder is provably gone: its process no longer exists on this host, Slurm requeued the job that
holds it (same job id, a later restart count: Slurm starts the new incarnation only once the old one
has ended), or it was not refreshed for `resume.lock_stale_after_s` (a node that died).

**The config** of a resumed run must compute what the checkpoint's run computed: a rerun whose
result-changing keys (model, data, optim, schedule, seed, ...) differ from `config.json` is refused
with the changed keys; keys that only change how or how often things happen (`SAFE_TO_CHANGE`:
cadences, timeouts, paths, the training length) may change, and every change is appended to
`config_history.jsonl`. `resume.allow_config_changes=True` lets an expert resume anyway (recorded).

Importing this module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import socket
import threading
import time

from absl import logging

from tfscale import errors, io
from tfscale.config import base_config
from tfscale.errors import ConfigError, WorkdirBusy
from tfscale.workdir import layout

# Keys whose change keeps a resumed run computing what its checkpoint's run computed (fnmatch patterns
# of dotted keys). Everything else (model, data contents and order, optim, schedule, seed, precision,
# local SGD) changes the result and is refused on resume.
SAFE_TO_CHANGE = (
    "train.epochs",  # extend (or cut) the run; the LR schedule's horizon moves with it
    "train.log_every_steps", "train.steps_per_loop", "train.eval_every_epochs", "train.eval_steps",
    "train.progress_every_s",
    "checkpoint.*", "profile_steps", "resume.*", "benchmark.*",
    "model.init_from", "model.init_skip_head",  # read by fresh runs only: a resume restores the checkpoint
    "data.data_dir", "data.stage_dir",  # where the same shards are (another node's local disk)
    "data.private_threads", "data.autotune", "data.ram_budget_mb", "data.eval_global_batch_size",
    "data.skip_corrupt_images",  # a run that stopped on a corrupt image resumes skipping it
    "jit_compile", "optim.compiled_update",  # how a step runs, not what it computes
    "distribute.backend", "distribute.num_cpu_devices",  # another worker count, the same global batch
    "distribute.log_all_ranks", "distribute.*_timeout_s", "distribute.collective_impl",
    "distribute.device_prefetch_batches", "distribute.pack_bytes", "distribute.plan_system", "distribute.port_base",
    "distribute.horovod_fusion_bytes", "distribute.horovod_cycle_time_ms",
    "schedule.decay_fractions",  # resolved into schedule.decay_epochs, which is compared
)


# ------------------------------------------------------------------------------------------ the lock


@dataclasses.dataclass
class Lock:
    """This process's hold on a workdir; `release()` when the run ends (also on errors)."""

    path: str
    holder: dict
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def keep_fresh(self, every_s: float) -> None:
        """Refreshes the lock's mtime every `every_s` from a daemon thread, so that it never looks stale."""

        def refresh():
            while not self._stop.wait(every_s):
                try:
                    os.utime(self.path)
                except FileNotFoundError:  # removed by hand: nothing left to refresh
                    return

        threading.Thread(target=refresh, name="workdir-lock", daemon=True).start()

    def release(self) -> None:
        self._stop.set()
        if _read_holder(self.path) == self.holder:  # ours still: a stale-lock takeover leaves others' alone
            io.remove_quietly(self.path)


def _me(env) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3),
            "slurm_job_id": env.get("SLURM_JOB_ID", ""), "slurm_restart_count": env.get("SLURM_RESTART_COUNT", "0")}


def _read_holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: judged by its age alone


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's process, or no pid to check: assume alive
    return not _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    """True for a process that has exited but was not reaped: a worker whose launcher died is reparented,
    and an init that never reaps (some containers' pid 1) leaves it a zombie, which signal 0 still finds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # no /proc (not Linux): signal 0 decided


def _stale_reason(holder: dict, age_s: float, me: dict, stale_after_s: float) -> str | None:
    """Why the lock of `holder` can be taken over, or None while its job may still be running."""
    if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
        return "held by this process (an earlier run in it did not release it)"
    if holder.get("host") == me["host"] and not _pid_alive(holder.get("pid")):
        return f"its process {holder.get('pid')} on this host no longer exists"
    if me["slurm_job_id"] and holder.get("slurm_job_id") == me["slurm_job_id"] \
            and holder.get("slurm_restart_count") != me["slurm_restart_count"]:
        return (f"Slurm requeued job {me['slurm_job_id']} (restart {holder.get('slurm_restart_count')} -> "
                f"{me['slurm_restart_count']}), so its earlier run has ended")
    if age_s > stale_after_s:
        return f"not refreshed for {age_s:.0f} s (resume.lock_stale_after_s={stale_after_s:g})"
    return None


def _describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if "since" in holder else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{job}, since {since}"


def acquire(workdir: str, stale_after_s: float, env=os.environ) -> Lock:
    """Takes `workdir`'s lock, or raises WorkdirBusy naming the live holder."""
    path = layout.lock(workdir)
    me = _me(env)
    temp = io.temp_path(path)
    with open(temp, "w") as f:
        json.dump(me, f)
    try:
        for _ in range(3):  # a takeover can race another job's; a few rounds settle it
            try:
                os.link(temp, path)  # atomic, fails if the lock exists: exactly one job wins
                return Lock(path, me)
            except FileExistsError:
                pass
            holder = _read_holder(path)
            if holder is None:  # released in between
                continue
            try:
                age_s = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            reason = _stale_reason(holder, age_s, me, stale_after_s)
            if reason is None:
                raise WorkdirBusy(
                    f"workdir {workdir} is in use by {_describe(holder)} ({path}). Wait for that job, stop it, "
                    "or use another --workdir; a killed job's lock is taken over automatically"
                )
            logging.warning("taking over the workdir lock of %s: %s", _describe(holder), reason)
            if _read_holder(path) == holder:  # still the stale one, not a lock another job just took
                io.remove_quietly(path)
        raise WorkdirBusy(f"workdir {workdir}: could not take {path}; another job keeps taking it")
    finally:
        io.remove_quietly(temp)


# -------------------------------------------------------------------------------------- the config


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(previous: dict, current: dict) -> dict[str, tuple]:
    """{dotted key: (previous value, current value)} of every key that differs (JSON-normalised).

    A key only one side has is no change when its value there is base_config()'s default: a key that
    another tfscale version added or dropped, at the value that does what that version did without it
    (a run checkpointed before `optim.clip_global_norm` existed resumes with it at 0, off).
    """
    before, after = _flatten(json.loads(json.dumps(previous))), _flatten(json.loads(json.dumps(current)))
    defaults = _flatten(json.loads(json.dumps(base_config().to_dict())))
    missing = object()
    changes = {}
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key, defaults.get(key, missing)), after.get(key, defaults.get(key, missing))
        if old != new:
            changes[key] = (None if old is missing else old, None if new is missing else new)
    return changes


def is_safe_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in SAFE_TO_CHANGE)


def has_checkpoint(workdir: str) -> bool:
    """True when a rerun in `workdir` resumes (CheckpointManager's state file exists)."""
    return os.path.exists(os.path.join(layout.checkpoints(workdir), "checkpoint"))


def check_config(workdir: str, cfg_dict: dict, *, allow_changes: bool) -> dict[str, tuple]:
    """The changes of `cfg_dict` against the workdir's `config.json` when the run resumes; raises
    ConfigError for result-changing ones unless `allow_changes`. A fresh run may change anything."""
    path = layout.config(workdir)
    if not (has_checkpoint(workdir) and os.path.exists(path)):
        return {}
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read ({err}); it records the config this workdir's checkpoints "
                          "were trained with: restore it, or use another --workdir") from err
    changes = config_changes(previous, cfg_dict)
    refused = {key: change for key, change in changes.items() if not is_safe_change(key)}
    if refused and not allow_changes:
        listed = "; ".join(f"config.{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
        raise ConfigError(
            f"workdir {workdir} holds checkpoints of a run with another config ({path}), and these keys change "
            f"what it computes: {listed}. Use another --workdir for the new config, or resume it unchanged; "
            "--config.resume.allow_config_changes=True resumes anyway (the change is recorded)"
        )
    return changes


def record_config(workdir: str, cfg_dict: dict, changes: dict[str, tuple], forced: bool) -> None:
    """Writes `config.json`; a resume that changed keys first appends them to `config_history.jsonl`."""
    if changes:
        row = {"time": round(time.time(), 3), "forced": forced,
               "changes": {key: {"from": old, "to": new} for key, (old, new) in changes.items()}}
        io.append_line(layout.history(workdir), json.dumps(row))
        logging.warning("resuming with changed config (recorded in %s): %s", layout.HISTORY,
                        "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()))
    io.write_json(layout.config(workdir), cfg_dict, sort_keys=True)


def claim(workdir: str, cfg_dict: dict, resume_cfg) -> Lock:
    """The chief's start in `workdir`: the lock, the config check, `config.json` (and its history).

    Raises WorkdirBusy, ConfigError or errors.WriteError (a workdir it cannot write) having written
    nothing (and holding no lock).
    """
    try:
        os.makedirs(workdir, exist_ok=True)
        lock = acquire(workdir, resume_cfg.lock_stale_after_s)
    except OSError as err:
        raise err if isinstance(err, errors.WriteError) else io.write_error(layout.lock(workdir), err) from err
    try:
        changes = check_config(workdir, cfg_dict, allow_changes=resume_cfg.allow_config_changes)
        forced = any(not is_safe_change(key) for key in changes)
        record_config(workdir, cfg_dict, changes, forced)
    except BaseException:
        lock.release()
        raise
    lock.keep_fresh(every_s=max(1.0, resume_cfg.lock_stale_after_s / 4))
    return lock


# ------------------------------------------------------------------------------------- metrics.jsonl


def trim_metrics(workdir: str, start_step: int) -> list[dict]:
    """Makes `metrics.jsonl` end at `start_step`, where a resumed run continues; returns the rows kept.

    Rows of later steps were logged after the checkpoint the run resumes from and are logged again
    as the steps are replayed; a last line cut short by a kill is dropped too. Rewritten atomically.
    """
    path = layout.metrics(workdir)
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    kept, dropped, torn = [], [], 0
    for line in filter(None, lines):
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        (kept if row.get("step", 0) <= start_step else dropped).append(row)
    if dropped or torn or (lines and lines[-1]):
        io.write_bytes(path, b"".join(json.dumps(row).encode() + b"\n" for row in kept))
        logging.info("metrics.jsonl: resuming at step %d, dropped %d row(s) of replayed steps%s", start_step,
                     len(dropped), f" and {torn} unreadable line(s)" if torn else "")
    return kept
