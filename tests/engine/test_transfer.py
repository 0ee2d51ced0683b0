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
