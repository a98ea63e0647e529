#!/usr/bin/env python3
"""Fault-injection soak: kill -9 and SIGTERM at random steps of a multi-worker run, resume after each.

    python tools/soak.py --workdir=runs/soak --cycles=20 [--workers=2 --backend=mwms --seed=0]
    make soak                                                          # the same, 20 cycles

First an uninterrupted reference run (`tfscale.launch` of configs/smoke.py, deterministic synthetic
data). Then the soak run, in its own workdir, is started again and again; in each cycle, at a random
step after training has begun, it gets one fault:
  * sigterm: SIGTERM to the launcher (as Slurm does before a preemption): every worker must save a
    checkpoint at one step and the job must exit 75;
  * kill9: SIGKILL to one random worker (a node dying): the job must end by itself, non-zero, within
    --max_exit_s (the survivors notice through the launcher and the heartbeat timeout).
A kill may land anywhere: in a step, a log write, a checkpoint save, an eval. The next cycle resumes
from the newest usable checkpoint. After the cycles the run is finished and must end with the
reference run's weights (same steps, same data order), one metrics row per logged step.

Writes WORKDIR/soak.json (every cycle: fault, rank, step, exit code, seconds to exit, where the next
run resumed) and prints a summary; exits 1 when any cycle or the final comparison failed. Run again over
the same workdir, it reuses the reference run when it has the same length, workers and backend, and starts
its soak run from step 0 (the previous one is removed, said in one line).
"""

import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # run from a checkout

from tfscale import errors  # noqa: E402
from tfscale.workdir import layout  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/soak", "Where the reference run, the soak run and soak.json go.")
_CYCLES = flags.DEFINE_integer("cycles", 20, "Faults to inject (each followed by a resume).")
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes (tfscale.launch --num_workers).")
_BACKEND = flags.DEFINE_enum("backend", "mwms", ["mwms", "horovod"], "Multi-worker backend.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the choice of faults, ranks and steps.")
_MAX_EXIT_S = flags.DEFINE_float("max_exit_s", 60.0, "A job still running this long after a fault fails the cycle.")
_EPOCHS = flags.DEFINE_float("epochs", 0, "Training length (0: long enough for --cycles faults).")

STEPS_PER_EPOCH = 20  # configs/smoke.py: 640 examples in batches of 32
# Checkpoints every 10 steps, a row every 2: kills land between checkpoints, after rows, in saves.
RUN_OVERRIDES = ["--config.checkpoint.every_epochs=0.5", "--config.train.log_every_steps=2",
                 "--config.train.eval_every_epochs=5", "--config.data.deterministic=True",
                 "--config.distribute.heartbeat_timeout_s=10", "--config.distribute.connect_timeout_s=60"]


def launch_command(workdir: str, epochs: float) -> list[str]:
    return [sys.executable, "-m", "tfscale.launch", f"--num_workers={_WORKERS.value}", "--threads_per_worker=1",
            f"--backend={_BACKEND.value}", "--", "-m", "tfscale.train", "--config=configs/smoke.py",
            f"--workdir={workdir}", f"--config.train.epochs={epochs}", *RUN_OVERRIDES]


