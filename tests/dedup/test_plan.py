"""Transfer planner: neighbour sets, volumes against Python sets, and a replay of every plan."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hongtu.dedup import (
    TransferPlan,
    check_order,
    identity_order,
    neighbour_sets,
    plan_transfers,
    transition_sets,
    union_sets,
)
from hongtu.dedup import sets as sets_module
from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.graph import _kernels as graph_kernels
from hongtu.partition import chunk_partition
from tests.cases import CASES

# (m, n): one chunk, one part, several parts.
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2), (4, 3)]
FLAGS = [(r, p) for r in (True, False) for p in (True, False)]


# ------------------------------------------------------------------ oracles
def renumbered(graph: Graph, m: int, n: int, seed: int = 0):
    """``(graph, chunk_ptr)`` after an injected balanced random part assignment."""
    rng = np.random.default_rng(seed)
    assignment = rng.permutation(np.arange(graph.num_nodes) % m)
    p = chunk_partition(graph, assignment, n, num_parts=m)
    return p.apply(graph), p.chunk_ptr


def py_neighbours(indptr, indices, chunk_ptr) -> list[list[int]]:
    return [sorted(set(indices[indptr[a]:indptr[b]].tolist()))
            for a, b in zip(chunk_ptr[:-1], chunk_ptr[1:])]


def brute_force_volumes(indptr, indices, chunk_ptr, order) -> dict[str, int]:
    """``v_ori``, ``v_p2p``, ``v_ru`` counted with Python sets."""
    nb = [set(s) for s in py_neighbours(indptr, indices, chunk_ptr)]
    v_ori = sum(len(nb[c]) for c in np.asarray(order).ravel())
    trans = [set().union(*(nb[c] for c in row)) for row in np.asarray(order)]
    v_p2p = sum(len(t) for t in trans)
    v_ru = sum(len(t - (trans[k - 1] if k else set())) for k, t in enumerate(trans))
    return {"v_ori": v_ori, "v_p2p": v_p2p, "v_ru": v_ru}


def resident_sets(nb, order, part_ptr, devices, p2p) -> list[list[tuple[list[int], set]]]:
    """Per device, per step: (chunks computed, rows kept in own slots)."""
    m = order.shape[1]
    owner = np.searchsorted(part_ptr, np.arange(part_ptr[-1]), side="right") - 1
    trans = [set().union(*(nb[c] for c in row)) for row in order]
    out = []
    for d in range(devices):
        if devices == 1 and (p2p or m == 1):
            steps = [(list(row), trans[k]) for k, row in enumerate(order)]
        elif devices == 1:
            steps = [([c], set(nb[c])) for c in order.ravel()]
        elif p2p:
            steps = [([order[k, d]], {u for u in trans[k] if owner[u] == d})
                     for k in range(order.shape[0])]
        else:
            steps = [([order[k, d]], set(nb[order[k, d]])) for k in range(order.shape[0])]
        out.append(steps)
    return out


def expected_traffic(nb, order, part_ptr, devices, reuse, p2p) -> tuple[int, int]:
    """``(h2d_rows, d2d_rows)`` by Python sets."""
    h2d = 0
    for steps in resident_sets(nb, order, part_ptr, devices, p2p):
        prev: set = set()
        for _, res in steps:
            h2d += len(res - prev) if reuse else len(res)
            prev = res
    d2d = 0
    if devices > 1 and p2p:  # (rows of other parts a device read at the step before stay)
        for d in range(devices):
            lo, hi = part_ptr[d], part_ptr[d + 1]
            prev = set()
            for c in order[:, d]:
                res = {u for u in nb[c] if not lo <= u < hi}
                d2d += len(res - prev) if reuse else len(res)
                prev = res
    return h2d, d2d


def replay(plan: TransferPlan, nb, seed: int = 0) -> None:
    """Walk a plan step by step on all devices at once, asserting the protocol.

    Buffers are dicts slot -> id; gradients are exact integers so the flushed
    host gradient must equal the sum of every chunk's contributions. A plan
    that keeps reused rows (``cached_rows``) holds supersets of the sets.
    """
    exact = plan.cached_rows == 0
    rng = random.Random(seed)
    plans = plan.plans
    steps = {p.num_steps for p in plans}
    assert len(steps) == 1 or plan.devices == 1
    expected = resident_sets(nb, plan.order, plan.part_ptr, plan.devices, plan.p2p)
    own = [dict() for _ in plans]
    grad = [dict() for _ in plans]
    host_grad: dict[int, int] = {}
    want_grad: dict[int, int] = {}
    processed = []
    recv = [dict() for _ in plans]  # the receive areas: rows stay while steps read them
    recv_grad = [dict() for _ in plans]
    for s in range(plans[0].num_steps):
        for p in plans:
            ids, slots = p.step("load_ids", s).tolist(), p.step("load_slots", s).tolist()
            assert ids == sorted(ids) and slots == sorted(slots)
            for u, sl in zip(ids, slots):
                assert 0 <= sl < p.num_slots and sl not in own[p.device]
                assert u not in own[p.device].values()
                own[p.device][sl] = u
                grad[p.device][sl] = 0
            held, want = set(own[p.device].values()), expected[p.device][s][1]
            assert held == want if exact else held >= want
            assert len(own[p.device]) <= p.num_slots
        # Exchange: d's run for e must equal e's run from d.
        for p in plans:
            sent, to = p.step("send_slots", s), p.step("send_to", s)
            sent_ids = p.step("send_ids", s)
            for e in range(plan.devices):
                mine = sent[to == e].tolist()
                assert len(mine) == p.send_counts[s, e]
                assert [own[p.device][sl] for sl in mine] == sent_ids[to == e].tolist()
                q = plans[e]
                frm = q.step("recv_from", s)
                their = q.step("recv_slots", s)[frm == p.device].tolist()
                assert q.step("recv_ids", s)[frm == p.device].tolist() == sent_ids[to == e].tolist()
                assert len(their) == q.recv_counts[s, p.device] == len(mine)
                for sl_src, sl_dst in zip(mine, their):
                    assert q.num_slots <= sl_dst < q.buffer_rows and sl_dst not in recv[e]
                    assert own[p.device][sl_src] not in recv[e].values()
                    recv[e][sl_dst] = own[p.device][sl_src]
                    recv_grad[e][sl_dst] = 0
        for p in plans:  # (the area holds exactly the step's rows of other parts)
            if plan.devices > 1 and plan.p2p:
                lo, hi = plan.part_ptr[p.device], plan.part_ptr[p.device + 1]
                c = p.chunk_ids[s]
                want = {u for u in nb[c] if not lo <= u < hi}
                assert set(recv[p.device].values()) == want
                assert len(recv[p.device]) <= p.num_recv_slots
        # Compute: every neighbour row at the slot the plan names.
        for p in plans:
            d = p.device
            for q in range(p.step_ptr[s], p.step_ptr[s + 1]):
                c, slots = p.chunk(q)
                processed.append(c)
                assert len(slots) == len(nb[c])
                for u, sl in zip(nb[c], slots.tolist()):
                    area, garea = (own[d], grad[d]) if sl < p.num_slots else (recv[d], recv_grad[d])
                    assert area.get(sl) == u, f"chunk {c} reads {u} at slot {sl}: not there"
                    g = rng.randint(1, 99)
                    garea[sl] = garea.get(sl, 0) + g
                    want_grad[u] = want_grad.get(u, 0) + g
        # Backward: gradients of rows leaving a receive area go back to the owners' slots.
        for p in plans:
            leave = p.step("leave_slots", s).tolist()
            owner = [q.device for q in plans for _ in range(p.leave_counts[s, q.device])]
            assert len(owner) == len(leave)
            gone = [recv[p.device].pop(sl) for sl in leave]
            assert gone == sorted(gone)
            if s + 1 < p.num_steps and plan.reuse:  # (rows read at s + 1 stay)
                nxt = set(nb[p.chunk_ids[s + 1]])
                assert not nxt & set(gone)
                assert set(recv[p.device].values()) <= nxt
            for e in range(plan.devices):
                q = plans[e]
                back = q.step("back_slots", s)
                b0 = int(q.back_counts[s, :p.device].sum())
                mine = [sl for sl, o in zip(leave, owner) if o == e]
                assert len(mine) == q.back_counts[s, p.device]
                for u, sl_src, sl_dst in zip([g for g, o in zip(gone, owner) if o == e], mine,
                                             back[b0:b0 + len(mine)].tolist()):
                    assert own[e][sl_dst] == u
                    grad[e][sl_dst] += recv_grad[p.device].pop(sl_src)
        for p in plans:
            ids, slots = p.step("flush_ids", s).tolist(), p.step("flush_slots", s).tolist()
            assert ids == sorted(ids)
            for u, sl in zip(ids, slots):
                assert own[p.device].pop(sl) == u
                host_grad[u] = host_grad.get(u, 0) + grad[p.device].pop(sl)
            if s + 1 < p.num_steps and plan.reuse:
                nxt = expected[p.device][s + 1][1]
                held, want = set(own[p.device].values()), expected[p.device][s][1] & nxt
                assert held == want if exact else held >= want
    assert all(not o for o in own), "rows left resident after the last step"
    assert all(not r for r in recv), "rows left in a receive area after the last step"
    assert sorted(processed) == list(range(plan.num_parts * plan.num_chunks))
    assert host_grad == want_grad


def random_order(m, n, seed):
    rng = np.random.default_rng(seed)
    order = identity_order(m, n)
    for i in range(m):
        order[:, i] = rng.permutation(order[:, i])
    return order[rng.permutation(n)]


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m,n", SHAPES)
def test_neighbour_sets_match_unique(case, m, n):
    g, chunk_ptr = renumbered(CASES[case](), m, n)
    ptr, ids = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    assert ptr.shape == (m * n + 1,) and ids.dtype == g.indices.dtype
    for c, want in enumerate(py_neighbours(g.indptr, g.indices, chunk_ptr)):
        assert ids[ptr[c]:ptr[c + 1]].tolist() == want


def test_unions_sort_and_scan_paths():
    # Sparse wide sets take the sort path, dense narrow ones the flag scan.
    rng = np.random.default_rng(3)
    vals = np.concatenate([rng.integers(0, 10**6, 50), rng.integers(5, 40, 500)]).astype(np.int64)
    gptr = np.array([0, 1, 2, 4])
    starts, stops = np.array([0, 50, 0, 50]), np.array([50, 550, 50, 550])
    ptr, ids = union_sets(vals, gptr, starts, stops, 10**6)
    want = [np.unique(vals[:50]), np.unique(vals[50:]), np.unique(vals)]
    for g in range(3):
        assert np.array_equal(ids[ptr[g]:ptr[g + 1]], want[g])
    sorted_vals = np.concatenate([np.unique(v) for v in (vals[:50], vals[50:])])
    cut = np.unique(vals[:50]).size
    ptr2, ids2 = union_sets(sorted_vals, np.array([0, 2]), np.array([0, cut]),
                            np.array([cut, sorted_vals.size]), 10**6, presorted=True)
    assert np.array_equal(ids2, np.unique(vals)) and ptr2.tolist() == [0, ids2.size]


@pytest.mark.parametrize("piece", [1, 7, 300])
def test_sorted_unions_cut_into_pieces(monkeypatch, piece):
    """A few groups of sorted segments are merged in pieces by value (more tasks
    than groups): the unions are those of one merge per group, empty groups and
    segments included."""
    rng = np.random.default_rng(piece)
    segs = [np.unique(rng.integers(0, 4000, k)) for k in (900, 0, 2500, 40, 1, 1200, 700)]
    values = np.concatenate(segs).astype(np.int32)
    ends = np.cumsum([0] + [x.size for x in segs])
    gptr = np.array([0, 3, 3, 4, 7])  # (the second group has no segment)
    want = [np.unique(np.concatenate(segs[a:b] + [np.empty(0, np.int64)]))
            for a, b in zip(gptr[:-1], gptr[1:])]
    monkeypatch.setattr(sets_module, "MERGE_PIECE", piece)
    assert sets_module._merge_pieces(values, gptr, ends[:-1], ends[1:]) is not None
    ptr, ids = union_sets(values, gptr, ends[:-1], ends[1:], 4000, presorted=True)
    assert ids.dtype == values.dtype and ptr.shape == (5,)
    for g in range(4):
        assert ids[ptr[g]:ptr[g + 1]].tolist() == want[g].tolist()
    # one group: as many pieces as four tasks per thread
    ptr, ids = union_sets(values, np.array([0, 7]), ends[:-1], ends[1:], 4000, presorted=True)
    assert ids.tolist() == np.unique(values).tolist() and ptr.tolist() == [0, ids.size]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m,n", SHAPES)
def test_volumes_match_brute_force(case, m, n):
    g, chunk_ptr = renumbered(CASES[case](), m, n)
    for order in (None, random_order(m, n, 1)):
        plan = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order)
        want = brute_force_volumes(g.indptr, g.indices, chunk_ptr, check_order(order, m, n))
        assert {k: getattr(plan, k) for k in want} == want
        assert plan.v_ru <= plan.v_p2p <= plan.v_ori
        if m == 1:
            assert plan.v_ori == plan.v_p2p


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("reuse,p2p", FLAGS)
def test_plan_replays(case, m, n, reuse, p2p):
    g, chunk_ptr = renumbered(CASES[case](), m, n, seed=len(case))
    nb = py_neighbours(g.indptr, g.indices, chunk_ptr)
    for devices in sorted({1, m}):
        for k, order in enumerate((None, random_order(m, n, 7))):
            plan = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order,
                                  reuse=reuse, p2p=p2p, devices=devices, row_bytes=512)
            replay(plan, nb, seed=k)
            h2d, d2d = expected_traffic(nb, plan.order, plan.part_ptr, devices, reuse, p2p)
            assert (plan.h2d_rows, plan.d2d_rows) == (h2d, d2d)
            assert plan.d2h_rows == plan.h2d_rows
            assert plan.h2d_bytes == 512 * h2d
            if devices == 1 and not p2p and not reuse:
                assert plan.h2d_rows == plan.v_ori
            if p2p and not reuse:
                assert plan.h2d_rows == plan.v_p2p
            if p2p and reuse:
                assert plan.h2d_rows == plan.v_ru


@pytest.mark.parametrize("m,n", [(2, 3), (3, 3), (4, 2)])
@pytest.mark.parametrize("cache", [0, 5])
def test_one_device_planned_alone_is_its_part_of_the_whole(m, n, cache):
    """A rank plans its own device's steps alone (``only``): the same arrays as
    that device's in the plan of every device, the others left out, the
    totals its own."""
    g, chunk_ptr = renumbered(CASES["halo_heavy"](), m, n)
    whole = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, devices=m, cache_rows=cache)
    for d in range(m):
        alone = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, devices=m,
                               cache_rows=cache, only=d)
        assert [p is None for p in alone.plans] == [e != d for e in range(m)]
        a, b = alone.plans[d], whole.plans[d]
        for f in dataclasses.fields(a):
            assert np.array_equal(getattr(a, f.name), getattr(b, f.name)), f.name
        assert (alone.h2d_rows, alone.d2d_rows, alone.d2h_rows) == (
            b.load_ids.shape[0], b.send_ids.shape[0], b.flush_ids.shape[0])
        assert (alone.v_ru, alone.cached_rows) == (whole.v_ru, whole.cached_rows)
        back = TransferPlan.from_npz_dict(alone.to_npz_dict())
        assert [p is None for p in back.plans] == [e != d for e in range(m)]


def test_in_place_slots_are_kept_and_compact():
    g, chunk_ptr = renumbered(CASES["halo_heavy"](), 2, 4)
    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, 2, 4, devices=2)
    nb_ptr, nb_ids = neighbour_sets(g.indptr, g.indices, chunk_ptr)
    t_ptr, _ = transition_sets(nb_ptr, nb_ids, plan.order, g.num_nodes)
    for p in plan.plans:
        sizes = np.diff(p.step_ptr)
        assert np.all(sizes == 1)
        # Resident area is exactly as large as the largest resident set.
        live, peak = 0, 0
        for s in range(p.num_steps):
            live += p.load_ptr[s + 1] - p.load_ptr[s]
            peak = max(peak, live)
            live -= p.flush_ptr[s + 1] - p.flush_ptr[s]
        assert peak == p.num_slots
        assert p.num_slots <= np.diff(t_ptr).max()
        # The receive area: as large as the most rows of other parts a step reads.
        lo, hi = plan.part_ptr[p.device], plan.part_ptr[p.device + 1]
        sets = [nb_ids[nb_ptr[c]:nb_ptr[c + 1]] for c in p.chunk_ids]
        assert p.num_recv_slots == max(int(((u < lo) | (u >= hi)).sum()) for u in sets)


@pytest.mark.parametrize("devices", [1, 3])
def test_parallel_kernels_agree_with_serial(monkeypatch, devices):
    # Unit-test inputs are below the serial cut-off; force the prange variants.
    g, chunk_ptr = renumbered(CASES["halo_heavy"](), 3, 2)
    order = random_order(3, 2, 5)
    serial = plan_transfers(g.indptr, g.indices, chunk_ptr, 3, 2, order=order, devices=devices)
    monkeypatch.setattr(graph_kernels, "SERIAL_BELOW", 0)
    par = plan_transfers(g.indptr, g.indices, chunk_ptr, 3, 2, order=order, devices=devices)
    a, b = serial.to_npz_dict(), par.to_npz_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    replay(par, py_neighbours(g.indptr, g.indices, chunk_ptr))


def test_npz_round_trip(tmp_path):
    g, chunk_ptr = renumbered(CASES["skewed"](), 3, 2)
    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, 3, 2, devices=3, row_bytes=256)
    np.savez(tmp_path / "plan.npz", **plan.to_npz_dict())
    with np.load(tmp_path / "plan.npz") as data:
        back = TransferPlan.from_npz_dict(data)
    assert back.volumes() == plan.volumes() and back.row_bytes == 256
    assert (back.reuse, back.p2p, back.devices) == (plan.reuse, plan.p2p, plan.devices)
    for a, b in zip(plan.plans, back.plans):
        for name, value in vars(a).items():
            assert np.array_equal(value, getattr(b, name)), name
    replay(back, py_neighbours(g.indptr, g.indices, chunk_ptr))


def test_bad_arguments():
    g, chunk_ptr = renumbered(CASES["isolated"](), 4, 2)
    with pytest.raises(UserError, match="devices must be 1 or"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, 4, 2, devices=2)
    bad = identity_order(4, 2)
    bad[0, 1], bad[0, 2] = bad[0, 2], bad[0, 1]
    with pytest.raises(UserError, match="another part"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, 4, 2, order=bad)
    with pytest.raises(UserError, match="shape"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, 4, 2, order=bad.T)
    dup = identity_order(4, 2)
    dup[1] = dup[0]
    with pytest.raises(UserError, match="exactly once"):
        plan_transfers(g.indptr, g.indices, chunk_ptr, 4, 2, order=dup)


@settings(max_examples=25, deadline=None)
@given(num_nodes=st.integers(8, 40), density=st.floats(0.0, 4.0), m=st.integers(1, 4),
       n=st.integers(1, 2), seed=st.integers(0, 2**16), reuse=st.booleans(),
       p2p=st.booleans(), multi=st.booleans())
def test_random_graphs_replay(num_nodes, density, m, n, seed, reuse, p2p, multi):
    rng = np.random.default_rng(seed)
    e = int(density * num_nodes)
    g = Graph.from_edge_index(rng.integers(0, num_nodes, (2, e)), num_nodes)
    g, chunk_ptr = renumbered(g, m, n, seed)
    nb = py_neighbours(g.indptr, g.indices, chunk_ptr)
    devices = m if multi else 1
    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=random_order(m, n, seed),
                          reuse=reuse, p2p=p2p, devices=devices)
    replay(plan, nb, seed)
    want = brute_force_volumes(g.indptr, g.indices, chunk_ptr, plan.order)
    assert (plan.v_ori, plan.v_p2p, plan.v_ru) == (want["v_ori"], want["v_p2p"], want["v_ru"])
    assert (plan.h2d_rows, plan.d2d_rows) == expected_traffic(nb, plan.order, plan.part_ptr,
                                                              devices, reuse, p2p)


# ------------------------------------------------------------------ kept rows
def load_counts(plan: TransferPlan) -> dict[tuple[int, int], int]:
    """``(device, row) -> loads per pass``."""
    out: dict[tuple[int, int], int] = {}
    for p in plan.plans:
        for u in p.load_ids.tolist():
            out[p.device, u] = out.get((p.device, u), 0) + 1
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m,n", [(1, 5), (2, 4), (3, 3), (4, 6)])
@pytest.mark.parametrize("extra", [1, 3, 10**6])
def test_kept_rows_replay_and_save_loads(case, m, n, extra):
    g, chunk_ptr = renumbered(CASES[case](), m, n, seed=len(case))
    nb = py_neighbours(g.indptr, g.indices, chunk_ptr)
    for devices in sorted({1, m}):
        order = random_order(m, n, 3)
        plain = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order,
                               devices=devices)
        kept = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order,
                              devices=devices, cache_rows=extra)
        replay(kept, nb, seed=extra)
        assert (kept.v_ori, kept.v_p2p, kept.v_ru) == (plain.v_ori, plain.v_p2p, plain.v_ru)
        assert kept.d2d_rows == plain.d2d_rows and kept.d2h_rows == kept.h2d_rows
        for a, b in zip(plain.plans, kept.plans):
            assert b.num_slots <= a.num_slots + extra
        # A kept row is loaded once instead of once per run of reads; every
        # other row exactly as without caching.
        before, after = load_counts(plain), load_counts(kept)
        assert before.keys() == after.keys()
        changed = [k for k in before if before[k] != after[k]]
        assert all(after[k] == 1 and before[k] > 1 for k in changed)
        assert len(changed) == kept.cached_rows
        assert kept.h2d_rows == plain.h2d_rows - sum(before[k] - 1 for k in changed)
        if extra == 10**6:  # room for everything: every row loaded once per device
            assert all(v == 1 for v in after.values())


def test_kept_rows_need_reuse_and_shared_sets():
    g, chunk_ptr = renumbered(CASES["skewed"](), 2, 4)
    for reuse, p2p in [(False, True), (True, False), (False, False)]:
        plan = plan_transfers(g.indptr, g.indices, chunk_ptr, 2, 4, reuse=reuse, p2p=p2p,
                              cache_rows=100)
        assert plan.cached_rows == 0


def test_kept_rows_prefer_most_reused():
    # Row 0 is read by steps 0, 2, 4 (2 gaps of 1 step: saves 2 loads), row 1
    # by steps 0 and 4 (one gap of 3 steps: saves 1); one spare slot per step
    # keeps row 0 only.
    from hongtu.dedup.cache import keep_reused_rows
    sets = [[0, 1, 5], [6, 9, 10], [0, 7, 11], [8, 12, 13], [0, 1]]
    ptr = np.cumsum([0] + [len(s) for s in sets])
    ids = np.concatenate([np.array(s) for s in sets]).astype(np.int64)
    new_ptr, new_ids, kept = keep_reused_rows(ptr, ids, 14, extra=1)
    got = [new_ids[new_ptr[s]:new_ptr[s + 1]].tolist() for s in range(len(sets))]
    assert kept == 1 and got == [[0, 1, 5], [0, 6, 9, 10], [0, 7, 11], [0, 8, 12, 13], [0, 1]]
    new_ptr, new_ids, kept = keep_reused_rows(ptr, ids, 14, extra=0)
    assert kept == 0 and np.array_equal(new_ids, ids)
    _, new_ids, kept = keep_reused_rows(ptr, ids, 14, extra=2)
    assert kept == 2 and new_ids.size == ids.size + 2 + 3


def py_keep_reused_rows(sets, num_nodes, extra, part_ptr):
    """The selection spelled out: rows by (runs - 1) / gap steps, best first,
    ties by id; a row is kept when each of its gap steps has a slot left."""
    steps = len(sets)
    reads = {u: [s for s in range(steps) if u in sets[s]] for u in range(num_nodes)}
    gap_steps = {u: [s for s in range(r[0], r[-1] + 1) if s not in r] if r else []
                 for u, r in reads.items()}
    runs = {u: sum(1 for a, b in zip(r, r[1:]) if b - a > 1) + 1 for u, r in reads.items() if r}
    cands = sorted((u for u in runs if runs[u] > 1),
                   key=lambda u: (-(runs[u] - 1) / len(gap_steps[u]), u))
    owner = lambda u: int(np.searchsorted(part_ptr, u, side="right")) - 1  # noqa: E731
    size = {(d, s): sum(1 for u in sets[s] if owner(u) == d)
            for d in range(len(part_ptr) - 1) for s in range(steps)}
    room = {(d, s): max(size[d, t] for t in range(steps)) + extra - size[d, s]
            for d, s in size}
    kept = []
    for u in cands:
        if all(room[owner(u), s] > 0 for s in gap_steps[u]):
            kept.append(u)
            for s in gap_steps[u]:
                room[owner(u), s] -= 1
    return [sorted(set(sets[s]) | {u for u in kept if s in gap_steps[u]}) for s in range(steps)]


@pytest.mark.parametrize("steps", [5, 64, 65, 130])
@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("extra", [1, 4, 50])
def test_kept_rows_match_the_spelled_out_selection(steps, devices, extra):
    """Random sets over more than 64 steps (several mask words) and devices."""
    from hongtu.dedup.cache import keep_reused_rows
    rng = np.random.default_rng(steps * 7 + devices + extra)
    num_nodes = 60
    sets = [sorted(rng.choice(num_nodes, rng.integers(1, 20), replace=False).tolist())
            for _ in range(steps)]
    part_ptr = np.linspace(0, num_nodes, devices + 1).astype(np.int64)
    ptr = np.cumsum([0] + [len(s) for s in sets])
    ids = np.concatenate([np.array(s) for s in sets]).astype(np.int32)
    new_ptr, new_ids, kept = keep_reused_rows(ptr, ids, num_nodes, extra,
                                              part_ptr if devices > 1 else None)
    got = [new_ids[new_ptr[s]:new_ptr[s + 1]].tolist() for s in range(steps)]
    want = py_keep_reused_rows(sets, num_nodes, extra, part_ptr)
    assert got == want and new_ids.dtype == ids.dtype
    assert kept == len({u for s in range(steps) for u in set(want[s]) - set(sets[s])})


@pytest.mark.parametrize("steps", [5, 64, 65, 130])
@pytest.mark.parametrize("extra", [2, 50])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("pieces", [False, True], ids=["whole-steps", "pieces"])
def test_kept_rows_walk_equals_the_extended_sets(steps, extra, parallel, pieces, monkeypatch):
    """The planner's slot walk on the sets as they are, holding kept rows through
    their gaps, gives the loads, flushes and slots of the walk on the sets
    extended by the kept rows (keep_reused_rows), in both kernel variants, with
    the walk's steps merged whole or in value pieces."""
    from hongtu.dedup import plan as plan_mod
    from hongtu.dedup.cache import choose_kept_rows, keep_reused_rows
    from hongtu.dedup.plan import _assign, _flags
    from hongtu.graph import _kernels as graph_kernels

    if parallel:
        monkeypatch.setattr(graph_kernels, "SERIAL_BELOW", 0)
    monkeypatch.setattr(plan_mod, "PIECE_ROWS", 1 if pieces else 1 << 40)
    rng = np.random.default_rng(steps + extra)
    num_nodes = 60
    sets = [sorted(rng.choice(num_nodes, rng.integers(1, 20), replace=False).tolist())
            for _ in range(steps)]
    ptr = np.cumsum([0] + [len(s) for s in sets]).astype(np.int64)
    ids = np.concatenate([np.array(s) for s in sets]).astype(np.int32)
    ext_ptr, ext_ids, count = keep_reused_rows(ptr, ids, num_nodes, extra)
    kept = choose_kept_rows(ptr, ids, num_nodes, extra)
    assert count > 0 and kept.kept == count
    assert np.array_equal(kept.sizes[0], np.diff(ext_ptr))
    res_ext = np.zeros(ext_ids.shape[0], dtype=np.int32)
    on_ext = _assign(ext_ids, ext_ptr[:-1], ext_ptr[1:], True, int(np.diff(ext_ptr).max()),
                     num_nodes, res_ext, np.int32)
    res = np.zeros(ids.shape[0], dtype=np.int32)
    walked = _assign(ids, ptr[:-1], ptr[1:], True, int(kept.sizes[0].max()), num_nodes, res,
                     np.int32, _flags(kept, ptr, ids))
    for a, b in zip(on_ext, walked):
        assert np.array_equal(a, b)
    for s in range(steps):  # every read row has the slot it has on the extended sets
        seg = ext_ids[ext_ptr[s]:ext_ptr[s + 1]]
        at = ext_ptr[s] + np.searchsorted(seg, ids[ptr[s]:ptr[s + 1]])
        assert np.array_equal(res[ptr[s]:ptr[s + 1]], res_ext[at])


