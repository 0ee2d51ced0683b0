"""numba kernels shared by the graph utilities, and the serial/parallel twin
compiler every planner kernel uses."""

from __future__ import annotations

import types

import numba
import numpy as np

#: Below this many elements (largest array argument) a :class:`parallel_kernel`
#: runs serially: waking the thread pool costs from ~0.1 ms up to a scheduler
#: time slice on a loaded machine, more than the work itself.
SERIAL_BELOW = 1 << 16


class parallel_kernel:
    """Compile a ``prange`` kernel twice: parallel for big inputs, serial for small ones.

    The serial copy gets its own qualified name, so numba's on-disk cache
    keeps the two apart.
    """

    def __init__(self, fn):
        self.parallel = numba.njit(parallel=True, cache=True)(fn)
        clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                                   fn.__defaults__, fn.__closure__)
        clone.__qualname__ = fn.__qualname__ + "_serial"
        clone.__doc__ = fn.__doc__
        self.serial = numba.njit(cache=True)(clone)
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    def __call__(self, *args):
        work = max((a.size for a in args if isinstance(a, np.ndarray)), default=0)
        return (self.parallel if work >= SERIAL_BELOW else self.serial)(*args)


#: De Bruijn multiplier: ``(lowest set bit * DEBRUIJN) >> 58`` indexes :data:`BIT_OF`
DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
#: position of a 64-bit word's single set bit, by its De Bruijn index
BIT_OF = np.zeros(64, dtype=np.int64)
BIT_OF[((np.uint64(1) << np.arange(64, dtype=np.uint64)) * DEBRUIJN) >> np.uint64(58)] = \
    np.arange(64)


@numba.njit(cache=True, inline="always")
def popcount(x):
    """Set bits of a uint64 word."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(cache=True, inline="always")
def lowest_bit(x):
    """Position of the lowest set bit of a non-zero uint64 word."""
    return BIT_OF[((x & (~x + np.uint64(1))) * DEBRUIJN) >> np.uint64(58)]


@numba.njit(cache=True, inline="always")
def highest_bit(x):
    """Position of the highest set bit of a non-zero uint64 word."""
    h = 0
    for shift in (32, 16, 8, 4, 2, 1):
        if x >> np.uint64(shift) != np.uint64(0):
            x >>= np.uint64(shift)
            h += shift
    return h


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
