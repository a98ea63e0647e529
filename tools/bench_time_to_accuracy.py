#!/usr/bin/env python3
"""Time to accuracy: tfscale against a plain Keras fit script on Fashion-MNIST, paired rounds.

    make bench-tta          # = make fashion-mnist, then:
    python tools/bench_time_to_accuracy.py --workdir=runs/tta [--rounds=3] [--tfscale_args='--config.seed=1']

Each round runs both, one after the other (the order alternates between rounds so that a drifting
machine hits both alike), each a fresh process evaluated on the 10,000 test images after every epoch:
- keras: tools/keras_fmnist.py, Keras' own defaults (`jit_compile="auto"`);
- tfscale: `python -m tfscale.train --config=configs/fmnist_resnet.py` on the same dataset converted by
  tfscale-convert, evaluating on the test split every epoch (`--tfscale_args` are appended).

The target of a round is the accuracy both of its runs reached: the lower of their final test top-1s
(or `--target_top1`). For each run the benchmark reads the seconds from process start to its first
evaluation at or above the target, and the final top-1; it prints each round, the medians and the
paired ratio tfscale / keras of the time to the target (below 1: tfscale is there sooner). `--tfscale_root` runs another checkout's tfscale (a before/after
comparison on the same machine). The figures go to WORKDIR/tta.json, the curves to WORKDIR/tta.png.
"""

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKDIR = flags.DEFINE_string("workdir", "runs/tta", "Runs, the converted dataset and tta.json go here.")
_IDX_DIR = flags.DEFINE_string("idx_dir", "/usr/share/datasets/fashion-mnist", "Fashion-MNIST's IDX .gz files.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds, each running both candidates once.")
_EPOCHS = flags.DEFINE_integer("epochs", 12, "Training epochs of both (the schedule's 4/8/11 decays are of 12).")
_TRAIN_EXAMPLES = flags.DEFINE_integer("train_examples", 12_800, "Training images (configs/fmnist_resnet.py's subset).")
_TFSCALE_ARGS = flags.DEFINE_string("tfscale_args", "", "Extra arguments of the tfscale run (shell words).")
_TARGET = flags.DEFINE_float("target_top1", 0.0, "Fixed test top-1 to reach (0: the lower final top-1 of each round).")
_REREAD = flags.DEFINE_bool("reread", False, "Only print the figures again from WORKDIR/tta.json's curves.")
_TFSCALE_ROOT = flags.DEFINE_string("tfscale_root", ROOT, "Checkout whose tfscale runs (its configs/ too).")


def _converted(workdir: str) -> str:
    """tfscale-convert's shards of the IDX files (`--train_examples` training images, the test split), once."""
    out = os.path.join(workdir, f"fmnist_{_TRAIN_EXAMPLES.value}")
    if not os.path.exists(os.path.join(out, "manifest-test.json")):
        subprocess.run([sys.executable, "-m", "tfscale.data.convert", "--format=idx", f"--input_dir={_IDX_DIR.value}",
                        f"--output_dir={out}", "--validation_examples=5000", f"--train_examples={_TRAIN_EXAMPLES.value}"],
                       check=True, cwd=ROOT, env=_env(ROOT))
    return out


