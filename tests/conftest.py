"""Shared test set-up: quiet TensorFlow, repo paths, config loading as the CLI does it, workdir readers."""

import contextlib
import fcntl
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from tfscale.workdir import layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every process a test starts inherits this: tests/helpers/site/sitecustomize.py keeps Keras and TensorFlow from
# importing three optional libraries for parts tfscale never uses (~1.3 s of CPU of each process's start; its
# docstring says which and why).
_SITE = os.path.join(REPO, "tests", "helpers", "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)


# --- running beside another test (`make test` runs two pytest-xdist workers, a test file to each) -------------

def pytest_collection_modifyitems(config, items):
    """Files with the most `slow` (multi-process) tests first: the two workers take whole files in this
    order (--dist loadfile --no-loadscope-reorder), so the long files start early and the short ones even
    out the end."""
    slow_tests = {}
    for item in items:
        slow_tests.setdefault(item.path, 0)
        slow_tests[item.path] += item.get_closest_marker("slow") is not None
    order = {path: rank for rank, path in enumerate(sorted(slow_tests, key=lambda p: (-slow_tests[p], p.name)))}
    items.sort(key=lambda item: order[item.path])  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked `alone` runs (setup to teardown) with no test of the other worker
    beside it; every other test shares the machine. A readers-writer lock on two files: a test marked
    `alone` holds the turnstile while it waits, so the other worker cannot keep it out test after test."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:  # one process: nothing runs beside anything
        yield
        return
    prefix = os.path.join(tempfile.gettempdir(), f"tfscale-tests-{run_id}")
    with open(prefix + ".turnstile", "a") as turnstile, open(prefix + ".machine", "a") as machine:
        alone = item.get_closest_marker("alone") is not None
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(machine, fcntl.LOCK_EX)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        if not alone:
            fcntl.flock(machine, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


def load_config(name: str, *overrides: str):
    """configs/<name>.py[:variant] with `--config.x=y` overrides, parsed exactly as `tfscale.train` parses them."""
    name, colon, variant = name.partition(":")
    argv = ["prog", f"--config={os.path.join(REPO, 'configs', name + '.py')}{colon}{variant}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


# TensorFlow 2.21 logs its oneDNN notice (on CPUs where oneDNN is on by default: AVX-512 and newer)
# through absl before it reads TF_CPP_MIN_LOG_LEVEL, so no setting hides it (tensorflow#100442), and
# absl adds its own "before InitializeLog" line. tfscale's programs take both out of their import's stderr
# (logs.import_tensorflow_without_banner, tests/test_cli_help.py); tests of what tfscale prints look past them
# where a process imports TensorFlow by other ways (python -c scripts, helpers).
TF_IMPORT_NOTICES = ("All log messages before absl::InitializeLog() is called", "] oneDNN custom operations are on.")


def without_tf_import_notices(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not any(n in line for n in TF_IMPORT_NOTICES))


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


def classic_example(jpeg: bytes, height: int, width: int, label: int, synset: str, filename: str,
                    boxes: list[tuple[float, float, float, float]]) -> bytes:
    """The tf.train.Example of build_imagenet_data.py's _convert_to_example, feature for feature.

    For tests of shards written by the classic converters (no manifest, 1-based labels, bounding boxes).
    """
    import tensorflow as tf  # here: conftest itself must not import TensorFlow

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    def byte(value: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    xmin, ymin, xmax, ymax = (list(coords) for coords in zip(*boxes)) if boxes else ([], [], [], [])
    feature = {
        "image/height": ints([height]),
        "image/width": ints([width]),
        "image/colorspace": byte(b"RGB"),
        "image/channels": ints([3]),
        "image/class/label": ints([label]),
        "image/class/synset": byte(synset.encode()),
        "image/class/text": byte(f"text of {synset}".encode()),
        "image/object/bbox/xmin": floats(xmin),
        "image/object/bbox/xmax": floats(xmax),
        "image/object/bbox/ymin": floats(ymin),
        "image/object/bbox/ymax": floats(ymax),
        "image/object/bbox/label": ints([label] * len(boxes)),
        "image/format": byte(b"JPEG"),
        "image/filename": byte(filename.encode()),
        "image/encoded": byte(jpeg),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def read_jsonl(path):
    """The rows of a JSON-lines file (metrics.jsonl)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def checkpoint_values(workdir):
    """{variable key: value} of the latest checkpoint in a workdir (model, optimizer slots, step)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(workdir, layout.CHECKPOINTS))
    keys = [k for k in reader.get_variable_to_shape_map() if "OBJECT_GRAPH" not in k and "save_counter" not in k]
    return {k: reader.get_tensor(k) for k in keys}


def stop_at_step(step):
    """A Keras callback standing in for an interruption: ends the run after `step` global steps
    (at the end of that loop of steps)."""
    import keras

    class StopAtStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(logs["global_step"]) >= step:
                self.model.stop_training = True

    return StopAtStep()


def frozen_bn_model_and_optimizer(cfg, cluster):
    """The config's model (seeded) with every BatchNorm frozen, so a step does not depend on how the batch is
    split over replicas, and its optimizer; built in the cluster's strategy scope."""
    import keras

    from tfscale.training import engine

    keras.utils.set_random_seed(cfg.seed)
    with cluster.strategy.scope():
        model = engine.build_model(cfg)
        for layer in model.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
        return model, engine.build_optimizer(cfg, model)


def quiet_env(**extra):
    """The environment for a worker subprocess: quiet, one thread each, no inherited TF_CONFIG."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
           "TF_NUM_INTEROP_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


@contextlib.contextmanager
def small_file_system(mount_point, size: str):
    """A tmpfs of `size` (mount's syntax: 64k, 8m) at `mount_point`, to fill up; skips the test where it
    cannot be mounted (not root)."""
    import subprocess

    os.makedirs(mount_point, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                            capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture(scope="session")
def digit_shards(tmp_path_factory):
    """(shard dir, {split: count}): scikit-learn's real digit scans as JPEG shards, 2 train + 1 validation."""
    from test_export import convert_both_splits, write_digit_jpegs

    root = tmp_path_factory.mktemp("digits")
    counts = write_digit_jpegs(str(root / "images"))
    convert_both_splits(str(root / "images"), str(root / "shards"))
    return str(root / "shards"), counts
