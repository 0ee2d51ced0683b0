"""numba kernels shared by the graph utilities."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, cache=True)
def _gather_ranges(values, indptr, order, new_indptr, relabel, out):
    mapped = relabel.shape[0] > 0
    for k in numba.prange(order.shape[0]):
        v = order[k]
        s = indptr[v]
        o = new_indptr[k]
        for t in range(indptr[v + 1] - s):
            out[o + t] = relabel[values[s + t]] if mapped else values[s + t]


@numba.njit(cache=True)
def bucket_fill(src, dst, indptr, out):
    """Scatter ``src`` into CSC order by ``dst``, keeping input order per destination."""
    cursor = indptr[:-1].copy()
    for k in range(dst.shape[0]):
        d = dst[k]
        out[cursor[d]] = src[k]
        cursor[d] += 1


def gather_ranges(values: np.ndarray, indptr: np.ndarray, order: np.ndarray,
                  new_indptr: np.ndarray, relabel: np.ndarray | None = None) -> np.ndarray:
    """Concatenate the CSR segments of ``values`` listed in ``order``.

    With ``relabel``, each value ``u`` is written as ``relabel[u]`` (in
    ``values``' dtype), in the same pass.
    """
    out = np.empty(int(new_indptr[-1]), dtype=values.dtype)
    relabel = values[:0] if relabel is None else relabel
    _gather_ranges(values, indptr, order, new_indptr, relabel, out)
    return out
