"""bench/bench_cap.py's run list and allocator summaries (no GPU needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench_cap = pytest.importorskip("bench_cap")

MIB = 1 << 20


def test_runs_name_a_system_and_whether_the_allocator_is_capped():
    assert bench_cap.parse_runs("cap,free/3,hongtu@24:cap, baseline:free,free/lag") == [
        ("hongtu", True, None), ("hongtu", False, 3), ("hongtu@24", True, None),
        ("baseline", False, None), ("hongtu", False, "lag")]
    for bad in ("capped", "free/1", "cap/x", "cap/lag"):
        with pytest.raises(ValueError, match=f"'{bad}' is not cap, free"):
            bench_cap.parse_runs(f"cap,{bad}")
    with pytest.raises(SystemExit) as exit_:  # (one line, exit code 2, before any work)
        bench_cap.main(["products-like", "--budget", "1GiB", "--runs", "cap,capped"])
    assert exit_.value.code == 2


def test_holding_sets_the_batches_held_for_the_mover_and_the_estimate():
    from hongtu.engine import budget, transfer
    from tests.engine.test_oracle import make_model

    model = make_model("gcn")
    before = transfer.HOLD_BATCHES
    one = budget.held_store_bytes(model, 100)
    with bench_cap.holding(before + 2):
        assert transfer.HOLD_BATCHES == budget.HOLD_BATCHES == before + 2
        assert budget.held_store_bytes(model, 100) == one * (before + 1) // (before - 1)
    assert transfer.HOLD_BATCHES == budget.HOLD_BATCHES == before
    with bench_cap.holding(None):
        assert transfer.HOLD_BATCHES == budget.HOLD_BATCHES == before
    with bench_cap.holding("lag"):  # (the mover only: the estimate as the release's)
        assert transfer.HOLD_BATCHES == bench_cap.LAG_BATCHES
        assert budget.held_store_bytes(model, 100) == one  # (HOLD_BATCHES there unchanged)
    assert transfer.HOLD_BATCHES == budget.HOLD_BATCHES == before


def _frame(name, line=1):
    return {"filename": f"/x/hongtu/engine/{name}.py", "line": line, "name": name}


def test_a_trace_is_summarised_per_stream_with_the_allocation_after_each_unmapping():
    names = {0: "compute", 7: "s_in"}
    big = 100 * MIB
    trace = [
        {"action": "alloc", "stream": 0, "size": big, "frames": [_frame("executor", 5)]},
        {"action": "alloc", "stream": 7, "size": MIB, "frames": []},  # (small: not listed)
        {"action": "free_requested", "stream": 0, "size": big, "frames": []},
        {"action": "segment_unmap", "stream": 0, "size": 40 * MIB, "frames": []},
        {"action": "segment_unmap", "stream": 0, "size": 20 * MIB, "frames": []},
        {"action": "alloc", "stream": 0, "size": big,
         "frames": [{"filename": "/usr/torch/x.py", "line": 3, "name": "f"},
                    _frame("transfer", 9)]},
        {"action": "alloc", "stream": 3, "size": big, "frames": []},  # (an unnamed stream)
    ]
    got = bench_cap.summarise_trace(trace, names)
    assert got["actions"]["alloc@compute"] == {"count": 2, "gib": round(200 / 1024, 3)}
    assert got["actions"]["segment_unmap@compute"]["count"] == 2
    assert got["actions"]["alloc@s_in"]["count"] == 1 and "alloc@3" in got["actions"]
    assert got["largest_allocations"][0] == {"stream": "compute", "mib": 100, "count": 1,
                                             "where": "engine/executor.py:5:executor"}
    assert len(got["largest_allocations"]) == 3  # (the 1 MiB one is not among them)
    assert got["after_unmaps"] == [{"unmapped_mib": 60, "stream": "compute", "alloc_mib": 100,
                                    "where": "engine/transfer.py:9:transfer"}]


def test_segments_are_summed_per_stream():
    g = 1 << 30
    got = bench_cap.segments_by_stream(
        [{"stream": 0, "total_size": 2 * g, "allocated_size": g},
         {"stream": 0, "total_size": g, "allocated_size": 0},
         {"stream": 9, "total_size": g, "allocated_size": g}], {0: "compute"})
    assert got == {"compute": {"reserved_gib": 3.0, "allocated_gib": 1.0, "segments": 2},
                   "9": {"reserved_gib": 1.0, "allocated_gib": 1.0, "segments": 1}}


def test_the_result_file_names_workload_scale_model_device_and_tag(tmp_path):
    from argparse import Namespace

    from common import workload_json

    args = Namespace(workload="largest", scale=24, model="gcn2", tag="")
    assert workload_json(tmp_path, "cap", args, "NVIDIA H200") == \
        tmp_path / "cap_largest-24_gcn2_nvidia-h200.json"
    args = Namespace(workload="rmat22", scale=None, model="gcn3", tag="s56")
    assert workload_json(str(tmp_path), "setup_profile", args, "NVIDIA H200") == \
        tmp_path / "s56_setup_profile_rmat22_gcn3_nvidia-h200.json"


def test_serve_puts_a_graph_or_a_loader_in_the_builtin_registry():
    import bench_suite

    from hongtu.graph.datasets import BUILTIN_DATASETS

    graph, calls = object(), []

    def load():
        calls.append(1)
        return graph

    try:
        bench_suite.serve("bench-serve-test", graph)
        assert BUILTIN_DATASETS["bench-serve-test"].build() is graph
        bench_suite.serve("bench-serve-test", load=load)  # (made again at every read)
        assert BUILTIN_DATASETS["bench-serve-test"].build() is graph and calls == [1]
    finally:
        BUILTIN_DATASETS.pop("bench-serve-test", None)
