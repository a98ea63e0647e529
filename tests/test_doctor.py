"""tfscale-doctor on this CPU machine: every check runs or says what it needs, as a user's first command would."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO

from tfscale.cluster import driver
from tfscale.perf import collective_probe, doctor, doctor_speed


def run_doctor(*args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE_DEVICES"))}
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
    assert list(rows) == ["gpus", "driver", "memory-growth", "all-reduce", "horovod", "xla-step", "float16-step",
                          "dali", "gpu-bandwidth", "throughput"]
    need_a_gpu = {"gpus", "driver", "memory-growth", "gpu-bandwidth", "throughput"}
    for name in need_a_gpu:
        assert rows[name][0] == "N/A", rows[name]
    # A real all-reduce between two MWMS worker processes, through tfscale's start-up (rings on the CPU here).
    assert rows["all-reduce"][0] == "PASS"
    assert rows["all-reduce"][1].startswith("between 2 processes on this node: 2 workers all-reduced with AUTO "
                                            "(TensorFlow's rings) on CPU:0: sum 3, expected 3")
    assert "; the strategy's collectives ran with communication hint AUTO;" in rows["all-reduce"][1]
    # What runs on a CPU runs for real: tfscale's XLA-compiled step and a loss-scaled float16 step.
    assert rows["xla-step"][0] == "PASS" and "(CPU, batch 2 at 64 px)" in rows["xla-step"][1]
    assert rows["float16-step"][0] == "PASS" and "loss scale 32768" in rows["float16-step"][1]
    # Optional parts: checked where installed (make test installs both), named where not.
    horovod_installed = importlib.util.find_spec("horovod") is not None
    if horovod_installed:
        assert rows["horovod"][0] == "PASS" and rows["horovod"][1].startswith("Horovod 0.28.1 built with ")
        assert "Gloo" in rows["horovod"][1] and "NCCL matters on GPU nodes: `make horovod-gpu`" in rows["horovod"][1]
        assert ("training's grouped Average of 2 tensors after hvd.init() (1 rank) on CPU:0: means 1, 2, expected "
                "1, 2" in rows["horovod"][1])
    else:
        assert rows["horovod"][0] == "N/A"
    assert rows["dali"][0] == "N/A" and "read through its TensorFlow plugin" in rows["dali"][1]
    passed = 4 if horovod_installed else 3
    assert lines[-1] == f"summary: {passed} pass, 0 fail, {10 - passed} n/a (gpus, driver, memory-growth, " + \
        ("" if horovod_installed else "horovod, ") + "dali, gpu-bandwidth, throughput)"
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
    assert "--only: no check named nvlink (checks: gpus, driver, memory-growth," in result.stderr


@pytest.mark.parametrize("name, gpu", [
    ("NVIDIA A100-SXM4-40GB (sm_80)", "A100"), ("Tesla V100-SXM2-16GB (sm_70)", "V100"),
    ("Tesla P100-PCIE-16GB (sm_60)", "P100"), ("NVIDIA H100 80GB HBM3 (sm_90)", None),
])
def test_published_figure_by_gpu_name(name, gpu):
    row = doctor_speed.published_figure(name)
    assert (row[0] if row else None) == gpu


@pytest.mark.slow
def test_fast_mode_skips_the_resnet_compiles():
    result = run_doctor("--fast")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = check_lines(result.stdout)
    assert list(rows) == ["gpus", "driver", "memory-growth", "all-reduce", "horovod", "dali", "gpu-bandwidth"]
    assert rows["all-reduce"][0] == "PASS"


@pytest.mark.slow
def test_the_all_reduce_check_fails_naming_a_port_another_process_holds():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_doctor("--only=all-reduce", f"--port_base={port}")
    assert result.returncode == 1
    status, detail = check_lines(result.stdout)["all-reduce"]
    assert status == "FAIL"
    assert detail.startswith("MWMS all-reduce between 2 processes on this node failed: worker 0: the probe process "
                             f"exited with 69: tfscale pre-flight: this worker's port {port} (worker 0 at "
                             f"127.0.0.1:{port} in the cluster spec) is already in use by another process")
    assert detail.endswith("worker 1: stopped: a peer failed first, or no answer within the time-out")


def test_the_all_reduce_check_judges_what_the_strategy_ran_not_what_the_config_asked():
    where, detail = "between 2 processes on this node", "2 workers all-reduced ..."
    # GPU workers whose live strategy ran NCCL: PASS. The config said NCCL, the strategy ran RING (an override that
    # never reached it): FAIL, naming what ran.
    assert doctor.all_reduce_verdict(where, detail, "AUTO", "NCCL", "NCCL", 2, False).status == "pass"
    broken = doctor.all_reduce_verdict(where, detail, "NCCL", "NCCL", "RING", 2, False)
    assert broken.status == "fail" and "GPU workers ran RING, not NCCL" in broken.detail
    assert doctor.all_reduce_verdict(where, detail, "AUTO", "NCCL", "", 8, True).status == "fail"
    # No GPU, or one GPU that two local workers cannot share: rings are what can run.
    assert doctor.all_reduce_verdict(where, detail, "AUTO", "AUTO", "AUTO", 0, False).status == "pass"
    one = doctor.all_reduce_verdict(where, detail, "AUTO", "NCCL", "AUTO", 1, False)
    assert one.status == "pass" and "one GPU cannot serve two NCCL ranks" in one.detail


def test_a_gpu_rank_with_a_horovod_built_without_nccl_fails_the_horovod_check():
    if importlib.util.find_spec("horovod") is None:
        pytest.skip("Horovod is not installed (make horovod)")
    # This machine's Horovod is a CPU build (no NCCL); a rank with a GPU would copy every gradient to the host.
    check = doctor.check_horovod(gpus=["/physical_device:GPU:0"])
    assert check.status == "fail"
    assert "built with MPI, Gloo: this rank has a GPU but Horovod was built without NCCL" in check.detail


def test_a_probe_that_aborts_is_reported_with_its_last_words():
    # What a Horovod whose CUDA runtime the driver refuses does: its check macro throws in an op thread, and the
    # process aborts. The doctor reports the signal and the message instead of a result.
    process = subprocess.Popen([sys.executable, "-c", "import os, sys; print('terminate called after throwing an "
                                "instance of std::logic_error: cudaEventCreateWithFlags failed: CUDA driver version is "
                                "insufficient for CUDA runtime version', file=sys.stderr, flush=True); os.abort()"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=60)
    ok, detail = collective_probe._verdict(process, stdout, stderr)
    assert not ok
    assert detail.startswith("the probe process killed by signal 6: terminate called after throwing")
    assert detail.endswith("CUDA driver version is insufficient for CUDA runtime version")


@pytest.mark.parametrize("node_driver, runtimes, status, said", [
    # Horovod built with the CUDA 13 toolkit (static runtime) on an R535 node: every rank would abort.
    ("535.104.05", {"TensorFlow 2.21.0": "12.5.1", "Horovod 0.28.1": "13.0"}, "FAIL",
     "Horovod 0.28.1 runs on a CUDA 13.0 runtime, which needs an NVIDIA driver >= 580; this node's is 535.104.05"),
    ("470.82.01", {"TensorFlow 2.21.0": "12.5.1"}, "FAIL",
     "TensorFlow 2.21.0 runs on a CUDA 12.5.1 runtime, which needs an NVIDIA driver >= 525; this node's is 470.82.01"),
    ("535.104.05", {"TensorFlow 2.21.0": "12.5.1", "Horovod 0.28.1": "12.5"}, "PASS",
     "NVIDIA driver 535.104.05 runs TensorFlow 2.21.0 CUDA 12.5.1, Horovod 0.28.1 CUDA 12.5"),
    ("", {"TensorFlow 2.21.0": "12.5.1"}, "N/A", "no NVIDIA driver loaded"),
])
def test_the_driver_check_names_the_runtime_that_needs_a_newer_driver(node_driver, runtimes, status, said):
    check = doctor.check_driver([], node_driver=node_driver, runtimes=runtimes)
    assert check.line().startswith(status) and said in check.detail, check.detail


def test_the_driver_version_is_read_from_the_loaded_kernel_module(tmp_path):
    version = tmp_path / "driver" / "nvidia" / "version"
    version.parent.mkdir(parents=True)
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
                       "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert driver.installed_driver(str(tmp_path)) == "535.104.05"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n")
    assert driver.installed_driver(str(tmp_path)) == "580.65.06"
    assert driver.installed_driver(str(tmp_path / "none")) == ""


@pytest.mark.parametrize("free_gib, status", [(1.5, "FAIL"), (38.5, "PASS")])
def test_memory_growth_is_judged_by_what_the_driver_says_the_process_holds(free_gib, status):
    # A 40 GiB A100: without memory growth TensorFlow's allocator takes nearly all of it at the first allocation.
    check = doctor.memory_growth_verdict(0, int(free_gib * 2**30), 40 * 2**30)
    assert check.status == status.lower()
    assert f"holds {40 - free_gib:.2f} of 40.0 GiB after two 64 MiB allocations" in check.detail
    if status == "FAIL":
        assert "reserved the GPU's memory up front (memory growth is off)" in check.detail


# --- throughput: the node's input beside the GPU's step -------------------------------------------------------


def test_input_below_the_stated_share_of_the_step_fails_naming_what_to_do(digit_shards):
    # tfscale's ImageNet pipeline on real JPEG shards, timed here; the GPU's step rate is what varies.
    from tfscale.perf import gpu_probe

    shards, _ = digit_shards
    rate = gpu_probe.input_images_per_sec(shards, per_gpu_batch=16, threads=1, warmup_batches=2, timed_batches=4)
    assert rate > 0
    status, text = doctor_speed.input_verdict(rate, rate / 0.5, shards, threads=1)  # a GPU twice as fast as the input
    assert status == doctor.FAIL
    assert f"input from {shards}: {rate:.0f} images/sec on 1 CPU(s), 0.50x the step" in text
    assert "below 90%, so the GPU waits for data. Stage the shards to node-local disk" in text
    # At the share: a step a hair slower than rate / 0.9, since rate / (rate / 0.9) can round to 0.8999...
    at_share = rate / doctor_speed.INPUT_SHARE * (1 - 1e-9)
    assert doctor_speed.input_verdict(rate, at_share, shards, 1)[0] == doctor.PASS
    assert doctor_speed.input_verdict(rate, rate, shards, 1) == (doctor.PASS, text.split(": below")[0].replace(
        "0.50x", "1.00x"))


def test_the_throughput_check_times_the_input_of_one_tasks_cpus_and_fails_an_input_bound_node(digit_shards,
                                                                                              monkeypatch):
    # The check's own path with the GPU injected: a device list of one GPU, its name and capability, and a
    # ResNet-50 step of 10 ms at batch 128 (12,800 images/sec: no CPU input of two cores feeds that).
    import tensorflow as tf

    from tfscale.perf import gpu_probe

    shards, _ = digit_shards
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda gpu: {"device_name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)})
    steps = []
    monkeypatch.setattr(gpu_probe, "resnet50_steps", lambda cluster, precision, size, batch, *_: steps.append(
        (precision, size, batch)) or {"step_s": [0.01] * 4})
    monkeypatch.setattr(doctor_speed, "INPUT_WARMUP_BATCHES", 1)
    monkeypatch.setattr(doctor_speed, "INPUT_BATCHES", 3)
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    check = doctor_speed.check_throughput(None, [gpu], shards, tasks_per_node=2)
    assert steps == [("mixed_float16", 224, 128)]
    assert check.status == doctor.FAIL
    threads = doctor_speed.task_cpus(2)
    assert check.detail.startswith("12800 images/sec (NVIDIA H100 80GB HBM3 (sm_90), mixed_float16+XLA, batch 128")
    assert f"input from {shards}: " in check.detail and f"on {threads} CPU(s)" in check.detail
    no_data = doctor_speed.check_throughput(None, [gpu], "", tasks_per_node=2)
    assert no_data.status == doctor.PASS and no_data.detail.endswith("input not timed (--data_dir=SHARDS times it)")
