"""Graph kernels: distinct values of groups of segments (bitmaps), in every path."""

from __future__ import annotations

import numpy as np
import pytest

from hongtu.graph import _kernels
from hongtu.graph._kernels import unique_union
from hongtu.partition._kernels import distinct_sources
from tests.partition.conftest import random_graph


def _ranges_of(rng, n, cuts):
    inner = np.sort(rng.choice(np.arange(1, n), cuts, replace=False))
    return np.concatenate(([0], inner, [n])).astype(np.int64)


# Both paths and their variants: groups dealt to threads (serial twins on
# inputs this small), groups split into pieces (more threads than groups;
# parallel kernels), and pieces in waves when few bitmaps fit.
_PATHS = [dict(threads=1), dict(threads=3), dict(threads=64, big=True),
          dict(threads=64, big=True, room_rows=3), dict(threads=3, big=True)]


@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize("ranges", [1, 2, 3, 7, 299])
def test_unique_union_counts_and_sorted_sets_of_each_range(monkeypatch, path, ranges):
    # Range r of a renumbering: the union of its vertices' in-edge segments,
    # with repeated sources, self-loops, empty and one-vertex ranges.
    g = random_graph(300, 4000, seed=5)
    dup = g.indices.copy()
    dup[::7] = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))[::7]  # self-loops
    dup[1::11] = dup[0:-1:11]  # repeated sources within a vertex's in-edges
    rng = np.random.default_rng(ranges)
    perm = rng.permutation(g.num_nodes)
    bounds = _ranges_of(rng, g.num_nodes, ranges - 1)
    if ranges >= 7:
        bounds[2] = bounds[1]  # an empty range
    want = [np.unique(np.concatenate([dup[g.indptr[v]:g.indptr[v + 1]] for v in perm[a:b]]
                                     + [np.empty(0, dup.dtype)]))
            for a, b in zip(bounds[:-1], bounds[1:])]
    if "room_rows" in path:  # bitmaps of 300 ids are 40 bytes
        monkeypatch.setattr(_kernels, "_BITS_BYTES", 40 * path["room_rows"])
    if path.get("big"):
        monkeypatch.setattr(_kernels, "SERIAL_BELOW", 0)
    ip = np.asarray(g.indptr, dtype=np.int64)
    for values in (dup, dup.astype(np.int64)):
        args = (values, bounds, ip[perm], ip[perm + 1], g.num_nodes)
        counts = unique_union(*args, threads=path["threads"])
        assert counts.tolist() == [w.size for w in want]
        ptr, ids = unique_union(*args, sets=True, threads=path["threads"])
        assert ids.dtype == values.dtype and np.diff(ptr).tolist() == counts.tolist()
        for r, w in enumerate(want):
            assert np.array_equal(ids[ptr[r]:ptr[r + 1]], w)
        # Sizes known from a count: one pass fewer, the same sets; wrong ones refused.
        ptr2, ids2 = unique_union(*args, sets=True, counts=counts, threads=path["threads"])
        assert np.array_equal(ptr2, ptr) and np.array_equal(ids2, ids)
        wrong = counts.copy()
        wrong[-1] += 1
        with pytest.raises(ValueError, match="not the sizes"):
            unique_union(*args, sets=True, counts=wrong, threads=path["threads"])
    assert distinct_sources(g.indptr, dup, perm, bounds).tolist() == counts.tolist()


@pytest.mark.parametrize("serial", [False, True])
def test_unique_union_sorts_or_scans_by_spread(monkeypatch, serial):
    # A few ids spread over a wide range are sorted; many packed ids are read
    # back from the bitmap in order. Both leave the bitmap clean for the next
    # group of the same thread (groups dealt round robin to one thread).
    monkeypatch.setattr(_kernels, "SERIAL_BELOW", 1 << 40 if serial else 0)
    n = 1 << 20
    rng = np.random.default_rng(0)
    wide = rng.choice(n, 50, replace=False)
    packed = rng.integers(1000, 3000, 5000)
    values = np.concatenate([wide, packed, wide[:10], packed[::3]]).astype(np.int32)
    cuts = np.cumsum([0, wide.size, packed.size, 10, packed[::3].size])
    gptr = np.arange(cuts.shape[0], dtype=np.int64)
    ptr, ids = unique_union(values, gptr, cuts[:-1], cuts[1:], n, sets=True, threads=1)
    for r in range(4):
        assert np.array_equal(ids[ptr[r]:ptr[r + 1]],
                              np.unique(values[cuts[r]:cuts[r + 1]]))
    assert unique_union(values, gptr, cuts[:-1], cuts[1:], n, threads=1).tolist() == \
        np.diff(ptr).tolist()


@pytest.mark.parametrize("path", [dict(threads=1), dict(threads=3, big=True),
                                  dict(threads=64, big=True)])
def test_run_bitmaps_count_and_list_every_grouping_from_one_pass(monkeypatch, path):
    # Several groupings of the same (permuted) segments, with empty groups and
    # shared and unshared bounds: each one's counts and sets are unique_union's.
    g = random_graph(300, 4000, seed=7)
    rng = np.random.default_rng(1)
    perm = rng.permutation(g.num_nodes)
    ip = np.asarray(g.indptr, dtype=np.int64)
    segs = (ip[perm], ip[perm + 1])
    groupings = [_ranges_of(rng, g.num_nodes, k) for k in (0, 2, 5, 40)]
    groupings.append(np.array([0, 0, 150, 150, 300], dtype=np.int64))
    if path.get("big"):
        monkeypatch.setattr(_kernels, "SERIAL_BELOW", 0)
    marked = []
    real_mark = _kernels._unique_mark
    monkeypatch.setattr(_kernels, "_unique_mark", lambda *a: marked.append(1) or real_mark(*a))

    def check(runs, values):
        for gptr in groupings:
            want = unique_union(values, gptr, *segs, g.num_nodes, sets=True, threads=1)
            assert runs.counts(gptr).tolist() == np.diff(want[0]).tolist()
            ptr, ids = runs.sets(gptr)
            assert ids.dtype == values.dtype
            assert np.array_equal(ptr, want[0]) and np.array_equal(ids, want[1])

    for values in (g.indices, g.indices.astype(np.int64)):
        runs = _kernels.RunBitmaps.mark(values, groupings, *segs, g.num_nodes,
                                        threads=path["threads"])
        check(runs, values)
        bad = next(v for v in range(1, 300) if v not in runs.cuts)
        with pytest.raises(ValueError, match="not a bound of the runs"):
            runs.counts(np.array([0, bad, 300]))
    assert len(marked) == 2  # one marking of the values per RunBitmaps
    # Room for the runs the bounds cut and no more (no even runs on top): the
    # same answers; room for fewer: no bitmaps.
    runs = np.unique(np.concatenate(groupings)).shape[0] - 1
    monkeypatch.setattr(_kernels, "_BITS_BYTES", 40 * runs)  # bitmaps of 300 ids: 40 bytes
    check(_kernels.RunBitmaps.mark(g.indices, groupings, *segs, g.num_nodes,
                                   threads=path["threads"]), g.indices)
    monkeypatch.setattr(_kernels, "_BITS_BYTES", 40 * (runs - 1))
    assert _kernels.RunBitmaps.mark(g.indices, groupings, *segs, g.num_nodes) is None
