"""numba kernels shared by the graph utilities, the partitioner, the planner and
the chunk blocks: the serial/parallel twin compiler, bit helpers, and the
distinct values of groups of segments (:func:`unique_union`)."""

from __future__ import annotations

import math
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
def is_identity(perm):
    """Whether ``perm[k] == k`` for every ``k`` (stops at the first that is not)."""
    for k in range(perm.shape[0]):  # noqa: SIM110 (a loop numba compiles)
        if perm[k] != k:
            return False
    return True


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


_ONE = np.uint64(1)
_LOW6 = np.uint64(63)
#: bitmaps of the split-group path, all pieces of a wave of groups together
_BITS_BYTES = 1 << 30


@numba.njit(cache=True)
def _emit_bits(bits, lo, hi, out, o):
    """Write the ids of the set bits of words ``bits[lo:hi]`` (bit ``j`` of word
    ``i`` is id ``64 i + j``) to ``out[o:]`` in order, clearing the words."""
    for i in range(lo, hi):
        x = bits[i]
        if x != 0:
            bits[i] = 0
            while x != 0:
                out[o] = 64 * i + lowest_bit(x)
                o += 1
                x &= x - _ONE


@parallel_kernel
def _unique_dealt(values, gptr, seg_start, seg_stop, num_nodes, workers, ptr, out, counts):
    """Distinct values of every group, groups dealt to ``workers`` round robin,
    each worker with one ``num_nodes``-bit bitmap.

    ``counts[g]`` = group ``g``'s distinct values. With ``out`` not empty
    they are also written to ``out[ptr[g]:ptr[g+1]]`` sorted (when that is
    their number). A group with at least as many values as the bitmap has
    words is marked without looking (one OR per value), then counted or read
    back in order word by word; a smaller one is marked by test-and-set,
    collected in first-seen order and re-emitted from the bitmap over the
    words they span, or sorted when that span is large next to ``k log k``.
    Either way the bitmap is left clear for the next group.
    """
    num_groups = gptr.shape[0] - 1
    words = (num_nodes + 63) // 64
    write = out.shape[0] > 0
    for w in numba.prange(workers):
        bits = np.zeros(words, dtype=np.uint64)
        for g in range(w, num_groups, workers):
            o = ptr[g] if write else 0
            end = ptr[g + 1] if write else 0
            edges = 0
            for s in range(gptr[g], gptr[g + 1]):
                edges += seg_stop[s] - seg_start[s]
            if edges >= words:
                for s in range(gptr[g], gptr[g + 1]):
                    for e in range(seg_start[s], seg_stop[s]):
                        u = values[e]
                        bits[u >> 6] |= _ONE << (np.uint64(u) & _LOW6)
                cnt = 0
                for i in range(words):
                    cnt += popcount(bits[i])
                counts[g] = cnt
                if write and cnt == end - o:
                    _emit_bits(bits, 0, words, out, o)
                else:  # (a wrong size given: nothing written)
                    bits[:] = 0
                continue
            k = o
            lo = words
            hi = -1
            for s in range(gptr[g], gptr[g + 1]):
                for e in range(seg_start[s], seg_stop[s]):
                    u = values[e]
                    i = u >> 6
                    b = _ONE << (np.uint64(u) & _LOW6)
                    x = bits[i]
                    if x & b == 0:
                        bits[i] = x | b
                        if write and k < end:
                            out[k] = u
                        k += 1
                        lo = min(lo, i)
                        hi = max(hi, i)
            cnt = k - o
            counts[g] = cnt
            if cnt == 0:
                continue
            span = hi - lo + 1
            if write and cnt == end - o and span <= cnt * (math.log2(cnt) + 1.0):
                _emit_bits(bits, lo, hi + 1, out, o)
                continue
            if write and cnt == end - o:
                out[o:k].sort()
            if span <= edges:
                bits[lo:hi + 1] = 0
            else:  # few values spread wide: clear just their words
                for s in range(gptr[g], gptr[g + 1]):
                    for e in range(seg_start[s], seg_stop[s]):
                        bits[values[e] >> 6] = 0


