"""Config files load and validate; overrides behave as users expect; mistakes get clear errors."""

import glob
import os
import subprocess
import sys

import pytest
from absl import flags
from conftest import REPO, load_config, run_cli

from tfscale import config as tfs_config
from tfscale.config import validation

CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
# Replica counts each recipe is written for (the file name says it).
REPLICAS = {"r50_8gpu.py": 8, "r50_32gpu.py": 32, "r50_lars_32k.py": 256, "seed000_r50.py": 32}
# Recipes that need a config argument (a study's method); test_seed000_recipes.py tests every method.
ARGUMENT = {"seed000_r50.py": ":gradual5"}


def parse(config_arg, *overrides):
    """`--config=configs/NAME.py` plus overrides, parsed exactly as `tfscale.train` does."""
    name = os.path.splitext(os.path.basename(config_arg.split("=", 1)[1]))[0]
    return load_config(name, *overrides)


def smoke(**overrides):
    cfg = parse(f"--config={REPO}/configs/smoke.py")
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_config_files_exist():
    names = {os.path.basename(p) for p in CONFIG_FILES}
    assert {"smoke.py", "cifar_resnet20.py", "r50_1gpu.py", "r50_8gpu.py", "r50_32gpu.py"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_loads_and_validates(path, tmp_path):
    cfg = load_config(os.path.splitext(os.path.basename(path))[0] + ARGUMENT.get(os.path.basename(path), ""))
    if cfg.data.dataset == "tfrecord":
        cfg.data.data_dir = str(tmp_path)
    validation.validate(cfg, num_replicas=REPLICAS.get(os.path.basename(path), 1))
    steps = tfs_config.to_steps(cfg)
    assert steps.train_steps >= 1 and steps.steps_per_epoch >= 1


@pytest.mark.parametrize("name", ["r50_1gpu", "r50_8gpu", "r50_32gpu", "r50_lars_32k", "cifar_resnet20"])
def test_recipes_train_on_the_shards_they_are_given(name, tmp_path):
    cfg = load_config(name, f"--config.data.data_dir={tmp_path}")
    assert cfg.data.dataset == "tfrecord"
    validation.validate(cfg)
    assert cfg.data.label_offset == 1  # ImageNet-layout shards: 1-based labels


@pytest.mark.parametrize("name", ["r50_1gpu", "r50_32gpu", "cifar_resnet20"])
def test_recipe_without_data_dir_names_the_key_and_the_converter(name):
    with pytest.raises(ValueError, match=r"config\.data\.data_dir .*tfscale-convert .*dataset=synthetic"):
        validation.validate(load_config(name))


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"config\.data\.data_dir='{tmp_path}/nope' is not a directory.*tfscale-convert"):
        validation.validate(load_config("r50_1gpu", f"--config.data.data_dir={tmp_path}/nope"))


@pytest.mark.parametrize("key", ["data_dir", "stage_dir", "tfds_name"])
def test_synthetic_data_with_a_data_source_is_refused(key, tmp_path):
    cfg = load_config("r50_32gpu", "--config.data.dataset=synthetic", f"--config.data.{key}={tmp_path}")
    with pytest.raises(ValueError, match=rf"config\.data\.{key}=.* config\.data\.dataset='synthetic'"):
        validation.validate(cfg)


def test_synthetic_stays_one_override_away():
    cfg = load_config("r50_32gpu", "--config.data.dataset=synthetic")
    validation.validate(cfg, num_replicas=32)
    assert cfg.data.label_offset == 0


def test_label_offset_follows_the_dataset(tmp_path):
    tfds = load_config("r50_1gpu", "--config.data.dataset=tfds", "--config.data.tfds_name=imagenet2012",
                       f"--config.data.data_dir={tmp_path}")
    validation.validate(tfds)
    assert tfds.data.label_offset == 0
    explicit = load_config("r50_1gpu", f"--config.data.data_dir={tmp_path}", "--config.data.label_offset=0")
    validation.validate(explicit)
    assert explicit.data.label_offset == 0  # an explicit value is kept
    bad = load_config("r50_1gpu", "--config.data.dataset=tfds", "--config.data.tfds_name=imagenet2012",
                      f"--config.data.data_dir={tmp_path}", "--config.data.label_offset=1")
    with pytest.raises(ValueError, match=r"label_offset=1 with config\.data\.dataset='tfds'.*0-based"):
        validation.validate(bad)


