"""Reading a recipe file: `--config=PATH[:ARG]` as the command lines and the study runner parse it, with
the recipes bundled in the package found by name from any directory.
"""

from __future__ import annotations

import ast
import os

import ml_collections
from absl import flags
from ml_collections import config_flags

from tfscale.errors import ConfigError

# Recipes shipped inside the package (configs/ in a checkout is a link to them).
BUNDLED_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def resolve_config_path(path: str) -> str:
    """`path` when it exists, else the bundled recipe of that name: `r50_32gpu`, `r50_32gpu.py` and
    `configs/r50_32gpu.py` all find it from any directory once tfscale is installed."""
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    bundled = os.path.join(BUNDLED_CONFIG_DIR, name if name.endswith(".py") else name + ".py")
    in_configs = os.path.dirname(path) in ("", "configs") or os.path.basename(os.path.dirname(path)) == "configs"
    return bundled if in_configs and os.path.isfile(bundled) else path


def bundled_recipes() -> list[tuple[str, tuple[str, ...], str]]:
    """(name, its `:ARG` variants, the first line of its docstring) of every bundled recipe, read from the files'
    text (no recipe is imported: --help stays fast). A recipe lists its variants in a module-level VARIANTS."""
    recipes = []
    for file in sorted(os.listdir(BUNDLED_CONFIG_DIR)):
        if not file.endswith(".py") or file.startswith("_"):
            continue
        with open(os.path.join(BUNDLED_CONFIG_DIR, file)) as f:
            module = ast.parse(f.read())
        doc = (ast.get_docstring(module) or "").split("\n")[0]
        variants = ()
        for node in module.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "VARIANTS" for t in node.targets):
                variants = tuple(ast.literal_eval(node.value))
        recipes.append((file[:-3], variants, doc))
    return recipes


def recipes_help() -> str:
    """The bundled recipes as --help lists them under --config: `name[:variant|...]: what it is`."""
    return "\n".join(f"  {name}{'[:' + '|'.join(variants) + ']' if variants else ''}: {doc}"
                     for name, variants, doc in bundled_recipes())


def resolve_config_arg(arg: str) -> str:
    """`--config=PATH[:ARG]` with PATH resolved by `resolve_config_path`; other arguments unchanged."""
    if not arg.startswith("--config="):
        return arg
    path, colon, config_arg = arg[len("--config="):].partition(":")
    return f"--config={resolve_config_path(path)}{colon}{config_arg}"


def load_config_file(path: str, overrides=()) -> ml_collections.ConfigDict:
    """`PATH[:ARG]` with `--config.x.y=v` overrides, parsed exactly as the CLIs parse them; ConfigError if it cannot be."""
    argv = ["tfscale", resolve_config_arg(f"--config={path}"), *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
    except (AttributeError, KeyError, flags.Error) as err:  # unknown key, bad value, unreadable file
        raise ConfigError(f"cannot load {path} with {' '.join(overrides) or 'no overrides'}: {err}") from err
    return flag_values.config
