"""Pinned host memory registered in place, and zero-copy device views of it."""

from __future__ import annotations

import pytest
import torch

from hongtu.engine.pinned import device_view, is_device_view, pinned_copies, pinned_empty


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


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 47, 256, 602, 1100])
@pytest.mark.parametrize("grid", [None, (1, 4), (3, 64), (8, 64)])
def test_copy_rows_gathers_from_and_scatters_into_pinned_memory(width, grid, monkeypatch):
    """The bounded-grid kernel (and torch's ops, ``None``) against plain indexing,
    for widths below, at and above one column tile, fewer programs than rows
    and rows per program capped by the tile (47: on half a program per SM)."""
    from hongtu.engine import transfer
    monkeypatch.setattr(transfer, "ROW_KERNEL", grid is not None)
    for name in ("ROW_LOADS", "ROW_STORES"):
        monkeypatch.setattr(transfer, name, grid)
    monkeypatch.setattr(transfer, "WIDE_ROW_BYTES", 0 if width != 47 else 1 << 20)
    dev = torch.device("cuda")
    host, ok = pinned_empty((5000, width), torch.float32)
    assert ok
    host.copy_(torch.randn(5000, width))
    view = device_view(host, dev)
    assert is_device_view(view) and not is_device_view(view[:10])
    ids = torch.randperm(5000)[:1234].sort().values
    slots = torch.randperm(2000)[:1234]
    buf = torch.zeros(2000, width, device=dev)
    transfer.copy_rows(view, buf, ids.to(dev), slots.to(dev))  # gather into slots
    want = torch.zeros(2000, width)
    want[slots] = host[ids]
    assert torch.equal(buf.cpu(), want)
    out = torch.empty(1234, width, device=dev)
    transfer.copy_rows(view, out, ids.to(dev))  # gather in order
    assert torch.equal(out.cpu(), host[ids])
    again = torch.empty(1234, width, device=dev)
    transfer.copy_rows(buf, again, slots.to(dev))  # on the device alone
    assert torch.equal(again, out)
    vals = torch.randn(1234, width, device=dev)
    transfer.copy_rows(vals, view, dst_ids=ids.to(dev))  # scatter into host rows
    torch.cuda.synchronize()
    assert torch.equal(host[ids], vals.cpu())
