"""What tfscale decides for GPU nodes, tested with the device lists injected (this machine has no GPU).

Each decision (docs/gpu.md's table) is a function of what the process sees; these tests hand it
GPUs, local ranks and Slurm environments, and for `distribute.setup` run every backend in a real
process whose `tf.config` reports GPUs (tests/helpers/fake_gpus.py). What stays unproven without a
GPU (NCCL itself, memory actually left to DALI, speed) is listed in docs/gpu.md.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, load_config, run_cli

from tfscale import config as tfs_config
from tfscale.cluster import devices, driver, horovod_start
from tfscale.config import ConfigError, validation
from tfscale.training import step_choices
from tfscale.workdir import layout

FAKE_GPUS = os.path.join(REPO, "tests", "helpers", "fake_gpus.py")


def setup_with_gpus(num_gpus: int, backend: str, *overrides: str, **env: str) -> dict:
    """`distribute.setup` of `backend` in a fresh process that sees `num_gpus` GPUs; its JSON report."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "TF_CONFIG", "TFSCALE_", "OMPI_", "CUDA_VISIBLE_DEVICES"))}
    result = subprocess.run([sys.executable, FAKE_GPUS, str(num_gpus), backend, *overrides], cwd=REPO,
                            env={**clean, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["stderr"] = result.stderr
    return report


SCENARIOS = os.path.join(REPO, "tests", "helpers", "fake_gpu_scenarios.py")


def setups_in_one_process(*scenarios: dict) -> list[dict]:
    """`setup_with_gpus` of each scenario ({"num_gpus", "backend", "env"}), in order, in one fresh process; their
    JSON reports. Every scenario but the last must be refused before it sets anything up (the helper checks),
    so that each one meets the process as a fresh one would."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "TF_CONFIG", "TFSCALE_", "OMPI_", "CUDA_VISIBLE_DEVICES"))}
    result = subprocess.run([sys.executable, SCENARIOS, json.dumps(scenarios)], cwd=REPO,
                            env={**clean, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"scenario": ')]
    assert [report.pop("scenario") for report in reports] == list(range(len(scenarios)))
    return reports


@pytest.fixture(scope="module")
def refused_workers_then_a_local_rank():
    """The workers below that are refused before they connect, and last the multi-worker MWMS worker of local rank 2
    (a real set-up): one process instead of one each, as a refused set-up leaves nothing behind."""
    from tfscale.launch import launch

    def tf_config(workers, index):
        return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})

    # never contacted: the refusals come first
    two_workers, three_workers = ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    port = launch.free_ports(1)[0]
    scenarios = {
        "more_workers_than_gpus": {"num_gpus": 2, "backend": "mwms",
                                   "env": {"TF_CONFIG": tf_config(three_workers, 2), "SLURM_LOCALID": "2"}},
        **{f"no_gpu_seen_{backend}": {"num_gpus": 0, "backend": backend,
                                      "env": {"TF_CONFIG": tf_config(two_workers, 0), "SLURM_GPUS_ON_NODE": "4",
                                              "SLURM_LOCALID": "0"}}
           for backend in ("mwms", "horovod")},
        "local_rank_2": {"num_gpus": 4, "backend": "mwms",
                         "env": {"TF_CONFIG": tf_config([f"127.0.0.1:{port}"], 0), "TFSCALE_LOCAL_RANK": "2"}},
    }
    return dict(zip(scenarios, setups_in_one_process(*scenarios.values())))


def growth(*indices):
    return [["memory_growth", f"/physical_device:GPU:{i}", True] for i in indices]


# --- which GPU a worker keeps, and memory growth on every backend ----------------------------------------


@pytest.mark.parametrize("backend", ["one_device", "mirrored", "mwms", "horovod"])
def test_every_backend_turns_memory_growth_on_before_its_strategy(backend):
    report = setup_with_gpus(2, backend)
    if backend == "horovod":  # a rank keeps its own GPU (local rank 0 of a one-rank job), then grows into it
        assert report["calls"] == [["visible", "/physical_device:GPU:0"], *growth(0)]
    else:  # one process for every local GPU (one_device uses the first; a one-worker MWMS mirrors over all)
        assert report["calls"] == growth(0, 1)


def test_a_multi_worker_mwms_worker_keeps_the_gpu_of_its_local_rank(refused_workers_then_a_local_rank):
    # A one-worker TF_CONFIG on a free port (the worker connects to itself), local rank 2 of 4 GPUs.
    report = refused_workers_then_a_local_rank["local_rank_2"]
    assert report["calls"] == [["visible", "/physical_device:GPU:2"], *growth(2)]


def test_more_workers_than_gpus_on_a_node_stops_before_connecting(refused_workers_then_a_local_rank):
    # Worker 2 of 3 (SLURM_LOCALID=2) on a node that shows 2 GPUs; the workers are never contacted.
    report = refused_workers_then_a_local_rank["more_workers_than_gpus"]
    assert report["calls"] == []
    assert "worker with local rank 2" in report["config_error"]
    assert "shows 2 GPUs to each worker (0-1): more worker processes than GPUs" in report["config_error"]
    assert "--ntasks-per-node=2" in report["config_error"]


# --- a GPU node whose TensorFlow sees no GPU: refused before connecting --------------------------------------


def fake_dev(tmp_path, *names):
    """A stand-in for a node's /dev with these device files."""
    dev = tmp_path / "dev"
    dev.mkdir(parents=True)
    for name in names:
        (dev / name).touch()
    return str(dev)


def test_the_nvidia_device_files_count_gpus_and_the_driver_files_do_not(tmp_path):
    dev = fake_dev(tmp_path, "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null")
    assert devices.node_gpu_evidence({}, dev) == (2, f"2 NVIDIA device file(s), {dev}/nvidia0 .. nvidia1")
    assert devices.node_gpu_evidence({}, fake_dev(tmp_path / "x", "nvidiactl")) == (0, "")
    # Slurm's count of the task's GPUs wins over the device files (a job may hold 2 of a node's 8).
    assert devices.node_gpu_evidence({"SLURM_GPUS_ON_NODE": "2"}, dev) == (2, "SLURM_GPUS_ON_NODE=2")
    assert devices.node_gpu_evidence({"SLURM_GPUS_ON_NODE": "0"}, str(tmp_path / "absent")) == (0, "")


def fake_devices_cgroup(root, rules: str):
    """`root`/proc/self/cgroup naming a job's cgroup v1 device controller, and its devices.list of `rules`."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text("11:devices:/slurm/uid_0/job_7/step_0\n4:memory:/slurm\n")
    rules_file = root / "cgroup" / "devices" / "slurm" / "uid_0" / "job_7" / "step_0" / "devices.list"
    rules_file.parent.mkdir(parents=True)
    rules_file.write_text(rules)
    return str(root / "proc"), str(root / "cgroup")


def test_a_slurm_job_counts_only_the_gpus_it_was_given(tmp_path):
    """/dev/nvidiaN exists on every GPU node: in a Slurm job it says nothing of what the job was given."""
    dev = fake_dev(tmp_path, "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")
    job = {"SLURM_JOB_ID": "7"}
    # A job that asked for no GPU: its device cgroup grants none (nvidiactl, 195:255, is no GPU) -> nothing expected.
    proc, cgroup = fake_devices_cgroup(tmp_path / "cpu_job", "c 1:3 rwm\nc 195:255 rwm\nc 136:* rwm\n")
    assert devices.node_gpu_evidence(job, dev, proc, cgroup) == (0, "")
    assert devices.hidden_gpus_problem(0, cuda_build=False, env=job, dev_dir=dev) is None
    # A site that does not constrain devices ("a *:* rwm"): still nothing to go by but Slurm's variables.
    proc, cgroup = fake_devices_cgroup(tmp_path / "open", "a *:* rwm\n")
    assert devices.node_gpu_evidence(job, dev, proc, cgroup) == (0, "")
    # Granted two GPUs by name: those two count.
    proc, cgroup = fake_devices_cgroup(tmp_path / "gpu_job", "c 195:255 rwm\nc 195:1 rwm\nc 195:3 rwm\n")
    assert devices.node_gpu_evidence(job, dev, proc, cgroup) == (
        2, f"the job's device cgroup grants {dev}/nvidia1, {dev}/nvidia3")
    # Slurm's own GPU variables and CUDA_VISIBLE_DEVICES naming devices say so directly.
    assert devices.node_gpu_evidence({**job, "SLURM_JOB_GPUS": "1,3"}, dev) == (2, "SLURM_JOB_GPUS=1,3")
    assert devices.node_gpu_evidence({**job, "CUDA_VISIBLE_DEVICES": "0"}, dev) == (1, "CUDA_VISIBLE_DEVICES=0")
    assert devices.node_gpu_evidence({**job, "CUDA_VISIBLE_DEVICES": "-1"}, dev, proc, str(tmp_path / "no")) == (0, "")


def test_cudnn_and_nccl_from_outside_the_venv_are_named(tmp_path):
    """A site's `module load cudnn nccl` puts its libraries on LD_LIBRARY_PATH, ahead of the wheels' RUNPATH."""
    venv = tmp_path / "venv"
    wheel = venv / "lib" / "python3.11" / "site-packages" / "nvidia" / "cudnn" / "lib"
    site = tmp_path / "sw" / "cudnn-9.1" / "lib"
    for directory in (wheel, site):
        directory.mkdir(parents=True)
        (directory / "libcudnn.so.9").touch()
    (site / "libnccl.so.2").touch()
    (site / "libcublas.so.12").touch()  # not one the check names
    maps = (f"7f00-7f10 r-xp 00000000 08:01 12 {wheel}/libcudnn.so.9\n"
            f"7f20-7f30 r-xp 00000000 08:01 13 {site}/libnccl.so.2\n"
            "7f40-7f50 rw-p 00000000 00:00 0 \n")
    env = {"LD_LIBRARY_PATH": f"{site}::{wheel}"}
    assert devices.foreign_cuda_libraries(env, maps, str(venv)) == [
        f"{site}/libnccl.so.2 (loaded)", f"{site}/libcudnn.so.9 (on LD_LIBRARY_PATH)",
        f"{site}/libnccl.so.2 (on LD_LIBRARY_PATH)"]
    maps_file = tmp_path / "maps"
    maps_file.write_text(maps)
    warning = devices.foreign_cuda_warning(env, str(maps_file), str(venv))
    assert warning.startswith(f"cuDNN/NCCL from outside the Python environment {venv}: {site}/libnccl.so.2 (loaded)")
    assert "MPI only" in warning
    # The venv's own wheels only: nothing to say.
    assert devices.foreign_cuda_warning({"LD_LIBRARY_PATH": str(wheel)}, str(tmp_path / "none"), str(venv)) is None


def test_a_cpu_venv_on_a_gpu_node_is_refused_naming_the_venv_and_tensorflow_cpu(tmp_path):
    dev = fake_dev(tmp_path, "nvidia0")
    problem = devices.hidden_gpus_problem(0, cuda_build=False, env={}, dev_dir=dev, venv="/home/u/tfscale/.venv")
    assert problem.startswith(f"the node has 1 GPU(s) (1 NVIDIA device file(s), {dev}/nvidia0) but TensorFlow sees "
                              "none: the Python environment /home/u/tfscale/.venv has a TensorFlow built without "
                              "CUDA (tensorflow-cpu")
    assert "make TF_EXTRA=gpu VENV=.venv-gpu venv" in problem and "CUDA_VISIBLE_DEVICES=-1" in problem
    # A CUDA build that found no GPU: the driver or CUDA did not load, which is a different fix.
    problem = devices.hidden_gpus_problem(0, cuda_build=True, env={"SLURM_GPUS_ON_NODE": "4"}, dev_dir=dev)
    assert "(SLURM_GPUS_ON_NODE=4) but TensorFlow sees none" in problem
    assert "CUDA or the NVIDIA driver did not load" in problem and "TF_CPP_MIN_LOG_LEVEL=0" in problem


@pytest.mark.parametrize("env, num_seen", [
    ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),  # hidden on purpose
    ({"CUDA_VISIBLE_DEVICES": ""}, 0),
    ({}, 1),  # TensorFlow sees the GPU
])
def test_gpus_hidden_on_purpose_or_seen_are_not_refused(tmp_path, env, num_seen):
    dev = fake_dev(tmp_path, "nvidia0")
    assert devices.hidden_gpus_problem(num_seen, cuda_build=False, env={**env, "SLURM_GPUS_ON_NODE": "1"},
                                       dev_dir=dev) is None


@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_a_worker_that_sees_no_gpu_where_slurm_allocated_some_stops_before_connecting(backend,
                                                                                      refused_workers_then_a_local_rank):
    # This machine's tensorflow-cpu sees no GPU; Slurm says the task has 4 (SLURM_GPUS_ON_NODE=4, worker 0 of a
    # 2-worker TF_CONFIG). MWMS would contact the workers of TF_CONFIG (never started here) and Horovod would
    # join its rendezvous: the refusal comes first.
    report = refused_workers_then_a_local_rank[f"no_gpu_seen_{backend}"]
    assert report["calls"] == []  # not even memory growth: nothing of the GPU set-up ran
    assert report["config_error"].startswith("the node has 4 GPU(s) (SLURM_GPUS_ON_NODE=4) but TensorFlow sees none: "
                                             f"the Python environment {sys.prefix} has a TensorFlow built without CUDA")


def test_train_on_a_node_with_gpus_it_cannot_see_exits_with_one_line_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
                                 "TF_CPP_MIN_LOG_LEVEL": "2", "SLURM_GPUS_ON_NODE": "2"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"the node has 2 GPU(s) (SLURM_GPUS_ON_NODE=2) but TensorFlow sees none: the Python environment " \
           f"{sys.prefix} has a TensorFlow built without CUDA" in result.stderr
    assert not (workdir / layout.CONFIG).exists()
    # The same node with the GPUs hidden on purpose trains on the CPU.
    assert devices.hidden_gpus_problem(0, False, {"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "-1"}) is None


@pytest.mark.parametrize("num_gpus, local_rank, kept", [(0, 3, None), (1, 3, None), (4, 0, 0), (4, 3, 3)])
def test_gpu_for_local_rank(num_gpus, local_rank, kept):
    # One visible GPU is the scheduler's choice (--gpus-per-task): kept whatever the local rank.
    assert devices.gpu_for_local_rank(num_gpus, local_rank) == kept


def test_gpu_for_local_rank_refuses_sharing_naming_the_host():
    with pytest.raises(ConfigError, match=r"local rank 4 on host gpu07, which shows 4 GPUs .*at most 4 tasks per node"):
        devices.gpu_for_local_rank(4, 4, host="gpu07")


def test_gpu_settings_after_tensorflow_started_its_devices_say_what_to_do():
    class Started:
        def list_physical_devices(self, device_type):
            return ["gpu0"]

        experimental = property(lambda self: self)

        def set_memory_growth(self, device, enable):
            raise RuntimeError("Physical devices cannot be modified after being initialized")

    with pytest.raises(RuntimeError, match=r"before TensorFlow initialises its devices .*distribute.setup\(\)"):
        devices.prepare_gpus(None, api=Started())


# --- which all-reduce ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("configured, num_gpus, chosen", [
    ("AUTO", 1, "NCCL"), ("AUTO", 8, "NCCL"), ("AUTO", 0, "AUTO"),
    ("RING", 4, "RING"), ("NCCL", 4, "NCCL"), ("NCCL", 0, "NCCL"),
])
def test_auto_all_reduce_is_nccl_on_a_worker_with_a_gpu(configured, num_gpus, chosen):
    assert devices.collective_implementation(configured, num_gpus) == chosen


@pytest.mark.slow
def test_mwms_is_built_with_nccl_and_every_collective_carries_the_hint():
    report = setup_with_gpus(1, "mwms")
    assert report["mwms_implementation"] == "NCCL"  # what MultiWorkerMirroredStrategy was constructed with
    assert report["household_hint"] == "nccl"  # the raw collective of local SGD's households
    without_gpu = setup_with_gpus(0, "mwms")
    assert (without_gpu["mwms_implementation"], without_gpu["household_hint"]) == ("AUTO", "auto")
    ring = setup_with_gpus(1, "mwms", "--config.distribute.collective_impl=RING")
    assert (ring["mwms_implementation"], ring["household_hint"]) == ("RING", "ring")


@pytest.mark.parametrize("recipe", ["r50_1gpu:amp", "r50_8gpu:amp_bf16", "r50_8gpu:xla"])
def test_a_variant_switched_to_mwms_by_an_override_still_all_reduces_over_nccl(recipe):
    # make_sbatch and users switch the backend with --config.distribute.backend after the variant ran.
    cfg = load_config(recipe, "--config.distribute.backend=mwms")
    assert cfg.distribute.collective_impl == "AUTO"
    assert devices.collective_implementation(cfg.distribute.collective_impl, num_gpus=1) == "NCCL"


def test_horovod_with_a_gpu_and_no_nccl_warns_of_host_copies():
    report = setup_with_gpus(1, "horovod")  # this machine's Horovod is a CPU (Gloo/MPI) build
    assert "Horovod was built without NCCL (hvd.nccl_built() is false): every gradient all-reduce is copied to host " \
           "memory" in report["stderr"]
    assert "make horovod-gpu" in report["stderr"]
    assert devices.horovod_host_copy_warning(1, nccl_built=21903) is None  # hvd.nccl_built() returns NCCL's version
    assert devices.horovod_host_copy_warning(0, nccl_built=False) is None  # a CPU run copies nothing


# --- jit_compile=auto, optim.compiled_update=auto -----------------------------------------------------------

GPUS = ["/job:worker/replica:0/task:0/device:GPU:0", "/job:worker/replica:0/task:0/device:GPU:1"]
CPUS = ["/job:localhost/replica:0/task:0/device:CPU:0"]


@pytest.mark.parametrize("overrides, devices, want", [
    ((), GPUS, True),  # Keras' rule on a GPU: XLA
    ((), CPUS, False),  # Keras' rule on a CPU-only machine: no XLA
    (("--config.distribute.backend=horovod",), GPUS, True),  # one process per GPU: its replica is a GPU
    (("--config.distribute.pack_bytes=65536",), GPUS, False),  # the buckets asked for win: they overlap only without XLA
    (("--config.model.sync_bn=True", "--config.distribute.backend=mwms"), GPUS, False),  # XLA cannot all-reduce across workers
    (("--config.model.sync_bn=True", "--config.distribute.backend=mirrored"), GPUS, True),  # between one process's GPUs it can
    (("--config.jit_compile=True",), CPUS, True),  # a value set stays
    (("--config.jit_compile=False",), GPUS, False),
])
def test_jit_compile_auto_is_decided_by_the_replicas_and_the_config(overrides, devices, want):
    cfg = load_config("smoke", *overrides)
    why = step_choices.resolve_compilation(cfg, devices)  # what the start-up line says after "auto -> want: "
    assert cfg.jit_compile is want
    validation.validate(cfg)  # a decided config is a valid one: no XLA conflict is ever chosen
    assert (why is None) == ("--config.jit_compile" in " ".join(overrides))  # a value set is no decision


def test_jit_compile_auto_names_why_it_chose_no_xla():
    # The run's start-up line says it (tests/test_train.py reads the CPU case from a real run's log).
    buckets = step_choices.resolve_compilation(load_config("smoke", "--config.distribute.pack_bytes=65536"), GPUS)
    assert buckets.startswith("config.distribute.pack_bytes=65536 asks for gradient buckets sent while the backward "
                              "pass runs")
    sync_bn = step_choices.resolve_compilation(
        load_config("smoke", "--config.model.sync_bn=True", "--config.distribute.backend=mwms"), GPUS)
    assert "across workers inside the step, which XLA cannot compile" in sync_bn
    assert step_choices.resolve_compilation(load_config("smoke"), CPUS).startswith("the replicas are CPUs")


def test_a_jit_compile_that_is_neither_auto_nor_a_bool_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"config.jit_compile must be 'auto', True or False, got 'xla'"):
        validation.validate(load_config("smoke", "--config.jit_compile=xla"))


@pytest.mark.parametrize("overrides, devices, want", [
    ((), GPUS, True),  # GPU replicas: one XLA call instead of the update's ~1,800 kernel launches
    ((), CPUS, False),  # CPU replicas: Keras' op-by-op update, the faster one there (docs/benchmarking.md)
    (("--config.jit_compile=True",), CPUS, False),  # decided by the replicas, not by the pass's XLA
    (("--config.jit_compile=False",), GPUS, True),
    (("--config.optim.compiled_update=True",), CPUS, True),  # a value set stays
    (("--config.optim.compiled_update=False",), GPUS, False),
])
def test_compiled_update_auto_is_decided_by_the_replicas(overrides, devices, want, monkeypatch):
    from tfscale.config import step_modes

    logged = []
    monkeypatch.setattr(step_modes.logging, "info", lambda message, *args: logged.append(message % args))
    cfg = load_config("smoke", *overrides)
    step_choices.resolve_compilation(cfg, devices)
    assert cfg.optim.compiled_update is want
    validation.validate(cfg)
    decided = [line for line in logged if line.startswith("config.optim.compiled_update=auto")]
    set_by_user = "--config.optim.compiled_update" in " ".join(overrides)
    assert len(decided) == (0 if set_by_user else 1) and (set_by_user or f"auto -> {want}:" in decided[0])


def test_a_compiled_update_that_is_neither_auto_nor_a_bool_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"config.optim.compiled_update must be 'auto', True or False, got 'yes'"):
        validation.validate(load_config("smoke", "--config.optim.compiled_update=yes"))


def test_a_model_whose_layer_cannot_be_compiled_falls_back_as_keras_does(caplog):
    import keras

    from tfscale.model import build

    class HostOnly(keras.layers.Layer):  # as Keras' lookup and hashing layers declare themselves
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_jit = False

        def call(self, x):
            return x

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(HostOnly(name="host_only")(inputs)))
    cfg = load_config("smoke", "--config.jit_compile=True")
    with caplog.at_level("WARNING"):
        build.check_xla(cfg, model)
    assert cfg.jit_compile is False
    assert ("config.jit_compile=True -> False: layer(s) host_only of config.model.name='cifar_resnet8' set "
            "supports_jit=False") in caplog.text
    supported = load_config("smoke", "--config.jit_compile=True")
    build.check_xla(supported, keras.Model(inputs, keras.layers.Dense(2)(inputs)))
    assert supported.jit_compile is True


# --- XLA and synchronized BatchNorm -------------------------------------------------------------------------


def test_sync_bn_inside_an_xla_step_is_refused_under_mwms_naming_both_keys():
    cfg = load_config("smoke", "--config.distribute.backend=mwms", "--config.model.sync_bn=True",
                      "--config.jit_compile=True")
    with pytest.raises(ConfigError, match=r"config.model.sync_bn=True with config.jit_compile=True under "
                                          r"config.distribute.backend='mwms'"):
        validation.validate(cfg)
    for allowed in (("--config.jit_compile=False",), ("--config.model.sync_bn=False",)):
        validation.validate(load_config("smoke", "--config.distribute.backend=mwms", "--config.model.sync_bn=True",
                                        "--config.jit_compile=True", *allowed))


def test_sync_bn_inside_an_xla_step_on_cpu_replicas_is_refused_before_anything_is_written(tmp_path):
    # MirroredStrategy all-reduces inside XLA only between GPUs; on CPU devices the trace would fail.
    result = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={tmp_path / 'run'}",
                     "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2",
                     "--config.model.sync_bn=True", "--config.jit_compile=True")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "FATAL config error: config.model.sync_bn=True with config.jit_compile=True on replicas "
        "/job:localhost/replica:0/task:0/device:CPU:0, /job:localhost/replica:0/task:0/device:CPU:1")
    assert not os.path.exists(tmp_path / "run" / layout.CONFIG)


# --- buckets that cannot overlap ----------------------------------------------------------------------------


def test_buckets_that_cannot_overlap_are_warned_of_and_negative_ones_refused(caplog):
    assert validation.bucket_warning(load_config("smoke", "--config.distribute.pack_bytes=65536")) is None
    assert validation.bucket_warning(load_config("smoke", "--config.jit_compile=True")) is None  # one message
    xla = load_config("smoke", "--config.distribute.pack_bytes=65536", "--config.jit_compile=True")
    with caplog.at_level("WARNING"):
        validation.validate(xla)
    assert ("config.distribute.pack_bytes=65536 with config.jit_compile=True: XLA computes every gradient at once"
            in caplog.text)
    sync_bn = validation.bucket_warning(load_config("smoke", "--config.distribute.pack_bytes=65536",
                                                    "--config.model.sync_bn=True", "--config.distribute.backend=mwms"))
    assert "first bucket waits for the backward pass's synchronized BatchNorm all-reduces" in sync_bn
    with pytest.raises(ConfigError, match=r"config.distribute.pack_bytes must be >= 0 .*got -1"):
        validation.validate(load_config("smoke", "--config.distribute.pack_bytes=-1"))


# --- float16 on Horovod's wire ------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_horovod_fp16_compression_needs_loss_scaled_float16(precision):
    cfg = load_config("smoke", "--config.distribute.backend=horovod", "--config.distribute.horovod_fp16_allreduce=True",
                      f"--config.precision={precision}")
    with pytest.raises(ConfigError, match=rf"horovod_fp16_allreduce=True with config.precision='{precision}'"):
        validation.validate(cfg)
    validation.validate(load_config("smoke", "--config.distribute.backend=horovod",
                                    "--config.distribute.horovod_fp16_allreduce=True",
                                    "--config.precision=mixed_float16"))


@pytest.mark.slow
def test_horovod_fp16_all_reduce_is_prescaled_so_large_gradients_do_not_overflow(tmp_path):
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    out = tmp_path / "fp16.json"
    result = subprocess.run([sys.executable, "-m", "tfscale.launch", "--backend=horovod", "--num_workers=2",
                             "--threads_per_worker=1", "--", os.path.join(REPO, "tests", "helpers", "horovod_fp16_sum.py"),
                             str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["size"] == 2 and got["dtypes"] == ["float32", "float32"]  # float16 on the wire only
    # Each rank's 40000 fits float16; summed first (Horovod's own Average) they do not.
    assert got["horovod_average"][0] == [float("inf"), float("inf")]
    for ours, exact in zip(got["fp16"], got["float32"]):  # the average, to a few float16 roundings (2^-11 each)
        assert ours == pytest.approx(exact, rel=2 ** -9)
    assert got["float32"][0] == [40000.0, 39984.0]


# --- CPU threads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env, affinity, cores, cap", [
    ({}, 64, 64, None),  # no Slurm: the affinity mask
    ({"SLURM_CPUS_PER_TASK": "8"}, 64, 8, 8),  # an unbound task sees the node: its share is 8
    ({"SLURM_CPUS_PER_TASK": "8"}, 8, 8, None),  # --cpu-bind=cores already gave it 8
    ({"SLURM_CPUS_PER_TASK": "8"}, 4, 4, None),  # taskset narrower still
])
def test_input_threads_follow_slurm_cpus_per_task(env, affinity, cores, cap):
    assert devices.usable_cores(env, affinity) == cores
    assert devices.input_thread_cap(env, affinity) == cap


def test_tf_data_and_dali_size_their_threads_from_slurm_cpus_per_task(monkeypatch):
    from tfscale.data.input import pipeline

    monkeypatch.setattr(devices, "affinity_cores", lambda: 64)  # the whole node, as an unbound task sees it
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    options = pipeline.tf_data_options(tfs_config.base_config().data)
    assert (options.threading.private_threadpool_size, options.autotune.cpu_budget) == (6, 6)
    assert devices.usable_cores() == 6  # DALI's num_threads and the converter's processes
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    options = pipeline.tf_data_options(tfs_config.base_config().data)
    assert options.threading.private_threadpool_size is None  # TensorFlow's own sizing


# --- DALI's GPU decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dali_decode, num_gpus, local_replicas, device", [
    ("auto", 0, 1, "cpu"), ("auto", 1, 1, "mixed"), ("auto", 8, 8, "cpu"),
    ("cpu", 1, 1, "cpu"), ("mixed", 1, 1, "mixed"),
])
def test_dali_decodes_on_the_gpu_only_with_one_replica_per_process(dali_decode, num_gpus, local_replicas, device):
    dali = pytest.importorskip("tfscale.data.input.dali", reason="DALI is not installed: run `make dali`")
    assert dali.decode_device(dali_decode, num_gpus, local_replicas) == device


def test_dali_mixed_decoding_for_several_local_replicas_is_refused_by_name():
    dali = pytest.importorskip("tfscale.data.input.dali", reason="DALI is not installed: run `make dali`")
    with pytest.raises(ConfigError, match=r"dali_decode='mixed': this worker process feeds 8 replicas "
                                          r"\(config.distribute.backend='mirrored'\?\).*'mwms' or 'horovod'"):
        dali.decode_device("mixed", 8, 8)
    with pytest.raises(ConfigError, match="dali_decode='mixed' decodes on a GPU and this process sees none"):
        dali.decode_device("mixed", 0, 1)


# --- a Horovod build whose CUDA runtime the node's driver cannot run ---------------------------------------


def fake_horovod_build(tmp_path, cuda_runtime: str | None, node_driver: str | None):
    """(a stand-in for horovod.tensorflow, a /proc): a Horovod package with tools/install_horovod.sh's build record
    (none for a CPU build), and a node whose NVIDIA kernel module has `node_driver` (none: no driver)."""
    import types

    package = tmp_path / "site-packages" / "horovod"
    (package / "tensorflow").mkdir(parents=True)
    if cuda_runtime:
        (package / driver.BUILD_RECORD).write_text(json.dumps({"horovod": "0.28.1", "cuda_runtime": cuda_runtime}))
    proc = tmp_path / "proc"
    if node_driver:
        (proc / "driver" / "nvidia").mkdir(parents=True)
        (proc / "driver" / "nvidia" / "version").write_text(
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {node_driver}  Sat Aug 19 01:15:15 UTC 2023\n")
    return types.SimpleNamespace(__file__=str(package / "tensorflow" / "__init__.py")), str(proc)


def test_a_cuda_13_horovod_on_an_r535_node_is_refused_before_hvd_init_naming_both_versions(tmp_path):
    hvd, proc = fake_horovod_build(tmp_path, cuda_runtime="13.0", node_driver="535.104.05")
    with pytest.raises(ConfigError) as err:
        horovod_start.check_driver(hvd, proc)
    assert str(err.value).startswith("this Horovod 0.28.1 build runs on a CUDA 13.0 runtime, which needs an NVIDIA "
                                     "driver >= 580; this node's is 535.104.05: every rank would abort")
    assert "make horovod-gpu" in str(err.value)


@pytest.mark.parametrize("cuda_runtime, node_driver", [
    ("12.5.1", "535.104.05"),  # the clang route or a CUDA 12 nvcc: TensorFlow's runtime
    ("13.0", "580.65.06"),
    ("13.0", None),  # no driver on this node (a login node, this CI machine): nothing to compare
    (None, "535.104.05"),  # a CPU build records nothing
])
def test_builds_the_node_can_run_start(tmp_path, cuda_runtime, node_driver):
    hvd, proc = fake_horovod_build(tmp_path, cuda_runtime, node_driver)
    horovod_start.check_driver(hvd, proc)  # no error
