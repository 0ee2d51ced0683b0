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

__all__ = ["RangeSources", "count_cut_edges", "distinct_sources", "symmetric_csr"]


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


def count_unique_groups(values, gptr, seg_start, seg_stop, num_nodes, workers, counts):
    """``counts[g]`` = number of distinct values in the segments of group ``g``.

    Group ``g`` is the union of segments ``values[seg_start[s]:seg_stop[s]]``
    for ``s`` in ``gptr[g]:gptr[g+1]``. One stamp array per worker (stamp =
    group id) finds repeats without any reset; groups are dealt to workers
    round-robin. Needs ``num_groups < 2**31``. Plain Python here: compiled
    below for the partitioner and by :mod:`hongtu.dedup` for the planner.
    """
    num_groups = gptr.shape[0] - 1
    for w in numba.prange(workers):
        mark = np.full(num_nodes, -1, dtype=np.int32)
        for g in range(w, num_groups, workers):
            c = 0
            for s in range(gptr[g], gptr[g + 1]):
                for e in range(seg_start[s], seg_stop[s]):
                    u = values[e]
                    if mark[u] != g:
                        mark[u] = g
                        c += 1
            counts[g] = c


_count_unique = numba.njit(parallel=True, cache=True)(count_unique_groups)


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
    num_ranges = int(bounds.shape[0] - 1)
    out = np.zeros(num_ranges, dtype=np.int64)
    if num_ranges == 0:
        return out
    threads = numba.get_num_threads()
    workers = max(1, min(num_ranges, threads))
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    perm = np.ascontiguousarray(perm, dtype=np.int64)
    indices = np.ascontiguousarray(indices)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    # Range r is the union of the in-edge segments of its vertices, in perm order.
    if 2 * num_ranges <= threads:  # few, large ranges: all threads on each in turn
        _count_unique_few(indices, bounds, indptr[perm], indptr[perm + 1],
                          indptr.shape[0] - 1, threads, out)
    else:
        _count_unique(indices, bounds, indptr[perm], indptr[perm + 1], indptr.shape[0] - 1,
                      workers, out)
    return out


@numba.njit(parallel=True, cache=True)
def _count_unique_few(values, gptr, seg_start, seg_stop, num_nodes, workers, counts):
    """:func:`count_unique_groups` for fewer groups than threads: every thread
    stamps a share of one group's segments into one shared array (all write
    the same stamp, so the order of writes does not matter), then the stamps
    are counted in parallel."""
    mark = np.full(num_nodes, -1, dtype=np.int32)
    part = np.zeros(workers, dtype=np.int64)
    for g in range(gptr.shape[0] - 1):
        a, b = gptr[g], gptr[g + 1]
        step = (b - a + workers - 1) // workers
        for w in numba.prange(workers):
            for s in range(a + w * step, min(b, a + (w + 1) * step)):
                for e in range(seg_start[s], seg_stop[s]):
                    mark[values[e]] = g
        rows = (num_nodes + workers - 1) // workers
        for w in numba.prange(workers):
            c = 0
            for u in range(w * rows, min(num_nodes, (w + 1) * rows)):
                if mark[u] == g:
                    c += 1
            part[w] = c
        counts[g] = part.sum()


_LAST_USE_BYTES = 2 << 30  # RangeSources' per-block scratch, all blocks together


