"""bench/bench_memory.py's replay of an allocator history (no GPU needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench_memory = pytest.importorskip("bench_memory")


def _frames(path, line, name):
    return [{"filename": path, "line": line, "name": name}]


def _alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size}


MARK = _frames("/x/bench/bench_memory.py", 1, "_mark_pass")


def test_each_pass_peak_is_its_rise_with_the_sites_it_held():
    trace = [
        _alloc(1, 100, _frames("/a/hongtu/engine/executor.py", 3, "f")),  # before any pass
        _alloc(9, 512, MARK), _free(9, 512),  # pass 0
        _alloc(9, 50, _frames("/a/hongtu/nn/ops.py", 7, "g")),  # (the mark's address again)
        _alloc(5, 30, _frames("/a/hongtu/nn/ops.py", 7, "g")),
        _free(1, 100),  # what the pass began with
        _alloc(2, 80, [{"filename": "/t/torch/x.py", "line": 1, "name": "k"},
                       *_frames("/a/hongtu/nn/ops.py", 8, "h")]),
        _free(9, 50), _free(5, 30),
        _alloc(10, 512, MARK), _free(10, 512),  # pass 1
        _alloc(4, 500, []),
        _free(2, 80),
    ]
    p0, p1 = bench_memory.pass_sites(trace, top=5)
    assert p0 == {"rise": 80, "sites": {"nn/ops.py:7 g": 80}, "freed_earlier": 0}
    # (at its peak, pass 1 holds the 500 bytes; it frees pass 0's 80 after)
    assert p1 == {"rise": 500, "sites": {"(no Python frame)": 500}, "freed_earlier": 0}


def test_what_a_pass_frees_of_its_start_lowers_its_rise():
    trace = [_alloc(1, 100, []), _alloc(9, 512, MARK), _free(9, 512), _free(1, 100),
             _alloc(2, 60, _frames("/a/hongtu/nn/ops.py", 8, "h")),
             _alloc(3, 60, _frames("/a/hongtu/nn/ops.py", 8, "h"))]
    (p,) = bench_memory.pass_sites(trace, top=1)
    assert p == {"rise": 20, "sites": {"nn/ops.py:8 h": 120}, "freed_earlier": 100}


def test_a_site_is_the_innermost_hongtu_line():
    frames = [{"filename": "/t/torch/functional.py", "line": 1, "name": "k"},
              *_frames("/a/hongtu/nn/ops.py", 8, "h"), *_frames("/a/hongtu/engine/x.py", 2, "f")]
    assert bench_memory._site(frames) == "nn/ops.py:8 h"
    assert bench_memory._site(frames[:1]) == "/t/torch/functional.py:1 k"
