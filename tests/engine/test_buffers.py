"""Host buffers: the input features gathered into h^0 in the renumbered order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hongtu.engine import buffers as B


@pytest.mark.parametrize("source", ["array", "float64", "memmap", "strided"])
def test_host_buffers_gather_renumbered_input_rows(tmp_path, monkeypatch, source):
    # h^0 row k is x[rows[k]], whichever way the rows are gathered (torch's
    # threads for an in-memory float32 array, numpy slab by slab otherwise),
    # across slab boundaries.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 6)).astype(np.float32)
    rows = rng.permutation(1000)[:700]
    if source == "float64":
        x = x.astype(np.float64)
    elif source == "memmap":
        np.save(tmp_path / "x.npy", x)
        x = np.load(tmp_path / "x.npy", mmap_mode="r")
    elif source == "strided":
        x = np.repeat(x, 2, axis=1)[:, ::2]
    monkeypatch.setattr(B, "available_host_memory", lambda: 1 << 40)
    monkeypatch.setattr(B, "_SLAB_BYTES", 128 * 6 * 4)  # slabs of 128 rows
    buf = B.HostBuffers(B.BufferPlan(700, [6, 4], [False, False]), x, pin=False, rows=rows)
    want = torch.from_numpy(np.asarray(x, dtype=np.float32)[rows])
    assert buf.h[0].dtype == torch.float32 and torch.equal(buf.h[0], want)
    # Without rows the input is used as it is.
    plain = B.HostBuffers(B.BufferPlan(1000, [6, 4], [False, False]), x, pin=False)
    assert torch.equal(plain.h[0], torch.from_numpy(np.asarray(x, dtype=np.float32)))


def test_gradients_kept_on_the_device_get_no_host_buffer():
    plan = B.BufferPlan(10, [6, 4, 3], [True, False], grads=[False, True, False])
    assert [name for name, _ in plan.entries()] == ["h^1", "grad h^1", "h^2", "a^0"]
    full = B.BufferPlan(10, [6, 4, 3], [True, False])
    assert full.total_bytes() - plan.total_bytes() == 10 * 3 * 4
    buf = B.HostBuffers(plan, np.zeros((10, 6), np.float32), pin=False)
    assert buf.grad[0] is None and buf.grad[1].shape == (10, 4) and buf.grad[2] is None


def test_host_check_counts_the_copy_of_the_features(monkeypatch):
    """The host check counts ``h^0`` where the buffers copy the input into it
    (renumbered rows, or pinned for a GPU): memory that holds the other buffers
    but not that copy is too small then, and enough for the input used as is."""
    from hongtu.errors import UserError

    plan = B.BufferPlan(100, [8, 4, 2], [True, False])
    x = np.ones((100, 8), dtype=np.float32)
    monkeypatch.setattr(B, "available_host_memory", lambda: plan.total_bytes())
    buf = B.HostBuffers(plan, x, pin=False)  # (h^0 is the input itself)
    assert buf.h[0].data_ptr() == torch.from_numpy(x).data_ptr()
    with pytest.raises(UserError, match=r"host memory too small: .*3.12 KiB of them a copy"):
        B.HostBuffers(plan, x, pin=False, rows=np.arange(100)[::-1])
    monkeypatch.setattr(B, "available_host_memory",
                        lambda: plan.total_bytes() + 100 * 8 * 4)
    buf = B.HostBuffers(plan, x, pin=False, rows=np.arange(100)[::-1])
    assert torch.equal(buf.h[0], torch.ones(100, 8))
