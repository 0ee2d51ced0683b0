"""hongtu.graph.graph: renumbering."""

import numpy as np

from hongtu.graph import Graph
from hongtu.graph.generators import rmat_graph


def _graph(seed: int = 0) -> Graph:
    return rmat_graph(9, 8, num_features=3, num_classes=4, seed=seed)


def test_permute_reorders_vertices_and_their_edges():
    g = _graph()
    perm = np.random.default_rng(1).permutation(g.num_nodes)
    p = g.permute(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(g.num_nodes)
    assert np.array_equal(p.x, g.x[perm]) and np.array_equal(p.y, g.y[perm])
    for k in (0, 7, g.num_nodes - 1):
        old = g.indices[g.indptr[perm[k]]:g.indptr[perm[k] + 1]]
        assert np.array_equal(p.indices[p.indptr[k]:p.indptr[k + 1]], inv[old])


def test_identity_permute_returns_the_graph_itself():
    """Nothing to renumber: the same graph, its arrays not copied."""
    g = _graph()
    assert g.permute(np.arange(g.num_nodes)) is g
    # (one vertex out of place: a real renumbering)
    perm = np.arange(g.num_nodes)
    perm[[3, 4]] = perm[[4, 3]]
    p = g.permute(perm)
    assert p is not g and np.array_equal(p.x[[3, 4]], g.x[[4, 3]])


def test_identity_permute_still_rebases_edges_not_from_zero():
    """An ``indptr`` that does not start at 0 (a view into a larger edge array)
    is rebased as any renumbering rebases it."""
    g = _graph()
    pad = np.concatenate([np.zeros(5, g.indices.dtype), g.indices])
    shifted = Graph(indptr=g.indptr + 5, indices=pad, x=g.x, y=g.y,
                    train_mask=g.train_mask, val_mask=g.val_mask, test_mask=g.test_mask)
    p = shifted.permute(np.arange(g.num_nodes))
    assert p is not shifted
    assert np.array_equal(p.indptr, g.indptr) and np.array_equal(p.indices, g.indices)
