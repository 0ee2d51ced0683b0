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

The result is a new list of resident sets (each batch's set plus the kept
rows passing through it); :func:`~hongtu.dedup.plan_transfers` assigns
slots on it exactly as without caching, and the engine executes it
unchanged.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["keep_reused_rows", "row_presence"]

_I64 = np.int64
_U64 = np.uint64
# De Bruijn multiplier: (lowest set bit * _DEBRUIJN) >> 58 indexes _BIT_OF.
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_BIT_OF = np.zeros(64, dtype=np.int64)
_BIT_OF[((np.uint64(1) << np.arange(64, dtype=np.uint64)) * _DEBRUIJN) >> np.uint64(58)] = \
    np.arange(64)


def _row_blocks(num_nodes: int) -> np.ndarray:
    """Contiguous row ranges for the parallel kernels (a few per thread)."""
    blocks = max(1, min(num_nodes, 4 * numba.get_num_threads()))
    return np.linspace(0, num_nodes, blocks + 1).astype(_I64)


@numba.njit(parallel=True, cache=True)
def _presence(t_ptr, t_ids, bounds, ptr, cursor, steps, fill):
    """Count (``fill`` false, into ``ptr[1:]``) or write the steps reading each row.

    Every block of rows finds its piece of each (sorted) set by binary search,
    so blocks write disjoint rows and each row's steps come out ascending.
    """
    for w in numba.prange(bounds.shape[0] - 1):
        r0, r1 = bounds[w], bounds[w + 1]
        for s in range(t_ptr.shape[0] - 1):
            seg = t_ids[t_ptr[s]:t_ptr[s + 1]]
            for k in range(np.searchsorted(seg, r0), np.searchsorted(seg, r1)):
                u = seg[k]
                if fill:
                    steps[cursor[u]] = s
                    cursor[u] += 1
                else:
                    ptr[u + 1] += 1


