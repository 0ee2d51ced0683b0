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
    assert p0 == {"rise": 80, "sites": {"nn/ops.py:7 g": 80}, "freed_earlier": 0,
                  "start_sites": {"engine/executor.py:3 f": 100}, "start_traced": 100}
    # (at its peak, pass 1 holds the 500 bytes; it frees pass 0's 80 after)
    assert p1 == {"rise": 500, "sites": {"(no Python frame)": 500}, "freed_earlier": 0,
                  "start_sites": {"nn/ops.py:8 h": 80}, "start_traced": 80}


def test_what_a_pass_frees_of_its_start_lowers_its_rise():
    trace = [_alloc(1, 100, []), _alloc(9, 512, MARK), _free(9, 512), _free(1, 100),
             _alloc(2, 60, _frames("/a/hongtu/nn/ops.py", 8, "h")),
             _alloc(3, 60, _frames("/a/hongtu/nn/ops.py", 8, "h"))]
    (p,) = bench_memory.pass_sites(trace, top=1)
    assert p == {"rise": 20, "sites": {"nn/ops.py:8 h": 120}, "freed_earlier": 100,
                 "start_sites": {"(no Python frame)": 100}, "start_traced": 100}


def test_a_pass_start_is_what_was_held_by_site():
    """What each pass begins with: the setup's allocations and what earlier
    passes left, summed by site, the largest first; allocations made before
    the history began are not traced."""
    setup = _frames("/a/hongtu/engine/buffers.py", 40, "row_memory")
    trace = [_alloc(1, 300, setup), _alloc(2, 200, setup),
             _alloc(3, 50, _frames("/a/hongtu/engine/transfer.py", 9, "keep")),
             _free(7, 64),  # (allocated before the history began)
             _alloc(9, 512, MARK), _free(9, 512),  # pass 0
             _alloc(4, 70, _frames("/a/hongtu/engine/transfer.py", 9, "keep")),
             _alloc(10, 512, MARK), _free(10, 512)]  # pass 1
    p0, p1 = bench_memory.pass_sites(trace, top=1)
    assert p0["start_sites"] == {"engine/buffers.py:40 row_memory": 500}
    assert p0["start_traced"] == 550 and p1["start_traced"] == 620
    assert bench_memory.pass_sites(trace, top=2)[1]["start_sites"] == {
        "engine/buffers.py:40 row_memory": 500, "engine/transfer.py:9 keep": 120}


def test_a_site_is_the_innermost_hongtu_line():
    frames = [{"filename": "/t/torch/functional.py", "line": 1, "name": "k"},
              *_frames("/a/hongtu/nn/ops.py", 8, "h"), *_frames("/a/hongtu/engine/x.py", 2, "f")]
    assert bench_memory._site(frames) == "nn/ops.py:8 h"
    assert bench_memory._site(frames[:1]) == "/t/torch/functional.py:1 k"
