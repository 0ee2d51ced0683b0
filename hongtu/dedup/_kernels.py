r"""numba kernels of the transfer planner.

Every set here is a sorted, duplicate-free run of vertex ids stored as a
*segment* ``vals[start:stop]`` of some flat array, so the planner never
copies a set to look at it. The kernels are linear in the sizes of the sets
they touch (merges), never ``O(|V|)`` per set. (Unions of unsorted
segments are the shared bitmap kernels,
:func:`hongtu.graph._kernels.unique_union`.)
"""

from __future__ import annotations

import numba
import numpy as np

from hongtu.graph._kernels import parallel_kernel

__all__ = ["merge_sorted", "intersect_counts", "kept_flags", "piece_bounds", "assign_marks",
           "assign_slots", "lookup_slots", "gather_segments"]


@parallel_kernel
def merge_sorted(values, gptr, seg_start, seg_stop, ptr, out, counts):
    """Union of groups of *sorted* segments by a k-way merge (sequential reads).

    With ``out`` empty only ``counts[g]`` (the union sizes) are computed;
    otherwise group ``g``'s union is written to ``out[ptr[g]:ptr[g+1]]``.
    """
    write = out.shape[0] > 0
    for g in numba.prange(gptr.shape[0] - 1):
        a = gptr[g]
        k = gptr[g + 1] - a
        pos = seg_start[a:a + k].copy()
        end = seg_stop[a:a + k]
        o = ptr[g]
        c = 0
        while True:
            best = -1
            bv = values[0]
            for s in range(k):
                if pos[s] < end[s]:
                    v = values[pos[s]]
                    if best < 0 or v < bv:
                        bv = v
                        best = s
            if best < 0:
                break
            for s in range(k):
                if pos[s] < end[s] and values[pos[s]] == bv:
                    pos[s] += 1
            if write:
                out[o + c] = bv
            c += 1
        counts[g] = c


@parallel_kernel
def intersect_counts(a_vals, a_start, a_stop, b_vals, b_start, b_stop, out):
    """``out[p] = |a_p ∩ b_p|`` for pairs of sorted segments (merge)."""
    for p in numba.prange(out.shape[0]):
        i, i1 = a_start[p], a_stop[p]
        j, j1 = b_start[p], b_stop[p]
        c = 0
        while i < i1 and j < j1:
            x, y = a_vals[i], b_vals[j]
            if x < y:
                i += 1
            elif y < x:
                j += 1
            else:
                c += 1
                i += 1
                j += 1
        out[p] = c


#: :func:`kept_flags`: a kept row's read after its first (it is resident already)
KEPT_BEFORE = 1
#: :func:`kept_flags`: a kept row's read before its last (it stays resident after)
KEPT_AFTER = 2


#: :func:`kept_flags` cuts each step into this many pieces, so that a few
#: steps (24 on R-MAT 2^24) still make several tasks per thread
FLAG_PIECES = 8


