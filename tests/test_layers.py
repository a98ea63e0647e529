"""tfscale's import graph runs one way: every module imports only modules of the layers below its own.

LAYERS is the order, written once (docs/architecture.md shows it): the commands at the top, errors and
the pure-Python building blocks at the bottom. Imports inside functions count too (a lazy import is
still a dependency). A new module goes into the layer its imports allow; the test names any module
left out, any import of a module in the same or a higher layer, and so any cycle.
"""

import ast
import os

import pytest
from conftest import REPO

LAYERS = [
    # the command-line tools
    ["doctor", "plan", "study", "data.convert.__main__", "data.stage.__main__"],
    ["benchmark"],
    ["train", "export", "baselines"],
    # the training run: its loops (the LR on device, synchronous and local SGD), setup and the step
    ["loops"],
    ["local_sgd_steps"],
    ["engine"],
    # data: input (the loader chosen above both tf.data and DALI), conversion, staging
    ["data.input.loaders"],
    ["data.input.dali"],
    ["data.input.pipeline", "data.convert.convert"],
    ["data.input.shard_dir", "data.input.record_index", "data.convert.arrays"],
    ["data.stage.stage", "data.convert.shards"],
    ["data.stage.stage_copy", "data.convert.encode"],
    ["data.stage.stage_plan", "data.stage.stage_state", "data.convert.sources", "data.convert.parallel",
     "data.convert.dali_index", "data.input.faults", "data.input.info"],
    # the run's services: cluster, launcher, checkpoints, workdir, callbacks, command line, studies' records
    ["init_from"],
    ["distribute", "launch", "callbacks", "checkpoints", "workdir", "cli", "study_hparams"],
    ["connect", "horovod_start", "io", "supervise", "plan_published"],
    ["devices", "validation"],
    # the schema (validation.py checks a config against it)
    ["config"],
    # pure building blocks: no tfscale imports but errors
    ["models", "model_stats", "optim", "ema", "schedules", "local_sgd", "collectives", "allreduce_bench", "scaling", "plan_model",
     "slurm_env", "launcher_death", "logs", "data.input.assignment", "data.input.preprocess",
     "data.input.batch_augment", "data.input.synthetic", "data.convert.val_labels"],
    ["errors", "workdir_layout", "tfscale", "data", "data.input", "data.convert", "data.stage"],
]


def modules() -> dict[str, str]:
    """{dotted name under tfscale (the package itself: "tfscale"): path}, recipes (configs/) aside."""
    root = os.path.join(REPO, "tfscale")
    found = {}
    for directory, _, files in os.walk(root):
        if os.path.relpath(directory, root).split(os.sep)[0] == "configs":
            continue
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name), root)[:-3].replace(os.sep, ".")
                found[relative.removesuffix("__init__").rstrip(".") or "tfscale"] = os.path.join(directory, name)
    return found


def dotted(target: str) -> str:
    """`tfscale.data.input.pipeline` -> `data.input.pipeline`, the names LAYERS uses (`tfscale` itself stays)."""
    return target.removeprefix("tfscale.") if target.startswith("tfscale.") else target


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The tfscale modules `path` imports, anywhere in it."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tfscale.data.input import pipeline` imports the module pipeline; `from tfscale.io import x`, io
            targets = [f"{node.module}.{alias.name}" if dotted(f"{node.module}.{alias.name}") in known
                       else node.module for alias in node.names]
        else:
            continue
        found |= {dotted(target) for target in targets
                  if (target == "tfscale" or target.startswith("tfscale.")) and dotted(target) in known}
    found.discard(name)
    return found


def layer_of() -> dict[str, int]:
    """{module: its layer's height}, 0 at the bottom."""
    return {module: height for height, layer in enumerate(reversed(LAYERS)) for module in layer}


def test_every_module_is_in_exactly_one_layer():
    listed = [module for layer in LAYERS for module in layer]
    assert sorted(set(listed)) == sorted(listed), "a module is listed twice"
    assert set(listed) == set(modules()), (f"not in LAYERS: {sorted(set(modules()) - set(listed))}; "
                                           f"in LAYERS but gone: {sorted(set(listed) - set(modules()))}")


def test_every_import_goes_down_so_there_is_no_cycle():
    found, height = modules(), layer_of()
    upward = [f"{name} (layer {height[name]}) imports {target} (layer {height[target]})"
              for name, path in sorted(found.items()) for target in sorted(imports_of(name, path, set(found)))
              if height[target] >= height[name]]
    assert not upward, "imports that do not go down:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, expected", [
    ("from tfscale.data.input import pipeline\n", {"data.input.pipeline"}),
    ("def f():\n    from tfscale import engine\n", {"engine"}),
    ("import tfscale.io\n", {"io"}),
    ("from tfscale.errors import ConfigError\n", {"errors"}),
    ("import os\nfrom absl import logging\n", set()),
])
def test_the_import_reader_sees_every_form(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of("x", str(path), set(modules())) == expected
