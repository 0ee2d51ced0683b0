r"""Deduplicated transfer planning (HongTu §5, Alg. 2-3, in-place slots of §6).

A batch ``k`` runs chunk ``order[k, i]`` on part ``i``. Its transition set
``T_k = ∪_i N_{order[k,i]}`` is split by owning part; device ``d`` is
responsible for ``𝕅_dk = T_k ∩ rows(d)`` (p2p), loads from host only the
rows it did not already hold at batch ``k-1`` (reuse,
``𝕅^cpu_dk = 𝕅_dk \ 𝕅_d(k-1)``), keeps the others in place
(``𝕅^gpu_dk``), and receives the rows other devices own from them.

:func:`plan_transfers` turns this into per-device arrays
(:class:`~hongtu.dedup.types.DevicePlan`) the engine executes without any
set logic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

from hongtu.dedup import _kernels as K
from hongtu.dedup.cache import KeptRows, choose_kept_rows, set_cuts
from hongtu.dedup.sets import (
    check_order,
    consecutive_overlaps,
    neighbour_sets,
    transfer_volumes,
    transition_sets,
)
from hongtu.dedup.types import DevicePlan, TransferPlan
from hongtu.errors import UserError

__all__ = ["DeviceNeeds", "plan_transfers"]

_I64 = np.int64


def _gather(vals: np.ndarray, start: np.ndarray, stop: np.ndarray,
            dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """``(ptr, flat)``: the segments ``vals[start[q]:stop[q]]`` concatenated."""
    start = np.ascontiguousarray(start, dtype=_I64)
    stop = np.ascontiguousarray(stop, dtype=_I64)
    ptr = np.zeros(start.shape[0] + 1, dtype=_I64)
    np.cumsum(stop - start, out=ptr[1:])
    out = np.empty(int(ptr[-1]), dtype=dtype or vals.dtype)
    if start.shape[0]:
        K.gather_segments(vals, start, stop, ptr, out)
    return ptr, out


def _lookup(q_vals, q_start, q_stop, r_vals, r_start, r_stop, r_slots, lo, hi, recv_base,
            slot_dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(ptr, slots)`` of query segments (see :func:`_kernels.lookup_slots`)."""
    q_start = np.ascontiguousarray(q_start, dtype=_I64)
    q_stop = np.ascontiguousarray(q_stop, dtype=_I64)
    ptr = np.zeros(q_start.shape[0] + 1, dtype=_I64)
    np.cumsum(q_stop - q_start, out=ptr[1:])
    out = np.empty(int(ptr[-1]), dtype=slot_dtype)
    num = q_start.shape[0]
    if num:
        K.lookup_slots(q_vals, q_start, q_stop, r_vals,
                       np.ascontiguousarray(r_start, dtype=_I64),
                       np.ascontiguousarray(r_stop, dtype=_I64), r_slots,
                       np.broadcast_to(np.asarray(lo, dtype=_I64), (num,)).copy(),
                       np.broadcast_to(np.asarray(hi, dtype=_I64), (num,)).copy(),
                       recv_base, ptr, out)
    if out.size and out.min() < 0:
        raise AssertionError("planner bug: a row a chunk reads is not resident")
    return ptr, out


#: Fewest rows of a step's set per piece of the slot walk's parallel phases
#: (:func:`_kernels.piece_bounds`): steps are cut into pieces so that there are
#: several tasks per thread even when the steps are few.
PIECE_ROWS = 2048


