r"""Greedy two-phase chunk reorganizer and the transfer cost model (HongTu Alg. 4, Eq. 4).

The batch order decides which chunks share a transition set (phase 1: which
chunk of every part goes into which batch) and which transition sets follow
each other (phase 2: the order of the batches). Both phases are greedy:

1. (``m > 1``) part 0's chunks seed the ``n`` batches; for each further part
   the pairs (chunk, batch) are taken by decreasing
   :math:`|N_c \cap T_b|`, each chunk and each batch once, and the batches'
   transition sets grow by the chunks they get.
2. The batches are chained by nearest neighbour on
   :math:`|T_a \cap T_b|` (every start tried, or the 16 largest sets for
   many batches), keeping the chain with the largest total overlap.

Overlaps are counted by numba kernels, over an inverted index (vertex ->
sets holding it) or over bit rows of the sets, whichever does less work;
never with Python sets. The result is kept only if its
cost :func:`cost` is below the identity order's, so reorganizing never
increases :math:`C`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np

from hongtu.graph._kernels import parallel_kernel

if TYPE_CHECKING:
    from hongtu.dedup.plan import DeviceNeeds
from hongtu.dedup.sets import (
    Volumes,
    check_order,
    gather_segments_csr,
    identity_order,
    neighbour_sets,
    transfer_volumes,
    transition_sets,
)

__all__ = ["DEFAULT_ROW_BYTES", "T_DD", "T_HD", "T_RU", "ReorgResult", "cost", "group_batches",
           "order_batches", "reorganize", "reorganize_report"]

#: Host -> device throughput (B/s): GPU gather of random rows from pinned host
#: memory, measured on an H200 (DESIGN.md §3; a contiguous copy reaches 55e9).
T_HD = 21e9
#: Device <-> device throughput (B/s): NVLink peer copy on nvidia-h200-x4.
T_DD = 393e9
#: In-place reuse throughput (B/s): rows already in device memory.
T_RU = 2e12
#: Row size assumed when neither the plan nor the caller gives one (128 fp32).
DEFAULT_ROW_BYTES = 512


def cost(plan, t_hd: float = T_HD, t_dd: float = T_DD, t_ru: float = T_RU,
         row_bytes: int | None = None) -> float:
    r"""Transfer time of one pass under the paper's cost model, in seconds.

    .. math::

        C = \frac{V_{+ru}}{T_{hd}} + \frac{V_{ori} - V_{+p2p}}{T_{dd}}
            + \frac{V_{+p2p} - V_{+ru}}{T_{ru}}

    with volumes in bytes (rows times ``row_bytes``).

    Args:
        plan: anything with ``v_ori, v_p2p, v_ru`` in rows (a
            :class:`~hongtu.dedup.TransferPlan` or :class:`~hongtu.dedup.Volumes`).
        t_hd: host -> device bytes/s (default :data:`T_HD`).
        t_dd: device <-> device bytes/s (default :data:`T_DD`).
        t_ru: in-place reuse bytes/s (default :data:`T_RU`).
        row_bytes: bytes per row; default the plan's ``row_bytes``, else
            :data:`DEFAULT_ROW_BYTES`.
    """
    rb = row_bytes or getattr(plan, "row_bytes", None) or DEFAULT_ROW_BYTES
    return float(rb) * (plan.v_ru / t_hd + (plan.v_ori - plan.v_p2p) / t_dd
                        + (plan.v_p2p - plan.v_ru) / t_ru)


# ------------------------------------------------------------------ kernels
@parallel_kernel
def _inverse(ptr, ids, num_nodes, workers):
    """Vertex -> sets holding it, as CSR (sets ascending per vertex).

    Sets are sorted, so worker ``w`` handles the id range
    ``[bounds[w], bounds[w+1])`` of every set: it alone counts and writes
    those vertices' lists, without atomics.
    """
    num_sets = ptr.shape[0] - 1
    bounds = np.empty(workers + 1, dtype=np.int64)
    for w in range(workers + 1):
        bounds[w] = (num_nodes * w) // workers
    cut = np.empty((num_sets, workers + 1), dtype=np.int64)
    for s in numba.prange(num_sets):
        seg = ids[ptr[s]:ptr[s + 1]]
        for w in range(workers + 1):
            cut[s, w] = ptr[s] + np.searchsorted(seg, bounds[w])
    inv_ptr = np.zeros(num_nodes + 1, dtype=np.int64)
    for w in numba.prange(workers):
        for s in range(num_sets):
            for t in range(cut[s, w], cut[s, w + 1]):
                inv_ptr[ids[t] + 1] += 1
    for v in range(num_nodes):
        inv_ptr[v + 1] += inv_ptr[v]
    inv = np.empty(ids.shape[0], dtype=np.int64)
    for w in numba.prange(workers):
        for s in range(num_sets):
            for t in range(cut[s, w], cut[s, w + 1]):
                u = ids[t]
                # inv_ptr[u] doubles as u's cursor; restored below.
                inv[inv_ptr[u]] = s
                inv_ptr[u] += 1
    for v in range(num_nodes, 0, -1):
        inv_ptr[v] = inv_ptr[v - 1]
    inv_ptr[0] = 0
    return inv_ptr, inv


def _inverted(ptr: np.ndarray, ids: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    workers = max(1, min(num_nodes, 4 * numba.get_num_threads()))
    return _inverse(ptr, ids, num_nodes, workers)


@parallel_kernel
def _overlaps(q_ptr, q_ids, q_sel, inv_ptr, inv, out):
    """``out[r, s] = |Q_{q_sel[r]} ∩ S_s|``: one row per query set (rows in parallel)."""
    for r in numba.prange(q_sel.shape[0]):
        q = q_sel[r]
        for t in range(q_ptr[q], q_ptr[q + 1]):
            u = q_ids[t]
            for e in range(inv_ptr[u], inv_ptr[u + 1]):
                out[r, inv[e]] += 1


@parallel_kernel
def _bitsets(ptr, ids, sel, words):
    """Set ``sel[r]`` as a bit row: bit ``u`` of row ``r`` set when ``u`` is in the set."""
    bits = np.zeros((sel.shape[0], words), dtype=np.uint64)
    for r in numba.prange(sel.shape[0]):
        row = bits[r]
        for t in range(ptr[sel[r]], ptr[sel[r] + 1]):
            u = ids[t]
            row[u >> 6] |= np.uint64(1) << np.uint64(u & 63)
    return bits


@numba.njit(inline="always")
def _popcount(x):
    # The bit-parallel sum LLVM turns into the CPU's popcount instruction.
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@parallel_kernel
def _bit_overlaps(qbits, tbits, out):
    """``out[r, s]`` = common bits of ``qbits[r]`` and ``tbits[s]`` (pairs in parallel)."""
    nt = tbits.shape[0]
    for it in numba.prange(qbits.shape[0] * nt):
        r, s = it // nt, it % nt
        a, b = qbits[r], tbits[s]
        c = np.uint64(0)
        for k in range(a.shape[0]):
            c += _popcount(a[k] & b[k])
        out[r, s] = c


#: Largest bit rows (bytes) :func:`_overlap_matrix` builds for the dense method.
_BITSET_BYTES = 1 << 30


def _overlap_matrix(q_ptr, q_ids, q_sel, t_ptr, t_ids, num_nodes):
    """``out[r, s] = |Q_{q_sel[r]} ∩ T_s|`` by whichever method does less work.

    The inverted index increments one counter per (query element, target set
    holding it): :math:`\\sum_u q_u k_u` steps, which hub vertices held by
    nearly every set make large. Bit rows cost one popcount per 64 vertices
    and pair of sets, and ran ~8x more such steps per second (2-core VM);
    they are used when that is cheaper and their rows fit in 1 GiB.
    """
    q_sel = np.ascontiguousarray(q_sel, dtype=np.int64)
    nq, nt = q_sel.shape[0], t_ptr.shape[0] - 1
    out = np.zeros((nq, nt), dtype=np.int64)
    if nq == 0 or nt == 0:
        return out
    words = (num_nodes + 63) // 64
    dense = nq * nt * words
    fits = (nq + nt) * words * 8 <= _BITSET_BYTES
    same = q_ids is t_ids and q_ptr is t_ptr and nq == nt  # every set against every set
    # sum_u k_u^2 >= (sum_u k_u)^2 / |V| (k_u: sets holding u) often decides alone.
    held = int(t_ptr[-1] - t_ptr[0])
    if fits and not (same and dense < 8 * held * held / max(num_nodes, 1)):
        fits = dense < 8 * _index_steps(q_ptr, q_ids, q_sel, t_ptr, t_ids, num_nodes, same)
    if fits:
        _bit_overlaps(_bitsets(q_ptr, q_ids, q_sel, words),
                      _bitsets(t_ptr, t_ids, np.arange(nt, dtype=np.int64), words), out)
    else:
        inv_ptr, inv = _inverted(t_ptr, t_ids, num_nodes)
        _overlaps(q_ptr, q_ids, q_sel, inv_ptr, inv, out)
    return out


def _index_steps(q_ptr, q_ids, q_sel, t_ptr, t_ids, num_nodes, same) -> int:
    """Counter increments of the inverted-index method: over the query sets'
    elements, the number of target sets holding each (the sets are sorted:
    counted by vertex ranges in parallel, :func:`_held_dot`)."""
    q_sel = np.ascontiguousarray(q_sel, dtype=np.int64)
    bounds = np.linspace(0, num_nodes, max(1, min(num_nodes, 4 * numba.get_num_threads())) + 1
                         ).astype(np.int64)
    return int(_held_dot(q_ptr, q_ids, q_sel, t_ptr, t_ids, bounds, same).sum())


@numba.njit(parallel=True, cache=True)
def _held_dot(q_ptr, q_ids, q_sel, t_ptr, t_ids, bounds, same):
    """Per vertex range ``bounds[w]:bounds[w+1]``: the sum over its vertices ``u`` of
    ``k_u`` (target sets holding ``u``) times the query sets holding ``u`` (``k_u``
    again with ``same``), each set's piece of the range found by binary search."""
    out = np.zeros(bounds.shape[0] - 1, dtype=np.int64)
    for w in numba.prange(bounds.shape[0] - 1):
        r0, r1 = bounds[w], bounds[w + 1]
        k = np.zeros(r1 - r0, dtype=np.int64)
        for s in range(t_ptr.shape[0] - 1):
            seg = t_ids[t_ptr[s]:t_ptr[s + 1]]
            for j in range(np.searchsorted(seg, r0), np.searchsorted(seg, r1)):
                k[seg[j] - r0] += 1
        if same:
            out[w] = np.sum(k * k)
            continue
        kq = np.zeros(r1 - r0, dtype=np.int64)
        for r in range(q_sel.shape[0]):
            seg = q_ids[q_ptr[q_sel[r]]:q_ptr[q_sel[r] + 1]]
            for j in range(np.searchsorted(seg, r0), np.searchsorted(seg, r1)):
                kq[seg[j] - r0] += 1
        out[w] = np.sum(kq * k)
    return out


