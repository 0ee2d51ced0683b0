r"""Structural and feature transforms on a :class:`~hongtu.graph.Graph`.

Every transform returns a new :class:`Graph` and leaves its input untouched
(vertex data arrays are shared, not copied, unless the transform rewrites
them). The structure is the in-edge CSC, so all kernels work one destination
segment at a time, in parallel with numba; nothing here sorts a global edge
array, which keeps the transforms linear-ish at tens of millions of edges.

Order of sources inside a destination segment:

- :func:`to_undirected` and :func:`add_self_loops` return every segment
  sorted ascending (they sort segments that are not sorted yet);
- :func:`remove_self_loops` keeps the input order, so sorted stays sorted.

Example::

    >>> g = Graph.from_edge_index(np.array([[0, 1, 1], [1, 2, 2]]), num_nodes=3)
    >>> to_undirected(g).edge_index().tolist()
    [[1, 0, 2, 1], [0, 1, 1, 2]]
"""

from __future__ import annotations

from dataclasses import replace

import numba
import numpy as np

from hongtu.graph.graph import Graph, index_dtype

__all__ = ["add_self_loops", "has_self_loops", "normalize_features", "remove_self_loops",
           "to_undirected"]

# Rows per slab when streaming features: ~64 MiB of float32 at a time, so a
# memory-mapped ``x`` is never pulled into memory whole.
_SLAB_ELEMENTS = 1 << 24


# ------------------------------------------------------------------ kernels
@numba.njit(parallel=True, cache=True)
def _count_unsorted(indptr, indices):
    bad = 0
    for v in numba.prange(indptr.shape[0] - 1):
        for k in range(indptr[v] + 1, indptr[v + 1]):
            if indices[k] < indices[k - 1]:
                bad += 1
                break
    return bad


@numba.njit(parallel=True, cache=True)
def _sort_segments(indptr, indices):
    for v in numba.prange(indptr.shape[0] - 1):
        s = indptr[v]
        e = indptr[v + 1]
        if e - s > 1:
            indices[s:e].sort()


@numba.njit(cache=True)
def _transpose_fill(indptr, indices, tptr, out):
    """Fill the transpose of a CSR: ``out[tptr[s]:tptr[s+1]]`` = the rows listing ``s``.

    ``tptr`` holds the transpose's offsets (counts of each ``s``, cumulated).
    """
    # Walking destinations in ascending order makes each reversed segment sorted.
    cursor = tptr[:-1].copy()
    for v in range(indptr.shape[0] - 1):
        for k in range(indptr[v], indptr[v + 1]):
            s = indices[k]
            out[cursor[s]] = v
            cursor[s] += 1


@numba.njit(parallel=True, cache=True)
def _merge_unique(aptr, a, bptr, b, counts, outptr, out, fill):
    """Union of two sorted lists per vertex, duplicates dropped.

    With ``fill`` false only ``counts`` is written; with ``fill`` true the
    union is written to ``out`` at ``outptr``.
    """
    for v in numba.prange(aptr.shape[0] - 1):
        i = aptr[v]
        ie = aptr[v + 1]
        j = bptr[v]
        je = bptr[v + 1]
        o = outptr[v]
        c = 0
        last = -1
        while i < ie or j < je:
            if j >= je or (i < ie and a[i] <= b[j]):
                val = np.int64(a[i])
                i += 1
            else:
                val = np.int64(b[j])
                j += 1
            if c == 0 or val != last:
                if fill:
                    out[o + c] = val
                c += 1
                last = val
        counts[v] = c


@numba.njit(parallel=True, cache=True)
def _self_loop_counts(indptr, indices, counts):
    for v in numba.prange(indptr.shape[0] - 1):
        c = 0
        for k in range(indptr[v], indptr[v + 1]):
            if indices[k] != v:
                c += 1
        counts[v] = c


@numba.njit(parallel=True, cache=True)
def _missing_self_loops(indptr, indices):
    missing = 0
    for v in numba.prange(indptr.shape[0] - 1):
        found = 0
        for k in range(indptr[v], indptr[v + 1]):
            if indices[k] == v:
                found = 1
                break
        missing += 1 - found
    return missing


@numba.njit(parallel=True, cache=True)
def _drop_self_loops(indptr, indices, outptr, out, add_one):
    # Sources stay in input order; with add_one the loop goes before the
    # first larger source, which is its sorted place in a sorted segment.
    for v in numba.prange(indptr.shape[0] - 1):
        o = outptr[v]
        placed = not add_one
        for k in range(indptr[v], indptr[v + 1]):
            s = indices[k]
            if s == v:
                continue
            if not placed and s > v:
                out[o] = v
                o += 1
                placed = True
            out[o] = s
            o += 1
        if not placed:
            out[o] = v


# ---------------------------------------------------------------- helpers
def _indptr_from_counts(counts: np.ndarray) -> np.ndarray:
    indptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr


def _sorted_indices(graph: Graph) -> np.ndarray:
    """``graph.indices`` with every segment sorted (the input if already so)."""
    indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
    indices = np.ascontiguousarray(graph.indices)
    if graph.num_edges and _count_unsorted(indptr, indices):
        indices = indices.copy()
        _sort_segments(indptr, indices)
    return indices


