"""The device-memory estimate and the chunk count chosen from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hongtu.dedup import neighbour_sets
from hongtu.engine.budget import (
    CHUNK_CANDIDATES,
    Chunkings,
    ChunkSizes,
    aggregates_in_place,
    batch_bytes,
    check_device_budget,
    choose_chunks,
    chunk_sizes,
    estimate_device_bytes,
    first_layer_stores,
    first_layer_whole_faster,
    grown_row_memory,
    held_store_bytes,
    kept_graph_bytes,
    kept_graph_layers,
    more_chunks,
    more_chunks_text,
    plan_loads,
    resident_block_bytes,
    row_memory,
    slot_widths,
    spare_rows,
    takes_more_chunks,
)
from hongtu.engine.executor import (
    first_layer_busy,
    gradients_kept,
    kept_grads_at,
    layers_moved_whole,
    rows_kept_at,
)
from hongtu.errors import UserError
from hongtu.graph._kernels import RunBitmaps
from hongtu.graph.generators import sbm_graph
from hongtu.nn import GCN, GNN, GNNLayer, ops
from hongtu.nn.model import resolve_layer
from hongtu.partition import chunk_partition
from tests.cases import CASES
from tests.engine.test_oracle import make_model


def _need(graph, assignment, model, n, **kw):
    p = chunk_partition(graph, assignment, n, num_parts=1)
    return estimate_device_bytes(model, chunk_sizes(graph, p.perm, p.chunk_ptr),
                                 num_nodes=graph.num_nodes, **kw)


@pytest.mark.parametrize("overlap", [True, False])
def test_choose_chunks_is_the_fewest_that_fit(overlap):
    graph = CASES["skewed"](seed=0)
    model = make_model("gcn")
    assignment = np.zeros(graph.num_nodes, dtype=np.int64)
    cands = [n for n in CHUNK_CANDIDATES if n <= graph.num_nodes]
    needs = {n: _need(graph, assignment, model, n, overlap=overlap) for n in cands}
    for budget in sorted(set(needs.values())):
        n, est = choose_chunks(graph, assignment, 1, model, budget, overlap=overlap)
        assert est <= budget and est == needs[n]
        assert all(needs[k] > budget for k in cands if k < n)  # none fewer fits


def test_overlap_staging_is_counted():
    graph = CASES["skewed"](seed=0)
    model = make_model("gcn")
    assignment = np.zeros(graph.num_nodes, dtype=np.int64)
    with_overlap = _need(graph, assignment, model, 4, overlap=True)
    assert with_overlap > _need(graph, assignment, model, 4, overlap=False)
    assert _need(graph, assignment, model, 4, resident=True) < with_overlap


@pytest.mark.parametrize("layer", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_estimate_counts_the_executors_row_memory_and_slots(layer, checkpoint):
    """What the estimate counts for rows is what the executor allocates: the row
    memory (transition buffer, gradient twin, staging) at the widest row, each
    destination-row slot at the width of what it holds."""
    from tests.engine.test_oracle import chunked_step

    graph = CASES["skewed"](seed=2)
    model = make_model(layer)
    _, g, ex = chunked_step(model, graph, 1, 4, checkpoint)
    plan, widths = ex.plan.plan, model.row_widths()
    assert ex._rowmem.numel() == row_memory(plan.buffer_rows, widths, plan.max_later_load)
    slot_w = slot_widths(model, model.cached_layers(checkpoint))
    max_dst = ex.chunks.max_rows()[1]
    for name, w in slot_w.items():
        assert ex.mover._dev[name][0].numel() == max(max_dst * w, 1)
    # rows 6 -> 3 -> 3 (GCN, weight first) or 6 -> 8 -> 3: own rows only where a
    # layer reads them, aggregates only where cached, ∇h^{l+1} always
    auto = checkpoint == "auto"
    expect = {"gcn": (0, 6 if auto else 0, 3), "sage": (8, 8 if auto else 0, 8),
              "gat": (8, 0, 8)}[layer]
    assert (slot_w["dst"], slot_w["aux"], slot_w["grad"]) == expect
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int64), 4, num_parts=1)
    sizes = chunk_sizes(g, p.perm, p.chunk_ptr)

    def est(rows, stage):
        return estimate_device_bytes(model, sizes, buffer_rows=rows, load_rows=stage,
                                     overlap=False)

    assert est(9, 5) - est(0, 0) == 4 * 2 * 9 * max(widths)  # (no staging without overlap)
    with_stage = estimate_device_bytes(model, sizes, buffer_rows=9, load_rows=5)
    assert with_stage - est(0, 0) == 4 * (row_memory(9, widths, 5)
                                          + max_dst * sum(slot_widths(model).values()))


@pytest.mark.parametrize("layer", ["sage", "gat"])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_own_rows_from_the_sources_need_no_slots(layer, checkpoint):
    """Where chunks take their own rows from their sources in every pass (a
    self-loop on every vertex; not cached), the executor allocates no slots to
    copy them into and the estimate counts none."""
    from hongtu.engine.executor import own_rows_copied
    from tests.engine.test_oracle import chunked_step

    graph = CASES["self_loops"](seed=2)
    model = make_model(layer)
    _, g, ex = chunked_step(model, graph, 1, 4, checkpoint)
    cached = model.cached_layers(checkpoint)
    copied = own_rows_copied(model, cached, True)
    assert copied == own_rows_copied(model, cached, ex._own_at is not None)
    # GAT and recomputed layers take them from the sources in both passes (or,
    # SAGE's second layer in forward, from the slots where it aggregates them);
    # cached layers copy them in backward
    assert copied == cached
    w = slot_widths(model, copied_dst=copied)["dst"]
    assert w == (8 if any(copied) else 0)
    max_dst = ex.chunks.max_rows()[1]
    assert ex.mover._dev["dst"][0].numel() == max(max_dst * w, 1)
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int64), 4, num_parts=1)
    sizes = chunk_sizes(g, p.perm, p.chunk_ptr)
    full, fewer = (estimate_device_bytes(model, sizes, buffer_rows=9, load_rows=5,
                                         copied_dst=c) for c in (None, copied))
    assert full - fewer == 4 * 2 * max_dst * (8 - w)  # (two slots each, with overlap)


def test_first_layer_moves_whole_without_a_gradient_twin():
    # widths 4 -> 8 -> 2 over 10 rows; the plan would load 11 rows per pass
    assert layers_moved_whole(10, [4, 8, 2], 40, 11, False) == [True, False]
    assert layers_moved_whole(10, [4, 8, 2], 39, 11, False) == [False, False]
    assert layers_moved_whole(10, [4, 8, 2], 160, 11, False) == [True, True]
    assert layers_moved_whole(10, [4, 8, 2], 159, 11, False) == [True, False]
    assert layers_moved_whole(10, [4, 8, 2], 160, 11, True) == [False, False]
    # loading each row once: the first layer's plan moves no more bytes and
    # travels under its pass; a later layer still moves whole (DMA, device adds)
    assert layers_moved_whole(10, [4, 8, 2], 160, 10, False) == [False, True]
    assert layers_moved_whole(10, [4, 8, 2], 160, 9, False) == [False, False]
    assert row_memory(3, [4, 8, 2], 5) == (2 * 3 + 5) * 8
    # the budget's leftover grows the memory to the largest need that fits
    assert grown_row_memory(30, 4 * 200, 10, [4, 8, 2], 11, False) == 160
    assert grown_row_memory(30, 4 * 100, 10, [4, 8, 2], 11, False) == 40
    assert grown_row_memory(30, 4 * 100, 10, [4, 8, 2], 10, False) == 30
    assert grown_row_memory(30, None, 10, [4, 8, 2], 11, False) == 30
    assert grown_row_memory(30, 4 * 200, 10, [4, 8, 2], 11, True) == 30


def test_first_layer_moves_whole_only_where_its_pass_is_faster():
    """Link time of the first layer's forward pass, whole n·w + n·s against step
    by step r0·w + max((r - r0)·w, n·s)."""
    # products-like GCN 3x256 at 24 chunks: 1.26 |V| loaded, 0.21 |V| at the
    # first step, 256 + 100 stored per row: step by step (376 < 456 |V|·4 B)
    n = 2_450_000
    stores = first_layer_stores([100, 256, 47, 47], [True, True, True])
    assert stores == 356
    assert not first_layer_whole_faster(n, 100, 3_079_392, 504_725, stores)
    # a pass that stores little (recomputed, narrow output) and loads 2 |V|: whole
    assert first_layer_stores([100, 47, 47], [False, False]) == 47
    assert first_layer_whole_faster(n, 100, 2 * n, n // 4, 47)
    # never when the plan loads each row at most once
    assert not first_layer_whole_faster(n, 100, n, 0, 0)
    # the same rule where the executor and the budget decide
    assert layers_moved_whole(10, [4, 8, 2], 160, 11, False, 3, 12) == [False, True]
    assert layers_moved_whole(10, [4, 8, 2], 160, 20, False, 3, 2) == [True, True]
    assert grown_row_memory(30, 4 * 100, 10, [4, 8, 2], 11, False, first_rows=3,
                            first_stores=12) == 30
    assert grown_row_memory(30, 4 * 100, 10, [4, 8, 2], 20, False, first_rows=3,
                            first_stores=2) == 40


def test_gradients_kept_between_passes():
    # the loss gradient: last layer whole and cached, as narrow as its rows;
    # ∇h^1: layer 1 whole and layer 0 cached (its backward uses no row memory)
    assert gradients_kept([True, True], [True, True], [4, 8, 2]) == [False, True, True]
    assert gradients_kept([True, True], [False, True], [4, 8, 2]) == [False, False, True]
    assert gradients_kept([True, True], [True, False], [4, 8, 2]) == [False, True, False]
    assert gradients_kept([True, False], [True, True], [4, 8, 2]) == [False] * 3
    assert gradients_kept([True, True], [True, True], [4, 2, 8]) == [False, True, False]
    assert gradients_kept([True, True], [True, True], [4, 2, 2]) == [False, True, True]
    # one layer: its whole rows have no gradient room; three: ∇h^1 and ∇h^3
    assert gradients_kept([True], [True], [4, 2]) == [False, False]
    assert gradients_kept([False, True, True], [True] * 3, [4, 8, 8, 2]) == \
        [False, True, False, True]
    # ∇h^2 of a narrow last layer moving whole, layer 1 cached on the plan's rows:
    # kept where it lies in the transition buffer (10 rows x 2 from 0 when the
    # loss gradient is kept, x 4 from 10 x 2 otherwise)
    assert gradients_kept([True, False, True], [True] * 3, [4, 8, 2, 2], 10, 20) == \
        [False, False, True, True]
    assert gradients_kept([True, False, True], [True] * 3, [4, 8, 2, 2], 10, 19) == \
        [False, False, False, True]
    assert gradients_kept([True, False, True], [True, False, True], [4, 8, 2, 2], 10, 20) == \
        [False, False, False, True]
    assert gradients_kept([True, False, True], [True, True, False], [4, 8, 2, 2], 10, 40) == \
        [False, False, True, False]
    assert gradients_kept([True, False, True], [True, True, False], [4, 8, 2, 2], 10, 39) == \
        [False, False, False, False]
    assert gradients_kept([True, True, True], [True] * 3, [4, 8, 2, 2], 10, 80) == \
        [False, True, False, True]  # (layer 1 whole: its backward fills the row memory)


def test_kept_gradient_placed_at_the_transition_buffers_end():
    # ∇h^2 (10 rows x 2) with the loss gradient kept: at the start, or with the
    # buffer's size (40) at its end, unless that covers where it was added up
    widths, kept = [4, 8, 2, 2], [False, False, True, True]
    assert kept_grads_at(10, widths, kept, 2) == 0
    assert kept_grads_at(10, widths, kept, 2, end=40, src=0) == 20
    assert kept_grads_at(10, widths, kept, 2, end=40, src=40) == 20
    assert kept_grads_at(10, widths, kept, 2, end=40, src=20) == 20  # (already there)
    assert kept_grads_at(10, widths, kept, 2, end=40, src=5) == 0  # (would cover it)
    assert kept_grads_at(10, widths, kept, 2, end=40, src=30) == 0
    assert kept_grads_at(10, widths, kept, 2, end=19, src=40) == 0  # (no room)
    # otherwise after its rows, wherever the buffer ends
    assert kept_grads_at(10, widths, [False, False, True, False], 2, end=40) == 20


def test_rows_kept_beside_the_first_layer():
    # transition buffer 3 rows x 4 at the start; twins 2 x 3 x 8; staging 5 x 8 after
    assert first_layer_busy(10, [4, 8, 2], 3, 5, False) == [(0, 12), (48, 88)]
    assert first_layer_busy(10, [4, 8, 2], 3, 0, False) == [(0, 12)]
    assert first_layer_busy(10, [4, 8, 2], 0, 0, False) == [(0, 4)]
    assert first_layer_busy(10, [4, 8, 2], 3, 5, True) == [(0, 40)]
    # h^1 is 10 x 2 = 20 elements; its gradients need 20 more, apart from them
    w, both, once = [4, 2, 3], [True, True], [True, True]
    assert rows_kept_at(10, w, 40, both, once, [(0, 12), (30, 40)]) is None
    assert rows_kept_at(10, w, 60, both, once, [(0, 12), (30, 40)]) == 40  # gradients at 0
    assert rows_kept_at(10, w, 59, both, once, [(0, 12), (30, 40)]) is None
    assert rows_kept_at(10, w, 48, both, once, [(0, 8)]) == 8  # gradients right after
    assert rows_kept_at(10, w, 47, both, once, [(0, 8)]) == 20  # ... else before them
    assert rows_kept_at(10, w, 39, both, once, [(0, 8)]) is None
    assert rows_kept_at(10, w, 60, [True, False], once, [(0, 8)]) is None
    assert rows_kept_at(10, w, 60, both, [True, False], [(0, 8)]) is None
    assert rows_kept_at(10, [4, 2], 60, [True], [True], [(0, 8)]) is None
    # the budget grows the memory for it: h^1 after the plan's memory
    assert grown_row_memory(30, 4 * 20, 10, w, 11, False) == 40
    assert grown_row_memory(30, 4 * 20, 10, w, 11, False, keep_rows=True) == 50
    assert grown_row_memory(30, 4 * 19, 10, w, 11, False, keep_rows=True) == 40
    assert grown_row_memory(30, 4 * 20, 10, w, 10, False, keep_rows=True) == 50
    assert grown_row_memory(30, 4 * 20, 10, w, 9, False, keep_rows=True) == 30


def test_no_chunk_count_fits_is_a_clear_error():
    graph = CASES["skewed"](seed=0)
    model = make_model("gcn")
    with pytest.raises(UserError, match=r"too small.*raise engine\.device_memory"):
        choose_chunks(graph, np.zeros(graph.num_nodes, dtype=np.int64), 1, model, 1000)


def test_spare_budget_keeps_reused_rows_with_the_same_losses(tmp_path):
    from tests.engine.test_resident import trainer

    # (a layer moving all its rows needs no kept rows)
    common = ("engine.accelerator=cpu", "engine.chunks=8", "engine.device_memory=1GiB",
              "engine.whole_layers=false")
    plain = trainer(tmp_path / "a", *common, "engine.dedup.cache=false")
    kept = trainer(tmp_path / "b", *common)
    assert plain.transfer_plan.cached_rows == 0 < kept.transfer_plan.cached_rows
    assert kept.transfer_plan.h2d_rows < plain.transfer_plan.h2d_rows
    assert kept.estimate <= kept.room
    assert kept.transfer_plan.volumes()["v_ru"] == plain.transfer_plan.v_ru
    for e in range(2):
        a, b = plain.run_epoch(e), kept.run_epoch(e)
        assert b["h2d_bytes"] < a["h2d_bytes"] and b["d2h_bytes"] < a["d2h_bytes"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (e, a["loss"], b["loss"])


def test_kept_rows_fit_the_budget_they_were_given(tmp_path):
    from tests.engine.test_resident import trainer

    base = trainer(tmp_path / "a", "engine.accelerator=cpu", "engine.chunks=8",
                   "engine.device_memory=1GiB", "engine.dedup.cache=false")
    # Room for more rows than the plan needs (and than the estimate made before
    # planning, which counts a whole buffer of staging): some kept, within budget.
    row = 2 * max(base.model.row_widths()) * 4
    budget = base.estimate + 2000 * row
    tr = trainer(tmp_path / "b", "engine.accelerator=cpu", "engine.chunks=8",
                 f"engine.device_memory={budget}B")
    assert tr.transfer_plan.cached_rows > 0
    assert tr.estimate <= budget
    grow = max(p.num_slots for p in tr.transfer_plan.plans) - \
        max(p.num_slots for p in base.transfer_plan.plans)
    assert 0 < grow <= 2000


def test_chunkings_bound_is_below_every_real_estimate():
    graph = CASES["skewed"](seed=0)
    model = make_model("gcn")
    assignment = np.arange(graph.num_nodes) % 2
    chunkings = Chunkings(graph, assignment, 2)
    for n in (1, 2, 4, 8):
        low = chunkings.bound(n)
        part, sizes = chunkings.get(n)
        assert np.array_equal(low.num_dst, sizes.num_dst)
        assert np.array_equal(low.num_edges, sizes.num_edges)
        assert np.array_equal(sizes.num_src, chunk_sizes(graph, part.perm, part.chunk_ptr).num_src)
        assert estimate_device_bytes(model, low) < estimate_device_bytes(model, sizes)
        assert chunkings.bound(n) is sizes  # once cut, the bound is the real sizes
    # Two parts: the count chosen with bounds is the fewest whose real estimate fits.
    needs = {n: estimate_device_bytes(model, chunkings.get(n)[1], num_nodes=graph.num_nodes)
             for n in CHUNK_CANDIDATES if n <= graph.num_nodes // 2}
    for budget in sorted(set(needs.values()))[::3]:
        n, est = choose_chunks(graph, assignment, 2, model, budget, overlap=True)
        assert est == needs[n] and all(needs[k] > budget for k in needs if k < n)


def test_chunk_count_search_sizes_its_next_counts_in_one_pass(monkeypatch):
    # The walk from the bound's start sizes four counts per pass over the edges
    # (RunBitmaps), the same sizes as one by one, and stops at the fewest that
    # fit; the chosen count's neighbour sets come from the same bitmaps.
    import hongtu.engine.budget as budget_mod
    graph = CASES["skewed"](seed=0)
    model = make_model("gcn")
    assignment = np.zeros(graph.num_nodes, dtype=np.int64)
    cands = [n for n in CHUNK_CANDIDATES if n <= graph.num_nodes]
    one_by_one = Chunkings(graph, assignment, 1)
    needs = {n: estimate_device_bytes(model, one_by_one.get(n)[1], num_nodes=graph.num_nodes,
                                      overlap=True) for n in cands}
    bounds = Chunkings(graph, assignment, 1)  # (never cut: its bounds stay bounds)
    passes = []
    real_union, real_mark = budget_mod.unique_union, RunBitmaps.mark.__func__
    monkeypatch.setattr(budget_mod, "unique_union",
                        lambda *a, **k: passes.append(1) or real_union(*a, **k))
    monkeypatch.setattr(RunBitmaps, "mark", classmethod(
        lambda cls, *a, **k: passes.append(1) or real_mark(cls, *a, **k)))
    for budget in sorted(set(needs.values())):
        passes.clear()
        chunkings = Chunkings(graph, assignment, 1)
        n, est = choose_chunks(graph, assignment, 1, model, budget, chunkings=chunkings,
                               overlap=True)
        assert est == needs[n] and all(needs[k] > budget for k in cands if k < n)
        start = next(i for i, k in enumerate(cands) if estimate_device_bytes(
            model, bounds.bound(k), num_nodes=graph.num_nodes, overlap=True) <= budget)
        assert len(passes) == -(-(cands.index(n) - start + 1) // 4), (budget, n, start)
        for k, (part, sizes) in chunkings._cut.items():
            assert np.array_equal(sizes.num_src, one_by_one.get(k)[1].num_src)
            assert np.array_equal(part.chunk_ptr, one_by_one.get(k)[0].chunk_ptr)
        ptr, ids = chunkings.sets(n)
        want = neighbour_sets(graph.indptr, graph.indices, chunkings.get(n)[0].chunk_ptr)
        assert np.array_equal(ptr, want[0]) and np.array_equal(ids, want[1])
        assert len(passes) == -(-(cands.index(n) - start + 1) // 4)  # (none more for them)
    # Renumbered ids (parts not in id order): no sets from the bitmaps.
    two = Chunkings(graph, np.arange(graph.num_nodes) % 2, 2)
    two.count([1, 2])
    assert 1 in two._cut and two.sets(1) is None


def test_trainer_takes_the_chosen_counts_sets_from_the_search(tmp_path, monkeypatch):
    # chunks=auto under a budget: the neighbour sets come from the search's
    # bitmaps (no neighbour_sets pass), and the run is the one a fixed count
    # gets from neighbour_sets: same plan, same losses.
    import hongtu.engine.trainer as trainer_mod
    from tests.engine.test_resident import trainer

    calls = []
    real = trainer_mod.neighbour_sets
    monkeypatch.setattr(trainer_mod, "neighbour_sets",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    common = ("engine.accelerator=cpu", "engine.device_memory=70MiB")
    auto = trainer(tmp_path / "a", *common, "engine.chunks=auto")
    assert auto.chunks.num_chunks > 1 and calls == []
    fixed = trainer(tmp_path / "b", *common, f"engine.chunks={auto.chunks.num_chunks}")
    assert calls == [1]
    assert fixed.transfer_plan.h2d_rows == auto.transfer_plan.h2d_rows
    for e in range(2):
        assert auto.run_epoch(e)["loss"] == fixed.run_epoch(e)["loss"]


def test_more_chunks_only_where_the_fewest_load_rows_again():
    # 5% more loads than distinct rows or fewer: no second count is planned.
    assert more_chunks(24, 1050, 1000, 10**6) is None
    assert more_chunks(24, 1000, 1000, 10**6) is None
    assert more_chunks(24, 0, 0, 10**6) is None
    # More: the next candidate count, within the smallest part.
    assert more_chunks(24, 1051, 1000, 10**6) == 32
    assert more_chunks(16, 1320, 1000, 10**6) == 24
    assert more_chunks(24, 1320, 1000, 31) is None  # (32 chunks of a 31-vertex part)
    assert more_chunks(24, 1320, 1000, 32) == 32
    assert more_chunks(CHUNK_CANDIDATES[-1], 1320, 1000, 10**9) is None
    # Taken where it loads a tenth fewer rows or more.
    assert takes_more_chunks(1000, 900) and takes_more_chunks(3245, 2507)
    assert not takes_more_chunks(1000, 901) and not takes_more_chunks(1000, 1000)
    text = more_chunks_text(24, 1.3245, 32, 1.0232, 32)
    assert text == ("engine.chunks=auto: 24 chunks per part, the fewest that fit, load 1.32x "
                    "their distinct rows per pass; 32 load 1.02x: 32 taken")


def test_plan_loads_counts_distinct_rows_per_device():
    from types import SimpleNamespace as P

    plans = [P(load_ids=np.array([3, 1, 3, 3, 7], dtype=np.int32)),
             P(load_ids=np.array([1, 1], dtype=np.int32)), P(load_ids=np.zeros(0, np.int32))]
    assert plan_loads(plans) == (7, 4)  # (3, 1, 7 on the first device; 1 on the second)
    assert plan_loads([]) == (0, 0)
    # Past the serial kernels' threshold: the parallel bitmaps count what np.unique does.
    rng = np.random.default_rng(0)
    big = [P(load_ids=rng.integers(0, 1 << 18, 300_000).astype(np.int32)),
           P(load_ids=np.sort(rng.integers(5, 1 << 17, 200_000)))]
    assert plan_loads(big) == (500_000, sum(np.unique(p.load_ids).size for p in big))


def test_layers_reading_own_rows_count_their_gradient():
    """A built-in aggregation's layer that reads its own rows (SAGE) holds their
    gradient beside the aggregate's in backward, and the transpose's edge
    weights: the estimate counts both (a recomputed SAGE layer ran past it by
    about that much, measured on an H200); GAT, with its own count, does not."""
    from hongtu.engine import budget

    g = CASES["self_loops"](seed=3)
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int64), 4, num_parts=1)
    sizes = chunk_sizes(g, p.perm, p.chunk_ptr)
    for layer, counted in [("sage", True), ("gat", False)]:
        model = make_model(layer)
        none = [False] * model.num_layers  # (no own-row slots either way)
        # (planned for a GPU, whose fused dropout leaves backward the larger step)
        with_it = estimate_device_bytes(model, sizes, copied_dst=none, device="cuda")
        for x in model.layers:
            x.needs_dst = False  # (an instance attribute: the estimate's term only)
        # (without its own rows SAGE's first layer may run its backward on
        # layer 1's flushes: their pieces, counted apart)
        without = estimate_device_bytes(model, sizes, copied_dst=none, device="cuda") \
            - budget.flush_pieces_bytes(model, int(sizes.num_dst.max()), 4)
        most = max(int(sizes.num_dst.max()) * w for w in model.row_widths()[:-1]) \
            + int(sizes.num_edges.max())
        assert (0 < with_it - without <= budget._SLACK * 4 * most) == counted
        assert (with_it == without) == (not counted)


def test_layers_aggregating_in_place_count_no_gathered_sources():
    """A layer that aggregates its sources where they lie (a cached first layer
    of a lone process, a layer reading its rows as kept) counts no gathered copy
    of them; one of several processes gathers and drops the first layer's
    sources, and one resident process every layer's. A layer whose inputs take
    a gradient counts, in backward, the transpose's output, and no copy of it
    beside (the product writes into its own input; measured on an H200,
    bench/bench_memory.py)."""
    g = CASES["skewed"](seed=0)
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int64), 4, num_parts=1)
    sizes = chunk_sizes(g, p.perm, p.chunk_ptr)
    model = make_model("gcn")  # (its second layer transforms first: reads z^1 as kept)
    cached = model.cached_layers()
    assert aggregates_in_place(model, cached) == [True, True]
    assert aggregates_in_place(model, cached, exchange=True) == [False, True]
    assert aggregates_in_place(model, cached, direct=True) == [False, False]
    assert aggregates_in_place(model, [False, True]) == [False, True]  # (recomputed first)
    gat = make_model("gat")
    assert aggregates_in_place(gat, gat.cached_layers()) == [False, False]

    def terms(**kw):
        return batch_bytes(model, sizes, device="cuda", cached=cached, **kw)

    one, several, resident = terms(), terms(exchange=True), terms(direct=True)
    assert several[0] > one[0] and several[1] == one[1]
    assert resident[0] == several[0]
    # (forward alone, the second layer gathers its sources only when resident:
    # 4 bytes per source and column, where in place the adjacency's columns
    # take 8 per edge; here, 3 columns wide, the copy is the smaller)
    assert terms(training=False, direct=True)[1] < terms(training=False)[1]
    src, dst, e = (int(x.max()) for x in (sizes.num_src, sizes.num_dst, sizes.num_edges))
    w = model.row_widths()[1]
    assert one[1] >= e * 4 + src * w * 4 + dst * w * 4  # (with the block on top)
    # the estimate is its fixed part and the largest of these, with slack
    from hongtu.engine import budget

    for kw, most in (({}, max(one)), ({"exchange": True}, max(several))):
        fixed = estimate_device_bytes(model, sizes, device="cuda", **kw) \
            - int(budget._SLACK * most)
        assert fixed == estimate_device_bytes(model, sizes, device="cuda") \
            - int(budget._SLACK * max(one))


@pytest.mark.parametrize("features", [8, 100])
def test_a_layer_before_one_transforming_first_counts_three_output_rows(features):
    """Where the next layer transforms first, a cached layer's written-out
    backward holds three rows of its output's width per destination (z, the
    gradient through the next layer's map and the one through ReLU-dropout:
    measured on an H200, bench/bench_memory.py --sites) beside the next layer's
    narrow gradient and the chunk's block; the count covers them however few
    input columns the layer has."""
    g = sbm_graph(6000, num_classes=16, num_features=features, avg_degree=4, seed=0)
    p = chunk_partition(g, np.zeros(g.num_nodes, dtype=np.int64), 4, num_parts=1)
    sizes = chunk_sizes(g, p.perm, p.chunk_ptr)
    torch.manual_seed(0)
    model = GNN([GCN(features, 256), GCN(256, 16)], dropout=0.5, activation="relu",
                transform_first=True, keep_dropped=True)
    assert model.row_widths()[1] == 16 and model.widths()[1] == 256
    dst, e = sizes.num_dst.astype(np.int64), sizes.num_edges.astype(np.int64)
    held = 4 * dst * (3 * 256 + 16) + 24 * e  # (the block: 24 B per edge measured)
    assert batch_bytes(model, sizes, device="cuda")[0] >= held.max()


def test_a_budget_above_the_gpus_free_memory_is_one_clear_line():
    """engine.device_memory above what the GPU has free stops before training, with
    the most it may be; up to the free memory it passes."""
    check_device_budget(8 << 30, 8 << 30, 80 << 30, "cuda:0")
    with pytest.raises(UserError, match=r"^engine\.device_memory=9\.00 GiB is more than cuda:0 "
                       r"has free \(8\.00 GiB of 80\.00 GiB\); set it to at most 8\.00 GiB, "
                       r"or to auto"):
        check_device_budget(9 << 30, 8 << 30, 80 << 30, "cuda:0")


@pytest.mark.parametrize("layer", ["gcn", "gat"])
def test_an_estimate_plans_for_the_device_that_trains(layer, monkeypatch):
    """Which temporaries a step makes depends on the kernels of the device that
    trains, not on the machine that plans: a GPU's fused dropout makes no mask
    and GAT's fused edge gradient no ``(E, width)`` gathers; a CPU makes both.
    ``hongtu report`` on a laptop planning for a GPU (no CUDA there) estimates
    as the GPU machine does, and a CPU run counts masks where Triton imports."""
    graph = CASES["skewed"](seed=0)
    model = make_model(layer)
    assignment = np.zeros(graph.num_nodes, dtype=np.int64)

    p = chunk_partition(graph, assignment, 4, num_parts=1)
    # (what a batch stores stays held while the next computes, on every GPU)
    held = held_store_bytes(model, int(chunk_sizes(graph, p.perm, p.chunk_ptr).num_dst.max()))

    def need(device):
        return _need(graph, assignment, model, 4, device=device)

    def machine(cuda: bool, triton: bool):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(ops, "_triton", lambda kind="dropout": object() if triton else None)

    machine(cuda=True, triton=True)  # a GPU machine training on its GPU
    gpu = need("cuda")
    assert need(None) == gpu  # (its own kernels)
    cpu = need("cpu")
    assert gpu - held < cpu  # no dropout mask (GAT: nor the edge gathers) on the GPU
    n_gpu, _ = choose_chunks(graph, assignment, 1, model, gpu, device="cuda")
    machine(cuda=False, triton=False)  # a laptop with torch's CPU build
    assert need("cuda") == gpu  # hongtu report planning for the GPU
    assert choose_chunks(graph, assignment, 1, model, gpu, device="cuda")[0] == n_gpu
    assert need("cpu") == need(None) == cpu
    machine(cuda=False, triton=True)  # Triton installed, training on the CPU
    assert need("cpu") == cpu
    machine(cuda=True, triton=False)  # a GPU without Triton runs the unfused path
    assert need("cuda") - held == cpu


def test_kept_rows_come_before_resident_blocks():
    """What the budget leaves after a plan buys kept rows first, whatever the
    chunk blocks would need; the blocks stay on the device only in what the
    plan with its kept rows leaves (Trainer: ``leftover_bytes`` after the plan).
    Blocks first had left R-MAT 2^22 GCN 3×256 at 40 chunks with 212,594 kept
    rows where rows first keeps enough to move 40% fewer bytes."""
    row = 2 * 256 * 4  # a kept row: a slot and its gradient twin, 256 wide
    assert spare_rows(None, 10, 256) == 0  # no budget: nothing kept
    assert spare_rows(100 * row, 100 * row, 256) == 0
    assert spare_rows(1000 * row + 5, 400 * row, 256) == 600
    assert spare_rows(10 * row, 20 * row, 256) == 0  # (over the budget: none)


def test_direct_resident_estimate_keeps_no_transition_buffer():
    """Resident in one process the executor reads rows in place and keeps a row
    memory of one row (no transition buffer, gradient twin or staging): the
    estimate counts that instead of the largest chunk's sources three times
    (R-MAT 2^22 GIN 2x256 at one chunk: 12.0 of 59.9 GiB)."""
    model = make_model("gin")
    sizes = ChunkSizes(np.array([900, 400]), np.array([300, 200]), np.array([5000, 2000]))
    widths = model.row_widths()
    kw = dict(num_nodes=500, overlap=True, resident=True, device="cuda")
    shared = estimate_device_bytes(model, sizes, 4, **kw)
    direct = estimate_device_bytes(model, sizes, 4, direct=True, **kw)
    assert shared - direct == (row_memory(900, widths, 900) - row_memory(1, widths)) * 4
    # (buffer_rows and load_rows, a plan's, do not apply in place)
    assert estimate_device_bytes(model, sizes, 4, buffer_rows=5000, load_rows=5000,
                                 direct=True, **kw) == direct


@pytest.mark.gpu
def test_direct_resident_executor_keeps_one_row():
    """What the direct estimate counts for rows is what a resident executor in one
    process allocates: a row memory of one row and no destination slots."""
    from tests.engine.test_oracle import chunked_step

    model = make_model("gin")
    _, _, ex = chunked_step(model, CASES["skewed"](seed=2), 1, 4, "auto", device="cuda",
                            resident=True)
    assert ex.resident and ex._direct
    assert ex._rowmem.numel() == row_memory(1, model.row_widths())
    assert all(t[0].numel() == 1 for t in ex.mover._dev.values())


class _GatedSum(GNNLayer):
    """The README's custom cacheable layer that counts what its update saves."""

    aggr = "sum"
    needs_dst = True

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels)
        self.lin = torch.nn.Linear(in_channels, out_channels)
        self.gate = torch.nn.Linear(in_channels, out_channels)

    def update(self, a, x_dst):
        return self.lin(a) * torch.sigmoid(self.gate(x_dst))

    def update_saved_bytes(self, num_dst, itemsize):
        return 2 * num_dst * self.out_channels * itemsize


