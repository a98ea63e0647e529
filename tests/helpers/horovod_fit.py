"""A Horovod `model.fit` script ported to Keras 3 with tfscale's replacements; saves the final weights.

    python tests/helpers/horovod_fit.py OUT.npz --mode=averaging|plain|single

averaging: tfscale's averaging_optimizer + BroadcastGlobalVariables + MetricAverage + LearningRateWarmup,
           each rank fitting its own half of every global batch (run under a Horovod launcher);
plain:     the same without gradient averaging (what hvd.DistributedOptimizer amounts to on Keras 3);
single:    one process fitting the whole global batch, no Horovod: the reference.
`{rank}` in OUT.npz becomes the rank. Each rank also writes its epoch-end logs to OUT.json.
"""

import json

import keras
import numpy as np
from absl import app, flags

from tfscale.cluster import distribute
from tfscale.config import base_config
from tfscale.model import optim
from tfscale.training import callbacks

_MODE = flags.DEFINE_enum("mode", "averaging", ["averaging", "plain", "single"], "What to run.")
PER_RANK_BATCH, NUM_RANKS, STEPS, LR = 8, 2, 12, 0.2


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(PER_RANK_BATCH * NUM_RANKS * STEPS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 3))).argmax(axis=1)
    return x, y


def rank_shard(x, y, rank):
    """Rank r's part of global batch i: rows [i*B + r*b, i*B + (r+1)*b), so the ranks' batches of step i
    together are exactly the single process's batch i."""
    index = np.arange(len(x)).reshape(STEPS, NUM_RANKS, PER_RANK_BATCH)[:, rank].ravel()
    return x[index], y[index]


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def main(argv):
    out = argv[1]
    x, y = data()
    fit_callbacks = []
    if _MODE.value == "single":
        net, batch, optimizer, rank = model(seed=0), PER_RANK_BATCH * NUM_RANKS, keras.optimizers.SGD(LR), 0
    else:
        cfg = base_config()
        cfg.distribute.backend = "horovod"
        cluster = distribute.setup(cfg.distribute)
        rank, batch = cluster.rank, PER_RANK_BATCH
        x, y = rank_shard(x, y, rank)
        # Different initial weights per rank: only the broadcast makes them start equal.
        net = model(seed=rank)
        optimizer = keras.optimizers.SGD(LR)
        if _MODE.value == "averaging":
            optimizer = optim.averaging_optimizer(optimizer, cluster)
        fit_callbacks = [callbacks.MetricAverage(cluster), callbacks.BroadcastGlobalVariables(cluster)]
    net.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = net.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=fit_callbacks)
    out = out.replace("{rank}", str(rank))
    np.savez(out, *[v.numpy() for v in net.weights])
    with open(out.replace(".npz", ".json"), "w") as f:
        json.dump({"loss": history.history["loss"], "optimizer": type(net.optimizer).__name__}, f)


if __name__ == "__main__":
    app.run(main)
