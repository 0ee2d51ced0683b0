"""Level 2 (chunking) and renumbering, with injected part assignments (no METIS)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hongtu.errors import UserError
from hongtu.partition import (
    METHODS,
    Chunker,
    Partition,
    assign_parts,
    chunk_partition,
    partition_graph,
)
from hongtu.partition.assign import OffsetPrefix, balanced_cuts, prefix_cuts


def check_invariants(graph, p: Partition) -> None:
    n_nodes, m, n = graph.num_nodes, p.num_parts, p.num_chunks
    assert p.perm.dtype == np.int64 and p.inv.dtype == np.int64
    assert p.part_ptr.dtype == np.int64 and p.chunk_ptr.dtype == np.int64
    assert p.part_ptr.shape == (m + 1,) and p.chunk_ptr.shape == (m * n + 1,)
    # perm is a permutation and inv its inverse.
    assert np.array_equal(np.sort(p.perm), np.arange(n_nodes))
    assert np.array_equal(p.inv[p.perm], np.arange(n_nodes))
    assert np.array_equal(p.perm[p.inv], np.arange(n_nodes))
    # Chunk ranges are contiguous, non-empty, cover [0, N) and nest in parts.
    assert p.chunk_ptr[0] == 0 and p.chunk_ptr[-1] == n_nodes
    assert np.all(np.diff(p.chunk_ptr) >= 1)
    assert np.array_equal(p.chunk_ptr[::n], p.part_ptr)
    for i in range(m):
        for j in range(n):
            c = i * n + j
            assert p.chunk_range(i, j) == (p.chunk_ptr[c], p.chunk_ptr[c + 1])
    # Every vertex in exactly one chunk, consistent with assignment().
    part, chunk = p.assignment()
    counts = np.bincount(part * n + chunk, minlength=m * n)
    assert np.array_equal(counts, np.diff(p.chunk_ptr))
    for i in range(m):
        start, stop = p.part_range(i)
        members = p.perm[start:stop]
        assert np.all(part[members] == i)
        # Within a part, original relative order is kept.
        assert np.all(np.diff(members) > 0)


def edge_multiset(graph, mapping=None):
    src, dst = graph.edge_index().astype(np.int64)
    if mapping is not None:
        src, dst = mapping[src], mapping[dst]
    return Counter(zip(src.tolist(), dst.tolist()))


def test_injected_assignment(make_random_graph):
    g = make_random_graph(300, 3000, seed=1)
    rng = np.random.default_rng(0)
    assignment = rng.integers(0, 3, g.num_nodes)
    p = chunk_partition(g, assignment, 4)
    check_invariants(g, p)
    assert p.num_parts == 3 and p.num_chunks == 4 and p.method == "given"
    part, _ = p.assignment()
    assert np.array_equal(part, assignment)


def test_apply_keeps_edges_and_data(make_random_graph):
    g = make_random_graph(200, 1500, seed=2)
    g.x = np.arange(g.num_nodes * 2, dtype=np.float32).reshape(-1, 2)
    g.y = np.arange(g.num_nodes)
    p = chunk_partition(g, np.arange(g.num_nodes) % 4, 3)
    h = p.apply(g)
    # New edge (a, b) is old edge (perm[a], perm[b]).
    assert edge_multiset(h, p.perm) == edge_multiset(g)
    assert np.array_equal(h.y, p.perm)
    assert np.array_equal(p.to_original(h.x), g.x)
    assert np.array_equal(p.to_original(h.y), g.y)
    # Chunk (i, j) owns one contiguous slice of the renumbered in-edges.
    for i in range(4):
        for j in range(3):
            start, stop = p.chunk_range(i, j)
            assert h.indptr[stop] - h.indptr[start] == g.in_degree()[p.perm[start:stop]].sum()


def test_chunks_balanced_by_in_edges(make_random_graph):
    g = make_random_graph(4000, 60000, seed=3)
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int32), 8)
    check_invariants(g, p)
    w = (g.in_degree() + 1)[p.perm]
    sums = np.add.reduceat(w, p.chunk_ptr[:-1])
    assert sums.max() / sums.mean() < 1.01


def test_balanced_cuts_min_size_and_skew():
    # One huge item must not leave empty pieces.
    w = np.array([1000, 1, 1, 1, 1, 1])
    b = balanced_cuts(w, 4)
    assert b[0] == 0 and b[-1] == 6 and np.all(np.diff(b) >= 1)
    b = balanced_cuts(np.ones(10), 5)
    assert np.array_equal(b, [0, 2, 4, 6, 8, 10])
    with pytest.raises(ValueError):
        balanced_cuts(np.ones(3), 4)


@pytest.mark.parametrize("ordered", [True, False])
def test_chunker_cuts_are_balanced_cuts_of_each_part(make_random_graph, ordered):
    """Each part's chunks are :func:`balanced_cuts` of its vertices' in-degree + 1 (float
    weights), whether the parts are id ranges (no renumbering: integer prefix sums
    from the offsets) or not; part sizes count a part of one vertex and an empty one."""
    g = make_random_graph(400, 3000, seed=5)
    rng = np.random.default_rng(1)
    sizes = [1, 0, 150, 249]
    assignment = np.repeat(np.arange(4), sizes)
    if not ordered:
        assignment = rng.permutation(assignment)
    chunker = Chunker(g, assignment, 4)
    assert chunker.ordered == ordered
    assert chunker.part_sizes.tolist() == sizes
    if ordered:
        assert np.array_equal(chunker.perm, np.arange(g.num_nodes))
    with pytest.raises(UserError, match="part 1 has 0 vertices"):
        chunker.cut(1)
    big = Chunker(g, np.repeat(np.arange(2), [150, 250]) if ordered
                  else rng.permutation(np.repeat(np.arange(2), [150, 250])), 2)
    for n in (1, 3, 7, 64):
        p = big.cut(n)
        check_invariants(g, p)
        w = (g.in_degree() + 1)[p.perm].astype(np.float64)
        for i in range(2):
            a, b = p.part_ptr[i], p.part_ptr[i + 1]
            assert np.array_equal(p.chunk_ptr[i * n:(i + 1) * n + 1] - a,
                                  balanced_cuts(w[a:b], n)), (n, i)


def test_prefix_cuts_of_integer_prefix_equal_float():
    """An integer prefix (searched for its targets rounded up), and the same prefix read
    from in-edge offsets (OffsetPrefix: weights in-degree + 1 of an id range), cut
    exactly as the prefix in float does, ties and targets between two sums included."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        size = int(rng.integers(1, 60))
        deg = rng.integers(0, 3, size=size + 7)
        indptr = np.concatenate(([0], np.cumsum(deg))).astype(np.int64)
        a = int(rng.integers(0, 7))
        prefix = np.concatenate(([0], np.cumsum(deg[a:a + size] + 1))).astype(np.int64)
        offsets = OffsetPrefix(indptr, a, a + size)
        probe = np.arange(-1, int(prefix[-1]) + 3)
        assert np.array_equal(offsets.searchsorted(probe), np.searchsorted(prefix, probe))
        assert np.array_equal(offsets[np.arange(size + 1)], prefix) and offsets[-1] == prefix[-1]
        for k in range(1, size + 1):
            as_float = prefix_cuts(prefix.astype(np.float64), k)
            assert np.array_equal(prefix_cuts(prefix, k), as_float), (trial, k)
            assert np.array_equal(prefix_cuts(offsets, k), as_float), (trial, k)


