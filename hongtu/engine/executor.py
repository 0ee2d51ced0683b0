r"""The batch executor: one training step of full-graph GNN training, chunk by chunk.

Follows HongTu Algorithm 1 (DESIGN.md §1) on one device, executing a
deduplicated transfer plan (:class:`hongtu.dedup.DevicePlan`):

* forward, layer by layer and step by step: bring the step's new neighbour
  rows ``𝕅^cpu`` from host into their slots of the device transition buffer
  (rows shared with the previous step stay in place), gather each chunk's
  ``h^l[N_c]`` from the buffer, compute layer ``l``, write ``h^{l+1}[V_c]`` —
  and, for cacheable layers, the aggregate ``a^l[V_c]`` — back to host;
* at the last layer, the loss of the chunk's train vertices (cross-entropy,
  normalised by the total train count) and its gradient ``∇h^L[V_c]``;
* backward, layer by layer and in the same step order: load the checkpoint
  (``a^l[V_c]`` for cacheable layers; the neighbour rows, with the same
  reuse, otherwise) and ``∇h^{l+1}[V_c]``, recompute the layer under
  autograd, backward, accumulate the neighbours' gradients at their slots on
  the device while the rows stay resident, and flush rows that leave into the
  host ``∇h^l``.

Where a layer's rows fit the device row memory whole, its passes move them in
one copy each way, and a training step hands what the next pass reads on the
device instead of through host memory: the loss gradient, ``∇h^1`` and
``h^1`` (:func:`gradients_kept`, :func:`rows_kept_at`). A last layer that
only adds a bias after a weight-first aggregation stores no aggregate
(:meth:`~hongtu.nn.model.GNN.stored_aggregates`).

Parameter gradients accumulate over chunks, so after :meth:`Executor.step`
they are exactly the full-graph gradients; the caller takes the optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numba
import numpy as np
import torch
from torch import Tensor

from hongtu.config import EngineConfig
from hongtu.dedup import DevicePlan
from hongtu.engine.budget import (
    aggregate_positions_bytes,
    aggregates_in_place,
    first_layer_may_fold,
    first_layer_stores,
    flush_piece_rows,
    flush_piece_spare,
    kept_graph_layers,
    plan_loads,
    row_memory,
    slot_widths,
    whole_layer_needs,
)
from hongtu.engine.buffers import HostBuffers, available_host_memory
from hongtu.engine.chunks import ChunkSet
from hongtu.engine.comm import Comm
from hongtu.engine.pinned import pinned_copies, pinned_tensor
from hongtu.engine.transfer import (
    IndexRing,
    Mover,
    Ticket,
    add_rows,
    engine_kernels,
    pin_blocks,
)
from hongtu.graph import Graph
from hongtu.graph.transforms import has_self_loops
from hongtu.nn import ops
from hongtu.nn.block import Block
from hongtu.nn.model import GNN, layer_seed

__all__ = ["Executor", "StepResult"]


@dataclass
class StepResult:
    """What one pass over the graph produced."""

    loss: float = 0.0
    correct: dict | None = None
    total: dict | None = None

    def accuracy(self, split: str) -> float:
        t = self.total.get(split, 0) if self.total else 0
        return self.correct[split] / t if t else float("nan")


@numba.njit(cache=True)
def _first_flushes_first(ids, ptr, seen, own_step, written, order, split):
    """Per step, the positions of rows whose flush may be written, then the others
    (each group in plan order); ``split[s]`` ends step ``s``'s first group.

    A flush may be written when nothing reached the row's gradient before: it is
    the row's first flush in the pass and its own chunk (which adds the row's
    own-row gradient, ``own_step``) has not run yet. Marks flushed rows in
    ``seen`` and written ones in ``written``.
    """
    for s in range(ptr.shape[0] - 1):
        o = ptr[s]
        for t in range(ptr[s], ptr[s + 1]):
            if not seen[ids[t]] and own_step[ids[t]] > s:
                order[o] = t
                written[ids[t]] = True
                o += 1
        split[s] = o
        for t in range(ptr[s], ptr[s + 1]):
            if seen[ids[t]] or own_step[ids[t]] <= s:
                order[o] = t
                o += 1
        for t in range(ptr[s], ptr[s + 1]):
            seen[ids[t]] = True


def layers_moved_whole(num_rows: int, widths: list[int], memory: int, load_rows: int,
                       exchange: bool, first_rows: int | None = None,
                       first_stores: int = 0) -> list[bool]:
    """Which layers' passes move all of ``h^l`` (and ``∇h^l``) in one contiguous
    copy each instead of the plan's neighbour rows: those that should
    (:func:`~hongtu.engine.budget.whole_layer_needs`, with ``first_rows`` and
    ``first_stores``) and fit the device row memory (``memory`` elements,
    :func:`~hongtu.engine.budget.row_memory`)."""
    return [n is not None and n <= int(memory)
            for n in whole_layer_needs(num_rows, widths, load_rows, exchange, first_rows,
                                       first_stores)]


def gradients_kept(whole: list[bool], cached: list[bool], widths: list[int],
                   num_rows: int = 0, twin: int = 0) -> list[bool]:
    """For ``l = 0 .. L``: whether ``∇h^l`` stays in device memory from the
    pass that makes it to the pass that reads it (no store, no load).

    ``widths`` are the rows' widths (``L + 1``). The loss gradient ``∇h^L``
    when the last layer (not the first: its whole rows have no gradient half)
    moves whole and is cached: its backward reads no rows, so the rows' half of
    the row memory collects ``∇h^{L-1}`` and the other half holds ``∇h^L``
    from the forward pass. ``∇h^1`` when layer 1 moves
    whole and layer 0 is cached: layer 0's backward uses no row memory
    (its inputs carry no gradient), so layer 1's gradients stay where they
    were added up. ``∇h^l`` of a later layer moving whole when layer ``l-1``
    is cached and moves the plan's rows: its backward reads no rows, so it
    leaves the transition buffer (the first ``twin`` elements of the row
    memory) alone and adds its gradients up in the twin after it; ``∇h^l``
    stays where it was added up if that lies within the first ``twin``
    elements (``num_rows`` rows: ``[0, n·w)`` for the last layer when
    ``∇h^L`` is kept, else ``[n·w, 2·n·w)``).
    """
    L = len(widths) - 1
    kept = [False] * (L + 1)
    if L > 1:
        kept[L] = whole[L - 1] and cached[L - 1] and widths[L] <= widths[L - 1]
        kept[1] = whole[1] and cached[0]
    for l in range(2, L):
        end = num_rows * widths[l] * (1 if l == L - 1 and kept[L] else 2)
        kept[l] = whole[l] and cached[l - 1] and not whole[l - 1] and 0 < end <= twin
    return kept


def gradients_held(widths: list[int], whole: list[bool], cached: list[bool], num_rows: int,
                   twin: int) -> bool:
    """Whether layer 1's backward leaves the gradients of the rows its last step
    flushes (every row it still holds: a transition buffer's worth, after the
    pass's compute, the link's one direction alone) in the gradient twin of the
    row memory, for the first layer's backward to add into the chunks of
    ``∇h^1`` it reads, instead of sending them through host memory. Layer 1
    moves the plan's rows; layer 0's backward adds no gradients up (its inputs
    carry none) and leaves the twin alone unless it reloads its rows whole
    past the transition buffer (``twin`` elements; not cached, wider)."""
    return (len(widths) > 2 and not whole[1]
            and (cached[0] or not whole[0] or num_rows * widths[0] <= twin))


def first_backward_in_flushes(model: GNN, cached: list[bool], whole: list[bool],
                              kept: list[bool], own: bool, direct: bool = False) -> bool:
    """Whether layer 1's backward pass also takes the first layer's parameter
    gradients, from every gradient row it flushes, so that ``∇h^1`` never goes
    to host memory and the first layer has no backward pass of its own.

    The first layer's backward needs no gradient of its inputs: a cached
    layer reading no own rows (GCN) runs only its update's backward there,
    from its stored aggregate ``a^0[V]`` and ``∇h^1[V]``. The update is
    row-wise and its parameter gradients linear in ``∇h^1``, so each flushed
    partial gradient ``g`` of rows ``R`` contributes the update's backward at
    ``(a^0[R], g)``, whichever chunk added it: the same sum, without writing
    ``∇h^1`` (its rows, flushed once or more) and reading it back with
    ``a^0`` (every row). ``a^0[R]`` is gathered instead (narrower rows, on
    GPUs zero-copy from pinned host memory).

    Needs every part of ``∇h^1`` to pass through layer 1's flushes: layer 1
    moves the plan's rows (``whole``), its gradients are not kept on the
    device (``kept``), and its own rows' gradients, if it reads them, are
    added at their slots (``own``: every chunk reads its own rows among its
    sources). Not in resident mode on one device (``direct``: no flushes).
    """
    if direct or not first_layer_may_fold(model):
        return False
    return bool(cached[0] and not whole[1] and not kept[1]
                and (own or not model.layers[1].needs_dst))


def held_rows(plan: DevicePlan) -> int:
    """Rows a plan's last step flushes (:func:`gradients_held`)."""
    p = plan.flush_ptr
    return int(p[-1] - p[-2]) if plan.num_steps else 0


def reads_rows_once(model: GNN, checkpoint: str) -> list[bool]:
    """Layers that read their rows ``h^l`` in the forward pass's aggregation
    only: cached (backward reads no rows) and not reading their own rows."""
    return [c and not layer.needs_dst
            for c, layer in zip(model.cached_layers(checkpoint), model.layers)]


def first_layer_busy(num_rows: int, widths: list[int], buffer_rows: int, stage_rows: int,
                     whole: bool, layer: int = 0) -> list[tuple[int, int]]:
    """The row memory the first layer's (or ``layer``'s) forward pass uses, as
    ``[a, b)`` element ranges: all its rows when it moves whole, else its
    transition buffer (at the start) and the staging of its next step's rows
    (after both twins)."""
    if whole:
        return [(0, num_rows * widths[layer])]
    rows = max(int(buffer_rows), 1)
    twins = row_memory(rows, widths)
    return [(0, rows * widths[layer])] + ([(twins, twins + int(stage_rows) * max(widths))]
                                          if stage_rows else [])


def grads_beside(at: int, size: int) -> int:
    """Where the gradients of ``size`` elements of rows kept at ``at`` go: the
    start of the row memory when the rows leave room there, else right after
    them (:func:`rows_kept_at`)."""
    return 0 if at >= size else at + size


def rows_kept_at(num_rows: int, widths: list[int], memory: int, whole: list[bool],
                 read_once: list[bool], busy: list[tuple[int, int]],
                 layer: int = 1) -> int | None:
    """Where ``h^1`` (or ``h^layer``) may stay in the row memory from the
    forward pass before its layer to that layer's (element offset), or ``None``.

    Only for a layer that moves whole and reads its rows only there
    (``read_once``: cached, its own rows not read; :func:`reads_rows_once`):
    nothing reads the host copy of its rows then. Its rows go
    to the first place, after the start or after a range the pass before
    uses (``busy``, :func:`first_layer_busy`), where they fit beside that
    range and leave room for their gradients: ``[0, n)`` when the rows start
    past it, else right after them.
    """
    if len(widths) < 3 or not whole[layer] or not read_once[layer]:
        return None
    size = num_rows * widths[layer]
    for a in sorted({0, size} | {b for _, b in busy}):
        grads = grads_beside(a, size)
        if (max(a, grads) + size <= memory
                and all(a + size <= x or a >= y for x, y in busy)):
            return a
    return None


def first_layer_rows(plan: DevicePlan, widths: list[int], cached: list[bool],
                     overlapped: bool) -> tuple[int | None, int]:
    """``(first_rows, first_stores)`` for :func:`~hongtu.engine.budget.whole_layer_needs`:
    the rows the plan's first step loads and the elements per row the first
    layer's forward pass stores, when loads and stores overlap; else ``(None,
    0)``: copies run one after another, and the fewer bytes win."""
    if not overlapped:
        return None, 0
    rows = int(plan.load_ptr[1] - plan.load_ptr[0]) if plan.num_steps else 0
    return rows, first_layer_stores(widths, cached)


@dataclass(frozen=True)
class Handoffs:
    """What a step keeps in the device row memory beyond the plan's rows."""

    #: ``whole[l]``: layer ``l`` moves all its rows per pass (:func:`layers_moved_whole`)
    whole: list[bool]
    #: ``kept[l]``: ``∇h^l`` stays on the device between passes (:func:`gradients_kept`)
    kept: list[bool]
    #: where ``h^m`` (``m``: :attr:`rows_layer`) stays between the forward passes
    #: of layers ``m - 1`` and ``m``, or ``None`` (:func:`rows_kept_at`)
    rows_at: int | None
    #: ``1``, or the last layer where the rows kept are its own
    rows_layer: int = 1
    #: layer 1's backward leaves its last step's gradients on the device for
    #: layer 0's (:func:`gradients_held`)
    held: bool = False

    @property
    def kept_layer(self) -> int | None:
        """The layer whose rows stay between forward passes (:attr:`rows_layer`),
        or ``None``."""
        return self.rows_layer if self.rows_at is not None else None


def plan_handoffs(num_rows: int, widths: list[int], memory: int, plan: DevicePlan,
                  stage_rows: int, exchange: bool, cached: list[bool], read_once: list[bool],
                  enabled: bool = True, overlapped: bool = False) -> Handoffs:
    """The :class:`Handoffs` of a row memory of ``memory`` elements with ``plan``'s
    transition buffer and ``stage_rows`` staging rows (the executor's, the
    Trainer's host buffers and ``hongtu report`` all take them from here);
    ``enabled`` false (no whole layers): none. ``overlapped``: loads and stores
    run at once (a GPU with ``engine.overlap``), so the first layer moves whole
    only where its pass is shorter by link time; otherwise wherever its plan
    loads more (:func:`first_layer_rows`)."""
    whole = layers_moved_whole(num_rows, widths, memory, int(plan.load_ids.shape[0]),
                               exchange, *first_layer_rows(plan, widths, cached, overlapped)) \
        if enabled else [False] * (len(widths) - 1)
    busy = first_layer_busy(num_rows, widths, plan.buffer_rows, stage_rows, whole[0])
    twin = max(int(plan.buffer_rows), 1) * max(widths)  # (the transition buffer)
    kept = gradients_kept(whole, cached, widths, num_rows, twin)
    at, m = rows_kept_at(num_rows, widths, memory, whole, read_once, busy), 1
    L = len(widths) - 1
    if at is None and L > 2:
        # else the last layer's rows, where its forward pass reads them from the
        # pass before, where they leave that pass's memory alone
        m = L - 1
        busy = first_layer_busy(num_rows, widths, plan.buffer_rows, stage_rows,
                                whole[m - 1], m - 1)
        at = rows_kept_at(num_rows, widths, memory, whole, read_once, busy, layer=m)
        if at is not None and kept[m]:
            # its gradients, added up over the rows (∇h^L kept) or beside them,
            # go where the layer before reads them (kept_grads_at): not across
            size = num_rows * widths[m]
            src = at if kept[L] else grads_beside(at, size)
            dst = kept_grads_at(num_rows, widths, kept, m)
            if src != dst and src < dst + size and dst < src + size:
                at = None
    return Handoffs(whole, kept, at, m, gradients_held(widths, whole, cached, num_rows, twin))