@pytest.mark.parametrize("overrides, message", [
    (["--config.data.tfds_name=imagenet2012"], r"tfds_name='imagenet2012' is set but config\.data\.dataset='tfrecord'"),
    (["--config.data.dataset=tfds", "--config.data.tfds_name=imagenet2012", "--config.data.stage_dir=/tmp/x"],
     r"stage_dir='/tmp/x' stages TFRecord shards"),
])
def test_contradicting_data_keys_are_refused(overrides, message, tmp_path):
    cfg = load_config("r50_1gpu", f"--config.data.data_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match=message):
        validation.validate(cfg)


def test_recipe_on_fewer_replicas_says_so_and_how_to_scale(tmp_path):
    cfg = load_config("r50_32gpu", f"--config.data.data_dir={tmp_path}")
    validation.validate(cfg, num_replicas=32)
    with pytest.raises(ValueError, match=(
        r"1 replica\(s\), so each would take 4096 images .*written for 32 replicas .*"
        r"--config\.data\.global_batch_size=128 ")):
        validation.validate(cfg, num_replicas=1)
    scaled = load_config("r50_32gpu", f"--config.data.data_dir={tmp_path}", "--config.data.global_batch_size=512")
    validation.validate(scaled, num_replicas=4)  # 128 per GPU on 4 GPUs: the recipe at a smaller batch
    assert scaled.optim.lr == pytest.approx(0.2)


def test_bundled_recipes_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bundled = os.path.join(tfs_config.BUNDLED_CONFIG_DIR, "r50_32gpu.py")
    for given in ("r50_32gpu", "r50_32gpu.py", "configs/r50_32gpu.py"):
        assert tfs_config.resolve_config_arg(f"--config={given}:arg") == f"--config={bundled}:arg"
    (tmp_path / "mine.py").write_text("")
    assert tfs_config.resolve_config_path("mine.py") == "mine.py"  # a file that exists wins
    assert tfs_config.resolve_config_path("elsewhere/r50_32gpu.py") == "elsewhere/r50_32gpu.py"
    assert tfs_config.resolve_config_path("no_such_recipe") == "no_such_recipe"


def test_r50_32gpu_is_the_goyal_recipe():
    cfg = parse(f"--config={REPO}/configs/r50_32gpu.py")
    assert cfg.model.name == "resnet50" and cfg.data.image_size == 224
    assert cfg.data.global_batch_size == 4096 and cfg.data.global_batch_size // 32 == 128
    assert cfg.optim.lr == pytest.approx(1.6)
    assert (cfg.optim.momentum, cfg.optim.weight_decay) == (0.9, 1e-4)
    assert (cfg.schedule.warmup, cfg.schedule.warmup_epochs) == ("gradual", 5.0)
    assert validation.decay_boundaries(cfg.schedule, cfg.train.epochs) == (30, 60, 80)
    assert cfg.schedule.decay_factor == 0.1 and cfg.train.epochs == 90.0
    assert tfs_config.to_steps(cfg).steps_per_epoch == 1_281_167 // 4096


def test_shortened_recipe_keeps_the_shape_of_its_step_decay():
    """r50_1gpu cut to 2 epochs decays at the same shares of the run (30, 60, 80 of 90), recorded in the config;
    boundaries given in epochs stay as given, and ones beyond the run say which override to add."""
    cut = load_config("r50_1gpu", "--config.data.dataset=synthetic", "--config.train.epochs=2")
    validation.validate(cut)
    assert tuple(cut.schedule.decay_epochs) == (0.6667, 1.3333, 1.7778)
    given = load_config("r50_1gpu", "--config.data.dataset=synthetic", "--config.train.epochs=2",
                        "--config.schedule.decay_epochs=(1,)")
    validation.validate(given)
    assert tuple(given.schedule.decay_epochs) == (1,)
    beyond = load_config("fmnist_resnet", "--config.data.dataset=synthetic", "--config.train.epochs=2")
    with pytest.raises(tfs_config.ConfigError, match=r"decay_epochs=\(4, 8, 11\) has boundary 11 beyond "
                       r"config.train.epochs=2.0.*--config.schedule.decay_fractions="):
        validation.validate(beyond)
    wrong = load_config("r50_1gpu", "--config.data.dataset=synthetic", "--config.schedule.decay_fractions=(0.5, 30.0)")
    with pytest.raises(tfs_config.ConfigError, match=r"decay_fractions=\(0.5, 30.0\) must lie in \(0, 1\]"):
        validation.validate(wrong)


def test_batch_override_rescales_linked_lr():
    base = parse(f"--config={REPO}/configs/r50_1gpu.py")
    doubled = parse(f"--config={REPO}/configs/r50_1gpu.py", "--config.data.global_batch_size=512")
    assert base.optim.lr == pytest.approx(0.1)
    assert doubled.optim.lr == pytest.approx(0.2)
    assert "lr: 0.2" in str(doubled)  # print(config) shows the derived value
    # The eval batch follows the train batch unless set.
    assert tfs_config.to_steps(doubled).eval_global_batch_size == 512


def test_lr_per_256_override_rescales_lr():
    cfg = parse(f"--config={REPO}/configs/r50_32gpu.py", "--config.optim.lr_per_256=0.2")
    assert cfg.optim.lr == pytest.approx(3.2)


def test_eval_batch_override_leaves_train_batch_alone():
    cfg = parse(f"--config={REPO}/configs/r50_1gpu.py", "--config.data.eval_global_batch_size=1000")
    assert cfg.data.global_batch_size == 256 and cfg.optim.lr == pytest.approx(0.1)
    assert tfs_config.to_steps(cfg).eval_steps == 50


def test_unknown_key_names_the_key():
    with pytest.raises((AttributeError, KeyError), match=r"lrr[\s\S]*Did you mean \"lr\""):
        parse(f"--config={REPO}/configs/smoke.py", "--config.optim.lrr=1")


def test_missing_config_file_names_it():
    cfg = parse(f"--config={REPO}/configs/no_such_config.py")
    with pytest.raises(OSError, match="no_such_config.py"):
        cfg.optim


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model__name="resnet51"), r"model\.name='resnet51'.*resnet50"),
        (dict(optim__name="adam"), r"optim\.name='adam'.*lars.*sgd"),
        (dict(schedule__decay="linear"), r"linear.*cosine"),
        (dict(schedule__warmup="slow"), r"slow.*gradual"),
        (dict(precision="float8"), r"precision='float8'.*mixed_bfloat16"),
        (dict(data__global_batch_size=0), r"data\.global_batch_size must be > 0, got 0"),
        (dict(data__image_size=-32), r"data\.image_size must be > 0, got -32"),
        (dict(train__epochs=0.0), r"train\.epochs must be > 0"),
        (dict(schedule__warmup_epochs=5.0), r"5\.0.*3\.0"),  # smoke trains 3 epochs
        (dict(data__global_batch_size=1000), r"global_batch_size=1000 exceeds .*num_train_examples=640"),
    ],
)
def test_validate_names_key_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        validation.validate(smoke(**overrides))