@pytest.mark.parametrize("method", METHODS)
def test_methods_on_isolated_and_self_loops(tiny, method):
    p = partition_graph(tiny, 2, 2, method=method, seed=1)
    check_invariants(tiny, p)
    assert edge_multiset(p.apply(tiny), p.perm) == edge_multiset(tiny)


@pytest.mark.parametrize("method", METHODS)
def test_one_part(tiny, method):
    p = partition_graph(tiny, 1, 3, method=method)
    check_invariants(tiny, p)
    assert np.array_equal(p.perm, np.arange(tiny.num_nodes))
    assert p.part_ptr.tolist() == [0, tiny.num_nodes]


def test_one_chunk_per_vertex(tiny):
    p = chunk_partition(tiny, np.zeros(12, dtype=np.int64), 12)
    assert np.array_equal(p.chunk_ptr, np.arange(13))


def test_range_is_contiguous_and_balanced(make_random_graph):
    g = make_random_graph(1000, 20000, seed=4)
    p = partition_graph(g, 4, 2, method="range")
    assert np.array_equal(p.perm, np.arange(g.num_nodes))
    w = g.in_degree() + 1
    sums = np.add.reduceat(w, p.part_ptr[:-1])
    assert sums.max() / sums.mean() < 1.01


def test_random_is_seeded(make_random_graph):
    g = make_random_graph(500, 5000, seed=5)
    a = partition_graph(g, 4, 2, method="random", seed=7)
    b = partition_graph(g, 4, 2, method="random", seed=7)
    c = partition_graph(g, 4, 2, method="random", seed=8)
    assert np.array_equal(a.perm, b.perm)
    assert not np.array_equal(a.perm, c.perm)
    check_invariants(g, a)


