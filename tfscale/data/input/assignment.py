"""Which data each worker reads: pure Python (no TensorFlow), the same answer on every worker.

M workers, N items (shard files, or examples: see `shard_level`), C copies of every item
(1 <= C <= M). The schemes are those of the data-assignment study tfscale reruns (ResNet-20 on
CIFAR-10, up to 16 workers); items are cut into residue classes i mod S, which are the study's
"shards" of the shuffled data (shard files are already in random order, and every worker shuffles
its own items with its own seed downstream):

* ``disjoint`` (C = 1): S = M shards, worker r reads shard r. Every item once; sizes within 1.
* ``full`` (C = M): every worker reads everything.
* ``coarse`` (C must divide M): S = M/C shards, worker r reads shard r mod S. Groups of C workers
  (r, r+S, r+2S, ...) hold identical data, and workers of different groups share nothing.
* ``medium_coarse``: S = M shards, worker r reads shards r, r+1, ..., r+C-1 (mod M). Worker r
  shares data with the 2C-2 workers r-C+1..r+C-1 (2C-1 intersecting workers counting itself), and no
  two workers hold equal data (C < M).
* ``fine_grained``: every item goes to C workers chosen so that all pairs of workers share about
  the same number of items (the study's "fine-grained" assignment; `pairwise_intersections` measures
  it). Construction: items come in rounds of M; in round q the item at position p goes to the workers
  (p + d) mod M for d in an offset set D_q, a C-subset of Z_M containing 0. The rounds cycle
  through the C-subsets containing 0 in a fixed shuffled order: over a whole cycle every difference
  d - d' (d, d' in D_q) occurs equally often, so every pair of workers shares exactly the same
  number of items (a translation argument: every pair (a, b) with b - a = delta shares one item of a
  round per pair of offsets differing by delta). When there are more than `MAX_FINE_GRAINED_ROUNDS`
  such subsets (large M and C), the cycle is that many of them drawn at random; the intersections are
  then equal up to sampling noise (a few % at M=32, C=8). Every worker gets exactly C items per
  round, so sizes differ only through the last, incomplete round.
* ``overlap``: C copies spread evenly around the ring: item i goes to workers (i + floor(k*M/C)) mod M,
  k = 0..C-1; sizes always within 1 of C*N/M. When C divides M this is exactly ``coarse`` (kept under
  its earlier name); otherwise the workers' sets overlap in a chain, neither coarse nor fine-grained.

Every scheme is periodic in the item index: worker r reads item i iff `pattern(...)[i % period]`. The
pipeline applies the same pattern to a TensorFlow example index (`tf.gather`), so example-level
sharding gives exactly the sets `assign` gives. The assignment takes no seed: every worker must
compute the same partition, so it may depend only on the sizes and the scheme (fine_grained's shuffle
of offset sets uses a fixed one).
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import numpy as np

from tfscale.config.names import ASSIGNMENT_LEVELS
from tfscale.config.rules import check_assignment, num_copies

# fine_grained: offset sets per cycle when not all C-subsets are used (the pattern holds this many x M items).
MAX_FINE_GRAINED_ROUNDS = 8192


@functools.lru_cache(maxsize=64)
def fine_grained_offsets(num_workers: int, copies: int) -> tuple[tuple[int, ...], ...]:
    """The offset sets D_q of fine_grained, one per round of a cycle (see the module docstring)."""
    rng = random.Random(f"tfscale fine_grained {num_workers} {copies}")  # str seeds hash the same in every process
    others = range(1, num_workers)
    if math.comb(num_workers - 1, copies - 1) <= MAX_FINE_GRAINED_ROUNDS:
        rounds = [(0, *rest) for rest in itertools.combinations(others, copies - 1)]
        rng.shuffle(rounds)
    else:
        rounds = [(0, *sorted(rng.sample(others, copies - 1))) for _ in range(MAX_FINE_GRAINED_ROUNDS)]
    return tuple(rounds)


@functools.lru_cache(maxsize=256)
def pattern(*, rank: int, num_workers: int, scheme: str, copies: int = 1) -> tuple[bool, ...]:
    """Worker `rank` reads item i iff `pattern[i % len(pattern)]`."""
    check_assignment(scheme, copies, num_workers)
    if not isinstance(rank, int) or not 0 <= rank < num_workers:
        raise ValueError(f"rank={rank!r} must be in [0, num_workers={num_workers})")
    m, c, r = num_workers, copies, rank
    if scheme == "full":
        return (True,)
    if scheme == "disjoint":
        return tuple(i == r for i in range(m))
    if scheme == "coarse":
        groups = m // c  # S shards; worker r reads shard r mod S
        return tuple(i == r % groups for i in range(groups))
    if scheme == "medium_coarse":
        return tuple((i - r) % m < c for i in range(m))
    if scheme == "overlap":
        return tuple(((i - r) * c) % m < c for i in range(m))
    # fine_grained: item p of round q goes to (p + d) mod M for d in D_q, so r reads it iff (r - p) mod M is in D_q.
    return tuple((r - p) % m in offsets for offsets in map(set, fine_grained_offsets(m, c)) for p in range(m))


def worker_keeps(index, *, rank: int, num_workers: int, scheme: str, copies: int = 1):
    """True where worker `rank` reads item `index` (a Python int)."""
    keep = pattern(rank=rank, num_workers=num_workers, scheme=scheme, copies=copies)
    return keep[index % len(keep)]


def assign(num_items: int, *, rank: int, num_workers: int, scheme: str, copies: int = 1) -> list[int]:
    """The sorted item indices worker `rank` reads (see the module docstring for the schemes)."""
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"num_items must be an int >= 0, got {num_items!r}")
    keep = pattern(rank=rank, num_workers=num_workers, scheme=scheme, copies=copies)
    period = len(keep)
    return [i for start in range(0, num_items, period) for i in range(start, min(start + period, num_items))
            if keep[i - start]]


def membership(num_items: int, *, num_workers: int, scheme: str, copies: int = 1) -> np.ndarray:
    """[M, N] bool matrix: worker r reads item i."""
    rows = []
    for rank in range(num_workers):
        keep = np.array(pattern(rank=rank, num_workers=num_workers, scheme=scheme, copies=copies))
        rows.append(np.resize(keep, num_items))  # np.resize repeats the period
    return np.stack(rows) if rows else np.zeros([0, num_items], bool)


def pairwise_intersections(num_items: int, *, num_workers: int, scheme: str, copies: int = 1) -> np.ndarray:
    """[M, M] int matrix: items read by both worker a and worker b (the diagonal: each worker's count).

    Counted over one period of the patterns, times the whole periods, plus the last partial one: the
    cost does not grow with the number of items (ImageNet's examples at the example level).
    """
    scheme_args = dict(num_workers=num_workers, scheme=scheme, copies=copies)
    period = int(np.lcm.reduce([len(pattern(rank=r, **scheme_args)) for r in range(num_workers)]))
    whole, rest = divmod(num_items, period)
    one_period = membership(period, **scheme_args).astype(np.float64)  # float: BLAS; counts stay exact
    partial = one_period[:, :rest]
    counts = whole * np.rint(one_period @ one_period.T) + np.rint(partial @ partial.T)
    return counts.astype(np.int64)


def report(num_items: int, *, num_workers: int, scheme: str, copies: int = 1, item: str = "examples") -> dict:
    """What a run's start-up line says about its assignment: C, C/M, items per worker, pairwise overlap."""
    c = num_copies(scheme, copies, num_workers)
    shared = pairwise_intersections(num_items, num_workers=num_workers, scheme=scheme, copies=copies)
    per_worker = np.diag(shared)
    pairs = shared[~np.eye(num_workers, dtype=bool)]
    return {
        "scheme": scheme, "copies": c, "copies_fraction": c / num_workers, "num_workers": num_workers,
        "item": item, "num_items": num_items,
        "items_per_worker_min": int(per_worker.min()), "items_per_worker_max": int(per_worker.max()),
        "pairwise_intersection_min": int(pairs.min()) if pairs.size else None,
        "pairwise_intersection_max": int(pairs.max()) if pairs.size else None,
    }


def describe(summary: dict) -> str:
    """`report`'s dict as the one log line a run prints at start-up."""
    line = (f"data assignment {summary['scheme']}: C={summary['copies']} copies of each of {summary['num_items']} "
            f"{summary['item']} over M={summary['num_workers']} workers (C/M={summary['copies_fraction']:.3g}); "
            f"{summary['items_per_worker_min']}-{summary['items_per_worker_max']} {summary['item']} per worker")
    if summary["pairwise_intersection_min"] is not None:
        line += (f"; any two workers share {summary['pairwise_intersection_min']}-"
                 f"{summary['pairwise_intersection_max']} {summary['item']}")
    return line


def shard_level(num_files: int, num_workers: int, level: str = "auto") -> str:
    """"file" or "example": what the scheme assigns. "auto" gives whole files when every worker can get
    some (num_files >= num_workers), else examples (every worker reads every file and keeps its own)."""
    if level not in ASSIGNMENT_LEVELS:
        raise ValueError(f"assignment level {level!r} is not one of {ASSIGNMENT_LEVELS}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_files < 1:
        raise ValueError(f"num_files must be >= 1, got {num_files}")
    if level == "file" and num_files < num_workers:
        raise ValueError(f"assignment level 'file' needs at least as many files as workers: {num_files} files, "
                         f"{num_workers} workers (use 'example' or 'auto', or write more shards)")
    if level != "auto":
        return level
    return "file" if num_files >= num_workers else "example"
