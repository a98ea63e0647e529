"""tfscale.data.input.assignment: who reads which items, for every scheme and awkward sizes."""

import collections
import itertools
import math

import numpy as np
import pytest

from tfscale.config import names, rules
from tfscale.data.input import assignment

# (N items, M workers): N < M, N not divisible by M, N divisible by M, single worker, empty.
SIZES = [(0, 3), (1, 1), (1, 4), (3, 5), (5, 5), (6, 4), (7, 3), (10, 4), (17, 6), (64, 8), (100, 7), (1024, 48)]


def _all(num_items, num_workers, scheme, copies=1):
    return [assignment.assign(num_items, rank=r, num_workers=num_workers, scheme=scheme, copies=copies)
            for r in range(num_workers)]


def _cases():
    for n, m in SIZES:
        for c in range(1, m + 1):
            yield n, m, c


@pytest.mark.parametrize("n,m", SIZES)
def test_disjoint_covers_every_item_exactly_once(n, m):
    shares = _all(n, m, "disjoint")
    assert sorted(itertools.chain(*shares)) == list(range(n))
    for r, share in enumerate(shares):
        assert share == [i for i in range(n) if i % m == r]
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n,m,c", list(_cases()))
def test_overlap_gives_each_item_to_exactly_c_workers_balanced(n, m, c):
    shares = _all(n, m, "overlap", c)
    readers = collections.defaultdict(set)
    for r, share in enumerate(shares):
        assert share == sorted(set(share)), "no duplicates, sorted"
        for i in share:
            readers[i].add(r)
    assert set(readers) == set(range(n))
    assert all(len(w) == c for w in readers.values())
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert sum(sizes) == c * n
    for i in range(n):  # the documented construction: item i goes to workers (i + floor(k*M/C)) mod M
        assert sorted(readers[i]) == sorted({(i + k * m // c) % m for k in range(c)})


@pytest.mark.parametrize("n,m", SIZES)
def test_full_gives_everything_to_everyone(n, m):
    assert _all(n, m, "full") == [list(range(n))] * m


@pytest.mark.parametrize("n,m", SIZES)
def test_overlap_extremes_equal_disjoint_and_full(n, m):
    assert _all(n, m, "overlap", 1) == _all(n, m, "disjoint")
    assert _all(n, m, "overlap", m) == _all(n, m, "full")


def test_balance_where_consecutive_copies_would_not_be():
    # Giving item i to workers i, i+1 (mod 4) would yield sizes 4, 3, 2, 3 here.
    assert [len(s) for s in _all(6, 4, "overlap", 2)] == [3, 3, 3, 3]


def test_partition_takes_no_seed():
    # The pipeline shuffles with a per-worker seed; all workers must still agree on the partition, so
    # assign cannot take one (a seed it ignored would suggest a shuffle that does not happen).
    with pytest.raises(TypeError, match="seed"):
        assignment.assign(10, rank=1, num_workers=4, scheme="overlap", copies=3, seed=1)
    assert assignment.assign(10, rank=1, num_workers=4, scheme="overlap", copies=3) == \
        assignment.assign(10, rank=1, num_workers=4, scheme="overlap", copies=3)


def _ceil_div(a, b):
    return -(-a // b)


@pytest.mark.parametrize("n,m,c", list(_cases()))
def test_share_sizes_are_ceil_and_floor_of_copies_times_items_over_workers(n, m, c):
    # What one worker reads per pass (epoch accounting): ceil(C*N/M) at most, one less at least.
    for scheme in ("disjoint", "overlap", "full"):
        copies = c if scheme == "overlap" else 1
        if scheme != "overlap" and c > 1:
            continue
        width = {"disjoint": 1, "overlap": copies, "full": m}[scheme]
        sizes = [len(s) for s in _all(n, m, scheme, copies)]
        assert max(sizes) == _ceil_div(width * n, m)
        assert min(sizes) >= _ceil_div(width * n, m) - 1


def test_share_sizes_on_imagenet():
    # Worker 0 holds one of the largest shares (residue 0 carries an extra item whenever M does not divide N).
    def share(scheme, copies=1):
        return len(assignment.assign(1_281_167, rank=0, num_workers=8, scheme=scheme, copies=copies))

    assert share("disjoint") == 160_146
    assert share("overlap", 2) == 320_292
    assert share("full") == 1_281_167
    assert share("full", 5) == 1_281_167  # copies ignored


@pytest.mark.parametrize("n,m,c", [(n, m, c) for n, m, c in _cases() if m <= 8])
def test_worker_keeps_matches_assign(n, m, c):
    for scheme in names.ASSIGNMENT_SCHEMES:
        if scheme == "coarse" and m % c:
            continue
        for r in range(m):
            keep = [i for i in range(n) if assignment.worker_keeps(i, rank=r, num_workers=m, scheme=scheme, copies=c)]
            assert keep == assignment.assign(n, rank=r, num_workers=m, scheme=scheme, copies=c)


# --- the study's named schemes -------------------------------------------------------------------------------

# (N, M, C): the study's 16 workers, CIFAR-10's 45k/50k, the digits' 1,797 scans, awkward remainders.
STUDY_SIZES = [(50_000, 16, 2), (50_000, 16, 4), (50_000, 16, 8), (45_000, 16, 3), (1_797, 4, 2), (1_797, 4, 3),
               (100, 8, 4), (60_000, 4, 2), (1_000, 6, 3), (97, 5, 2)]


def _readers(n, m, scheme, c):
    held = assignment.membership(n, num_workers=m, scheme=scheme, copies=c)
    return held.sum(axis=0), held


# coarse needs C | M (other sizes are refused: test_coarse_refuses_copies_not_dividing_the_workers)
@pytest.mark.parametrize("scheme,n,m,c", [(scheme, n, m, c) for scheme in ("coarse", "medium_coarse", "fine_grained")
                                          for n, m, c in STUDY_SIZES if scheme != "coarse" or m % c == 0])
def test_every_example_has_exactly_c_copies(scheme, n, m, c):
    copies_per_item, held = _readers(n, m, scheme, c)
    assert (copies_per_item == c).all()
    for r in range(m):  # the matrix and assign agree
        assert np.flatnonzero(held[r]).tolist() == assignment.assign(n, rank=r, num_workers=m, scheme=scheme, copies=c)


@pytest.mark.parametrize("n,m,c", [(n, m, c) for n, m, c in STUDY_SIZES if m % c == 0])
def test_coarse_forms_groups_of_c_workers_holding_equal_data(n, m, c):
    _, held = _readers(n, m, "coarse", c)
    shards = m // c  # S
    for a in range(m):
        for b in range(m):
            same_group = a % shards == b % shards
            assert (held[a] == held[b]).all() == same_group
            if not same_group:
                assert not (held[a] & held[b]).any()
    assert assignment.assign(n, rank=1, num_workers=m, scheme="coarse", copies=c) == list(range(1 % shards, n, shards))
    # The spread construction `overlap` is coarse whenever C divides M.
    assert _all(n, m, "overlap", c) == _all(n, m, "coarse", c)


def test_coarse_refuses_copies_not_dividing_the_workers():
    with pytest.raises(ValueError, match=r"copies=3 must divide num_workers=16.*\[1, 2, 4, 8, 16\].*medium_coarse"):
        rules.check_assignment("coarse", 3, 16)


@pytest.mark.parametrize("n,m,c", [(n, m, c) for n, m, c in STUDY_SIZES if c < m])
def test_medium_coarse_gives_2c_minus_1_intersecting_workers_none_equal(n, m, c):
    _, held = _readers(n, m, "medium_coarse", c)
    for a in range(m):
        neighbours = {b for b in range(m) if (held[a] & held[b]).any()}
        assert neighbours == {(a + d) % m for d in range(-(c - 1), c)}  # a-C+1 .. a+C-1
        assert len(neighbours) == min(m, 2 * c - 1)
        assert not any((held[a] == held[b]).all() for b in range(m) if b != a)
    # worker i reads shards i .. i+C-1 (shard j: items j mod M)
    assert assignment.assign(3 * m, rank=m - 1, num_workers=m, scheme="medium_coarse", copies=c) == sorted(
        i for i in range(3 * m) if (i - (m - 1)) % m < c)


@pytest.mark.parametrize("n,m,c", STUDY_SIZES)
def test_fine_grained_pairwise_intersections_are_near_equal(n, m, c):
    shared = assignment.pairwise_intersections(n, num_workers=m, scheme="fine_grained", copies=c)
    pairs = shared[~np.eye(m, dtype=bool)]
    expected = n * c * (c - 1) / (m * (m - 1))  # E|A and B| when every C-subset is equally likely
    sizes = np.diag(shared)
    assert sizes.max() - sizes.min() <= c  # exactly C per round of M items; the last round is partial
    if n >= 1000:
        assert pairs.min() > 0
        assert pairs.max() / pairs.min() < 1.05, (pairs.min(), pairs.max(), expected)
        assert abs(pairs.mean() - expected) / expected < 0.01
    # Compare: coarse and medium_coarse leave many pairs sharing nothing (when C < M/2).
    if 2 * c < m:
        medium = assignment.pairwise_intersections(n, num_workers=m, scheme="medium_coarse", copies=c)
        assert medium[~np.eye(m, dtype=bool)].min() == 0


def test_fine_grained_is_exactly_equal_over_a_whole_cycle():
    # M=8, C=3: the 21 offset sets containing 0 make a cycle of 21 rounds of 8 items.
    m, c = 8, 3
    rounds = len(assignment.fine_grained_offsets(m, c))
    assert rounds == math.comb(m - 1, c - 1) == 21
    for cycles in (1, 3):
        shared = assignment.pairwise_intersections(cycles * rounds * m, num_workers=m, scheme="fine_grained", copies=c)
        pairs = shared[~np.eye(m, dtype=bool)]
        assert pairs.min() == pairs.max() == cycles * c * math.comb(m - 2, c - 2)  # the translation argument
        assert (np.diag(shared) == cycles * rounds * c).all()


def test_limiting_cases_equal_disjoint_and_full():
    for scheme in ("coarse", "medium_coarse", "fine_grained"):
        assert _all(101, 4, scheme, 1) == _all(101, 4, "disjoint")
        assert _all(101, 4, scheme, 4) == _all(101, 4, "full")


def test_report_states_copies_sizes_and_intersections():
    summary = assignment.report(1797, num_workers=4, scheme="coarse", copies=2)
    assert summary == {
        "scheme": "coarse", "copies": 2, "copies_fraction": 0.5, "num_workers": 4, "item": "examples",
        "num_items": 1797, "items_per_worker_min": 898, "items_per_worker_max": 899,
        "pairwise_intersection_min": 0, "pairwise_intersection_max": 899,
    }
    assert assignment.describe(summary) == (
        "data assignment coarse: C=2 copies of each of 1797 examples over M=4 workers (C/M=0.5); 898-899 examples "
        "per worker; any two workers share 0-899 examples")
    assert assignment.report(10, num_workers=1, scheme="full")["pairwise_intersection_min"] is None


def test_shard_level():
    assert assignment.shard_level(1024, 8) == "file"
    assert assignment.shard_level(8, 8) == "file"
    assert assignment.shard_level(7, 8) == "example"
    assert assignment.shard_level(1, 1) == "file"
    assert assignment.shard_level(1024, 8, "example") == "example"
    with pytest.raises(ValueError, match="'file' needs at least as many files as workers: 7 files, 8 workers"):
        assignment.shard_level(7, 8, "file")
    with pytest.raises(ValueError, match="num_workers"):
        assignment.shard_level(4, 0)


def test_check_errors_name_the_values():
    with pytest.raises(ValueError, match=r"'bogus'.*disjoint.*full.*coarse.*medium_coarse.*fine_grained.*overlap"):
        rules.check_assignment("bogus", 1, 4)
    with pytest.raises(ValueError, match=r"copies=0.*num_workers=4"):
        rules.check_assignment("overlap", 0, 4)
    with pytest.raises(ValueError, match=r"copies=5.*num_workers=4"):
        rules.check_assignment("overlap", 5, 4)
    with pytest.raises(ValueError, match="num_workers.*0"):
        rules.check_assignment("disjoint", 1, 0)
    # copies only matters for overlap (the config default copies=2 must not break M=1 runs)
    rules.check_assignment("disjoint", 2, 1)
    rules.check_assignment("full", 7, 1)
    rules.check_assignment("overlap", 4, 4)
    with pytest.raises(ValueError, match="copies=3"):
        assignment.assign(10, rank=0, num_workers=2, scheme="overlap", copies=3)
    with pytest.raises(ValueError, match="rank=2"):
        assignment.assign(10, rank=2, num_workers=2, scheme="disjoint")
    with pytest.raises(ValueError, match="'shared'"):
        assignment.assign(10, rank=0, num_workers=2, scheme="shared")
