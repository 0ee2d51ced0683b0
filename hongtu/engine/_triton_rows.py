"""Row copies between a device and pinned host memory as one Triton kernel (GPU).

``dst[dst_ids[i]] = src[src_ids[i]]`` where either side may be a zero-copy
device view of pinned host memory. Unlike ``index_select``/``index_copy_``,
which launch a block per few rows and so put every SM's worth of PCIe reads in
flight at once and hold every SM until they finish, the grid here is bounded
(programs loop over rows), so compute and the other stream's kernels keep
running beside it and copies the other way keep their share of the link.
Measured on an H200 next to a device→host DMA copy of 600K rows: torch's
zero-copy gather reaches 50 GB/s but drags the copy down to 28 GB/s (78 GB/s
together); this kernel at one program per SM gathers at 34 GB/s while the
copy keeps 50 GB/s (84 together); alone both gather at 50-51 GB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 4  # rows per loop iteration of a program


# Row counts change from call to call: one compiled kernel for all of them
# (strides stay specialised: their divisibility lets loads be vectorised).
@triton.jit(do_not_specialize=["n"])
def _copy_rows(src, src_stride, src_ids, dst, dst_stride, dst_ids, n, width,
               HAS_SRC_IDS: tl.constexpr, HAS_DST_IDS: tl.constexpr,
               ROWS: tl.constexpr, COLS: tl.constexpr, ADD: tl.constexpr = False):
    step = tl.num_programs(0) * ROWS
    cols = tl.arange(0, COLS)
    for start in range(tl.program_id(0) * ROWS, n, step):
        i = start.to(tl.int64) + tl.arange(0, ROWS)
        valid = i < n
        r = tl.load(src_ids + i, mask=valid, other=0) if HAS_SRC_IDS else i
        d = tl.load(dst_ids + i, mask=valid, other=0) if HAS_DST_IDS else i
        for c0 in range(0, width, COLS):
            c = c0 + cols
            m = valid[:, None] & (c < width)[None, :]
            v = tl.load(src + r[:, None] * src_stride + c[None, :], mask=m)
            if ADD:
                v += tl.load(dst + d[:, None] * dst_stride + c[None, :], mask=m)
            tl.store(dst + d[:, None] * dst_stride + c[None, :], v, mask=m)


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a GPU), looked up once."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor | None,
                     dst_ids: torch.Tensor | None, programs_per_sm: float) -> None:
    """``dst[dst_ids] = src[src_ids]`` (``None``: rows in order) on the current stream."""
    n = int((src_ids if src_ids is not None else dst_ids).shape[0])
    width = int(src.shape[1])
    if n == 0 or width == 0:
        return
    grid = (max(1, min(triton.cdiv(n, _ROWS), int(sm_count(dst.device) * programs_per_sm))),)
    cols = min(triton.next_power_of_2(width), 512)
    _copy_rows[grid](src, src.stride(0), src_ids if src_ids is not None else src,
                     dst, dst.stride(0), dst_ids if dst_ids is not None else dst, n, width,
                     HAS_SRC_IDS=src_ids is not None, HAS_DST_IDS=dst_ids is not None,
                     ROWS=_ROWS, COLS=cols)


#: programs per SM of :func:`add_rows_triton` (device memory only: no link to share)
ADD_PROGRAMS_PER_SM = 16


def add_rows_triton(dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[dst_ids] += src`` for unique ``dst_ids``, without atomics (device tensors)."""
    n, width = int(dst_ids.shape[0]), int(src.shape[1])
    if n == 0 or width == 0:
        return
    grid = (max(1, min(triton.cdiv(n, _ROWS), sm_count(dst.device) * ADD_PROGRAMS_PER_SM)),)
    cols = min(triton.next_power_of_2(width), 512)
    _copy_rows[grid](src, src.stride(0), src, dst, dst.stride(0), dst_ids, n, width,
                     HAS_SRC_IDS=False, HAS_DST_IDS=True, ROWS=_ROWS, COLS=cols, ADD=True)
