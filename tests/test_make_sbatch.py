"""tools/make_sbatch.py and the slurm/ templates, without Slurm: #SBATCH lines, EDIT HERE values, bash
syntax, shellcheck, and the batch-size split check. Real submissions are in tests/test_slurm.py."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

SPEC = importlib.util.spec_from_file_location("make_sbatch", os.path.join(REPO, "tools", "make_sbatch.py"))
make_sbatch = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(make_sbatch)

TEMPLATES = sorted(make_sbatch.TEMPLATES.values())
R50_32GPU = os.path.join(REPO, "configs", "r50_32gpu.py")
# r50_32gpu on fewer than its 32 GPUs: the batch scaled to 128 images per GPU, as its docstring says.
R50_ON_4_GPUS = "--config.data.global_batch_size=512"
R50_ON_8_GPUS = "--config.data.global_batch_size=1024"


def fake_venv(root, wheel: str, cuda_build: bool) -> str:
    """A venv's files as make_sbatch reads them: TensorFlow's dist-info and build_info.py, nothing that runs."""
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "tensorflow" / "python" / "platform").mkdir(parents=True)
    (site / f"{wheel.replace('-', '_')}-2.21.0.dist-info").mkdir()
    (site / "tensorflow" / "python" / "platform" / "build_info.py").write_text(
        f"build_info = collections.OrderedDict([('is_cuda_build', {cuda_build}), ('is_rocm_build', False)])\n")
    return str(root)


@pytest.fixture(autouse=True)
def gpu_venv(tmp_path_factory, monkeypatch):
    """make_sbatch's default --venv is the Python running it, this CPU venv: GPU jobs get a GPU venv's files."""
    venv = fake_venv(tmp_path_factory.mktemp("venv-gpu"), "tensorflow", cuda_build=True)
    monkeypatch.setattr(make_sbatch, "DEFAULT_VENV", venv)
    return venv


def test_a_gpu_job_is_refused_a_venv_whose_tensorflow_has_no_cuda(tmp_path, capsys):
    args = [f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms", "--config.data.dataset=synthetic",
            f"--output={tmp_path / 'job.sbatch'}"]
    cpu_venv = fake_venv(tmp_path / "venv", "tensorflow-cpu", cuda_build=False)
    assert make_sbatch.main([*args, f"--venv={cpu_venv}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"make_sbatch: --venv={cpu_venv} has tensorflow-cpu, a TensorFlow without CUDA: the job's "
                          "4 GPUs per node would sit idle")
    assert "--venv=.venv-gpu" in err and not (tmp_path / "job.sbatch").exists()
    # The Python running make_sbatch, when it is a CPU venv (after `make demo`), is named as the default.
    make_sbatch.DEFAULT_VENV = cpu_venv
    assert make_sbatch.main(args) == 2
    assert "(the default: the Python running make_sbatch) has tensorflow-cpu" in capsys.readouterr().err
    # The same venv is right for CPU-only nodes; a GPU venv passes and is named in the summary.
    assert make_sbatch.main([*args[:2], "--gpus_per_node=0", "--tasks_per_node=4", *args[3:]]) == 0
    gpu_venv = fake_venv(tmp_path / "venv-gpu", "tensorflow", cuda_build=True)
    assert make_sbatch.main([*args, f"--venv={gpu_venv}"]) == 0
    assert f"--venv={gpu_venv}: tensorflow with CUDA" in capsys.readouterr().out
    # This machine's own venv, read the same way: tensorflow-cpu, no CUDA.
    assert make_sbatch.venv_tensorflow(sys.prefix) == ("tensorflow-cpu", False)
    # A venv that is not on this machine (or takes TensorFlow from a module) cannot be read: said, not refused.
    assert make_sbatch.main([*args, "--venv=/cluster/envs/tf"]) == 0
    assert "--venv=/cluster/envs/tf: no TensorFlow in its site-packages here, not checked" in capsys.readouterr().out


@pytest.fixture
def shards(tmp_path):
    """A directory for --data_dir (make_sbatch checks that it exists; it reads no file in it)."""
    path = tmp_path / "shared" / "imagenet"
    path.mkdir(parents=True)
    return str(path)


def generate(tmp_path, *args, name="job.sbatch"):
    """Runs the tool's main as the CLI would; returns the script text."""
    path = tmp_path / name
    code = make_sbatch.main([f"--output={path}", *args])
    assert code == 0
    return path.read_text()


