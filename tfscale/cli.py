"""What every tfscale command-line tool does the same way: flags, absl.app, bad input as one line.

Training-like commands (`--config=FILE[:ARG] --workdir=DIR [--config.x.y=v ...]`: train, benchmark,
export's helpers) start with `run_cli(main, ...)`; a config error ends them with one FATAL line.
Other tools:

    def _job(f: flags.FlagValues) -> None:
        do_the_work(f.input_dir, ...)          # raise ValueError/OSError for bad input

    def run(argv=None):
        cli.run_tool(_job, define_flags=_define_flags, argv=argv)

(`takes_arguments=True` for a tool with positional arguments, as the study runner.) A command that runs
another command (`tfscale.launch [flags] -- <python args...>`) parses its own flags with `split_command`.

No TensorFlow here: tools that must start fast (staging) use it too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Iterable, Sequence

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from tfscale import config as tfs_config
from tfscale import errors, logs

# Bad input (a missing directory, a wrong count): the message says it all, a traceback adds nothing.
INPUT_ERRORS = (ValueError, OSError)


def import_extra(module: str, *, tool: str, package: str, extra: str, why: str):
    """`module` imported; when `package` is not installed (`pip install ".[cpu]"` leaves extras out),
    exits 1 with one line naming the pip command of tfscale's extra `extra` that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        sys.exit(f'error: {tool} needs {package} ({why}): pip install ".[{extra}]" in the tfscale checkout '
                 f"(or pip install {package})")


def make_key_flags(names: Iterable[str]) -> None:
    """Lists flags defined in a library module under the main script's `--help` (absl shows only the key
    flags of sys.argv[0]: `python -m tfscale.x`'s shim or a `tfscale-*` console script, which define none)."""
    for name in names:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def adopt_usage(module_name: str) -> None:
    """Gives a console script (whose generated __main__ has no docstring) the usage text of the tool's module,
    which absl prints at the top of --help, as `python -m` prints it."""
    main = sys.modules.get("__main__")
    if main is not None and not main.__doc__:
        main.__doc__ = sys.modules[module_name].__doc__


def define_key_flags(define_flags: Callable[[], None]) -> None:
    """Runs `define_flags` and makes every flag it defined a key flag: the tool's --help lists them."""
    before = set(flags.FLAGS)
    define_flags()
    make_key_flags(sorted(set(flags.FLAGS) - before))


def run_tool(job: Callable[..., object], *, define_flags: Callable[[], None],
             errors: tuple[type[BaseException], ...] = INPUT_ERRORS, argv: list[str] | None = None,
             takes_arguments: bool = False) -> None:
    """Defines the flags, then runs job(FLAGS) under absl.app; exits 1 with one error line on `errors`.

    Positional arguments are a usage error, unless `takes_arguments`: then the job is called as
    job(FLAGS, arguments) and judges them itself. Anything else a job raises (a bug) keeps its traceback;
    a job may end the process itself (sys.exit) with its own code.
    """
    define_key_flags(define_flags)
    adopt_usage(job.__module__)

    def main(argv: list[str]) -> int:
        if len(argv) > 1 and not takes_arguments:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        try:
            job(flags.FLAGS, argv[1:]) if takes_arguments else job(flags.FLAGS)
        except errors as e:  # bad input: one clear line, no traceback
            logging.error("%s", e)
            return 1
        return 0

    app.run(main, argv=argv)


# --- commands that run a command: `LAUNCHER [flags] -- <command ...>` ----------------------------------------


class UsageError(ValueError):
    """A command line that cannot run; the launcher prints its usage with it and exits with EXIT_USAGE."""


