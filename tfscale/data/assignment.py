"""Which data each worker reads: pure Python (no TensorFlow), the same answer on every worker.

M workers, N items (shard files, or examples when there are fewer files than workers; see
`shard_level`). Three schemes:

* ``disjoint`` (default): worker r gets the items i with i mod M == r; every item is read by
  exactly one worker, and worker sizes differ by at most 1.
* ``overlap`` with C copies (1 <= C <= M): every item is read by exactly C distinct workers and each
  worker gets floor(C*N/M) or ceil(C*N/M) items. C=1 is exactly `disjoint`, C=M exactly `full`.
* ``full``: every worker gets every item (each worker shuffles with its own seed; the pipeline's job).

Construction of ``overlap``: item i goes to workers (i + floor(k*M/C)) mod M for k = 0..C-1, i.e. its
C copies are spread evenly around the ring of workers. Worker r therefore holds the residue classes
(r - floor(k*M/C)) mod M. Spreading the copies (rather than giving item i to the C *consecutive*
workers i, i+1, ..., i+C-1) is what keeps the counts within 1 when M does not divide N: the residues
0..(N mod M)-1 that carry one extra item form a contiguous block, and a set of C evenly spaced
residues meets any contiguous block in floor or ceil of C*(N mod M)/M places, whereas C consecutive
residues can meet it in anywhere from max(0, C + (N mod M) - M) to min(C, N mod M) places (e.g. N=6,
M=4, C=2: consecutive gives 4,3,2,3 items; spread gives 3,3,3,3). When C divides M the spread
construction gives workers r, r + M/C, r + 2M/C, ... identical item sets (M/C groups, each holding
every item once); otherwise the sets overlap in a chain.

The assignment takes no seed: every worker must compute the same partition, so it may depend only
on the sizes and the scheme. Item order is randomised by the per-worker shuffle downstream (the
pipeline's job, with a per-worker seed), and shard files are already in random order.

`worker_keeps` is the per-index membership test of the same construction written with only
+, -, *, % and comparisons, so the pipeline can apply it to a TF int64 example index inside
`Dataset.filter` (example-level sharding) and get exactly the sets `assign` gives.
"""

from __future__ import annotations

SCHEMES = ("disjoint", "overlap", "full")


def check(scheme: str, copies: int, num_workers: int) -> None:
    """ValueError naming the bad value: unknown scheme, num_workers < 1, or (for `overlap`) copies
    outside [1, num_workers]. `copies` is ignored by `disjoint` and `full`.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"assignment scheme {scheme!r} is not one of {SCHEMES}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if scheme == "overlap":
        if isinstance(copies, bool) or not isinstance(copies, int):
            raise ValueError(f"copies must be an int, got {copies!r}")
        if not 1 <= copies <= num_workers:
            raise ValueError(
                f"copies={copies} must be in [1, num_workers={num_workers}] for scheme 'overlap' "
                f"(1 = disjoint, {num_workers} = full)"
            )


def _width(scheme: str, copies: int, num_workers: int) -> int:
    """Copies of each item: 1 (disjoint), C (overlap), M (full)."""
    return {"disjoint": 1, "overlap": copies, "full": num_workers}[scheme]


def worker_keeps(index, *, rank: int, num_workers: int, scheme: str, copies: int = 1):
    """True where worker `rank` reads item `index`; `index` may be an int or an integer tensor.

    Same sets as `assign`: item i is kept iff ((i - rank) * C) mod M < C (C = 1 for disjoint, M for
    full), i.e. iff (rank - i) mod M is one of the offsets floor(k*M/C).
    """
    check(scheme, copies, num_workers)
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank={rank} must be in [0, num_workers={num_workers})")
    width = _width(scheme, copies, num_workers)
    return ((index - rank) * width) % num_workers < width


def assign(num_items: int, *, rank: int, num_workers: int, scheme: str, copies: int = 1) -> list[int]:
    """The sorted item indices worker `rank` reads (see the module docstring for the schemes)."""
    check(scheme, copies, num_workers)
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"num_items must be an int >= 0, got {num_items!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_workers:
        raise ValueError(f"rank={rank!r} must be in [0, num_workers={num_workers})")
    if scheme == "full":
        return list(range(num_items))
    width = _width(scheme, copies, num_workers)
    # Worker r holds the residue classes (r - floor(k*M/C)) mod M, k = 0..C-1.
    residues = {(rank - k * num_workers // width) % num_workers for k in range(width)}
    return sorted(i for r in residues for i in range(r, num_items, num_workers))


def shard_level(num_files: int, num_workers: int) -> str:
    """"file" when every worker can get whole files (num_files >= num_workers), else "example"."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_files < 1:
        raise ValueError(f"num_files must be >= 1, got {num_files}")
    return "file" if num_files >= num_workers else "example"
