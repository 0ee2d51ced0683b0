r"""numba kernels of the partitioner: symmetrisation and partition statistics.

All kernels read the in-edge CSC of :class:`~hongtu.graph.Graph` directly
(``indptr`` int64, ``indices`` int32 or int64) and never build a dense or
``E``-sized temporary in Python, so they stay linear in memory and time on
graphs with tens of millions of edges.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from hongtu.graph import _kernels as _graph_kernels
from hongtu.graph._kernels import lowest_bit, parallel_kernel, popcount

__all__ = ["count_cut_edges", "distinct_sources", "symmetric_csr", "unique_union"]


@numba.njit(cache=True)
def _out_lists(indptr, indices, out_ptr):
    """Destinations of each vertex's out-edges, grouped by source (CSR)."""
    n = indptr.shape[0] - 1
    cursor = out_ptr[:-1].copy()
    out = np.empty(indices.shape[0], dtype=indices.dtype)
    for v in range(n):
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            out[cursor[u]] = v
            cursor[u] += 1
    return out


@numba.njit(parallel=True, cache=True)
def _sym_neighbours(indptr, indices, out_ptr, out_idx, blocks, buf, counts):
    """Write the distinct neighbours of every vertex to the front of its window.

    Neighbours of ``v`` are its in- and out-neighbours except ``v`` itself,
    each once, in first-seen order; ``v`` owns ``buf[indptr[v] + out_ptr[v]:
    indptr[v+1] + out_ptr[v+1]]``. One stamp array per block of vertices
    (stamp = the vertex being processed) finds duplicates without sorting or
    resetting; blocks are balanced by arc count so hubs do not serialise.
    """
    n = indptr.shape[0] - 1
    for b in numba.prange(blocks.shape[0] - 1):
        mark = np.full(n, -1, dtype=buf.dtype)
        for v in range(blocks[b], blocks[b + 1]):
            mark[v] = v
            base = indptr[v] + out_ptr[v]
            c = 0
            for e in range(indptr[v], indptr[v + 1]):
                u = indices[e]
                if mark[u] != v:
                    mark[u] = v
                    buf[base + c] = u
                    c += 1
            for e in range(out_ptr[v], out_ptr[v + 1]):
                u = out_idx[e]
                if mark[u] != v:
                    mark[u] = v
                    buf[base + c] = u
                    c += 1
            counts[v] = c


@numba.njit(parallel=True, cache=True)
def _compact(indptr, out_ptr, buf, xadj, adjncy):
    n = indptr.shape[0] - 1
    for v in numba.prange(n):
        base = indptr[v] + out_ptr[v]
        o = xadj[v]
        for t in range(xadj[v + 1] - o):
            adjncy[o + t] = buf[base + t]


def symmetric_csr(indptr: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Undirected simple graph of a directed CSC, as METIS wants it.

    Vertex ``v``'s neighbours are :math:`(N_{in}(v) \cup N_{out}(v)) \setminus \{v\}`,
    without duplicates (in first-seen order, not sorted), so every undirected
    edge appears as exactly two arcs.

    Args:
        indptr: in-edge CSC offsets (int64, ``N + 1``).
        indices: source of each in-edge (int32 or int64).

    Returns:
        ``(xadj, adjncy)``, both int64 (METIS' 64-bit ``idx_t``).
    """
    n = indptr.shape[0] - 1
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    indices = np.ascontiguousarray(indices)
    out_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(indices, minlength=n), out=out_ptr[1:])
    out_idx = _out_lists(indptr, indices, out_ptr)
    # Blocks of about equal arc count, a few per thread.
    num_blocks = max(1, min(n, 4 * numba.get_num_threads()))
    arcs = indptr + out_ptr
    targets = np.linspace(0, arcs[-1], num_blocks + 1)[1:-1]
    blocks = np.concatenate(([0], np.searchsorted(arcs, targets), [n])).astype(np.int64)
    buf = np.empty(int(arcs[-1]), dtype=indices.dtype)
    counts = np.empty(n, dtype=np.int64)
    _sym_neighbours(indptr, indices, out_ptr, out_idx, blocks, buf, counts)
    del out_idx
    xadj = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=xadj[1:])
    adjncy = np.empty(int(xadj[-1]), dtype=np.int64)
    _compact(indptr, out_ptr, buf, xadj, adjncy)
    return xadj, adjncy


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
    if num_groups >= threads or values.shape[0] < _graph_kernels.SERIAL_BELOW:
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
    pieces = max(1, min(-(-2 * threads // num_groups), room))
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


def distinct_sources(indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray,
                     bounds: np.ndarray) -> np.ndarray:
    r"""Number of distinct in-neighbours :math:`|N(R)|` of each vertex range.

    Range ``r`` holds the destinations ``perm[bounds[r]:bounds[r+1]]``
    (original ids), i.e. a contiguous range of renumbered ids.

    Args:
        indptr: in-edge CSC offsets of the original graph.
        indices: sources of the in-edges of the original graph.
        perm: new id -> original id.
        bounds: int64 range boundaries over new ids (``R + 1``).

    Returns:
        int64 array of ``R`` counts.
    """
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    perm = np.ascontiguousarray(perm, dtype=np.int64)
    # Range r is the union of the in-edge segments of its vertices, in perm order.
    return unique_union(indices, bounds, indptr[perm], indptr[perm + 1], indptr.shape[0] - 1)


@numba.njit(parallel=True, cache=True)
def _cut_edges(indptr, indices, part, blocks, partial):
    # Per-block sums instead of a prange scalar reduction, which some numba
    # versions fail to compile here ("unexpected cycle in lookup()").
    for b in numba.prange(blocks.shape[0] - 1):
        c = 0
        for v in range(blocks[b], blocks[b + 1]):
            p = part[v]
            for e in range(indptr[v], indptr[v + 1]):
                if part[indices[e]] != p:
                    c += 1
        partial[b] = c


def count_cut_edges(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray) -> int:
    """Number of edges whose source and destination lie in different parts."""
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    n = indptr.shape[0] - 1
    num_blocks = max(1, min(n, 4 * numba.get_num_threads()))
    targets = np.linspace(0, indptr[-1], num_blocks + 1)[1:-1]
    blocks = np.concatenate(([0], np.searchsorted(indptr, targets), [n])).astype(np.int64)
    partial = np.zeros(num_blocks, dtype=np.int64)
    _cut_edges(indptr, np.ascontiguousarray(indices), np.ascontiguousarray(part), blocks, partial)
    return int(partial.sum())
