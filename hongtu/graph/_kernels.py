"""numba kernels shared by the graph utilities."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, cache=True)
def _gather_ranges(values, indptr, order, new_indptr, out):
    for k in numba.prange(order.shape[0]):
        v = order[k]
        s = indptr[v]
        o = new_indptr[k]
        for t in range(indptr[v + 1] - s):
            out[o + t] = values[s + t]


@numba.njit(cache=True)
def bucket_fill(src, dst, indptr, out):
    """Scatter ``src`` into CSC order by ``dst``, keeping input order per destination."""
    cursor = indptr[:-1].copy()
    for k in range(dst.shape[0]):
        d = dst[k]
        out[cursor[d]] = src[k]
        cursor[d] += 1


def gather_ranges(values: np.ndarray, indptr: np.ndarray, order: np.ndarray,
                  new_indptr: np.ndarray) -> np.ndarray:
    """Concatenate the CSR segments of ``values`` listed in ``order``."""
    out = np.empty(int(new_indptr[-1]), dtype=values.dtype)
    _gather_ranges(values, indptr, order, new_indptr, out)
    return out
