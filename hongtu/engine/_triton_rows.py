"""Row copies between a device and pinned host memory as one Triton kernel (GPU).

``dst[dst_ids[i]] = src[src_ids[i]]`` where either side may be a zero-copy
device view of pinned host memory. Unlike ``index_select``/``index_copy_``,
which launch a block per few rows and so put every SM's worth of PCIe reads in
flight at once and hold every SM until they finish, the grid here is bounded
(programs loop over rows), so compute and the other stream's kernels keep
running beside it and copies the other way keep their share of the link.

An SM that runs a program writing host memory runs compute slowly beside
it: measured on an H200 (``bench/bench_rows.py``), a 100K×256×256 GEMM took
3.25× as long beside a scatter of 1 KB rows into host memory at half a
program per SM and 1.20× at 2 programs of 64 rows, which write as fast
(51-52 GB/s; a cuSPARSE product 3.89× and 1.05×). So the caller picks the
grid (:func:`hongtu.engine.transfer.copy_rows`): a few programs of 16 warps,
each with many rows in flight, or half a program per SM of 4 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 4  # rows per loop iteration of a program on the default grid
#: the most elements (rows × a column tile) a program moves per loop iteration
#: when it reads or writes host memory (more spill registers and slow it down)
TILE = 16384


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
                     dst_ids: torch.Tensor | None, grid: tuple[int, int] | None = None) -> None:
    """``dst[dst_ids] = src[src_ids]`` (``None``: rows in order) on the current stream.

    ``grid``: ``(programs, rows)``, how many programs (of 16 warps) move the
    rows and how many rows each moves per loop iteration (at most
    :data:`TILE` elements); ``None`` (the default): half a program per SM
    (of 4 warps) of 4 rows at a time."""
    n = int((src_ids if src_ids is not None else dst_ids).shape[0])
    width = int(src.shape[1])
    if n == 0 or width == 0:
        return
    cols = min(triton.next_power_of_2(width), 512)
    if grid is None:
        programs, rows, warps = max(1, sm_count(dst.device) // 2), _ROWS, 4
    else:
        programs, rows, warps = grid[0], min(triton.next_power_of_2(grid[1]), TILE // cols), 16
    _copy_rows[(max(1, min(triton.cdiv(n, rows), int(programs))),)](
        src, src.stride(0), src_ids if src_ids is not None else src,
        dst, dst.stride(0), dst_ids if dst_ids is not None else dst, n, width,
        HAS_SRC_IDS=src_ids is not None, HAS_DST_IDS=dst_ids is not None,
        ROWS=rows, COLS=cols, num_warps=warps)


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