@pytest.mark.parametrize("m,n,devices", [(1, 5, 1), (3, 4, 1), (3, 4, 3), (4, 6, 4)])
def test_needs_before_slots_equal_the_plan(m, n, devices):
    """The budget function sees exactly what the plan without kept rows needs."""
    g, chunk_ptr = renumbered(CASES["halo_heavy"](), m, n, seed=2)
    seen = []
    order = random_order(m, n, 4)

    def budget(needs):
        seen.append(needs)
        return 0

    plan = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order, devices=devices,
                          cache_rows=budget)
    assert len(seen) == 1 and plan.cached_rows == 0
    assert [(x.buffer_rows, x.max_later_load) for x in seen[0]] == \
        [(p.buffer_rows, p.max_later_load) for p in plan.plans]
    kept = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order, devices=devices,
                          cache_rows=lambda needs: 3)
    fixed = plan_transfers(g.indptr, g.indices, chunk_ptr, m, n, order=order, devices=devices,
                           cache_rows=3)
    assert kept.to_npz_dict().keys() == fixed.to_npz_dict().keys()
    assert all(np.array_equal(a, fixed.to_npz_dict()[k]) for k, a in kept.to_npz_dict().items())


def py_slots(sets, reuse):
    """Lowest-free slot assignment spelled out: ``(loads, flushes)`` per step, as (id, slot)."""
    slot_of: dict[int, int] = {}
    loads, flushes = [], []
    prev: list[int] = []
    for s, cur in enumerate(sets + [[]]):
        keep = set(cur) if reuse and s < len(sets) else set()
        if s:
            flushes.append([(u, slot_of.pop(u)) for u in prev if u not in keep])
        if s == len(sets):
            break
        step = []
        for u in cur:
            if u not in slot_of:
                p = min(set(range(len(cur) + 1)) - set(slot_of.values()))
                slot_of[u] = p
                step.append((u, p))
        loads.append(step)
        prev = cur
    return loads, flushes


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("pieces", [False, True], ids=["whole-steps", "pieces"])
def test_slot_assignment_is_lowest_free(monkeypatch, reuse, serial, pieces):
    """The two-pass slot assignment (parallel merges, sequential placement of loads and
    flushes only) places rows exactly as the one-pass rule does, for segments stored in
    any order in the base array (the planner's no-p2p case), with every step's set
    merged whole or cut into value pieces (empty pieces and sets included)."""
    from hongtu.dedup import plan as plan_mod
    from hongtu.dedup.plan import _assign

    monkeypatch.setattr(graph_kernels, "SERIAL_BELOW", 1 << 40 if serial else 0)
    monkeypatch.setattr(plan_mod, "PIECE_ROWS", 1 if pieces else 1 << 40)
    rng = np.random.default_rng(3)
    for trial in range(20):
        steps = int(rng.integers(1, 9))
        sets = [sorted(rng.choice(30, size=int(rng.integers(0, 20)), replace=False).tolist())
                for _ in range(steps)]
        where = rng.permutation(steps)  # step s is stored as the where[s]-th segment
        sizes = np.array([len(sets[s]) for s in np.argsort(where)], dtype=np.int64)
        seg = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        vals = np.zeros(int(seg[-1]), dtype=np.int32)
        for s in range(steps):
            vals[seg[where[s]]:seg[where[s] + 1]] = sets[s]
        start, stop = seg[:-1][where].copy(), seg[1:][where].copy()
        res = np.zeros(vals.shape[0], dtype=np.int32)
        num_slots = int(sizes.max()) if steps else 0
        load_ptr, load_ids, load_slots, flush_ptr, flush_ids, flush_slots = _assign(
            vals, start, stop, reuse, num_slots, 30, res, np.int32)
        loads, flushes = py_slots(sets, reuse)
        for s in range(steps):
            got = list(zip(load_ids[load_ptr[s]:load_ptr[s + 1]].tolist(),
                           load_slots[load_ptr[s]:load_ptr[s + 1]].tolist()))
            assert got == loads[s], (trial, s)
            got = list(zip(flush_ids[flush_ptr[s]:flush_ptr[s + 1]].tolist(),
                           flush_slots[flush_ptr[s]:flush_ptr[s + 1]].tolist()))
            assert got == flushes[s], (trial, s)
            held = {u: p for u, p in zip(sets[s], res[start[s]:stop[s]].tolist())}
            live = {}
            for t in range(s + 1):
                live.update(dict(loads[t]))
                for u, _ in flushes[t] if t < s else []:
                    live.pop(u)
            assert held == live, (trial, s)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_set_cuts_are_each_sets_first_positions_at_or_above_each_bound(dtype):
    # (int32 sets searched with int64 bounds would be copied whole by numpy:
    # the bounds are narrowed when they fit, never changing the answer.)
    from hongtu.dedup.cache import set_cuts

    rng = np.random.default_rng(3)
    sets = [np.sort(rng.choice(100, k, replace=False)) for k in (0, 5, 40, 100)]
    ptr = np.cumsum([0] + [s.size for s in sets])
    ids = np.concatenate(sets).astype(dtype)
    for bounds in (np.array([0, 10, 50, 100]), np.array([], dtype=np.int64),
                   np.array([0, 2**40])):
        got = set_cuts(ptr, ids, bounds)
        want = [[ptr[s] + int(np.sum(sets[s] < b)) for b in bounds] for s in range(len(sets))]
        assert got.dtype == np.int64 and got.tolist() == want