def kept_grads_at(num_rows: int, widths: list[int], kept: list[bool], l: int,
                  end: int | None = None, src: int = 0) -> int:
    """Where in the row memory the backward pass of layer ``l - 1`` reads a kept
    ``∇h^l`` of a layer ``l >= 2`` (element offset, :func:`gradients_kept`):
    the start when ``l`` is the last layer and ``∇h^L`` is kept, else after
    ``n`` rows of ``h^l``. With ``end`` (the transition buffer's elements) and
    ``src`` (where that last layer's backward added them up), the buffer's
    last elements instead, where they do not cover ``src``'s: its first rows
    stay free for the next forward's first rows (``Executor._prefetch``)."""
    L = len(widths) - 1
    size = num_rows * widths[l]
    if not (l == L - 1 and kept[L]):
        return size
    at = -1 if end is None else end - size
    return at if at >= 0 and (at == src or at >= src + size or at + size <= src) else 0


#: the ordered copy of the inputs may take at most this share of the available host memory
_HOST_SHARE = 0.8


def _rows_in_order(h: Tensor, ids: np.ndarray, pin: bool) -> Tensor:
    """``h[ids]`` as a new host tensor (pinned with ``pin``)."""
    shape = (int(ids.shape[0]), int(h.shape[1]))
    out = pinned_tensor(shape, h.dtype) if pin else torch.empty(shape, dtype=h.dtype)
    torch.index_select(h, 0, torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
                       out=out)
    return out


def first_in_place(plan: DevicePlan) -> bool:
    """Whether ``plan``'s first step loads its rows into slots ``0..n-1`` in
    order (one contiguous copy can bring them straight into the buffer)."""
    n0 = int(plan.load_ptr[1]) if plan.num_steps else 0
    return bool(np.array_equal(np.asarray(plan.load_slots[:n0]), np.arange(n0)))


def ordered_row_layers(plan: DevicePlan, whole: list[bool], once: list[bool],
                       enabled: bool = True) -> list[bool]:
    """Per layer ``m``: whether a training forward pass may write ``h^m`` in the
    order ``plan`` first loads its rows (the executor's ``ordered_rows``; host
    room aside): a later layer (not the first) that reads its rows only
    through its loads (``once``, :func:`reads_rows_once`) and moves the plan's
    rows (not ``whole``), where the first step's rows land in slots ``0..n-1``."""
    ok = enabled and first_in_place(plan)
    return [ok and m > 0 and once[m] and not whole[m] for m in range(len(whole))]


def first_loaded_rows(plan: DevicePlan) -> int:
    """The distinct rows ``plan`` loads."""
    return plan_loads([plan])[1]


def first_load_index_bytes(plan: DevicePlan, max_chunk_rows: int, slot_bytes: int = 0) -> int:
    """Device bytes the index arrays of rows written in first-load order (a GPU,
    :class:`_FirstLoads`) add: two slots each for a chunk's (where its rows go,
    which rows) and a step's (rows loaded again, the slots of its loads), int64
    — none when one of each fits ``slot_bytes``, the size of each of the
    Mover's two gradient slots, which forward passes leave unused
    (:meth:`~hongtu.engine.transfer.Mover.forward_spare`)."""
    p = np.asarray(plan.load_ptr, dtype=np.int64)
    step = int(2 * np.diff(p)[1:].max()) if plan.num_steps > 1 else 0
    arrays = 8 * (2 * int(max_chunk_rows) + step)
    return 0 if arrays <= slot_bytes else 2 * arrays


def ordered_rows_room(plan: DevicePlan, once: list[bool], enabled: bool, left: int | None,
                      max_chunk_rows: int, slot_bytes: int) -> int | None:
    """Device bytes for writing rows in first-load order (its index arrays,
    :func:`first_load_index_bytes`) where some layer may (:func:`ordered_row_layers`,
    ``enabled``: a GPU with overlap, out of core) and the budget's leftover
    ``left`` holds them (``None``: no budget); else ``None``: rows are gathered."""
    if not enabled or not any(ordered_row_layers(plan, [False] * len(once), once)):
        return None
    need = first_load_index_bytes(plan, max_chunk_rows, slot_bytes)
    return need if left is None or need <= left else None


def first_load_host_bytes(plan: DevicePlan, rows: int = 0) -> int:
    """Host bytes (pinned on a GPU) of the index arrays of rows written in
    first-load order (:class:`_FirstLoads`, int64: each step's, the cids of
    its loads again and the slots of all its loads, and each chunk's, two per
    row it loads), and with ``rows`` (a process's own rows, where ``a^0`` is
    stored once: :class:`_AggregateLayout`) each chunk's order of its rows."""
    loads = int(plan.load_ids.shape[0])
    return 8 * (2 * loads + first_loaded_rows(plan) + int(rows))


def first_load_traffic(plan: DevicePlan, loaded: int) -> tuple[int, int]:
    """Bytes of those index arrays per pass (host→device, a GPU): ``(a pass that
    writes rows in first-load order, a pass that loads them)``, given the
    ``loaded`` distinct rows (:func:`first_loaded_rows`)."""
    loads = int(plan.load_ids.shape[0])
    first = int(plan.load_ptr[1]) if plan.num_steps else 0
    return 16 * loaded, 8 * (loads - first + loads - loaded)


@dataclass
class _FirstLoads:
    """A plan's loads in first-load order: the rows it loads, each once, in the
    order of their first load (``cid`` numbers them so), for rows a forward pass
    writes where the next layer's steps load them as one contiguous run each
    (a row's later loads, after it left the buffer, gather it from there).
    Index arrays are int64 host tensors (pinned for a GPU, which copies each
    to the device one batch ahead)."""

    #: rows loaded at all (``cid`` runs ``0 .. count-1``)
    count: int
    #: per step ``s``: its first loads are ``cid`` ``run[s] .. run[s+1]-1``
    run: np.ndarray
    #: per step: ``(again, ids)``: ``ids`` holds the ``cid`` of the step's
    #: ``again`` loads of rows loaded before (sorted), then the slots of all
    #: its loads, first loads first
    steps: list
    #: per chunk: its loaded rows' ``cid``, then which of the chunk's rows each
    #: is, in three groups each sorted by ``cid``: rows the first step does not
    #: load, rows it loads that a later step loads again, rows only it loads
    chunks: dict
    #: per chunk: the sizes of the first two groups (:attr:`chunks`)
    split: dict
    #: the rows loaded (ascending) and the ``cid`` of each
    rows: np.ndarray
    cid: np.ndarray
    #: per load of the plan: whether it is its row's first
    first: np.ndarray

    def largest(self) -> tuple[int, int]:
        """Elements of the longest chunk array and of the longest step array
        (steps after the first: the first loads all rows as one run)."""
        return (max((int(t.numel()) for t in self.chunks.values()), default=0),
                max((int(t.numel()) for _, t in self.steps[1:]), default=0))