def test_impossible_batch_split_is_refused_with_nearest_sizes():
    cfg = smoke(data__global_batch_size=30, data__eval_global_batch_size=60)
    with pytest.raises(ValueError, match=r"global_batch_size=30 cannot be split evenly over 4 replicas.*28 or 32"):
        validation.validate(cfg, num_replicas=4)
    validation.validate(cfg, num_replicas=3)  # 30 / 3 is fine


def test_to_steps_converts_epochs_once():
    cfg = smoke()  # 640 train examples, batch 32, 3 epochs, eval every 1.5, checkpoint every 1.0
    steps = tfs_config.to_steps(cfg)
    assert steps.steps_per_epoch == 20
    assert steps.train_steps == 60
    assert steps.eval_every_steps == 30
    assert steps.checkpoint_every_steps == 20
    assert steps.eval_steps == 16  # ceil(500 / 32)
    assert steps.eval_batch_padding == 16 * 32 - 500


def test_large_batch_without_lars_warns(caplog):
    cfg = parse(f"--config={REPO}/configs/r50_32gpu.py", "--config.data.global_batch_size=16384",
                "--config.data.dataset=synthetic")
    with caplog.at_level("WARNING"):
        validation.validate(cfg, num_replicas=128)
    assert "global_batch_size=16384 exceeds 8192" in caplog.text and "LARS" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        validation.validate(parse(f"--config={REPO}/configs/r50_lars_32k.py", "--config.data.dataset=synthetic"),
                            num_replicas=256)
    assert "exceeds" not in caplog.text