@parallel_kernel
def _unique_mark(values, gptr, seg_start, seg_ptr, pieces, rows):
    """Row ``g*pieces + k``: bitmap of piece ``k`` of group ``g``'s values (the
    group's ``seg_ptr``-concatenated segments cut into equal runs)."""
    for it in numba.prange(rows.shape[0]):
        g, k = it // pieces, it % pieces
        row = rows[it]
        row[:] = 0
        s0, s1 = gptr[g], gptr[g + 1]
        e0, e1 = seg_ptr[s0], seg_ptr[s1]
        step = (e1 - e0 + pieces - 1) // pieces
        lo = e0 + k * step
        hi = min(e1, lo + step)
        if lo >= hi:
            continue
        s = s0 + np.searchsorted(seg_ptr[s0:s1 + 1], lo, side="right") - 1
        e = lo
        while e < hi:
            stop = min(hi, seg_ptr[s + 1])
            shift = seg_start[s] - seg_ptr[s]
            for t in range(e, stop):
                u = values[shift + t]
                row[u >> 6] |= _ONE << (np.uint64(u) & _LOW6)
            e = stop
            s += 1


@parallel_kernel
def _unique_blocks(rows, pieces, block, offs, out, counts):
    """Per group and block of ``block`` words: OR the pieces' rows into the
    first, then count the bits (``out`` empty, into ``counts[g, b]``) or write
    their ids from ``out[offs[g, b]]`` on."""
    words = rows.shape[1]
    nblocks = counts.shape[1]
    write = out.shape[0] > 0
    for it in numba.prange(counts.shape[0] * nblocks):
        g, b = it // nblocks, it % nblocks
        first = g * pieces
        a, z = b * block, min(words, (b + 1) * block)
        if write:
            _emit_bits(rows[first], a, z, out, offs[g, b])
            continue
        c = 0
        for i in range(a, z):
            x = rows[first, i]
            for k in range(1, pieces):
                x |= rows[first + k, i]
            rows[first, i] = x
            c += popcount(x)
        counts[g, b] = c


