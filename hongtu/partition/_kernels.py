r"""numba kernels of the partitioner: symmetrisation and partition statistics.

All kernels read the in-edge CSC of :class:`~hongtu.graph.Graph` directly
(``indptr`` int64, ``indices`` int32 or int64) and never build a dense or
``E``-sized temporary in Python, so they stay linear in memory and time on
graphs with tens of millions of edges.
"""

from __future__ import annotations

import numba
import numpy as np

from hongtu.graph._kernels import unique_union

__all__ = ["count_cut_edges", "distinct_sources", "symmetric_csr"]


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
