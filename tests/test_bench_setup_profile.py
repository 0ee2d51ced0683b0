"""bench/bench_setup_profile.py's kernel clock and profile tables (no GPU needed)."""

import cProfile
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench_setup_profile = pytest.importorskip("bench_setup_profile")

from hongtu.dedup import _kernels as K  # noqa: E402
from hongtu.graph import _kernels as GK  # noqa: E402


def _gather():
    vals = np.arange(10, dtype=np.int64)
    start, stop = np.array([0, 4]), np.array([2, 7])
    out_ptr = np.array([0, 2, 5])
    out = np.empty(5, dtype=np.int64)
    K.gather_segments(vals, start, stop, out_ptr, out)
    return out


def test_kernel_clock_counts_calls_per_kernel_and_puts_the_call_back():
    original = GK.parallel_kernel.__call__
    with bench_setup_profile.KernelClock() as clock:
        out = _gather()
        _gather()
    assert GK.parallel_kernel.__call__ is original
    assert out.tolist() == [0, 1, 4, 5, 6]  # (the kernel still ran)
    table = clock.table()
    assert list(table) == ["gather_segments"]
    assert table["gather_segments"]["calls"] == 2 and table["gather_segments"]["s"] > 0
    _gather()  # after the block: not counted
    assert clock.table()["gather_segments"]["calls"] == 2


def test_top_lists_functions_by_own_time_and_filters_by_file():
    def busy():
        return sum(i * i for i in range(20000))

    profile = cProfile.Profile()
    profile.enable()
    busy()
    profile.disable()
    rows = bench_setup_profile.top(profile, "tottime", 3)
    assert len(rows) == 3
    assert rows[0]["own_s"] >= rows[1]["own_s"] >= rows[2]["own_s"]
    mine = bench_setup_profile.top(profile, "cumulative", 5, r"test_bench_setup_profile\.py")
    assert mine and all("test_bench_setup_profile.py" in r["function"] for r in mine)
    assert any(r["function"].endswith("(busy)") for r in mine)
    assert bench_setup_profile.top(profile, "tottime", 5, r"no/such/file") == []
