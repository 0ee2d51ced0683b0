"""Small labelled graphs for tests (after DGL's graph_cases.py).

Each case is a function of a seed returning a :class:`hongtu.graph.Graph` with
features, labels and a train mask. Cases cover the shapes that break chunked
execution: isolated vertices, self-loops, a skewed (hub) degree distribution,
and a graph whose chunks share most of their neighbours.
"""

from __future__ import annotations

import numpy as np

from hongtu.graph import Graph

NUM_FEATURES = 6
NUM_CLASSES = 3


def _finish(src, dst, n, rng, name) -> Graph:
    x = rng.standard_normal((n, NUM_FEATURES)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, n).astype(np.int64)
    r = rng.random(n)
    return Graph.from_edge_index(np.stack([src, dst]), n, x=x, y=y, train_mask=r < 0.5,
                                 val_mask=(r >= 0.5) & (r < 0.75), test_mask=r >= 0.75,
                                 name=name)


def isolated(seed: int = 0) -> Graph:
    """Random edges among the first 40 of 50 vertices: 10 isolated vertices."""
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, 40, 200), rng.integers(0, 40, 200)
    return _finish(src, dst, 50, rng, "isolated")


def self_loops(seed: int = 0) -> Graph:
    """A random graph where every vertex also has a self-loop."""
    rng = np.random.default_rng(seed)
    n = 45
    src, dst = rng.integers(0, n, 150), rng.integers(0, n, 150)
    loops = np.arange(n)
    return _finish(np.concatenate([src, loops]), np.concatenate([dst, loops]), n, rng,
                   "self_loops")


def skewed(seed: int = 0) -> Graph:
    """Power-law-ish: vertex 0 receives an edge from everyone, sources Zipf-drawn."""
    rng = np.random.default_rng(seed)
    n = 60
    src = np.minimum(rng.zipf(1.6, 300) - 1, n - 1)
    dst = rng.integers(0, n, 300)
    hub_src = np.arange(n)
    return _finish(np.concatenate([src, hub_src]), np.concatenate([dst, np.zeros(n, int)]),
                   n, rng, "skewed")


def halo_heavy(seed: int = 0) -> Graph:
    """Dense random graph: every chunk reads most vertices as neighbours."""
    rng = np.random.default_rng(seed)
    n = 40
    src, dst = rng.integers(0, n, 600), rng.integers(0, n, 600)
    return _finish(src, dst, n, rng, "halo_heavy")


CASES = {"isolated": isolated, "self_loops": self_loops, "skewed": skewed,
         "halo_heavy": halo_heavy}
