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
