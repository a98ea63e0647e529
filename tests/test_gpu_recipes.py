"""The ResNet-50 recipes' GPU variants (`configs/r50_*.py:xla`, `:amp`, `:amp_bf16`).

What is tested here is the configuration a GPU cluster gets and that the variant runs through
tfscale's real CLI; the GPU speed itself (Tensor Cores, XLA fusion, NCCL) cannot be measured on a
CPU-only machine (docs/gpu.md says what is tested where).
"""

import json
import math
import os

import pytest
from conftest import load_config, read_jsonl, run_cli

from tfscale import config as tfs_config
from tfscale.config import validation
from tfscale.training import step_choices
from tfscale.workdir import layout

RECIPES = ("r50_1gpu", "r50_8gpu", "r50_32gpu")


def flat(cfg) -> dict:
    """{'data.global_batch_size': 256, ...} for every key of the config."""
    def walk(prefix, node):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(name + ".", value)
            else:
                yield name, value

    return dict(walk("", cfg.to_dict()))


def changed(before: dict, after: dict) -> dict:
    return {key: after[key] for key in before if before[key] != after[key]}


@pytest.mark.parametrize("recipe", RECIPES)
def test_without_a_variant_the_recipe_stays_float32_with_xla_decided_by_the_devices(recipe):
    cfg = load_config(recipe)
    assert (cfg.precision, cfg.jit_compile) == ("float32", "auto")


GPU_REPLICA = ["/job:worker/replica:0/task:0/device:GPU:0"]
CPU_REPLICA = ["/job:worker/replica:0/task:0/device:CPU:0"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_default_gpu_run_is_float32_with_xla_and_one_message(recipe, tmp_path):
    # What `python -m tfscale.train --config=configs/<recipe>.py` runs on a GPU worker: the published float32
    # recipe, XLA-compiled (Keras 3's BatchNorm is fused only then), the gradients as one message after the
    # backward pass (no buckets: nothing leaves an XLA call before it ends).
    cfg = load_config(recipe, f"--config.data.data_dir={tmp_path}")
    step_choices.resolve_compilation(cfg, GPU_REPLICA)
    assert (cfg.precision, cfg.jit_compile, cfg.distribute.pack_bytes) == ("float32", True, 0)
    assert cfg.optim.compiled_update is True  # the update as one XLA call, not ~1,800 kernel launches
    validation.validate(cfg)
    assert validation.bucket_warning(cfg) is None
    on_cpu = load_config(recipe, f"--config.data.data_dir={tmp_path}")
    step_choices.resolve_compilation(on_cpu, CPU_REPLICA)
    assert on_cpu.jit_compile is False  # Keras' compile leaves XLA off on CPU-only machines too
    assert on_cpu.optim.compiled_update is False  # Keras' update, the faster one on CPU cores


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("variant, precision", sorted(tfs_config.GPU_VARIANTS.items()))
def test_a_variant_changes_how_steps_run_not_what_they_compute(recipe, variant, precision):
    float32, fast = flat(load_config(recipe)), flat(load_config(f"{recipe}:{variant}"))
    want = {"precision": precision, "jit_compile": True} if precision != "float32" else {"jit_compile": True}
    # channels_last and 100 steps per loop are set too, but they are already the defaults. The all-reduce
    # is not the variant's: AUTO becomes NCCL on every GPU worker (tests/test_gpu_decisions.py).
    assert fast["model.data_format"] == "channels_last" and fast["train.steps_per_loop"] == 100
    assert changed(float32, fast) == want  # batch, LR, schedule, epochs: untouched


@pytest.mark.parametrize("variant, want", [
    ("amp", {"jit_compile": True}),  # the recipe's own mixed_float16, XLA-compiled
    ("amp_bf16", {"precision": "mixed_bfloat16", "jit_compile": True}),
    ("xla", {"precision": "float32", "jit_compile": True}),
])
def test_the_lars_recipe_has_the_variants_too(variant, want):
    published, fast = flat(load_config("r50_lars_32k")), flat(load_config(f"r50_lars_32k:{variant}"))
    assert (published["precision"], published["jit_compile"]) == ("mixed_float16", "auto")
    assert changed(published, fast) == want  # LARS, batch 32k, schedule, epochs: untouched


def test_an_unknown_variant_is_one_line_naming_the_recipe_and_the_choices(tmp_path):
    result = run_cli("tfscale.train", "--config=configs/r50_8gpu.py:fp8", f"--workdir={tmp_path}")
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == ("FATAL config error: r50_8gpu:fp8 is not a variant of r50_8gpu: use one of xla, amp, amp_bf16, "
                         "or no ':variant' for the float32 recipe")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_amp_variant_trains_through_the_cli(tmp_path):
    # float16 + XLA run on CPU too (slowly): the user's command line, a tiny model and data.
    result = run_cli(
        "tfscale.train", "--config=configs/r50_1gpu.py:amp", f"--workdir={tmp_path}",
        "--config.model.name=cifar_resnet8", "--config.data.dataset=synthetic_learnable",
        "--config.data.image_size=32", "--config.data.num_classes=10", "--config.data.global_batch_size=16",
        "--config.data.num_train_examples=160", "--config.data.num_eval_examples=32", "--config.train.epochs=2",
        "--config.train.log_every_steps=5", "--config.schedule.warmup_epochs=0", "--config.schedule.decay_epochs=(1,)",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, layout.CONFIG)) as f:
        recorded = json.load(f)
    assert (recorded["precision"], recorded["jit_compile"]) == ("mixed_float16", True)
    losses = [row["loss"] for row in read_jsonl(os.path.join(tmp_path, layout.METRICS)) if "loss" in row]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    with open(os.path.join(tmp_path, layout.SUMMARY)) as f:
        assert json.load(f)["steps"] == 20
