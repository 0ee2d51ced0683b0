r"""The plan a device executes: :class:`DevicePlan` and :class:`TransferPlan`.

Both are flat arrays plus per-step pointer arrays, so a plan saves to a
``.npz`` (:meth:`TransferPlan.to_npz_dict`) and loads back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

__all__ = ["DevicePlan", "TransferPlan"]

_SCALARS = ("device", "num_slots", "num_recv_slots")


@dataclass
class DevicePlan:
    r"""What one device loads, exchanges, reads and flushes, step by step.

    **Steps.** The device runs ``S = len(step_ptr) - 1`` steps. Step ``s``
    computes chunks ``chunk_ids[step_ptr[s]:step_ptr[s+1]]`` (flat ids
    ``c = i*n + j``). With ``p2p`` (or one part) step ``s`` is batch ``s``
    and every device runs the same number of steps; on one device without
    ``p2p`` every chunk is its own step (``S = m*n``), in the row-major
    order of the batch order.

    **Buffer.** The device keeps one row buffer of
    ``num_slots + num_recv_slots`` rows: slots ``[0, num_slots)`` hold its
    resident rows (loaded from host, kept across steps in place),
    slots ``[num_slots, num_slots + num_recv_slots)`` are the receive area,
    where rows of other parts stay in place while consecutive steps read them
    (with ``reuse``; without, every step's rows replace the step before's).

    **Per step ``s``, in this order** (``X[s]`` below means
    ``X[ptr[s]:ptr[s+1]]`` of the matching ``*_ptr``):

    1. load: ``buf[load_slots[s]] = host[load_ids[s]]`` (ids and slots both
       ascending). In backward, zero the gradient rows at ``load_slots[s]``.
    2. exchange (only with several devices and ``p2p``): send
       ``buf[send_slots[s]]`` to the peers; the rows for peer ``e`` are the
       run of ``send_to[s] == e``, ids ascending, peers ascending, with
       ``send_counts[s, e]`` rows: the rows of this device's part that enter
       ``e``'s receive area at ``s``. The rows entering this device's area
       arrive grouped by peer (the all-to-all's output, split by
       ``recv_counts[s]``), ids ascending (``recv_ids[s]``, owners
       ``recv_from[s]``), and go to ``buf[recv_slots[s]]``. The send list to
       ``e`` of this device equals ``e``'s receive list from this device
       (same ids, same order), so one all-to-all with per-peer counts
       implements it. In backward, zero the gradient rows at
       ``recv_slots[s]``.
    3. compute: chunk at position ``q`` of ``chunk_ids`` reads its
       neighbour rows (in the order of its sorted ``N_c`` = ``Block.src_ids``)
       at ``buf[chunk_slots[chunk_slot_ptr[q]:chunk_slot_ptr[q+1]]]``; in
       backward it scatter-adds their gradients at the same slots.
    4. backward only: the gradients of the rows leaving the receive area
       after ``s`` (``buf[leave_slots[s]]``, grouped by owner, ids
       ascending, ``leave_counts[s]`` rows per peer) go back to their owners
       (the reverse all-to-all); the rows returned to this device
       (``back_counts[s]`` per peer, in that order) are added at its slots
       ``back_slots[s]``, which hold those rows at ``s``.
    5. flush: rows ``flush_ids[s]`` at ``flush_slots[s]`` leave the buffer
       (they are not needed at step ``s+1``; after the last step all rows
       leave). In backward add their gradients into host ``∇h[flush_ids]``.

    Every residency interval of a row is loaded (or received) once and
    flushed (or returned) once; slots stay below ``num_slots`` (received
    ones below ``num_slots + num_recv_slots``) and two resident rows never
    share one.

    Args:
        device: device (rank) index ``d``.
        num_slots: rows of the resident area (``max_s`` of the resident set).
        num_recv_slots: rows of the receive area (0 without exchange).
        step_ptr: int64 ``(S+1,)`` into ``chunk_ids``.
        chunk_ids: int64, chunks in processing order.
        chunk_slot_ptr: int64 ``(len(chunk_ids)+1,)`` into ``chunk_slots``.
        chunk_slots: buffer slot of each neighbour row of each chunk.
        load_ptr, load_ids, load_slots: per-step host loads.
        flush_ptr, flush_ids, flush_slots: per-step flushes (after the step).
        send_ptr, send_ids, send_slots, send_to: per-step sends.
        recv_ptr, recv_ids, recv_slots, recv_from: per-step receives.
        send_counts, recv_counts: int64 ``(S, devices)`` rows per peer.
        leave_ptr, leave_slots, leave_counts: per-step received rows whose
            gradients return to their owners (slots in the receive area).
        back_ptr, back_slots, back_counts: per-step gradients returned to
            this device, added at its slots.

    Shapes:
        ``*_ptr`` are int64 of length ``S + 1`` (``chunk_slot_ptr`` of
        ``len(chunk_ids) + 1``); ids are the graph's index dtype, slots int32
        (int64 when the buffer could exceed ``2**31`` rows), ``send_to`` /
        ``recv_from`` int32, ``step_ptr``, ``chunk_ids`` and the counts int64.
    """

    device: int
    num_slots: int
    num_recv_slots: int
    step_ptr: np.ndarray
    chunk_ids: np.ndarray
    chunk_slot_ptr: np.ndarray
    chunk_slots: np.ndarray
    load_ptr: np.ndarray
    load_ids: np.ndarray
    load_slots: np.ndarray
    flush_ptr: np.ndarray
    flush_ids: np.ndarray
    flush_slots: np.ndarray
    send_ptr: np.ndarray
    send_ids: np.ndarray
    send_slots: np.ndarray
    send_to: np.ndarray
    send_counts: np.ndarray
    recv_ptr: np.ndarray
    recv_ids: np.ndarray
    recv_slots: np.ndarray
    recv_from: np.ndarray
    recv_counts: np.ndarray
    leave_ptr: np.ndarray
    leave_slots: np.ndarray
    leave_counts: np.ndarray
    back_ptr: np.ndarray
    back_slots: np.ndarray
    back_counts: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.step_ptr.shape[0] - 1)

    @property
    def buffer_rows(self) -> int:
        """Rows of the whole device buffer (resident + receive area)."""
        return self.num_slots + self.num_recv_slots

    @property
    def max_later_load(self) -> int:
        """The most rows a step after the first loads (they can travel during the
        step before, through a staging area of this many rows)."""
        loads = np.diff(np.asarray(self.load_ptr, dtype=np.int64))
        return int(loads[1:].max()) if loads.shape[0] > 1 else 0

    def step(self, name: str, s: int) -> np.ndarray:
        """``name`` (e.g. ``'load_ids'``) restricted to step ``s``."""
        ptr = getattr(self, name.split("_")[0] + "_ptr")
        return getattr(self, name)[ptr[s]:ptr[s + 1]]

    def chunk(self, q: int) -> tuple[int, np.ndarray]:
        """``(chunk id, neighbour slots)`` of the ``q``-th chunk processed."""
        p = self.chunk_slot_ptr
        return int(self.chunk_ids[q]), self.chunk_slots[p[q]:p[q + 1]]


@dataclass
class TransferPlan:
    r"""The deduplicated transfer plan of one pass over all batches.

    Args:
        num_nodes: ``|V|``.
        num_parts: ``m``.
        num_chunks: ``n`` chunks per part (= number of batches).
        devices: 1, or ``m`` (device ``d`` owns part ``d``).
        reuse: in-place reuse of rows between consecutive steps.
        p2p: rows shared inside a batch are loaded once (by their owner).
        order: int64 ``(n, m)`` batch order; ``order[k, i]`` is the chunk
            part ``i`` runs in batch ``k``.
        part_ptr: int64 ``(m+1,)``; part ``i`` owns ids
            ``[part_ptr[i], part_ptr[i+1])``.
        plans: one :class:`DevicePlan` per device (``None`` for a device
            not planned: :func:`~hongtu.dedup.plan_transfers`' ``only``).
        cached_rows: rows kept on their device through steps that do not
            read them (spare-memory caching; 0 without it).
        v_ori, v_p2p, v_ru: rows per pass without dedup, with p2p, with
            p2p and reuse (independent of this plan's flags).
        h2d_rows: rows this plan loads from host per pass.
        d2d_rows: rows this plan moves between devices per pass.
        d2h_rows: rows this plan flushes to host per pass (= ``h2d_rows``).
            (These three count the planned devices' rows.)
        row_bytes: bytes per row, or ``None``.
    """

    num_nodes: int
    num_parts: int
    num_chunks: int
    devices: int
    reuse: bool
    p2p: bool
    order: np.ndarray
    part_ptr: np.ndarray
    plans: list[DevicePlan | None] = field(default_factory=list)
    cached_rows: int = 0
    v_ori: int = 0
    v_p2p: int = 0
    v_ru: int = 0
    h2d_rows: int = 0
    d2d_rows: int = 0
    d2h_rows: int = 0
    row_bytes: int | None = None

    def _bytes(self, rows: int) -> int | None:
        return None if self.row_bytes is None else int(rows) * int(self.row_bytes)

    @property
    def h2d_bytes(self) -> int | None:
        return self._bytes(self.h2d_rows)

    @property
    def d2d_bytes(self) -> int | None:
        return self._bytes(self.d2d_rows)

    @property
    def d2h_bytes(self) -> int | None:
        return self._bytes(self.d2h_rows)

    def volumes(self) -> dict[str, int]:
        """Rows (and bytes, when ``row_bytes`` is known) of every volume."""
        out = {k: int(getattr(self, k)) for k in
               ("v_ori", "v_p2p", "v_ru", "h2d_rows", "d2d_rows", "d2h_rows")}
        if self.row_bytes is not None:
            out.update({k.replace("rows", "bytes") if k.endswith("rows") else k + "_bytes":
                        v * int(self.row_bytes) for k, v in list(out.items())})
        out["cached_rows"] = int(self.cached_rows)
        return out

    # ------------------------------------------------------------------ npz
    def to_npz_dict(self) -> dict[str, np.ndarray]:
        """Flat ``{name: array}`` for ``np.savez``; device fields as ``dev{d}.{name}``."""
        out = {k: np.asarray(getattr(self, k)) for k in
               ("num_nodes", "num_parts", "num_chunks", "devices", "v_ori", "v_p2p", "v_ru",
                "h2d_rows", "d2d_rows", "d2h_rows")}
        out["reuse"] = np.asarray(bool(self.reuse))
        out["p2p"] = np.asarray(bool(self.p2p))
        out["cached_rows"] = np.asarray(int(self.cached_rows))
        out["row_bytes"] = np.asarray(-1 if self.row_bytes is None else int(self.row_bytes))
        out["order"] = self.order
        out["part_ptr"] = self.part_ptr
        for p in (p for p in self.plans if p is not None):
            for f in fields(DevicePlan):
                out[f"dev{p.device}.{f.name}"] = np.asarray(getattr(p, f.name))
        return out

    @classmethod
    def from_npz_dict(cls, data) -> TransferPlan:
        """Inverse of :meth:`to_npz_dict` (accepts the mapping ``np.load`` returns)."""
        scalar = {k: int(data[k]) for k in
                  ("num_nodes", "num_parts", "num_chunks", "devices", "v_ori", "v_p2p", "v_ru",
                   "h2d_rows", "d2d_rows", "d2h_rows")}
        rb = int(data["row_bytes"])
        plans = []
        for d in range(scalar["devices"]):
            if f"dev{d}.device" not in data:  # (not planned)
                plans.append(None)
                continue
            kw = {}
            for f in fields(DevicePlan):
                v = np.asarray(data[f"dev{d}.{f.name}"])
                kw[f.name] = int(v) if f.name in _SCALARS else v
            plans.append(DevicePlan(**kw))
        cached = int(data["cached_rows"]) if "cached_rows" in data else 0
        return cls(reuse=bool(data["reuse"]), p2p=bool(data["p2p"]), cached_rows=cached,
                   order=np.asarray(data["order"]), part_ptr=np.asarray(data["part_ptr"]),
                   plans=plans, row_bytes=None if rb < 0 else rb, **scalar)