def _first_loads(plan: DevicePlan, chunks: ChunkSet, pin: bool) -> _FirstLoads:
    """The :class:`_FirstLoads` of ``plan`` (host rows of ``chunks``)."""
    ids = np.asarray(plan.load_ids, dtype=np.int64) - chunks.row0
    slots = np.asarray(plan.load_slots, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    by_id = ids[order]
    starts = np.ones(by_id.shape[0], dtype=bool)
    starts[1:] = by_id[1:] != by_id[:-1]
    first = np.zeros(ids.shape[0], dtype=bool)
    first[order[starts]] = True  # (a stable sort: the earliest load of each row)
    uniq = by_id[starts]
    cid_of_uniq = (np.cumsum(first) - 1)[order[starts]]
    cid = cid_of_uniq[np.searchsorted(uniq, ids)]
    run = np.zeros(plan.num_steps + 1, dtype=np.int64)
    arrays = []
    for s in range(plan.num_steps):
        a, b = int(plan.load_ptr[s]), int(plan.load_ptr[s + 1])
        f = first[a:b]
        run[s + 1] = run[s] + int(f.sum())
        again = np.flatnonzero(~f)
        again = again[np.argsort(cid[a:b][again], kind="stable")]
        arrays.append((int(again.shape[0]),
                       np.concatenate([cid[a:b][again], slots[a:b][f], slots[a:b][again]])))
    reloaded = np.zeros(uniq.shape[0], dtype=bool)
    reloaded[cid[~first]] = True  # (rows loaded more than once)
    places, split = {}, {}
    for c in sorted({int(c) for c in plan.chunk_ids}):
        v0, v1 = chunks.range(c)
        a, b = np.searchsorted(uniq, [v0, v1])
        at, rows = cid_of_uniq[a:b], uniq[a:b] - v0
        group = np.where(at >= run[1], 0, np.where(reloaded[at], 1, 2))
        sort = np.lexsort((at, group))
        places[c] = np.concatenate([at[sort], rows[sort]])
        split[c] = (int((group == 0).sum()), int((group == 1).sum()))
    host = [torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
            for x in [a for _, a in arrays] + list(places.values())]
    if pin:
        host = pinned_copies(host)
    steps = [(again, t) for (again, _), t in zip(arrays, host)]
    return _FirstLoads(int(uniq.shape[0]), run, steps,
                       dict(zip(places, host[len(arrays):])), split, uniq, cid_of_uniq, first)


def aggregates_in_load_order(narrow: bool, into_first: bool) -> bool:
    """Whether a training forward pass stores the first layer's aggregates
    ``a^0`` once, where layer 1 loads them (:class:`_AggregateLayout`: the rows
    it loads in first-load order, then the others in row order), instead of
    in row order and the loaded rows again in first-load order: where layer
    1's rows are made from them (``narrow``, :func:`first_aggregates_ordered`)
    and the first layer's backward runs on layer 1's flushes (``into_first``,
    :func:`first_backward_in_flushes`), which gathers the flushed rows'
    aggregates through their positions (:func:`~hongtu.engine.budget.aggregate_positions_bytes`).
    Each chunk's aggregate goes out as one contiguous copy per step that
    first loads rows of it, and one for the rest (DMA on a GPU), compacted on
    the device first: ``|V|`` rows a pass instead of ``|V|`` and, again, the
    rows a step after the first loads, scattered row by row. GCN 3×256 on an H200
    (``bench/HISTORY.md``): the first layer's forward pass 30.5 against 52–60
    ms on products-like, epochs 0.194–0.213 against 0.216–0.221 s there and
    0.315–0.318 against 0.347 s on R-MAT 2^22."""
    return narrow and into_first


@dataclass
class _AggregateLayout:
    """Where a training forward pass stores the first layer's aggregates
    (:func:`aggregates_in_load_order`): row ``v``'s at ``pos[v]``."""

    #: per local row, its position (device; int32 on a GPU)
    pos: Tensor
    #: positions below this: the rows layer 1's first step loads
    first: int
    #: per chunk: its rows (local to the chunk) by position (pinned int64 on a GPU)
    orders: dict
    #: per chunk: its runs ``(position, offset in orders[c], rows)``, by position
    runs: dict


def _index_dtype(device: torch.device, n: int) -> torch.dtype:
    """The dtype of a device index array of ``n`` entries or values: int32 on
    a GPU where they fit, else int64."""
    return torch.int32 if device.type == "cuda" and n < 2**31 else torch.int64


def _aggregate_layout(fl: _FirstLoads, chunks: ChunkSet, n: int,
                      device: torch.device) -> _AggregateLayout:
    """The :class:`_AggregateLayout` of ``n`` local rows loaded as ``fl`` says."""
    pos = np.empty(n, dtype=np.int64)
    loaded = np.zeros(n, dtype=bool)
    loaded[fl.rows] = True
    pos[fl.rows] = fl.cid
    rest = np.flatnonzero(~loaded)
    pos[rest] = fl.count + np.arange(rest.shape[0])
    first = int(fl.run[1]) if fl.run.shape[0] > 1 else 0
    orders, runs = {}, {}
    for c in sorted(fl.chunks):
        v0, v1 = chunks.range(c)
        order = np.argsort(pos[v0:v1], kind="stable")
        at = pos[v0:v1][order]
        # (a run breaks where positions do and where the first step's end)
        cut = np.flatnonzero((np.diff(at) != 1) | (at[1:] == first)) + 1
        ends = np.concatenate([cut, [at.shape[0]]]) if at.shape[0] else cut
        starts = np.concatenate([[0], cut]) if at.shape[0] else cut
        runs[c] = [(int(at[a]), int(a), int(b - a)) for a, b in zip(starts, ends)]
        orders[c] = torch.from_numpy(order.astype(np.int64))
    if device.type == "cuda":
        orders = dict(zip(orders, pinned_copies(list(orders.values()))))
    return _AggregateLayout(torch.from_numpy(pos).to(device=device,
                                                     dtype=_index_dtype(device, n)),
                            first, orders, runs)


def backward_in_reverse(once: bool, comm, fits: bool = True) -> bool:
    """Whether layer 1's backward pass visits the plan's steps last to first,
    where the first layer's backward runs on its flushes and reads ``a^0``
    stored once in layer 1's load order (``once``,
    :func:`aggregates_in_load_order`), in one process (``comm`` is ``None``;
    with several, each rank would send received rows' gradients back at the
    step that received them: tried on two H200s, R-MAT 2^22 GCN 3×256 took
    0.197 against 0.190 s, one run each, and is not kept), and where its
    index arrays (:class:`_FoldOrder`) ``fits`` in the room the flush pieces
    can give (:func:`~hongtu.engine.budget.flush_piece_spare`: the estimate
    counts the pieces, not them).

    A row's residency is the same interval of steps whichever way they run,
    so the plan's slots hold: in reverse, the rows entering at a step are
    those it flushes in forward order, and the rows a step flushes are those
    it loads (a row's gradient is complete at its first use). The rows a
    step loads first lie in ``a^0``'s buffer as one run, so the first
    layer's backward brings their aggregates as one contiguous copy (DMA)
    and gathers only the rows loaded again (:class:`_FoldOrder`), instead of
    gathering every flushed row's from where it lies (zero-copy, which holds
    the GPU's SMs and is slower per byte on the link). GCN 3×256 on an H200
    (``bench/HISTORY.md``): the hidden layer's backward pass 80.6 against
    87.7 ms on products-like (the GPU busy 65 against 78 ms), epochs 0.189
    against 0.197 s; 134 against 140 ms on R-MAT 2^22, 0.311 against 0.316 s."""
    return bool(once and comm is None and fits)


def fold_fits(plan: DevicePlan, first_loads: int, w0: int, itemsize: int, max_rows: int,
              reserve: int, device: torch.device) -> bool:
    """Whether the index arrays of layer 1's reversed backward
    (:class:`_FoldOrder`: ``plan``'s loads, ``first_loads`` of them distinct)
    fit the room the flush pieces can give (their rows ``w0`` elements wide,
    ``max_rows`` the most a chunk has, ``reserve`` bytes taken from them
    already: :func:`~hongtu.engine.budget.flush_piece_spare`)."""
    loads = int(plan.load_ids.shape[0])
    return _FoldOrder.bytes_for(loads, loads - first_loads, device) \
        <= flush_piece_spare(w0, itemsize, max_rows, reserve)


def keeps_last_aggregate(reverse: bool, stored: list[bool]) -> bool:
    """Whether layer 1's aggregates of the training forward pass's last chunk
    stay on the device for its backward, which visits that chunk first
    (:func:`backward_in_reverse`): written into the device slot its load
    would land in, neither stored nor loaded (on R-MAT 2^22 GCN 3×256 the
    backward pass otherwise waits for that store, the last of the forward
    pass's, to load them back). Not where a later layer stores an aggregate
    too: its backward passes load theirs into those slots in between."""
    return bool(reverse and len(stored) > 1 and stored[1] and not any(stored[2:]))


@dataclass
class _FoldOrder:
    """The order of the rows layer 1's steps load, as its reversed backward
    flushes them (:func:`backward_in_reverse`): per step, the rows it loads
    first (their aggregates at positions ``run[s] .. run[s+1]-1`` of
    :class:`_FirstLoads`), then the rows it loads again."""

    #: per load in that order, its index among the plan's loads (device;
    #: int32 on a GPU)
    perm: Tensor
    #: the positions of the rows loaded again, in that order (device int64)
    again_pos: Tensor
    #: per step ``s``: its rows loaded again are ``again_pos[again_ptr[s]:again_ptr[s+1]]``
    again_ptr: np.ndarray

    def nbytes(self) -> int:
        """Device bytes of the arrays."""
        return sum(t.numel() * t.element_size() for t in (self.perm, self.again_pos))

    @staticmethod
    def bytes_for(loads: int, again: int, device: torch.device) -> int:
        """:meth:`nbytes` of a plan with ``loads`` loads, ``again`` of them again."""
        return loads * _index_dtype(device, loads).itemsize + 8 * again


def _fold_order(plan: DevicePlan, fl: _FirstLoads, row0: int,
                device: torch.device) -> _FoldOrder:
    """The :class:`_FoldOrder` of ``plan``'s loads (``fl``: their first loads;
    host rows from ``row0``)."""
    ptr = np.asarray(plan.load_ptr, dtype=np.int64)
    step = np.repeat(np.arange(plan.num_steps), np.diff(ptr))
    perm = np.lexsort((~fl.first, step))  # (stable: each kind in the plan's order)
    again = perm[~fl.first[perm]]
    ids = np.asarray(plan.load_ids, dtype=np.int64)[again] - row0
    pos = fl.cid[np.searchsorted(fl.rows, ids)]
    again_ptr = np.zeros(plan.num_steps + 1, dtype=np.int64)
    np.cumsum(np.bincount(step[again], minlength=plan.num_steps), out=again_ptr[1:])
    return _FoldOrder(torch.from_numpy(perm).to(device=device,
                                                dtype=_index_dtype(device, perm.shape[0])),
                      torch.from_numpy(pos).to(device), again_ptr)


def first_step_rows(plan: DevicePlan) -> tuple[int, int]:
    """``(rows the plan's first step loads, those of them no later step loads
    again)``: a layer whose first-step rows the pass before leaves on the device
    (:func:`early_layers`) moves the first of them not at all and stores the
    second not at all."""
    if not plan.num_steps:
        return 0, 0
    ids = np.asarray(plan.load_ids)
    p1 = int(plan.load_ptr[1])
    return p1, p1 - int(np.intersect1d(ids[:p1], ids[p1:]).shape[0])


def early_layers(ordered: list[bool], whole: list[bool], rows_layer: int | None) -> list[bool]:
    """Per layer ``m``: whether the training forward pass before it writes its
    first-step rows (it writes ``h^m`` in first-load order: ``ordered[m]``)
    straight into the gradient twin of the row memory, which no forward pass
    uses, for its first step to copy on the device: not where that pass holds
    its rows whole, nor where rows kept between passes (``rows_layer``, or
    ``None``) are read or written there."""
    return [ordered[m] and m > 0 and not whole[m - 1]
            and not (rows_layer is not None and m - rows_layer in (0, 1))
            for m in range(len(ordered))]


def first_aggregates_ordered(model: GNN, stored: list[bool], ordered: list[bool],
                             early: list[bool]) -> bool:
    """Whether a training forward pass may write layer 1's rows in first-load
    order as the first layer's aggregates ``a^0`` where they are narrower than
    the rows layer 1 reads (``h^1``, or ``drop(h^1)`` kept dropped), layer 1's
    steps making each loaded row from its aggregate on the device
    (:meth:`~hongtu.nn.GNN.emit_rows`: one product per row): layer 1 reads
    rows written in first-load order (``ordered[1]``) whose first step's rows
    stay on the device (``early[1]``, as they are), and the first layer
    stores its aggregate and updates it alone (no own rows). Fewer bytes
    both ways: GCN 3×256 on R-MAT 2^22 stores 512-byte rows instead of 1 KiB
    ones in the first layer's pass and loads them in the second's (0.352
    against 0.398 s per epoch on an H200, steady); on products-like (400-byte
    rows) 0.223-0.236 against 0.251-0.258 s per process on one machine, and
    epochs switching between 0.23 and 0.26-0.34 s on another, for the same
    mean as without (``bench/HISTORY.md``)."""
    widths = model.row_widths()
    return (len(ordered) > 1 and ordered[1] and early[1] and stored[0]
            and not model.layers[0].needs_dst and widths[0] < widths[1])


def own_rows_in_sources(model: GNN, cached: list[bool]) -> list[bool]:
    """Layers whose backward steps take their own rows from their sources where
    every chunk reads them there (``Executor(own_in_sources=True)``): those that
    read them and gather their sources — not cached (a cached layer's backward
    reads no sources). (Forward steps: :func:`own_rows_forward`.)"""
    return [layer.needs_dst and not c for layer, c in zip(model.layers, cached)]


def own_rows_copied(model: GNN, cached: list[bool], own: bool) -> list[bool]:
    """Layers whose passes copy their own rows from host memory (into the
    destination-row slots): all that read them, but with ``own`` (every chunk
    reads them among its sources) only those that copy them in backward
    (cached: :func:`own_rows_in_sources`); forward steps then take them from
    the device (:func:`own_rows_forward`)."""
    if not own:
        return [layer.needs_dst for layer in model.layers]
    return [layer.needs_dst and not b
            for layer, b in zip(model.layers, own_rows_in_sources(model, cached))]


def own_rows_forward(model: GNN, whole: list[bool], own: bool,
                     direct: bool = False) -> list[bool]:
    """Layers whose forward steps take their own rows ``h^l[V_c]`` from the rows
    on the device instead of copying them from host memory: a layer whose rows
    are all there (``whole``: a view of them), and with ``own`` (every chunk
    reads its own rows among its sources) every layer that reads them — from
    its gathered sources, or from its rows' slots where it aggregates them
    there (cached layers too: their backward still copies them; a first
    layer's slots hold its rows dropped out, as its update reads them). None
    when the buffers are on one device (``direct``: a range is a view)."""
    return [layer.needs_dst and not direct and (whole[l] or own)
            for l, layer in enumerate(model.layers)]


#: ``engine.checkpoint: auto`` recomputes layers reading their own rows out of core
#: (:func:`resolved_checkpoint`) only on graphs with fewer edges per vertex than
#: this. Recomputing aggregates again, work in proportion to the edges; caching
#: moves about two more rows per vertex (the aggregate stored and loaded back,
#: the own rows copied, against the plan's rows, own rows among them, loaded
#: once): both scale with the row width, so the graph's average in-degree
#: decides. On an H200, 2x256, at a quarter of PyG's memory, recomputed against
#: cached: products-like (26 edges per vertex) GIN 0.328 against 0.384 s, SAGE
#: 0.328 against 0.383; R-MAT graphs with 128 features at 61 edges per vertex
#: GIN 0.205 and 0.215 against 0.217 and 0.216 s, SAGE 0.212 and 0.209 against
#: 0.218 and 0.219; at 101 GIN 0.199 and 0.153 against 0.165 and 0.157, SAGE
#: 0.162 and 0.154 against 0.142 and 0.149; at 151 GIN 0.132
#: and 0.129 against 0.118 and 0.126, SAGE 0.132 and 0.128 against 0.113 and
#: 0.112; at 221 GIN 0.122 and 0.122 against 0.103 and 0.095; reddit-like (494)
#: GIN 0.260 against 0.190, SAGE 0.261 against 0.156. The break-even lies near
#: 100 (a cost model of cuSPARSE's product against the link had put it near 190).
OWN_RECOMPUTE_BELOW_DEGREE = 100


def resolved_checkpoint(checkpoint: str, own: bool, graph: Graph | None = None) -> str:
    """``engine.checkpoint`` as a run applies it: ``auto`` out of core on a GPU
    where every chunk reads its own rows among its sources (``own``:
    :func:`own_rows_read`, not resident; on a CPU no link to spare and the
    aggregation again costs) recomputes the layers that read them (``"own"``:
    :meth:`~hongtu.nn.model.GNN.cached_layers`): their backward then loads the
    plan's rows, own rows among them, instead of the cached aggregate and a
    copy of the own rows — unless ``graph``'s edges per vertex make aggregating
    again cost more (:data:`OWN_RECOMPUTE_BELOW_DEGREE`)."""
    degree = 0.0 if graph is None else graph.num_edges / max(graph.num_nodes, 1)
    own = own and degree < OWN_RECOMPUTE_BELOW_DEGREE
    return "own" if checkpoint == "auto" and own else checkpoint


def own_rows_read(engine: EngineConfig, model: GNN, graph: Graph) -> bool:
    """``Executor(own_in_sources=...)`` as training (and ``hongtu report``) sets
    it: a layer reads its own rows, every vertex of ``graph`` has a self-loop,
    and ``engine.dedup.p2p`` is on (a chunk's own rows are then loaded once per
    batch, as a row its chunks share is)."""
    return (engine.dedup.p2p and any(layer.needs_dst for layer in model.layers)
            and has_self_loops(graph))


def _own_positions(chunks: ChunkSet) -> dict[int, int]:
    """Per chunk of ``chunks``, where its destinations lie among its sorted
    source ids (every one of them a source: ``ValueError`` otherwise)."""
    at = {}
    for c, b in enumerate(chunks.blocks):
        if b is None:
            continue
        src = b.src_ids.numpy()
        p = int(np.searchsorted(src, b.dst_start))
        n = b.num_dst
        if n and (p + n > src.shape[0] or int(src[p]) != b.dst_start
                  or int(src[p + n - 1]) != b.dst_start + n - 1):
            raise ValueError(f"chunk {c} does not read all its own rows as sources "
                             "(own_in_sources needs a self-loop on every vertex)")
        at[c] = p
    return at


def written_first(plan: DevicePlan, num_rows: int = 0, own_range=None,
                  row0: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each step's gradient flushes, those that may be written first
    (:func:`_first_flushes_first`): ``(ids, order, split, written)``, the
    flushed rows (``plan.flush_ids`` from ``row0``), their positions in that
    order, where each step's written ones end, and which rows (of
    ``num_rows`` at least) a flush writes.
    ``own_range(c)``: the rows of chunk ``c``, whose own-row gradient the chunk
    adds at its step (layers that read their destinations' rows); without it,
    no row gets one."""
    ids = np.asarray(plan.flush_ids, dtype=np.int64) - row0
    ptr = np.asarray(plan.flush_ptr, dtype=np.int64)
    seen = np.zeros(max(num_rows, int(ids.max()) + 1 if ids.size else 0), dtype=np.bool_)
    own = np.full(seen.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
    for s in range(plan.num_steps if own_range is not None else 0):
        for q in range(plan.step_ptr[s], plan.step_ptr[s + 1]):
            v0, v1 = own_range(int(plan.chunk_ids[q]))
            own[v0:v1] = s
    written = np.zeros_like(seen)
    order = np.empty(ids.shape[0], dtype=np.int64)
    split = np.empty(ptr.shape[0] - 1, dtype=np.int64)
    _first_flushes_first(ids, ptr, seen, own, written, order, split)
    return ids, order, split, written


def flush_staging_elements(plan: DevicePlan, split: np.ndarray, written: list[bool],
                           widths: list[int], whole: list[bool], into_first: bool, held: bool,
                           dst_adds: list[bool], max_dst: int) -> int:
    """Elements of the largest gradient flush a GPU step stages in pinned host
    memory out of core (:class:`~hongtu.engine.transfer.Mover`'s flush staging):
    a backward pass of layer ``l >= 1`` flushes its step's rows of ``∇h^l``
    (``widths[l]`` wide), and with ``written[l]`` only those added (``split``,
    :func:`written_first`: a written flush goes straight to host memory); none
    where the layer moves whole (``whole``), for ``∇h^1`` into the first
    layer's backward (``into_first``), nor at the last step where layer 1
    holds its gradients for the first layer's (``held``,
    :func:`gradients_held`). ``dst_adds[l]``: its chunks' own-row gradients
    (at most ``max_dst`` rows) are added in host memory."""
    ptr = np.asarray(plan.flush_ptr, dtype=np.int64)
    counts = [ptr[1:] - ptr[:-1], ptr[1:] - split]
    most = 0
    for l in range(1, len(widths) - 1):
        if whole[l]:
            continue
        if not (l == 1 and into_first):
            steps = counts[bool(written[l])]
            steps = steps[:-1] if l == 1 and held else steps
            most = max(most, int(steps.max(initial=0)) * widths[l])
        if dst_adds[l]:
            most = max(most, int(max_dst) * widths[l])
    return most


def plan_index_bytes(plan: DevicePlan) -> int:
    """Device bytes of ``plan``'s index arrays as training holds them
    (:class:`_PlanOnDevice`: int64, the loads' and flushes' ids and slots,
    the chunks' slots and the exchange's), which the device estimate does
    not count."""
    p = plan
    return 8 * (2 * int(p.load_ids.shape[0]) + 2 * int(p.flush_ids.shape[0])
                + sum(int(a.shape[0]) for a in (p.chunk_slots, p.send_slots, p.recv_slots,
                                                p.leave_slots, p.back_slots)))


class _PlanOnDevice:
    """A :class:`DevicePlan`'s index arrays on the compute device, sliced per step
    (:func:`plan_index_bytes`)."""

    def __init__(self, plan: DevicePlan, device: torch.device, row0: int = 0,
                 num_rows: int = 0, own_range=None) -> None:
        def dev(a: np.ndarray, shift: int = 0) -> Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64) - shift).to(device)

        self.plan = plan
        # Host ids become rows of this process's own host buffers (which start at row0).
        self.load_ids, self.load_slots = dev(plan.load_ids, row0), dev(plan.load_slots)
        # A row's first flush in a pass can be written instead of added (nothing
        # was added there yet): order each step's flushes written-ones first.
        ids, order, self.flush_split, written = written_first(plan, num_rows, own_range, row0)
        self.flush_ids = ids[order]  # for host adds
        self.flush_slots = dev(np.asarray(plan.flush_slots)[order])
        self.flush_ids_dev = dev(self.flush_ids)
        #: rows no flush writes (zeroed at the start of a pass whose flushes are written)
        self.unwritten = np.flatnonzero(~written[:num_rows])
        self.chunk_slots = dev(plan.chunk_slots)
        self.send_slots = dev(plan.send_slots)
        self.send_counts = plan.send_counts.tolist()
        self.recv_counts = plan.recv_counts.tolist()
        self.recv_slots = dev(plan.recv_slots)
        # (a step whose rows fill the receive area from its start: received in place)
        self.recv_in_place = [bool(np.array_equal(
            got, plan.num_slots + np.arange(got.shape[0])))
            for got in (plan.step("recv_slots", s) for s in range(plan.num_steps))]
        self.leave_slots = dev(plan.leave_slots)
        self.leave_counts = plan.leave_counts.tolist()
        self.back_slots = dev(plan.back_slots)
        self.back_counts = plan.back_counts.tolist()

        p = plan
        #: ``(step, q, chunk id, first of its step, last of its step)`` in processing order
        self.items = [(s, q, int(p.chunk_ids[q]), q == p.step_ptr[s], q == p.step_ptr[s + 1] - 1)
                      for s in range(p.num_steps) for q in range(p.step_ptr[s], p.step_ptr[s + 1])]
        #: the same, last step first (see backward_in_reverse)
        self.items_reversed = [(s, q, c, last, first) for s, q, c, first, last in self.items[::-1]]

    def load(self, s: int) -> tuple[Tensor, Tensor]:
        a, b = int(self.plan.load_ptr[s]), int(self.plan.load_ptr[s + 1])
        return self.load_ids[a:b], self.load_slots[a:b]

    def flush(self, s: int, first: bool = False) -> tuple[np.ndarray, Tensor, Tensor]:
        """Step ``s``'s flushes ``(host ids, slots, ids on the device)``: all of them,
        or with ``first`` those whose flush is written (see _first_flushes_first)."""
        a, b = int(self.plan.flush_ptr[s]), int(self.plan.flush_ptr[s + 1])
        if first:
            b = int(self.flush_split[s])
        return self.flush_ids[a:b], self.flush_slots[a:b], self.flush_ids_dev[a:b]

    def held(self, write: bool, chunk_range) -> tuple[dict, Tensor, Tensor]:
        """The last step's flushes as :class:`Executor` holds them on the device
        (:func:`gradients_held`): ``(segments, local rows, slots)``, each kind sorted
        by row: ``segments[c] = (w0, w1, a0, a1)``, chunk ``c``'s rows (local to its
        range ``chunk_range(c)``) written at ``w0:w1`` (with ``write``: nothing
        reached the row before) and added at ``a0:a1``."""
        s = self.plan.num_steps - 1
        a, b = int(self.plan.flush_ptr[s]), int(self.plan.flush_ptr[s + 1])
        split = int(self.flush_split[s]) if write else a
        ids, local = self.flush_ids[a:b], np.empty(b - a, dtype=np.int64)
        # written ones first, each kind by row: a chunk's are two runs
        order = np.concatenate([np.argsort(ids[:split - a], kind="stable"),
                                split - a + np.argsort(ids[split - a:], kind="stable")])
        ids = ids[order]
        segments, cut = {}, split - a
        for c in sorted(set(int(x) for x in self.plan.chunk_ids)):
            v0, v1 = chunk_range(c)
            w0, w1 = np.searchsorted(ids[:cut], [v0, v1]) if cut else (0, 0)
            a0, a1 = cut + np.searchsorted(ids[cut:], [v0, v1])
            local[w0:w1], local[a0:a1] = ids[w0:w1] - v0, ids[a0:a1] - v0
            segments[c] = (int(w0), int(w1), int(a0), int(a1))
        slots = self.flush_slots[a:b][torch.from_numpy(order).to(self.flush_slots.device)]
        return segments, torch.from_numpy(local).to(slots.device), slots

    def reflush(self, s: int) -> tuple[np.ndarray, Tensor, Tensor]:
        """Step ``s``'s flushes that are added (the row's gradient already holds something)."""
        a, b = int(self.flush_split[s]), int(self.plan.flush_ptr[s + 1])
        return self.flush_ids[a:b], self.flush_slots[a:b], self.flush_ids_dev[a:b]

    def sends(self, s: int) -> tuple[Tensor, list[int], list[int], Tensor | None]:
        """Step ``s``'s send slots, the per-peer send and receive counts, and the
        slots the received rows go to (``None``: the receive area's first rows,
        in order)."""
        a, b = int(self.plan.send_ptr[s]), int(self.plan.send_ptr[s + 1])
        into = None if self.recv_in_place[s] else self.entering(s)
        return self.send_slots[a:b], self.send_counts[s], self.recv_counts[s], into

    def entering(self, s: int) -> Tensor:
        """The receive area's slots of the rows entering it at step ``s``."""
        return self.recv_slots[int(self.plan.recv_ptr[s]):int(self.plan.recv_ptr[s + 1])]

    def returns(self, s: int) -> tuple[Tensor, list[int], Tensor, list[int]]:
        """After step ``s``: the slots of the received rows leaving (their gradients
        go back) with the per-peer counts, and the slots where the gradients
        returned to this device are added, with theirs."""
        p = self.plan
        a, b = int(p.leave_ptr[s]), int(p.leave_ptr[s + 1])
        c, d = int(p.back_ptr[s]), int(p.back_ptr[s + 1])
        return self.leave_slots[a:b], self.leave_counts[s], self.back_slots[c:d], \
            self.back_counts[s]

    def slots(self, q: int) -> Tensor:
        p = self.plan.chunk_slot_ptr
        return self.chunk_slots[int(p[q]):int(p[q + 1])]


