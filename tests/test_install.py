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
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _run([*pip, "-c", os.path.join(REPO, "requirements", "constraints-cpu.txt"), f"{REPO}[cpu]"], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(venv / "bin" / "python"), "-c", "import tfscale, os; print(os.path.dirname(tfscale.__file__))"],
                 cwd=elsewhere).stdout.strip()
    assert where.startswith(str(venv)) and os.path.isfile(os.path.join(where, "configs", "r50_32gpu.py"))

    _run([str(venv / "bin" / "tfscale-train"), "--config=smoke", "--workdir=run", "--config.train.epochs=1",
          "--config.train.eval_every_epochs=1"], cwd=elsewhere)
    with open(elsewhere / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 20 and summary["eval_top1"] > 0
    _run([str(venv / "bin" / "tfscale-export"), "--workdir=run"], cwd=elsewhere)
    assert (elsewhere / "run" / "export" / "model.keras").is_file()
