"""The NVIDIA driver a node has against the one its CUDA code needs.

A CUDA runtime of major version M runs on any driver of at least M's first release family, whatever
its minor version (NVIDIA's "minor version compatibility", CUDA 11 onwards; docs.nvidia.com/deploy/
cuda-compatibility, Table 1: CUDA 11.x >= 450, 12.x >= 525, 13.x >= 580). Below that the first CUDA call
fails with "CUDA driver version is insufficient for CUDA runtime version": in TensorFlow the GPUs are
not found, in a Horovod op thread the check throws and every rank aborts. Each piece of CUDA code in a
tfscale environment brings its own runtime: TensorFlow's wheel (CUDA 12), and Horovod's extension,
whose build records the runtime it links (tools/install_horovod.sh writes horovod/tfscale_build.json).
The standard library only: no TensorFlow here.
"""

from __future__ import annotations

import json
import os
import re

# CUDA major version -> the oldest Linux driver release family (major) that runs it.
MIN_DRIVER_MAJOR = {11: 450, 12: 525, 13: 580}
_VERSION = re.compile(r"Kernel Module(?: for [\w-]+)?\s+(\d+(?:\.\d+)+)")
BUILD_RECORD = "tfscale_build.json"  # in Horovod's package directory


def installed_driver(proc: str = "/proc") -> str:
    """The loaded NVIDIA kernel module's version, e.g. '535.104.05'; '' without one."""
    try:
        with open(os.path.join(proc, "driver", "nvidia", "version")) as f:
            match = _VERSION.search(f.read())
    except OSError:
        return ""
    return match.group(1) if match else ""


def min_driver_major(cuda_version: str) -> int | None:
    """The oldest driver family for a CUDA version such as '12.5.1' or '13.0'; None when not known."""
    major = cuda_version.split(".")[0]
    return MIN_DRIVER_MAJOR.get(int(major)) if major.isdigit() else None


def driver_problems(driver: str, runtimes: dict[str, str]) -> list[str]:
    """What cannot run on `driver`: one message per runtime ({what: CUDA version}) that needs a newer one."""
    if not driver:
        return []
    problems = []
    for what, cuda_version in runtimes.items():
        needed = min_driver_major(cuda_version)
        if needed is not None and int(driver.split(".")[0]) < needed:
            problems.append(f"{what} runs on a CUDA {cuda_version} runtime, which needs an NVIDIA driver >= {needed}; "
                            f"this node's is {driver}")
    return problems


def horovod_build_record(package_dir: str) -> dict:
    """What tools/install_horovod.sh recorded of the Horovod build in `package_dir`; {} where nothing was."""
    try:
        with open(os.path.join(package_dir, BUILD_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def horovod_driver_problems(package_dir: str, proc: str = "/proc") -> list[str]:
    """What the node's driver cannot run of the Horovod build in `package_dir` (its record); [] without a
    driver, without a record (a CPU build) or when it can."""
    record = horovod_build_record(package_dir)
    runtime = record.get("cuda_runtime", "")
    if not runtime:
        return []
    return driver_problems(installed_driver(proc), {f"this Horovod {record.get('horovod', '')} build".replace("  ", " "):
                                                    runtime})
