"""Pinned host memory registered in place, and zero-copy device views of it."""

from __future__ import annotations

import pytest
import torch

from hongtu.engine.pinned import device_view, pinned_copies, pinned_empty


@pytest.mark.gpu
def test_pinned_empty_is_zeroed_registered_and_readable_by_the_gpu():
    t, ok = pinned_empty((1000, 33), torch.float32)
    assert ok and t.is_pinned() and t.shape == (1000, 33) and t.data_ptr() % 4096 == 0
    assert not t.any()
    t.copy_(torch.randn(1000, 33))
    ids = torch.tensor([5, 999, 0, 5], device="cuda")
    got = device_view(t, torch.device("cuda")).index_select(0, ids)
    assert torch.equal(got.cpu(), t[ids.cpu()])


@pytest.mark.gpu
def test_pinned_copies_share_one_slab_and_keep_values():
    src = [torch.arange(7, dtype=torch.int64), torch.randn(3, 5), torch.empty(0),
           torch.tensor([1.5], dtype=torch.float64)]
    out = pinned_copies(src)
    for a, b in zip(src, out):
        assert b.is_pinned() and b.dtype == a.dtype and torch.equal(a, b)
        assert b.data_ptr() % 128 == 0 or b.numel() == 0
        assert torch.equal(b.to("cuda", non_blocking=True).cpu(), a)
