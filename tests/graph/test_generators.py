"""Tests of the synthetic generators (R-MAT, SBM) and the built-in dataset registry."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.graph.datasets import BUILTIN_DATASETS, load_builtin
from hongtu.graph.generators import rmat_edges, rmat_graph, rmat_sized_graph, sbm_graph


def _edge_keys(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """``dst * n + src`` of every edge, and the same key of its reverse."""
    src = g.indices.astype(np.int64)
    dst = g.dst().astype(np.int64)
    return dst * g.num_nodes + src, src * g.num_nodes + dst


def _assert_no_duplicates(g: Graph) -> None:
    keys, _ = _edge_keys(g)
    assert np.unique(keys).shape[0] == keys.shape[0]


def _assert_undirected(g: Graph) -> None:
    keys, rev = _edge_keys(g)
    assert np.isin(rev, keys).all()


def _assert_same(g: Graph, h: Graph) -> None:
    for key in ("indptr", "indices", "x", "y", "train_mask", "val_mask", "test_mask"):
        a, b = getattr(g, key), getattr(h, key)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key


def _assert_disjoint_masks(g: Graph) -> None:
    total = g.train_mask.astype(int) + g.val_mask.astype(int) + g.test_mask.astype(int)
    assert total.max() <= 1


# ------------------------------------------------------------------ R-MAT
def test_rmat_edges_shapes_and_range():
    src, dst = rmat_edges(10, edge_factor=8, seed=3)
    assert src.shape == dst.shape == (8 * 1024,)
    assert src.dtype == dst.dtype == np.int32
    for ids in (src, dst):
        assert ids.min() >= 0 and ids.max() < 1024


def test_rmat_edges_deterministic_per_seed():
    a = rmat_edges(10, edge_factor=4, seed=1)
    b = rmat_edges(10, edge_factor=4, seed=1)
    c = rmat_edges(10, edge_factor=4, seed=2)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


def test_rmat_edges_independent_of_thread_count():
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = rmat_edges(11, edge_factor=4, seed=5)
        one_g = sbm_graph(500, num_classes=3, num_features=5, seed=5)
    finally:
        numba.set_num_threads(before)
    many = rmat_edges(11, edge_factor=4, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(one, many))
    _assert_same(one_g, sbm_graph(500, num_classes=3, num_features=5, seed=5))


def test_rmat_degree_distribution_is_skewed():
    g = rmat_graph(14, edge_factor=16, num_features=1)
    deg = g.in_degree()
    assert deg.max() > 20 * deg.mean()
    # The vertex permutation spreads hubs over the id range instead of vertex 0.
    assert np.argmax(deg) != 0


def test_rmat_quadrant_probabilities():
    # With a = 1 every edge stays in the top-left quadrant: all ids map to perm[0].
    src, dst = rmat_edges(6, edge_factor=2, a=1.0, b=0.0, c=0.0)
    assert np.unique(src).size == 1 and np.unique(dst).size == 1 and src[0] == dst[0]


def test_rmat_graph_shapes_dtypes_and_split():
    g = rmat_graph(10, edge_factor=8, num_features=12, num_classes=5, seed=4)
    n = 1024
    g.validate()
    assert g.num_nodes == n and g.name == "rmat-10"
    assert g.indptr.dtype == np.int64 and g.indices.dtype == np.int32
    assert g.x.shape == (n, 12) and g.x.dtype == np.float32
    assert abs(float(g.x.mean())) < 0.05 and abs(float(g.x.std()) - 1) < 0.05
    assert g.y.dtype == np.int64 and g.y.min() >= 0 and g.y.max() < 5
    assert (g.train_mask.sum(), g.val_mask.sum(), g.test_mask.sum()) == (614, 204, 206)
    _assert_disjoint_masks(g)
    assert (g.train_mask | g.val_mask | g.test_mask).all()


def test_rmat_graph_dedup():
    g = rmat_graph(10, edge_factor=16, num_features=1)
    _assert_no_duplicates(g)
    raw = rmat_graph(10, edge_factor=16, num_features=1, dedup=False)
    assert raw.num_edges == 16 * 1024 > g.num_edges
    # De-duplication removes repeats only: the distinct edge sets agree.
    assert np.array_equal(np.unique(_edge_keys(raw)[0]), np.sort(_edge_keys(g)[0]))


def test_rmat_graph_matches_raw_edges():
    src, dst = rmat_edges(9, edge_factor=4, seed=7)
    g = rmat_graph(9, edge_factor=4, num_features=2, seed=7, dedup=False)
    want = np.sort(dst.astype(np.int64) * 512 + src)
    assert np.array_equal(np.sort(_edge_keys(g)[0]), want)


def test_rmat_graph_undirected():
    g = rmat_graph(9, edge_factor=4, num_features=2, undirected=True)
    _assert_undirected(g)
    _assert_no_duplicates(g)


def test_rmat_graph_deterministic_per_seed():
    _assert_same(rmat_graph(9, 4, num_features=6, seed=3), rmat_graph(9, 4, num_features=6, seed=3))
    g, h = rmat_graph(9, 4, num_features=6, seed=3), rmat_graph(9, 4, num_features=6, seed=4)
    assert not np.array_equal(g.x, h.x) and not np.array_equal(g.y, h.y)


@pytest.mark.parametrize("kwargs", [dict(scale=0), dict(scale=8, edge_factor=0),
                                    dict(scale=8, a=0.6, b=0.3, c=0.3)])
def test_rmat_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        rmat_edges(**kwargs)


# ------------------------------------------------------------------ SBM
def test_rmat_sized_graph_has_exact_counts_and_is_rmat_induced():
    n, m = 3000, 50_000
    g = rmat_sized_graph(n, m, num_features=5, num_classes=7, seed=2)
    assert (g.num_nodes, g.num_edges, g.num_features) == (n, m, 5)
    assert int(g.indices.max()) < n and int(g.y.max()) < 7
    deg = g.in_degree()
    assert deg.max() > 10 * deg.mean()  # R-MAT skew survives the induced subgraph
    g2 = rmat_sized_graph(n, m, num_features=5, num_classes=7, seed=2)
    assert np.array_equal(g.indptr, g2.indptr) and np.array_equal(g.indices, g2.indices)


def test_sbm_structure():
    g = sbm_graph(2000, num_classes=5, num_features=16, avg_degree=10, seed=1)
    g.validate()
    assert g.num_nodes == 2000 and g.indices.dtype == np.int32
    assert not np.any(g.indices == g.dst()), "self-loop"
    _assert_no_duplicates(g)
    _assert_undirected(g)
    assert 9 < g.num_edges / g.num_nodes <= 10
    assert g.x.shape == (2000, 16) and g.x.dtype == np.float32
    assert g.y.dtype == np.int64 and set(np.unique(g.y)) == set(range(5))


def test_sbm_intra_class_fraction():
    g = sbm_graph(3000, num_classes=4, num_features=2, p_intra=0.8, seed=2)
    same = np.mean(g.y[g.indices] == g.y[g.dst()])
    assert 0.75 < same < 0.85
    g = sbm_graph(3000, num_classes=4, num_features=2, p_intra=1.0, seed=2)
    assert np.all(g.y[g.indices] == g.y[g.dst()])


def test_sbm_planetoid_split():
    g = sbm_graph(3000, num_classes=6, num_features=4, train_per_class=20, val=500, test=1000)
    _assert_disjoint_masks(g)
    assert np.array_equal(np.bincount(g.y[g.train_mask], minlength=6), np.full(6, 20))
    assert (g.val_mask.sum(), g.test_mask.sum()) == (500, 1000)


def test_sbm_split_clipped_on_small_graph():
    g = sbm_graph(100, num_classes=4, num_features=4, train_per_class=20, val=500, test=1000)
    _assert_disjoint_masks(g)
    n_train = int(g.train_mask.sum())
    assert n_train == sum(min(20, c) for c in np.bincount(g.y, minlength=4))
    assert g.val_mask.sum() == 100 - n_train and g.test_mask.sum() == 0


def test_sbm_deterministic_per_seed():
    _assert_same(sbm_graph(800, seed=9), sbm_graph(800, seed=9))
    g, h = sbm_graph(800, seed=9), sbm_graph(800, seed=10)
    assert not np.array_equal(g.y, h.y) and not np.array_equal(g.x, h.x)


def test_sbm_is_learnable_from_neighbourhoods():
    # Nearest-centroid classification (centroids from the training vertices):
    # on the neighbourhood mean it must be far better than on raw features,
    # which is what makes a GCN beat an MLP on these graphs.
    g = load_builtin("sbm-small")
    dst = g.dst()
    agg = g.x.astype(np.float64).copy()
    np.add.at(agg, dst, g.x[g.indices])
    agg /= (g.in_degree() + 1)[:, None]

    def accuracy(feat: np.ndarray) -> float:
        cent = np.stack([feat[g.train_mask & (g.y == c)].mean(0) for c in range(g.num_classes)])
        dist = ((feat[g.test_mask, None, :] - cent[None]) ** 2).sum(-1)
        return float(np.mean(dist.argmin(1) == g.y[g.test_mask]))

    raw, smoothed = accuracy(g.x), accuracy(agg)
    assert smoothed > 0.7 and smoothed > raw + 0.3


# ------------------------------------------------------------------ registry
def test_registry_names_and_descriptions():
    for name in ("sbm-small", "sbm-medium", "sbm-large", "rmat-16", "rmat-20", "rmat-22"):
        assert name in BUILTIN_DATASETS
        desc = BUILTIN_DATASETS[name].description
        assert desc and "\n" not in desc


def test_load_builtin_sbm_small():
    g = load_builtin("builtin:sbm-small")
    assert g.name == "sbm-small"
    assert (g.num_nodes, g.num_features, g.num_classes) == (3000, 100, 7)
    assert (g.train_mask.sum(), g.val_mask.sum(), g.test_mask.sum()) == (140, 500, 1000)


def test_load_builtin_unknown_name():
    with pytest.raises(UserError) as err:
        load_builtin("foo")
    msg = str(err.value)
    assert msg.startswith("unknown built-in dataset 'foo'; choose one of: sbm-small, sbm-medium")
    assert "rmat-22" in msg and "\n" not in msg