def sbatch_lines(text):
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def edit_block_values(script_path, *names):
    """Runs the script's EDIT HERE block in bash (HOME and TMPDIR fixed) and returns the variables' values."""
    text = open(script_path).read()
    block = text[text.index("# ===") : text.index("set -euo pipefail")]
    printer = "\n".join(f'printf "%s\\0" "{name}=${{{name}[*]}}"' for name in names)
    result = subprocess.run(["bash", "-c", block + printer], capture_output=True, text=True, check=True,
                            env={"HOME": "/home/u", "TMPDIR": "/local/tmp", "PATH": os.environ["PATH"]})
    return dict(item.split("=", 1) for item in result.stdout.split("\0") if item)


def assert_shellcheck_clean(path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_templates_are_valid_bash_and_shellcheck_clean(template):
    assert subprocess.run(["bash", "-n", template]).returncode == 0
    assert_shellcheck_clean(template)


def test_templates_share_one_common_block():
    """The SIGTERM/requeue/staging code is duplicated so each script stands alone; it must not drift."""
    blocks = []
    for template in TEMPLATES:
        text = open(template).read()
        blocks.append(text[text.index("# --- common:") : text.index("# --- end common")])
    assert blocks[0] == blocks[1]
    for needle in ("trap on_term TERM", "scontrol requeue", "SLURM_RESTART_COUNT", "tools/stage_data.py"):
        assert needle in blocks[0]


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_templates_have_preemption_header(template):
    lines = sbatch_lines(open(template).read())
    assert "#SBATCH --requeue" in lines
    assert any(re.fullmatch(r"#SBATCH --signal=B:TERM@\d+", line) for line in lines)
    assert any(line.startswith("#SBATCH --output=") and "%j" in line for line in lines)


def test_one_node_four_gpus(tmp_path, shards):
    text = generate(tmp_path, f"--config={R50_32GPU}", "--nodes=1", "--gpus_per_node=4", "--backend=mwms",
                    f"--data_dir={shards}", R50_ON_4_GPUS)
    lines = sbatch_lines(text)
    for expected in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                     "#SBATCH --cpus-per-task=8", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@300"):
        assert expected in lines
    # No partition/account given: the placeholders stay commented out (sbatch ignores ##SBATCH).
    assert not any("--partition" in line or "--account" in line for line in lines)
    assert "##SBATCH --partition=PARTITION" in text
    assert re.search(r"^# export CUDA_VISIBLE_DEVICES=-1 ", text, re.M)  # a GPU job keeps its GPUs
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert_shellcheck_clean(tmp_path / "job.sbatch")


def test_eight_nodes_four_gpus_for_the_32_gpu_recipe(tmp_path, capsys, shards):
    text = generate(tmp_path, f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=horovod",
                    "--partition=gpu", "--account=proj42", "--time=12:00:00", "--signal_lead_s=600",
                    "--workdir=/shared/runs/r50", f"--data_dir={shards}", "--stage_dir=$TMPDIR/in net",
                    "--config.optim.lr_per_256=0.1", "--config.train.epochs=90.5")
    lines = sbatch_lines(text)
    for expected in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --time=12:00:00",
                     "#SBATCH --signal=B:TERM@600", "#SBATCH --job-name=tfscale-r50_32gpu-horovod"):
        assert expected in lines
    printed = capsys.readouterr().out
    assert "8 nodes x 4 GPUs = 32 replicas, 128 images per replica per step (global batch 4096)" in printed
    assert f"submit with: sbatch {tmp_path / 'job.sbatch'}" in printed
    values = edit_block_values(tmp_path / "job.sbatch", "CONFIG", "CONFIG_OVERRIDES", "WORKDIR", "DATA_DIR",
                               "STAGE_DIR", "LAUNCHER", "VENV")
    assert values == {
        "CONFIG": R50_32GPU, "CONFIG_OVERRIDES": "--config.optim.lr_per_256=0.1 --config.train.epochs=90.5",
        "WORKDIR": "/shared/runs/r50", "DATA_DIR": shards,
        "STAGE_DIR": "/local/tmp/in net",  # $TMPDIR expands on the node; the space survives quoting
        "LAUNCHER": "srun-pmix", "VENV": make_sbatch.DEFAULT_VENV,
    }
    assert_shellcheck_clean(tmp_path / "job.sbatch")


