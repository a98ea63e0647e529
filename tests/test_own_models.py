"""Models tfscale did not define: keras.applications by name and the user's own builder (tfscale.model.build).

What they take and return, which variables get weight decay, how tfscale's BatchNorm keys reach their
layers, their size in the start-up line and the planner, init_from their own weight files, and every
refusal through the real `tfscale.train` command line: one line, exit code 1, no traceback.
"""

import json
import os
import textwrap

import keras
import numpy as np
import pytest
from conftest import REPO, load_config, quiet_env
from helpers.cli_batch import run_batch

from tfscale.config import validation
from tfscale.errors import ConfigError
from tfscale.model import build, models, optim, stats
from tfscale.training import engine, init_from

SMALL = ("--config.data.image_size=32", "--config.data.num_classes=10")
BUILDER = '''
import keras


def build_model(num_classes, input_shape, width=8):
    """A small functional CNN: uint8 images in, normalised inside, num_classes logits out."""
    images = keras.Input(shape=input_shape, dtype="uint8", name="images")
    x = keras.layers.Rescaling(1 / 127.5, offset=-1.0)(images)
    x = keras.layers.Conv2D(width, 3, use_bias=False, name="conv")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(num_classes, dtype="float32", name="logits")(x), name="tiny")
'''


def app_config(name, *overrides):
    return load_config("smoke", f"--config.model.name=keras.applications.{name}", *SMALL, *overrides)


@pytest.fixture(scope="module")
def builder_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_models.py"
    path.write_text(BUILDER)
    return path


def test_every_keras_image_classifier_is_a_model_name():
    names = build.application_names()
    assert {"EfficientNetV2B0", "ConvNeXtTiny", "MobileNetV3Small", "DenseNet121", "ResNet50", "Xception"} <= set(names)
    assert len(names) == 40  # Keras 3.15's image classifiers
    for name in ("keras.applications.EfficientNetV2B0", "my_package.models:build", "models.py:build", "resnet50"):
        load_config("smoke", f"--config.model.name={name}")  # passes validation
    with pytest.raises(ConfigError, match="keras.applications.<Name>, package.module:function"):
        validation.validate(load_config("smoke", "--config.model.name=efficientnet"))


@pytest.mark.parametrize("name, normalisation, own_preprocessing", [
    ("EfficientNetV2B0", "normalize", False),  # include_preprocessing switched off, tfscale normalises
    ("EfficientNetB0", "to_float", True),  # always preprocesses itself: 0-255 values in
    ("DenseNet121", "normalize", False),  # no preprocessing of its own
])
def test_an_application_takes_tfscales_images_and_returns_float32_logits(name, normalisation, own_preprocessing):
    cfg = app_config(name, "--config.precision=mixed_bfloat16")
    with engine.precision_policy(cfg.precision):
        model = build.create_from_config(cfg)
    assert model.inputs[0].dtype == "uint8" and tuple(model.inputs[0].shape) == (None, 32, 32, 3)
    assert tuple(model.outputs[0].shape) == (None, 10) and model.outputs[0].dtype == "float32"
    assert model.layers[-1].name == "logits" and model.get_layer(normalisation)
    rescaling = [layer for layer in model.layers if isinstance(layer, keras.layers.Rescaling)]
    assert bool(rescaling) == own_preprocessing
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    assert np.all(np.isfinite(model(images, training=False).numpy()))


def test_weight_decay_and_lars_reach_every_kernel_and_nothing_else():
    model = build.create_from_config(app_config("EfficientNetV2B0"))
    kernels = {layer.kernel.path for layer in model.layers
               if isinstance(layer, (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.Dense))}
    decayed = {v.path for v in model.trainable_variables if optim.is_decayed(v)}
    assert decayed == kernels and len(kernels) == 92  # not BatchNorm's gamma/beta, not the biases


