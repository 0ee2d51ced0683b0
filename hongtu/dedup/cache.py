r"""Rows kept on the device across batches with spare device memory (HongTu §5).

In-place reuse keeps a row on the device while *consecutive* batches read
it. A row read by batches 3, 4 and 9 is still loaded twice (and, in
backward, flushed twice): it leaves after batch 4 and comes back for 9. With
spare device memory the planner can keep such a row through its gap
(batches 5-8) and load it once per pass.

Which rows: from the plan's transition sets, every row's *runs* (maximal
stretches of consecutive batches that read it) and *gap steps* (batches
between its first and last read that do not). Keeping a row saves
``runs - 1`` loads and as many flushes, and costs one slot at each of its
gap steps. Rows are taken in order of saving per gap step (ties: lower id),
each only if every one of its gap steps still has a free slot on its
device; a device has ``num_slots + extra`` slots at every step, where
``num_slots`` is its largest resident set without caching. So the device
buffer grows by at most ``extra`` rows.

The result, as :func:`keep_reused_rows` writes it, is a new list of
resident sets (each batch's set plus the kept rows passing through it).
:func:`~hongtu.dedup.plan_transfers` takes the choice alone
(:func:`choose_kept_rows`: each kept row's first and last read) and assigns
slots on the sets as they are, loading a kept row at its first read and
flushing it after its last: the same loads, flushes and slots as on the
extended sets, without writing them (they are several times the reads on
big graphs). The engine executes the plan unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from hongtu.graph._kernels import highest_bit, lowest_bit, popcount

__all__ = ["KeptRows", "choose_kept_rows", "keep_reused_rows"]

_I64 = np.int64
_U64 = np.uint64
_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def _row_blocks(num_nodes: int) -> np.ndarray:
    """Contiguous ranges of ``num_nodes`` items for the parallel kernels (a few per thread)."""
    blocks = max(1, min(num_nodes, 4 * numba.get_num_threads()))
    return np.linspace(0, num_nodes, blocks + 1).astype(_I64)


@numba.njit(parallel=True, cache=True)
def _presence(t_ptr, t_ids, bounds, pm):
    """Bit ``s`` of row ``u``'s mask ``pm[u]``: step ``s`` reads row ``u``.

    Every block of rows clears its rows (``pm`` may come from ``np.empty``:
    the pages are first touched here, on all threads) and finds its piece of
    each (sorted) set by binary search, so blocks write disjoint rows.
    """
    for w in numba.prange(bounds.shape[0] - 1):
        r0, r1 = bounds[w], bounds[w + 1]
        pm[r0:r1] = 0
        for s in range(t_ptr.shape[0] - 1):
            seg = t_ids[t_ptr[s]:t_ptr[s + 1]]
            bit = _ONE << np.uint64(s & 63)
            for k in range(np.searchsorted(seg, r0), np.searchsorted(seg, r1)):
                pm[seg[k], s >> 6] |= bit


def set_cuts(ptr: np.ndarray, ids: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``cut[s, t]`` = position in ``ids`` of the first id ``>= bounds[t]`` in
    sorted set ``s`` (CSR ``ptr``/``ids``)."""
    bounds = np.asarray(bounds, dtype=_I64)
    if ids.dtype != _I64 and (bounds.size == 0 or bounds.max() <= np.iinfo(ids.dtype).max):
        bounds = bounds.astype(ids.dtype)  # (keys of another dtype: numpy copies the set)
    out = np.empty((ptr.shape[0] - 1, bounds.shape[0]), dtype=_I64)
    for s in range(out.shape[0]):
        out[s] = ptr[s] + np.searchsorted(ids[ptr[s]:ptr[s + 1]], bounds)
    return out


@numba.njit(cache=True, inline="always")
def _first_last(m):
    """First and last set step of a row's mask (``-1, -1`` when empty)."""
    first, last = -1, -1
    for w in range(m.shape[0]):
        if m[w] != 0:
            if first < 0:
                first = 64 * w + lowest_bit(m[w])
            last = 64 * w + highest_bit(m[w])
    return first, last