def test_doctor_runs_first_when_asked(tmp_path, shards):
    generate(tmp_path, f"--config={R50_32GPU}", "--nodes=2", "--gpus_per_node=4", "--backend=mwms",
             f"--data_dir={shards}", R50_ON_8_GPUS, "--doctor=gpus,horovod")
    assert edit_block_values(tmp_path / "job.sbatch", "DOCTOR") == {"DOCTOR": "gpus,horovod"}
    generate(tmp_path, f"--config={R50_32GPU}", "--nodes=2", "--gpus_per_node=4", "--backend=mwms",
             f"--data_dir={shards}", R50_ON_8_GPUS)
    assert edit_block_values(tmp_path / "job.sbatch", "DOCTOR") == {"DOCTOR": ""}  # off unless asked for
    code = make_sbatch.main([f"--output={tmp_path / 'x.sbatch'}", f"--config={R50_32GPU}", "--nodes=2",
                             "--gpus_per_node=4", "--backend=mwms", f"--data_dir={shards}", R50_ON_8_GPUS,
                             "--doctor=gpus,nvlink"])
    assert code == 2 and not (tmp_path / "x.sbatch").exists()


def test_writing_a_script_does_not_import_tensorflow(tmp_path):
    """make_sbatch runs before every job (and the Slurm tests call it for each one): it validates the config
    and the doctor's check names without TensorFlow's ~3 s import."""
    script = (
        "import runpy, sys\n"
        f"sys.argv = ['make_sbatch.py', '--config=configs/smoke.py', '--nodes=1', '--gpus_per_node=0', "
        f"'--tasks_per_node=2', '--backend=mwms', '--doctor=gpus,all-reduce', '--output={tmp_path / 'job.sbatch'}']\n"
        f"try:\n    runpy.run_path({os.path.join(REPO, 'tools', 'make_sbatch.py')!r}, run_name='__main__')\n"
        "except SystemExit as end:\n    assert end.code == 0, end.code\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras'})\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job.sbatch").exists()


def test_cpu_only_tasks_drop_gpu_lines(tmp_path):
    text = generate(tmp_path, "--config=" + os.path.join(REPO, "configs", "smoke.py"), "--nodes=1",
                    "--gpus_per_node=0", "--tasks_per_node=2", "--backend=mwms")
    lines = sbatch_lines(text)
    assert "#SBATCH --ntasks-per-node=2" in lines and "#SBATCH --cpus-per-task=1" in lines
    assert not [line for line in lines if "gpu" in line.split("=")[0]]
    # A CPU job hides the GPUs of a GPU partition's node, so that a GPU venv trains on the CPU as asked.
    assert re.search(r"^export CUDA_VISIBLE_DEVICES=-1 ", text, re.M)
    assert_shellcheck_clean(tmp_path / "job.sbatch")


def test_gpus_per_task_request(tmp_path, shards):
    lines = sbatch_lines(generate(tmp_path, f"--config={R50_32GPU}", "--nodes=2", "--gpus_per_node=4",
                                  "--backend=mwms", "--gpu_request=per_task", f"--data_dir={shards}", R50_ON_8_GPUS))
    assert "#SBATCH --gpus-per-task=1" in lines
    assert not any(line.startswith("#SBATCH --gpus-per-node") for line in lines)


def test_values_with_quotes_and_dollars_are_quoted_for_bash(tmp_path, shards):
    # benchmark.image_dir: a free-text key that training ignores and validate accepts as it is.
    generate(tmp_path, f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
             f"--data_dir={shards}", '--modules=cuda/12 "x" `y`', "--config.benchmark.image_dir=it's")
    values = edit_block_values(tmp_path / "job.sbatch", "MODULES", "CONFIG_OVERRIDES")
    assert values == {"MODULES": 'cuda/12 "x" `y`', "CONFIG_OVERRIDES": "--config.benchmark.image_dir=it's"}


