"""Graph cases shared by the partitioner tests (small, built inline)."""

from __future__ import annotations

import numpy as np
import pytest

from hongtu.graph import Graph


def local_rmat(scale: int, edge_factor: int, seed: int = 0) -> Graph:
    """A skewed R-MAT-like graph (a, b, c, d = .57, .19, .19, .05), duplicates kept."""
    rng = np.random.default_rng(seed)
    num_edges = edge_factor << scale
    src = np.zeros(num_edges, dtype=np.int64)
    dst = np.zeros(num_edges, dtype=np.int64)
    for bit in range(scale):
        r = rng.random(num_edges)
        src |= (r >= 0.76).astype(np.int64) << bit
        dst |= (((r >= 0.57) & (r < 0.76)) | (r >= 0.95)).astype(np.int64) << bit
    return Graph.from_edge_index(np.stack([src, dst]), num_nodes=1 << scale, name=f"rmat-{scale}")


def rmat(scale: int, edge_factor: int = 16) -> Graph:
    """``hongtu.graph.generators.rmat_graph`` when it is there, else :func:`local_rmat`."""
    try:
        from hongtu.graph.generators import rmat_graph

        return rmat_graph(scale, edge_factor)
    except (ImportError, AttributeError, TypeError):
        return local_rmat(scale, edge_factor)


def tiny_graph() -> Graph:
    """12 vertices: self-loops, a duplicate edge, a hub, isolated vertices 9..11."""
    edges = np.array([
        [0, 1, 2, 3, 3, 4, 5, 5, 6, 7, 8, 1, 2, 4, 6, 0, 5],
        [1, 2, 0, 3, 0, 0, 5, 0, 0, 8, 7, 2, 3, 5, 7, 0, 6],
    ])
    return Graph.from_edge_index(edges, num_nodes=12, name="tiny")


def random_graph(num_nodes: int, num_edges: int, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    return Graph.from_edge_index(rng.integers(0, num_nodes, (2, num_edges)), num_nodes=num_nodes)


@pytest.fixture(scope="session")
def rmat14() -> Graph:
    """A skewed graph of 2**14 vertices, ~2**18 edges."""
    return rmat(14, 16)


@pytest.fixture
def tiny() -> Graph:
    return tiny_graph()


@pytest.fixture
def make_random_graph():
    """Factory ``(num_nodes, num_edges, seed=0) -> Graph`` of uniform random edges."""
    return random_graph
