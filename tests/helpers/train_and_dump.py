"""Test driver: trains like `python -m tfscale.train`, then saves this worker's final weights.

    python tests/helpers/train_and_dump.py WEIGHTS.npz --config=... --workdir=... [--config.x=y ...]

Every worker writes its own file (and WEIGHTS_init.npz before the first step), so tests can compare the weights each worker ends up with
(the chief's checkpoint alone cannot show that the workers agree). `{rank}` in WEIGHTS.npz becomes the
Horovod rank, for launchers (horovodrun, mpirun) that start every rank with the same arguments.
`--freeze_bn` (first after WEIGHTS.npz) trains with BatchNorm frozen: no batch-size dependence left,
so runs that split a batch differently (gradient accumulation) must compute the same update.
"""

import os
import sys

import keras
import numpy as np

from tfscale import config as tfs_config
from tfscale import engine, train


class DumpWeights(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_begin(self, logs=None):
        np.savez(self.path.replace(".npz", "_init.npz"), *[v.numpy() for v in self.model.weights])

    def on_train_end(self, logs=None):
        np.savez(self.path, *[v.numpy() for v in self.model.weights])


def build_model_with_frozen_bn(cfg, build_model=engine.build_model):
    model = build_model(cfg)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False  # Keras 3: inference-mode statistics, no moving-average updates
    return model


def main(cfg, workdir):
    train.train_and_evaluate(cfg, workdir, extra_callbacks=[DumpWeights(OUTPUT)])


if __name__ == "__main__":
    RANK = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    OUTPUT = sys.argv.pop(1).replace("{rank}", RANK)
    if sys.argv[1] == "--freeze_bn":
        sys.argv.pop(1)
        engine.build_model = build_model_with_frozen_bn
    tfs_config.run_cli(main, workdir_help="workdir")
