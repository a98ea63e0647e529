"""What a tfscale job prints: each message once, progress from the chief only, TensorFlow's chatter off.

Three sources write to a job's stderr, and left alone they make it unreadable:
  * absl: tfscale's own lines, and the ~30 TensorFlow modules that log through absl directly
    (e.g. "Sharding callback duration: 37 microseconds" at every checkpoint);
  * TensorFlow's Python logger `tensorflow`. Importing TensorFlow before absl's handler exists (every
    CLI does) gives it a handler of its own, and it also propagates to absl's handler on the root
    logger: every message twice, `INFO:tensorflow:...` then `I1123 ...]`;
  * TensorFlow's C++ runtime (oneDNN notice, CPU feature guard, gRPC and coordination-service lines),
    filtered by TF_CPP_MIN_LOG_LEVEL, which TensorFlow reads once, when it is imported; except the
    oneDNN notice, which TensorFlow 2.21 prints at import (twice, after absl's "All log messages before
    absl::InitializeLog()" line) at every level.

The pieces, each called where the moment is right:
  quiet_tensorflow_banner(__name__)   top of a CLI module, before TensorFlow's import: C++ level 1
      (warnings and errors kept, INFO banner dropped) unless the user set TF_CPP_MIN_LOG_LEVEL;
  import_tensorflow_without_banner()  right after (after the CPU binding, where a module binds): TensorFlow
      imported with the oneDNN notice taken out of what the import prints;
  configure()                         CLI start (cli.run_cli): absl's handler is the one handler,
      the `tensorflow` logger propagates to it, TensorFlow's INFO lines are dropped;
  gate_workers(is_chief, ...)         end of distribute.setup, after the topology line: non-chief
      workers keep warnings and errors only, unless `distribute.log_all_ranks`.
absl's `--verbosity=1` (debug) brings TensorFlow's INFO lines back, for debugging TensorFlow itself.
This module imports neither TensorFlow nor Keras: it must run before them.
"""

from __future__ import annotations

import importlib.util
import logging as std_logging
import os
import sys
import tempfile

from absl import logging

# TensorFlow's C++ levels: 0 all, 1 drops INFO, 2 drops WARNING too, 3 drops ERROR too.
CPP_LOG_LEVEL = "1"
CONSOLE_SCRIPT_PREFIX = "tfscale-"  # pyproject's [project.scripts]: tfscale-train, tfscale-bench, ...
# What TensorFlow's import prints whatever TF_CPP_MIN_LOG_LEVEL says (measured with 2.21 at levels 1 and 2),
# through absl's stderr sink of a process that never calls absl::InitializeLog: taken out of the import's stderr.
IMPORT_BANNER = ("All log messages before absl::InitializeLog() is called are written to STDERR",
                 "oneDNN custom operations are on.")


_banner_quiet = False  # set by quiet_tensorflow_banner in a program: import_tensorflow_without_banner acts


def quiet_tensorflow_banner(module_name: str = "__main__") -> None:
    """Hides TensorFlow's C++ INFO start-up lines of this process (and its children), keeping warnings.

    Call before TensorFlow is imported. A TF_CPP_MIN_LOG_LEVEL the user set wins (0: nothing is hidden).
    `module_name`: the caller's `__name__` when called at import time, so that only a module run as a program
    (`python -m tfscale.x` or a `tfscale-*` console script) changes the environment, not a library import.
    Then `import_tensorflow_without_banner` imports TensorFlow without its oneDNN notice.
    """
    global _banner_quiet
    if _runs_as_program(module_name):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", CPP_LOG_LEVEL)
        _banner_quiet = os.environ["TF_CPP_MIN_LOG_LEVEL"] != "0"


def import_tensorflow_without_banner() -> None:
    """In a program that called quiet_tensorflow_banner (and left TF_CPP_MIN_LOG_LEVEL above 0): imports
    TensorFlow with IMPORT_BANNER's lines taken out of what it prints to stderr meanwhile; anything else (a CUDA
    library that does not load, a warning) passes through, after the import. Elsewhere, nothing.

    Call after anything that must precede TensorFlow's import (topology.bind_at_start)."""
    if not _banner_quiet or "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:  # a file, not a pipe: nothing the import writes can block it
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not any(banner in line for banner in IMPORT_BANNER)))
            sys.stderr.flush()


def _runs_as_program(module_name: str) -> bool:
    # A console script imports the module under its real name; its own name is in argv[0].
    return module_name == "__main__" or os.path.basename(sys.argv[0]).startswith(CONSOLE_SCRIPT_PREFIX)


def configure() -> None:
    """One handler (absl's, on the root logger) for every Python logger; TensorFlow's INFO lines off.

    Call after absl has parsed the flags (inside `app.run`'s main), so `--verbosity` is known.
    Idempotent.
    """
    logging.use_absl_handler()  # app.run installed it already; a no-op then
    handler = logging.get_absl_handler()
    if _drop_tensorflow_info not in handler.filters:
        handler.addFilter(_drop_tensorflow_info)
    quiet_tensorflow_python()


def quiet_tensorflow_python() -> None:
    """The `tensorflow` logger without a handler of its own (its records reach absl's handler once,
    by propagation) and at WARNING: it logs every collective it traces at INFO."""
    tf_logger = std_logging.getLogger("tensorflow")
    for handler in list(tf_logger.handlers):
        tf_logger.removeHandler(handler)
    tf_logger.propagate = True
    tf_logger.setLevel(std_logging.NOTSET if _debugging() else std_logging.WARNING)


def gate_workers(is_chief: bool, log_all_ranks: bool = False) -> None:
    """After a worker's topology line: only the chief reports progress; other workers keep WARNING+.

    N workers repeating the chief's lines bury the one line that matters (usually a non-chief's
    error). `log_all_ranks=True` leaves every worker at the configured verbosity.
    """
    if not is_chief and not log_all_ranks:
        # With absl's handler on the root logger this sets the root level: Python loggers that
        # inherit it (absl, keras, horovod) are gated alike.
        logging.set_verbosity(logging.WARNING)
    quiet_tensorflow_python()


def _debugging() -> bool:
    return logging.get_verbosity() >= logging.DEBUG


def _tensorflow_dirs() -> tuple[str, ...]:
    """TensorFlow's package directory (as imported and resolved), found without importing it."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return ()
    location = list(spec.submodule_search_locations)[0]
    return tuple({os.path.join(location, ""), os.path.join(os.path.realpath(location), "")})


_TENSORFLOW_DIRS: tuple[str, ...] | None = None


def _drop_tensorflow_info(record: std_logging.LogRecord) -> bool:
    """Handler filter: False (drop) for INFO and DEBUG records logged from TensorFlow's own modules.

    TensorFlow logs its internals at INFO through absl directly, bypassing the `tensorflow` logger's
    level; warnings and errors always pass, and `--verbosity=1` lets everything through.
    """
    global _TENSORFLOW_DIRS
    if record.levelno >= std_logging.WARNING or _debugging():
        return True
    if _TENSORFLOW_DIRS is None:
        _TENSORFLOW_DIRS = _tensorflow_dirs()
    return not record.pathname.startswith(_TENSORFLOW_DIRS)


def format_duration(seconds: float) -> str:
    """Whole seconds as H:MM:SS (hours may exceed 24: '27:46:40'), the form a reader adds to a clock."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