@numba.njit(cache=True)
def _greedy_match(score):
    """Greedy assignment on a square matrix: ``col[row]``, best pairs first, ties by index."""
    n = score.shape[0]
    flat = score.ravel()
    idx = np.argsort(-flat, kind="mergesort")
    col_of = np.full(n, -1, dtype=np.int64)
    used = np.zeros(n, dtype=np.bool_)
    left = n
    for t in range(idx.shape[0]):
        if left == 0:
            break
        r, c = idx[t] // n, idx[t] % n
        if col_of[r] < 0 and not used[c]:
            col_of[r] = c
            used[c] = True
            left -= 1
    return col_of


@numba.njit(cache=True)
def _nearest_chain(w, starts):
    """Best nearest-neighbour chain over ``w`` (maximise consecutive overlap)."""
    n = w.shape[0]
    best = np.arange(n)
    best_total = -1
    for s0 in starts:
        seen = np.zeros(n, dtype=np.bool_)
        path = np.empty(n, dtype=np.int64)
        path[0] = s0
        seen[s0] = True
        total = 0
        for t in range(1, n):
            last = path[t - 1]
            nxt = -1
            for b in range(n):
                if not seen[b] and (nxt < 0 or w[last, b] > w[last, nxt]):
                    nxt = b
            path[t] = nxt
            seen[nxt] = True
            total += w[last, nxt]
        if total > best_total:
            best_total = total
            best = path
    return best


