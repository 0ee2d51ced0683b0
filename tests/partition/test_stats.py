"""partition_stats against a brute-force count, and format_stats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hongtu.partition import chunk_partition, format_stats, partition_graph, partition_stats


def brute_stats(graph, p):
    part, chunk = p.assignment()
    flat = part * p.num_chunks + chunk
    src, dst = graph.edge_index().astype(np.int64).tolist()
    part_nbrs = [set() for _ in range(p.num_parts)]
    chunk_nbrs = [set() for _ in range(p.num_parts * p.num_chunks)]
    part_edges = [0] * p.num_parts
    chunk_edges = [0] * (p.num_parts * p.num_chunks)
    cut = 0
    for s, d in zip(src, dst):
        part_nbrs[part[d]].add(s)
        chunk_nbrs[flat[d]].add(s)
        part_edges[part[d]] += 1
        chunk_edges[flat[d]] += 1
        cut += int(part[s] != part[d])
    n = graph.num_nodes
    return {
        "part_edges": part_edges,
        "chunk_edges": chunk_edges,
        "part_neighbors": [len(x) for x in part_nbrs],
        "chunk_neighbors": [len(x) for x in chunk_nbrs],
        "cut_edges": cut,
        "alpha_parts": sum(len(x) for x in part_nbrs) / n,
        "alpha_chunks": sum(len(x) for x in chunk_nbrs) / n,
    }


@pytest.mark.parametrize("method", ["metis", "range", "random"])
def test_stats_match_brute_force(tiny, make_random_graph, method):
    for g, (m, n) in ((tiny, (3, 2)), (make_random_graph(150, 900, seed=5), (4, 3))):
        p = partition_graph(g, m, n, method=method, seed=2)
        stats = partition_stats(g, p)
        expect = brute_stats(g, p)
        for key, value in expect.items():
            assert stats[key] == pytest.approx(value), key
        assert stats["cut_fraction"] == pytest.approx(expect["cut_edges"] / g.num_edges)
        assert stats["part_vertices"] == np.diff(p.part_ptr).tolist()
        pe = np.array(expect["part_edges"])
        assert stats["edge_balance"] == pytest.approx(pe.max() / pe.mean())
        ce = np.array(expect["chunk_edges"])
        assert stats["chunk_edge_balance"] == pytest.approx(ce.max() / ce.mean())
        json.dumps(stats)


def test_stats_injected_two_parts(tiny):
    # Part 0 = even ids, part 1 = odd ids.
    p = chunk_partition(tiny, np.arange(12) % 2, 1)
    stats = partition_stats(tiny, p)
    assert stats == {**stats, **brute_stats(tiny, p)}
    assert stats["num_parts"] == 2 and stats["num_chunks"] == 1


def test_stats_without_edges():
    from hongtu.graph import Graph

    g = Graph.from_edge_index(np.zeros((2, 0), dtype=np.int64), num_nodes=8)
    stats = partition_stats(g, partition_graph(g, 2, 2, method="range"))
    assert stats["cut_edges"] == 0 and stats["cut_fraction"] == 0.0
    assert stats["edge_balance"] == 1.0 and stats["alpha_parts"] == 0.0


def test_format_stats(tiny):
    text = format_stats(partition_stats(tiny, partition_graph(tiny, 2, 3, method="range")))
    lines = text.splitlines()
    assert lines[0].startswith("partition: range, 2 parts x 3 chunks, 12 vertices, 17 edges")
    assert len(lines) == 1 + 2 + 2 + 1
    assert "alpha" in lines[-1] and "cut" in lines[-1]
