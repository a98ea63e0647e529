"""The input benchmark runs its three pipelines and reports what it prints."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from tfscale.data import convert


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    photos, shards = str(root / "photos"), str(root / "shards")
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "make_photo_tree.py"), photos, "--classes", "3", "--per_class", "12"],
        check=True, capture_output=True,
    )
    convert.convert(photos, shards, "train", 4, num_workers=1)
    return photos, shards


@pytest.mark.slow
def test_input_benchmark_prints_and_saves_three_rates(photo_shards, tmp_path):
    photos, shards = photo_shards
    result = run_cli(
        "tfscale.benchmark", "--config=configs/r50_1gpu.py", f"--workdir={tmp_path}",
        "--config.benchmark.mode=input", "--config.data.dataset=tfrecord", f"--config.data.data_dir={shards}",
        f"--config.benchmark.image_dir={photos}", "--config.data.global_batch_size=8",
        "--config.data.image_size=64", "--config.benchmark.num_batches=4", "--config.benchmark.num_warmup_batches=1",
        "--config.benchmark.rounds=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    printed = json.loads(lines[-1])  # the last line is the JSON summary
    assert set(printed) == {"tfscale_images_per_sec", "decode_only_images_per_sec", "keras_baseline_images_per_sec"}
    assert all(rate > 0 for rate in printed.values())
    with open(os.path.join(tmp_path, "benchmark.json")) as f:
        saved = json.load(f)
    for key, rate in printed.items():
        assert saved[key] == rate
        assert len(saved["rounds"][key.replace("_images_per_sec", "")]) == 2
    # the ratio lines agree with the figures
    ours = printed["tfscale_images_per_sec"]
    ratio_line = next(line for line in lines if "decode-only" in line)
    assert f"{ours / printed['decode_only_images_per_sec']:.2f}x" in ratio_line


def test_input_benchmark_needs_shards(tmp_path):
    result = run_cli("tfscale.benchmark", "--config=configs/r50_1gpu.py", f"--workdir={tmp_path}",
                     "--config.benchmark.mode=input")
    assert result.returncode != 0
    assert "dataset='tfrecord'" in result.stderr