# ------------------------------------------------------------------ phases
def _group(nb_ptr, nb_ids, m, n, num_nodes):
    """Phase 1; also returns the transition sets of the grouped order."""
    order = identity_order(m, n)
    t_ptr, t_ids = nb_ptr[:n + 1], nb_ids[:int(nb_ptr[n])]     # part 0 seeds the batches
    for i in range(1, m):
        score = _overlap_matrix(nb_ptr, nb_ids, np.arange(i * n, (i + 1) * n),  # [chunk, batch]
                                t_ptr, t_ids, num_nodes)
        batch_of = _greedy_match(score)
        order[batch_of, i] = i * n + np.arange(n)
        t_ptr, t_ids = transition_sets(nb_ptr, nb_ids, order[:, :i + 1], num_nodes)
    return order, (t_ptr, t_ids)


def _chain(t_ptr, t_ids, num_nodes, max_starts=16):
    """Phase 2 on given transition sets: the batch permutation, and the overlap
    matrix of the sets (``None`` when there are two or fewer)."""
    n = t_ptr.shape[0] - 1
    if n <= 2:
        return np.arange(n, dtype=np.int64), None
    w = _overlap_matrix(t_ptr, t_ids, np.arange(n), t_ptr, t_ids, num_nodes)
    by_size = np.argsort(-np.diff(t_ptr), kind="stable")
    starts = by_size if n <= 256 else by_size[:max_starts]
    return _nearest_chain(w, np.ascontiguousarray(starts, dtype=np.int64)), w