@numba.njit(cache=True, inline="always")
def _span_word(first, last, w):
    """Bits of steps ``first..last`` that fall in word ``w``."""
    lo, hi = max(first, 64 * w), min(last, 64 * w + 63)
    if lo > hi:
        return np.uint64(0)
    width = hi - lo + 1
    ones = _ALL if width == 64 else (_ONE << np.uint64(width)) - _ONE
    return ones << np.uint64(lo - 64 * w)


@numba.njit(parallel=True, cache=True)
def _scores(pm, width, key):
    """``key[u] = (runs - 1) * width + gap steps`` of row ``u`` read in more than one
    run of consecutive steps, else ``-1`` (a run starts at a set bit whose step
    before is clear)."""
    words = pm.shape[1]
    for u in numba.prange(pm.shape[0]):
        m = pm[u]
        runs, reads, carry = 0, 0, _U64(0)
        for w in range(words):
            x = m[w]
            runs += popcount(x & ~((x << _ONE) | carry))
            reads += popcount(x)
            carry = x >> _U64(63)
        if runs > 1:
            first, last = _first_last(m)
            key[u] = (runs - 1) * width + (last - first + 1 - reads)
        else:
            key[u] = -1


@numba.njit(parallel=True, cache=True)
def _mark_keys(key, bounds, seen):
    """``seen[k]`` for every candidate key ``k`` present (``key >= 0``). (Written once
    each: the threads share the few cache lines of ``seen``.)"""
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            if key[u] >= 0 and not seen[key[u]]:
                seen[key[u]] = True


@numba.njit(parallel=True, cache=True)
def _count_ranks(key, rank_of, bounds, counts):
    """``counts[w, r]``: candidates of row block ``w`` whose key has rank ``r``."""
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            if key[u] >= 0:
                counts[w, rank_of[key[u]]] += 1


@numba.njit(parallel=True, cache=True)
def _place_candidates(key, rank_of, pm, bounds, offs, ids, masks):
    """Write each candidate at its place in score order (``offs[w, r]``: the next
    place of block ``w``'s candidates of rank ``r``), with the mask of its gap
    steps (bit ``s`` of ``masks[j]``: candidate ``ids[j]`` passes step ``s``
    unread). Blocks and rows within them go in id order, so ties stay in id
    order, and ``pm`` is read row after row."""
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            if key[u] < 0:
                continue
            r = rank_of[key[u]]
            j = offs[w, r]
            offs[w, r] = j + 1
            ids[j] = u
            m = pm[u]
            first, last = _first_last(m)
            for k in range(masks.shape[1]):
                masks[j, k] = _span_word(first, last, k) & ~m[k]


@numba.njit(parallel=True, cache=True)
def _gap_counts(masks, owner, num_steps, bounds, counts):
    """``counts[b, d * num_steps + s]``: candidates of block ``b`` (of the order)
    on device ``d`` passing step ``s`` unread."""
    for b in numba.prange(bounds.shape[0] - 1):
        for i in range(bounds[b], bounds[b + 1]):
            base = owner[i] * num_steps
            for w in range(masks.shape[1]):
                x = masks[i, w]
                while x != 0:
                    counts[b, base + 64 * w + lowest_bit(x)] += 1
                    x &= x - _ONE


@numba.njit(cache=True)
def _first_refusal(masks, owner, num_steps, room, bounds, counts):
    """The first candidate the greedy refuses (``masks.shape[0]`` if none).

    Until it, the greedy takes every candidate, so a step of device ``d``
    refuses the first candidate to pass it after ``room[d, s]`` others have
    (the first at all when ``room`` is 0 or less). ``counts``
    (:func:`_gap_counts`) finds the block of that candidate, one scan of the
    block its place in it.
    """
    first = masks.shape[0]
    for d in range(room.shape[0]):
        for s in range(num_steps):
            need = max(room[d, s], 0) + 1  # the one refused: this many pass s
            c = d * num_steps + s
            seen = 0
            for b in range(bounds.shape[0] - 1):
                if bounds[b] >= first:
                    break
                if seen + counts[b, c] < need:
                    seen += counts[b, c]
                    continue
                bit = _ONE << np.uint64(s & 63)
                for i in range(bounds[b], min(bounds[b + 1], first)):
                    if owner[i] == d and masks[i, s >> 6] & bit:
                        seen += 1
                        if seen == need:
                            first = i
                            break
                break
    return first