@parallel_kernel
def kept_flags(vals, start, stop, first, last, flags):
    """``flags`` (aligned with ``vals``) of the reads of kept rows, step ``s`` =
    ``vals[start[s]:stop[s]]``: :data:`KEPT_BEFORE` when the row's ``first``
    read is before ``s``, :data:`KEPT_AFTER` when its ``last`` is after
    (``first``/``last`` per id, ``-1`` for rows not kept)."""
    for it in numba.prange(start.shape[0] * FLAG_PIECES):
        s, k = it // FLAG_PIECES, it % FLAG_PIECES
        n = stop[s] - start[s]
        for t in range(start[s] + n * k // FLAG_PIECES, start[s] + n * (k + 1) // FLAG_PIECES):
            u = vals[t]
            f = 0
            if first[u] >= 0:
                if first[u] < s:
                    f |= KEPT_BEFORE
                if last[u] > s:
                    f |= KEPT_AFTER
            flags[t] = f


@parallel_kernel
def piece_bounds(vals, start, stop, pa, pb):
    """Cut every step's set into ``P = pa.shape[1] - 1`` pieces by value.

    ``pa[s, k]``: where piece ``k`` of ``R_s = vals[start[s]:stop[s]]`` starts
    (equal counts of rows); ``pb[s, k]`` (``s >= 1``): where the rows of
    ``R_{s-1}`` of the same values start, so piece ``k`` of the transition
    ``s-1 → s`` pairs rows of the same value range on both sides (below
    ``R_s``'s second piece in the first, from its last piece on in the last).
    """
    pieces = pa.shape[1] - 1
    for s in numba.prange(start.shape[0]):
        a, b = start[s], stop[s]
        for k in range(pieces + 1):
            pa[s, k] = a + (k * (b - a)) // pieces
        if s == 0:
            continue
        i, i1 = start[s - 1], stop[s - 1]
        pb[s, 0] = i
        pb[s, pieces] = i1
        for k in range(1, pieces):
            if pa[s, k] >= b:  # (an empty set: every row of R_{s-1} in the first piece)
                pb[s, k] = i1
                continue
            v = vals[pa[s, k]]
            lo, hi = pb[s, k - 1], i1
            while lo < hi:  # first row of R_{s-1} not below v
                mid = (lo + hi) // 2
                if vals[mid] < v:
                    lo = mid + 1
                else:
                    hi = mid
            pb[s, k] = lo


@parallel_kernel
def assign_marks(vals, start, stop, reuse, kept_flags, res_slots, pa, pb, loads, flushes):
    """Step 1 of :func:`assign_slots`, piece by piece (:func:`piece_bounds`): mark each
    row of every step and count the loads (``loads[s, k]``: rows of piece ``k``
    of ``R_s`` loaded at ``s``) and flushes (``flushes[s, k]``: rows of piece
    ``k`` of ``R_s`` flushed after ``s``), so the caller sizes the lists
    exactly."""
    num_steps = start.shape[0]
    pieces = pa.shape[1] - 1
    kept = kept_flags.shape[0] > 0
    for it in numba.prange(num_steps * pieces):
        s, k = it // pieces, it % pieces
        a, b = pa[s, k], pa[s, k + 1]
        for t in range(a, b):
            res_slots[t] = -1
        same = 0
        held = 0  # rows of R_{s-1} kept past it, not in R_s
        back = 0  # kept rows of R_s that came in before (not loads)
        if s > 0:
            i, i1 = pb[s, k], pb[s, k + 1]
            j = a
            while reuse and (i < i1 or j < b):
                if j == b or (i < i1 and vals[i] < vals[j]):
                    if not kept and j == b:
                        break  # (without kept rows only the matches count)
                    if kept and kept_flags[i] & KEPT_AFTER:
                        held += 1
                    i += 1
                elif i == i1 or vals[j] < vals[i]:
                    if not kept and i == i1:
                        break
                    if kept and kept_flags[j] & KEPT_BEFORE:
                        back += 1
                    j += 1
                else:
                    res_slots[j] = -2 - i
                    same += 1
                    i += 1
                    j += 1
            flushes[s - 1, k] = pb[s, k + 1] - pb[s, k] - same - held
        loads[s, k] = b - a - same - back
        if s == num_steps - 1:  # after the last step every row leaves
            flushes[s, k] = b - a


@parallel_kernel
def assign_slots(vals, start, stop, kept_flags, occ, slot_of, res_slots, load_pos, pa, pb,
                 load_offs, flush_offs, load_ptr, load_ids, load_slots, flush_ptr, flush_ids,
                 flush_slots):
    """Walk one device's resident sets step by step and give every row a slot.

    Step ``s`` keeps ``R_s = vals[start[s]:stop[s]]`` resident. Before it,
    the rows of ``R_{s-1}`` that ``R_s`` does not hold (all of them without
    ``reuse``) are flushed and their slots freed; then every row of ``R_s``
    without a slot takes the lowest free slot, in id order, and is loaded.
    Kept rows keep their slot (in-place reuse). After the last step every
    row is flushed. ``res_slots`` (aligned with ``vals``) gets every row's
    slot at every step.

    Rows kept through their gaps (only with ``reuse``) are resident from the
    first step that reads them to the last, whether or not the steps between
    hold them: they enter only at the first and leave only after the last.
    ``kept_flags`` (aligned with ``vals``, :func:`kept_flags`; empty: no
    kept rows) marks their reads after the first (:data:`KEPT_BEFORE`) and
    before the last (:data:`KEPT_AFTER`). That is the walk over the sets
    extended by the kept rows passing through, without the extended sets.

    Only the placement is sequential, and it visits loads and flushes alone:

    1. in parallel over the steps' pieces (:func:`piece_bounds`: ranges of
       values, so that a few steps still make many tasks), one merge of
       ``R_{s-1}`` and ``R_s`` marks each row of ``R_s`` in ``res_slots``:
       ``-2 - i`` when it stays from position ``i`` of ``R_{s-1}``, ``-1``
       when it enters (or a kept row comes back); the counts give
       ``load_ptr``/``load_offs`` and ``flush_ptr``/``flush_offs`` (per step,
       and where each piece's rows go) (:func:`assign_marks`, run first: the
       lists are then sized exactly);
    2. in parallel over the pieces, the loaded and flushed ids are listed (a
       row of ``R_s`` leaves when no mark of ``R_{s+1}`` names it and it is
       not kept past ``s``), each piece from its offset, so every step's
       list is in id order;
    3. step by step, flushed rows free the slot they were loaded into
       (``slot_of``, per id) and loaded rows take the lowest free slots (a
       byte per slot, ``occ``; the free slots are counted per block of
       slots and ranked by a prefix over the blocks), each in parallel within
       the step (its loads and flushes are distinct rows, and every row
       flushed at ``s`` was placed at an earlier step);
    4. loaded rows' slots go to ``res_slots``, then, step by step in
       parallel, staying rows copy theirs from ``R_{s-1}`` and kept rows
       coming back read their one slot from ``slot_of``.

    Segments of different steps must not overlap; positions in ``vals``
    must fit ``res_slots``' dtype. ``occ`` (zeroed uint8, a byte per slot:
    at least the most rows resident at a step, kept ones included) is
    scratch and is left clean;
    ``slot_of`` (``|V|``) and ``load_pos`` are scratch.

    Lowest-free placement keeps every slot below the most rows resident at
    a step: the new rows of step ``s`` fill the gaps left by the kept rows.
    """
    num_steps = start.shape[0]
    if num_steps == 0:
        return
    kept = kept_flags.shape[0] > 0
    pieces = pa.shape[1] - 1
    for it in numba.prange(num_steps * pieces):  # 2.
        s, k = it // pieces, it % pieces
        q = load_offs[s, k]
        for t in range(pa[s, k], pa[s, k + 1]):
            if res_slots[t] == -1 and not (kept and kept_flags[t] & KEPT_BEFORE):
                load_ids[q] = vals[t]
                load_pos[q] = t
                q += 1
        f = flush_offs[s, k]
        if s + 1 < num_steps:  # rows of piece k of R_s against those of R_{s+1}
            t0, t1 = pb[s + 1, k], pb[s + 1, k + 1]
            j, j1 = pa[s + 1, k], pa[s + 1, k + 1]
        else:
            t0, t1 = pa[s, k], pa[s, k + 1]
            j, j1 = 0, 0
        for t in range(t0, t1):
            while j < j1 and res_slots[j] == -1:
                j += 1
            if j < j1 and res_slots[j] == -2 - t:
                j += 1
            elif not (kept and kept_flags[t] & KEPT_AFTER):
                flush_ids[f] = vals[t]
                f += 1
    block = 4096  # slots per block of the free-slot count
    num_blocks = (occ.shape[0] + block - 1) // block
    free = np.zeros(num_blocks + 1, dtype=np.int64)
    for s in range(num_steps + 1):  # 3. (the last round only flushes)
        if s > 0:
            for f in numba.prange(flush_ptr[s - 1], flush_ptr[s]):
                sl = slot_of[flush_ids[f]]
                flush_slots[f] = sl
                occ[sl] = 0
        if s == num_steps:
            break
        q0, want = load_ptr[s], load_ptr[s + 1] - load_ptr[s]
        if want == 0:
            continue
        for c in numba.prange(num_blocks):  # free slots per block, then their ranks
            n = 0
            for p in range(c * block, min(occ.shape[0], (c + 1) * block)):
                n += occ[p] == 0
            free[c + 1] = n
        for c in range(num_blocks):
            free[c + 1] += free[c]
        for c in numba.prange(num_blocks):  # the lowest `want` free slots, in order
            r = free[c]
            p = c * block
            end = min(occ.shape[0], (c + 1) * block)
            while r < want and p < end:
                if occ[p] == 0:
                    occ[p] = 1
                    load_slots[q0 + r] = p
                    r += 1
                p += 1
        for q in numba.prange(q0, q0 + want):
            slot_of[load_ids[q]] = load_slots[q]
    for q in numba.prange(load_ptr[num_steps]):  # 4.
        res_slots[load_pos[q]] = load_slots[q]
    for s in range(1, num_steps):
        for t in numba.prange(start[s], stop[s]):
            i = res_slots[t]
            if i < -1:
                res_slots[t] = res_slots[-2 - i]
            elif i == -1:  # a kept row back after its gap: its one slot
                res_slots[t] = slot_of[vals[t]]


@parallel_kernel
def lookup_slots(q_vals, q_start, q_stop, r_vals, r_start, r_stop, r_slots, lo, hi, recv_base,
                 recv_start, recv_slots, out_ptr, out):
    """Slots of the rows of query segments, found in resident segments.

    Query ``q`` (sorted ids) is answered against resident segment ``q``
    (sorted, aligned slots ``r_slots``): an id in ``[lo[q], hi[q])`` must be
    resident and gets its slot; any other id is a received row and, as the
    ``r``-th received id of the query, gets ``recv_base + recv_slots[recv_start[q] + r]``
    (``recv_slots`` empty: ``recv_base + r``). An owned id missing from the
    resident set gets ``-1`` (a bug the caller checks for).
    """
    placed = recv_slots.shape[0] > 0
    for q in numba.prange(q_start.shape[0]):
        j = r_start[q]
        j1 = r_stop[q]
        r = 0
        o = out_ptr[q]
        for t in range(q_start[q], q_stop[q]):
            u = q_vals[t]
            if lo[q] <= u < hi[q]:
                while j < j1 and r_vals[j] < u:
                    j += 1
                if j < j1 and r_vals[j] == u:
                    out[o] = r_slots[j]
                else:
                    out[o] = -1
            else:
                out[o] = recv_base + (recv_slots[recv_start[q] + r] if placed else r)
                r += 1
            o += 1


@parallel_kernel
def gather_segments(vals, start, stop, out_ptr, out):
    """Concatenate segments ``vals[start[q]:stop[q]]`` into ``out`` at ``out_ptr[q]``."""
    for q in numba.prange(start.shape[0]):
        o = out_ptr[q]
        for t in range(start[q], stop[q]):
            out[o] = vals[t]
            o += 1
