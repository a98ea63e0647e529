"""The user's path with a model of their own: a builder file outside the package (examples/my_model.py,
copied away), real digit scans converted to shards (the session's: conftest.digit_shards), 2 MWMS workers
through tfscale.launch + tfscale.train, tfscale.export, and serving in a fresh process that never imports tfscale."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, run_cli
from test_export import SERVE_SCRIPT, quiet_env

from tfscale.workdir import layout


@pytest.fixture(scope="module")
def own_model_export(digit_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    builder = root / "user_code" / "my_model.py"
    builder.parent.mkdir()
    shutil.copy(os.path.join(REPO, "examples", "my_model.py"), builder)
    # The session's digit scans (conftest's digit_shards: test_export's write_digit_jpegs and
    # convert_both_splits, into images/ and shards/ of one folder).
    shards_dir, counts = digit_shards
    images_dir, workdir = pathlib.Path(shards_dir).parent / "images", root / "train"
    assert sorted(os.listdir(images_dir)) == ["train", "validation"]
    launch = subprocess.run(
        [sys.executable, "-m", "tfscale.launch", "--num_workers=2", "--", "-m", "tfscale.train",
         "--config=configs/digits.py", f"--workdir={workdir}", f"--config.data.data_dir={shards_dir}",
         f"--config.model.name={builder}:build_model", "--config.distribute.backend=mwms",
         f"--config.data.num_train_examples={counts['train']}", f"--config.data.num_eval_examples={counts['validation']}",
         "--config.data.image_size=16", "--config.train.epochs=4", "--config.schedule.warmup_epochs=0.5",
         "--config.train.eval_every_epochs=4", "--config.checkpoint.every_epochs=4", "--config.train.log_every_steps=22"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=900,
    )
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    exported = run_cli("tfscale.export", f"--workdir={workdir}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    script = root / "serve.py"
    script.write_text(SERVE_SCRIPT)
    served = subprocess.run([sys.executable, str(script), str(workdir / "export"), str(images_dir / "validation")],
                            cwd=str(root), env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-3000:]
    with open(workdir / layout.SUMMARY) as f:
        summary = json.load(f)
    return {"summary": summary, "served": json.loads(served.stdout.strip().splitlines()[-1]),
            "log": launch.stdout + launch.stderr}


@pytest.mark.slow
def test_a_model_of_your_own_trains_exports_and_serves_its_eval_top1(own_model_export):
    served, summary = own_model_export["served"], own_model_export["summary"]
    assert summary["num_workers"] == 2
    assert served["num_images"] == 359
    assert served["num_correct"] / served["num_images"] == summary["eval_top1"]
    assert summary["eval_top1"] > 0.5  # 10 classes: chance is 0.1
    assert not served["tfscale_imported"]
    assert served["keras_layer_classes"] == ["keras"] and served["keras_max_abs_diff"] < 1e-5
    # The start-up line names the model's size, cost and what its gradients weigh.
    assert "model " in own_model_export["log"] and "MB of gradients a step" in own_model_export["log"]