def test_split_that_does_not_divide_the_batch_fails_naming_key_and_value(tmp_path, capsys, shards):
    # 3 nodes x 4 GPUs = 12 replicas; 4096 = 12 * 341 + 4.
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=3", "--gpus_per_node=4", "--backend=mwms",
                             f"--data_dir={shards}", f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2
    error = capsys.readouterr().err
    assert ("3 nodes x 4 tasks = 12 replicas: config.data.global_batch_size=4096 cannot be split evenly over "
            "12 replicas (nearest valid sizes: 4092 or 4104)") in error
    assert not (tmp_path / "job.sbatch").exists()


def test_override_is_validated_with_the_split(tmp_path, capsys, shards):
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
                             f"--data_dir={shards}", "--config.data.global_batch_size=1000",
                             f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2
    assert "config.data.global_batch_size=1000 cannot be split evenly over 32 replicas (nearest valid sizes: 992 or 1024)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--config.optim.lrr=1"], "lrr"),
    (["--config.distribute.backend=horovod"], "the backend is chosen with --backend"),
    (["--tasks_per_node=2"], "--tasks_per_node=2 with --gpus_per_node=4"),
])
def test_bad_requests_name_the_option(tmp_path, capsys, args, message):
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
                             f"--output={tmp_path / 'job.sbatch'}", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cpu_only_needs_tasks_per_node(tmp_path, capsys):
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=1", "--gpus_per_node=0", "--backend=mwms",
                             f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2
    assert "--gpus_per_node=0 (CPU-only) needs --tasks_per_node" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ data


def training_command(script_path, env, python="python", select_run="") -> list[str]:
    """The python arguments of every training task: the script's EDIT HERE block and common functions run
    in bash (`select_run`, e.g. select_study_run, then stage_data with a stand-in srun that copies
    nothing), then `train_args mwms`."""
    text = open(script_path).read()
    edit_block = text[text.index("# ===") : text.index("set -euo pipefail")]
    common = text[text.index("# --- common:") : text.index("# --- end common")]
    out = os.path.join(os.path.dirname(script_path), "train_args")
    # The stand-in srun prints the staged directory, for a script that reads it from stage_data.py's stdout.
    stand_in = 'srun() { local a; for a in "$@"; do case $a in --dest_dir=*) echo "${a#--dest_dir=}" ;; esac; done; }\n'
    run = (f'PYTHON={python}\n{select_run}\nstage_data > /dev/null\ntrain_args mwms\n'
           f'printf "%s\\0" "${{TRAIN_ARGS[@]}}" > {out}\n')
    subprocess.run(["bash", "-c", edit_block + common + stand_in + run], check=True, capture_output=True, text=True,
                   env={"PATH": os.environ["PATH"], **env})
    return open(out).read().split("\0")[:-1]


