"""Runs `distribute.setup` for one backend in a process that "sees" GPUs this machine does not have.

    python tests/helpers/fake_gpus.py NUM_GPUS BACKEND [--config.distribute.x=y ...]

`devices.prepare_gpus` is handed a stand-in for `tf.config` that lists NUM_GPUS GPUs and records what
tfscale does with them; everything else is real (the strategy is built on the CPU, as TensorFlow finds
no GPU). Prints one JSON line: the calls recorded in order, the cluster's all-reduce, the
implementation MultiWorkerMirroredStrategy was built with, or the ConfigError's message.
"""

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfscale import config as tfs_config  # noqa: E402
from tfscale.cluster import devices  # noqa: E402
from tfscale.cluster import distribute


class FakeGpuConfig:
    """The three `tf.config` calls `devices.prepare_gpus` makes, over GPUs that exist only here."""

    def __init__(self, num_gpus: int):
        self.gpus = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
                     for i in range(num_gpus)]
        self.calls = []
        self.experimental = self  # set_memory_growth lives in tf.config.experimental

    def list_physical_devices(self, device_type):
        return list(self.gpus) if device_type == "GPU" else []

    def set_visible_devices(self, device, device_type):
        self.calls.append(["visible", device.name])

    def set_memory_growth(self, device, enable):
        self.calls.append(["memory_growth", device.name, enable])


def main(num_gpus: str, backend: str, *overrides: str) -> None:
    fake = FakeGpuConfig(int(num_gpus))
    devices.prepare_gpus = functools.partial(devices.prepare_gpus, api=fake)
    cfg = tfs_config.base_config()
    cfg.distribute.backend = backend
    for override in overrides:  # --config.distribute.key=value
        key, value = override.removeprefix("--config.distribute.").split("=", 1)
        cfg.distribute[key] = type(cfg.distribute[key])(value)
    try:
        cluster = distribute.setup(cfg.distribute)
    except tfs_config.ConfigError as err:
        print(json.dumps({"calls": fake.calls, "config_error": str(err)}))
        return
    options = cluster.strategy.extended._communication_options if backend == "mwms" else None
    print(json.dumps({
        "calls": fake.calls,
        "all_reduce": cluster.all_reduce,
        "mwms_implementation": options.implementation.value if options else None,
        "household_hint": getattr(cluster._collectives, "communication_hint", None),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
