"""Every command-line tool's --help, as its console script runs it: its own flags (not "Try --helpfull" alone),
the bundled recipes and their variants where it takes --config, and no TensorFlow banner."""

import importlib
import os
import subprocess
import sys
import tomllib

from conftest import REPO, TF_IMPORT_NOTICES

from tfscale.config import files

with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    SCRIPTS = tomllib.load(f)["project"]["scripts"]

# Flags each tool's --help must list (a sample: the ones a user looks for first).
OWN_FLAGS = {
    "tfscale-train": ["--config", "--workdir", "--mode"],
    "tfscale-bench": ["--config", "--workdir"],
    "tfscale-convert": ["--input_dir", "--output_dir", "--split", "--num_shards"],
    "tfscale-launch": ["--num_workers", "--backend"],
    "tfscale-export": ["--workdir", "--output_dir", "--checkpoint"],
    "tfscale-stage": ["--config", "--dest_dir"],
    "tfscale-study": ["--workdir", "--run_index"],
    "tfscale-doctor": ["--only", "--fast", "--data_dir", "--json", "--tasks_per_node"],
    "tfscale-plan": ["--config", "--system", "--gpus"],
}


def console_script(name: str) -> list[str]:
    """The command pip's console script runs (`from module import run; run()` with argv[0] the script's name),
    without depending on where pip put it."""
    module, function = SCRIPTS[name].split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; "
                                  f"sys.exit({function}())"]


def test_every_tools_help_lists_its_own_flags_without_tensorflows_banner():
    assert set(OWN_FLAGS) == set(SCRIPTS)  # a new tool gets its line here
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's shell has it
    runs = {name: subprocess.Popen([*console_script(name), "--help"], cwd=REPO, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in SCRIPTS}
    for name, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        listed = [line.split(":")[0].strip().replace("--[no]", "--") for line in stdout.splitlines()
                  if line.startswith("  --")]
        assert set(OWN_FLAGS[name]) <= set(listed), f"{name} --help lists {listed}:\n{stdout[-2000:]}"
        assert not any(notice in stderr for notice in TF_IMPORT_NOTICES), f"{name}: {stderr[-2000:]}"
        assert not [line for line in stderr.splitlines() if line.startswith("I0000")], f"{name}: {stderr[-2000:]}"
        if name != "tfscale-launch":  # its usage line is its own (cli.split_command)
            usage = importlib.import_module(SCRIPTS[name].split(":")[0]).__doc__.splitlines()[0]
            assert stdout.strip().splitlines()[0] == usage, name  # the module's usage, as `python -m` shows it
        if "--config" in OWN_FLAGS[name] and name != "tfscale-stage":
            assert "r50_32gpu[:xla|amp|amp_bf16]: ResNet-50 v1.5 on ImageNet, 32 GPUs" in " ".join(stdout.split()), name
            assert "seed000_r50[:naive|linear|stepping5|stepping5_32|gradual5|gradual10]" in stdout, name


def test_the_recipes_variants_listed_are_the_ones_they_accept():
    from tfscale.config import GPU_VARIANTS, load_config_file

    recipes = {name: variants for name, variants, _ in files.bundled_recipes()}
    assert recipes["r50_32gpu"] == tuple(GPU_VARIANTS) and recipes["smoke"] == ()
    for name, variants in recipes.items():
        for variant in variants:
            load_config_file(f"{name}:{variant}")  # raises ConfigError for a variant the recipe refuses