def unique_union(values: np.ndarray, gptr: np.ndarray, seg_start: np.ndarray,
                 seg_stop: np.ndarray, num_nodes: int, sets: bool = False,
                 seg_ptr: np.ndarray | None = None, counts: np.ndarray | None = None,
                 threads: int | None = None):
    r"""Distinct values of every group of segments: their counts, or the sorted sets.

    Group ``g`` is the union of ``values[seg_start[s]:seg_stop[s]]`` for ``s``
    in ``gptr[g]:gptr[g+1]``, values in ``[0, num_nodes)``. Every group is
    marked in a ``num_nodes``-bit bitmap (an eighth of a byte per vertex, so
    the random accesses stay in cache on graphs whose stamp or flag arrays
    would not). With a group per thread or more the groups are dealt to the
    threads; with fewer, each group's values are cut into pieces marked in
    parallel and OR-ed, in waves of groups whose bitmaps fit
    ``_BITS_BYTES``.

    Args:
        values: int32 or int64 ids.
        gptr: int64 ``(G + 1,)`` group boundaries over the segments.
        seg_start, seg_stop: int64 bounds of each segment in ``values``.
        num_nodes: the id range.
        sets: return the sets rather than their sizes.
        seg_ptr: the running length of the segments (``S + 1``, ``0``
            first), when the caller has it; computed when needed.
        counts: with ``sets``, the sets' sizes when the caller has them
            (from an earlier count): saves a pass.
        threads: the threads to plan for (default numba's); more than
            the groups take the split-group path.

    Returns:
        int64 counts ``(G,)``, or with ``sets`` ``(ptr, ids)``: CSR of the
        sorted sets, ``ids`` of ``values``' dtype.
    """
    values = np.ascontiguousarray(values)
    gptr = np.ascontiguousarray(gptr, dtype=np.int64)
    seg_start = np.ascontiguousarray(seg_start, dtype=np.int64)
    seg_stop = np.ascontiguousarray(seg_stop, dtype=np.int64)
    num_groups = gptr.shape[0] - 1
    given = None
    if sets and counts is not None:
        given = np.ascontiguousarray(counts, dtype=np.int64)
        if given.shape != (max(num_groups, 0),):
            raise ValueError(f"{given.shape[0]} counts given for {num_groups} groups")
    counts = np.zeros(max(num_groups, 0), dtype=np.int64)
    ptr = np.zeros(max(num_groups, 0) + 1, dtype=np.int64)
    none = values[:0]
    if num_groups <= 0 or values.shape[0] == 0:
        if given is not None and given.any():
            raise ValueError("the counts given are not the sizes of these sets")
        return (ptr, none.copy()) if sets else counts
    threads = threads or numba.get_num_threads()
    words = (int(num_nodes) + 63) // 64
    if num_groups >= threads or values.shape[0] < SERIAL_BELOW:
        workers = max(1, min(num_groups, threads))
        if given is None:
            _unique_dealt(values, gptr, seg_start, seg_stop, num_nodes, workers, ptr, none,
                          counts)
        if not sets:
            return counts
        np.cumsum(counts if given is None else given, out=ptr[1:])
        ids = np.empty(int(ptr[-1]), dtype=values.dtype)
        if ids.size:
            _unique_dealt(values, gptr, seg_start, seg_stop, num_nodes, workers, ptr, ids,
                          counts)
        if given is not None and not np.array_equal(counts, given):
            raise ValueError("the counts given are not the sizes of these sets")
        return ptr, ids
    if seg_ptr is None:
        seg_ptr = np.zeros(seg_start.shape[0] + 1, dtype=np.int64)
        np.cumsum(seg_stop - seg_start, out=seg_ptr[1:])
    seg_ptr = np.ascontiguousarray(seg_ptr, dtype=np.int64)
    room = max(1, _BITS_BYTES // (8 * words))  # rows a wave may hold
    pieces = max(1, min(-(-4 * threads // num_groups), room))
    per_wave = max(1, room // pieces)
    block = 4096
    nblocks = -(-words // block)
    out: list[np.ndarray] = []
    for g0 in range(0, num_groups, per_wave):
        g1 = min(num_groups, g0 + per_wave)
        rows = np.empty(((g1 - g0) * pieces, words), dtype=np.uint64)
        _unique_mark(values, gptr[g0:g1 + 1], seg_start, seg_ptr, pieces, rows)
        part = np.empty((g1 - g0, nblocks), dtype=np.int64)
        _unique_blocks(rows, pieces, block, part, none, part)
        counts[g0:g1] = part.sum(axis=1)
        if sets:
            offs = np.zeros(part.size + 1, dtype=np.int64)
            np.cumsum(part.ravel(), out=offs[1:])
            ids = np.empty(int(offs[-1]), dtype=values.dtype)
            if ids.size:
                _unique_blocks(rows, pieces, block, offs[:-1].reshape(part.shape), ids, part)
            out.append(ids)
        del rows
    if not sets:
        return counts
    if given is not None and not np.array_equal(counts, given):
        raise ValueError("the counts given are not the sizes of these sets")
    np.cumsum(counts, out=ptr[1:])
    return ptr, np.concatenate(out) if len(out) > 1 else out[0]


@parallel_kernel
def _union_blocks(rows, first, block, offs, out, counts):
    """Per group ``g`` and block ``b`` of ``block`` words, the OR of rows
    ``first[g]:first[g+1]`` (the rows left as they are): its set bits counted
    into ``counts[g, b]`` (``out`` empty), or their ids written from
    ``out[offs[g, b]]`` on."""
    words = rows.shape[1]
    nblocks = counts.shape[1]
    write = out.shape[0] > 0
    for it in numba.prange(counts.shape[0] * nblocks):
        g, b = it // nblocks, it % nblocks
        a, z = b * block, min(words, (b + 1) * block)
        r0, r1 = first[g], first[g + 1]
        if r0 >= r1:
            counts[g, b] = 0
            continue
        acc = rows[r0, a:z].copy()
        for r in range(r0 + 1, r1):
            acc |= rows[r, a:z]
        if write:
            o = offs[g, b]
            for i in range(z - a):
                x = acc[i]
                while x != 0:
                    out[o] = 64 * (a + i) + lowest_bit(x)
                    o += 1
                    x &= x - _ONE
            continue
        c = 0
        for i in range(z - a):
            c += popcount(acc[i])
        counts[g, b] = c


class RunBitmaps:
    r"""Segments cut into runs, each run's values marked in its own bitmap.

    A group of consecutive segments whose bounds are run bounds is the union
    of its runs: its distinct values are the set bits of the OR of their
    bitmaps, so several groupings of the same segments are counted (and
    their sets listed) from one pass over the values. Made by
    :meth:`mark`.
    """

    _BLOCK = 4096  # words per task of the ORs

    def __init__(self, rows: np.ndarray, cuts: np.ndarray, dtype: np.dtype) -> None:
        self.rows, self.cuts, self.dtype = rows, cuts, dtype

    @classmethod
    def mark(cls, values: np.ndarray, groupings: list[np.ndarray], seg_start: np.ndarray,
             seg_stop: np.ndarray, num_nodes: int, seg_ptr: np.ndarray | None = None,
             threads: int | None = None) -> RunBitmaps | None:
        """Cut the segments at every bound of ``groupings`` (each a ``gptr`` of
        :func:`unique_union` over these segments), and into runs of about
        equal length on top so that every thread has several, then mark each
        run. ``None`` when the runs' bitmaps would not fit ``_BITS_BYTES``."""
        values = np.ascontiguousarray(values)
        seg_start = np.ascontiguousarray(seg_start, dtype=np.int64)
        seg_stop = np.ascontiguousarray(seg_stop, dtype=np.int64)
        if seg_ptr is None:
            seg_ptr = np.zeros(seg_start.shape[0] + 1, dtype=np.int64)
            np.cumsum(seg_stop - seg_start, out=seg_ptr[1:])
        seg_ptr = np.ascontiguousarray(seg_ptr, dtype=np.int64)
        threads = threads or numba.get_num_threads()
        words = (int(num_nodes) + 63) // 64
        room = _BITS_BYTES // (8 * max(words, 1))  # bitmaps that fit
        cuts = np.unique(np.concatenate([np.asarray(g, dtype=np.int64) for g in groupings])) \
            if groupings else np.zeros(1, np.int64)
        if cuts.shape[0] - 1 > room:
            return None
        even = np.linspace(0, int(seg_ptr[-1]), min(4 * threads, room - cuts.shape[0] + 1) + 1)
        if even.shape[0] > 1:
            at = np.searchsorted(seg_ptr, even.astype(np.int64), side="left")
            cuts = np.unique(np.concatenate([cuts, at[(at > cuts[0]) & (at < cuts[-1])]]))
        rows = np.empty((cuts.shape[0] - 1, words), dtype=np.uint64)
        _unique_mark(values, cuts, seg_start, seg_ptr, 1, rows)
        return cls(rows, cuts, values.dtype)

    def _blocks(self, gptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = np.searchsorted(self.cuts, np.asarray(gptr, dtype=np.int64))
        if not np.array_equal(self.cuts[np.minimum(first, self.cuts.shape[0] - 1)], gptr):
            raise ValueError("a group bound is not a bound of the runs")
        part = np.empty((first.shape[0] - 1, -(-self.rows.shape[1] // self._BLOCK)), np.int64)
        _union_blocks(self.rows, first, self._BLOCK, part, np.empty(0, self.dtype), part)
        return first, part

    def counts(self, gptr: np.ndarray) -> np.ndarray:
        """Distinct values of every group of ``gptr`` (int64)."""
        return self._blocks(gptr)[1].sum(axis=1)

    def sets(self, gptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The groups' sorted sets: CSR ``(ptr, ids)``, ``ids`` of the values' dtype."""
        first, part = self._blocks(gptr)
        offs = np.zeros(part.size + 1, dtype=np.int64)
        np.cumsum(part.ravel(), out=offs[1:])
        ids = np.empty(int(offs[-1]), dtype=self.dtype)
        if ids.size:
            _union_blocks(self.rows, first, self._BLOCK, offs[:-1].reshape(part.shape), ids,
                          part)
        ptr = np.zeros(part.shape[0] + 1, dtype=np.int64)
        np.cumsum(part.sum(axis=1), out=ptr[1:])
        return ptr, ids
