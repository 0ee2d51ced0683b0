r"""Neighbour sets, transition sets and the three transfer volumes (HongTu §5).

All functions take the *renumbered* graph (chunk ``c = i*n + j`` is the id
range ``chunk_ptr[c]:chunk_ptr[c+1]``) and return plain arrays. Sets are
stored as CSR: set ``c`` is ``ids[ptr[c]:ptr[c+1]]``, sorted and unique.

With ``T_k = ∪_i N_{order[k,i]}`` the transition set of batch ``k``:

.. math::

    V_{ori} = \sum_k \sum_i |N_{order[k,i]}|, \quad
    V_{+p2p} = \sum_k |T_k|, \quad
    V_{+ru} = \sum_k |T_k \setminus T_{k-1}|

(``T_{-1} = ∅``). ``V_{+ru}`` does not depend on how rows are split over
devices: the owners' pieces of ``T_k`` are disjoint, so the per-device
differences add up to the difference of the unions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from hongtu.dedup import _kernels as K
from hongtu.errors import UserError
from hongtu.graph._kernels import unique_union

__all__ = ["Volumes", "check_order", "consecutive_overlaps", "identity_order", "neighbour_sets",
           "transfer_volumes", "transition_sets", "union_sets"]


def union_sets(values: np.ndarray, gptr: np.ndarray, seg_start: np.ndarray,
               seg_stop: np.ndarray, num_nodes: int,
               presorted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    r"""Sorted unique union of groups of segments of ``values``.

    Args:
        values: ids in ``[0, num_nodes)``.
        gptr: int64 ``(G + 1,)``; group ``g`` is segments ``gptr[g]:gptr[g+1]``.
        seg_start, seg_stop: int64 bounds of each segment in ``values``.
        num_nodes: ``|V|``.
        presorted: every segment is sorted and unique: merge them (sequential
            reads) instead of marking them in a ``|V|``-bit bitmap.

    Returns:
        ``(ptr, ids)``: CSR of the ``G`` unions, ``ids`` of ``values``' dtype.
    """
    gptr = np.ascontiguousarray(gptr, dtype=np.int64)
    seg_start = np.ascontiguousarray(seg_start, dtype=np.int64)
    seg_stop = np.ascontiguousarray(seg_stop, dtype=np.int64)
    values = np.ascontiguousarray(values)
    num_groups = gptr.shape[0] - 1
    counts = np.zeros(num_groups, dtype=np.int64)
    ptr = np.zeros(num_groups + 1, dtype=np.int64)
    if num_groups == 0 or values.shape[0] == 0:
        return ptr, np.empty(0, dtype=values.dtype)
    if presorted and np.all(gptr[1:] - gptr[:-1] == 1):  # one set per group: a copy
        return gather_segments_csr(values, seg_start[gptr[:-1]], seg_stop[gptr[:-1]])
    if presorted:
        # (cut into pieces by value where the groups are fewer than the tasks wanted)
        pieces = _merge_pieces(values, gptr, seg_start, seg_stop)
        if pieces is not None:
            gptr, seg_start, seg_stop, per = pieces
            counts = np.zeros(gptr.shape[0] - 1, dtype=np.int64)
            ptr = np.zeros(gptr.shape[0], dtype=np.int64)
        K.merge_sorted(values, gptr, seg_start, seg_stop, ptr, values[:0], counts)
        np.cumsum(counts, out=ptr[1:])
        ids = np.empty(int(ptr[-1]), dtype=values.dtype)
        if ids.size:
            K.merge_sorted(values, gptr, seg_start, seg_stop, ptr, ids, counts)
        return (ptr[::per].copy() if pieces is not None else ptr), ids
    return unique_union(values, gptr, seg_start, seg_stop, num_nodes, sets=True)



def gather_segments_csr(vals: np.ndarray, start: np.ndarray, stop: np.ndarray,
                        dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """``(ptr, flat)``: the segments ``vals[start[q]:stop[q]]`` concatenated, as CSR."""
    start = np.ascontiguousarray(start, dtype=np.int64)
    stop = np.ascontiguousarray(stop, dtype=np.int64)
    ptr = np.zeros(start.shape[0] + 1, dtype=np.int64)
    np.cumsum(stop - start, out=ptr[1:])
    out = np.empty(int(ptr[-1]), dtype=dtype or vals.dtype)
    if start.shape[0]:
        K.gather_segments(vals, start, stop, ptr, out)
    return ptr, out


#: The presorted union cuts its groups into pieces of at least this many ids
#: where they are fewer than four tasks per thread (a few batches of many rows:
#: the transition sets of several parts), :func:`_merge_pieces`.
MERGE_PIECE = 1 << 16


def _merge_pieces(values, gptr, seg_start, seg_stop):
    """Groups of sorted segments cut into ``P`` pieces each, by the values at
    equal steps of the group's longest segment: ``(gptr, seg_start, seg_stop,
    P)`` of the ``G * P`` pieces in group-major, value order (piece ``k`` of a
    group holds every segment's values from the ``k``-th cut to the next, so
    the pieces' unions laid end to end are the group's), or ``None`` where one
    piece a group is enough."""
    num_groups = gptr.shape[0] - 1
    lengths = seg_stop - seg_start
    ends = np.concatenate([[0], np.cumsum(lengths)])
    most = int((ends[gptr[1:]] - ends[gptr[:-1]]).max())
    per = min(-(-4 * numba.get_num_threads() // num_groups), most // MERGE_PIECE)
    if per <= 1:
        return None
    starts, stops = [], []
    for g in range(num_groups):
        a, b = int(gptr[g]), int(gptr[g + 1])
        if a == b:
            continue
        top = a + int(np.argmax(lengths[a:b]))
        cut = values[seg_start[top] + lengths[top] * np.arange(1, per) // per]
        bounds = np.empty((b - a, per + 1), dtype=np.int64)  # [segment, cut]
        bounds[:, 0], bounds[:, -1] = seg_start[a:b], seg_stop[a:b]
        for i in range(b - a):
            x, y = int(seg_start[a + i]), int(seg_stop[a + i])
            bounds[i, 1:-1] = x + np.searchsorted(values[x:y], cut)
        starts.append(bounds[:, :-1].T.ravel())  # (piece-major within the group)
        stops.append(bounds[:, 1:].T.ravel())
    sizes = np.repeat(np.diff(gptr), per)
    new_gptr = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_gptr[1:])
    return new_gptr, np.concatenate(starts), np.concatenate(stops), per


def neighbour_sets(indptr: np.ndarray, indices: np.ndarray, chunk_ptr: np.ndarray,
                   counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The neighbour set :math:`N_c` of every chunk, as CSR.

    :math:`N_c` is the sorted set of distinct sources of the in-edges of
    chunk ``c``, i.e. ``np.unique(indices[indptr[a]:indptr[b]])`` with
    ``a, b = chunk_ptr[c], chunk_ptr[c+1]`` (the ``src_ids`` of its Block).

    Args:
        indptr: int64 in-edge CSC offsets of the renumbered graph (``|V|+1``).
        indices: sources of the in-edges (int32 or int64).
        chunk_ptr: int64 chunk boundaries (``m*n + 1``).
        counts: the sets' sizes when known (e.g. the memory planner's
            ``num_src`` of this chunking): saves a pass over the edges.

    Returns:
        ``(ptr, ids)``: ``ptr`` int64 ``(m*n + 1,)``, ``ids`` of ``indices``' dtype.

    Example::

        >>> ptr, ids = neighbour_sets(g.indptr, g.indices, p.chunk_ptr)
        >>> ids[ptr[3]:ptr[4]]          # N of chunk 3
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    chunk_ptr = np.asarray(chunk_ptr, dtype=np.int64)
    num_nodes = indptr.shape[0] - 1
    if chunk_ptr[0] != 0 or chunk_ptr[-1] != num_nodes or np.any(np.diff(chunk_ptr) < 0):
        raise ValueError(f"chunk_ptr must rise from 0 to {num_nodes}, got "
                         f"{chunk_ptr[0]}..{chunk_ptr[-1]}")
    num_chunks = chunk_ptr.shape[0] - 1
    edges = indptr[chunk_ptr]
    gptr = np.arange(num_chunks + 1, dtype=np.int64)
    return unique_union(indices, gptr, edges[:-1], edges[1:], num_nodes, sets=True,
                        seg_ptr=edges - edges[0], counts=counts)


def identity_order(num_parts: int, num_chunks: int) -> np.ndarray:
    """``order[k, i] = i*n + k``: batch ``k`` is chunk ``k`` of every part."""
    return (np.arange(num_parts, dtype=np.int64)[None, :] * num_chunks
            + np.arange(num_chunks, dtype=np.int64)[:, None])


def check_order(order: np.ndarray | None, num_parts: int, num_chunks: int) -> np.ndarray:
    """Validate a batch order (``None`` = identity) and return it as int64.

    Raises:
        UserError: wrong shape, a chunk in the wrong part's column, or a
            chunk missing or repeated.
    """
    if order is None:
        return identity_order(num_parts, num_chunks)
    order = np.asarray(order, dtype=np.int64)
    m, n = num_parts, num_chunks
    if order.shape != (n, m):
        raise UserError(f"batch order has shape {order.shape}, expected ({n}, {m}) "
                        "(one row per batch, one column per part)")
    part = np.arange(m, dtype=np.int64)[None, :]
    if np.any(order < part * n) or np.any(order >= (part + 1) * n):
        raise UserError("batch order puts a chunk in another part's column: column i must "
                        f"hold chunk ids i*{n} .. i*{n}+{n - 1}")
    if not np.array_equal(np.sort(order.ravel()), np.arange(m * n)):
        raise UserError("batch order must list every chunk exactly once")
    return order


def transition_sets(nb_ptr: np.ndarray, nb_ids: np.ndarray, order: np.ndarray,
                    num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    r"""CSR of the transition sets :math:`T_k = \bigcup_i N_{order[k,i]}`, one per batch.

    With one part in its own order these are the neighbour sets themselves
    (the same arrays, not a copy).
    """
    order = np.asarray(order, dtype=np.int64)
    flat = order.ravel()
    if order.shape[1] == 1 and np.array_equal(flat, np.arange(flat.shape[0])):
        return nb_ptr, nb_ids
    gptr = np.arange(0, flat.shape[0] + 1, max(1, order.shape[1]), dtype=np.int64)
    return union_sets(nb_ids, gptr, nb_ptr[flat], nb_ptr[flat + 1], num_nodes, presorted=True)


def consecutive_overlaps(t_ptr: np.ndarray, t_ids: np.ndarray,
                         rows: np.ndarray | None = None) -> np.ndarray:
    r"""``|T_k ∩ T_{k-1}|`` for ``k = 1 .. K-1`` (int64, ``K - 1`` values).

    Args:
        t_ptr, t_ids: CSR of the transition sets.
        rows: optional batch permutation: batch ``k`` is set ``rows[k]``.
    """
    starts = np.ascontiguousarray(t_ptr[:-1], dtype=np.int64)
    stops = np.ascontiguousarray(t_ptr[1:], dtype=np.int64)
    if rows is not None:
        starts, stops = starts[rows], stops[rows]
    num = max(0, starts.shape[0] - 1)
    out = np.zeros(num, dtype=np.int64)
    if num:
        K.intersect_counts(t_ids, starts[1:], stops[1:], t_ids, starts[:-1], stops[:-1], out)
    return out


@dataclass(frozen=True)
class Volumes:
    r"""Rows moved per pass under the three dedup levels (paper Table 8).

    Args:
        v_ori: rows loaded when every chunk loads its own neighbours.
        v_p2p: rows loaded from host when a batch shares rows (p2p), no reuse.
        v_ru: rows loaded from host with p2p and in-place reuse.
        num_nodes: ``|V|``, for normalising.
        row_bytes: bytes per row, or ``None``.
    """

    v_ori: int
    v_p2p: int
    v_ru: int
    num_nodes: int = 0
    row_bytes: int | None = None

    def normalised(self) -> dict[str, float]:
        """``V_ori``, ``V_ori − V_+p2p``, ``V_+p2p − V_+ru`` and ``V_+ru`` over ``|V|``."""
        n = max(1, self.num_nodes)
        return {"v_ori": self.v_ori / n, "p2p_saved": (self.v_ori - self.v_p2p) / n,
                "ru_saved": (self.v_p2p - self.v_ru) / n, "v_ru": self.v_ru / n}


def transfer_volumes(nb_ptr: np.ndarray, nb_ids: np.ndarray, order: np.ndarray,
                     num_nodes: int, row_bytes: int | None = None,
                     transitions: tuple[np.ndarray, np.ndarray] | None = None,
                     rows: np.ndarray | None = None,
                     overlaps: np.ndarray | None = None) -> Volumes:
    """:class:`Volumes` of a batch order, from the neighbour sets.

    Args:
        nb_ptr, nb_ids: :func:`neighbour_sets` of the graph.
        order: ``(num_batches, m)`` batch order (see :func:`check_order`).
        num_nodes: ``|V|``.
        row_bytes: recorded in the result.
        transitions: precomputed :func:`transition_sets`: of ``order`` itself,
            or, with ``rows``, of an order whose rows ``rows`` give ``order``
            (``order = base[rows]``), so a reordering needs no new unions.
        rows: see ``transitions``.
        overlaps: precomputed :func:`consecutive_overlaps` of the batches.
    """
    if transitions is None:
        if rows is not None:
            raise ValueError("rows needs the transitions of the base order")
        transitions = transition_sets(nb_ptr, nb_ids, order, num_nodes)
    t_ptr, t_ids = transitions
    v_p2p = int(t_ptr[-1])
    if overlaps is None:
        overlaps = consecutive_overlaps(t_ptr, t_ids, rows)
    v_ru = v_p2p - int(overlaps.sum())
    return Volumes(v_ori=int(nb_ptr[-1]), v_p2p=v_p2p, v_ru=v_ru, num_nodes=int(num_nodes),
                   row_bytes=row_bytes)
