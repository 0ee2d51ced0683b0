"""The built-in aggregations' edge weights as one Triton kernel (GPU).

The tensor-op version in :mod:`hongtu.nn.ops` takes about a dozen launches per
block (each edge's destination by ``repeat_interleave``, two clamped inverse
square roots, two gathers, a product) and, for the transpose, one more gather
through ``t_perm``. Here one launch finds each edge's row by binary search in
the row pointer and writes its weight from the two degrees, for the CSR and
for its transpose alike. Each weight is the same product of the same two
factors as the tensor ops' (a GPU test checks the values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
#: ``op`` codes of the kernel
GCN, MEAN_OF_ROW, MEAN_OF_COL = 0, 1, 2


@triton.jit(do_not_specialize=["nnz", "nrows", "steps"])
def _weights_kernel(ptr, cols, row_deg, col_deg, out, nnz, nrows, steps,
                    OP: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = e < nnz
    # the edge's row: the last r with ptr[r] <= e (ptr[lo] <= e < ptr[hi])
    lo = tl.zeros((BLOCK,), dtype=tl.int64)
    hi = tl.full((BLOCK,), 0, dtype=tl.int64) + nrows
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = tl.load(ptr + mid, mask=valid, other=0) <= e
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    c = tl.load(cols + e, mask=valid, other=0)
    if OP == 0:
        rs = tl.math.rsqrt(tl.maximum(tl.load(row_deg + lo, mask=valid, other=1.0), 1.0))
        cs = tl.math.rsqrt(tl.maximum(tl.load(col_deg + c, mask=valid, other=1.0), 1.0))
        w = cs * rs
    elif OP == 1:
        w = tl.math.div_rn(1.0, tl.maximum(tl.load(row_deg + lo, mask=valid, other=1.0), 1.0))
    else:
        w = tl.math.div_rn(1.0, tl.maximum(tl.load(col_deg + c, mask=valid, other=1.0), 1.0))
    tl.store(out + e, w, mask=valid)


def edge_weights_triton(ptr: torch.Tensor, cols: torch.Tensor, row_deg: torch.Tensor,
                        col_deg: torch.Tensor, op: int) -> torch.Tensor:
    """float32 weight of every edge of the CSR ``(ptr, cols)``: ``GCN``:
    ``rsqrt(max(col_deg[c], 1)) * rsqrt(max(row_deg[r], 1))``; ``MEAN_OF_ROW`` /
    ``MEAN_OF_COL``: ``1 / max(deg, 1)`` of the edge's row / column."""
    nnz, nrows = int(cols.shape[0]), int(ptr.shape[0]) - 1
    out = torch.empty(nnz, dtype=torch.float32, device=cols.device)
    if nnz:
        grid = (triton.cdiv(nnz, _BLOCK),)
        _weights_kernel[grid](ptr.contiguous(), cols.contiguous(),
                              row_deg.to(torch.float32).contiguous(),
                              col_deg.to(torch.float32).contiguous(), out, nnz, nrows,
                              max(nrows, 1).bit_length(), OP=op, BLOCK=_BLOCK)
    return out