def test_lars_recipe():
    cfg = parse(f"--config={REPO}/configs/r50_lars_32k.py")
    assert cfg.optim.name == "lars" and cfg.optim.label_smoothing == 0.1
    assert cfg.schedule.decay == "polynomial" and cfg.schedule.poly_power == 2.0
    assert cfg.data.num_classes == 1000 and cfg.schedule.warmup_epochs > 0
    assert cfg.optim.lr == pytest.approx(29.0)
    halved = parse(f"--config={REPO}/configs/r50_lars_32k.py", "--config.data.global_batch_size=16384")
    assert halved.optim.lr == pytest.approx(14.5)  # base LR grows (and shrinks) with the batch


def test_recipe_without_data_fails_fast_naming_data_dir(tmp_path):
    """The first thing a new user types: no shards yet. It must not build a 4096-image batch of noise."""
    result = run_cli("tfscale.train", "--config=configs/r50_32gpu.py", f"--workdir={tmp_path}/w")
    assert result.returncode != 0
    assert "config.data.data_dir" in result.stderr and "tfscale-convert" in result.stderr
    assert not os.path.exists(tmp_path / "w")  # nothing written


def test_recipe_on_one_replica_is_refused_before_anything_is_built(tmp_path):
    result = run_cli("tfscale.train", "--config=r50_32gpu", f"--workdir={tmp_path}/w",
                     f"--config.data.data_dir={tmp_path}", "--config.distribute.backend=one_device",
                     cwd=str(tmp_path))  # the bundled recipe, by name, from another directory
    assert result.returncode != 0
    assert "each would take 4096 images" in result.stderr and "--config.data.global_batch_size=128" in result.stderr
    assert "parameters" not in result.stderr  # the model was never built


def test_dispatch_names_equal_the_implementing_modules():
    from tfscale.data.input import batch_augment, preprocess
    from tfscale.model import models, optim

    assert tfs_config.MODEL_NAMES == tuple(models.MODELS)
    assert tfs_config.OPTIMIZERS == optim.OPTIMIZERS
    assert tfs_config.AUGMENTS == preprocess.AUGMENTS
    assert tfs_config.BATCH_AUGMENTS == batch_augment.BATCH_AUGMENTS


def test_validate_does_not_import_tensorflow():
    script = (
        "import sys\n"
        "import tfscale.config, tfscale.config.validation\n"
        "cfg = tfscale.config.base_config()\n"
        "cfg.data.dataset = 'synthetic'\n"
        "tfscale.config.validation.validate(cfg, num_replicas=1)\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras'})\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("overrides, num_replicas, message", [
    (["--config.model.bn_group_size=12"], 2, r"bn_group_size=12 does not divide the batch each replica computes at "
                                             r"once \(16: config.data.global_batch_size=32 over 2 replicas"),
    (["--config.model.bn_group_size=16", "--config.optim.grad_accum_steps=4"], 1,
     r"bn_group_size=16 does not divide the batch each replica computes at once \(8: .* and 4 micro-batches\)"),
    (["--config.model.bn_group_size=8", "--config.model.sync_bn=True"], 1, r"bn_group_size=8 with .*sync_bn=True"),
])
def test_ghost_batch_norm_groups_must_tile_each_replicas_batch(overrides, num_replicas, message):
    cfg = load_config("smoke", *overrides)
    with pytest.raises(tfs_config.ConfigError, match=message):
        validation.validate(cfg, num_replicas=num_replicas)
    validation.validate(load_config("smoke", "--config.model.bn_group_size=8"), num_replicas=2)  # 16 = 2 x 8