def logged_steps(workdir: str) -> list[int]:
    try:
        with open(os.path.join(workdir, layout.METRICS)) as f:
            return [json.loads(line)["step"] for line in f if '"loss"' in line and line.endswith("\n")]
    except FileNotFoundError:
        return []


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (Linux /proc)."""
    pids = {}
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        with open(f"/proc/{launcher_pid}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                with open(f"/proc/{pid}/environ", "rb") as env:
                    variables = dict(v.split(b"=", 1) for v in env.read().split(b"\0") if b"=" in v)
                tf_config = json.loads(variables.get(b"TF_CONFIG", b"{}") or b"{}")
                rank = variables.get(b"HOROVOD_RANK", str(tf_config.get("task", {}).get("index", 0)).encode())
                pids[int(rank)] = pid
    return pids


def run_to_end(workdir: str, epochs: float, log_path: str) -> str:
    with open(log_path, "w") as log:
        code = subprocess.call(launch_command(workdir, epochs), cwd=_REPO, stdout=log, stderr=subprocess.STDOUT)
    output = open(log_path).read()
    if code:
        raise SystemExit(f"soak: {workdir} ended with exit code {code}; last output:\n{output[-3000:]}")
    return output


def one_cycle(cycle: int, workdir: str, epochs: float, rng: random.Random) -> dict:
    """Starts (or resumes) the soak run, injects one fault at a random step, waits for the job to end."""
    total_steps = int(epochs * STEPS_PER_EPOCH)
    log_path = os.path.join(os.path.dirname(workdir), f"cycle-{cycle:02d}.log")
    fault = rng.choice(["sigterm", "kill9"])
    record = {"cycle": cycle, "fault": fault}
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(launch_command(workdir, epochs), cwd=_REPO, stdout=log, stderr=subprocess.STDOUT)
        target = None
        while launcher.poll() is None:  # wait for training to run, then for a random step of it
            steps = logged_steps(workdir)
            # This run logged a step, and its metrics line is written (the log line can come first).
            if target is None and steps and re.search(r"\] step \d+/", open(log_path).read()):
                last_possible = total_steps - 2
                target = rng.randint(min(steps[-1] + 1, last_possible), min(steps[-1] + 25, last_possible))
            if target is not None and steps and steps[-1] >= target:
                break
            time.sleep(0.01)
        if launcher.poll() is not None:
            record.update(ok=False, problem=f"the run ended (code {launcher.returncode}) before the fault")
            return record
        record["after_step"] = logged_steps(workdir)[-1]
        if fault == "sigterm":
            launcher.send_signal(signal.SIGTERM)
        else:
            record["rank"], pid = rng.choice(sorted(worker_pids(launcher.pid).items()))
            os.kill(pid, signal.SIGKILL)
        signalled_at = time.monotonic()
        try:
            code = launcher.wait(timeout=_MAX_EXIT_S.value)
        except subprocess.TimeoutExpired:
            launcher.kill()
            code = launcher.wait()
        record.update(exit_code=code, seconds_to_exit=round(time.monotonic() - signalled_at, 2))
    output = open(log_path).read()
    saved = sorted(set(int(s) for s in re.findall(r"checkpoint saved at step (\d+);", output)))
    if fault == "sigterm":
        record["ok"] = code == errors.EXIT_PREEMPTED and len(saved) == 1
        record["checkpoint_step"] = saved[0] if saved else None
    else:
        record["ok"] = code not in (0, None) and record["seconds_to_exit"] < _MAX_EXIT_S.value
    if not record["ok"]:
        record["problem"] = output[-2000:]
    return record


def resumed_from(log_path: str) -> int | None:
    match = re.search(r"resumed from \S+ckpt-(\d+) at step", open(log_path).read()) if os.path.exists(log_path) else None
    return int(match.group(1)) if match else None


def checkpoint_values(workdir: str) -> dict:
    import tensorflow as tf  # only for the final comparison

    reader = tf.train.load_checkpoint(os.path.join(workdir, layout.CHECKPOINTS))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if "OBJECT_GRAPH" not in k and "save_counter" not in k}


def compare(soaked: str, reference: str) -> dict:
    a, b = checkpoint_values(soaked), checkpoint_values(reference)
    equal = a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in b)
    max_diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in b if k in a)
    return {"weights_equal": bool(equal), "max_abs_difference": max_diff}


def reference_matches(reference: str, epochs: float) -> bool:
    """Whether `reference` is a finished run of this soak's length, worker count and backend (a rerun reuses it)."""
    try:
        with open(os.path.join(reference, layout.SUMMARY)) as f:
            summary = json.load(f)
        with open(os.path.join(reference, layout.CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (config["train"]["epochs"] == epochs and summary.get("num_workers") == _WORKERS.value
            and config["distribute"]["backend"] == _BACKEND.value)


def start_fresh(root: str, soaked: str) -> None:
    """A soak's run starts at step 0: a previous soak's run (finished, or stopped mid-cycle) and its cycle logs
    go, said in one line; its soak.json stays until this soak writes its own."""
    if os.path.exists(soaked):
        print(f"soak: removing the previous soak's run {soaked} and its logs: every soak starts from step 0")
        shutil.rmtree(soaked)
    for log in glob.glob(os.path.join(root, "cycle-*.log")) + glob.glob(os.path.join(root, "final.log")):
        os.remove(log)


def main(argv):
    del argv
    root = os.path.abspath(_WORKDIR.value)
    os.makedirs(root, exist_ok=True)
    # A cycle advances ~15 steps on average (a kill loses what followed the last checkpoint): 40 steps a
    # cycle leave the last faults far from the end, where the run would simply finish.
    epochs = _EPOCHS.value or max(5.0, _CYCLES.value * 2.0)
    reference, soaked = os.path.join(root, "reference"), os.path.join(root, "run")
    rng = random.Random(_SEED.value)
    print(f"soak: reference run of {int(epochs * STEPS_PER_EPOCH)} steps on {_WORKERS.value} {_BACKEND.value} workers")
    if reference_matches(reference, epochs):
        print(f"soak: reusing the reference run {reference} (same length, workers and backend)")
    else:
        shutil.rmtree(reference, ignore_errors=True)  # another soak's length, or stopped before its end
        run_to_end(reference, epochs, os.path.join(root, "reference.log"))
    start_fresh(root, soaked)
    cycles = []
    for cycle in range(1, _CYCLES.value + 1):
        record = one_cycle(cycle, soaked, epochs, rng)
        record["resumed_from"] = resumed_from(os.path.join(root, f"cycle-{cycle:02d}.log"))
        cycles.append(record)
        print(f"cycle {cycle:2d}: {record['fault']:7s} rank {record.get('rank', '-')} after step "
              f"{record.get('after_step')}: exit {record.get('exit_code')} in {record.get('seconds_to_exit')} s; "
              f"run had resumed from step {record['resumed_from']}; {'ok' if record['ok'] else 'FAILED'}", flush=True)
    run_to_end(soaked, epochs, os.path.join(root, "final.log"))
    steps = logged_steps(soaked)
    final = {**compare(soaked, reference), "rows_unique_and_complete": steps == list(range(2, steps[-1] + 1, 2))
             and steps[-1] == int(epochs * STEPS_PER_EPOCH)}
    failures = [c["cycle"] for c in cycles if not c["ok"]]
    report = {
        "cycles": len(cycles), "failures": failures, "final": final,
        "max_seconds_to_exit": {fault: max((c["seconds_to_exit"] for c in cycles if c["fault"] == fault
                                            and "seconds_to_exit" in c), default=None) for fault in ("sigterm", "kill9")},
        "workers": _WORKERS.value, "backend": _BACKEND.value, "seed": _SEED.value, "steps": steps[-1],
        "cycle_records": cycles,
    }
    with open(os.path.join(root, "soak.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"soak: {len(cycles)} cycles, {len(failures)} failed {failures or ''}; max seconds to exit "
          f"{report['max_seconds_to_exit']}; final weights equal the reference: {final['weights_equal']} "
          f"(max |diff| {final['max_abs_difference']:.2e}); metrics rows unique and complete: "
          f"{final['rows_unique_and_complete']}; {os.path.join(root, 'soak.json')}")
    return 1 if failures or not final["weights_equal"] or not final["rows_unique_and_complete"] else 0


if __name__ == "__main__":
    app.run(main)
