"""tfscale's configuration: every key and its default (schema), the names each key accepts (names), the
rules for keys that work together (rules), what is derived from a config (derived: epochs become steps
there and nowhere else), reading a recipe file (files), the rules for the `auto` keys of how a step runs
(step_modes) and `validate` (validation).

This face is what recipe files and user code import (`from tfscale.config import base_config`); tfscale's
own modules import the module that owns a name. Nothing here imports TensorFlow or any other part of
tfscale but `errors`, so a bad config fails in about a second.
"""

from tfscale.config.derived import Steps, eval_global_batch_size, profile_window, to_steps
from tfscale.config.files import BUNDLED_CONFIG_DIR, load_config_file, resolve_config_arg, resolve_config_path
from tfscale.config.names import *  # noqa: F403  the accepted values of each key
from tfscale.config.names import __all__ as _names
from tfscale.config.schema import GPU_VARIANTS, base_config, gpu_variant
from tfscale.config.validation import validate
from tfscale.errors import ConfigError

__all__ = ["BUNDLED_CONFIG_DIR", "GPU_VARIANTS", "ConfigError", "Steps", "base_config", "eval_global_batch_size",
           "gpu_variant", "load_config_file", "profile_window", "resolve_config_arg", "resolve_config_path", "to_steps",
           "validate", *_names]
