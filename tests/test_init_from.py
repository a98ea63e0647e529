"""Starting from trained weights (config.model.init_from): fine-tuning, sources, errors, resume wins."""

import json
import os

import keras
import numpy as np
import pytest
from conftest import load_config

from tfscale import config as tfs_config
from tfscale import export
from tfscale.config import validation
from tfscale.training import engine, init_from, train
from tfscale.workdir import layout

SOURCE_CLASSES = 10
TARGET_CLASSES = 5
HEAD = ("logits/kernel", "logits/bias")
# The smoke recipe, shorter: 20 steps per epoch, evaluation on 96 examples.
SHORT = ("--config.schedule.warmup_epochs=0.25", "--config.data.num_eval_examples=96")


def weights_by_path(model) -> dict:
    return {w.path: w.numpy().copy() for w in model.weights}


class RecordWeights(keras.callbacks.Callback):
    """Model weights (and optimizer state) before the first step of a run and after its last."""

    def __init__(self, stop_at_step=None):
        super().__init__()
        self.stop_at_step = stop_at_step
        self.begin = self.end = None
        self.optimizer_iterations_at_begin = None
        self.optimizer_slots_at_begin = None

    def on_train_begin(self, logs=None):
        self.begin = weights_by_path(self.model)
        optimizer = self.model.optimizer
        self.optimizer_iterations_at_begin = int(optimizer.iterations.numpy())
        self.optimizer_slots_at_begin = [v.numpy() for v in optimizer.variables if "momentum" in v.path]

    def on_train_batch_end(self, batch, logs=None):
        if self.stop_at_step and int(logs["global_step"]) >= self.stop_at_step:
            self.model.stop_training = True  # stands in for an interruption

    def on_train_end(self, logs=None):
        self.end = weights_by_path(self.model)


def losses(workdir):
    with open(os.path.join(workdir, layout.METRICS)) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 10-class smoke run of 20 steps; its final weights by variable path."""
    workdir = str(tmp_path_factory.mktemp("source"))
    recorder = RecordWeights()
    train.train_and_evaluate(load_config("smoke", "--config.train.epochs=1", *SHORT), workdir,
                             extra_callbacks=[recorder])
    return workdir, recorder.end


def finetune_config(init_from_path, *overrides):
    return load_config(
        "smoke", f"--config.data.num_classes={TARGET_CLASSES}", f"--config.model.init_from={init_from_path}",
        "--config.model.init_skip_head=True", "--config.train.epochs=1.5", *SHORT, *overrides,
    )


@pytest.fixture(scope="module")
def finetune(source, tmp_path_factory):
    """Fine-tuning to 5 classes, interrupted at step 10, then rerun to the end (30 steps)."""
    workdir = str(tmp_path_factory.mktemp("finetune"))
    first, second = RecordWeights(stop_at_step=10), RecordWeights()
    train.train_and_evaluate(finetune_config(source[0]), workdir, extra_callbacks=[first])
    summary = train.train_and_evaluate(finetune_config(source[0]), workdir, extra_callbacks=[second])
    return workdir, first, second, summary


@pytest.mark.slow
def test_finetune_starts_from_the_source_backbone_exactly(source, finetune):
    _, source_weights = source
    begin = finetune[1].begin
    backbone = [path for path in begin if path not in HEAD]
    assert len(backbone) == len(source_weights) - len(HEAD) > 40  # every conv and BN variable of ResNet-8
    for path in backbone:
        np.testing.assert_array_equal(begin[path], source_weights[path], err_msg=path)


def test_finetune_head_is_new_and_has_the_new_shape(source, finetune):
    _, source_weights = source
    begin = finetune[1].begin
    assert source_weights["logits/kernel"].shape == (64, SOURCE_CLASSES)
    assert begin["logits/kernel"].shape == (64, TARGET_CLASSES) and begin["logits/bias"].shape == (TARGET_CLASSES,)
    # A fresh N(0, 0.01) kernel and zero bias, not a slice of the trained head.
    assert not np.allclose(begin["logits/kernel"], source_weights["logits/kernel"][:, :TARGET_CLASSES], atol=1e-3)
    assert 0.005 < begin["logits/kernel"].std() < 0.015
    np.testing.assert_array_equal(begin["logits/bias"], np.zeros(TARGET_CLASSES))


def test_finetune_optimizer_starts_fresh(finetune):
    first = finetune[1]
    assert first.optimizer_iterations_at_begin == 0
    assert first.optimizer_slots_at_begin and all(not slot.any() for slot in first.optimizer_slots_at_begin)


def test_resuming_wins_over_init_from(source, finetune):
    """The rerun continues from the workdir's step-10 checkpoint, not from the source weights."""
    _, first, second, summary = finetune
    assert summary["steps"] == 30
    for path, value in first.end.items():
        np.testing.assert_array_equal(second.begin[path], value, err_msg=path)
    assert not np.array_equal(second.begin["stem_conv/kernel"], source[1]["stem_conv/kernel"])


def test_finetune_learns_the_new_task(finetune):
    workdir, _, _, summary = finetune
    run_losses = losses(workdir)
    assert len(run_losses) == 3 and run_losses[-1] < 0.8 * run_losses[0], run_losses
    assert summary["eval_top1"] > 0.4  # 5 classes: chance is 0.2


def test_head_mismatch_without_skip_head_names_the_variable_and_both_shapes(source, tmp_path):
    cfg = finetune_config(source[0], "--config.model.init_skip_head=False")
    mismatch = r"variable logits/kernel has shape \(64, 10\) there but \(64, 5\) in the model"
    with pytest.raises(ValueError, match=mismatch):
        train.train_and_evaluate(cfg, str(tmp_path))
    assert not os.path.exists(tmp_path / layout.CHECKPOINTS / "checkpoint")  # failed before any training