def test_batchnorm_keys_reach_the_applications_batchnorm_layers():
    def batchnorms(*overrides):
        model = build.create_from_config(app_config("EfficientNetV2B0", *overrides))
        return [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]

    own = batchnorms()
    assert own and not any(bn.synchronized for bn in own)
    bare = keras.applications.EfficientNetV2B0(include_top=False, weights=None, input_shape=(32, 32, 3))
    assert {bn.momentum for bn in own} == {layer.momentum for layer in bare.layers
                                           if isinstance(layer, keras.layers.BatchNormalization)}  # its own
    assert all(bn.synchronized for bn in batchnorms("--config.model.sync_bn=True"))
    tuned = batchnorms("--config.model.bn_momentum=0.8", "--config.model.bn_epsilon=0.002")
    assert len(tuned) == len(own) and {(bn.momentum, bn.epsilon) for bn in tuned} == {(0.8, 0.002)}
    grouped = batchnorms("--config.model.bn_group_size=8")
    assert len(grouped) == len(own) and all(isinstance(bn, models.GhostBatchNormalization) for bn in grouped)


def test_size_and_flops_of_an_application_are_its_published_ones():
    cfg = load_config("smoke", "--config.model.name=keras.applications.EfficientNetV2B0", "--config.data.image_size=224",
                      "--config.data.num_classes=1000")
    info = stats.describe(build.create_from_config(cfg))
    # Tan & Le 2021 (EfficientNetV2), Table 7: B0 has 7.1M parameters and 0.72B FLOPs (multiply-adds) at 224.
    assert info["trainable_params"] == pytest.approx(7.1e6, rel=0.01)
    assert info["flops_per_image"] / 2 == pytest.approx(0.72e9, rel=0.01)
    assert info["gradient_bytes"] == 4 * info["trainable_params"]


def test_the_users_builder_from_a_file_and_from_a_module(builder_file, monkeypatch):
    model = build.create_from_config(load_config("smoke", f"--config.model.name={builder_file}:build_model", *SMALL))
    assert model.name == "tiny" and tuple(model.outputs[0].shape) == (None, 10)
    monkeypatch.syspath_prepend(str(builder_file.parent))
    cfg = load_config("smoke", "--config.model.name=my_models:build_model", *SMALL)
    with cfg.unlocked():
        cfg.model.options.width = 4  # keyword arguments of the builder (a recipe file sets them)
    assert build.create_from_config(cfg).get_layer("conv").kernel.shape == (3, 3, 3, 4)


def test_an_applications_keras2_weights_file_initialises_it(tmp_path):
    """ImageNet weights downloaded elsewhere come as Keras 2 .h5 files of the application without its top."""
    bare = keras.applications.EfficientNetV2B0(include_top=False, weights=None, input_shape=(32, 32, 3),
                                               include_preprocessing=False)
    bare.save(tmp_path / "efficientnetv2-b0_notop.h5")  # the Keras 2 format those files have
    bare.save_weights(tmp_path / "b0.weights.h5")
    for path in ("efficientnetv2-b0_notop.h5", "b0.weights.h5"):
        cfg = app_config("EfficientNetV2B0", f"--config.model.init_from={tmp_path / path}",
                         "--config.model.init_skip_head=True")
        model = build.create_from_config(cfg)
        report = init_from.apply(cfg, model, build.create_from_config)
        assert report.skipped == ["logits/kernel", "logits/bias"]
        np.testing.assert_array_equal(model.get_layer("stem_conv").kernel.numpy(), bare.get_layer("stem_conv").kernel.numpy())
    resnet = load_config("smoke", f"--config.model.init_from={tmp_path / 'efficientnetv2-b0_notop.h5'}")
    with pytest.raises(ConfigError, match="loads into keras.applications models only"):
        init_from.apply(resnet, build.create_from_config(resnet), build.create_from_config)


# --- refusals, through the command line --------------------------------------------------------------

