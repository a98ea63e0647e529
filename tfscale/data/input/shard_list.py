"""The shard list a staged copy carries: `.tfscale-shards.json` in a staging destination, {split: every
source shard name, in reading order}. Staging (tfscale.data.stage) writes it; the input pipeline reads
it to number a node's partial copy as the full directory is numbered, so each worker still picks its own
shards. Plain os and json (staging does not import TensorFlow).
"""

from __future__ import annotations

import json
import os

from tfscale import io as tfio

SHARD_LIST_FILE = ".tfscale-shards.json"  # {split: source shard names}: how workers number a partial copy
_VERSION = 1


def read_shard_list(data_dir: str, split: str) -> list[str] | None:
    """Names of every `split` shard of the source `data_dir` was staged from, in reading order; None when
    data_dir is not a staging destination of that split. The copy may hold only some of them (`Readers`).
    """
    path = os.path.join(data_dir, SHARD_LIST_FILE)
    try:
        with open(path) as f:
            names = json.load(f)["splits"][split]
    except (OSError, ValueError, KeyError, TypeError):  # absent (not staged here) or unreadable
        return None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return None
    outside = [n for n in names if not tfio.is_plain_file_name(n)]
    if outside:  # the input pipeline would read a file outside the copy
        raise ValueError(f"{path} lists {split} shard {outside[0]!r}: shard names must be plain file names in {data_dir}")
    return names


def save_shard_lists(dest_dir: str, shard_lists: dict[str, list[str]]) -> None:
    """Records (merged with other splits already recorded) how the staged splits' shards are numbered."""
    path = os.path.join(dest_dir, SHARD_LIST_FILE)
    try:
        with open(path) as f:
            recorded = dict(json.load(f)["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    if all(recorded.get(split) == names for split, names in shard_lists.items()):
        return
    recorded.update(shard_lists)
    tfio.write_json(path, {"version": _VERSION, "splits": recorded}, indent=0, sort_keys=True)
