"""tfscale.errors: one owner of the named errors and exit codes, and the table users read them from."""

import os
import re

import pytest
from conftest import REPO

from tfscale import errors


def documented_exit_codes() -> set[int]:
    """The codes of docs/reliability.md's exit-code table (rows `| 65 | ...`)."""
    with open(os.path.join(REPO, "docs", "reliability.md")) as f:
        return {int(code) for code in re.findall(r"^\| (\d+) \|", f.read(), re.M)}


def test_every_exit_code_is_in_the_reliability_table_and_every_row_is_one_of_them():
    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_")} - {errors.EXIT_USAGE}
    assert documented_exit_codes() == codes | {0}


@pytest.mark.parametrize("err, code", [
    (errors.Preempted(7), errors.EXIT_PREEMPTED), (errors.WorkdirBusy("x"), errors.EXIT_WORKDIR_BUSY),
    (errors.WriteError("x"), errors.EXIT_WRITE_FAILED), (errors.ConfigError("x"), errors.EXIT_CONFIG),
    (errors.CheckpointError("x"), errors.EXIT_CHECKPOINT), (errors.MissingDataError("x"), errors.EXIT_MISSING_DATA),
    (errors.CorruptDataError("x"), errors.EXIT_CORRUPT_DATA), (errors.ManifestError("x"), errors.EXIT_CORRUPT_DATA),
    (errors.ChiefRefused(73), 73), (RuntimeError("a bug"), 1)])
def test_each_error_ends_the_process_with_its_code(err, code):
    assert errors.exit_code(err) == code


def test_a_fatal_line_is_one_line_naming_the_kind_and_the_code():
    err = errors.MissingDataError("no TFRecord shards named validation-*-of-* in /scratch/shards")
    assert errors.fatal("data", err, errors.exit_code(err)) == (
        "FATAL data error: no TFRecord shards named validation-*-of-* in /scratch/shards (exit code 66)")
    assert errors.one_line(ValueError("{{function_node __inference_step_42}} bad\n  value")) == "bad value"