@numba.njit(cache=True)
def _greedy(masks, owner, room, full, take, start):
    """Take each candidate from ``start`` on, in order, whose gap steps all have a
    free slot left.

    ``full[d]`` marks the steps of device ``d`` with none, so a candidate is
    checked in one AND per 64 steps; a taken one spends a slot at each of its
    gap steps.
    """
    kept = 0
    for i in range(start, masks.shape[0]):
        d = owner[i]
        fits = True
        for w in range(masks.shape[1]):
            if masks[i, w] & full[d, w]:
                fits = False
                break
        if not fits:
            continue
        take[i] = True
        kept += 1
        for w in range(masks.shape[1]):
            m = masks[i, w]
            while m != 0:
                low = m & (~m + _ONE)
                s = w * 64 + lowest_bit(low)
                room[d, s] -= 1
                if room[d, s] <= 0:
                    full[d, w] |= low
                m ^= low
    return kept


@numba.njit(parallel=True, cache=True)
def _extended(pm, keep, bounds, offs, out, fill):
    """Count (``fill`` false) or write each step's extended set per block of rows.

    A kept row is in every step from its first read to its last, any other
    row in the steps that read it. ``offs[w, s]`` counts, or is the next
    position of, block ``w``'s rows in step ``s``; blocks are in row order,
    so every set comes out sorted.
    """
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            m = pm[u]
            if keep[u]:
                first, last = _first_last(m)
                for s in range(first, last + 1):
                    if fill:
                        out[offs[w, s]] = u
                    offs[w, s] += 1
                continue
            for k in range(m.shape[0]):
                x = m[k]
                while x != 0:
                    s = 64 * k + lowest_bit(x)
                    if fill:
                        out[offs[w, s]] = u
                    offs[w, s] += 1
                    x &= x - _ONE