BAD_BUILDERS = {
    "two_args": "def build_model(num_classes):\n    pass\n",
    "wrong_classes": BUILDER.replace("Dense(num_classes,", "Dense(num_classes + 1,"),
    "softmax": BUILDER.replace('dtype="float32", name="logits"', 'activation="softmax", name="logits"'),
    "not_a_model": "def build_model(num_classes, input_shape):\n    return 'model'\n",
    "import_fails": "import no_such_package\n",
    "subclassed": textwrap.dedent('''
        import keras

        class Net(keras.Model):
            def __init__(self, num_classes):
                super().__init__()
                self.bn = keras.layers.BatchNormalization()
                self.pool = keras.layers.GlobalAveragePooling2D()
                self.head = keras.layers.Dense(num_classes)

            def call(self, x, training=False):
                return self.head(self.pool(self.bn(keras.ops.cast(x, "float32"), training=training)))

        def build_model(num_classes, input_shape):
            model = Net(num_classes)
            model(keras.Input(input_shape, dtype="uint8"))
            return model
        '''),
}
REFUSALS = [
    ("unknown application", ["--config.model.name=keras.applications.EfficientNetV9"],
     "keras.applications has no image classifier 'EfficientNetV9'"),
    ("no file", ["--config.model.name=nowhere/models.py:build_model"], "no file"),
    ("no function", ["--config.model.name={dir}/two_args.py:build"], "has no function 'build'"),
    ("signature", ["--config.model.name={dir}/two_args.py:build_model"],
     "cannot be called as function(num_classes, input_shape, **options) -> keras.Model"),
    ("classes", ["--config.model.name={dir}/wrong_classes.py:build_model"],
     "the model returns [(None, 11)]; tfscale needs one output of shape (None, 10)"),
    ("softmax", ["--config.model.name={dir}/softmax.py:build_model"], "applies softmax; tfscale's loss takes logits"),
    ("not a model", ["--config.model.name={dir}/not_a_model.py:build_model"], "returned str, not a keras.Model"),
    ("import", ["--config.model.name={dir}/import_fails.py:build_model"],
     "ModuleNotFoundError: No module named 'no_such_package'"),
    ("subclassed", ["--config.model.name={dir}/subclassed.py:build_model"],
     "returned a subclassed keras.Model (Net); tfscale needs a functional or Sequential one"),
    ("zero_init_residual", ["--config.model.name=keras.applications.MobileNetV3Small",
                            "--config.model.zero_init_residual=True"],
     "config.model.zero_init_residual=True zero-initialises the BatchNorm closing each residual branch"),
    ("channels_first", ["--config.model.name=keras.applications.MobileNetV3Small",
                        "--config.model.data_format=channels_first"], "follows Keras' image_data_format"),
    ("application options", ["--config.model.name=keras.applications.MobileNetV3Small", "--config={dir}/options.py"],
     "building the model failed: TypeError"),
    ("options for a ResNet", ["--config={dir}/resnet_options.py"], "options are for keras.applications and your own"),
]


