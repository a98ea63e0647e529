"""Runs `distribute.setup` for several scenarios, in order, in one process that "sees" GPUs it does not have.

    python tests/helpers/fake_gpu_scenarios.py '[{"num_gpus": 2, "backend": "mwms", "env": {...}}, ...]'

Each scenario is what one run of tests/helpers/fake_gpus.py does (its FakeGpuConfig records the calls), with
`env` set in os.environ for that scenario only. GPU and strategy set-up are process-global, so only the last
scenario may get that far: every one before it must be refused (ConfigError) before it records a call or
builds a strategy, which leaves the process as a fresh one for the next. The helper checks that and stops
otherwise. Prints one JSON line per scenario: {"scenario": index, "calls": [...], then the ConfigError's
message or the cluster's all-reduce and the implementation MultiWorkerMirroredStrategy was built with}.
"""

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from fake_gpus import FakeGpuConfig  # noqa: E402  (this script's directory is on sys.path)

from tfscale import config as tfs_config  # noqa: E402
from tfscale.cluster import devices, distribute  # noqa: E402

_PREPARE_GPUS = devices.prepare_gpus


def run_scenario(num_gpus: int, backend: str, overrides=(), env=None) -> dict:
    fake = FakeGpuConfig(num_gpus)
    devices.prepare_gpus = functools.partial(_PREPARE_GPUS, api=fake)
    cfg = tfs_config.base_config()
    cfg.distribute.backend = backend
    for override in overrides:  # --config.distribute.key=value
        key, value = override.removeprefix("--config.distribute.").split("=", 1)
        cfg.distribute[key] = type(cfg.distribute[key])(value)
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        cluster = distribute.setup(cfg.distribute)
    except tfs_config.ConfigError as err:
        return {"calls": fake.calls, "config_error": str(err)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    options = cluster.strategy.extended._communication_options if backend == "mwms" else None
    return {
        "calls": fake.calls,
        "all_reduce": cluster.all_reduce,
        "mwms_implementation": options.implementation.value if options else None,
        "household_hint": getattr(cluster._collectives, "communication_hint", None),
    }


def main(scenarios_json: str) -> None:
    scenarios = json.loads(scenarios_json)
    for index, scenario in enumerate(scenarios):
        report = run_scenario(**scenario)
        print(json.dumps({"scenario": index, **report}), flush=True)
        if index < len(scenarios) - 1 and (report["calls"] or "config_error" not in report):
            sys.exit(f"scenario {index} got past the refusal (calls {report['calls']}): the process is no longer "
                     "fresh for the scenarios after it")


if __name__ == "__main__":
    main(*sys.argv[1:])