def split_command(argv: Sequence[str], define_flags: Callable[[flags.FlagValues], None], *,
                  command_hint: str) -> tuple[flags.FlagValues, list[str]]:
    """(the launcher's flags, the command after `--`): absl flags as every tfscale tool takes them before
    `--`, the command after it never parsed here. UsageError naming what is wrong: a flag absl refuses, an
    argument before `--`, or no command (`command_hint` shows one)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1:]
    values = flags.FlagValues()
    define_flags(values)
    try:
        extra = values(["launcher", *own])[1:]
    except flags.Error as err:
        raise UsageError(str(err)) from None
    if extra:
        raise UsageError(f"unexpected arguments before --: {' '.join(extra)}")
    if not command:
        raise UsageError(f"nothing to run: put the command after --, e.g. -- {command_hint}")
    return values, command


def usage_text(usage: str, values: flags.FlagValues, module: str) -> str:
    """`usage: ...` and the help of the flags `module` defined, as --help prints it."""
    return f"usage: {usage}\n\n{values.module_help(module)}\n"


# --- --config / --workdir commands ------------------------------------------------------------------


def _innermost_config_error(err: BaseException | None) -> errors.ConfigError | None:
    """The first ConfigError raised under `err` (absl and ml_collections wrap a recipe's own)."""
    found = None
    while err is not None:
        found = err if isinstance(err, errors.ConfigError) else found
        err = err.__context__
    return found


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing for the CLIs, with a one-line error for a config key that does not exist
    or a recipe that refuses its `:variant`."""
    try:
        return flags.FLAGS(argv)
    except flags.IllegalFlagValueError as err:
        refused = _innermost_config_error(err)
        if refused is None:
            raise
        sys.exit(errors.fatal("config", refused))
    except (AttributeError, KeyError) as err:  # raised by the locked ConfigDict
        message = err
        while isinstance(message, BaseException) and message.args:  # unwrap AttributeError(KeyError(str))
            message = message.args[0]
        overrides = " ".join(a for a in argv[1:] if a.startswith("--config."))
        sys.exit(f"FATAL unknown config key among {overrides}: {' '.join(str(message).split())}")


# The keys this process's command line set (`--config.x.y=v`), recorded by run_cli: a count given there is
# the user's statement about the data, which the data's own count never replaces (tfscale.data.input.info.adopt).
_command_line_keys: frozenset[str] = frozenset()


def command_line_keys() -> frozenset[str]:
    """Dotted keys (`data.num_classes`) set by `--config.*` flags of this process's CLI; empty outside run_cli."""
    return _command_line_keys


def config_help(what: str) -> str:
    """--config's help: `what` it is, how it is given, and the bundled recipes with their variants."""
    return (f"{what}: a config file (PATH[:ARG]), or a bundled recipe by name, e.g. r50_32gpu:amp. Any key can be "
            "overridden: --config.data.data_dir=/scratch/imagenet --config.train.epochs=10. Bundled recipes:\n"
            + tfs_config.files.recipes_help())


def run_cli(main: Callable[[ml_collections.ConfigDict, str], object], workdir_help: str) -> None:
    """Runs a `--config=FILE[:ARG] --workdir=DIR [--config.x.y=v ...]` command: `main(config, workdir)`.

    The flags are defined here, when a CLI starts, not at import: train, benchmark and the test
    helpers all take `--config`/`--workdir`, and a process that imports several of them (pytest, a
    study driver) would otherwise define the flags twice.
    """
    # The config flag reads sys.argv itself (to find the --config.* overrides), so resolve it there.
    sys.argv = [tfs_config.resolve_config_arg(arg) for arg in sys.argv]
    config = config_flags.DEFINE_config_file("config", None, config_help("The recipe to run"), lock_config=True)
    workdir = flags.DEFINE_string("workdir", None, workdir_help)
    flags.mark_flags_as_required(["config", "workdir"])
    make_key_flags(["config", "workdir"])
    adopt_usage(main.__module__)

    def app_main(argv):
        global _command_line_keys
        logs.configure()  # absl's handler is in place now: make it the only one, TensorFlow's INFO off
        _command_line_keys = frozenset(config_flags.get_override_values(flags.FLAGS["config"]))
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        try:
            main(config.value, workdir.value)
        except errors.ConfigError as err:
            sys.exit(errors.fatal("config", err))

    app.run(app_main, flags_parser=parse_flags)
