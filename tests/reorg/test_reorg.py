"""Reorganizer: valid orders, the cost model, never worse than identity, and greedy wins."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hongtu.dedup import (
    Volumes,
    check_order,
    consecutive_overlaps,
    identity_order,
    neighbour_sets,
    plan_transfers,
    transition_sets,
)
from hongtu.graph import Graph
from hongtu.graph import _kernels as graph_kernels
from hongtu.reorg import (
    T_DD,
    T_HD,
    T_RU,
    cost,
    group_batches,
    order_batches,
    plan_batches,
    reorganize,
    reorganize_report,
)
from tests.cases import CASES
from tests.dedup.test_plan import brute_force_volumes, renumbered

SHAPES = [(1, 1), (1, 4), (2, 3), (3, 3), (4, 2)]


def brute_cost(g, chunk_ptr, order, **kw) -> float:
    vol = brute_force_volumes(g.indptr, g.indices, chunk_ptr, order)
    return cost(Volumes(**vol), **kw)


def set_graph(reads: list[range], chunk_size: int = 5) -> tuple[Graph, np.ndarray]:
    """Chunk ``c`` = ids ``[c*size, (c+1)*size)``; each of its vertices reads all ``reads[c]``."""
    src, dst = [], []
    for c, rows in enumerate(reads):
        for v in range(c * chunk_size, (c + 1) * chunk_size):
            src += list(rows)
            dst += [v] * len(rows)
    num_nodes = len(reads) * chunk_size
    g = Graph.from_edge_index(np.array([src, dst]), num_nodes)
    return g, np.arange(0, num_nodes + 1, chunk_size, dtype=np.int64)


def test_cost_formula():
    vol = Volumes(v_ori=100, v_p2p=60, v_ru=25, row_bytes=4)
    want = 4 * (25 / T_HD + 40 / T_DD + 35 / T_RU)
    assert cost(vol) == pytest.approx(want)
    assert cost(vol, row_bytes=8) == pytest.approx(2 * want)
    assert cost(vol, t_hd=1.0, t_dd=2.0, t_ru=5.0) == pytest.approx(4 * (25 + 20 + 7))
    g, chunk_ptr = renumbered(CASES["skewed"](), 2, 2)
    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, 2, 2, row_bytes=64)
    assert cost(plan) == pytest.approx(64 * (plan.v_ru / T_HD + (plan.v_ori - plan.v_p2p) / T_DD
                                             + (plan.v_p2p - plan.v_ru) / T_RU))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m,n", SHAPES)
def test_valid_and_never_worse(case, m, n):
    g, chunk_ptr = renumbered(CASES[case](), m, n, seed=3)
    res = reorganize_report(g.indptr, g.indices, chunk_ptr, m, n)
    order = check_order(res.order, m, n)
    assert sorted(order.ravel().tolist()) == list(range(m * n))
    assert all(order[k, i] // n == i for k in range(n) for i in range(m))
    # Independent check of the cost with Python sets.
    ident = brute_cost(g, chunk_ptr, identity_order(m, n))
    assert brute_cost(g, chunk_ptr, order) <= ident
    assert res.costs[res.chosen] == pytest.approx(brute_cost(g, chunk_ptr, order))
    assert res.costs["identity"] == pytest.approx(ident)
    for name, vol in res.volumes.items():
        assert vol.v_ori == res.volumes["identity"].v_ori, name
    assert np.array_equal(reorganize(g.indptr, g.indices, chunk_ptr, m, n), order)
    # The chosen order's overlaps, read off the chain's matrix, are the counted
    # ones, and the plan made with them is the plan made without.
    nb = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    counted = consecutive_overlaps(*transition_sets(*nb, order, g.num_nodes))
    if n > 2:
        assert np.array_equal(res.overlaps, counted)
    got_order, plan = plan_batches(g.indptr, g.indices, chunk_ptr, m, n, cache_rows=3)
    want = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order, cache_rows=3)
    a, b = plan.to_npz_dict(), want.to_npz_dict()
    assert np.array_equal(got_order, order)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="overlaps given"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order,
                       overlaps=np.zeros(n + 1, dtype=np.int64))
    # (the reorganiser's sets of the chosen order are the counted ones)
    sets = res.transitions()
    want_sets = transition_sets(*nb, order, g.num_nodes)
    assert all(np.array_equal(x, y) for x, y in zip(sets, want_sets))
    with pytest.raises(ValueError, match="transition sets given"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order,
                       transitions=(sets[0][:-1], sets[1]))


def test_phase2_chains_similar_batches():
    a, b = range(0, 10), range(10, 20)
    g, chunk_ptr = set_graph([a, b, a, b])
    res = reorganize_report(g.indptr, g.indices, chunk_ptr, 1, 4)
    assert res.chosen == "order"
    assert res.volumes["identity"].v_ru == 40 and res.volumes["order"].v_ru == 20
    rows = res.order[:, 0].tolist()
    assert {frozenset(rows[:2]), frozenset(rows[2:])} == {frozenset({0, 2}), frozenset({1, 3})}
    nb = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    assert np.array_equal(order_batches(*nb, identity_order(1, 4), g.num_nodes), res.order)


def test_phase1_groups_chunks_with_shared_neighbours():
    a, b, c = range(0, 10), range(10, 20), range(20, 30)
    # Part 0 reads a, b, c; part 1 reads c, a, b: identity batches mix them.
    g, chunk_ptr = set_graph([a, b, c, c, a, b], chunk_size=5)
    nb = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    grouped = group_batches(*nb, 2, 3, g.num_nodes)
    assert grouped.tolist() == [[0, 4], [1, 5], [2, 3]]
    res = reorganize_report(g.indptr, g.indices, chunk_ptr, 2, 3)
    assert res.chosen == "group+order"
    assert res.volumes["group+order"].v_ru == 30 < res.volumes["identity"].v_ru == 40
    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, 2, 3, order=res.order, devices=2)
    assert plan.h2d_rows == 30
    # When host loads cost nothing and peer copies are slow, grouping loses.
    slow_dd = reorganize_report(g.indptr, g.indices, chunk_ptr, 2, 3, t_hd=1e15, t_dd=1e6)
    assert slow_dd.chosen != "group+order"


def test_parallel_kernels_agree_with_serial(monkeypatch):
    g, chunk_ptr = renumbered(CASES["skewed"](), 3, 3, seed=1)
    serial = reorganize_report(g.indptr, g.indices, chunk_ptr, 3, 3)
    monkeypatch.setattr(graph_kernels, "SERIAL_BELOW", 0)
    par = reorganize_report(g.indptr, g.indices, chunk_ptr, 3, 3)
    assert np.array_equal(serial.order, par.order) and serial.costs == par.costs


def test_overlap_methods_agree(monkeypatch):
    # Bit rows and the inverted index count the same intersections, for the
    # chain (sets against themselves) and for a part's chunks against batches.
    from hongtu.reorg import reorg as R

    g, chunk_ptr = renumbered(CASES["skewed"](), 3, 3, seed=1)
    ptr, ids = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    n = g.num_nodes
    expect = np.array([[np.intersect1d(ids[ptr[q]:ptr[q + 1]], ids[ptr[s]:ptr[s + 1]]).size
                        for s in range(3)] for q in range(3, 6)])
    both = set()
    for cap in (0, 1 << 30):  # 0: bit rows never fit, so the inverted index is used
        monkeypatch.setattr(R, "_BITSET_BYTES", cap)
        monkeypatch.setattr(R, "_bit_overlaps", _spy(R._bit_overlaps, both, "bits"))
        monkeypatch.setattr(R, "_overlaps", _spy(R._overlaps, both, "index"))
        sub = R._overlap_matrix(ptr, ids, np.arange(3, 6), ptr[:4], ids[:ptr[3]], n)
        assert np.array_equal(sub, expect)
        full = R._overlap_matrix(ptr, ids, np.arange(9), ptr, ids, n)
        assert np.array_equal(full, full.T) and np.array_equal(full[3:6, :3], expect)
    assert both == {"bits", "index"}


def _spy(fn, seen, name):
    def call(*a):
        seen.add(name)
        return fn(*a)
    return call


def test_phases_can_be_switched_off():
    g, chunk_ptr = renumbered(CASES["halo_heavy"](), 2, 4)
    res = reorganize_report(g.indptr, g.indices, chunk_ptr, 2, 4, phase1=False, phase2=False)
    assert res.chosen == "identity" and list(res.costs) == ["identity"]
    res = reorganize_report(g.indptr, g.indices, chunk_ptr, 2, 4, phase1=False)
    assert list(res.costs) == ["identity", "order"]


@settings(max_examples=30, deadline=None)
@given(num_nodes=st.integers(12, 60), density=st.floats(0.0, 6.0), m=st.integers(1, 4),
       n=st.integers(1, 3), seed=st.integers(0, 2**16), hub=st.booleans())
def test_random_graphs_never_worse(num_nodes, density, m, n, seed, hub):
    rng = np.random.default_rng(seed)
    e = int(density * num_nodes)
    src = rng.zipf(1.5, e) % num_nodes if hub else rng.integers(0, num_nodes, e)
    g = Graph.from_edge_index(np.stack([src, rng.integers(0, num_nodes, e)]), num_nodes)
    g, chunk_ptr = renumbered(g, m, n, seed)
    order = check_order(reorganize(g.indptr, g.indices, chunk_ptr, m, n), m, n)
    assert brute_cost(g, chunk_ptr, order) <= brute_cost(g, chunk_ptr, identity_order(m, n))


@pytest.mark.parametrize("seed", range(4))
def test_index_steps_count_the_sets_holding_each_query_element(seed):
    """The inverted index's work (which decides the overlap method), counted by
    vertex ranges in parallel, is the count of sets holding each vertex, summed
    over the query sets' elements."""
    from hongtu.reorg.reorg import _index_steps

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))

    def csr(k):
        sets = [np.unique(rng.integers(0, n, rng.integers(0, 3000))) for _ in range(k)]
        return (np.concatenate([[0], np.cumsum([s.size for s in sets])]).astype(np.int64),
                np.concatenate(sets).astype(np.int32))

    t_ptr, t_ids = csr(int(rng.integers(1, 9)))
    q_ptr, q_ids = csr(int(rng.integers(1, 9)))
    sel = rng.permutation(q_ptr.size - 1)[:int(rng.integers(1, q_ptr.size))]
    held = np.bincount(t_ids, minlength=n)
    asked = np.bincount(np.concatenate([q_ids[q_ptr[q]:q_ptr[q + 1]] for q in sel]),
                        minlength=n)
    assert _index_steps(q_ptr, q_ids, sel, t_ptr, t_ids, n, False) == int(asked @ held)
    every = np.arange(t_ptr.size - 1)
    assert _index_steps(t_ptr, t_ids, every, t_ptr, t_ids, n, True) == int(held @ held)