def _saved_and_held(model, l, dst, device):
    """Bytes layer ``l``'s update of ``dst`` rows keeps from forward to backward
    in a resident run: what autograd saves (parameters aside) and what the
    executor holds beside it (the update's input, own rows and output)."""
    from hongtu.engine.executor import _Rows

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    w = model.row_widths()[l]
    a = torch.randn(dst, w, device=device, requires_grad=l > 0)
    x = torch.randn(dst, w, device=device, requires_grad=l > 0) \
        if model.layers[l].needs_dst else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.step_update(l, _Rows(torch.arange(dst, device=device)), a, x, 1, 2)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = sum(v for k, v in saved.items() if k not in params)
    return held + sum(t.numel() * t.element_size() for t in (a, x, out)
                      if t is not None and t.untyped_storage().data_ptr() not in saved)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layer", ["gcn", "sage", "gin", "gated"])
@pytest.mark.parametrize("dropout, activation, keep_dropped, gcn_last", [
    (0.5, "relu", True, False), (0.5, "relu", True, True), (0.0, "relu", True, True),
    (0.5, "elu", True, False), (0.0, "elu", False, False), (0.5, "relu", False, True)])
def test_kept_graph_bytes_count_what_autograd_keeps(device, layer, dropout, activation,
                                                    keep_dropped, gcn_last):
    """A resident run keeps the update graphs of the layers kept_graph_layers names
    (not GCN's, whose backward is written out); kept_graph_bytes counts what
    autograd saves for each update and what the executor holds beside it,
    layer by layer on a three-layer model in training (GCN last: the layer
    before emits z^2): exactly for SAGE; for GIN exactly but for its own rows
    dropped out, which its update does not save; exactly for the README's
    custom layer, which counts its own; at least that for GCN with ELU (the
    default update_saved_bytes). On a GPU the fused dropout saves no mask."""
    cls = _GatedSum if layer == "gated" else resolve_layer(layer)
    torch.manual_seed(0)
    layers = [cls(16, 32), cls(32, 32), (GCN if gcn_last else cls)(32, 4)]
    model = GNN(layers, dropout=dropout, activation=activation, transform_first=True,
                keep_dropped=keep_dropped).to(device)
    model.train()
    kept = kept_graph_layers(model, model.cached_layers("auto"), model.stored_aggregates("auto"))
    if layer == "gcn":  # (its backward written out with ReLU; autograd's with ELU)
        assert kept == [activation == "elu"] * 2 + [False]
    else:
        assert kept == [True, True, not gcn_last]
        assert model.transforms_first(2) == gcn_last
    dst = 1000
    sizes = ChunkSizes(np.array([3 * dst, dst]), np.array([dst, dst // 2]),
                       np.array([10 * dst, dst]))
    for l, k in enumerate(kept):
        if not k:
            continue
        held = sum(_saved_and_held(model, l, d, device) for d in (dst, dst // 2))
        count = kept_graph_bytes(model, sizes, 4, [i == l for i in range(3)], device)
        own = dropout > 0 and not model.keeps_dropped(l)  # (own rows dropped: a copy)
        if layer in ("sage", "gated"):
            assert count == held, (l, count, held)
        elif layer == "gin":  # (and 1 + eps, where the product saves it)
            copy = own * (dst + dst // 2) * model.row_widths()[l] * 4
            assert count - held - copy in (0, 2 * 4), (l, count, held)
        else:
            assert held <= count, (l, count, held)


def test_resident_blocks_of_one_process_of_several():
    """With one process per part a process keeps its own part's blocks: the
    largest part's bytes, not every part's (chunks part by part)."""
    sizes = ChunkSizes(num_src=np.array([5, 6, 7, 8]), num_dst=np.array([2, 2, 3, 3]),
                       num_edges=np.array([10, 20, 30, 40]))
    each = [e * (3 * 8 + 4 + 8) + (s + d) * (8 + 4) + s * 8
            for s, d, e in zip([5, 6, 7, 8], [2, 2, 3, 3], [10, 20, 30, 40])]
    assert resident_block_bytes(sizes, 4) == sum(each)
    assert resident_block_bytes(sizes, 4, parts=2) == each[2] + each[3]
    assert resident_block_bytes(sizes, 4, parts=4) == max(each)


def test_aggregate_positions_come_out_of_the_flush_pieces():
    """Where training on a GPU may store the first layer's aggregates once, in
    layer 1's load order (narrower than layer 1's rows, the first layer's
    backward run on layer 1's flushes), the estimate counts an int32 position
    per row, and the two pieces the flushes gather give up as many bytes, down
    to a quarter of their rows: the count stays where the pieces are large
    enough. None on a CPU, nor where the aggregates are as wide as the rows."""
    from hongtu.engine import budget

    def model(features: int) -> GNN:
        return GNN([GCN(features, 256), GCN(256, 256), GCN(256, 47)], dropout=0.5,
                   activation="relu")

    narrow, wide = model(100), model(256)
    n, rows = 2_450_000, 153_000
    assert budget.aggregate_positions_bytes(narrow, n, True) == 4 * n
    assert budget.aggregate_positions_bytes(narrow, n, False) == 0
    assert budget.aggregate_positions_bytes(wide, n, True) == 0
    plain = budget.flush_pieces_bytes(narrow, rows, 4)
    assert plain == 2 * rows * 400
    with_them = budget.flush_pieces_bytes(narrow, rows, 4, n, gpu=True)
    assert plain - 800 < with_them <= plain  # (whole rows given up)
    assert budget.flush_piece_rows(100, 4, rows, 4 * n) == rows - -(-4 * n // 800)
    # (few rows a piece: a quarter kept, the positions counted beside)
    assert budget.flush_piece_rows(100, 4, 1000, 4 * n) == 250
    assert budget.flush_pieces_bytes(narrow, 1000, 4, n, gpu=True) == 2 * 250 * 400 + 4 * n
    sizes = budget.ChunkSizes(np.array([rows]), np.array([rows]), np.array([10 * rows]))
    for device, gpu in (("cuda", True), ("cpu", False)):  # (the pieces and positions counted)
        assert estimate_device_bytes(narrow, sizes, num_nodes=n, device=device) \
            - estimate_device_bytes(narrow, sizes, device=device) \
            == 11 * n + budget.flush_pieces_bytes(narrow, rows, 4, n, gpu) - plain


def test_flush_piece_spare_is_what_the_pieces_give_up_before_their_floor():
    """The two pieces give up rows down to a quarter of them: what is left of
    that room after ``reserve`` (never negative)."""
    from hongtu.engine import budget

    rows = budget.FLUSH_PIECE_BYTES // 400  # (100-wide float rows: the byte cap binds)
    floor = -(-rows // 4)
    assert budget.flush_piece_spare(100, 4, 10**9) == 2 * (rows - floor) * 400
    assert budget.flush_piece_spare(100, 4, 1000, 1000) == 2 * 750 * 400 - 1000
    assert budget.flush_piece_spare(100, 4, 1000, 10**9) == 0
    spare = budget.flush_piece_spare(100, 4, 1000, 4000)
    # (taking it all leaves the pieces at their floor, not below)
    assert budget.flush_piece_rows(100, 4, 1000, 4000 + spare) == 250
