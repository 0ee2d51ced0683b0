"""Device row helpers of the transfer module."""

from __future__ import annotations

import pytest
import torch

from hongtu.engine.transfer import add_rows


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 37, 256, 600])
def test_add_rows_matches_index_add(width):
    """The atomics-free row add equals index_add_ with unique ids, bit for bit."""
    dst = torch.randn(5000, width, device="cuda")
    ids = torch.randperm(5000, device="cuda")[:3001]
    src = torch.randn(3001, width, device="cuda")
    ref = dst.clone().index_add_(0, ids, src)
    add_rows(dst, ids, src)
    assert torch.equal(dst, ref)


def test_add_rows_on_cpu():
    dst = torch.zeros(6, 3)
    add_rows(dst, torch.tensor([4, 1]), torch.ones(2, 3))
    assert dst.sum(1).tolist() == [0, 3, 0, 0, 3, 0]


@pytest.mark.gpu
def test_timeline_marks_every_layer_pass(tmp_path):
    """The opt-in timeline (bench/bench_passes.py) holds every timed piece of one epoch
    and a mark and byte counters at each layer pass; it does not change the totals."""
    from hongtu.config import config_from_dict
    from hongtu.engine.trainer import Trainer

    cfg = config_from_dict({
        "data": {"path": "builtin:sbm-small"}, "model": {"hidden": 16, "layers": 2},
        "engine": {"chunks": 4, "resident": False, "cache_dir": str(tmp_path / "cache")},
        "output": {"dir": str(tmp_path / "run")}})
    tr = Trainer(cfg, out=lambda s: None)
    mv = tr.executor.mover
    mv.timeline = []
    rec = tr.run_epoch(0, evaluate=False)
    assert len([t for t in mv.timeline if t[0] == "pass"]) == 4 == len(mv.pass_bytes)
    assert mv.pass_bytes[0] == (0, 0) and all(b >= a >= 0 for _, a, b in mv.timeline)
    h2d = sum(b - a for f, a, b in mv.timeline if f == "time_h2d_s") / 1e3
    assert h2d == pytest.approx(rec["time_h2d_s"], rel=1e-3)