def _env(root: str) -> dict:
    return {**os.environ, "PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "-1")}


def run_keras(run_dir: str) -> list[tuple[float, float]]:
    """[(seconds since start, test top-1)] after each epoch of the plain Keras script."""
    os.makedirs(run_dir, exist_ok=True)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "keras_fmnist.py"), f"--data_dir={_IDX_DIR.value}",
                           f"--train_examples={_TRAIN_EXAMPLES.value}", f"--epochs={_EPOCHS.value}"],
                          env=_env(ROOT), capture_output=True, text=True, check=False)
    with open(os.path.join(run_dir, "log.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"keras_fmnist.py exited {proc.returncode}; its output is in {run_dir}/log.txt")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [(row["time_s"], row["val_top1"]) for row in rows]


def run_tfscale(run_dir: str, data_dir: str) -> list[tuple[float, float]]:
    """[(seconds since start, test top-1)] of each evaluation of a fresh `tfscale.train` run."""
    root = os.path.abspath(_TFSCALE_ROOT.value)
    cmd = [sys.executable, "-m", "tfscale.train", f"--config={root}/configs/fmnist_resnet.py", f"--workdir={run_dir}",
           f"--config.data.data_dir={os.path.abspath(data_dir)}", "--config.data.eval_split=test",
           "--config.data.num_eval_examples=10000", "--config.train.eval_every_epochs=1",
           f"--config.data.num_train_examples={_TRAIN_EXAMPLES.value}",
           f"--config.train.epochs={_EPOCHS.value}", *shlex.split(_TFSCALE_ARGS.value)]
    start = time.time()
    with open(os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w") as log:
        proc = subprocess.run(cmd, env=_env(root), cwd=root, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        raise RuntimeError(f"tfscale.train exited {proc.returncode}; its log is {run_dir}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(row["time"] - start, row["eval_top1"]) for row in rows if "eval_top1" in row]


def seconds_to(curve: list[tuple[float, float]], target: float) -> float:
    """Seconds from start to the first evaluation at or above `target` (inf: never)."""
    return next((t for t, top1 in curve if top1 >= target - 1e-9), float("inf"))


def round_row(index: int, curves: dict[str, list[tuple[float, float]]]) -> dict:
    """One round's figures from its two curves [(seconds since start, test top-1)], printed."""
    target = _TARGET.value or min(curve[-1][1] for curve in curves.values())
    row = {"round": index, "target_top1": target,
           **{f"{name}_final_top1": curves[name][-1][1] for name in curves},
           **{f"{name}_total_s": round(curves[name][-1][0], 1) for name in curves},
           **{f"{name}_to_target_s": round(seconds_to(curves[name], target), 1) for name in curves},
           "curves": curves}
    row["ratio_to_target"] = round(row["tfscale_to_target_s"] / row["keras_to_target_s"], 3)  # 0 / inf: one never got there
    never = [name for name in curves if math.isinf(row[f"{name}_to_target_s"])]
    ratio = f"ratio {row['ratio_to_target']:.3f}" if not never else f"no ratio: {' and '.join(never)} never reached it"
    print(f"round {index}: target {target:.4f}  keras {row['keras_to_target_s']:.0f} s (final "
          f"{row['keras_final_top1']:.4f}, {row['keras_total_s']:.0f} s)  tfscale {row['tfscale_to_target_s']:.0f} s "
          f"(final {row['tfscale_final_top1']:.4f}, {row['tfscale_total_s']:.0f} s)  {ratio}",
          flush=True)
    return row


def summarize(rounds: list[dict]) -> dict:
    summary = {key: statistics.median(r[key] for r in rounds)
               for key in ("keras_to_target_s", "tfscale_to_target_s", "keras_final_top1", "tfscale_final_top1",
                           "keras_total_s", "tfscale_total_s", "ratio_to_target")}
    print("median over %d rounds: time to the round's common top-1 tfscale / keras = %.3f (%.0f s vs %.0f s); "
          "to the end of training %.0f s vs %.0f s; final top-1 tfscale %.4f, keras %.4f" % (
              len(rounds), summary["ratio_to_target"], summary["tfscale_to_target_s"], summary["keras_to_target_s"],
              summary["tfscale_total_s"], summary["keras_total_s"], summary["tfscale_final_top1"],
              summary["keras_final_top1"]))
    return summary


def plot(rounds: list[dict], path: str) -> None:
    """Test top-1 against seconds from process start, tfscale beside Keras, one panel per round, the round's
    target top-1 as a line: WORKDIR/tta.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rounds), figsize=(5.5 * len(rounds), 4), sharey=True, squeeze=False)
    for axis, row in zip(axes[0], rounds):
        for name, style in (("tfscale", "o-"), ("keras", "s--")):
            seconds, top1 = zip(*row["curves"][name])
            axis.plot(seconds, top1, style, markersize=4, label=f"{name} ({row[f'{name}_to_target_s']:.0f} s to target)")
        axis.axhline(row["target_top1"], color="grey", linewidth=0.8, label=f"target {row['target_top1']:.4f}")
        axis.set(title=f"round {row['round'] + 1}", xlabel="seconds since the process started", ylabel="test top-1")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv):
    del argv
    workdir = os.path.abspath(_WORKDIR.value)
    report_path = os.path.join(workdir, "tta.json")
    if _REREAD.value:  # the figures again from the stored curves (e.g. with another --target_top1)
        with open(report_path) as f:
            stored = json.load(f)
        rounds = [round_row(r["round"], r["curves"]) for r in stored["rounds"]]
        summarize(rounds)
        plot(rounds, os.path.join(workdir, "tta.png"))
        return
    os.makedirs(workdir, exist_ok=True)
    data_dir = _converted(workdir)
    rounds = []
    for i in range(_ROUNDS.value):
        order = ("keras", "tfscale") if i % 2 == 0 else ("tfscale", "keras")
        curves = {}
        for name in order:
            run_dir = os.path.join(workdir, f"round{i}_{name}")
            shutil.rmtree(run_dir, ignore_errors=True)  # a rerun measures fresh runs, never a resume
            curves[name] = run_keras(run_dir) if name == "keras" else run_tfscale(run_dir, data_dir)
        rounds.append(round_row(i, curves))
    summary = summarize(rounds)
    with open(report_path, "w") as f:
        json.dump({"tfscale_args": _TFSCALE_ARGS.value, "tfscale_root": _TFSCALE_ROOT.value, "rounds": rounds,
                   "median": summary}, f, indent=1)
    plot(rounds, os.path.join(workdir, "tta.png"))


if __name__ == "__main__":
    app.run(main)
