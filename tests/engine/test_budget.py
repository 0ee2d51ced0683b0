"""The device-memory estimate and the chunk count chosen from it."""

from __future__ import annotations

import numpy as np
import pytest

from hongtu.engine.budget import (
    CHUNK_CANDIDATES,
    Chunkings,
    choose_chunks,
    chunk_sizes,
    estimate_device_bytes,
)
from hongtu.errors import UserError
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