def config_as_train_loads_it(train_args: list[str]) -> dict:
    """`python -m tfscale.train ARGS`'s config: the same CLI parsing (tfscale.cli.run_cli), then printed
    instead of trained (and not validated: the staged directory exists only on the nodes)."""
    assert train_args[:2] == ["-m", "tfscale.train"]
    load = "import json; from tfscale import cli; cli.run_cli(lambda c, w: print(json.dumps(c.to_dict())), '')"
    result = subprocess.run([sys.executable, "-c", load, *train_args[2:]], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_32_gpu_recipe_trains_on_the_tfrecords_staged_on_each_node(tmp_path, shards):
    """What the 8 x 4 GPU job's tasks run: the recipe's own dataset (TFRecords), read from the node-local copy."""
    generate(tmp_path, f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
             f"--data_dir={shards}")
    env = {"HOME": "/home/u", "TMPDIR": "/local/tmp", "SLURM_NNODES": "8", "SLURM_NTASKS": "32",
           "SLURM_NTASKS_PER_NODE": "4"}
    stage_dir = edit_block_values(tmp_path / "job.sbatch", "STAGE_DIR")["STAGE_DIR"]
    assert stage_dir == "/local/tmp/tfscale_data"  # the default --stage_dir, expanded on the node
    train_args = training_command(tmp_path / "job.sbatch", env)
    assert f"--config={R50_32GPU}" in train_args
    config = config_as_train_loads_it(train_args)
    assert config["data"]["dataset"] == "tfrecord"
    assert config["data"]["data_dir"] == stage_dir
    assert config["data"]["stage_dir"] == ""  # staged by the script, not again by every task
    assert config["distribute"]["backend"] == "mwms" and config["data"]["global_batch_size"] == 4096


def test_tfrecord_recipe_without_data_dir_says_to_pass_it(tmp_path, capsys):
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
                             f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2
    assert (f"make_sbatch: {R50_32GPU} trains on config.data.dataset='tfrecord', which needs its files: "
            "pass --data_dir=DIR") in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("args, message", [
    (["--data_dir={shards}/missing"], "--data_dir={shards}/missing is not a directory here"),
    (["--data_dir={shards}", "--config.data.data_dir=/x"],
     "--data_dir and --config.data.data_dir=/x are both given"),
    (["--data_dir={shards}", "--config.data.stage_dir=/local"],
     "--config.data.stage_dir=/local: the job script stages the data itself; use --stage_dir"),
])
def test_bad_data_requests_name_the_option(tmp_path, capsys, shards, args, message):
    code = make_sbatch.main([f"--config={R50_32GPU}", "--nodes=8", "--gpus_per_node=4", "--backend=mwms",
                             f"--output={tmp_path / 'job.sbatch'}", *(a.format(shards=shards) for a in args)])
    assert code == 2
    assert message.format(shards=shards) in capsys.readouterr().err


def test_data_dir_for_a_synthetic_config_is_refused(tmp_path, capsys, shards):
    """configs/smoke.py reads no files: a --data_dir would be staged and then ignored."""
    code = make_sbatch.main([f"--config={os.path.join(REPO, 'configs', 'smoke.py')}", "--nodes=1",
                             "--gpus_per_node=0", "--tasks_per_node=2", "--backend=mwms", f"--data_dir={shards}",
                             f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2
    assert f"config.data.data_dir={shards!r} is set but config.data.dataset='synthetic_learnable'" \
        in capsys.readouterr().err


def test_template_drift_is_an_error():
    with pytest.raises(make_sbatch.UsageError, match="no WORKDIR in its EDIT HERE block"):
        make_sbatch.render_edit_block(["# ===== EDIT HERE =====", 'CONFIG=""', "# ====="],
                                      {"CONFIG": '"x"', "WORKDIR": '"y"'})


def test_gpu_variant_gets_its_own_job_name_and_workdir(tmp_path, shards):
    # An AMP job next to the float32 one must not resume from the float32 run's checkpoints.
    common = ["--nodes=1", "--gpus_per_node=4", "--backend=mwms", f"--data_dir={shards}", R50_ON_4_GPUS]
    plain = generate(tmp_path, f"--config={R50_32GPU}", *common, name="plain.sbatch")
    amp = generate(tmp_path, f"--config={R50_32GPU}:amp", *common, name="amp.sbatch")
    assert "#SBATCH --job-name=tfscale-r50_32gpu-mwms" in sbatch_lines(plain)
    assert "#SBATCH --job-name=tfscale-r50_32gpu_amp-mwms" in sbatch_lines(amp)
    workdirs = [edit_block_values(tmp_path / name, "WORKDIR")["WORKDIR"] for name in ("plain.sbatch", "amp.sbatch")]
    assert [os.path.basename(w) for w in workdirs] == ["r50_32gpu", "r50_32gpu_amp"]


# ---------------------------------------------------------------------------------------- studies

STUDY = """
def get_study():
    return {"config": "configs/smoke.py", "overrides": ["--config.train.epochs=1"],
            "cells": {"b32": ["--config.data.global_batch_size=32"], "b64": ["--config.data.global_batch_size=64"],
                      "b90": ["--config.data.global_batch_size=90"]},
            "seeds": [0, 1], "baseline": "b32"}
"""


@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_a_study_becomes_a_job_array_of_its_runs(tmp_path, backend, capsys):
    study = tmp_path / "batch_study.py"
    study.write_text(STUDY)
    text = generate(tmp_path, f"--study={study}", "--nodes=1", "--gpus_per_node=0", "--tasks_per_node=2",
                    f"--backend={backend}", "--array_parallel=2", f"--workdir={tmp_path / 'w'}")
    assert "a job array of 6 runs (3 cells x 2 seeds)" in capsys.readouterr().out
    lines = sbatch_lines(text)
    assert "#SBATCH --array=0-5%2" in lines and f"#SBATCH --job-name=tfscale-study_batch_study-{backend}" in lines
    assert "#SBATCH --output=tfscale-%x-%A_%a.out" in lines  # one log per array task
    values = edit_block_values(tmp_path / "job.sbatch", "STUDY", "WORKDIR", "CONFIG")
    assert values == {"STUDY": str(study), "WORKDIR": str(tmp_path / "w"), "CONFIG": os.path.join(REPO, "configs/smoke.py")}
    assert_shellcheck_clean(tmp_path / "job.sbatch")


def test_every_cell_of_a_study_is_validated_and_a_bad_one_named(tmp_path, capsys):
    study = tmp_path / "batch_study.py"
    study.write_text(STUDY)
    # 4 replicas split 32 and 64, not 90.
    code = make_sbatch.main([f"--study={study}", "--nodes=2", "--gpus_per_node=0", "--tasks_per_node=2",
                             "--backend=mwms", f"--output={tmp_path / 'job.sbatch'}"])
    assert code == 2 and not (tmp_path / "job.sbatch").exists()
    err = capsys.readouterr().err
    assert f"make_sbatch: study {study}, cell b90: 2 nodes x 2 tasks = 4 replicas:" in err and "90" in err
    assert make_sbatch.main([f"--study={study}", f"--config={R50_32GPU}", "--nodes=1", "--gpus_per_node=4",
                             "--backend=mwms"]) == 2
    assert "give either --config (one run) or --study" in capsys.readouterr().err


def test_a_study_whose_cells_need_different_worker_counts_is_refused_naming_them(tmp_path, capsys):
    study = tmp_path / "workers_study.py"
    study.write_text(STUDY.replace('"b90": ["--config.data.global_batch_size=90"]',
                                   '"b96": {"overrides": ["--config.data.global_batch_size=96"], "num_workers": 4}'))
    assert make_sbatch.main([f"--study={study}", "--nodes=1", "--gpus_per_node=0", "--tasks_per_node=2",
                             "--backend=mwms", f"--output={tmp_path / 'job.sbatch'}"]) == 2
    assert not (tmp_path / "job.sbatch").exists()
    err = capsys.readouterr().err
    assert "different worker counts (b32: 1, b64: 1, b96: 4)" in err and "one job array per worker count" in err


@pytest.mark.parametrize("study, nodes, runs", [("lr_scaling_fmnist.py", 8, "30 runs (6 cells x 5 seeds)"),
                                                ("assignment_households_fmnist.py", 4, "80 runs (16 cells x 5 seeds)")])
def test_the_committed_studies_thesis_versions_are_job_arrays_at_the_theses_gpu_counts(tmp_path, capsys, study,
                                                                                       nodes, runs):
    """32 GPUs for the LR-scaling thesis, 16 workers for the data-assignment one: every cell validates there."""
    text = generate(tmp_path, f"--study={os.path.join(REPO, 'studies', study)}:thesis", f"--nodes={nodes}",
                    "--gpus_per_node=4", "--backend=mwms", f"--config.data.data_dir={REPO}")
    assert f"a job array of {runs}" in capsys.readouterr().out
    stem = study.removesuffix(".py")
    assert f"#SBATCH --job-name=tfscale-study_{stem}_thesis-mwms" in sbatch_lines(text)


def test_an_array_task_trains_its_run_with_the_jobs_own_overrides_last(tmp_path):
    study = tmp_path / "batch_study.py"
    study.write_text(STUDY)
    generate(tmp_path, f"--study={study}", "--nodes=1", "--gpus_per_node=0", "--tasks_per_node=2", "--backend=mwms",
             f"--workdir={tmp_path / 'w'}", "--config.train.epochs=2")
    # Task 3: the second cell (b64), second seed (1).
    train_args = training_command(tmp_path / "job.sbatch", {"SLURM_ARRAY_TASK_ID": "3"}, python=sys.executable,
                                  select_run="select_study_run")
    assert train_args[2:4] == ["--config=configs/smoke.py", f"--workdir={tmp_path / 'w' / 'runs' / 'b64' / 'seed1'}"]
    config = config_as_train_loads_it(train_args)
    assert (config["seed"], config["data"]["global_batch_size"]) == (1, 64)
    assert config["train"]["epochs"] == 2  # the job's override, given after the study file's epochs=1
    assert make_sbatch.main([f"--study={study}", "--nodes=1", "--gpus_per_node=0", "--tasks_per_node=2",
                             "--backend=mwms", "--config.seed=5", f"--output={tmp_path / 'x.sbatch'}"]) == 2
