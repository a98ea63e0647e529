#!/usr/bin/env python3
"""The demo: real handwritten digits -> image folders -> TFRecord shards -> training -> eval top-1.

scikit-learn ships 1,797 real 8x8 digit scans (UCI optdigits). This writes them as a class-folder
image tree (PNG, upscaled to 32x32), holds out a stratified 20% as the validation split, converts
both splits with tfscale's conversion tool and trains configs/digits.py on the shards with two
local workers (MultiWorkerMirroredStrategy over 127.0.0.1, started by tfscale.launch).

    python tools/digits_demo.py --workdir=runs/demo [--config.x.y=v ...]

Needs scikit-learn, tfscale's `examples` extra: `make demo` installs it; after `pip install ".[cpu]"`,
run `pip install ".[examples]"` in the checkout.
"""

import json
import os
import subprocess
import sys

import numpy as np
from absl import app, flags, logging
from PIL import Image

from tfscale import cli
from tfscale.workdir import layout

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Where images, shards and the training run go.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Local worker processes (1: single process).")
_HOLDOUT_FRACTION = 0.2
_IMAGE_SIZE_PX = 32


def write_image_tree(root: str, seed: int = 0) -> dict:
    """Writes train/ and validation/ class trees of PNGs; returns {split: number of images}."""
    datasets = cli.import_extra("sklearn.datasets", tool="tools/digits_demo.py", package="scikit-learn",
                                extra="examples", why="it ships the digit scans")
    digits = datasets.load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "validation": 0}
    for label in range(10):
        indices = rng.permutation(np.flatnonzero(digits.target == label))
        num_holdout = round(len(indices) * _HOLDOUT_FRACTION)
        for position, index in enumerate(indices):
            split = "validation" if position < num_holdout else "train"
            folder = os.path.join(root, split, f"digit_{label}")
            os.makedirs(folder, exist_ok=True)
            pixels = (digits.images[index] * (255.0 / 16.0)).astype(np.uint8)  # scans are 0..16
            image = Image.fromarray(pixels, mode="L").resize((_IMAGE_SIZE_PX, _IMAGE_SIZE_PX), Image.BICUBIC)
            image.save(os.path.join(folder, f"scan_{index:04d}.png"))
            counts[split] += 1
    return counts


def main(argv):
    workdir = os.path.abspath(_WORKDIR.value)
    images_dir, shards_dir = os.path.join(workdir, "images"), os.path.join(workdir, "shards")
    counts = write_image_tree(images_dir)  # first: without scikit-learn, its one error line is all the output
    from tfscale.data.convert import convert  # imports TensorFlow

    for split, num_shards in (("train", 4), ("validation", 2)):
        convert.convert(os.path.join(images_dir, split), shards_dir, split, num_shards)
    logging.info("converted %s images into %s", counts, shards_dir)
    train_dir = os.path.join(workdir, "train")
    command = [
        sys.executable, "-m", "tfscale.launch", f"--num_workers={_NUM_WORKERS.value}", "--",
        "-m", "tfscale.train", "--config=configs/digits.py", f"--workdir={train_dir}",
        f"--config.data.data_dir={shards_dir}", f"--config.data.num_train_examples={counts['train']}",
        f"--config.data.num_eval_examples={counts['validation']}", "--config.distribute.backend=mwms",
        *argv[1:],
    ]
    subprocess.run(command, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(train_dir, layout.SUMMARY)) as f:
        summary = json.load(f)
    print(f"\ndigits demo: eval top-1 {summary['eval_top1']:.4f} on {counts['validation']} held-out real scans "
          f"after {summary['steps']} steps on {summary['num_workers']} worker(s) ({summary['images_per_sec']} "
          f"images/sec); workdir {train_dir}")


if __name__ == "__main__":
    app.run(main)