def group_batches(nb_ptr: np.ndarray, nb_ids: np.ndarray, num_parts: int, num_chunks: int,
                  num_nodes: int) -> np.ndarray:
    r"""Phase 1: a batch order whose batches share many neighbours (identity for ``m = 1``).

    Args:
        nb_ptr, nb_ids: :func:`~hongtu.dedup.neighbour_sets` of the graph.
        num_parts: ``m``.
        num_chunks: ``n``.
        num_nodes: ``|V|``.
    """
    return _group(nb_ptr, nb_ids, num_parts, num_chunks, num_nodes)[0]


def order_batches(nb_ptr: np.ndarray, nb_ids: np.ndarray, order: np.ndarray,
                  num_nodes: int, max_starts: int = 16) -> np.ndarray:
    r"""Phase 2: reorder the rows of ``order`` so consecutive transition sets overlap most.

    Args:
        nb_ptr, nb_ids: :func:`~hongtu.dedup.neighbour_sets` of the graph.
        order: ``(n, m)`` batch order whose batches are kept, reordered.
        num_nodes: ``|V|``.
        max_starts: chain starts tried when there are more than 256 batches.
    """
    t_ptr, t_ids = transition_sets(nb_ptr, nb_ids, order, num_nodes)
    return order[_chain(t_ptr, t_ids, num_nodes, max_starts)[0]]


