"""Tests of the structural and feature transforms against set-based references."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hongtu.graph import Graph, csc_from_edges
from hongtu.graph.transforms import (
    add_self_loops,
    has_self_loops,
    normalize_features,
    remove_self_loops,
    to_undirected,
)


def _graph(edges: list[tuple[int, int]], n: int, **data) -> Graph:
    ei = np.array(edges, dtype=np.int64).reshape(-1, 2).T
    return Graph.from_edge_index(ei, num_nodes=n, **data)


def _edges(g: Graph) -> Counter:
    return Counter(zip(g.indices.tolist(), g.dst().tolist()))


def _segments_sorted(g: Graph) -> bool:
    return all(np.all(np.diff(g.indices[g.indptr[v]:g.indptr[v + 1]]) >= 0)
               for v in range(g.num_nodes))


# ---------------------------------------------------------------- to_undirected
def test_to_undirected_adds_reverse_and_dedups() -> None:
    g = _graph([(0, 1), (1, 2), (1, 2), (2, 1), (3, 3), (3, 3)], 5)
    u = to_undirected(g)
    assert _edges(u) == Counter({(0, 1): 1, (1, 0): 1, (1, 2): 1, (2, 1): 1, (3, 3): 1})
    assert u.num_nodes == 5 and u.in_degree()[4] == 0
    assert _segments_sorted(u)
    u.validate()


def test_to_undirected_is_idempotent_and_keeps_vertex_data() -> None:
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    y = np.array([0, 1, 0, 1])
    g = _graph([(3, 0), (2, 0), (1, 0), (0, 2)], 4, x=x, y=y, name="g")
    u = to_undirected(g)
    assert u.indices[u.indptr[0]:u.indptr[1]].tolist() == [1, 2, 3]
    assert u.x is x and u.y is y and u.name == "g"
    again = to_undirected(u)
    assert np.array_equal(again.indptr, u.indptr) and np.array_equal(again.indices, u.indices)
    assert g.num_edges == 4  # the input is untouched


def test_to_undirected_int64_input_and_empty_graph() -> None:
    g = Graph(indptr=np.array([0, 1, 2], dtype=np.int64), indices=np.array([1, 0], np.int64))
    u = to_undirected(g)
    assert u.indices.dtype == np.int32 and _edges(u) == Counter({(1, 0): 1, (0, 1): 1})
    empty = to_undirected(_graph([], 3))
    assert empty.num_edges == 0 and empty.num_nodes == 3


# ------------------------------------------------------------------ self-loops
def test_add_self_loops_exactly_one_per_vertex() -> None:
    g = _graph([(2, 2), (2, 2), (0, 2), (1, 2), (1, 2), (4, 2), (1, 0)], 5)
    s = add_self_loops(g)
    assert s.indices[s.indptr[2]:s.indptr[3]].tolist() == [0, 1, 1, 2, 4]  # multi-edge kept
    loops = Counter(v for u, v in _edges(s).elements() if u == v)
    assert loops == Counter(range(5))
    assert s.num_edges == 5 + 5 and _segments_sorted(s)


def test_has_self_loops_needs_one_on_every_vertex() -> None:
    g = _graph([(2, 2), (0, 2), (1, 1), (0, 0)], 4)  # vertex 3 has none
    assert not has_self_loops(g)
    assert has_self_loops(add_self_loops(g))
    assert not has_self_loops(remove_self_loops(add_self_loops(g)))
    assert has_self_loops(_graph([], 0)) and not has_self_loops(_graph([], 1))


def test_add_self_loops_sorts_unsorted_segments() -> None:
    g = _graph([(3, 1), (0, 1), (2, 1)], 4)
    s = add_self_loops(g)
    assert s.indices[s.indptr[1]:s.indptr[2]].tolist() == [0, 1, 2, 3]


def test_remove_self_loops_keeps_order() -> None:
    g = _graph([(3, 1), (1, 1), (0, 1), (2, 2)], 4)
    r = remove_self_loops(g)
    assert r.indices.tolist() == [3, 0] and r.dst().tolist() == [1, 1]
    assert remove_self_loops(r).num_edges == 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_transforms_match_set_reference(n: int, data: st.DataObject) -> None:
    edges = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                               max_size=40))
    g = _graph(edges, n)
    sym = {(u, v) for u, v in edges} | {(v, u) for u, v in edges}
    u = to_undirected(g)
    assert _edges(u) == Counter(sym) and _segments_sorted(u)
    no_loops = Counter((a, b) for a, b in edges if a != b)
    assert _edges(remove_self_loops(g)) == no_loops
    s = add_self_loops(g)
    assert _edges(s) == no_loops + Counter((v, v) for v in range(n)) and _segments_sorted(s)
    assert _edges(add_self_loops(u)) == Counter(sym - {(v, v) for v in range(n)}) + Counter(
        (v, v) for v in range(n))


def test_csc_from_edges_matches_stable_sort() -> None:
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 50, 500), rng.integers(0, 50, 500)
    indptr, indices = csc_from_edges(src, dst, 60)
    order = np.argsort(dst, kind="stable")
    assert np.array_equal(indices, src[order])
    assert np.array_equal(np.diff(indptr), np.bincount(dst, minlength=60))
    assert indices.dtype == np.int32


# ------------------------------------------------------------ normalize_features
def test_normalize_features_rows_sum_to_one_zero_rows_stay() -> None:
    x = np.array([[1, 3, 0], [0, 0, 0], [2, 2, 4]], dtype=np.float32)
    g = _graph([(0, 1)], 3, x=x)
    out = normalize_features(g).x
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [[0.25, 0.75, 0], [0, 0, 0], [0.25, 0.25, 0.5]])
    assert x[0, 1] == 3  # the input is untouched


def test_normalize_features_streams_a_memmap(tmp_path) -> None:
    rng = np.random.default_rng(1)
    x = rng.random((50, 7)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    out = normalize_features(_graph([], 50, x=mm)).x
    assert not isinstance(out, np.memmap)
    np.testing.assert_allclose(out, x / x.sum(1, keepdims=True), rtol=1e-6)
    assert normalize_features(_graph([], 2)).x is None


@pytest.mark.parametrize("fn", [to_undirected, add_self_loops, remove_self_loops])
def test_structure_transforms_reset_fingerprint(fn) -> None:
    g = _graph([(0, 1), (1, 1)], 2)
    before = g.fingerprint()
    assert fn(g).fingerprint() != before
