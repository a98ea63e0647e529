"""What a job prints: each message once, the chief's progress with an ETA, quiet non-chief workers,
no TensorFlow C++ banner. Real processes, default environment (no TF_CPP_MIN_LOG_LEVEL from the test).
"""

import collections
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from absl import logging
from conftest import REPO, without_tf_import_notices

from tfscale import logs
from tfscale.workdir import layout

# absl's Python header and the C++ runtime's: severity, date, time, thread/pid, then file:line] message.
LOG_HEADER = re.compile(r"^(?P<severity>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (?P<message>\S+:\d+\] .*)$")
BANNER = ("cpu_feature_guard", "oneDNN custom operations", "This TensorFlow binary is optimized")
ETA = re.compile(r"  eta \d+:\d\d:\d\d$")


def default_env(**extra):
    """This process's environment without the test suite's own TF_CPP_MIN_LOG_LEVEL: what a user has."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("TF_CONFIG", None)
    return env


def messages(lines):
    """The log records among `lines` as (severity, 'file:line] message'), timestamps stripped."""
    return [(m["severity"], m["message"]) for m in map(LOG_HEADER.match, lines) if m]


def assert_each_message_once(lines):
    """No message printed twice (two handlers), none in TensorFlow's own `INFO:tensorflow:` format."""
    assert not [line for line in lines if re.match(r"(INFO|WARNING|ERROR):tensorflow:", line)]
    repeated = [m for m, n in collections.Counter(messages(lines)).items() if n > 1]
    assert not repeated, repeated


def assert_no_banner(text):
    text = without_tf_import_notices(text)  # the one notice TensorFlow prints before reading its level
    assert not any(marker in text for marker in BANNER), text[:3000]
    assert not re.search(r"^(\[rank \d\] )?I0000 ", text, re.MULTILINE), "a C++ INFO line got through"


def test_format_duration():
    assert logs.format_duration(0) == "0:00:00"
    assert logs.format_duration(59.6) == "0:01:00"
    assert logs.format_duration(3723.2) == "1:02:03"
    assert logs.format_duration(100000) == "27:46:40"  # hours, not days: adds up on a clock


def test_banner_level_is_set_for_programs_only_and_never_over_the_users(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "-")  # recorded first, so the original comes back afterwards
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest"])
    logs.quiet_tensorflow_banner("tfscale.train")  # imported as a library: the environment stays as it is
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    monkeypatch.setattr(sys, "argv", ["/venv/bin/tfscale-train", "--config=x"])  # console script
    logs.quiet_tensorflow_banner("tfscale.train")
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"  # warnings and errors stay visible
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user asked for everything
    logs.quiet_tensorflow_banner("__main__")
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


@pytest.fixture
def absl_verbosity():
    previous = logging.get_verbosity()
    logging.set_verbosity(logging.INFO)
    yield
    logging.set_verbosity(previous)


def test_gate_workers(absl_verbosity):
    logs.gate_workers(is_chief=True)
    assert logging.get_verbosity() == logging.INFO
    logs.gate_workers(is_chief=False, log_all_ranks=True)
    assert logging.get_verbosity() == logging.INFO
    logs.gate_workers(is_chief=False)
    assert logging.get_verbosity() == logging.WARNING


# A CLI in miniature: the banner call before TensorFlow's import, configure() once absl parsed the flags.
# MirroredStrategy logs "Using MirroredStrategy with devices" through the `tensorflow` logger at INFO.
SCRIPT = textwrap.dedent(
    """
    from tfscale import logs
    logs.quiet_tensorflow_banner(__name__)
    import tensorflow as tf
    from absl import app, logging

    def main(argv):
        logs.configure()
        logging.info("one absl line")
        tf.get_logger().warning("one tensorflow warning")
        tf.distribute.MirroredStrategy()  # its INFO line is dropped at the default verbosity
        logging.set_verbosity(logging.DEBUG)  # what --verbosity=1 gives: TensorFlow's INFO lines back
        logs.configure()
        tf.distribute.MirroredStrategy()

    app.run(main)
    """
)


def test_one_handler_prints_each_message_once_without_the_banner():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=default_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert_each_message_once(lines)
    assert_no_banner(result.stderr)
    assert sum("one absl line" in line for line in lines) == 1
    assert sum("one tensorflow warning" in line for line in lines) == 1
    # Dropped once, shown once under debug verbosity, never twice.
    assert sum("Using MirroredStrategy with devices" in line for line in lines) == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_two_workers_chief_reports_others_stay_quiet(tmp_path):
    """`tfscale.launch` + MWMS as a user runs it: rank 1 prints its topology line and warnings only."""
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--threads_per_worker=1", "--",
               "-m", "tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}",
               "--config.distribute.backend=mwms", "--config.train.epochs=0.5",
               "--config.schedule.warmup_epochs=0.25", "--config.train.log_every_steps=5"]
    result = subprocess.run(command, cwd=REPO, env=default_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    by_rank = {rank: [line[len(f"[rank {rank}] "):] for line in lines if line.startswith(f"[rank {rank}] ")]
               for rank in (0, 1)}

    assert_no_banner(result.stderr)
    for rank, rank_lines in by_rank.items():
        assert_each_message_once(rank_lines)
        assert sum(f"tfscale worker rank={rank}/2" in line for line in rank_lines) == 1
    # Rank 1: the topology line is its only INFO record; anything else is a warning or an error.
    rank1_info = [message for severity, message in messages(by_rank[1]) if severity == "I"]
    assert len(rank1_info) == 1 and "tfscale worker rank=1/2" in rank1_info[0], by_rank[1]
    assert not any(line.startswith("INFO") for line in by_rank[1])
    # The chief: one step line per logged step, each with the time left.
    step_lines = [line for line in by_rank[0] if re.search(r"\] step \d+/10 ", line)]
    assert [re.search(r"step (\d+)/", line)[1] for line in step_lines] == ["5", "10"], by_rank[0]
    assert all(ETA.search(line) for line in step_lines), step_lines
    assert step_lines[-1].endswith("eta 0:00:00")
    with open(os.path.join(workdir, layout.METRICS)) as f:
        times = [json.loads(line)["time"] for line in f]
    assert times == sorted(times) and len(times) == 3  # steps 5 and 10, then the eval row
