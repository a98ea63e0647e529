"""What every tfscale command-line tool does the same way: flags, absl.app, bad input as one line.

    def _job(f: flags.FlagValues) -> None:
        do_the_work(f.input_dir, ...)          # raise ValueError/OSError for bad input

    def run(argv=None):
        cli.run_tool(_job, define_flags=_define_flags, argv=argv)

No TensorFlow here: tools that must start fast (staging) use it too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Iterable

from absl import app, flags, logging

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
    """Lists flags defined in a library module under the main script's `--helpshort` (absl shows only
    the key flags of sys.argv[0], and these are defined elsewhere)."""
    for name in names:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def run_tool(job: Callable[[flags.FlagValues], object], *, define_flags: Callable[[], None],
             errors: tuple[type[BaseException], ...] = INPUT_ERRORS, argv: list[str] | None = None) -> None:
    """Defines the flags, then runs job(FLAGS) under absl.app; exits 1 with one error line on `errors`.

    Positional arguments are a usage error: every tool here takes flags only. Anything else a job
    raises (a bug) keeps its traceback.
    """
    define_flags()

    def main(argv: list[str]) -> int:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        try:
            job(flags.FLAGS)
        except errors as e:  # bad input: one clear line, no traceback
            logging.error("%s", e)
            return 1
        return 0

    app.run(main, argv=argv)