@dataclass
class ReorgResult:
    """The chosen order, and the cost and volumes of every candidate tried.

    Args:
        order: int64 ``(n, m)`` batch order with the lowest cost.
        chosen: name of that candidate (``'identity'``, ``'order'``,
            ``'group+order'``).
        costs: seconds per pass of each candidate (:func:`cost`).
        volumes: :class:`~hongtu.dedup.Volumes` of each candidate.
        overlaps: :func:`~hongtu.dedup.consecutive_overlaps` of the chosen
            order's batches, when the reorganiser had them (else ``None``).
        sets: the chosen order's transition sets as the reorganiser made
            them, ``(ptr, ids, rows)``: batch ``k``'s is set ``rows[k]``
            (``rows`` ``None``: set ``k``); see :meth:`transitions`.
    """

    order: np.ndarray
    chosen: str
    costs: dict[str, float] = field(default_factory=dict)
    volumes: dict[str, Volumes] = field(default_factory=dict)
    overlaps: np.ndarray | None = None
    sets: tuple | None = None

    def transitions(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The chosen order's :func:`~hongtu.dedup.transition_sets`, batch by
        batch (copied into that order where the reorganiser reordered them),
        or ``None``."""
        if self.sets is None:
            return None
        ptr, ids, rows = self.sets
        if rows is None:
            return ptr, ids
        rows = np.asarray(rows, dtype=np.int64)
        return gather_segments_csr(ids, ptr[:-1][rows], ptr[1:][rows])


def reorganize_report(indptr: np.ndarray, indices: np.ndarray, chunk_ptr: np.ndarray,
                      num_parts: int, num_chunks: int, *,
                      neighbours: tuple[np.ndarray, np.ndarray] | None = None,
                      row_bytes: int | None = None, t_hd: float = T_HD, t_dd: float = T_DD,
                      t_ru: float = T_RU, phase1: bool = True,
                      phase2: bool = True) -> ReorgResult:
    """:func:`reorganize`, also returning the cost of every candidate order."""
    m, n = int(num_parts), int(num_chunks)
    indptr = np.asarray(indptr, dtype=np.int64)
    num_nodes = indptr.shape[0] - 1
    nb_ptr, nb_ids = neighbours if neighbours is not None else neighbour_sets(
        indptr, indices, chunk_ptr)
    if nb_ptr.shape[0] != m * n + 1:
        raise ValueError(f"{nb_ptr.shape[0] - 1} neighbour sets for {m} x {n} chunks")
    ident = identity_order(m, n)
    t_ident = transition_sets(nb_ptr, nb_ids, ident, num_nodes)
    # name -> (order, transition sets of its batches in some base order, rows,
    # the base sets' overlap matrix or None).
    rows, w = _chain(*t_ident, num_nodes) if phase2 else (None, None)
    candidates = {"identity": (ident, t_ident, None, w)}
    if phase2:
        candidates["order"] = (ident[rows], t_ident, rows, w)
    if phase1 and m > 1:
        grouped, t_group = _group(nb_ptr, nb_ids, m, n, num_nodes)
        rows, w = _chain(*t_group, num_nodes) if phase2 else (None, None)
        candidates["group+order"] = (grouped if rows is None else grouped[rows], t_group,
                                     rows, w)
    res = ReorgResult(order=ident, chosen="identity")
    for name, (order, trans, rows, w) in candidates.items():
        check_order(order, m, n)
        # Consecutive overlaps of a reordering are entries of the chain's matrix.
        seq = np.arange(n) if rows is None else rows
        over = None if w is None else np.ascontiguousarray(w[seq[:-1], seq[1:]])
        vol = transfer_volumes(nb_ptr, nb_ids, order, num_nodes, row_bytes=row_bytes,
                               transitions=trans, rows=rows, overlaps=over)
        res.volumes[name] = vol
        res.costs[name] = cost(vol, t_hd, t_dd, t_ru, row_bytes)
        # Strictly cheaper only: on a tie the simpler (earlier) order stays.
        if name == "identity" or res.costs[name] < res.costs[res.chosen]:
            res.order, res.chosen, res.overlaps = order, name, over
            res.sets = (*trans, rows)
    return res


def reorganize(indptr: np.ndarray, indices: np.ndarray, chunk_ptr: np.ndarray,
               num_parts: int, num_chunks: int, **kwargs) -> np.ndarray:
    r"""Greedy two-phase batch order that lowers the transfer cost (HongTu Alg. 4).

    Args:
        indptr: int64 in-edge CSC offsets of the renumbered graph.
        indices: sources of the in-edges.
        chunk_ptr: int64 ``(m*n + 1,)`` chunk boundaries.
        num_parts: ``m``.
        num_chunks: ``n`` chunks per part.
        **kwargs: ``neighbours`` (precomputed :func:`~hongtu.dedup.neighbour_sets`),
            ``row_bytes``, ``t_hd``, ``t_dd``, ``t_ru`` (see :func:`cost`),
            ``phase1``, ``phase2`` (default ``True``).

    Returns:
        int64 ``(n, m)`` order for :func:`~hongtu.dedup.plan_transfers`; the
        identity order unless a greedy order has a strictly lower cost.

    Example::

        >>> order = reorganize(g.indptr, g.indices, p.chunk_ptr, 4, 8)
        >>> plan = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 4, 8, order=order)
    """
    return reorganize_report(indptr, indices, chunk_ptr, num_parts, num_chunks, **kwargs).order


def plan_batches(indptr: np.ndarray, indices: np.ndarray, chunk_ptr: np.ndarray,
                 num_parts: int, num_chunks: int, *, reuse: bool = True, p2p: bool = True,
                 reorg: bool = True, devices: int = 1, row_bytes: int | None = None,
                 t_hd: float = T_HD, t_dd: float = T_DD, t_ru: float = T_RU,
                 cache_rows: int | Callable[[list[DeviceNeeds]], int] = 0,
                 neighbours: tuple[np.ndarray, np.ndarray] | None = None,
                 only: int | None = None):
    """Batch order (reorganised or identity) and the transfer plan that executes it.

    The one call the engine's setup makes: neighbour sets are computed once
    and shared by the reorganizer and the planner. ``t_hd``, ``t_dd``,
    ``t_ru`` are the cost model's throughputs in bytes/s (see :func:`cost`).
    ``cache_rows`` (slots, or a budget function of the devices' needs) keeps
    reused rows resident across batches (see
    :func:`~hongtu.dedup.plan_transfers`). ``neighbours``: the
    :func:`~hongtu.dedup.neighbour_sets` when the caller has them already.
    ``only``: plan that device's steps alone (see :func:`~hongtu.dedup.plan_transfers`).

    Returns:
        ``(order, plan)``: the ``(n, m)`` batch order and its
        :class:`~hongtu.dedup.TransferPlan`.
    """
    from hongtu.dedup import plan_transfers

    nb = neighbours if neighbours is not None else neighbour_sets(indptr, indices, chunk_ptr)
    overlaps = None
    if reorg:
        res = reorganize_report(indptr, indices, chunk_ptr, num_parts, num_chunks,
                                neighbours=nb, row_bytes=row_bytes, t_hd=t_hd, t_dd=t_dd,
                                t_ru=t_ru)
        order, overlaps, sets = res.order, res.overlaps, res.transitions()
    else:
        order, sets = identity_order(num_parts, num_chunks), None
    plan = plan_transfers(indptr, indices, chunk_ptr, num_parts, num_chunks, order=order,
                          reuse=reuse, p2p=p2p, devices=devices, row_bytes=row_bytes,
                          neighbours=nb, cache_rows=cache_rows, overlaps=overlaps,
                          only=only, transitions=sets)
    return order, plan
