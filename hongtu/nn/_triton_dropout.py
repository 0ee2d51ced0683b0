"""The counter-based dropout hash as Triton kernels (GPU).

Bit-identical to the tensor-op version in :mod:`hongtu.nn.ops` (a test on a
GPU checks it): one launch writes the whole keep-mask instead of ~25
elementwise int64 kernels per block of rows, and :func:`dropout_triton` applies
it in the same pass (``x * where(keep, scale, 0)``, which equals
``(x * mask) * scale`` bit for bit) without writing the mask at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _fmix32(h):
    # int64 lanes holding 32-bit values; products wrap mod 2^64, whose low 32
    # bits are the 32-bit product, so masking restores exact uint32 arithmetic.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _keep(ids_ptr, offs, valid, width, seed_lo, seed_hi, threshold):
    seed_lo, seed_hi = seed_lo & 0xFFFFFFFF, seed_hi & 0xFFFFFFFF  # see _words
    threshold = threshold & 0xFFFFFFFF
    row = offs // width
    col = offs - row * width
    vid = tl.load(ids_ptr + row, mask=valid, other=0)
    key = vid * width + col                                  # int64, non-negative
    h = _fmix32((key >> 32) ^ seed_lo)
    h = _fmix32((key & 0xFFFFFFFF) ^ h ^ seed_hi)
    return h >= threshold


# Seeds change every epoch and layer: no compiled variant per value.
_VARYING = ["total", "seed_lo", "seed_hi", "threshold"]


@triton.jit(do_not_specialize=_VARYING)
def _mask_kernel(ids_ptr, out_ptr, total, width, seed_lo, seed_hi, threshold,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    keep = _keep(ids_ptr, offs, valid, width, seed_lo, seed_hi, threshold)
    tl.store(out_ptr + offs, keep, mask=valid)


@triton.jit(do_not_specialize=_VARYING)
def _dropout_kernel(x_ptr, gate_ptr, ids_ptr, out_ptr, total, width, seed_lo, seed_hi,
                    threshold, scale, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    keep = _keep(ids_ptr, offs, valid, width, seed_lo, seed_hi, threshold)
    x = tl.load(x_ptr + offs, mask=valid)
    if MODE == 1:  # relu first, as torch's: max(x, 0) keeping NaN and -0.0
        x = tl.where(x < 0, 0.0, x)
    y = x * tl.where(keep, scale, 0.0)
    if MODE == 2:  # relu's gradient after dropout's, as torch's: 0 where relu(gate) <= 0
        gate = tl.load(gate_ptr + offs, mask=valid, other=0.0)
        y = tl.where(gate <= 0, 0.0, y)
    tl.store(out_ptr + offs, y, mask=valid)


@triton.jit(do_not_specialize=_VARYING)
def _dropout_rows_kernel(x_ptr, x_at_ptr, out_ptr, at_ptr, ids_ptr, total, width, seed_lo,
                         seed_hi, threshold, scale, X_AT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    keep = _keep(ids_ptr, offs, valid, width, seed_lo, seed_hi, threshold)
    row = offs // width
    col = offs - row * width
    if X_AT:
        src = tl.load(x_at_ptr + row, mask=valid, other=0) * width + col
    else:
        src = offs
    x = tl.load(x_ptr + src, mask=valid)
    dst = tl.load(at_ptr + row, mask=valid, other=0) * width + col
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
    total = ids.shape[0] * width
    if total:
        grid = (triton.cdiv(total, _BLOCK),)
        _mask_kernel[grid](ids, out, total, width, *_words(seed, threshold), BLOCK=_BLOCK)
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
    total = x.numel()
    if total:
        width = total // ids.shape[0]
        grid = (triton.cdiv(total, _BLOCK),)
        _dropout_kernel[grid](x, gate, ids, out, total, width, *_words(seed, threshold), scale,
                              MODE=mode, BLOCK=_BLOCK)
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
    total = n * width
    src_at = at if x_at is None else x_at.to(torch.int64).contiguous()
    grid = (triton.cdiv(total, _BLOCK),)
    _dropout_rows_kernel[grid](x, src_at, out, at, ids, total, width,
                               *_words(seed, threshold), scale, X_AT=x_at is not None,
                               BLOCK=_BLOCK)