@pytest.fixture(scope="module")
def bad_builders(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad")
    for name, source in BAD_BUILDERS.items():
        (directory / f"{name}.py").write_text(source)
    config = "from tfscale.configs import smoke\n\n\ndef get_config():\n    c = smoke.get_config()\n{body}    return c\n"
    (directory / "options.py").write_text(config.format(body="    c.model.options.no_such_argument = 1\n"))
    (directory / "resnet_options.py").write_text(config.format(body="    c.model.options.width = 2\n"))
    return directory


@pytest.fixture(scope="module")
def refused_runs(bad_builders, tmp_path_factory):
    """{case: (the command's CompletedProcess, its workdir)}: every REFUSALS command line as the user types it,
    `python -m tfscale.train ...`, each its own process with its own exit code and stderr; the processes
    are forked from one that imported tfscale.train's modules once (tests/helpers/cli_batch.py),
    so 13 refusals cost one TensorFlow import instead of 13."""
    root = tmp_path_factory.mktemp("refused")
    commands, workdirs = [], {}
    for case, overrides, _ in REFUSALS:
        args = [arg.format(dir=bad_builders) for arg in overrides]
        config = next((a for a in args if a.startswith("--config=")), "--config=configs/smoke.py")
        workdirs[case] = root / case.replace(" ", "_") / "run"
        args = [a for a in args if not a.startswith("--config=")]
        commands.append(["-m", "tfscale.train", config, f"--workdir={workdirs[case]}", *args])
    results = run_batch(commands, preload=["tfscale.training.train"], cwd=REPO, env=quiet_env(),
                        timeout_s=300 + 60 * len(commands))
    return {case: (result, workdirs[case]) for (case, _, _), result in zip(REFUSALS, results)}


@pytest.mark.parametrize("case, overrides, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_model_tfscale_cannot_train_is_refused_at_start_up(case, overrides, message, refused_runs):
    result, workdir = refused_runs[case]
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "config error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # Refused before connecting or claiming the workdir: nothing written.
    assert not os.path.exists(workdir / "config.json")


GPU_VARIANTS = [("amp", "mixed_float16"), ("amp_bf16", "mixed_bfloat16"), ("xla", "float32")]


@pytest.fixture(scope="module")
def gpu_variant_runs(tmp_path_factory):
    """{variant: (CompletedProcess, workdir)}: each variant's `python -m tfscale.train` run, its own process
    forked from one that imported tfscale.train's modules once (tests/helpers/cli_batch.py)."""
    root = tmp_path_factory.mktemp("variants")
    workdirs = {variant: root / variant for variant, _ in GPU_VARIANTS}
    commands = [
        ["-m", "tfscale.train", f"--config=configs/r50_1gpu.py:{variant}", f"--workdir={workdirs[variant]}",
         "--config.model.name=keras.applications.MobileNetV3Small", "--config.data.dataset=synthetic_learnable",
         *SMALL, "--config.data.global_batch_size=16", "--config.data.num_train_examples=160",
         "--config.data.num_eval_examples=32", "--config.train.epochs=1", "--config.train.log_every_steps=5",
         "--config.schedule.warmup_epochs=0", "--config.schedule.decay_epochs=(1,)"]
        for variant, _ in GPU_VARIANTS]
    results = run_batch(commands, preload=["tfscale.training.train"], cwd=REPO, env=quiet_env(),
                        timeout_s=600 * len(commands))
    return {variant: (result, workdirs[variant]) for (variant, _), result in zip(GPU_VARIANTS, results)}


@pytest.mark.slow
@pytest.mark.parametrize("variant, precision", GPU_VARIANTS)
def test_a_gpu_variant_trains_an_application_through_the_cli(variant, precision, gpu_variant_runs):
    """The GPU recipes' precision + XLA on a keras.applications model (on CPU here, slowly)."""
    import math

    result, workdir = gpu_variant_runs[variant]
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.load(open(workdir / "config.json"))
    assert (recorded["precision"], recorded["jit_compile"]) == (precision, True)
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert any("eval_top1" in row for row in rows)


@pytest.mark.slow
def test_the_benchmark_measures_an_application_and_the_planner_predicts_it_from_its_gradient_bytes(tmp_path):
    model = ["--config=configs/smoke.py", "--config.model.name=keras.applications.ConvNeXtTiny",
             "--config.data.global_batch_size=4"]
    plan_args = ["-m", "tfscale.perf.plan", *model, "--system=a100_ib_200g", "--gpus=1,16",
                 f"--benchmark_json={tmp_path / 'benchmark.json'}"]
    # The benchmark, then the planner on its report: one after the other, each its own process forked from one
    # that imported both once (tests/helpers/cli_batch.py). Two breakdown steps, not the default 20: the
    # breakdown's numbers are not what is tested here, and each ConvNeXtTiny step costs ~0.4 s on this CPU.
    bench, planned, refused = run_batch(
        [["-m", "tfscale.benchmark", *model, f"--workdir={tmp_path}", "--config.benchmark.mode=synthetic",
          "--config.benchmark.num_batches=3", "--config.benchmark.num_warmup_batches=1",
          "--config.benchmark.breakdown_batches=2"],
         [*plan_args, "--per_gpu_batch=4"],
         [*plan_args, "--per_gpu_batch=16"]],
        preload=["tfscale.perf.benchmark", "tfscale.perf.plan"], cwd=REPO, env=quiet_env(), timeout_s=1200)
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "total images/sec:" in bench.stdout
    gradient_mb = stats.describe(build.create_from_config(load_config("smoke", *model[1:])))["gradient_bytes"] / 1e6
    assert f"{gradient_mb:.1f} MB of gradients a step" in bench.stderr  # the start-up line
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["model_size"]["gradient_bytes"] / 1e6 == pytest.approx(gradient_mb)
    assert report["model_size"]["flops_per_image"] > 0
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert f"keras.applications.ConvNeXtTiny, 4 images per GPU, {gradient_mb:.1f} MB of gradients" in planned.stdout
    # A benchmark of another batch than the plan's is refused, naming both.
    assert refused.returncode == 1 and "ran keras.applications.ConvNeXtTiny at 4 images per GPU; the plan is of " \
        "keras.applications.ConvNeXtTiny at 16" in refused.stderr