def row_presence(t_ptr: np.ndarray, t_ids: np.ndarray,
                 num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Transpose of the resident sets: ``(ptr, steps)``, the steps that read each row, ascending."""
    t_ptr = np.ascontiguousarray(t_ptr, dtype=_I64)
    t_ids = np.ascontiguousarray(t_ids)
    bounds = _row_blocks(num_nodes)
    pres_ptr = np.zeros(num_nodes + 1, dtype=_I64)
    none = np.empty(0, dtype=np.int32)
    _presence(t_ptr, t_ids, bounds, pres_ptr, pres_ptr, none, False)
    np.cumsum(pres_ptr, out=pres_ptr)
    pres_steps = np.empty(int(pres_ptr[-1]), dtype=np.int32)
    _presence(t_ptr, t_ids, bounds, pres_ptr, pres_ptr[:-1].copy(), pres_steps, True)
    return pres_ptr, pres_steps


@numba.njit(parallel=True, cache=True)
def _runs_and_gaps(pres_ptr, pres_steps, runs, gaps):
    for u in numba.prange(pres_ptr.shape[0] - 1):
        a, b = pres_ptr[u], pres_ptr[u + 1]
        r = 0
        g = 0
        for t in range(a + 1, b):
            d = pres_steps[t] - pres_steps[t - 1]
            if d > 1:
                r += 1
                g += d - 1
        runs[u] = r + 1 if b > a else 0
        gaps[u] = g


@numba.njit(parallel=True, cache=True)
def _gap_masks(cands, pres_ptr, pres_steps, masks):
    """Bit ``s`` of ``masks[j]``: candidate ``cands[j]`` passes step ``s`` unread."""
    one = np.uint64(1)
    for j in numba.prange(cands.shape[0]):
        u = cands[j]
        for t in range(pres_ptr[u] + 1, pres_ptr[u + 1]):
            for s in range(pres_steps[t - 1] + 1, pres_steps[t]):
                masks[j, s >> 6] |= one << np.uint64(s & 63)


@numba.njit(cache=True)
def _counting_order(keys, num_keys):
    """Stable order of ``keys`` (ascending, each in ``[0, num_keys)``)."""
    start = np.zeros(num_keys + 1, dtype=np.int64)
    for k in keys:
        start[k + 1] += 1
    for k in range(num_keys):
        start[k + 1] += start[k]
    order = np.empty(keys.shape[0], dtype=np.int64)
    for j in range(keys.shape[0]):
        order[start[keys[j]]] = j
        start[keys[j]] += 1
    return order


@numba.njit(parallel=True, cache=True)
def _take_rows(a, idx):
    out = np.empty((idx.shape[0], a.shape[1]), dtype=a.dtype)
    for i in numba.prange(idx.shape[0]):
        out[i] = a[idx[i]]
    return out


@numba.njit(cache=True)
def _greedy(masks, owner, room, full, bit_of, take):
    """Take each candidate, in order, whose gap steps all have a free slot left.

    ``full[d]`` marks the steps of device ``d`` with none, so a candidate is
    checked in one AND per 64 steps; a taken one spends a slot at each of its
    gap steps.
    """
    zero = np.uint64(0)
    shift = np.uint64(58)
    kept = 0
    for i in range(masks.shape[0]):
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
            while m != zero:
                low = m & (zero - m)
                s = w * 64 + bit_of[(low * _DEBRUIJN) >> shift]
                room[d, s] -= 1
                if room[d, s] <= 0:
                    full[d, w] |= low
                m ^= low
    return kept


@numba.njit(parallel=True, cache=True)
def _extended(pres_ptr, pres_steps, keep, bounds, offs, out, fill):
    """Count (``fill`` false) or write each step's extended set per block of rows.

    A kept row is in every step from its first read to its last, any other
    row in the steps that read it. ``offs[w, s]`` counts, or is the next
    position of, block ``w``'s rows in step ``s``; blocks are in row order,
    so every set comes out sorted.
    """
    for w in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[w], bounds[w + 1]):
            a, b = pres_ptr[u], pres_ptr[u + 1]
            if a == b:
                continue
            if keep[u]:
                for s in range(pres_steps[a], pres_steps[b - 1] + 1):
                    if fill:
                        out[offs[w, s]] = u
                    offs[w, s] += 1
            else:
                for t in range(a, b):
                    s = pres_steps[t]
                    if fill:
                        out[offs[w, s]] = u
                    offs[w, s] += 1


def _score_order(runs: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Candidates best first by ``runs / gaps`` (runs here already minus one), ties by position.

    A stable counting sort on the rank of each (runs, gaps) pair's value: the
    pairs are few (both below the step count), the candidates many.
    """
    width = int(gaps.max()) + 1
    pair = runs * width + gaps
    present = np.flatnonzero(np.bincount(pair, minlength=1))
    # Equal fractions are equal doubles (division is correctly rounded): one rank.
    values = (present // width) / (present % width)
    uniq, rank = np.unique(-values, return_inverse=True)
    key = np.zeros(int(pair.max()) + 1, dtype=_I64)
    key[present] = rank
    return _counting_order(key[pair], uniq.shape[0])


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
    """
    t_ptr = np.ascontiguousarray(t_ptr, dtype=_I64)
    t_ids = np.ascontiguousarray(t_ids)
    num_steps = t_ptr.shape[0] - 1
    if extra <= 0 or num_steps < 3 or t_ids.size == 0:
        return t_ptr, t_ids, 0
    part_ptr = np.array([0, num_nodes], dtype=_I64) if part_ptr is None \
        else np.asarray(part_ptr, dtype=_I64)
    devices = part_ptr.shape[0] - 1
    pres_ptr, pres_steps = row_presence(t_ptr, t_ids, num_nodes)
    runs = np.empty(num_nodes, dtype=_I64)
    gaps = np.empty(num_nodes, dtype=_I64)
    _runs_and_gaps(pres_ptr, pres_steps, runs, gaps)
    cands = np.flatnonzero(runs > 1)
    if cands.size == 0:
        return t_ptr, t_ids, 0
    # Saving per slot spent, best first; ties in id order.
    order = _score_order(runs[cands] - 1, gaps[cands])
    masks = np.zeros((cands.shape[0], (num_steps + 63) // 64), dtype=_U64)
    _gap_masks(cands, pres_ptr, pres_steps, masks)  # in id order: reads stream
    masks = _take_rows(masks, order)
    cands = cands[order]
    # Set sizes per device and step: room = largest + extra - this one.
    sizes = np.empty((devices, num_steps), dtype=_I64)
    for s in range(num_steps):
        seg = t_ids[t_ptr[s]:t_ptr[s + 1]]
        sizes[:, s] = np.diff(np.searchsorted(seg, part_ptr))
    room = sizes.max(axis=1, keepdims=True) + int(extra) - sizes
    full = np.zeros((devices, masks.shape[1]), dtype=_U64)
    for d, s in zip(*np.nonzero(room <= 0)):
        full[d, s >> 6] |= _U64(1) << _U64(s & 63)
    owner = np.searchsorted(part_ptr, cands, side="right").astype(_I64) - 1
    take = np.zeros(cands.shape[0], dtype=np.bool_)
    kept = int(_greedy(masks, owner, room, full, _BIT_OF, take))
    if kept == 0:
        return t_ptr, t_ids, 0
    keep = np.zeros(num_nodes, dtype=np.bool_)
    keep[cands[take]] = True
    # Each step's set with the kept rows passing through it, in one transposition.
    bounds = _row_blocks(num_nodes)
    offs = np.zeros((bounds.shape[0] - 1, num_steps), dtype=_I64)
    none = np.empty(0, dtype=t_ids.dtype)
    _extended(pres_ptr, pres_steps, keep, bounds, offs, none, False)
    new_ptr = np.zeros(num_steps + 1, dtype=_I64)
    np.cumsum(offs.sum(axis=0), out=new_ptr[1:])
    offs = np.cumsum(offs, axis=0) - offs + new_ptr[:-1]
    new_ids = np.empty(int(new_ptr[-1]), dtype=t_ids.dtype)
    _extended(pres_ptr, pres_steps, keep, bounds, offs, new_ids, True)
    return new_ptr, new_ids, kept