class RangeSources:
    r"""Distinct in-neighbours of any contiguous ranges of one renumbering.

    One pass over the edges records, for every edge in renumbered destination
    order, the last earlier destination with the same source (``prev``); an
    edge then brings a new source into a range ``[a, b)`` exactly when its
    ``prev`` lies before ``a``. So the counts of any cut of the ids into
    ranges (every chunk count the memory planner tries) are one sequential
    scan of ``prev`` instead of a pass of random accesses each. Equal to
    :func:`distinct_sources` (duplicate edges and self-loops included).

    Args:
        indptr, indices: in-edge CSC of the original graph.
        perm: new id -> original id.
        edge_ptr: running in-edge count over ``perm`` order (``N + 1``, ``0``
            first); computed when ``None``.
        blocks: destination blocks scanned in parallel (default: one per thread).

    Memory: one ``E``-long ``prev`` (int32 below 2^31 vertices) and, while it
    is built, one ``N``-long array per block (blocks capped so these stay
    within 2 GiB).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray,
                 edge_ptr: np.ndarray | None = None, blocks: int | None = None) -> None:
        indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        perm = np.ascontiguousarray(perm, dtype=np.int64)
        n = perm.shape[0]
        if edge_ptr is None:
            edge_ptr = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.diff(indptr)[perm], out=edge_ptr[1:])
        self.edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
        dtype = np.int32 if n < 2**31 - 1 else np.int64
        cap = max(1, _LAST_USE_BYTES // max(1, n * np.dtype(dtype).itemsize))
        blocks = max(1, min(n, cap, blocks or numba.get_num_threads()))
        self.blocks = blocks
        targets = np.linspace(0, self.edge_ptr[-1], blocks + 1)[1:-1]
        vblocks = np.concatenate(([0], np.searchsorted(self.edge_ptr, targets), [n]))
        last = np.empty((blocks, n), dtype=dtype)  # filled with -1 by the threads
        self.prev = np.empty(int(self.edge_ptr[-1]), dtype=dtype)
        _previous_uses(np.ascontiguousarray(indices), indptr[perm], self.edge_ptr,
                       vblocks.astype(np.int64), last, self.prev)

    def __call__(self, bounds: np.ndarray) -> np.ndarray:
        """int64 count of distinct sources of each range ``[bounds[r], bounds[r+1])``."""
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        ranges = bounds.shape[0] - 1
        if ranges <= 0:
            return np.zeros(max(ranges, 0), dtype=np.int64)
        pieces = self._pieces(ranges)
        return self._partial(bounds, pieces).reshape(ranges, pieces).sum(axis=1)

    def _pieces(self, ranges: int) -> int:
        return max(1, -(-2 * numba.get_num_threads() // ranges))

    def _partial(self, bounds: np.ndarray, pieces: int) -> np.ndarray:
        partial = np.empty((bounds.shape[0] - 1) * pieces, dtype=np.int64)
        _new_sources(self.prev, self.edge_ptr, bounds, pieces, self.prev[:0], partial,
                     self.prev[:0])
        return partial

    def sets(self, bounds: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct sources of each range themselves, sorted, as CSR ``(ptr, ids)``.

        ``indices`` are the sources of the renumbered graph (new ids), edge
        for edge in this renumbering's order (:meth:`Graph.permute` keeps
        each destination's edges in order), so the result is
        :func:`~hongtu.dedup.neighbour_sets` of that graph: the edges that
        bring a new source into their range are taken, then sorted, without
        a pass of random accesses over all edges.
        """
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        indices = np.ascontiguousarray(indices)
        if indices.shape != self.prev.shape:
            raise ValueError(f"{indices.shape[0]} sources given for the {self.prev.shape[0]} "
                             "edges of this renumbering")
        ranges = bounds.shape[0] - 1
        pieces = self._pieces(max(ranges, 1))
        offsets = np.zeros(ranges * pieces + 1, dtype=np.int64)
        np.cumsum(self._partial(bounds, pieces), out=offsets[1:])
        ids = np.empty(int(offsets[-1]), dtype=indices.dtype)
        if ids.size:
            _new_sources(self.prev, self.edge_ptr, bounds, pieces, indices, offsets, ids)
        ptr = offsets[::pieces].copy()
        workers = max(1, min(ranges, numba.get_num_threads()))
        _sort_segments(ids, ptr, self.edge_ptr.shape[0] - 1, workers)
        return ptr, ids


