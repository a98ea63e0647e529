"""`pip install .` into a fresh environment, then the CLIs from another directory: what a cluster user does.

No checkout on the path, no editable install: the installed package must carry its recipes
(`--config=smoke` resolves to the bundled file) and its console scripts must work.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from tfscale.workdir import layout


def _run(argv, cwd, timeout_s=900):
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pip_install_into_a_fresh_venv_then_train_from_elsewhere(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    # --no-compile: pip byte-compiles every module it installs, TensorFlow's thousands included, one at a time
    # (~20 s of this test); Python compiles the ones the commands below import as they import them. What is
    # installed (files, metadata, console scripts) is the same.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run([*pip, "-c", os.path.join(REPO, "requirements", "constraints-cpu.txt"), f"{REPO}[cpu]"], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(venv / "bin" / "python"), "-c", "import tfscale, os; print(os.path.dirname(tfscale.__file__))"],
                 cwd=elsewhere).stdout.strip()
    assert where.startswith(str(venv)) and os.path.isfile(os.path.join(where, "configs", "r50_32gpu.py"))

    _run([str(venv / "bin" / "tfscale-train"), "--config=smoke", "--workdir=run", "--config.train.epochs=1",
          "--config.train.eval_every_epochs=1"], cwd=elsewhere)
    with open(elsewhere / "run" / layout.SUMMARY) as f:
        summary = json.load(f)
    assert summary["steps"] == 20 and summary["eval_top1"] > 0
    _run([str(venv / "bin" / "tfscale-export"), "--workdir=run"], cwd=elsewhere)
    assert (elsewhere / "run" / "export" / "model.keras").is_file()
    doctor = _run([str(venv / "bin" / "tfscale-doctor"), "--only=gpus,horovod"], cwd=elsewhere).stdout
    assert "N/A   horovod        Horovod is not installed (optional: `make horovod`" in doctor  # optional, named so
    assert doctor.strip().splitlines()[-1] == "summary: 0 pass, 0 fail, 2 n/a (gpus, horovod)"

    # The example-data tools need scikit-learn, which only the `examples` extra installs: one line naming it.
    requires = _run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; "
                     "print('\\n'.join(m.requires('tfscale')))"], cwd=elsewhere).stdout.splitlines()
    assert 'scikit-learn<2,>=1.4; extra == "examples"' in requires
    for tool, args in (("digits_demo.py", ["--workdir=demo"]), ("make_photo_tree.py", ["photos"])):
        result = subprocess.run([str(venv / "bin" / "python"), os.path.join(REPO, "tools", tool), *args], cwd=elsewhere,
                                capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
        assert result.returncode == 1
        assert result.stderr.strip() == (
            f'error: tools/{tool} needs scikit-learn (it ships the '
            f'{"digit scans" if tool == "digits_demo.py" else "two photographs"}): pip install ".[examples]" in the '
            "tfscale checkout (or pip install scikit-learn)"), result.stderr[-2000:]  # the whole output


def test_a_gpu_build_into_a_cpu_venv_is_refused_before_anything_is_installed(tmp_path):
    # tensorflow-cpu and tensorflow[and-cuda] share one package directory, and Horovod and the DALI plugin are
    # compiled against the TensorFlow present: switching a venv between them in place leaves it broken.
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu").touch()
    result = subprocess.run(["make", "-C", REPO, f"VENV={venv}", "TF_EXTRA=gpu", "venv"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert (f"{venv} holds the TensorFlow of TF_EXTRA=cpu; TF_EXTRA=gpu needs its own venv" in result.stderr)
    assert "VENV=.venv-gpu" in result.stderr
    assert sorted(os.listdir(venv)) == [".installed-cpu"]  # no python, nothing installed