def _score_order(key: np.ndarray, pm: np.ndarray, bounds: np.ndarray, width: int):
    """``(ids, masks)``: the candidates (``key >= 0``) best first by saving per slot,
    ``runs / gaps``, ties by id (``key = runs * width + gaps``, runs here already
    minus one), and the mask of each one's gap steps.

    A counting sort on the rank of each key's value, in parallel over row
    blocks: the keys are few (both parts below the step count), the
    candidates many.
    """
    steps = width - 1
    seen = np.zeros((steps // 2 + 2) * width, dtype=np.bool_)
    _mark_keys(key, bounds, seen)
    present = np.flatnonzero(seen)
    # Equal fractions are equal doubles (division is correctly rounded): one rank.
    values = (present // width) / (present % width)
    uniq, rank = np.unique(-values, return_inverse=True)
    rank_of = np.zeros(seen.shape[0], dtype=_I64)
    rank_of[present] = rank.ravel()
    counts = np.zeros((bounds.shape[0] - 1, uniq.shape[0]), dtype=_I64)
    _count_ranks(key, rank_of, bounds, counts)
    # Place of block w's first candidate of rank r: ranks first, then blocks.
    flat = counts.T.ravel()
    offs = (np.cumsum(flat) - flat).reshape(counts.T.shape).T.copy()
    num = int(flat.sum())
    ids = np.empty(num, dtype=_I64)
    masks = np.empty((num, pm.shape[1]), dtype=_U64)
    _place_candidates(key, rank_of, pm, bounds, offs, ids, masks)
    return ids, masks


def _mark_full(room: np.ndarray, full: np.ndarray) -> None:
    """Set bit ``s`` of ``full[d]`` for every step of device ``d`` with no room left."""
    for d, t in zip(*np.nonzero(room <= 0)):
        full[d, t >> 6] |= _U64(1) << _U64(t & 63)


def _take(masks: np.ndarray, owner: np.ndarray, room: np.ndarray, full: np.ndarray,
          take: np.ndarray) -> int:
    """The greedy choice (:func:`_greedy`) into ``take``; ``room``/``full`` are spent.

    The candidates before the first the greedy refuses are taken in bulk (their
    gap steps counted in parallel), so only the rest is walked one by one.
    """
    num, num_steps = masks.shape[0], room.shape[1]
    bounds = _row_blocks(num)  # (blocks of the candidates, in their order)
    counts = np.zeros((bounds.shape[0] - 1, room.shape[0] * num_steps), dtype=_I64)
    _gap_counts(masks, owner, num_steps, bounds, counts)
    start = _first_refusal(masks, owner, num_steps, room, bounds, counts)
    if start > 0:
        take[:start] = True
        spent = np.zeros(room.size, dtype=_I64)
        b = int(np.searchsorted(bounds, start, side="right")) - 1  # block holding start
        spent += counts[:b].sum(axis=0)
        if start > bounds[b]:
            part = np.zeros((1, room.size), dtype=_I64)
            _gap_counts(masks[bounds[b]:start], owner[bounds[b]:start], num_steps,
                        np.array([0, start - bounds[b]], dtype=_I64), part)
            spent += part[0]
        room -= spent.reshape(room.shape)
        _mark_full(room, full)
    return start + _greedy(masks, owner, room, full, take, start)


class KeptRows(NamedTuple):
    """Rows kept on the device through their gap steps, for the slot assignment.

    ``first[u]``/``last[u]``: the first and last step reading kept row ``u``
    (``-1`` for every other row); it is loaded at ``first`` and flushed after
    ``last`` only. ``sizes[d, s]``: device ``d``'s resident rows at step ``s``
    with the kept rows passing through it (at most its largest set plus
    ``extra``). ``kept``: how many rows are kept.
    """

    first: np.ndarray
    last: np.ndarray
    sizes: np.ndarray
    kept: int


def _select(t_ptr, t_ids, num_nodes, extra, part_ptr):
    """The greedy selection: ``(pm, bounds, keep, kept, sizes with kept rows)`` (``keep``:
    a flag per row), or ``None``."""
    t_ptr = np.ascontiguousarray(t_ptr, dtype=_I64)
    t_ids = np.ascontiguousarray(t_ids)
    num_steps = t_ptr.shape[0] - 1
    if extra <= 0 or num_steps < 3 or t_ids.size == 0:
        return None
    part_ptr = np.array([0, num_nodes], dtype=_I64) if part_ptr is None \
        else np.asarray(part_ptr, dtype=_I64)
    devices = part_ptr.shape[0] - 1
    words = (num_steps + 63) // 64
    bounds = _row_blocks(num_nodes)
    pm = np.empty((num_nodes, words), dtype=_U64)  # the steps reading each row
    _presence(t_ptr, t_ids, bounds, pm)
    width = num_steps + 1  # above any gap count
    # (keys stay below (num_steps // 2 + 1) * width: int32 unless the steps are many)
    small = (num_steps // 2 + 2) * width < np.iinfo(np.int32).max
    key = np.empty(num_nodes, dtype=np.int32 if small else _I64)
    _scores(pm, width, key)
    # Saving per slot spent, best first; ties in id order.
    cands, masks = _score_order(key, pm, bounds, width)
    del key
    if cands.size == 0:
        return None
    # Set sizes per device and step: room = largest + extra - this one.
    sizes = np.diff(set_cuts(t_ptr, t_ids, part_ptr), axis=1).T.copy()
    top = sizes.max(axis=1, keepdims=True) + int(extra)
    room = top - sizes
    full = np.zeros((devices, masks.shape[1]), dtype=_U64)
    _mark_full(room, full)
    owner = np.zeros(cands.shape[0], dtype=_I64) if devices == 1 else \
        np.searchsorted(part_ptr, cands, side="right").astype(_I64) - 1
    take = np.zeros(cands.shape[0], dtype=np.bool_)
    kept = _take(masks, owner, room, full, take)
    if kept == 0:
        return None
    keep = np.zeros(num_nodes, dtype=np.bool_)
    keep[cands[take]] = True
    return pm, bounds, keep, kept, top - room


@numba.njit(parallel=True, cache=True)
def _spans(pm, keep, bounds, first, last):
    """``first[u]``, ``last[u]``: the first and last step reading each kept row ``u``
    (``-1`` for the others), row block by row block."""
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            if keep[u]:
                first[u], last[u] = _first_last(pm[u])
            else:
                first[u], last[u] = -1, -1


def choose_kept_rows(t_ptr: np.ndarray, t_ids: np.ndarray, num_nodes: int, extra: int,
                     part_ptr: np.ndarray | None = None) -> KeptRows | None:
    r"""Which rows to keep through their gap steps, without extending the sets.

    The selection of :func:`keep_reused_rows` (same arguments), as the steps
    spanned by each kept row: :func:`~hongtu.dedup.plan_transfers` assigns
    slots on the sets as they are, loading a kept row at its first read and
    flushing it after its last (the same loads, flushes and slots as on the
    extended sets, without writing them). ``None`` when no row is kept.
    """
    picked = _select(t_ptr, t_ids, num_nodes, extra, part_ptr)
    if picked is None:
        return None
    pm, bounds, keep, kept, sizes = picked
    first = np.empty(num_nodes, dtype=np.int32)
    last = np.empty(num_nodes, dtype=np.int32)
    _spans(pm, keep, bounds, first, last)
    return KeptRows(first, last, sizes, kept)


def keep_reused_rows(t_ptr: np.ndarray, t_ids: np.ndarray, num_nodes: int, extra: int,
                     part_ptr: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    r"""Resident sets that keep the most reused rows through their gaps.

    Args:
        t_ptr, t_ids: the resident sets step by step (CSR; each sorted).
        num_nodes: ``|V|``.
        extra: slots each device may add to its largest resident set.
        part_ptr: with several devices, device ``d`` holds the rows
            ``[part_ptr[d], part_ptr[d+1])`` of every set and gets its own
            ``extra``; ``None``: one device holds all.

    Returns:
        ``(ptr, ids, kept)``: the extended sets (each a sorted superset of
        the input's) and how many rows are kept through a gap.

    Memory: a mask of the steps reading each row (8 bytes per row and 64
    steps) and one of each candidate's gap steps (as many per candidate).
    The planner uses :func:`choose_kept_rows`, which makes the same choice
    without writing the extended sets.
    """
    t_ptr = np.ascontiguousarray(t_ptr, dtype=_I64)
    t_ids = np.ascontiguousarray(t_ids)
    picked = _select(t_ptr, t_ids, num_nodes, extra, part_ptr)
    if picked is None:
        return t_ptr, t_ids, 0
    pm, bounds, keep, kept, _ = picked
    num_steps = t_ptr.shape[0] - 1
    # Each step's set with the kept rows passing through it, in one transposition.
    offs = np.zeros((bounds.shape[0] - 1, num_steps), dtype=_I64)
    none = np.empty(0, dtype=t_ids.dtype)
    _extended(pm, keep, bounds, offs, none, False)
    new_ptr = np.zeros(num_steps + 1, dtype=_I64)
    np.cumsum(offs.sum(axis=0), out=new_ptr[1:])
    offs = np.cumsum(offs, axis=0) - offs + new_ptr[:-1]
    new_ids = np.empty(int(new_ptr[-1]), dtype=t_ids.dtype)
    _extended(pm, keep, bounds, offs, new_ids, True)
    return new_ptr, new_ids, kept
