"""Per-edge dot products of two row sets as one Triton kernel (GPU).

``out[e] = <g[dst[e]], x[src[e]]>``: the gradient of a weighted sparse
product with respect to its edge weights. Written as two gathers, a product
and a sum, it materialises two ``(E, width)`` tensors per call; here each
program reads the rows of a block of edges and keeps only the sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_EDGES = 64  # edges per program


@triton.jit(do_not_specialize=["num_edges"])
def _sddmm_kernel(g, g_stride, x, x_stride, dst, src, out, num_edges, width,
                  EDGES: tl.constexpr, COLS: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * EDGES + tl.arange(0, EDGES)
    valid = e < num_edges
    d = tl.load(dst + e, mask=valid, other=0)
    s = tl.load(src + e, mask=valid, other=0)
    acc = tl.zeros((EDGES,), dtype=tl.float32)
    for c0 in range(0, width, COLS):
        c = c0 + tl.arange(0, COLS)
        m = valid[:, None] & (c < width)[None, :]
        a = tl.load(g + d[:, None] * g_stride + c[None, :], mask=m, other=0.0)
        b = tl.load(x + s[:, None] * x_stride + c[None, :], mask=m, other=0.0)
        acc += tl.sum(a * b, axis=1)
    tl.store(out + e, acc, mask=valid)


def sddmm_triton(g: torch.Tensor, x: torch.Tensor, dst: torch.Tensor,
                 src: torch.Tensor) -> torch.Tensor:
    """``(g[dst] * x[src]).sum(-1)`` for float32 2-D ``g`` and ``x`` (rows may be strided)."""
    if g.stride(-1) != 1:
        g = g.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    dst, src = dst.long(), src.long()  # row offsets in int64 (no-ops for int64 ids)
    n, width = int(dst.shape[0]), int(x.shape[1])
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    if n:
        cols = max(16, min(triton.next_power_of_2(width), 128))
        _sddmm_kernel[(triton.cdiv(n, _EDGES),)](g, g.stride(0), x, x.stride(0), dst, src, out,
                                                 n, width, EDGES=_EDGES, COLS=cols)
    return out