def _with_structure(graph: Graph, indptr: np.ndarray, indices: np.ndarray) -> Graph:
    return replace(graph, indptr=indptr, indices=indices, _fingerprint=None)


def _transpose(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """Out-edge CSR of ``graph``: ``(indptr, indices)`` with sorted segments.

    The out-neighbours (destinations) of ``u`` are ``indices[indptr[u]:indptr[u+1]]``,
    ascending; multi-edges appear as often as in the input.
    """
    n = graph.num_nodes
    indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
    tptr = _indptr_from_counts(graph.out_degree())
    out = np.empty(graph.num_edges, dtype=index_dtype(n))
    _transpose_fill(indptr, np.ascontiguousarray(graph.indices), tptr, out)
    return tptr, out


# ------------------------------------------------------------- transforms
def to_undirected(graph: Graph) -> Graph:
    r"""Add the reverse of every edge and drop duplicate edges.

    The result has edge :math:`(u, v)` iff the input has :math:`(u, v)` or
    :math:`(v, u)`, each exactly once; self-loops are kept (once). Sources of
    each destination come out sorted ascending.

    Args:
        graph: any graph; its vertex data is shared with the result.

    Returns:
        A symmetric graph with the same vertices and vertex data.
    """
    n = graph.num_nodes
    indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
    indices = _sorted_indices(graph)
    tptr, tidx = _transpose(graph)
    counts = np.empty(n, dtype=np.int64)
    dummy = np.empty(0, dtype=index_dtype(n))
    _merge_unique(indptr, indices, tptr, tidx, counts, indptr, dummy, False)
    new_ptr = _indptr_from_counts(counts)
    out = np.empty(int(new_ptr[-1]), dtype=index_dtype(n))
    _merge_unique(indptr, indices, tptr, tidx, counts, new_ptr, out, True)
    return _with_structure(graph, new_ptr, out)


def remove_self_loops(graph: Graph) -> Graph:
    """Drop every edge :math:`(v, v)`; other sources keep their order.

    Args:
        graph: any graph; its vertex data is shared with the result.

    Returns:
        The graph without self-loops.
    """
    return _rebuild_self_loops(graph, np.ascontiguousarray(graph.indices), add=False)


def add_self_loops(graph: Graph) -> Graph:
    r"""Give every vertex exactly one self-loop :math:`(v, v)`.

    Existing self-loops are dropped first, so a vertex that had two ends up
    with one; other multi-edges are kept. Sources of each destination come
    out sorted ascending.

    Args:
        graph: any graph; its vertex data is shared with the result.

    Returns:
        The graph with ``num_nodes`` self-loops.
    """
    return _rebuild_self_loops(graph, _sorted_indices(graph), add=True)


def has_self_loops(graph: Graph) -> bool:
    """Whether every vertex has a self-loop :math:`(v, v)` (then every chunk
    reads its own destinations' rows among its sources).

    Example::

        >>> g = Graph.from_edge_index(np.array([[0, 1], [1, 0]]), num_nodes=2)
        >>> has_self_loops(g), has_self_loops(add_self_loops(g))
        (False, True)
    """
    indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
    return graph.num_nodes == 0 or _missing_self_loops(indptr, graph.indices) == 0


def _rebuild_self_loops(graph: Graph, indices: np.ndarray, add: bool) -> Graph:
    n = graph.num_nodes
    indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
    counts = np.empty(n, dtype=np.int64)
    _self_loop_counts(indptr, indices, counts)
    if add:
        counts += 1
    elif int(counts.sum()) == graph.num_edges:
        return _with_structure(graph, indptr, indices)
    new_ptr = _indptr_from_counts(counts)
    out = np.empty(int(new_ptr[-1]), dtype=index_dtype(n))
    _drop_self_loops(indptr, indices, new_ptr, out, add)
    return _with_structure(graph, new_ptr, out)


def normalize_features(graph: Graph) -> Graph:
    r"""Row-normalise the features so every row sums to 1.

    .. math:: x'_{v} = x_{v} / \textstyle\sum_f x_{v,f}

    A row summing to 0 (e.g. an all-zero row) is left unchanged rather than
    divided by zero. Unlike PyG's ``NormalizeFeatures`` no minimum is
    subtracted first and a row summing to less than 1 is still scaled to 1;
    for non-negative count features such as bag-of-words the two agree.
    Rows are streamed in slabs, so a memory-mapped ``x`` is read once and the
    result is a new in-memory float32 array.

    Args:
        graph: a graph whose ``x`` is ``(N, F)``; a graph without features is
            returned as is.

    Returns:
        The graph with normalised float32 features.
    """
    x = graph.x
    if x is None:
        return graph
    n, f = x.shape
    out = np.empty((n, f), dtype=np.float32)
    step = max(1, _SLAB_ELEMENTS // max(f, 1))
    for s in range(0, n, step):
        block = np.asarray(x[s:s + step], dtype=np.float32)
        sums = block.sum(axis=1, dtype=np.float64)
        sums[sums == 0] = 1.0
        np.divide(block, sums[:, None], out=out[s:s + step], casting="unsafe")
    return replace(graph, x=out, _fingerprint=None)