def fresh_model(num_classes):
    keras.utils.set_random_seed(1)
    return engine.build_model(load_config("smoke", f"--config.data.num_classes={num_classes}"))


def assert_loaded_backbone(model, source_weights, head_loaded: bool):
    for path, value in weights_by_path(model).items():
        if path in HEAD and not head_loaded:
            assert value.shape[-1] == TARGET_CLASSES
            continue
        np.testing.assert_array_equal(value, source_weights[path], err_msg=path)


def test_keras_file_source_from_an_export(source, tmp_path):
    """The exported model.keras (plain Keras layers) as a starting point, to the same or fewer classes."""
    export.export(source[0], str(tmp_path / "export"))
    path = str(tmp_path / "export" / "model.keras")
    same = fresh_model(SOURCE_CLASSES)
    report = init_from.apply(load_config("smoke", f"--config.model.init_from={path}"), same, engine.build_model)
    assert_loaded_backbone(same, source[1], head_loaded=True)
    assert report.skipped == [] and len(report.loaded) == len(source[1])
    smaller = fresh_model(TARGET_CLASSES)
    report = init_from.apply(finetune_config(path), smaller, engine.build_model)
    assert_loaded_backbone(smaller, source[1], head_loaded=False)
    assert report.skipped == list(HEAD)


def test_a_keras_file_that_would_run_code_is_refused(tmp_path):
    """A .keras file can hold a Lambda layer: Python bytecode that runs when the model is loaded."""
    marker = tmp_path / "marker"
    inputs = keras.Input((4,))
    touch_marker = eval(f"lambda x: (__import__('pathlib').Path({str(marker)!r}).touch(), x)[1]")  # path in its code
    outputs = keras.layers.Lambda(touch_marker)(inputs)
    crafted = str(tmp_path / "model.keras")
    keras.Model(inputs, outputs).save(crafted)
    marker.unlink()  # building the model above ran the lambda once
    with pytest.raises(tfs_config.ConfigError, match=f"config.model.init_from='{crafted}': Keras cannot load it safely"):
        init_from.source_weights(crafted, engine.build_model)
    assert not marker.exists()
    keras.models.load_model(crafted, safe_mode=False)  # the premise: loading it unguarded runs its code
    assert marker.exists()


def test_weights_h5_source(source, tmp_path):
    restored = init_from.restore_run(source[0], engine.build_model).model
    path = str(tmp_path / "source.weights.h5")
    restored.save_weights(path)
    model = fresh_model(TARGET_CLASSES)
    init_from.apply(finetune_config(path), model, engine.build_model)
    assert_loaded_backbone(model, source[1], head_loaded=False)
    with pytest.raises(ValueError, match=r"logits/kernel has shape \(64, 10\) there but \(64, 5\)"):
        init_from.apply(finetune_config(path, "--config.model.init_skip_head=False"), fresh_model(TARGET_CLASSES),
                        engine.build_model)


def test_checkpoint_prefix_source(source, tmp_path):
    """A checkpoint inside a workdir: its own weights, not the latest ones."""
    prefixes = sorted(p[:-len(".index")] for p in os.listdir(os.path.join(source[0], layout.CHECKPOINTS))
                      if p.endswith(".index"))
    assert prefixes == ["ckpt-20"]
    model = fresh_model(TARGET_CLASSES)
    init_from.apply(finetune_config(os.path.join(source[0], layout.CHECKPOINTS, "ckpt-20")), model, engine.build_model)
    assert_loaded_backbone(model, source[1], head_loaded=False)


def test_other_architecture_fails_naming_a_variable(source):
    cfg = finetune_config(source[0], "--config.model.name=cifar_resnet20")
    model = engine.build_model(cfg)
    with pytest.raises(ValueError, match=r"does not fit config.model.name='cifar_resnet20': \d+ variables of the "
                                         r"model are not in it \(first: stage1_block2_conv1/kernel\)"):
        init_from.apply(cfg, model, engine.build_model)


def test_workdir_without_checkpoint_fails_naming_it(tmp_path):
    (tmp_path / layout.CONFIG).write_text(json.dumps(load_config("smoke").to_dict()))
    cfg = finetune_config(str(tmp_path))
    with pytest.raises(ValueError, match=f"no checkpoint in {tmp_path}/checkpoints"):
        init_from.apply(cfg, fresh_model(TARGET_CLASSES), engine.build_model)


def test_validate_rejects_a_missing_source(tmp_path):
    missing = str(tmp_path / "nothing_here.keras")
    with pytest.raises(ValueError, match=f"config.model.init_from='{missing}' does not exist"):
        validation.validate(load_config("smoke", f"--config.model.init_from={missing}"))


def test_export_and_init_from_read_the_newest_checkpoint_that_reads_back_whole(tmp_path):
    """As a resumed run does: a newest checkpoint cut short on the file system is skipped with a warning."""
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(load_config("smoke", "--config.train.epochs=1", "--config.checkpoint.every_epochs=0.5",
                                         *SHORT), workdir)
    newest = os.path.join(workdir, layout.CHECKPOINTS, "ckpt-20.data-00000-of-00001")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    restored = init_from.restore_run(workdir, engine.build_model)
    assert restored.step == 10 and restored.checkpoint.endswith("ckpt-10")
    info = export.export(workdir)
    assert info["step"] == 10 and info["checkpoint"].endswith("ckpt-10")
