"""A run's checkpoints evaluated in a process of their own: `tfscale-train --mode=eval` and `--mode=continuous_eval`.

    tfscale-train --mode=eval --workdir=runs/r50 [--checkpoint=runs/r50/checkpoints/ckpt-900] [--split=test]
    tfscale-train --mode=continuous_eval --workdir=runs/r50 [--split=validation] [--timeout_s=3600]

Model Garden's `--mode=eval` / `continuous_eval` and Keras' SidecarEvaluator. The model, data and precision
are the training run's own (WORKDIR/config.json); the process needs no GPU and no share of the training job,
so it can run beside it, on another node or a CPU. `eval` evaluates the newest checkpoint (or the named one)
once; `continuous_eval` evaluates each checkpoint as it appears (tf.train.checkpoints_iterator) and stops
after the run's last one, or when none has appeared for `--timeout_s`. Each evaluation:
  * is printed: `eval of ckpt-900 (step 900) on validation: top-1 ... (N examples)`, with the EMA weights'
    figures too where the run keeps an EMA (`optim.ema_decay`);
  * is appended to WORKDIR/evaluations.jsonl (step, checkpoint, split, eval_* and the time);
  * goes to TensorBoard's `validation` run of the workdir (`validation_<split>` for another split), under the
    tags training's own evals use (loss, top1, top5), so its points land on the training run's curves.
"""

from __future__ import annotations

import json
import os
import time

import tensorflow as tf
from absl import logging

from tfscale import io
from tfscale.model import ema
from tfscale.training import checkpoints, controller, engine, init_from
from tfscale.training.callbacks import EVAL_PREFIX, write_scalars
from tfscale.workdir import layout

EVALUATIONS = "evaluations.jsonl"  # WORKDIR/evaluations.jsonl: a row per checkpoint evaluated here
MODES = ("eval", "continuous_eval")
POLL_S = 5.0  # how often continuous_eval looks for a new checkpoint


def eval_config(workdir: str, split: str = ""):
    """The training run's config for one evaluating process: its data and model, one device, `split`."""
    cfg = init_from.read_run_config(workdir)
    cfg.distribute.backend = "one_device"  # a process of its own, whatever the training job's backend
    if split:
        cfg.data.eval_split = split
    return cfg


class Evaluator:
    """The run's model, eval step and eval input, built once; `evaluate(checkpoint)` restores and evaluates."""

    def __init__(self, workdir: str, split: str = ""):
        self.workdir = workdir
        cfg = eval_config(workdir, split)
        self.run = engine.with_data(cfg, engine.join(cfg))
        self.cfg = self.run.cfg
        with engine.precision_policy(self.cfg.precision):
            self.model, self.optimizer = engine.build_model_and_optimizer(self.cfg, self.run.cluster)
        self.eval_step = engine.make_eval_step(self.cfg, self.run.cluster, self.model)
        self.batches = iter(engine.eval_dataset(self.run))
        self.use_ema = ema.is_on(self.optimizer)
        if self.use_ema:  # its averages are slots: built now, so a restore fills them at once
            self.optimizer.build(self.model.trainable_variables)
        split = self.cfg.data.eval_split
        run_name = "validation" if split == "validation" else f"validation_{split}"
        self.writer = tf.summary.create_file_writer(os.path.join(layout.tensorboard(workdir), run_name),
                                                    filename_suffix=".evaluator")

    def _eval_once(self, step: int, weights: str = "") -> dict:
        return engine.evaluate(self.eval_step, self.batches, self.run.steps.eval_steps, self.cfg.train.progress_every_s,
                               say=lambda text: logging.info("eval at step %d%s: %s", step, weights, text))

    def evaluate(self, checkpoint: str | None = None) -> dict:
        """Restores `checkpoint` (the newest usable one by default) and evaluates it; the recorded row."""
        prefix, step = checkpoints.restore_model(self.workdir, self.model, checkpoint or None,
                                                 optimizer=self.optimizer if self.use_ema else None)
        results = controller.raw_and_ema(lambda weights: self._eval_once(step, weights), self.model, self.optimizer)
        row = {"step": step, "checkpoint": os.path.basename(prefix), "split": self.cfg.data.eval_split, **results}
        self._record(row)
        return row

    def _record(self, row: dict) -> None:
        ema_text = f"  EMA weights: top-1 {row['eval_top1_ema']:.4f}" if "eval_top1_ema" in row else ""
        print(f"eval of {row['checkpoint']} (step {row['step']}) on {row['split']}: top-1 {row['eval_top1']:.4f}  "
              f"top-5 {row['eval_top5']:.4f}  loss {row['eval_loss']:.4f}{ema_text}  ({row['eval_examples']} examples)",
              flush=True)
        io.append_line(os.path.join(self.workdir, EVALUATIONS), json.dumps({**row, "time": round(time.time(), 3)}))
        write_scalars(self.writer, {"step": row["step"], **{k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}})


def continuous(evaluator: Evaluator, timeout_s: float) -> list[dict]:
    """Evaluates each new checkpoint of the workdir as it appears; stops after the run's last step, or after
    `timeout_s` without a new one. The rows, in order."""
    rows = []
    final_step = evaluator.run.steps.train_steps
    directory = layout.checkpoints(evaluator.workdir)
    for prefix in tf.train.checkpoints_iterator(directory, min_interval_secs=POLL_S, timeout=timeout_s):
        rows.append(evaluator.evaluate(prefix))
        if rows[-1]["step"] >= final_step:
            break
    else:
        logging.info("no new checkpoint in %s for %.0f s: the evaluator stops", directory, timeout_s)
    return rows


def wait_for_run(workdir: str, timeout_s: float) -> None:
    """Waits until the training run has written its config.json (a side-car may start before it)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(layout.config(workdir)):
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no training run in {workdir}: no {layout.CONFIG} after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def run_mode(mode: str, workdir: str, checkpoint: str = "", split: str = "", timeout_s: float = 3600.0) -> list[dict]:
    """`--mode=eval` (the newest or the named checkpoint, once) or `continuous_eval`; the rows recorded."""
    if mode == "continuous_eval":
        wait_for_run(workdir, timeout_s)
    elif not os.path.isdir(layout.checkpoints(workdir)):
        raise FileNotFoundError(f"no checkpoints in {workdir}: has the run saved one yet?")
    evaluator = Evaluator(workdir, split)
    if mode == "eval":
        return [evaluator.evaluate(checkpoint or None)]
    return continuous(evaluator, timeout_s)