def test_too_many_chunks_is_user_error(tiny):
    assignment = np.zeros(12, dtype=np.int64)
    assignment[:2] = 1
    with pytest.raises(UserError, match="part 1 has 2 vertices"):
        chunk_partition(tiny, assignment, 3)
    with pytest.raises(UserError, match="need at least 13 vertices"):
        partition_graph(tiny, 1, 13, method="range")
    with pytest.raises(UserError, match="need at least 14 vertices"):
        partition_graph(tiny, 2, 7, method="metis")
    # An empty part is caught the same way.
    with pytest.raises(UserError, match="part 2 has 0 vertices"):
        chunk_partition(tiny, assignment, 1, num_parts=3)


def test_bad_arguments_are_user_errors(tiny):
    with pytest.raises(UserError, match="metis, range, random"):
        partition_graph(tiny, 2, 2, method="spectral")
    with pytest.raises(UserError, match="12 vertices into 13 parts"):
        assign_parts(tiny, 13, method="range")
    with pytest.raises(UserError, match="need at least 13 vertices"):
        partition_graph(tiny, 13, 1, method="range")
    with pytest.raises(UserError):
        partition_graph(tiny, 0, 1, method="range")
    with pytest.raises(UserError):
        chunk_partition(tiny, np.zeros(12, dtype=np.int64), 0)


def test_apply_rejects_other_graph(tiny, make_random_graph):
    p = partition_graph(tiny, 2, 2, method="range")
    with pytest.raises(UserError, match="partition this graph again"):
        p.apply(make_random_graph(13, 20))


def test_chunker_cuts_every_count_as_chunk_partition(make_random_graph):
    g = make_random_graph(300, 2000, seed=4)
    assignment = np.arange(g.num_nodes) % 3
    chunker = Chunker(g, assignment, 3, method="metis", seed=7)
    for n in (1, 2, 5, 8):
        p, q = chunker.cut(n), chunk_partition(g, assignment, n, num_parts=3, method="metis",
                                               seed=7)
        check_invariants(g, p)
        assert np.array_equal(p.chunk_ptr, q.chunk_ptr) and np.array_equal(p.perm, q.perm)
        assert (p.method, p.seed) == ("metis", 7)
    assert chunker.cut(2).perm is chunker.cut(4).perm  # one renumbering for every count
    with pytest.raises(UserError, match="fewer than the 101 chunks"):
        chunker.cut(101)
