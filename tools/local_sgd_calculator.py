#!/usr/bin/env python3
r"""The household local-SGD calculator: which local batch matches a target effective batch, and what it costs.

    python tools/local_sgd_calculator.py --effective_batch=128 --num_workers=16 --households=8 \
        --sync_period=128 --num_train_examples=45000 --epochs=182

Prints B_l (the per-worker batch), the effective batch it gives (the data-assignment study's
Eq. A.3: B_e = B_l * M * (H + L_W - 1) / (H * L_W)), iterations, world syncs and the study's LR
multiplier L_W * H / (H + L_W - 1) (used with a 5-epoch gradual warmup). The example above is the
study's own: B_l = 61, 8554 iterations, 67 world syncs. Then train with
`--config.distribute.sync=local_sgd --config.distribute.households=H --config.distribute.sync_period=L_W`
and `--config.data.global_batch_size=B_l*M` (docs/local_sgd.md).
"""

import os
import sys

# Runs from a checkout too, without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from tfscale.training import local_sgd  # noqa: E402

flags.DEFINE_float("effective_batch", None, "B_e, the effective batch to match.", lower_bound=1)
flags.DEFINE_integer("num_workers", None, "M, workers (replicas).", lower_bound=1)
flags.DEFINE_integer("households", None, "H, households (groups of M/H workers averaging gradients every step).",
                     lower_bound=1)
flags.DEFINE_integer("sync_period", None, "L_W, steps between world syncs.", lower_bound=1)
flags.DEFINE_integer("num_train_examples", 45_000, "N, training examples (CIFAR-10 with 5,000 held out: 45,000).",
                     lower_bound=1)
flags.DEFINE_integer("epochs", 182, "Epochs (182: 64k iterations at batch 128 on 45,000 images, He et al.).",
                     lower_bound=1)
flags.mark_flags_as_required(["effective_batch", "num_workers", "households", "sync_period"])


def main(argv):
    f = flags.FLAGS
    if f.num_workers % f.households:
        raise app.UsageError(f"--households={f.households} must divide --num_workers={f.num_workers}")
    plan = local_sgd.household_batch(f.effective_batch, num_workers=f.num_workers, households=f.households,
                                     sync_period=f.sync_period, num_train_examples=f.num_train_examples,
                                     epochs=f.epochs)
    print(f"M={f.num_workers} workers in H={f.households} households, world sync every L_W={f.sync_period} steps, "
          f"target B_e={f.effective_batch:g}")
    print(f"local batch B_l = {plan['local_batch']} (global batch B_l*M = {plan['local_batch'] * f.num_workers}); "
          f"effective batch {plan['effective_batch']:.2f}")
    print(f"{plan['steps_per_epoch']} iterations per epoch x {f.epochs} epochs = {plan['iterations']} iterations, "
          f"{plan['world_syncs']} world syncs")
    print(f"LR multiplier L_W*H/(H+L_W-1) = {plan['lr_scale']:.4f}, with a 5-epoch gradual warmup")


if __name__ == "__main__":
    app.run(main)
