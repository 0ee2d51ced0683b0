"""Level 1 with METIS: symmetrisation, balance, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from hongtu.graph import Graph
from hongtu.partition import assign_parts, partition_graph, partition_stats
from hongtu.partition._kernels import symmetric_csr


def brute_symmetric(graph: Graph) -> list[list[int]]:
    nbrs = [set() for _ in range(graph.num_nodes)]
    for s, d in graph.edge_index().T.tolist():
        if s != d:
            nbrs[s].add(d)
            nbrs[d].add(s)
    return [sorted(x) for x in nbrs]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_symmetric_csr_matches_brute_force(tiny, make_random_graph, dtype):
    for g in (tiny, make_random_graph(60, 400, seed=3)):
        xadj, adjncy = symmetric_csr(g.indptr, g.indices.astype(dtype))
        assert xadj.dtype == np.int64 and adjncy.dtype == np.int64
        got = [sorted(adjncy[xadj[v]:xadj[v + 1]].tolist()) for v in range(g.num_nodes)]
        assert got == brute_symmetric(g)


def test_symmetric_csr_empty_graph():
    g = Graph.from_edge_index(np.zeros((2, 0), dtype=np.int64), num_nodes=5)
    xadj, adjncy = symmetric_csr(g.indptr, g.indices)
    assert xadj.tolist() == [0] * 6 and adjncy.size == 0


def test_metis_balance_on_skewed_graph(rmat14):
    p = partition_graph(rmat14, 4, 8, method="metis")
    stats = partition_stats(rmat14, p)
    assert stats["edge_balance"] <= 1.10, stats["part_edges"]
    assert stats["chunk_edge_balance"] <= 1.25, stats["chunk_edges"]
    # R-MAT cuts badly whatever the method, but METIS must still beat random.
    rnd = partition_stats(rmat14, partition_graph(rmat14, 4, 8, method="random"))
    assert stats["cut_edges"] < 0.95 * rnd["cut_edges"]


def test_metis_is_seeded(make_random_graph):
    g = make_random_graph(2000, 16000, seed=9)
    a = assign_parts(g, 4, seed=3)
    b = assign_parts(g, 4, seed=3)
    assert a.dtype == np.int32 and a.shape == (g.num_nodes,)
    assert np.array_equal(a, b)
    assert set(np.unique(a).tolist()) == {0, 1, 2, 3}


def test_metis_one_part_skips_metis(monkeypatch, make_random_graph):
    from hongtu.partition import assign

    def boom(*args, **kwargs):
        raise AssertionError("METIS called for one part")

    monkeypatch.setattr(assign, "symmetric_csr", boom)
    parts = assign_parts(make_random_graph(50, 100), 1, method="metis")
    assert parts.dtype == np.int32 and not parts.any()


def test_metis_graph_without_edges():
    g = Graph.from_edge_index(np.zeros((2, 0), dtype=np.int64), num_nodes=40)
    p = partition_graph(g, 2, 2, method="metis")
    assert np.all(np.diff(p.part_ptr) >= 2)


def test_timings_reported(make_random_graph):
    timings: dict[str, float] = {}
    assign_parts(make_random_graph(300, 2000), 2, method="metis", timings=timings)
    assert {"symmetrize_s", "metis_s", "assign_s"} <= set(timings)


@pytest.fixture
def metis_fails_from(monkeypatch):
    """pymetis raising as it does when METIS runs out of memory, from ``m`` parts."""
    import pymetis

    real = pymetis.part_graph

    def failing(m):
        def part_graph(nparts, *args, **kwargs):
            if nparts >= m:
                raise RuntimeError("Caught an unknown exception!")
            return real(nparts, *args, **kwargs)
        monkeypatch.setattr(pymetis, "part_graph", part_graph)
    return failing


def test_metis_failure_is_one_line_naming_the_way_out(make_random_graph, metis_fails_from):
    from hongtu.partition import MetisError

    metis_fails_from(4)
    g = make_random_graph(200, 1600, seed=2)
    assert np.bincount(assign_parts(g, 2, method="metis")).size == 2
    with pytest.raises(MetisError, match=r"METIS could not split the graph \(200 vertices, "
                       r".* into 4 parts \(RuntimeError: Caught an unknown exception!\); .*"
                       r"engine.partitioner=range") as info:
        assign_parts(g, 4, method="metis")
    assert "\n" not in str(info.value)
