"""Which shards a node stages: a split's manifest (or its `{split}-*-of-*` files), cut to what its readers read.

Every eval shard is staged (evaluation reads example i on worker i mod W from every file); of the
train shards only those the node's workers read (`Readers`), chosen exactly as tfscale.data.input.pipeline
assigns them: whole files by tfscale.data.input.assignment when there are at least as many files as
workers, else every file. Files are numbered in sorted name order, as the pipeline numbers them.
No TensorFlow, no copying here: `plan` only decides.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Iterable

from absl import logging

from tfscale import io as tfio
from tfscale.config.rules import check_assignment
from tfscale.data.input import assignment


@dataclasses.dataclass(frozen=True)
class Shard:
    """A file to stage and what it must match: the manifest's values, or None without a manifest."""

    name: str
    size_bytes: int | None = None
    sha256: str | None = None
    manifest: str | None = None  # path of the manifest listing it, for error messages


@dataclasses.dataclass(frozen=True)
class Readers:
    """The training workers one node stages train shards for, and how shards are assigned to workers."""

    ranks: tuple[int, ...]  # the node's workers (input pipeline ids)
    num_workers: int  # workers of the whole job
    scheme: str = "disjoint"  # config.data.assignment
    copies: int = 1  # config.data.copies
    level: str = "auto"  # config.data.assignment_level

    def __post_init__(self):
        check_assignment(self.scheme, self.copies, self.num_workers)
        if not self.ranks:
            raise ValueError("no worker ranks given")
        outside = [rank for rank in self.ranks if not 0 <= rank < self.num_workers]
        if outside:
            raise ValueError(f"worker ranks {outside} are not in [0, num_workers={self.num_workers})")

    def file_indices(self, num_files: int) -> list[int]:
        """Sorted indices of the files these workers read, as tfscale.data.input.pipeline assigns them."""
        if assignment.shard_level(num_files, self.num_workers, self.level) == "example":
            return list(range(num_files))  # fewer files than workers: every worker reads every file
        indices = set()
        for rank in self.ranks:
            indices.update(assignment.assign(num_files, rank=rank, num_workers=self.num_workers, scheme=self.scheme,
                                             copies=self.copies))
        return sorted(indices)


def parse_ranks(spec: str) -> tuple[int, ...]:
    """"0,1,2,3", "0-3" or "0-3,8-11" -> sorted distinct ranks; ValueError naming a bad part."""
    ranks = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"worker ranks {spec!r}: {part!r} is not a rank or a range first-last like 0-3")
        first = int(match.group(1))
        ranks.update(range(first, int(match.group(2) or first) + 1))
    return tuple(sorted(ranks))


def _split_manifest(src_dir: str, split: str) -> tuple[str | None, dict | None]:
    """(path, contents) of the manifest of `split` in src_dir, the converter's name first; (None, None)."""
    path = tfio.find_manifest(src_dir, split)
    return (path, tfio.read_manifest_file(path)) if path else (None, None)


def _manifest_shards(manifest: dict, path: str) -> list[Shard]:
    for entry in manifest["shards"]:
        _check_plain_name(entry["name"])  # a manifest names files next to it, never elsewhere
    return [Shard(s["name"], s.get("bytes"), s.get("sha256"), path) for s in manifest["shards"]]


def _named_shards(src_dir: str, split: str) -> list[Shard]:
    """Shards of a split without a manifest: files named `{split}-*-of-*`."""
    pattern = os.path.join(glob.escape(src_dir), f"{split}-*-of-*")
    names = sorted(os.path.basename(p) for p in glob.glob(pattern) if os.path.isfile(p))
    if not names:
        raise FileNotFoundError(f"no {tfio.MANIFEST_FORMAT.format(split=split)} and no shards named {split}-*-of-* "
                                f"in {src_dir}")
    return [Shard(name) for name in names]


def _check_plain_name(name: str) -> None:
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"files must be plain file names in src_dir, got {name!r}")


def _listed_files(src_dir: str, files: Iterable[str]) -> list[Shard]:
    """Exactly `files`, verified against whichever manifest in src_dir lists them."""
    known: dict[str, Shard] = {}
    paths = {p for pattern in tfio.MANIFEST_GLOBS for p in glob.glob(os.path.join(glob.escape(src_dir), pattern))}
    for path in sorted(paths):
        manifest = tfio.read_manifest_file(path)
        known.update({s.name: s for s in _manifest_shards(manifest, path)})
    shards = []
    for name in files:
        _check_plain_name(name)
        shards.append(known.get(name, Shard(name)))
    return shards


def _shards_read_by(readers: Readers, split: str, shards: list[Shard]) -> list[Shard]:
    """The shards of `split` the workers of `readers` read; files are numbered in sorted name order,
    as the input pipeline numbers `{split}-*-of-*`."""
    names = sorted(s.name for s in shards)
    wanted = {names[i] for i in readers.file_indices(len(names))}
    logging.info("staging %d of %d %s shards: those workers %s of %d read (assignment %s)", len(wanted), len(names),
                 split, _ranks_text(readers.ranks), readers.num_workers, readers.scheme)
    return [s for s in shards if s.name in wanted]


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 3) -> "0-3"; anything else comma-separated."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def plan(src_dir: str, splits: Iterable[str], files: Iterable[str] | None, *, train_split: str | None = "train",
         readers: Readers | None = None) -> tuple[list[Shard], list[str], dict[str, list[str]]]:
    """(shards to stage, manifest file names to stage alongside, {split: all its shard names, sorted}).

    Shards without duplicates, in order. With `readers`, of the `train_split` shards only those the
    readers' workers read; other splits whole. `files` stages exactly those files and lists no split.
    """
    shard_lists = {}
    if files is not None:
        shards, manifests = _listed_files(src_dir, files), []
    else:
        shards, manifests = [], []
        for split in splits:
            path, manifest = _split_manifest(src_dir, split)
            if manifest is None:
                split_shards = _named_shards(src_dir, split)
            else:
                split_shards = _manifest_shards(manifest, path)
                manifests.append(os.path.basename(path))
            shard_lists[split] = sorted(s.name for s in split_shards)
            if readers is not None and split == train_split:
                split_shards = _shards_read_by(readers, split, split_shards)
            shards += split_shards
    unique = {s.name: s for s in reversed(shards)}  # reversed: the first listing of a name wins
    return [unique[name] for name in dict.fromkeys(s.name for s in shards)], list(dict.fromkeys(manifests)), shard_lists