class Executor:
    """Runs forward, loss and backward over a :class:`ChunkSet` following a plan.

    Args:
        model: the GNN (parameters on ``device``).
        chunks: the chunk blocks (host tensors).
        buffers: the host buffers (or, in resident mode, the same buffers
            allocated on the device).
        labels: ``(N,)`` int64 labels.
        masks: ``{"train": ..., "val": ..., "test": ...}`` boolean ``(N,)`` masks.
        device: the compute device.
        plan: the device's transfer plan (:func:`hongtu.dedup.plan_transfers`).
        checkpoint: ``auto`` caches aggregates of cacheable layers; ``recompute``
            recomputes every layer in full in backward.
        seed: the run seed (dropout streams derive from it).
        resident_blocks: keep every chunk's block on the device (when the
            budget allows); otherwise blocks wait in pinned host memory and
            are copied to the device for each use.
        comm: the process group when several ranks train together (rank ``r``
            trains part ``r``; its host buffers, labels and masks hold only
            that part's rows, starting at ``chunks.row0``).
        num_train: train vertices of the whole graph (the loss is normalised
            by it); default ``masks["train"].sum()``.
        overlap: on a GPU, move the next batch's rows while the current one
            computes (:class:`~hongtu.engine.transfer.Mover`).
        whole_layers: a layer whose rows fit the device row memory (the
            transition buffer, its gradient twin and the row staging) moves all
            of them per pass (:func:`layers_moved_whole`); ``False`` =
            every layer moves the plan's neighbour rows.
        row_elements: elements of the device row memory, when the budget left
            more than the plan needs (:func:`~hongtu.engine.budget.grown_row_memory`);
            never less than the plan's (:func:`~hongtu.engine.budget.row_memory`),
            the default.
        ordered_inputs: keep a copy of ``h^0``'s loaded rows in the order the
            plan loads them (pinned), so the first layer's step loads are one
            contiguous copy each (DMA) instead of a gather; host buffers only,
            with overlap on a GPU (where the rows land in the staging area).
        ordered_rows: a training forward pass writes ``h^l`` of a later layer
            that reads its rows only through the plan's loads (cached, not its
            own rows: :func:`reads_rows_once`; not moved whole) straight in the
            order the plan first loads them, each loaded row once (pinned,
            another buffer of those rows), so that layer's step brings its
            first loads as one contiguous copy (DMA; the first step's written
            on the device by the pass before, :meth:`_early`) and gathers only
            rows loaded again; evaluation writes ``h^l`` as before. Same
            conditions as ``ordered_inputs``, and the plan's first step must
            load into slots ``0..n-1``.
        own_in_sources: every chunk reads its destinations' own rows among
            its sources (every vertex has a self-loop:
            :func:`~hongtu.graph.transforms.has_self_loops`). Then a layer that
            reads its own rows takes them from the device instead of copying
            them from host memory: in forward from its gathered sources or its
            rows' slots (:func:`own_rows_forward`), in backward from its
            gathered sources (not cached: :func:`own_rows_in_sources`); every
            such layer adds their gradients at their slots with the sources'
            (no own-row adds in host memory; a row's first flush in a pass is
            written).
        first_in_flushes: where it may (:func:`first_backward_in_flushes`),
            layer 1's backward takes the first layer's parameter gradients from
            the gradient rows it flushes instead of sending them to host memory
            for a first-layer pass (then ``buffers`` need no ``∇h^1``). The
            Trainer asks for it on GPUs, where it saves link bytes; on a CPU
            the pass it saves reads host memory in order and the gathers and
            smaller products cost more (an R-MAT 2^16 GCN 3x256 epoch on two
            cores: 0.65-0.69 against 0.60-0.62 s).
        keep_graphs: resident on one device, a training forward pass keeps the
            autograd graph of each chunk's update for the backward pass of
            the layers :func:`~hongtu.engine.budget.kept_graph_layers` names
            (SAGE, GIN, custom layers: as PyG keeps them), which then runs no
            update again; their aggregates are not stored, and ``buffers`` may
            leave them out (the Trainer does). The Trainer asks
            for it where the graphs fit the budget beside everything else
            (:func:`~hongtu.engine.budget.kept_graph_bytes`).
        narrow_rows: with ``ordered_rows``, layer 1's rows written as the first
            layer's aggregates where :func:`first_aggregates_ordered` allows it
            (``None``: on a GPU; ``True`` forces it on a CPU too, for tests;
            ``False``: never).
    """

    def __init__(self, model: GNN, chunks: ChunkSet, buffers: HostBuffers, labels: Tensor,
                 masks: dict[str, Tensor], device: torch.device, plan: DevicePlan,
                 checkpoint: str = "auto", seed: int = 0, resident_blocks: bool = True,
                 comm: Comm | None = None, num_train: int | None = None,
                 overlap: bool = True, whole_layers: bool = True,
                 row_elements: int | None = None, ordered_inputs: bool = False,
                 ordered_rows: bool = False, own_in_sources: bool = False,
                 first_in_flushes: bool = False, keep_graphs: bool = False,
                 narrow_rows: bool | None = None) -> None:
        self.model = model
        self.chunks = chunks
        self.buf = buffers
        self.device = device
        self.seed = seed
        self.cached = model.cached_layers(checkpoint)
        self.stored = model.stored_aggregates(checkpoint)  # cached with an aggregate to keep
        self.dtype = buffers.h[1].dtype
        widths = model.row_widths()
        self.comm = comm
        self.resident = buffers.h[1].device.type == "cuda"
        # Where a chunk's own rows lie among its sources (position of its first
        # destination in its sorted source ids), when every chunk reads them.
        self._own_at = _own_positions(chunks) if own_in_sources else None
        self._own_src = own_rows_in_sources(model, self.cached)  # (backward)
        # Otherwise layers that read their destinations' own rows add those rows'
        # gradient in host memory chunk by chunk; then a flush is written only
        # before the row's chunk ran.
        self._own_host = (self._own_at is None
                          and any(layer.needs_dst for layer in model.layers[1:]))
        self.plan = _PlanOnDevice(plan, device, chunks.row0, buffers.h[0].shape[0],
                                  own_range=chunks.range if self._own_host else None)
        # Staging for destination rows (none when the buffers are on the device:
        # a range is then a view of them), each slot as wide as what it holds.
        max_dst = 0 if self.resident else chunks.max_rows()[1]
        slot_w = slot_widths(model, self.stored,
                             own_rows_copied(model, self.cached, self._own_at is not None))
        # Resident on one device: chunks read h^l and add into ∇h^l in place, so
        # the transition buffer and the transfer plan are not needed.
        self._direct = self.resident and comm is None
        # The row memory: the transition buffer (rows of h^l), its gradient twin
        # and the staging area of the next step's rows, allocated once as one
        # piece; a layer whose whole rows fit it moves them all at once.
        rows = 1 if self._direct else max(plan.buffer_rows, 1)
        stage = plan.max_later_load if overlap and not self._direct else 0
        need = row_memory(rows, widths, stage)
        size = need if row_elements is None or self._direct else max(need, int(row_elements))
        self._rowmem = torch.empty(size, dtype=self.dtype, device=device)
        twins = row_memory(rows, widths)  # the buffer and its gradient twin; staging after
        self._tbuf, self._gbuf = self._rowmem[:twins].chunk(2)
        ordered = ordered_inputs and not self.resident and (overlap or device.type == "cpu")
        n = buffers.h[0].shape[0]
        once = reads_rows_once(model, checkpoint)
        hand = plan_handoffs(n, widths, self._rowmem.numel(), plan, stage, comm is not None,
                             self.cached, once,
                             enabled=whole_layers and not self._direct,
                             overlapped=overlap and device.type == "cuda")
        self._whole = hand.whole
        # ∇h^1's last flushes wait in the gradient twin for the first layer's
        # backward (gradients_held); built per kind of flush on first use.
        # The first layer's backward run on layer 1's flushes: their rows'
        # aggregates are gathered a piece at a time (two pieces in flight).
        self._in_flushes = first_in_flushes and first_backward_in_flushes(
            model, self.cached, hand.whole, hand.kept, self._own_at is not None, self._direct)
        self._hold = not self._direct and hand.held and not self._in_flushes
        # Pinned areas gradient flushes are staged in, as large as the largest flush.
        written = [g is not None and g.device.type == "cpu" and g.is_pinned()
                   for g in buffers.grad]
        flushes = 0 if self.resident else flush_staging_elements(
            plan, self.plan.flush_split, written, widths, hand.whole, self._in_flushes,
            self._hold, [d and self._own_at is None for d in
                         (layer.needs_dst for layer in model.layers)], max_dst)
        self.mover = Mover(device, {k: (max_dst if w else 0, w) for k, w in slot_w.items()},
                           max(widths), self.dtype, load_rows=stage, overlap=overlap,
                           stage=self._rowmem[twins:], flush_elements=flushes)
        self._graphs: dict[tuple[int, int], tuple] = {}  # (layer, chunk): kept update
        self._held_by: dict[bool, tuple] = {}
        self._held = None
        self._head = None  # (the next backward pass's first reads, issued early)
        # h^0's rows in load order: step s's loads are rows load_ptr[s]:load_ptr[s+1]
        # (not when host memory would not hold the copy: the rows are gathered then).
        self._ordered = None
        self._first_in_place = first_in_place(plan)
        self._store_ids = self._load_ids = None
        load_rows = int(plan.load_ids.shape[0])
        itemsize = buffers.h[0].element_size()
        copy_bytes = load_rows * widths[0] * itemsize
        room = _HOST_SHARE * available_host_memory() if device.type == "cuda" else float("inf")
        if ordered and not self._whole[0] and 0 < copy_bytes <= room:
            self._ordered = _rows_in_order(buffers.h[0], np.asarray(plan.load_ids) - chunks.row0,
                                           pin=device.type == "cuda")
            room -= copy_bytes
        # Later layers' rows written in first-load order by the training forward pass.
        self._ordered_rows: list[Tensor | None] = [None] * len(widths)
        may = ordered_row_layers(plan, self._whole, once,
                                 ordered_rows and not self._direct and not self.resident
                                 and (overlap or device.type == "cpu"))
        self._first_loads = _first_loads(plan, chunks, device.type == "cuda") \
            if any(may) else None
        loaded = self._first_loads.count if self._first_loads is not None else 0
        # Layer 1's as the first layer's aggregates where narrower (by default on
        # a GPU; a CPU reads host memory in place: narrow_rows=True forces it there,
        # for tests).
        narrow = (device.type == "cuda" if narrow_rows is None else narrow_rows) \
            and first_aggregates_ordered(model, self.stored, may,
                                         early_layers(may, self._whole, hand.kept_layer))
        # (where a^0 is stored once, in layer 1's load order: its first rows, no copy)
        once_agg = aggregates_in_load_order(narrow, self._in_flushes) \
            and buffers.agg[0] is not None \
            and (device.type != "cuda" or buffers.agg[0].is_pinned())
        self._agg_layout = None
        for m in range(1, model.num_layers):
            width = widths[0] if m == 1 and narrow else widths[m]
            nbytes = loaded * width * itemsize
            if m == 1 and may[m] and once_agg and loaded:
                self._ordered_rows[1] = buffers.agg[0][:loaded]
                self._agg_layout = _aggregate_layout(self._first_loads, chunks, n, device)
            elif may[m] and 0 < nbytes <= room:
                shape = (loaded, width)
                self._ordered_rows[m] = (pinned_tensor(shape, self.dtype)
                                         if device.type == "cuda"
                                         else torch.empty(shape, dtype=self.dtype))
                room -= nbytes
        if not any(t is not None for t in self._ordered_rows):
            self._first_loads = None
        else:  # (their index arrays: on a GPU, two in flight for stores and for loads)
            chunk_ids, step_ids = self._first_loads.largest()
            if self._agg_layout is not None:
                chunk_ids = max([chunk_ids, *(int(t.numel())
                                              for t in self._agg_layout.orders.values())])
            spare = self.mover.forward_spare([chunk_ids, step_ids])
            self._store_ids = IndexRing(self.mover, chunk_ids, spare and spare[0])
            self._load_ids = IndexRing(self.mover, step_ids, spare and spare[1])
        # Layer 1's backward visits the steps last to first where the first
        # layer's backward reads a^0 stored in load order (one process), its
        # index arrays taking their room from the flush pieces.
        w0, max_rows = widths[0], max(chunks.max_rows()[1], 1)
        reserve = aggregate_positions_bytes(model, n, device.type == "cuda")
        once = self._agg_layout is not None
        self._reverse = backward_in_reverse(
            once, comm, once and fold_fits(plan, self._first_loads.count, w0, itemsize,
                                           max_rows, reserve, device))
        # (layer 1's aggregates of the last chunk: (chunk, ticket) from a
        # training forward pass to the backward's first read)
        self._keep_last = keeps_last_aggregate(self._reverse, self.stored) \
            and buffers.agg[1] is not None
        self._kept_agg = None
        self._fold = _fold_order(plan, self._first_loads, chunks.row0, device) \
            if self._reverse else None
        if self._in_flushes:
            self._flush_piece = flush_piece_rows(
                w0, itemsize, max_rows, reserve + (self._fold.nbytes() if self._reverse else 0))
            self._flush_rows = torch.empty((2, self._flush_piece, w0), dtype=self.dtype,
                                           device=device)
            self._flush_free = [None, None]  # (events: compute done with each)
        self.labels = labels.to(device)
        self.num_train = max(int(masks["train"].sum()) if num_train is None else num_train, 1)
        # For the loss: the split masks side by side (their sizes are constant:
        # counted once per pass); the labels as gather indices are made a chunk
        # at a time (a copy of all of them would be 8 bytes a vertex more than
        # the estimate counts).
        self._splits = torch.stack([masks[k] for k in _SPLITS], 1).to(device)
        self._split_sizes = self._splits.sum(0).to(torch.float64)
        self._classes = model.layers[-1].out_width
        # Layers that aggregate their sources where they lie, without a gathered
        # copy (budget.aggregates_in_place): whole layers in the row memory, the
        # others in the transition buffer's slots. A first layer's rows are
        # dropped out there once, as they arrive (a slot holds one row for the
        # whole pass) or once the whole copy is in; backward reads none of them.
        here = aggregates_in_place(model, self.cached, comm is not None, self._direct)
        self._in_place = [w and h for w, h in zip(self._whole, here)]
        self._in_slots = [h and not w for w, h in zip(self._whole, here)]
        self._piece = max(chunks.max_rows()[0], 1)  # rows dropped at a time
        # Forward steps take their own rows from the device where they are there.
        self._fwd_own = own_rows_forward(model, self._whole, self._own_at is not None,
                                         self._direct)
        # Gradients handed from pass to pass in the row memory.
        self._kept = hand.kept
        lacking = [l for l in range(1, len(widths))
                   if buffers.grad[l] is None and not self._kept[l]
                   and not (l == 1 and self._in_flushes)]
        if lacking:
            raise ValueError(f"host buffers lack grad h^{lacking[0]}, which this executor "
                             "moves through host memory (BufferPlan.grads)")
        # (an aggregate buffer may be left out only where the layer keeps its graph;
        # which layers do is fixed here, as the Trainer sized the buffers)
        self._graph_layers = kept_graph_layers(model, self.cached, self.stored) \
            if keep_graphs else [False] * len(model.layers)
        lacking = [l for l, s in enumerate(self.stored) if s and buffers.agg[l] is None
                   and not (self._direct and self._graph_layers[l])]
        if lacking:
            raise ValueError(f"host buffers lack the aggregate of layer {lacking[0]}, which "
                             "this executor stores for backward (BufferPlan.cached)")
        # Where whole layers keep their rows and gradients (element offsets);
        # h^m (h^1, or the last layer's) may stay from the forward pass before
        # its layer to that layer's.
        self._at = [(0, n * w) for w in widths[:-1]]
        at, self._rows_layer = hand.rows_at, hand.rows_layer
        self.rows_kept = at is not None
        if self.rows_kept:
            size = n * widths[self._rows_layer]
            self._at[self._rows_layer] = (at, grads_beside(at, size))
        self._widths = widths
        self._early_at = early_layers([t is not None for t in self._ordered_rows], self._whole,
                                      hand.kept_layer)
        self._narrow = narrow and self._ordered_rows[1] is not None
        # (aggregates made into rows a piece at a time: at most a chunk's
        # aggregate of layer 1 in the piece, its product and its rows)
        self._widen_piece = max(1, chunks.max_rows()[1] * widths[1]
                                // (widths[0] + 2 * widths[1])) if self._narrow else 0
        if device.type == "cpu":
            self._blocks = chunks.blocks
        elif resident_blocks:
            self._blocks = [b if b is None else b.to(device) for b in chunks.blocks]
        elif all(b is None or b.indptr.is_pinned() for b in chunks.blocks):
            self._blocks = chunks.blocks  # (pinned already: the trainer's, pin_blocks)
        else:
            # Pinned slabs (copied to the device batch by batch), index arrays
            # as int32 where they fit: half the bytes on the link.
            self._blocks = pin_blocks(chunks.blocks)
        self._copy_blocks = device.type != "cpu" and not resident_blocks
        if device.type != "cpu":
            # The chunk set refers to these copies from now on: the int64 host
            # blocks it was built with (about 24 bytes an edge) can go.
            self.chunks = dataclasses.replace(chunks, blocks=self._blocks)
        # The next forward's first rows (step 0 of layer 0, in load order: one
        # run into slots 0..n-1) travel during the first layer's backward pass
        # (layer 1's where that one runs the first's: _in_flushes; the last
        # layer's before it where _clear_first_rows finds room), a piece
        # beside each of its batches, where the link has room: backward reads
        # none of the transition buffer's rows then (a cached first layer, and
        # a cached layer 1), and the inputs do not change between epochs. The
        # forward pass then starts computing at once instead of waiting for its
        # largest load.
        self._prefetch_in = 1 if self._in_flushes else 0
        ahead = (self.mover.overlap and self._in_slots[0] and self.cached[self._prefetch_in]
                 and self._ordered is not None and self._first_in_place)
        self._kept_end = None
        first = int(plan.load_ptr[1]) * widths[0]  # (those rows' elements)
        if ahead:
            self._clear_first_rows(first)
        self._prefetch_from = self._prefetch_start(first)
        self._prefetch = ahead and self._prefetch_from is not None
        self._ahead = None  # (rows ticket, block ticket) of the first forward item
        # The loss may be read after backward is issued (step) where nothing in
        # backward waits for forward on this thread: one process, on a GPU, and
        # every array in pinned host memory (backward's CPU writes go to ∇h^l,
        # l < L, which forward neither reads nor writes; its loads wait for the
        # stores they read on the device, never on this thread).
        b = self.buf
        self._late_result = (self.mover.cuda and comm is None and all(
            t.device.type == "cpu" and t.is_pinned()
            for t in [*b.h, *b.grad, *b.agg] if t is not None))

    @property
    def whole_layers(self) -> list[int]:
        """The layers whose passes move all their rows (:func:`layers_moved_whole`)."""
        return [l for l, w in enumerate(self._whole) if w]

    @property
    def kept_on_device(self) -> list[str]:
        """What a training step hands from pass to pass in device memory instead
        of through host memory: ``h^1`` or the last layer's rows
        (:func:`rows_kept_at`), gradients (:func:`gradients_kept`) and the rows
        of ``∇h^1`` layer 1's last step holds (:func:`gradients_held`)."""
        return ([f"h^{self._rows_layer}"] * self.rows_kept
                + [f"grad h^{l}" for l, k in enumerate(self._kept) if k]
                + ["the last step's grad h^1 rows"] * self._hold)

    @property
    def own_rows_from_sources(self) -> list[int]:
        """Layers whose steps take their own rows from the chunks' sources
        (forward or backward: ``own_in_sources``; in forward from where the
        sources lie on the device) instead of copying them from host memory."""
        if self._own_at is None:
            return []
        return [l for l, (f, b) in enumerate(zip(self._fwd_own, self._own_src)) if f or b]

    @property
    def kept_graphs(self) -> list[int]:
        """Layers whose update graph a training forward pass keeps for backward
        (``keep_graphs``; resident on one device only)."""
        return [l for l, k in enumerate(self._graph_layers) if k and self._direct]

    @property
    def keeps_last_aggregate(self) -> bool:
        """Whether layer 1's aggregates of the training forward pass's last chunk
        stay on the device for its reversed backward (:func:`keeps_last_aggregate`)."""
        return self._keep_last

    @property
    def backward_reversed(self) -> bool:
        """Whether layer 1's backward visits the steps last to first
        (:func:`backward_in_reverse`)."""
        return self._reverse

    @property
    def first_in_flushes(self) -> bool:
        """Whether layer 1's backward runs the first layer's on the gradient rows
        it flushes (:func:`first_backward_in_flushes`)."""
        return self._in_flushes

    @property
    def ordered_input_bytes(self) -> int:
        """Host bytes of the first layer's inputs kept in load order (0: none kept)."""
        t = self._ordered
        return 0 if t is None else t.numel() * t.element_size()

    def _early(self, m: int) -> bool:
        """Whether the training forward pass before layer ``m`` writes its
        first-step rows straight into the gradient twin of the row memory
        (:func:`early_layers`), so its first step copies them on the device
        instead of loading them, and only those a later step loads again go
        to host memory."""
        return self._early_at[m]

    @property
    def rows_from_aggregates(self) -> bool:
        """Whether layer 1's rows in load order are the first layer's aggregates,
        made into its rows as they load (:func:`first_aggregates_ordered`)."""
        return self._narrow

    @property
    def ordered_rows(self) -> list[int]:
        """Layers whose rows a training forward pass writes in load order."""
        return [m for m, t in enumerate(self._ordered_rows) if t is not None]

    @property
    def ordered_row_bytes(self) -> int:
        """Host bytes of the rows written in load order (:attr:`ordered_rows`;
        none for layer 1's where they are the first layer's aggregates, stored
        once: :func:`aggregates_in_load_order`)."""
        return sum(t.numel() * t.element_size() for m, t in enumerate(self._ordered_rows)
                   if t is not None and not (m == 1 and self._agg_layout is not None))

    # ------------------------------------------------------------- helpers
    def _fetch_block(self, c: int, skip: tuple[str, ...] = ()):
        """Chunk ``c``'s block, or (blocks not resident) a ticket for its copy
        (the tensors named in ``skip`` stay in host memory)."""
        block = self._blocks[c]
        if self._copy_blocks and block is not None:
            return self.mover.fetch_block(block, skip)
        return block

    def _take_block(self, fetched) -> Block:
        if fetched is None or isinstance(fetched, Block):
            return fetched
        return self.mover.take_block(fetched)

    def _whole_rows(self, l: int, k: int = 0) -> Tensor:
        """A whole layer's rows (``k = 0``) or their gradients (``k = 1``) on the device."""
        n, w, at = self.buf.h[0].shape[0], self.buf.h[l].shape[1], self._at[l][k]
        return self._rowmem[at:at + n * w].view(n, w)

    def _grad_rows(self, l: int) -> Tensor:
        """Where a whole layer ``l`` adds ``∇h^l`` up (and, :func:`gradients_kept`,
        keeps it); ``∇h^L``: in the last layer's gradient room."""
        if l < len(self._whole):  # (the last layer's rows' half when ∇h^L holds the other)
            return self._whole_rows(l, 0 if l == len(self._whole) - 1 and self._kept[-1] else 1)
        n, at = self.buf.h[0].shape[0], self._at[l - 1][1]
        return self._rowmem[at:at + n * self.buf.h[l].shape[1]].view(n, -1)

    def _offset(self, t: Tensor) -> int:
        """Where a view of the row memory begins in it (elements)."""
        return (t.data_ptr() - self._rowmem.data_ptr()) // t.element_size()

    def _kept_grads(self, l: int) -> Tensor:
        """Where layer ``l - 1``'s backward reads a kept ``∇h^l`` (:func:`gradients_kept`):
        ``∇h^1`` and ``∇h^L`` where they were written; a later layer's at
        :func:`kept_grads_at` (copied there where it was added up elsewhere:
        over rows kept there)."""
        if l in (1, self.model.num_layers):
            return self._grad_rows(l)
        n, w = self.buf.h[0].shape[0], self.buf.h[l].shape[1]
        at = kept_grads_at(n, self._widths, self._kept, l, self._kept_end,
                           self._offset(self._grad_rows(l)))
        return self._rowmem[at:at + n * w].view(n, w)

    def _sources(self, l: int, q: int, block: Block, tbuf: Tensor) -> Tensor:
        """``h^l[N_c]``: from the transition buffer, or (resident) from ``h^l`` itself."""
        if self._whole[l]:
            return self._whole_rows(l).index_select(0, block.src_ids)
        if not self._direct:
            return tbuf.index_select(0, self.plan.slots(q))
        h = self.buf.h[l]
        return h if block.num_src == h.shape[0] else h.index_select(0, block.src_ids)

    def _add_sources(self, l: int, q: int, block: Block, gbuf: Tensor, g: Tensor) -> None:
        """``∇h^l[N_c] += g``: at the rows' slots, or (resident) into ``∇h^l`` itself."""
        if self._whole[l]:
            add_rows(self._grad_rows(l), block.src_ids, g)
        elif not self._direct:
            add_rows(gbuf, self.plan.slots(q), g)
        elif block.num_src == g.shape[0] == self.buf.grad[l].shape[0]:
            self.buf.grad[l].add_(g)
        else:
            self.buf.grad[l].index_add_(0, block.src_ids, g)

    def _dst_in_sources(self, l: int) -> bool:
        """Whether layer ``l``'s backward steps take their own rows from their
        sources (``own_in_sources``; :func:`own_rows_in_sources`)."""
        return self._own_at is not None and self._own_src[l]

    def _own_of(self, c: int, x_src: Tensor, block: Block) -> Tensor:
        """Chunk ``c``'s own rows ``h^l[V_c]`` within its sources ``x_src`` (a view)."""
        return x_src.narrow(0, self._own_at[c], block.num_dst)

    def _own_forward(self, l: int, q: int, c: int, block: Block, tbuf: Tensor,
                     x_src: Tensor | None) -> Tensor:
        """Chunk ``c``'s own rows of ``h^l`` for a forward step (:func:`own_rows_forward`):
        a view of a whole layer's rows or of the gathered sources ``x_src``, else
        (a layer aggregating its rows in their slots) a copy from their slots."""
        if self._whole[l]:
            v0, v1 = self.chunks.range(c)
            return self._whole_rows(l)[v0:v1]
        if x_src is not None:
            return self._own_of(c, x_src, block)
        p = self._own_at[c]
        return tbuf.index_select(0, self.plan.slots(q)[p:p + block.num_dst])

    def _fetch_rows(self, l: int, i: int, s: int, first: bool, tbuf: Tensor,
                    train: bool = False):
        """The rows of ``h^l`` item ``i`` brings: a whole layer's all at the first
        item; otherwise the step's new neighbour rows at its first chunk (from
        their copy in load order where there is one: the inputs', or in a
        training forward pass a later layer's, :attr:`_ordered_rows`)."""
        if self._direct:
            return None
        if self._whole[l]:
            return self.mover.fetch_all(self.buf.h[l], self._whole_rows(l)) if i == 0 else None
        if not first:
            return None
        ids, slots = self.plan.load(s)
        if l == 0 and self._ordered is not None and (s > 0 or self._first_in_place):
            p = self.plan.plan.load_ptr
            return self.mover.fetch_run(self._ordered, int(p[s]), int(p[s + 1]), slots, tbuf,
                                        direct=s == 0)
        if l > 0 and train and self._ordered_rows[l] is not None:
            fl = self._first_loads
            a, b = int(fl.run[s]), int(fl.run[s + 1])
            if s == 0 and self._early(l):  # (brought during the pass before)
                return self.mover.take_early(self._buffer(self._gbuf, tbuf.shape[1]), tbuf, b)
            if s == 0:  # (all first loads, into slots 0..n-1)
                return self.mover.fetch_run(self._ordered_rows[l], a, b, None, tbuf, direct=True)
            again, arr = fl.steps[s]
            ticket, k = self._load_ids.fetch(arr)  # (on the load stream, as the rows)
            ids = ticket.value
            return self.mover.fetch_run(self._ordered_rows[l], a, b, ids[again:], tbuf,
                                        ids=ids[:again], ring=(self._load_ids, k))
        return self.mover.fetch_rows(self.buf.h[l], ids, slots, tbuf, direct=s == 0)

    def _place_dropped(self, rows: Ticket, s: int, tbuf: Tensor, seed: int) -> None:
        """Put the rows step ``s`` brought into their slots with the first layer's
        dropout applied: as they leave the staging area where they came
        through it, else in their slots (a bounded piece at a time, unless one
        kernel drops them where they lie)."""
        mv, model = self.mover, self.model
        if model.p <= 0:
            mv.place(rows)
            return
        ids, slots = self.plan.load(s)
        fused = ops.fused_dropout(tbuf)
        with mv.timing("time_compute_s"):
            def put(value, buf, at):
                model.drop_sources_into(0, value, ids, seed, buf, at)

            if mv.place(rows, put if fused else None) and fused:
                return
            piece = max(ids.shape[0], 1) if fused else self._piece
            for a in range(0, ids.shape[0], piece):
                at = slots[a:a + piece]
                model.drop_sources_into(0, tbuf, ids[a:a + piece], seed, tbuf, at, x_at=at)

    def _drop_whole_first(self, seed: int) -> None:
        """Apply the first layer's dropout to its whole rows where they lie (once
        per training pass, after their copy), a bounded piece at a time, so
        its chunks aggregate them in place (:attr:`_in_place`) as the slots'
        rows are (:meth:`_place_dropped`), without a gathered copy each."""
        model, rows = self.model, self._whole_rows(0)
        if model.p <= 0:
            return
        with self.mover.timing("time_compute_s"):
            for a in range(0, rows.shape[0], self._piece):
                at = torch.arange(a, min(a + self._piece, rows.shape[0]), device=rows.device)
                model.drop_sources_into(0, rows, at, seed, rows, at, x_at=at)

    def _rows_from_aggregates(self, s: int, tbuf: Tensor, seed: int) -> None:
        """Make the rows step ``s`` loaded for layer 1 as the first layer's
        aggregates (in their slots' first columns, :func:`first_aggregates_ordered`)
        into the rows layer 1 reads, with its dropout ``seed``, a bounded
        piece at a time."""
        ids, slots = self.plan.load(s)
        ids = ids + self.chunks.row0 if self.chunks.row0 else ids  # (global: the masks' keys)
        agg = tbuf[:, :self._ordered_rows[1].shape[1]]
        with self.mover.timing("time_compute_s"):
            for a in range(0, ids.shape[0], self._widen_piece):
                at = slots[a:a + self._widen_piece]
                rows = self.model.emit_rows(0, agg.index_select(0, at),
                                            ids[a:a + self._widen_piece], seed)
                tbuf.index_copy_(0, at, rows)

    def _clear_first_rows(self, size: int) -> None:
        """Keep gradients that stay on the device between backward passes off
        the next forward's first rows (``size`` elements from the row memory's
        start, :attr:`_prefetch`): a narrow last layer's ``∇h^{L-1}`` goes to the
        transition buffer's end (:func:`kept_grads_at`), and where
        :meth:`_before_flushes` the loss gradient too, those rows then
        travelling during the last layer's backward, whose link has room (its
        GPU time is the larger), instead of layer 1's."""
        self._kept_end = self._tbuf.numel()
        if self._before_flushes(size):
            n = self.buf.h[0].shape[0]
            self._at[-1] = (self._at[-1][0], self._kept_end - n * self._widths[-1])
            self._prefetch_in = len(self._at) - 1

    def _before_flushes(self, size: int) -> bool:
        """Whether the next forward's first rows (``size`` elements from the row
        memory's start) may travel during the last layer's backward, the pass
        before the one that runs the first layer's on its flushes: three layers,
        the last cached and moving whole with ``∇h^3`` kept (its backward reads
        no rows), ``∇h^3`` at the transition buffer's end clear of those rows and
        of the last layer's rows (where it adds ``∇h^2`` up), and ``∇h^2`` kept
        (:func:`kept_grads_at`, over ``∇h^3`` once spent) clear of them too."""
        L, kept = self.model.num_layers, self._kept
        if not (L == 3 and self._in_flushes and self._whole[2] and self.cached[2]
                and kept[2] and kept[3]):
            return False
        n, end = self.buf.h[0].shape[0], self._tbuf.numel()
        loss, rows = n * self._widths[3], n * self._widths[2]
        at, g = end - loss, self._at[2][0]  # (∇h^3's place; ∇h^2 added up over the rows)
        return (at >= size and (at >= g + rows or at + loss <= g)
                and kept_grads_at(n, self._widths, kept, 2, end, g) >= size)

    def _prefetch_start(self, size: int) -> int | None:
        """The first item of the backward pass carrying the next forward's first
        rows (:attr:`_prefetch_in`) whose fetch may write them into the row
        memory's first ``size`` elements (the transition buffer's first rows):
        0, unless a gradient the pass reads stays on the device there. Then,
        for ``∇h^2`` (layer 1's pass, where it runs the first layer's), the
        second item after the last whose chunk reads rows of it there (a fetch
        waits for the compute issued before it: the item before it has not
        run yet); ``None`` where no item is left, and for ``∇h^1`` (the first
        layer's pass reads it from its first item)."""
        l = self._prefetch_in + 1
        if len(self._kept) <= l or not self._kept[l]:
            return 0
        g = self._kept_grads(l)
        start = self._offset(g)
        if start >= size or g.numel() == 0:
            return 0
        if l == 1:
            return None
        rows = -(-(size - start) // g.shape[1])  # its rows lying there: 0 .. rows-1
        items = self._back_items(self._prefetch_in)
        last = max((i for i, (_, _, c, _, _) in enumerate(items)
                    if self.chunks.range(c)[0] < rows), default=-2)
        return last + 2 if last + 2 < len(items) else None

    def _forward_skip(self, l: int) -> tuple[str, ...]:
        """What layer ``l``'s forward pass leaves of its blocks in host memory."""
        return () if self.model.layers[l].reads_transpose else Block.TRANSPOSE

    def _fetch_ahead(self, k: int, n: int) -> None:
        """Piece ``k`` of ``n`` of the next forward's first rows (``_prefetch``);
        with the last, its first block too."""
        p = self.plan.plan.load_ptr
        p0, rows = int(p[0]), int(p[1]) - int(p[0])
        a, b = rows * k // n, rows * (k + 1) // n
        tbuf = self._buffer(self._tbuf, self.buf.h[0].shape[1])
        ticket = self.mover.fetch_ahead(self._ordered, p0 + a, p0 + b, tbuf, a, k == 0)
        if k == n - 1:  # (the pieces land in order: the last's ticket waits for all)
            self._ahead = (ticket,
                           self._fetch_block(self.plan.items[0][2], self._forward_skip(0)))

    def _seed(self, epoch: int, l: int) -> int:
        return layer_seed(self.seed, epoch, l)

    def _buffer(self, which: Tensor, width: int) -> Tensor:
        rows = 0 if self._direct else self.plan.plan.buffer_rows
        return which[: rows * width].view(rows, width)

    # ------------------------------------------------------------- forward
    def forward(self, epoch: int, train: bool, progress=None) -> StepResult:
        """Forward over all layers; in training mode also the loss and ``∇h^L``."""
        return self._result(self._forward(epoch, train, progress))

    def _result(self, acc: Tensor) -> StepResult:
        """Loss and accuracy counts of a forward's accumulator (a synchronisation)."""
        acc[4:7] += self._split_sizes
        v = acc.tolist()  # the pass's one synchronisation
        res = StepResult(v[0], dict(zip(_SPLITS, map(int, v[1:4]))),
                         dict(zip(_SPLITS, map(int, v[4:7]))))
        if self.comm is not None:
            self._reduce(res)
        return res

    @torch.no_grad()
    def _forward(self, epoch: int, train: bool, progress=None) -> Tensor:
        """:meth:`forward`'s passes, issued; the accumulator of loss and counts."""
        model, buf, mv, plan = self.model, self.buf, self.mover, self.plan
        model.train(train)
        L = model.num_layers
        acc = torch.zeros(7, dtype=torch.float64, device=self.device)  # loss, correct, total
        # h^1 stays on the device for the second layer's pass (in training:
        # evaluation leaves every h^l in host memory, where predict reads them)
        keep = self.rows_kept and train
        self._graphs.clear()  # (a training forward pass without its backward left some)
        self._kept_agg = None
        graphs = set(self.kept_graphs) if train else set()
        for l in range(L):
            layer = model.layers[l]
            seed, nxt = self._seed(epoch, l), self._seed(epoch, l + 1)
            tbuf = self._buffer(self._tbuf, buf.h[l].shape[1])

            def fetch(i, l=l, layer=layer, tbuf=tbuf):
                s, _, c, first, _ = plan.items[i]
                v0, v1 = self.chunks.range(c)
                ahead = self._ahead if l == 0 and i == 0 else None
                self._ahead = None
                rows = None if l == self._rows_layer and keep else ahead[0] if ahead is not None \
                    else self._fetch_rows(l, i, s, first, tbuf, train)
                dst = mv.fetch_range(buf.h[l], v0, v1, "dst") \
                    if layer.needs_dst and not self._fwd_own[l] else None
                # where its rows go, when the next layer's are written in first-load order
                places = None
                if train and l + 1 < L and self._ordered_rows[l + 1] is not None:
                    once = l == 0 and self._agg_layout is not None  # (a^0 stored once)
                    places = self._store_ids.fetch(self._agg_layout.orders[c] if once
                                                   else self._first_loads.chunks[c])
                return rows, dst, ahead[1] if ahead is not None else self._fetch_block(
                    c, self._forward_skip(l)), places

            def run(i, fetched, fetch_next, l=l, layer=layer, seed=seed, nxt=nxt, tbuf=tbuf):
                s, q, c, _, _ = plan.items[i]
                rows, dst, block, places = fetched
                in_slots = self._in_slots[l]
                if rows is not None:
                    if l == 0 and in_slots and train:
                        self._place_dropped(rows, s, tbuf, seed)
                    else:
                        mv.place(rows)
                        if l == 0 and self._in_place[0] and train:
                            self._drop_whole_first(seed)
                    if l == 1 and train and self._narrow and s > 0:
                        self._rows_from_aggregates(s, tbuf, seed)
                    self._exchange(s, tbuf)
                fetch_next()
                block = self._take_block(block)
                v0, v1 = self.chunks.range(c)
                x_dst = mv.take(dst) if dst is not None else None
                with mv.timing("time_compute_s"):
                    x_src = None
                    if self._in_place[l]:
                        a = ops.aggregate_rows(block, self._whole_rows(l), layer.aggr)
                    elif in_slots:
                        a = ops.aggregate_rows(block, tbuf, layer.aggr, self.plan.slots(q))
                    elif self.cached[l] and train:
                        x_src = self._sources(l, q, block, tbuf)
                        a = model.step_aggregate(l, block, x_src, seed)
                    else:
                        a = None
                    if a is None:
                        x_src = self._sources(l, q, block, tbuf)
                    if self._fwd_own[l]:
                        x_dst = self._own_forward(l, q, c, block, tbuf, x_src)
                    if a is not None:
                        # (a first layer's own rows from its slots or its whole
                        # rows: dropped out already)
                        dropped = l == 0 and (in_slots or self._in_place[0]) and train \
                            and self._fwd_own[l]
                        if l in graphs:  # its graph kept for backward, not its aggregate
                            out = self._keep_update(l, c, block, a, x_dst, seed, nxt, dropped)
                            a = None
                        else:
                            out = model.step_update(l, block, a, x_dst, seed, nxt,
                                                    dst_dropped=dropped)
                    else:
                        out = model.step_forward(l, block, x_src, x_dst, seed, nxt)
                    a = a if self.stored[l] and train else None  # stored for backward
                    kept = train and l == L - 1 and self._kept[-1]  # ∇h^L: where it is kept
                    grad = self._output(out, v0, v1, train, acc,
                                        self._grad_rows(L)[v0:v1] if kept else None) \
                        if l == L - 1 else None
                once = l == 0 and self._agg_layout is not None and a is not None
                if a is not None and l == 1 and self._keep_last and i == len(plan.items) - 1:
                    self._kept_agg = (c, mv.keep_range(a, "aux"))  # (keeps_last_aggregate)
                elif a is not None and not once:
                    mv.store_range(buf.agg[l], v0, a)
                if l == self._rows_layer - 1 and keep:
                    self._whole_rows(l + 1)[v0:v1].copy_(out)
                elif once:
                    self._store_aggregates(c, a, out, places)
                elif l < L - 1 and train and self._ordered_rows[l + 1] is not None:
                    # (layer 1's as the first layer's aggregates, first_aggregates_ordered)
                    value = a if l == 0 and self._narrow else out
                    ticket, k = places
                    ids = mv.take(ticket)
                    n = stored = ids.shape[0] // 2
                    if self._early(l + 1):  # the next layer's first-step rows: on the device,
                        a, b = self._first_loads.split[c]  # (and in host memory if loaded again)
                        stored = a + b
                        twin = self._buffer(self._gbuf, out.shape[1])
                        with mv.timing("time_compute_s"):
                            twin.index_copy_(0, ids[a:n], out.index_select(0, ids[n + a:]))
                    mv.store_rows(self._ordered_rows[l + 1], ids[:stored], value,
                                  ids[n:n + stored])
                    self._store_ids.release(k, mv.s_out)
                elif l < L - 1:
                    mv.store_range(buf.h[l + 1], v0, out)
                elif not train:
                    mv.store_range(buf.h[-1], v0, out)
                elif not kept:  # (kept: written where it stays)
                    mv.store_range(buf.grad[-1], v0, grad)
                if progress is not None:
                    progress(1)

            self._run_pass(fetch, run, loose=train and self._ends_before_stores(l))
        return acc

    def _ends_before_stores(self, l: int) -> bool:
        """Whether training's forward pass of layer ``l`` may end before its
        stores are done, the next pass computing while they go (the stores of
        a^1 on R-MAT 2^22 GCN 3×256 went on 29 ms after the hidden layer's
        last chunk computed): each store reads a tensor compute made for it,
        which the allocator keeps until it is stored (:meth:`Mover.join`), and
        every load of rows after it waits for it (:meth:`Mover.barrier`). Not
        resident, where later passes read the buffers the stores write in
        place, with no load to wait for them; not where the pass writes the
        next layer's rows in first-load order by
        index arrays that the store stream reads from memory backward passes
        load into (:meth:`Mover.forward_spare`); one process (on two H200s,
        where each rank's backward waits for all its stores before its first
        load, R-MAT 2^22 GCN 3×256 took 0.193 against 0.188 s, one run each)."""
        ordered = l + 1 < self.model.num_layers and self._ordered_rows[l + 1] is not None \
            and not (l == 0 and self._agg_layout is not None)
        return self.comm is None and not self.resident and not ordered

    def _store_aggregates(self, c: int, a: Tensor, out: Tensor, places) -> None:
        """Store chunk ``c``'s first-layer aggregates ``a`` where layer 1 loads
        them (:func:`aggregates_in_load_order`): compacted by position on the
        device, then one copy per run; the rows layer 1's first step loads also
        go, as the layer's output ``out``, where that step takes them
        (:meth:`_early`)."""
        mv, lay = self.mover, self._agg_layout
        ticket, k = places
        order = mv.take(ticket)
        with mv.timing("time_compute_s"):
            value = a.index_select(0, order)
            if self._early(1):
                twin = self._buffer(self._gbuf, out.shape[1])
                for p, o, rows in lay.runs[c]:
                    if p >= lay.first:
                        break
                    torch.index_select(out, 0, order[o:o + rows], out=twin[p:p + rows])
        mv.store_runs(self.buf.agg[0], value, lay.runs[c])
        self._store_ids.release(k, mv.compute)

    def _keep_update(self, l: int, c: int, block, a: Tensor, x_dst: Tensor | None, seed: int,
                     nxt: int, dst_dropped: bool) -> Tensor:
        """Layer ``l``'s update of chunk ``c`` under autograd, its graph kept for
        the backward pass (``keep_graphs``); the output, detached."""
        need_in = l > 0  # (as backward: ∇h^0 is never needed)
        a = a.detach().requires_grad_(need_in)
        # (own rows may lie in memory later passes write: a copy, which the graph may save)
        x_dst = x_dst.detach().clone().requires_grad_(need_in) if x_dst is not None else None
        with torch.enable_grad():
            out = self.model.step_update(l, block, a, x_dst, seed, nxt, dst_dropped=dst_dropped)
        self._graphs[(l, c)] = (a, x_dst, out)
        return out.detach()

    def _run_pass(self, fetch, run, after=None, loose: bool = False) -> None:
        """One layer pass over the plan's items.

        ``fetch(i)`` issues item ``i``'s transfers and returns what ``run(i,
        fetched, fetch_next)`` needs. With overlap, ``run`` calls
        ``fetch_next()`` as soon as compute may overwrite what item ``i+1``'s
        transfers target (before it computes item ``i``), so the next batch's
        rows travel while this one computes; without, item ``i+1`` is fetched
        after item ``i`` ran. ``after()``, at the last item's ``fetch_next``,
        issues transfers of the pass after this one. At the end compute waits
        for the pass's loads, and for its stores unless ``loose``
        (:meth:`_ends_before_stores`) or there were none (the pending ones
        are then a loose pass's).
        """
        mv, n = self.mover, len(self.plan.items)
        mv.barrier()
        ahead = fetch(0) if n else None
        mark = []  # (the pass's own loads end here)
        for i in range(n):
            box = []

            def fetch_next(i=i, box=box):
                if mv.overlap and i + 1 < n:
                    box.append(fetch(i + 1))
                elif i + 1 == n and after is not None:
                    mark.append(mv.load_mark())
                    after()

            mv.step()
            run(i, ahead, fetch_next)
            ahead = box[0] if box else (fetch(i + 1) if i + 1 < n else None)
        mv.join(mark[0] if mark else None, stores=not loose and mv.stored_in_pass)

    def _exchange(self, s: int, tbuf: Tensor) -> None:
        """Rows entering other ranks' receive areas go to them; rows entering this
        rank's land in its receive area (those received before stay where they are)."""
        if self.comm is None:
            return
        slots, send, recv, into = self.plan.sends(s)
        n = sum(recv)
        area = tbuf.narrow(0, self.plan.plan.num_slots, n) if into is None \
            else tbuf.new_empty((n, tbuf.shape[1]))
        self.mover.exchange(self.comm, area, recv, tbuf.index_select(0, slots), send)
        if into is not None:
            with self.mover.timing("time_d2d_s"):
                tbuf.index_copy_(0, into, area)

    def _exchange_back(self, s: int, gbuf: Tensor) -> None:
        """Gradients of the received rows leaving after step ``s`` return to their
        owners, and those returned to this rank are added at its slots."""
        if self.comm is None:
            return
        leave, out_counts, slots, in_counts = self.plan.returns(s)
        back = gbuf.new_empty((slots.shape[0], gbuf.shape[1]))
        self.mover.exchange(self.comm, back, in_counts, gbuf.index_select(0, leave), out_counts)
        gbuf.index_add_(0, slots, back)

    def _reduce(self, res: StepResult) -> None:
        """Loss and accuracy counts of all ranks."""
        keys = sorted(res.correct)
        t = torch.tensor([res.loss] + [res.correct[k] for k in keys]
                         + [res.total[k] for k in keys], dtype=torch.float64, device=self.device)
        self.comm.all_reduce_(t)
        v = t.tolist()
        res.loss = v[0]
        for i, k in enumerate(keys):
            res.correct[k], res.total[k] = int(v[1 + i]), int(v[1 + len(keys) + i])

    def _output(self, logits: Tensor, v0: int, v1: int, train: bool, acc: Tensor,
                into: Tensor | None = None) -> Tensor | None:
        """Count correct predictions into ``acc``; in training add the chunk's loss and
        return ``∇h^L`` of its rows (written into ``into`` when given). Device-side
        only: nothing waits for the GPU. On a GPU (float32) one kernel."""
        kernel = engine_kernels("loss") if logits.is_cuda and logits.dtype == torch.float32 \
            and logits.stride(1) == 1 else None
        y = self.labels[v0:v1]
        cols = y.clamp(0, self._classes - 1)  # (the labels as gather indices)
        if kernel is not None and logits.shape[1] <= kernel.MAX_CLASSES:
            grad = (into if into is not None else torch.empty_like(logits)) if train else None
            kernel.output_triton(logits, y, cols, self._splits[v0:v1], acc, self.num_train,
                                 grad)
            return grad
        grad = _output_torch(logits, y, cols.unsqueeze(1), self._splits[v0:v1], acc,
                             self.num_train, train)
        if into is None or grad is None:
            return grad
        into.copy_(grad)
        return into

    # ------------------------------------------------------------ backward
    def backward(self, epoch: int, progress=None) -> None:
        """Backward over all layers; parameter gradients accumulate in ``.grad``."""
        model, buf, mv, plan = self.model, self.buf, self.mover, self.plan
        model.train(True)
        self._ahead = None  # (passes before the first layer's overwrite those rows)
        self._held = self._head = None
        # (with _in_flushes the first layer's backward runs on layer 1's flushes)
        for l in reversed(range(1 if self._in_flushes else 0, model.num_layers)):
            layer = model.layers[l]
            seed, nxt = self._seed(epoch, l), self._seed(epoch, l + 1)
            need_in = l > 0  # ∇h^0 is never needed: inputs carry no gradient
            into_first = l == 1 and self._in_flushes
            width = buf.h[l].shape[1]
            tbuf = self._buffer(self._tbuf, width)
            gbuf = self._buffer(self._gbuf, width)
            # Where nothing reached a row's gradient yet in this pass, its flush
            # is written (by the GPU), later ones added; rows no flush writes are
            # zeroed. Own-row gradients (layers that read their destinations'
            # rows) are added at their slots (own_in_sources) or in host memory
            # chunk by chunk, which the plan's flush order counts (_own_host);
            # where nothing can be written, ∇h^l starts at zero and everything
            # is added.
            # A whole layer's gradients add up on the device and go to host at
            # the end of the pass, written over what it held.
            whole = self._whole[l]
            write = (need_in and not self._direct and not whole and not into_first
                     and mv.can_write(buf.grad[l]))
            if write:
                buf.grad[l][torch.from_numpy(plan.unwritten)] = 0
            elif need_in and whole:
                self._grad_rows(l).zero_()
            elif need_in and not into_first:
                buf.grad[l].zero_()

            # A cached layer that stores no aggregate outputs finish(a), which
            # adds one row (the bias): ∇a is ∇h^{l+1}, and finish's parameters
            # take their gradient once, from its column sums over the pass.
            gsum = None if self.stored[l] or not self.cached[l] else torch.zeros(
                layer.out_width, dtype=buf.h[l].dtype, device=self.device)

            items = self._back_items(l)

            def fetch(i, l=l, layer=layer, tbuf=tbuf, items=items):
                s, _, c, first, _ = items[i]
                v0, v1 = self.chunks.range(c)
                start = self._prefetch_from
                if l == self._prefetch_in and self._prefetch and i >= start:
                    self._fetch_ahead(i - start, len(plan.items) - start)
                rows = None if self.cached[l] else self._fetch_rows(l, i, s, first, tbuf)
                g_out = Ticket(self._kept_grads(l + 1)[v0:v1]) if self._kept[l + 1] \
                    else mv.fetch_range(buf.grad[l + 1], v0, v1, "grad")
                dst = mv.fetch_range(buf.h[l], v0, v1, "dst") \
                    if layer.needs_dst and not self._dst_in_sources(l) else None
                head = None
                if i == 0:  # (its first reads may have been issued during the pass before)
                    head, self._head = self._head, None
                return rows, g_out, dst, *(head or self._backward_reads(l, c))

            def run(i, fetched, fetch_next, l=l, layer=layer, seed=seed, nxt=nxt, tbuf=tbuf,
                    gbuf=gbuf, need_in=need_in, write=write, gsum=gsum, into_first=into_first,
                    items=items):
                s, q, c, first, last = items[i]
                rows = fetched[0]
                if rows is not None:
                    mv.place(rows)
                    self._exchange(s, tbuf)
                if first and need_in and not self._direct and not self._whole[l]:
                    # rows entering: no gradient (in reverse, those leaving in forward order)
                    entering = plan.flush(s)[1] if items is plan.items_reversed \
                        else plan.load(s)[1]
                    gbuf.index_fill_(0, entering, 0)
                    if self.comm is not None:  # (nor do those entering the receive area)
                        gbuf.index_fill_(0, plan.entering(s), 0)
                # (the first piece of the step's flushed rows' aggregates travels
                # beside its last chunk)
                piece = self._flush_gather(s, 0) if last and into_first else None
                fetch_next()
                self._backward_chunk(l, layer, q, c, fetched, tbuf, gbuf, need_in, seed, nxt,
                                     gsum)
                if progress is not None:
                    progress(1)
                if last and need_in and not self._direct and not self._whole[l]:
                    self._exchange_back(s, gbuf)
                    if into_first:
                        self._first_backward_on_flush(s, gbuf, piece, epoch)
                        return
                    if l == 1 and self._hold and s == plan.plan.num_steps - 1:
                        if write not in self._held_by:
                            self._held_by[write] = plan.held(write, self.chunks.range)
                        self._held = self._held_by[write]  # (for layer 0's backward)
                        return
                    if write:
                        _, slots, ids_dev = plan.flush(s, first=True)
                        mv.write_rows(buf.grad[l], ids_dev, slots, gbuf)
                        ids, slots, ids_dev = plan.reflush(s)
                    else:
                        ids, slots, ids_dev = plan.flush(s)
                    mv.flush_rows(buf.grad[l], ids, slots, gbuf, ids_dev=ids_dev)

            # (the next pass's first aggregate and block travel beside the last batch)
            self._run_pass(fetch, run, (lambda l=l: self._backward_head(l - 1))
                           if l > 0 and mv.overlap and not into_first else None)
            if gsum is not None:
                with mv.timing("time_compute_s"):
                    model.finish_backward(l, gsum)
            if need_in and self._whole[l] and not self._kept[l]:
                mv.store_range(buf.grad[l], 0, self._grad_rows(l))
                mv.join()  # the next pass reuses that memory
            elif need_in and self._kept[l]:
                kept = self._kept_grads(l)
                if kept.data_ptr() != self._grad_rows(l).data_ptr():
                    with mv.timing("time_compute_s"):  # (∇h^L, under them, is spent)
                        kept.copy_(self._grad_rows(l))
            mv.drain()  # ∇h^l complete in host memory before layer l-1 reads it
        if self.comm is not None:
            self.comm.all_reduce_grads(self.model.parameters())

    def _flushed(self, s: int) -> int:
        """How many rows layer 1's step ``s`` flushes (in reverse: loads)."""
        p = self.plan.plan.load_ptr if self._reverse else self.plan.plan.flush_ptr
        return int(p[s + 1]) - int(p[s])

    def _flushed_rows(self, s: int, a: int, b: int) -> tuple[Tensor, Tensor]:
        """``(local row ids, slots)`` of rows ``a .. b-1`` of those layer 1's step
        ``s`` flushes, in the order :meth:`_flush_gather` brings their aggregates
        (reversed: :class:`_FoldOrder`'s)."""
        if not self._reverse:
            _, slots, ids = self.plan.flush(s)
            return ids[a:b], slots[a:b]
        p0 = int(self.plan.plan.load_ptr[s])
        at = self._fold.perm[p0 + a:p0 + b]
        return self.plan.load_ids.index_select(0, at), self.plan.load_slots.index_select(0, at)

    def _flush_gather(self, s: int, k: int) -> tuple[Ticket, int, int] | None:
        """Start bringing piece ``k`` of the aggregates ``a^0`` of the rows layer
        1's step ``s`` flushes (:func:`first_backward_in_flushes`) into one of two
        device pieces; ``(ticket, a, b)``: its flush positions, or ``None`` past
        the last. In reverse (:func:`backward_in_reverse`) the rows the step
        loads first come as one copy and only those it loads again are gathered."""
        n = self._flushed(s)
        a = k * self._flush_piece
        if a >= n:
            return None
        b = min(a + self._flush_piece, n)
        out, free = self._flush_rows[k % 2], self._flush_free[k % 2]
        if not self._reverse:
            _, _, ids = self.plan.flush(s)
            at = self._agg_layout.pos if self._agg_layout is not None else None
            return self.mover.gather_rows(self.buf.agg[0], ids[a:b], out, free, at), a, b
        fl, fo = self._first_loads, self._fold
        r0, first = int(fl.run[s]), int(fl.run[s + 1] - fl.run[s])
        g0 = int(fo.again_ptr[s])
        again = fo.again_pos[g0 + max(a - first, 0):g0 + max(b - first, 0)]
        run = (r0 + min(a, first), r0 + min(b, first))
        return self.mover.gather_rows(self.buf.agg[0], again, out, free, run=run), a, b

    def _first_backward_on_flush(self, s: int, gbuf: Tensor, piece, epoch: int) -> None:
        """The first layer's backward on the gradient rows layer 1's step ``s``
        flushes (``∇h^1`` partial sums, at their slots of ``gbuf``): its update
        run again on their aggregates and its backward from those gradients,
        a piece at a time, the next piece's aggregates travelling meanwhile."""
        model, mv = self.model, self.mover
        seed, nxt = self._seed(epoch, 0), self._seed(epoch, 1)
        k = 0
        while piece is not None:
            ticket, a, b = piece
            piece = self._flush_gather(s, k + 1)
            rows = mv.take(ticket)
            with mv.timing("time_compute_s"):
                ids, slots = self._flushed_rows(s, a, b)
                g = gbuf.index_select(0, slots)
                _update_backward(model, 0, _Rows(ids + self.chunks.row0), rows, None, g,
                                 seed, nxt, need_in=False)
            if mv.overlap:  # (the gather after next may overwrite these rows then)
                done = torch.cuda.Event()
                done.record(mv.compute)
                self._flush_free[k % 2] = done
            k += 1

    def _backward_reads(self, l: int, c: int) -> tuple:
        """Layer ``l``'s backward reads of chunk ``c`` that no pass before it in
        backward writes: its cached aggregate and its block (a cached first
        layer, whose inputs need no gradient, recomputes only its update, which
        reads no graph, its own rows coming as a range: its blocks stay in host
        memory; other cached layers read the graph through the aggregation's
        transpose only)."""
        mv = self.mover
        v0, v1 = self.chunks.range(c)
        kept = self._kept_agg if l == 1 else None
        if kept is not None and kept[0] == c:  # (on the device: keeps_last_aggregate)
            agg, self._kept_agg = kept[1], None
        elif self.stored[l] and self.buf.agg[l] is not None:
            agg = mv.fetch_range(self.buf.agg[l], v0, v1, "aux")
        else:
            agg = None  # (none stored, or its graph kept)
        if self.cached[l] and l == 0:
            return agg, self._blocks[c]
        return agg, self._fetch_block(c, Block.NOT_TRANSPOSED if self.cached[l] else ())

    def _backward_head(self, l: int) -> None:
        """Start layer ``l``'s backward pass's first :meth:`_backward_reads` now
        (during the pass before it)."""
        self._head = self._backward_reads(l, self._back_items(l)[0][2])

    def _back_items(self, l: int) -> list[tuple]:
        """The plan's items in the order layer ``l``'s backward pass visits them
        (:func:`backward_in_reverse`)."""
        return self.plan.items_reversed if l == 1 and self._reverse else self.plan.items

    def _backward_chunk(self, l: int, layer, q: int, c: int, fetched, tbuf: Tensor,
                        gbuf: Tensor, need_in: bool, seed: int, nxt: int,
                        gsum: Tensor | None) -> None:
        model, buf, mv = self.model, self.buf, self.mover
        _, g_out, dst, agg, block = fetched
        block = self._take_block(block)
        v0, _ = self.chunks.range(c)
        g_out = mv.take(g_out)
        if l == 0 and self._held is not None:
            self._add_held(c, g_out)
        if gsum is not None:  # output finish(a), finish adds a row: no autograd
            with mv.timing("time_compute_s"):
                gsum.add_(g_out.sum(0))
                if need_in:
                    g = model.step_aggregate_transpose(l, block, g_out, seed)
                    self._add_sources(l, q, block, gbuf, g)
            return
        x_dst = mv.take(dst).detach().requires_grad_(need_in) if dst is not None else None
        a = mv.take(agg) if agg is not None else None  # (none: not stored, or graph kept)
        graph = self._graphs.pop((l, c), None)
        with mv.timing("time_compute_s"), torch.enable_grad():
            if graph is not None:  # the update's graph, kept by the forward pass
                a, x_kept, out = graph
                graph = None
                _backward(out, g_out)
                del out
                x_dst = x_kept if x_kept is not None else x_dst  # (its gradient added below)
                g_src = (model.step_aggregate_transpose(l, block, a.grad, seed)
                         if need_in and a.grad is not None else None)
            elif a is not None:
                g_a = _update_backward(model, l, block, a, x_dst, g_out, seed, nxt, need_in)
                g_src = (model.step_aggregate_transpose(l, block, g_a, seed)
                         if need_in and g_a is not None else None)
            else:
                x_src = self._sources(l, q, block, tbuf).detach().requires_grad_(need_in)
                own = self._dst_in_sources(l)
                if own:  # (a view outside autograd: its gradient is added into x_src's
                    # below, in place, not through a zero-padded copy of all sources)
                    x_dst = self._own_of(c, x_src.detach(), block).requires_grad_(need_in)
                out = model.step_forward(l, block, x_src, x_dst, seed, nxt)
                _backward(out, g_out)
                g_src = x_src.grad if need_in else None
                if own and need_in and x_dst.grad is not None:
                    if g_src is None:
                        g_src = torch.zeros_like(x_src)
                    self._own_of(c, g_src, block).add_(x_dst.grad)
            if g_src is not None:
                self._add_sources(l, q, block, gbuf, g_src)
        if need_in and dst is not None and x_dst.grad is not None:
            if self._whole[l]:
                self._grad_rows(l)[v0:v0 + x_dst.shape[0]].add_(x_dst.grad)
            elif self._own_at is not None and not self._direct:  # at the rows' slots
                with mv.timing("time_compute_s"):
                    p = self._own_at[c]
                    add_rows(gbuf, self.plan.slots(q)[p:p + x_dst.shape[0]], x_dst.grad)
            else:
                mv.add_range(buf.grad[l], v0, x_dst.grad)

    def _add_held(self, c: int, g: Tensor) -> None:
        """``∇h^1`` of chunk ``c`` (``g``, as read from host memory) completed by the
        gradients layer 1's backward held on the device (:func:`gradients_held`)."""
        (w0, w1, a0, a1), local, slots = self._held[0][c], *self._held[1:]
        if w0 == w1 and a0 == a1:
            return
        gbuf = self._buffer(self._gbuf, g.shape[1])
        with self.mover.timing("time_compute_s"):
            if w1 > w0:
                g.index_copy_(0, local[w0:w1], gbuf.index_select(0, slots[w0:w1]))
            if a1 > a0:
                g.index_add_(0, local[a0:a1], gbuf.index_select(0, slots[a0:a1]))

    def step(self, epoch: int, progress=None, after_backward=None) -> StepResult:
        """Forward + loss + backward: leaves the full-graph gradients in the parameters.

        Where it may (:attr:`_late_result`), backward is issued before the
        loss is read, so the device goes from forward to backward without
        waiting for this thread, and the times of finished work are read
        while the device ends the step. ``after_backward()`` runs once
        backward is issued, before the loss is read there (the trainer
        issues its optimizer step behind backward so).
        """
        self.model.zero_grad(set_to_none=True)
        acc = self._forward(epoch, train=True, progress=progress)
        if not self._late_result:
            res = self._result(acc)
        self.backward(epoch, progress=progress)
        if after_backward is not None:
            after_backward()
        if self._late_result:
            self.mover.fold(done_only=True)
            res = self._result(acc)
        return res

    def evaluate(self, epoch: int, progress=None) -> StepResult:
        """Forward without dropout; accuracies per split, logits in ``h^L``."""
        return self.forward(epoch, train=False, progress=progress)

    def batches_per_epoch(self, evaluate: bool) -> int:
        """Chunk visits of one epoch (for progress bars)."""
        per_pass = self.plan.plan.chunk_ids.shape[0]
        L = self.model.num_layers
        return per_pass * (3 * L if evaluate else 2 * L) - per_pass * self._in_flushes


_SPLITS = ("train", "val", "test")


def _output_torch(logits: Tensor, y: Tensor, cols: Tensor, splits: Tensor, acc: Tensor,
                  num_train: int, train: bool) -> Tensor | None:
    """:meth:`Executor._output` in torch ops (CPU, non-float32, very many classes):
    ``cols`` ``(n, 1)`` the labels clamped to the classes, ``splits`` ``(n, 3)``."""
    hit = (logits.argmax(dim=-1) == y).unsqueeze(1)
    acc[1:4] += (hit & splits).sum(0)  # (split sizes: once per pass)
    if not train:
        return None
    # Cross-entropy over the train rows, normalised by the whole graph's
    # train count, and its gradient (softmax - onehot) / count; rows outside
    # the train split contribute exactly zero.
    m = splits[:, :1]
    z = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(z, dim=1)
    acc[0] -= torch.where(m, logp.gather(1, cols), 0.0).sum().to(acc.dtype) / num_train
    grad = logp.exp_()
    grad.scatter_add_(1, cols, torch.full_like(cols, -1, dtype=grad.dtype))
    return torch.where(m, grad.div_(num_train), 0.0).to(logits.dtype)


class _Rows:
    """What a cacheable layer's update reads of a block (:meth:`GNN.step_update`):
    its destinations' global ids, here any rows ``ids``."""

    def __init__(self, ids: Tensor) -> None:
        self.ids, self.seed = ids, None

    def dst_ids(self, device: torch.device | None = None) -> Tensor:
        return self.ids if device is None else self.ids.to(device)


def _update_backward(model: GNN, l: int, block, a: Tensor, x_dst: Tensor | None, grad: Tensor,
                     seed: int, nxt: int, need_in: bool) -> Tensor | None:
    """The backward of layer ``l``'s update at its aggregate ``a`` (and own rows
    ``x_dst``) for ``grad``: its products written out where the model may
    (:meth:`GNN.update_backward`), else through autograd; ``∇a`` with
    ``need_in``, else ``None`` (``∇x_dst`` into ``x_dst.grad`` where it
    requires one)."""
    done, g_a = model.update_backward(l, block, a, grad, nxt, need_in, x_dst, seed)
    if done:
        return g_a
    a = a.detach().requires_grad_(need_in)
    with torch.enable_grad():
        _backward(model.step_update(l, block, a, x_dst, seed, nxt), grad)
    return a.grad


def _backward(out: Tensor, grad: Tensor) -> None:
    if out.requires_grad:
        out.backward(grad)
