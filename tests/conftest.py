"""Shared test set-up: quiet TensorFlow, repo paths, config loading as the CLI does it."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, *overrides: str):
    """configs/<name>.py with `--config.x=y` overrides, parsed exactly as `tfscale.train` parses them."""
    argv = ["prog", f"--config={os.path.join(REPO, 'configs', name + '.py')}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def run_cli(module: str, *args: str, timeout_s: float = 600, cwd: str = REPO):
    """Runs `python -m module args...` as a user would; returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


@pytest.fixture
def repo():
    return REPO
