"""bench/bench_passes.py's kernel attribution (a profiler trace, no GPU needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench_passes = pytest.importorskip("bench_passes")


def _launch(corr, ts, driver=False):
    return {"cat": "cuda_driver" if driver else "cuda_runtime", "name": "launch", "ts": ts,
            "dur": 1, "args": {"correlation": corr}}


def _kernel(corr, name, ms, cat="kernel"):
    return {"cat": cat, "name": name, "ts": 1000 + corr, "dur": ms * 1000,
            "args": {"correlation": corr}}


def test_kernels_are_counted_in_the_pass_that_launched_them():
    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "PASS forward L0", "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "PASS backward L0", "ts": 200, "dur": 100},
        _launch(1, 10), _launch(2, 20, driver=True), _launch(3, 30), _launch(4, 40),
        _launch(5, 150), _launch(6, 250), _launch(7, 260), _launch(8, 270),
        # (kernels run later than their launch, the first pass's after it ended)
        _kernel(1, "void cusparse::csrmm_alg2_kernel<false, long>(long, float)", 2.0),
        _kernel(2, "_copy_rows", 3.0),  # Triton, launched through the driver API
        _kernel(3, "Memcpy HtoD (Pinned -> Device)", 0.5, cat="gpu_memcpy"),
        _kernel(4, "void cusparse::csrmm_alg2_kernel<false, long>(long, float)", 1.0),
        _kernel(5, "multi_tensor_apply_kernel", 0.25),
        _kernel(6, "gemm", 1.0), _kernel(7, "_dropout_kernel", 1.5),
        _kernel(8, "Memcpy DtoH (Device -> Pinned)", 0.75, cat="gpu_memcpy"),
    ]}
    out = bench_passes.kernels_per_pass(trace, top=1)
    assert list(out) == ["forward L0", "backward L0", "between"]
    f, b, between = out["forward L0"], out["backward L0"], out["between"]
    assert f["transfer_ms"] == pytest.approx(3.5) and f["compute_ms"] == pytest.approx(3.0)
    assert f["top"] == [["void cusparse::csrmm_alg2_kernel", pytest.approx(3.0), 2]]
    assert b["compute_ms"] == pytest.approx(2.5) and b["transfer_ms"] == pytest.approx(0.75)
    assert b["top"] == [["_dropout_kernel", pytest.approx(1.5), 1]]
    assert between["compute_ms"] == pytest.approx(0.25)
    # (transfers by kind: the row kernel's zero-copy rows, DMA copies by direction)
    assert f["transfers"] == [["row kernel", pytest.approx(3.0), 1],
                              ["DMA HtoD", pytest.approx(0.5), 1]]
    assert b["transfers"] == [["DMA DtoH", pytest.approx(0.75), 1]]
    assert between["transfers"] == []


def test_pass_table_gives_busy_times_the_tail_and_the_bound():
    """Per pass, from a timeline: each stream's busy time (overlaps merged,
    intervals clipped to the pass), both ways at once, idle time, and the tail
    from the last compute to the pass's end (a pass waiting for its stores)."""
    timeline = [("pass", 0.0, 0.0), ("time_h2d_s", 0.0, 4.0), ("time_compute_s", 1.0, 5.0),
                ("time_d2h_s", 3.0, 9.0), ("time_h2d_s", 2.0, 3.0),
                ("pass", 10.0, 10.0), ("time_compute_s", 10.0, 12.0), ("time_h2d_s", 11.0, 16.0)]
    peak = {"h2d": 1e9, "d2h": 1e9, "both": 1.5e9}  # bytes/s
    rows = bench_passes.passes(timeline, [(0, 0), (4_000_000, 6_000_000)],
                               (9_000_000, 6_000_000), peak)
    first, second = rows
    assert first["pass_ms"] == 10.0 and first["h2d_busy_ms"] == 4.0
    assert first["d2h_busy_ms"] == 6.0 and first["gpu_busy_ms"] == 4.0
    assert first["both_ways_ms"] == 1.0 and first["idle_ms"] == 1.0
    assert first["tail_ms"] == 5.0  # (compute ended at 5, the stores at 9, the pass at 10)
    assert first["bound_ms"] == pytest.approx(max(4, 6, 10 / 1.5))  # ms at the peaks
    assert second["pass_ms"] == 6.0 and second["tail_ms"] == 4.0
    assert second["h2d_bytes"] == 5_000_000 and second["d2h_bytes"] == 0
