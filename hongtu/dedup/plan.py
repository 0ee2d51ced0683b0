r"""Deduplicated transfer planning (HongTu §5, Alg. 2-3, in-place slots of §6).

A batch ``k`` runs chunk ``order[k, i]`` on part ``i``. Its transition set
``T_k = ∪_i N_{order[k,i]}`` is split by owning part; device ``d`` is
responsible for ``𝕅_dk = T_k ∩ rows(d)`` (p2p), loads from host only the
rows it did not already hold at batch ``k-1`` (reuse,
``𝕅^cpu_dk = 𝕅_dk \ 𝕅_d(k-1)``), keeps the others in place
(``𝕅^gpu_dk``), and receives the rows other devices own from them, keeping
those it received at batch ``k-1`` and reads again in place too.

:func:`plan_transfers` turns this into per-device arrays
(:class:`~hongtu.dedup.types.DevicePlan`) the engine executes without any
set logic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from hongtu.dedup import _kernels as K
from hongtu.dedup.cache import KeptRows, choose_kept_rows, set_cuts
from hongtu.dedup.sets import (
    check_order,
    consecutive_overlaps,
    gather_segments_csr,
    neighbour_sets,
    transfer_volumes,
    transition_sets,
)
from hongtu.dedup.types import DevicePlan, TransferPlan
from hongtu.errors import UserError

__all__ = ["DeviceNeeds", "plan_transfers"]

_I64 = np.int64


def _lookup(q_vals, q_start, q_stop, r_vals, r_start, r_stop, r_slots, lo, hi, recv_base,
            slot_dtype, received=None) -> tuple[np.ndarray, np.ndarray]:
    """``(ptr, slots)`` of query segments (see :func:`_kernels.lookup_slots`;
    ``received``: ``(recv_start, recv_slots)`` where the received rows lie)."""
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
                       recv_base, *(received or (np.zeros(0, dtype=_I64),
                                                 np.zeros(0, dtype=slot_dtype))), ptr, out)
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


class _Walk(NamedTuple):
    """A device's receive area, step by step (:func:`_receive_walks`): where the
    received sets start and end (``ptr``), each received row's slot in the
    area (``slots``, set by set), the rows entering it at each step
    (``load_*``) and those leaving after it (``flush_*``)."""

    ptr: np.ndarray
    slots: np.ndarray
    load_ptr: np.ndarray
    load_ids: np.ndarray
    load_slots: np.ndarray
    flush_ptr: np.ndarray
    flush_ids: np.ndarray
    flush_slots: np.ndarray


def _receive_walks(devices, order, nb_ptr, nb_ids, nb_cut, reuse, num_nodes,
                   slot_dtype) -> list[_Walk]:
    """The receive area's slot walk of every device.

    Device ``e``'s received set at step ``s`` is its chunk's neighbours that
    other parts own (sorted: parts are ascending ranges). With ``reuse`` a
    row received at step ``s - 1`` and read again at ``s`` stays in its slot
    of the receive area, as the resident rows do in theirs (the same walk,
    :func:`_assign`): only the rows that enter travel, and a row's gradient
    goes back to its owner once, when it leaves. The owner holds the row for
    the whole stay (it is in every one of those steps' transition sets).
    """
    walks = []
    for e in range(devices):
        c = order[:, e]
        # (two segments a step: the neighbours below the own rows, those above)
        start = np.stack([nb_ptr[c], nb_cut[c, e + 1]], axis=1).ravel()
        stop = np.stack([nb_cut[c, e], nb_ptr[c + 1]], axis=1).ravel()
        ptr, vals = gather_segments_csr(nb_ids, start, stop)
        ptr = ptr[::2].copy()
        sizes = np.diff(ptr)
        area = int(sizes.max()) if sizes.size else 0
        slots = np.zeros(vals.shape[0], dtype=slot_dtype if vals.shape[0] < 2**31 - 2 else _I64)
        walk = _assign(vals, ptr[:-1].copy(), ptr[1:].copy(), reuse, area, num_nodes, slots,
                       slot_dtype)
        walks.append(_Walk(ptr, slots.astype(slot_dtype, copy=False), *walk))
    return walks


def _exchange(d, devices, part_ptr, walks, base, r_start, r_stop, res_slots, own, num_slots,
              slot_dtype) -> dict:
    """Send / receive / return arrays of device ``d`` (empty without ``walks``:
    no exchange).

    ``walks``: :func:`_receive_walks`. Device ``d`` receives at step ``s`` the
    rows entering its receive area, and sends each peer ``e`` the rows of its
    own part entering ``e``'s, read from its slots. After the step, the
    gradients of the rows leaving ``d``'s area go back to their owners
    (``leave_*``), and ``d`` adds the gradients returned by its peers at its
    slots (``back_*``).
    """
    num_steps = r_start.shape[0]
    send_counts = np.zeros((num_steps, devices), dtype=_I64)
    recv_counts = np.zeros((num_steps, devices), dtype=_I64)
    if walks is None:
        empty_ptr = np.zeros(num_steps + 1, dtype=_I64)
        no_ids = base[:0].copy()
        no_slots = np.empty(0, dtype=slot_dtype)
        no_peers = np.empty(0, dtype=np.int32)
        return dict(num_recv_slots=0, send_ptr=empty_ptr, send_ids=no_ids,
                    send_slots=no_slots, send_to=no_peers, send_counts=send_counts,
                    recv_ptr=empty_ptr.copy(), recv_ids=no_ids.copy(),
                    recv_slots=no_slots.copy(), recv_from=no_peers.copy(),
                    recv_counts=recv_counts, leave_ptr=empty_ptr.copy(),
                    leave_slots=no_slots.copy(), leave_counts=send_counts.copy(),
                    back_ptr=empty_ptr.copy(), back_slots=no_slots.copy(),
                    back_counts=recv_counts.copy())
    peers = np.array([e for e in range(devices) if e != d], dtype=_I64)
    k = peers.size

    def from_peers(kind):
        """The rows of ``d``'s part in every peer's ``kind`` lists (``"load"``: entering
        its area, ``"flush"``: leaving it), step-major: ``(counts (steps, peers),
        pointers, the lists end to end with their segments, d's slots of them)``."""
        starts, stops, lists, offs = [], [], [], 0
        for e in peers:
            ptr, ids = getattr(walks[e], f"{kind}_ptr"), getattr(walks[e], f"{kind}_ids")
            cut = set_cuts(ptr, ids, part_ptr[d:d + 2])
            starts.append(cut[:, 0] + offs)
            stops.append(cut[:, 1] + offs)
            lists.append(ids)
            offs += ids.shape[0]
        flat = np.concatenate(lists)
        start, stop = np.stack(starts, axis=1).ravel(), np.stack(stops, axis=1).ravel()
        ptr, slots = _lookup(flat, start, stop, base, np.repeat(r_start, k),
                             np.repeat(r_stop, k), res_slots, own[0], own[1], num_slots,
                             slot_dtype)
        return (stop - start).reshape(num_steps, k), ptr[::k].copy(), (flat, start, stop), slots

    # Sends: the rows of d's part entering each peer's area.
    counts, send_ptr, segments, send_slots = from_peers("load")
    send_ids = gather_segments_csr(*segments)[1]
    send_counts[:, peers] = counts
    send_to = np.repeat(np.tile(peers, num_steps), counts.ravel()).astype(np.int32)
    # Returns: the rows of d's part leaving each peer's area after the step.
    counts, back_ptr, _, back_slots = from_peers("flush")
    back_counts = np.zeros_like(recv_counts)
    back_counts[:, peers] = counts
    # Receives and leaves: d's own walk, its lists grouped by owner (ascending ids).
    w = walks[d]
    recv_counts[:] = np.diff(set_cuts(w.load_ptr, w.load_ids, part_ptr), axis=1)
    return dict(num_recv_slots=int(np.diff(w.ptr).max()) if num_steps else 0,
                send_ptr=send_ptr, send_ids=send_ids, send_slots=send_slots, send_to=send_to,
                send_counts=send_counts, recv_ptr=w.load_ptr, recv_ids=w.load_ids,
                recv_slots=(num_slots + w.load_slots.astype(_I64)).astype(slot_dtype),
                recv_from=np.searchsorted(part_ptr, w.load_ids, side="right").astype(np.int32)
                - 1, recv_counts=recv_counts, leave_ptr=w.flush_ptr,
                leave_slots=(num_slots + w.flush_slots.astype(_I64)).astype(slot_dtype),
                leave_counts=np.diff(set_cuts(w.flush_ptr, w.flush_ids, part_ptr), axis=1),
                back_ptr=back_ptr, back_slots=back_slots, back_counts=back_counts)


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
                   overlaps: np.ndarray | None = None, only: int | None = None,
                   transitions: tuple[np.ndarray, np.ndarray] | None = None) -> TransferPlan:
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
        transitions: :func:`~hongtu.dedup.transition_sets` of ``order``, when
            the caller has them (the reorganiser does).
        only: with several devices, plan device ``only``'s steps alone (a
            rank needs no other's): the other entries of ``plans`` are
            ``None`` and ``h2d_rows``, ``d2d_rows``, ``d2h_rows`` count that
            device's rows (the volumes, kept rows and order are the whole
            plan's).

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
    if transitions is None:
        transitions = transition_sets(nb_ptr, nb_ids, order, num_nodes)
    elif np.shape(transitions[0]) != (order.shape[0] + 1,):
        raise ValueError(f"{np.size(transitions[0]) - 1} transition sets given for "
                         f"{order.shape[0]} batches")
    t_ptr, t_ids = transitions
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
    walks = _receive_walks(devices, order, nb_ptr, nb_ids, nb_cut, reuse, num_nodes,
                           slot_dtype) if exchange else None
    plans: list[DevicePlan | None] = [None] * devices
    for d in (range(devices) if only is None or devices == 1 else (int(only),)):
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
            # (with an exchange one chunk a step: its received rows are the step's)
            received = (walks[d].ptr[:-1], walks[d].slots) if exchange else None
            chunk_slot_ptr, chunk_slots = _lookup(
                nb_ids, nb_ptr[chunk_ids], nb_ptr[chunk_ids + 1], base, r_start[step_of],
                r_stop[step_of], res_slots, own[0], own[1], num_slots, slot_dtype, received)
        ex = _exchange(d, devices, part_ptr, walks, base, r_start, r_stop, res_slots, own,
                       num_slots, slot_dtype)
        plans[d] = DevicePlan(
            device=d, num_slots=num_slots, step_ptr=step_ptr, chunk_ids=chunk_ids,
            chunk_slot_ptr=chunk_slot_ptr, chunk_slots=chunk_slots, load_ptr=load_ptr,
            load_ids=load_ids, load_slots=load_slots, flush_ptr=flush_ptr, flush_ids=flush_ids,
            flush_slots=flush_slots, **ex)
    planned = [p for p in plans if p is not None]
    h2d = sum(int(p.load_ids.shape[0]) for p in planned)
    return TransferPlan(
        num_nodes=num_nodes, num_parts=m, num_chunks=n, devices=int(devices), reuse=bool(reuse),
        p2p=bool(p2p), order=order, part_ptr=part_ptr, plans=plans,
        cached_rows=kept.kept if kept is not None else 0,
        v_ori=vol.v_ori,
        v_p2p=vol.v_p2p, v_ru=vol.v_ru, h2d_rows=h2d,
        d2d_rows=sum(int(p.send_ids.shape[0]) for p in planned),
        d2h_rows=sum(int(p.flush_ids.shape[0]) for p in planned), row_bytes=row_bytes)
