"""tfscale.data.assignment: who reads which items, for every scheme and awkward sizes."""

import collections
import itertools

import pytest

from tfscale.data import assignment

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
    for scheme in assignment.SCHEMES:
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
def test_worker_keeps_matches_assign_for_ints_and_tensors(n, m, c):
    for scheme, copies in (("disjoint", 1), ("overlap", c), ("full", 1)):
        for r in range(m):
            keep = [i for i in range(n)
                    if assignment.worker_keeps(i, rank=r, num_workers=m, scheme=scheme, copies=copies)]
            assert keep == assignment.assign(n, rank=r, num_workers=m, scheme=scheme, copies=copies)


def test_worker_keeps_works_on_tensors_in_dataset_filter():
    tf = pytest.importorskip("tensorflow")
    n, m, c = 23, 5, 2
    for r in range(m):
        ds = tf.data.Dataset.range(n).filter(
            lambda i: assignment.worker_keeps(i, rank=r, num_workers=m, scheme="overlap", copies=c))
        assert [int(x) for x in ds] == assignment.assign(n, rank=r, num_workers=m, scheme="overlap", copies=c)


def test_shard_level():
    assert assignment.shard_level(1024, 8) == "file"
    assert assignment.shard_level(8, 8) == "file"
    assert assignment.shard_level(7, 8) == "example"
    assert assignment.shard_level(1, 1) == "file"
    with pytest.raises(ValueError, match="num_workers"):
        assignment.shard_level(4, 0)


def test_check_errors_name_the_values():
    with pytest.raises(ValueError, match=r"'bogus'.*disjoint.*overlap.*full"):
        assignment.check("bogus", 1, 4)
    with pytest.raises(ValueError, match=r"copies=0.*num_workers=4"):
        assignment.check("overlap", 0, 4)
    with pytest.raises(ValueError, match=r"copies=5.*num_workers=4"):
        assignment.check("overlap", 5, 4)
    with pytest.raises(ValueError, match="num_workers.*0"):
        assignment.check("disjoint", 1, 0)
    # copies only matters for overlap (the config default overlap_copies=2 must not break M=1 runs)
    assignment.check("disjoint", 2, 1)
    assignment.check("full", 7, 1)
    assignment.check("overlap", 4, 4)
    with pytest.raises(ValueError, match="copies=3"):
        assignment.assign(10, rank=0, num_workers=2, scheme="overlap", copies=3)
    with pytest.raises(ValueError, match="rank=2"):
        assignment.assign(10, rank=2, num_workers=2, scheme="disjoint")
    with pytest.raises(ValueError, match="'shared'"):
        assignment.assign(10, rank=0, num_workers=2, scheme="shared")