def _assign(vals, start, stop, reuse, num_slots, num_nodes, res_slots, slot_dtype,
            flags: np.ndarray | None = None):
    """Run :func:`_kernels.assign_marks` and :func:`_kernels.assign_slots` for one
    device: ``(load_ptr, load_ids, load_slots, flush_ptr, flush_ids, flush_slots)``.
    ``num_slots``: the most rows resident at a step (kept rows included);
    ``flags``: :func:`_flags` of ``vals`` when rows are kept."""
    if flags is not None and not reuse:
        raise ValueError("kept rows need reuse: a row is kept in place between its reads")
    flags = np.empty(0, dtype=np.int8) if flags is None else flags
    steps = start.shape[0]
    longest = int((stop - start).max()) if steps else 0
    pieces = max(1, min(-(-8 * numba.get_num_threads() // max(steps, 1)),
                        longest // PIECE_ROWS))
    pa = np.empty((steps, pieces + 1), dtype=_I64)
    pb = np.zeros((steps, pieces + 1), dtype=_I64)
    K.piece_bounds(vals, start, stop, pa, pb)
    loads = np.zeros((steps, pieces), dtype=_I64)
    flushes = np.zeros((steps, pieces), dtype=_I64)
    K.assign_marks(vals, start, stop, bool(reuse), flags, res_slots, pa, pb, loads, flushes)

    def offsets(counts):  # (per-step pointers, first place of every piece)
        flat = np.zeros(counts.size + 1, dtype=_I64)
        np.cumsum(counts.ravel(), out=flat[1:])
        return flat[::pieces].copy(), flat[:-1].reshape(counts.shape)

    load_ptr, load_offs = offsets(loads)
    flush_ptr, flush_offs = offsets(flushes)
    load_ids = np.empty(int(load_ptr[-1]), dtype=vals.dtype)
    load_slots = np.empty(load_ids.shape[0], dtype=slot_dtype)
    flush_ids = np.empty(int(flush_ptr[-1]), dtype=vals.dtype)
    flush_slots = np.empty(flush_ids.shape[0], dtype=slot_dtype)
    K.assign_slots(vals, start, stop, flags,
                   np.zeros(max(num_slots, 1), dtype=np.uint8),  # a byte per slot
                   np.empty(num_nodes, dtype=slot_dtype), res_slots,
                   np.empty(load_ids.shape[0], dtype=res_slots.dtype), pa, pb, load_offs,
                   flush_offs, load_ptr, load_ids, load_slots, flush_ptr, flush_ids,
                   flush_slots)
    return load_ptr, load_ids, load_slots, flush_ptr, flush_ids, flush_slots


def _flags(kept: KeptRows, ptr: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """:func:`_kernels.kept_flags` of the sets ``ptr``/``ids`` (one per step)."""
    flags = np.empty(ids.shape[0], dtype=np.int8)
    K.kept_flags(ids, np.ascontiguousarray(ptr[:-1]), np.ascontiguousarray(ptr[1:]), kept.first,
                 kept.last, flags)
    return flags


def _exchange(d, devices, order, chunk_ids, nb_ptr, nb_ids, nb_cut, base, r_start, r_stop,
              res_slots, own, num_slots, slot_dtype, exchange) -> dict:
    """Send / receive arrays of device ``d`` (empty without an exchange)."""
    num_steps = r_start.shape[0]
    send_counts = np.zeros((num_steps, devices), dtype=_I64)
    recv_counts = np.zeros((num_steps, devices), dtype=_I64)
    if not exchange:
        empty_ptr = np.zeros(num_steps + 1, dtype=_I64)
        return dict(num_recv_slots=0, send_ptr=empty_ptr, send_ids=nb_ids[:0].copy(),
                    send_slots=np.empty(0, dtype=slot_dtype),
                    send_to=np.empty(0, dtype=np.int32), send_counts=send_counts,
                    recv_ptr=empty_ptr.copy(), recv_ids=nb_ids[:0].copy(),
                    recv_slots=np.empty(0, dtype=slot_dtype),
                    recv_from=np.empty(0, dtype=np.int32), recv_counts=recv_counts)
    peers = np.array([e for e in range(devices) if e != d], dtype=_I64)
    k = peers.size
    # Send to e at step s: N of e's chunk clipped to d's rows, read from d's slots.
    sc = order[:, peers]
    s_start, s_stop = nb_cut[sc, d].ravel(), nb_cut[sc, d + 1].ravel()
    send_ptr, send_ids = _gather(nb_ids, s_start, s_stop)
    _, send_slots = _lookup(nb_ids, s_start, s_stop, base, np.repeat(r_start, k),
                            np.repeat(r_stop, k), res_slots, own[0], own[1], num_slots,
                            slot_dtype)
    send_counts[:, peers] = (s_stop - s_start).reshape(num_steps, k)
    send_to = np.repeat(np.tile(peers, num_steps), s_stop - s_start).astype(np.int32)
    # Receive from e at step s: N of d's chunk clipped to e's rows, into the
    # receive area in source order (= id order: parts are ascending ranges).
    rc = chunk_ids[:, None]
    q_start, q_stop = nb_cut[rc, peers].ravel(), nb_cut[rc, peers + 1].ravel()
    _, recv_ids = _gather(nb_ids, q_start, q_stop)
    recv_counts[:, peers] = (q_stop - q_start).reshape(num_steps, k)
    per_step = recv_counts.sum(axis=1)
    recv_ptr = np.zeros(num_steps + 1, dtype=_I64)
    np.cumsum(per_step, out=recv_ptr[1:])
    recv_slots = (num_slots + np.arange(recv_ids.shape[0], dtype=_I64)
                  - np.repeat(recv_ptr[:-1], per_step)).astype(slot_dtype)
    return dict(num_recv_slots=int(per_step.max()) if num_steps else 0,
                send_ptr=send_ptr[::k].copy(), send_ids=send_ids, send_slots=send_slots,
                send_to=send_to, send_counts=send_counts, recv_ptr=recv_ptr, recv_ids=recv_ids,
                recv_slots=recv_slots,
                recv_from=np.repeat(np.tile(peers, num_steps), q_stop - q_start).astype(np.int32),
                recv_counts=recv_counts)


@dataclass(frozen=True)
class DeviceNeeds:
    """What a device's plan without kept rows needs (``DevicePlan``'s properties of
    the same names), known before any slot is assigned."""

    buffer_rows: int
    max_later_load: int


def _needs(t_ptr, t_ids, overlaps, part_ptr, nb_ptr, nb_cut, order, devices, exchange) -> list:
    """:class:`DeviceNeeds` of every device for shared sets with reuse
    (``overlaps``: :func:`consecutive_overlaps` of the transition sets)."""
    if not exchange:
        sizes = np.diff(t_ptr)
        later = sizes[1:] - overlaps
        return [DeviceNeeds(int(sizes.max()) if sizes.size else 0,
                            int(later.max()) if later.size else 0)]
    t_cut = set_cuts(t_ptr, t_ids, part_ptr)
    out = []
    for d in range(devices):
        a, b = t_cut[:, d].copy(), t_cut[:, d + 1].copy()
        both = np.zeros(max(a.shape[0] - 1, 0), dtype=_I64)
        if both.size:
            K.intersect_counts(t_ids, a[1:], b[1:], t_ids, a[:-1], b[:-1], both)
        c = order[:, d]
        recv = (nb_ptr[c + 1] - nb_ptr[c]) - (nb_cut[c, d + 1] - nb_cut[c, d])
        later = (b - a)[1:] - both
        out.append(DeviceNeeds(int((b - a).max()) + int(recv.max()),
                               int(later.max()) if later.size else 0))
    return out


def plan_transfers(indptr: np.ndarray, indices: np.ndarray, chunk_ptr: np.ndarray,
                   num_parts: int, num_chunks: int, order: np.ndarray | None = None,
                   reuse: bool = True, p2p: bool = True, devices: int = 1,
                   row_bytes: int | None = None,
                   neighbours: tuple[np.ndarray, np.ndarray] | None = None,
                   cache_rows: int | Callable[[list[DeviceNeeds]], int] = 0,
                   overlaps: np.ndarray | None = None) -> TransferPlan:
    r"""Plan the deduplicated host↔device transfers of one pass.

    Resident set of device ``d`` at step ``s`` (the rows it keeps in its own
    slots):

    * ``p2p`` (or ``m == 1``): ``T_s ∩ rows(d)``; with one device all of
      ``T_s``. Rows of other devices' parts that ``d``'s chunk reads are
      received from their owner.
    * no ``p2p``, ``devices == m``: ``N`` of the device's chunk, all from host.
    * no ``p2p``, one device: every chunk is a step of its own, resident set
      ``N_c`` (no sharing at all: without reuse the host traffic is ``V_ori``).

    With ``reuse`` rows resident at step ``s-1`` and ``s`` stay in their slot;
    without it every step reloads its whole resident set. With ``reuse``,
    shared sets and ``cache_rows > 0``, each device may also keep up to
    ``cache_rows`` more rows through the steps that do not read them (the
    most reused first, see :mod:`hongtu.dedup.cache`): they are loaded and
    flushed once per run of steps instead of once per run of reads.

    Args:
        indptr: int64 in-edge CSC offsets of the renumbered graph.
        indices: sources of the in-edges.
        chunk_ptr: int64 ``(m*n + 1,)`` chunk boundaries.
        num_parts: ``m``.
        num_chunks: ``n`` chunks per part.
        order: ``(n, m)`` batch order; default identity (``order[k, i] = i*n + k``).
        reuse: keep rows shared by consecutive steps in place (default ``True``).
        p2p: share rows inside a batch (default ``True``).
        devices: 1 or ``m`` (device ``d`` owns part ``d``); default 1.
        row_bytes: bytes per row, for the ``*_bytes`` volumes.
        neighbours: precomputed :func:`neighbour_sets` ``(ptr, ids)``.
        cache_rows: slots each device may add to keep reused rows resident
            across steps (0: none), or a function of the devices'
            :class:`DeviceNeeds` without kept rows that returns it (a budget).
        overlaps: :func:`~hongtu.dedup.consecutive_overlaps` of the batches
            of ``order``, when the caller has them (the reorganiser does).

    Returns:
        The :class:`~hongtu.dedup.types.TransferPlan`.

    Raises:
        UserError: ``devices`` is neither 1 nor ``m``, or ``order`` is invalid.

    Example::

        >>> plan = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 4, 8, devices=4)
        >>> plan.h2d_rows <= plan.v_ori
        True
    """
    m, n = int(num_parts), int(num_chunks)
    indptr = np.asarray(indptr, dtype=_I64)
    chunk_ptr = np.asarray(chunk_ptr, dtype=_I64)
    num_nodes = indptr.shape[0] - 1
    if chunk_ptr.shape != (m * n + 1,):
        raise UserError(f"chunk_ptr has {chunk_ptr.shape[0]} entries, expected m*n+1 = "
                        f"{m * n + 1} for {m} parts x {n} chunks")
    if chunk_ptr[0] != 0 or chunk_ptr[-1] != num_nodes:
        raise UserError(f"chunk_ptr spans {chunk_ptr[0]}..{chunk_ptr[-1]} but the graph has "
                        f"{num_nodes} vertices; partition this graph again")
    if devices not in (1, m):
        raise UserError(f"devices must be 1 or the number of parts ({m}), got {devices}; "
                        "set engine.parts = engine.devices")
    order = check_order(order, m, n)
    nb_ptr, nb_ids = neighbours if neighbours is not None else neighbour_sets(
        indptr, indices, chunk_ptr)
    if nb_ptr.shape != (m * n + 1,):
        raise ValueError(f"{nb_ptr.shape[0] - 1} neighbour sets given for {m * n} chunks")
    part_ptr = chunk_ptr[::n].copy()
    t_ptr, t_ids = transition_sets(nb_ptr, nb_ids, order, num_nodes)
    if overlaps is None:
        overlaps = consecutive_overlaps(t_ptr, t_ids)
    elif np.shape(overlaps) != (t_ptr.shape[0] - 2,):
        raise ValueError(f"{np.size(overlaps)} overlaps given for {t_ptr.shape[0] - 1} batches")
    vol = transfer_volumes(nb_ptr, nb_ids, order, num_nodes, transitions=(t_ptr, t_ids),
                           overlaps=overlaps)
    slot_dtype = np.int32 if 2 * num_nodes + 1 < np.iinfo(np.int32).max else _I64
    shared = p2p or m == 1
    exchange = shared and devices > 1
    kept = None
    nb_cut = set_cuts(nb_ptr, nb_ids, part_ptr) if exchange else None
    if callable(cache_rows):
        cache_rows = int(cache_rows(_needs(t_ptr, t_ids, overlaps, part_ptr, nb_ptr, nb_cut, order,
                                           devices, exchange))) if shared and reuse else 0
    if shared and reuse and cache_rows > 0:
        # (The sets stay as they are; the slot walk holds kept rows through their gaps.)
        kept = choose_kept_rows(t_ptr, t_ids, num_nodes, int(cache_rows),
                                part_ptr if exchange else None)
    flags = None if kept is None else _flags(kept, t_ptr, t_ids)
    t_cut = set_cuts(t_ptr, t_ids, part_ptr) if exchange else None
    flat = order.ravel()
    # Resident segments of all devices are disjoint pieces of one base array,
    # so one slot array aligned with that base serves every device.
    base = t_ids if shared else nb_ids
    # (It first holds positions in base: wider than the slots on huge plans.)
    res_slots = np.zeros(base.shape[0], dtype=slot_dtype if base.shape[0] < 2**31 - 2 else _I64)
    plans = []
    for d in range(devices):
        if devices == 1:
            chunk_ids = flat.copy()
            own = (0, num_nodes)
            step_ptr = np.arange(0, m * n + 1, m if shared else 1, dtype=_I64)
        else:
            chunk_ids = order[:, d].copy()
            own = (int(part_ptr[d]), int(part_ptr[d + 1])) if exchange else (0, num_nodes)
            step_ptr = np.arange(n + 1, dtype=_I64)
        if shared and devices == 1:
            r_start, r_stop = t_ptr[:-1], t_ptr[1:]
        elif exchange:
            r_start, r_stop = t_cut[:, d].copy(), t_cut[:, d + 1].copy()
        else:
            r_start, r_stop = nb_ptr[chunk_ids], nb_ptr[chunk_ids + 1]
        r_start = np.ascontiguousarray(r_start, dtype=_I64)
        r_stop = np.ascontiguousarray(r_stop, dtype=_I64)
        num_slots = int((r_stop - r_start).max()) if r_start.size else 0
        if kept is not None:
            num_slots = int(kept.sizes[d if exchange else 0].max())
        load_ptr, load_ids, load_slots, flush_ptr, flush_ids, flush_slots = _assign(
            base, r_start, r_stop, reuse, num_slots, num_nodes, res_slots, slot_dtype, flags)
        # Chunk reads: step of each chunk position -> its resident segment.
        if shared and m == 1:
            # One chunk per step, whose rows are the step's set: read them as they lie.
            chunk_slot_ptr, chunk_slots = t_ptr.copy(), res_slots.astype(slot_dtype, copy=False)
            if chunk_slots.size and chunk_slots.min() < 0:
                raise AssertionError("planner bug: a row a chunk reads is not resident")
        else:
            step_of = np.repeat(np.arange(step_ptr.shape[0] - 1), np.diff(step_ptr))
            chunk_slot_ptr, chunk_slots = _lookup(
                nb_ids, nb_ptr[chunk_ids], nb_ptr[chunk_ids + 1], base, r_start[step_of],
                r_stop[step_of], res_slots, own[0], own[1], num_slots, slot_dtype)
        ex = _exchange(d, devices, order, chunk_ids, nb_ptr, nb_ids, nb_cut, base, r_start,
                       r_stop, res_slots, own, num_slots, slot_dtype, exchange)
        plans.append(DevicePlan(
            device=d, num_slots=num_slots, step_ptr=step_ptr, chunk_ids=chunk_ids,
            chunk_slot_ptr=chunk_slot_ptr, chunk_slots=chunk_slots, load_ptr=load_ptr,
            load_ids=load_ids, load_slots=load_slots, flush_ptr=flush_ptr, flush_ids=flush_ids,
            flush_slots=flush_slots, **ex))
    h2d = sum(int(p.load_ids.shape[0]) for p in plans)
    return TransferPlan(
        num_nodes=num_nodes, num_parts=m, num_chunks=n, devices=int(devices), reuse=bool(reuse),
        p2p=bool(p2p), order=order, part_ptr=part_ptr, plans=plans,
        cached_rows=kept.kept if kept is not None else 0,
        v_ori=vol.v_ori,
        v_p2p=vol.v_p2p, v_ru=vol.v_ru, h2d_rows=h2d,
        d2d_rows=sum(int(p.send_ids.shape[0]) for p in plans),
        d2h_rows=sum(int(p.flush_ids.shape[0]) for p in plans), row_bytes=row_bytes)
