"""The device-memory estimate and the chunk count chosen from it."""

from __future__ import annotations

import numpy as np
import pytest

from hongtu.engine.budget import CHUNK_CANDIDATES, choose_chunks, chunk_sizes, estimate_device_bytes
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
