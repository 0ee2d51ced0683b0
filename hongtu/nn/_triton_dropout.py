"""The counter-based dropout hash as Triton kernels (GPU).

Bit-identical to the tensor-op version in :mod:`hongtu.nn.ops` (a test on a
GPU checks it): one launch writes the whole keep-mask instead of ~25
elementwise int64 kernels per block of rows, and :func:`dropout_triton` applies
it in the same pass (``x * where(keep, scale, 0)``, which equals
``(x * mask) * scale`` bit for bit) without writing the mask at all. Each
program takes a 2-D tile of rows and columns (no per-element division by the
width) and hashes in uint32 lanes (no 64-bit products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements a program covers (rows x columns of a 2-D tile, columns a power of two)
_TILE = 2048
_MAX_COLS = 256


def _tile(width: int) -> tuple[int, int]:
    """``(rows, columns)`` of a program's tile for rows of ``width``."""
    cols = min(_MAX_COLS, triton.next_power_of_2(max(int(width), 1)))
    return _TILE // cols, cols


@triton.jit
def _fmix32(h):
    # uint32 lanes: products and shifts wrap and fill as the 32-bit hash's.
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _tile_at(n, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A program's rows ``(ROWS, 1)``, columns ``(1, COLS)``, which rows exist and
    which elements: a 2-D tile, so no element divides its offset by the width."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    inside = row < n
    return row, col, inside, inside & (col < width)


@triton.jit
def _keep(ids_ptr, row, col, inside, width, seed_lo, seed_hi, threshold):
    vid = tl.load(ids_ptr + row, mask=inside, other=0)
    key = vid * width + col                                  # int64, non-negative
    seed_lo = (seed_lo & 0xFFFFFFFF).to(tl.uint32)           # (see _words)
    seed_hi = (seed_hi & 0xFFFFFFFF).to(tl.uint32)
    threshold = (threshold & 0xFFFFFFFF).to(tl.uint32)
    h = _fmix32((key >> 32).to(tl.uint32) ^ seed_lo)
    h = _fmix32(key.to(tl.uint32) ^ h ^ seed_hi)
    return h >= threshold


# Seeds change every epoch and layer, row counts every step: no compiled variant per value.
_VARYING = ["n", "seed_lo", "seed_hi", "threshold"]


@triton.jit(do_not_specialize=_VARYING)
def _mask_kernel(ids_ptr, out_ptr, n, width, seed_lo, seed_hi, threshold,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    row, col, inside, valid = _tile_at(n, width, ROWS, COLS)
    keep = _keep(ids_ptr, row, col, inside, width, seed_lo, seed_hi, threshold)
    tl.store(out_ptr + row * width + col, keep, mask=valid)


@triton.jit(do_not_specialize=_VARYING)
def _dropout_kernel(x_ptr, gate_ptr, ids_ptr, out_ptr, n, width, seed_lo, seed_hi,
                    threshold, scale, MODE: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    row, col, inside, valid = _tile_at(n, width, ROWS, COLS)
    keep = _keep(ids_ptr, row, col, inside, width, seed_lo, seed_hi, threshold)
    offs = row * width + col
    x = tl.load(x_ptr + offs, mask=valid)
    if MODE == 1:  # relu first, as torch's: max(x, 0) keeping NaN and -0.0
        x = tl.where(x < 0, 0.0, x)
    y = x * tl.where(keep, scale, 0.0)
    if MODE == 2:  # relu's gradient after dropout's, as torch's: 0 where relu(gate) <= 0
        gate = tl.load(gate_ptr + offs, mask=valid, other=0.0)
        y = tl.where(gate <= 0, 0.0, y)
    tl.store(out_ptr + offs, y, mask=valid)


@triton.jit(do_not_specialize=_VARYING)
def _dropout_rows_kernel(x_ptr, x_at_ptr, out_ptr, at_ptr, ids_ptr, n, width, seed_lo,
                         seed_hi, threshold, scale, X_AT: tl.constexpr, ROWS: tl.constexpr,
                         COLS: tl.constexpr):
    row, col, inside, valid = _tile_at(n, width, ROWS, COLS)
    keep = _keep(ids_ptr, row, col, inside, width, seed_lo, seed_hi, threshold)
    if X_AT:
        src = tl.load(x_at_ptr + row, mask=inside, other=0) * width + col
    else:
        src = row * width + col
    x = tl.load(x_ptr + src, mask=valid)
    dst = tl.load(at_ptr + row, mask=inside, other=0) * width + col
    tl.store(out_ptr + dst, x * tl.where(keep, scale, 0.0), mask=valid)


def _words(seed: int, threshold: int) -> tuple[int, int, int]:
    """The seed's two 32-bit words and the threshold, each with bit 40 set.

    Triton types an int argument by its value (int32 below 2^31, else int64)
    and compiles a kernel per signature; with the bit set every call passes
    int64, and the kernel masks it off again.
    """
    tag = 1 << 40
    return (seed & 0xFFFFFFFF) | tag, ((seed >> 32) & 0xFFFFFFFF) | tag, threshold | tag


def dropout_mask_triton(ids: torch.Tensor, width: int, threshold: int, seed: int) -> torch.Tensor:
    """Keep-mask ``(len(ids), width)`` computed on the GPU in one launch."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.shape[0], width), dtype=torch.bool, device=ids.device)
    n = int(ids.shape[0])
    if n and width:
        rows, cols = _tile(width)
        grid = (triton.cdiv(n, rows), triton.cdiv(width, cols))
        _mask_kernel[grid](ids, out, n, width, *_words(seed, threshold), ROWS=rows, COLS=cols)
    return out


def dropout_triton(x: torch.Tensor, ids: torch.Tensor, threshold: int, seed: int,
                   scale: float, relu: bool = False,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """``x * keep * scale`` for a float32 ``x`` of ``len(ids)`` rows, in one pass;
    with ``relu``, of ``relu(x)``; with ``gate``, zero where ``relu(gate) <= 0``
    (the gradient of ``dropout(relu(gate))`` given ``x``, the output's)."""
    mode = 1 if relu else 0 if gate is None else 2
    ids = ids.to(torch.int64).contiguous()
    x = x.contiguous()
    gate = x if gate is None else gate.contiguous()
    out = torch.empty_like(x)
    n = int(ids.shape[0])
    if x.numel():
        width = x.numel() // n
        rows, cols = _tile(width)
        grid = (triton.cdiv(n, rows), triton.cdiv(width, cols))
        _dropout_kernel[grid](x, gate, ids, out, n, width, *_words(seed, threshold), scale,
                              MODE=mode, ROWS=rows, COLS=cols)
    return out


def dropout_rows_triton(x: torch.Tensor, ids: torch.Tensor, threshold: int, seed: int,
                        scale: float, out: torch.Tensor, at: torch.Tensor,
                        x_at: torch.Tensor | None = None) -> None:
    """``out[at[i]] = x[i] * keep * scale`` (``x[x_at[i]]`` with ``x_at``) for float32
    rows, in one pass; ``out`` may be ``x`` (in place: ``x_at = at``)."""
    n = int(ids.shape[0])
    if n == 0 or out.shape[1] == 0:
        return
    if not (out.is_contiguous() and x.is_contiguous()):
        raise ValueError("dropout_rows_triton needs contiguous rows")
    ids = ids.to(torch.int64).contiguous()
    at = at.to(torch.int64).contiguous()
    width = int(out.shape[1])
    src_at = at if x_at is None else x_at.to(torch.int64).contiguous()
    rows, cols = _tile(width)
    grid = (triton.cdiv(n, rows), triton.cdiv(width, cols))
    _dropout_rows_kernel[grid](x, src_at, out, at, ids, n, width, *_words(seed, threshold),
                               scale, X_AT=x_at is not None, ROWS=rows, COLS=cols)
