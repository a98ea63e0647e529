"""tfscale-doctor on this CPU machine: every check runs or says what it needs, as a user's first command would."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from tfscale.perf import doctor


def run_doctor(*args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "tfscale.doctor", *args], cwd=REPO, capture_output=True, text=True,
                          env={**clean, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, timeout=600)


def check_lines(stdout: str) -> dict[str, tuple[str, str]]:
    """{check name: (STATUS, detail)} of the doctor's one-line-per-check output."""
    rows = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition("  ")
        if status.strip() in ("PASS", "FAIL", "N/A"):
            name, _, detail = rest.strip().partition(" ")
            rows[name] = (status.strip(), detail.strip())
    return rows


@pytest.mark.slow
def test_doctor_on_a_cpu_machine_runs_every_check_and_names_what_needs_a_gpu(tmp_path):
    result = run_doctor(f"--json={tmp_path / 'doctor.json'}")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"tfscale-doctor on {os.uname().nodename}: Python ")
    assert "tensorflow-cpu 2.21" in lines[0]  # which TensorFlow wheel, the first thing to know on a GPU node
    rows = check_lines(result.stdout)
    assert list(rows) == ["gpus", "memory-growth", "all-reduce", "horovod", "xla-step", "float16-step", "dali",
                          "gpu-bandwidth", "throughput"]
    need_a_gpu = {"gpus", "memory-growth", "all-reduce", "gpu-bandwidth", "throughput"}
    for name in need_a_gpu:
        assert rows[name][0] == "N/A", rows[name]
    assert "AUTO -> AUTO: TensorFlow's rings without a GPU" in rows["all-reduce"][1]
    # What runs on a CPU runs for real: tfscale's XLA-compiled step and a loss-scaled float16 step.
    assert rows["xla-step"][0] == "PASS" and "(CPU, batch 2 at 64 px)" in rows["xla-step"][1]
    assert rows["float16-step"][0] == "PASS" and "loss scale 32768" in rows["float16-step"][1]
    # Optional parts: checked where installed (make test installs both), named where not.
    horovod_installed = importlib.util.find_spec("horovod") is not None
    if horovod_installed:
        assert rows["horovod"][0] == "PASS" and rows["horovod"][1].startswith("Horovod 0.28.1 built with ")
        assert "Gloo" in rows["horovod"][1] and "NCCL matters on GPU nodes: `make horovod-gpu`" in rows["horovod"][1]
    else:
        assert rows["horovod"][0] == "N/A"
    assert rows["dali"][0] == "N/A"
    passed = 3 if horovod_installed else 2
    assert lines[-1].startswith(f"summary: {passed} pass, 0 fail, {9 - passed} n/a (gpus, memory-growth, all-reduce")
    recorded = json.loads((tmp_path / "doctor.json").read_text())
    assert [c["name"] for c in recorded["checks"]] == list(rows)


def test_a_gpu_node_whose_tensorflow_sees_no_gpu_fails_naming_the_wheel():
    # Slurm says this task has 4 GPUs; the installed TensorFlow (tensorflow-cpu here) cannot see any.
    result = run_doctor("--only=gpus", SLURM_GPUS_ON_NODE="4")
    assert result.returncode == 1
    status, detail = check_lines(result.stdout)["gpus"]
    assert status == "FAIL"
    assert detail.startswith(f"the node has 4 GPU(s) (SLURM_GPUS_ON_NODE=4) but TensorFlow sees none: the Python "
                             f"environment {sys.prefix} has a TensorFlow built without CUDA (tensorflow-cpu")
    assert result.stdout.strip().splitlines()[-1] == "summary: 0 pass, 1 fail, 0 n/a"


def test_an_unknown_check_is_named():
    result = run_doctor("--only=gpus,nvlink")
    assert result.returncode == 1
    assert "--only: no check named nvlink (checks: gpus, memory-growth," in result.stderr


@pytest.mark.parametrize("name, gpu", [
    ("NVIDIA A100-SXM4-40GB (sm_80)", "A100"), ("Tesla V100-SXM2-16GB (sm_70)", "V100"),
    ("Tesla P100-PCIE-16GB (sm_60)", "P100"), ("NVIDIA H100 80GB HBM3 (sm_90)", None),
])
def test_published_figure_by_gpu_name(name, gpu):
    row = doctor.published_figure(name)
    assert (row[0] if row else None) == gpu


def test_the_bandwidth_measurement_runs_on_two_cpu_devices():
    # The GPU check's code path (MirroredStrategy all-reduce, timed) on the two logical CPU devices of a fresh
    # process; the figure means nothing for GPUs, the test is that it measures.
    code = (
        "import tensorflow as tf\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "from tfscale.perf import doctor\n"
        "s = doctor.allreduce_seconds(['/cpu:0', '/cpu:1'], 1 << 20, 3, tf.distribute.ReductionToOneDevice())\n"
        "print(s)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert 0 < float(result.stdout.strip().splitlines()[-1]) < 10
