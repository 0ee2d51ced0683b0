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

from hongtu.graph.transforms import merge_unique, transpose_fill

__all__ = ["keep_reused_rows", "row_presence"]

_I64 = np.int64


def row_presence(t_ptr: np.ndarray, t_ids: np.ndarray,
                 num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Transpose of the resident sets: ``(ptr, steps)``, the steps that read each row, ascending."""
    counts = np.bincount(np.asarray(t_ids, dtype=_I64), minlength=num_nodes)
    pres_ptr = np.zeros(num_nodes + 1, dtype=_I64)
    np.cumsum(counts, out=pres_ptr[1:])
    pres_steps = np.empty(int(pres_ptr[-1]), dtype=np.int32)
    if pres_steps.size:
        transpose_fill(np.ascontiguousarray(t_ptr, dtype=_I64), np.ascontiguousarray(t_ids),
                       pres_ptr, pres_steps)
    return pres_ptr, pres_steps


@numba.njit(cache=True)
def _runs_and_gaps(pres_ptr, pres_steps, runs, gaps):
    for u in range(pres_ptr.shape[0] - 1):
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


@numba.njit(cache=True)
def _greedy(cands, pres_ptr, pres_steps, owner, room, keep):
    """Keep each candidate, in order, whose gap steps all have a free slot left."""
    kept = 0
    for u in cands:
        d = owner[u]
        a, b = pres_ptr[u], pres_ptr[u + 1]
        fits = True
        for t in range(a + 1, b):
            for s in range(pres_steps[t - 1] + 1, pres_steps[t]):
                if room[d, s] <= 0:
                    fits = False
                    break
            if not fits:
                break
        if not fits:
            continue
        for t in range(a + 1, b):
            for s in range(pres_steps[t - 1] + 1, pres_steps[t]):
                room[d, s] -= 1
        keep[u] = True
        kept += 1
    return kept


@numba.njit(cache=True)
def _gap_rows(pres_ptr, pres_steps, keep, ptr, out):
    """CSR over steps of the kept rows passing through each step (not reading it).

    With ``out`` empty only counts into ``ptr[1:]``; then fills ``out`` at
    ``ptr``. Rows are visited in id order, so every step's list is sorted.
    """
    counting = out.shape[0] == 0
    fill = ptr[:-1].copy()
    for u in range(keep.shape[0]):
        if keep[u]:
            for t in range(pres_ptr[u] + 1, pres_ptr[u + 1]):
                for s in range(pres_steps[t - 1] + 1, pres_steps[t]):
                    if counting:
                        ptr[s + 1] += 1
                    else:
                        out[fill[s]] = u
                        fill[s] += 1


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
    # Saving per slot spent, best first; a stable sort keeps ties in id order.
    score = (runs[cands] - 1) / gaps[cands]
    cands = cands[np.argsort(-score, kind="stable")]
    # Set sizes per device and step: room = largest + extra - this one.
    sizes = np.empty((devices, num_steps), dtype=_I64)
    for s in range(num_steps):
        seg = t_ids[t_ptr[s]:t_ptr[s + 1]]
        cut = np.searchsorted(seg, part_ptr)
        sizes[:, s] = np.diff(cut)
    room = sizes.max(axis=1, keepdims=True) + int(extra) - sizes
    owner = (np.searchsorted(part_ptr, np.arange(num_nodes), side="right") - 1).astype(_I64)
    keep = np.zeros(num_nodes, dtype=np.bool_)
    kept = int(_greedy(cands, pres_ptr, pres_steps, owner, room, keep))
    if kept == 0:
        return t_ptr, t_ids, 0
    # Each step's set merged with the kept rows passing through it.
    gap_ptr = np.zeros(num_steps + 1, dtype=_I64)
    _gap_rows(pres_ptr, pres_steps, keep, gap_ptr, t_ids[:0])
    np.cumsum(gap_ptr, out=gap_ptr)
    gap_ids = np.empty(int(gap_ptr[-1]), dtype=t_ids.dtype)
    _gap_rows(pres_ptr, pres_steps, keep, gap_ptr, gap_ids)
    new_ptr = t_ptr + gap_ptr  # the two lists of a step are disjoint
    new_ids = np.empty(int(new_ptr[-1]), dtype=t_ids.dtype)
    counts = np.empty(num_steps, dtype=_I64)
    merge_unique(t_ptr, t_ids, gap_ptr, gap_ids, counts, new_ptr, new_ids, True)
    return new_ptr, new_ids, kept