@numba.njit(parallel=True, cache=True)
def _previous_uses(indices, seg_start, edge_ptr, vblocks, last, prev):
    """``prev[e]``: the last destination before ``e``'s with ``e``'s source, or ``-1``.

    Each thread scans a block of destinations with its own ``last`` row; then
    every row becomes the last use before its block (a running max over the
    blocks, per vertex), and edges without a use inside their block take it.
    """
    blocks, n = last.shape
    for t in numba.prange(blocks):
        mine = last[t]
        mine[:] = -1
        for v in range(vblocks[t], vblocks[t + 1]):
            s = seg_start[v]
            for k in range(edge_ptr[v + 1] - edge_ptr[v]):
                u = indices[s + k]
                prev[edge_ptr[v] + k] = mine[u]
                mine[u] = v
    step = 4096
    for b in numba.prange((n + step - 1) // step):
        for u in range(b * step, min(n, (b + 1) * step)):
            run = -1
            for t in range(blocks):
                x = last[t, u]
                last[t, u] = run
                if x >= 0:
                    run = x
    for t in numba.prange(1, blocks):
        before = last[t]
        for v in range(vblocks[t], vblocks[t + 1]):
            s = seg_start[v]
            for k in range(edge_ptr[v + 1] - edge_ptr[v]):
                e = edge_ptr[v] + k
                if prev[e] < 0:
                    prev[e] = before[indices[s + k]]


@numba.njit(parallel=True, cache=True)
def _new_sources(prev, edge_ptr, bounds, pieces, indices, at, out):
    """The edges of range ``c`` whose source was not used earlier in it, in ``pieces``
    parts each: counted into ``at[it]`` (``out`` empty), or their ``indices``
    written to ``out`` from ``at[it]`` on."""
    write = out.shape[0] > 0
    for it in numba.prange(bounds.shape[0] * pieces - pieces):
        c, k = it // pieces, it % pieces
        a = bounds[c]
        e0, e1 = edge_ptr[a], edge_ptr[bounds[c + 1]]
        step = (e1 - e0 + pieces - 1) // pieces
        lo = e0 + k * step
        o = at[it] if write else 0
        for e in range(lo, min(e1, lo + step)):
            if prev[e] < a:
                if write:
                    out[o] = indices[e]
                o += 1
        if not write:
            at[it] = o


@numba.njit(cache=True)
def sort_distinct(out, o, cnt, lo, hi, flag, flagged):
    """Sort the distinct ids ``out[o:o+cnt]`` (all in ``[lo, hi]``) in place.

    When ``[lo, hi]`` is small next to ``k log k`` the ids are re-emitted in
    order by scanning ``flag`` over it, else sorted. ``flagged``: ``flag``
    is already set at exactly these ids; it is left clear either way.
    """
    if hi - lo + 1 <= 2.0 * cnt * (math.log2(max(cnt, 1)) + 1.0):
        if not flagged:
            for t in range(o, o + cnt):
                flag[out[t]] = 1
        k = o
        for u in range(lo, hi + 1):
            if flag[u] != 0:
                flag[u] = 0
                out[k] = u
                k += 1
    else:
        if flagged:
            for t in range(o, o + cnt):
                flag[out[t]] = 0
        out[o:o + cnt].sort()


@numba.njit(parallel=True, cache=True)
def _sort_segments(ids, ptr, num_nodes, workers):
    """Sort every segment ``ids[ptr[r]:ptr[r+1]]`` of distinct ids (segments dealt to workers)."""
    num = ptr.shape[0] - 1
    for w in numba.prange(workers):
        flag = np.zeros(num_nodes, dtype=np.uint8)
        for r in range(w, num, workers):
            o, cnt = ptr[r], ptr[r + 1] - ptr[r]
            if cnt > 0:
                seg = ids[o:o + cnt]
                sort_distinct(ids, o, cnt, seg.min(), seg.max(), flag, False)


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
