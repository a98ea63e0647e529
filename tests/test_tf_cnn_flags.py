"""tf_cnn_benchmarks' command lines run by tfscale-bench: the studies' own line translated flag by flag, flags
tfscale cannot honour refused by name, and the line run for real under tfscale's launcher and under mpirun."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from tfscale.perf import tf_cnn_flags
from tfscale.workdir import layout

# Seed 000's appendices: ResNet-50, 32 images per GPU, Horovod, real ImageNet, 200 batches, under mpirun -np 4.
SEED000 = ["--model", "resnet50", "--batch_size", "32", "--variable_update", "horovod", "--data_dir",
           "/data/imagenet", "--data_name", "imagenet", "--num_batches=200"]


def test_seed000s_command_line_becomes_tfscales_with_the_per_gpu_batch_times_the_world():
    assert tf_cnn_flags.is_tf_cnn_command(SEED000)
    assert tf_cnn_flags.translate(SEED000, {"OMPI_COMM_WORLD_SIZE": "4"}) == [
        "--config=r50_1gpu", "--workdir=runs/tf_cnn_benchmarks", "--config.model.name=resnet50",
        "--config.distribute.backend=horovod", "--config.data.global_batch_size=128",
        "--config.data.max_per_replica_batch_size=32", "--config.optim.momentum=0.9",
        "--config.benchmark.num_batches=200", "--config.data.data_dir=/data/imagenet", "--config.data.dataset=tfrecord",
        "--config.data.eval_split=train", "--config.benchmark.mode=train"]


def test_the_other_common_flags():
    args = tf_cnn_flags.translate(["--model=resnet101", "--batch_size=64", "--num_gpus=2",
                                   "--variable_update=replicated", "--use_fp16", "--xla_compile=True", "--data_format=NCHW", "--optimizer=sgd",
                                   "--num_warmup_batches=5", "--display_every=20", "--train_dir=/scratch/b"], {})
    assert args == ["--config=r50_1gpu", "--workdir=/scratch/b", "--config.model.name=resnet101",
                    "--config.distribute.backend=mirrored", "--config.data.global_batch_size=128",
                    "--config.data.max_per_replica_batch_size=64", "--config.optim.momentum=0.0",
                    "--config.benchmark.num_warmup_batches=5", "--config.benchmark.display_every=20",
                    "--config.data.dataset=synthetic", "--config.benchmark.mode=synthetic",
                    "--config.model.data_format=channels_first", "--config.precision=mixed_float16",
                    "--config.jit_compile=True"]
    # World size from the launcher that started the process: tfscale.launch's TF_CONFIG, Slurm's step.
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2", "c:3"]}, "task": {"type": "worker", "index": 0}})
    for env, workers in (({"TF_CONFIG": tf_config}, 3), ({"SLURM_STEP_NUM_TASKS": "8"}, 8), ({}, 1)):
        line = ["--model=resnet50", "--batch_size=16", "--variable_update=collective_all_reduce"]
        args = tf_cnn_flags.translate(line, env)
        assert f"--config.data.global_batch_size={16 * workers}" in args and "--config.distribute.backend=mwms" in args
    assert not tf_cnn_flags.is_tf_cnn_command(["--config=r50_1gpu", "--workdir=w", "--config.benchmark.num_batches=5"])
    # tfscale's own overrides after the line (tfscale.launch adds the backend's) pass through, last, so they win.
    line = ["--model=resnet50", "--batch_size=8", "--config.distribute.backend=mwms", "--config.data.image_size=64"]
    assert tf_cnn_flags.is_tf_cnn_command(line)
    assert tf_cnn_flags.translate(line, {})[-2:] == ["--config.distribute.backend=mwms", "--config.data.image_size=64"]


@pytest.mark.parametrize("argv, said", [
    (["--model=vgg16"], "--model=vgg16 is not one tfscale-bench runs (resnet50, resnet50_v1.5, resnet101, resnet152)"),
    (["--model=resnet50", "--variable_update=parameter_server"], "--variable_update=parameter_server is not one"),
    (["--model=resnet50", "--forward_only"], "--forward_only is a flag tfscale-bench does not run"),
    (["--model=resnet50", "--variable_update=horovod", "--num_gpus=4"],
     "--num_gpus=4 with --variable_update=horovod: one GPU per process"),
    (["--model=resnet50", "--data_dir=/d", "--data_name=cifar10"], "--data_name=cifar10: tfscale-bench reads"),
    (["--model=resnet50", "--batch_size"], "--batch_size needs a value"),
])
def test_a_flag_tfscale_cannot_honour_is_refused_by_name(argv, said):
    with pytest.raises(tf_cnn_flags.Refused, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        tf_cnn_flags.translate(argv, {})


def test_a_refused_line_ends_the_command_with_its_reason():
    result = subprocess.run([sys.executable, "-m", "tfscale.benchmark", "--model", "inception3", "--batch_size", "32"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("tfscale-bench: --model=inception3 is not one")


# The studies' line with the per-GPU batch and the batch count cut to what 2 CPU cores run in seconds.
SMALL = ["--model", "resnet50", "--batch_size", "1", "--variable_update", "horovod", "--num_batches=2",
         "--num_warmup_batches=1", "--display_every=1"]
TF_CNN_LINES = ("Step\tImg/sec\ttotal_loss", "Done warm up (1 steps", "total images/sec: ")


def assert_two_horovod_workers_ran(result, workdir, mode):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tf_cnn_benchmarks' command line runs as: tfscale-bench --config=r50_1gpu" in result.stderr
    for line in TF_CNN_LINES:
        assert line in result.stdout, result.stdout[-3000:]
    report = json.loads((workdir / layout.BENCHMARK).read_text())
    assert (report["backend"], report["num_workers"], report["global_batch_size"], report["mode"]) == \
        ("horovod", 2, 2, mode)  # --batch_size per GPU, as tf_cnn_benchmarks' = 1 x 2 ranks
    assert report["model"] == "resnet50" and report["config"]["data"]["image_size"] == 224


needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason="Horovod is not installed: run `make horovod`")


@pytest.mark.slow
@needs_horovod
def test_the_line_runs_under_tfscales_launcher_on_synthetic_data(tmp_path):
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--backend=horovod", "--", "-m",
               "tfscale.benchmark", *SMALL, f"--train_dir={tmp_path}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_two_horovod_workers_ran(result, tmp_path, "synthetic")


@pytest.mark.slow
@needs_horovod
def test_the_line_runs_under_mpirun_on_tfrecords(tmp_path):
    hvd = pytest.importorskip("horovod.tensorflow")
    if shutil.which("mpirun") is None or not hvd.mpi_built():
        pytest.skip("needs OpenMPI's mpirun and Horovod built with MPI: `make mpi`, then `make horovod`")
    tree, shards = tmp_path / "tree", tmp_path / "shards"
    subprocess.run([sys.executable, "tools/make_photo_tree.py", str(tree), "--classes", "2", "--per_class", "8"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/tfrecord_convert.py", f"--input_dir={tree}", f"--output_dir={shards}",
                    "--split=train", "--num_shards=2"], cwd=REPO, check=True, capture_output=True)
    workdir = tmp_path / "bench"
    command = [shutil.which("mpirun"), "--allow-run-as-root", "-np", "2", "--oversubscribe", "-bind-to", "none",
               sys.executable, "-m", "tfscale.benchmark", *SMALL, "--data_dir", str(shards), "--data_name", "imagenet",
               f"--train_dir={workdir}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_two_horovod_workers_ran(result, workdir, "train")
    assert json.loads((workdir / layout.BENCHMARK).read_text())["config"]["data"]["data_dir"] == str(shards)
