r"""Device memory budget: what one chunk needs, and the fewest chunks that fit.

The estimate is per chunk and per layer, the peak of forward and backward:

* the device row memory (:func:`row_memory`): the transition buffer and its
  gradient twin (the plan's buffer rows) and staging for the next step's
  neighbour rows (with overlap), at the widest layer; destination-row slots
  (own rows, cached aggregates, output gradients; :func:`slot_widths`),
  double-buffered with overlap, each as wide as what it holds;
* the chunk's block (two copies of its edges, plus per-edge weights);
* the step of the layer (:func:`batch_bytes`): for a cached layer the larger
  of its forward (sources gathered and dropped out, or, aggregated where
  they lie, :func:`aggregates_in_place`, the adjacency's columns; the
  aggregate) and its backward (the transpose's output, or the update's
  gradients); for a recomputed one its sources and their gradient beside
  the aggregate, the output and their gradients (dropout masks where no
  fused kernel runs); plus the layer's own ``extra_device_bytes``;
* parameters with their gradients and Adam's two moments, and, where they are
  small enough (:func:`step_ahead`), the copy of the parameters and moments
  the trainer takes each epoch to issue the optimizer step behind backward.

On a GPU the executor measures the real peak; the estimate is what
``engine.chunks: auto`` is chosen with and what ``hongtu report`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hongtu.config import format_size
from hongtu.engine.transfer import HOLD_BATCHES
from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.graph._kernels import RunBitmaps, unique_union
from hongtu.nn import ops
from hongtu.nn.model import GNN
from hongtu.partition import Chunker, Partition
from hongtu.partition._kernels import distinct_sources

__all__ = ["AUTO_BUDGET_FRACTION", "CHUNK_CANDIDATES", "ROWS_PER_EXTRA_CHUNK", "ChunkSizes",
           "Chunkings", "aggregates_in_place", "batch_bytes", "check_device_budget",
           "choose_chunks", "choose_resident", "chunk_sizes",
           "estimate_device_bytes", "first_layer_stores", "first_layer_whole_faster",
           "grown_row_memory", "held_store_bytes", "kept_graph_bytes", "kept_graph_layers",
           "kept_graph_need", "kept_graphs", "leftover_bytes", "more_chunks", "more_chunks_text",
           "plan_loads", "resident_block_bytes", "row_memory", "slot_widths", "spare_rows",
           "takes_more_chunks", "whole_layer_needs"]

CHUNK_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                    768, 1024, 1536, 2048, 4096)
#: chunk counts sized by one pass over the edges when the search needs one
#: (:meth:`Chunkings.count`): the count it stops at is most often within three
#: of its start
_AHEAD = 4
_MASK_BYTES = 5  # dropout: the boolean mask and the masked copy's extra, per element
# (none when the fused GPU kernel runs, ops.fused_dropout: counted then only for
# layers with their own forward, whose peaks were measured with it counted)
# Fixed extras: cuSPARSE's buffers and allocator slack. (The dropout mask is
# one Triton kernel on GPUs and a numba kernel on CPU: no int64 temporaries.
# Only the tensor-op fallback, on a GPU without Triton, hashes MASK_BLOCK
# elements at a time, ~48 B each, about 200 MB more than this estimate.)
_FIXED_EXTRA = 64 << 20
#: bytes of the first layer's aggregates gathered at a time for its backward
#: run on layer 1's gradient flushes (two such pieces in flight)
FLUSH_PIECE_BYTES = 64 << 20
_SLACK = 1.10


@dataclass
class ChunkSizes:
    """Rows and edges of every chunk (flat, ``m * n``)."""

    num_src: np.ndarray
    num_dst: np.ndarray
    num_edges: np.ndarray


#: parameters and optimizer state at most this large (a copy each epoch) let the
#: optimizer step be issued behind backward (:meth:`~hongtu.engine.Trainer.run_epoch`)
STEP_AHEAD_BYTES = 64 << 20


def step_ahead(param_bytes: int) -> bool:
    """Whether the trainer issues the optimizer step behind backward for
    parameters of ``param_bytes``: where a copy of them and of Adam's two
    moments (three times as much) takes at most :data:`STEP_AHEAD_BYTES`."""
    return 3 * int(param_bytes) <= STEP_AHEAD_BYTES


def chunk_sizes(graph: Graph, perm: np.ndarray, chunk_ptr: np.ndarray) -> ChunkSizes:
    """Sizes of the chunks ``chunk_ptr`` cuts from ``graph`` renumbered by ``perm``.

    ``graph`` is in the user's ids; ``perm`` maps new ids to them.
    """
    num_src = distinct_sources(graph.indptr, graph.indices, perm, chunk_ptr)
    return _sizes(_in_edge_prefix(graph, perm), chunk_ptr, num_src)


def _in_edge_prefix(graph: Graph, perm: np.ndarray) -> np.ndarray:
    """Running in-edge count over the vertices in ``perm`` order (``0`` first)."""
    cum = np.zeros(graph.num_nodes + 1, dtype=np.int64)
    np.cumsum(graph.in_degree()[perm], out=cum[1:])
    return cum


def _sizes(cum: np.ndarray, chunk_ptr: np.ndarray, num_src: np.ndarray) -> ChunkSizes:
    return ChunkSizes(num_src, np.diff(chunk_ptr), cum[chunk_ptr[1:]] - cum[chunk_ptr[:-1]])


def row_memory(buffer_rows: int, widths: list[int], stage_rows: int = 0) -> int:
    """Elements of the device row memory: the transition buffer and its gradient
    twin (``buffer_rows`` of the widest row each), then the staging area for the
    next step's neighbour rows (``stage_rows``; the plan's ``max_later_load``
    with overlap, else 0). One allocation, so a layer moved whole may use all of it."""
    return (2 * int(buffer_rows) + int(stage_rows)) * max(widths)


def whole_layer_needs(num_rows: int, widths: list[int], load_rows: int,
                      exchange: bool, first_rows: int | None = None,
                      first_stores: int = 0) -> list[int | None]:
    """Row-memory elements each layer needs to move all its rows per pass, or
    ``None`` where it should not.

    A layer needs its rows (``num_rows`` of ``widths[l]``) and their gradients,
    except the first layer, whose inputs carry no gradient. It should move whole
    when the plan would load at least as many rows per pass (``load_rows``): no
    more bytes, as DMA instead of a gather — only for a lone process
    (``exchange`` false; otherwise rows of other parts travel by the plan's
    exchange). The first layer only when the plan would load more, and then
    only where that is the faster pass (:func:`first_layer_whole_faster`, given
    the plan's first step's rows ``first_rows`` and the elements its forward
    stores per row ``first_stores``; ``first_rows`` ``None``: whenever the plan
    loads more).
    """
    out: list[int | None] = []
    for l, w in enumerate(widths[:-1]):
        if l == 0:
            more = load_rows > num_rows and (first_rows is None or first_layer_whole_faster(
                num_rows, w, load_rows, first_rows, first_stores))
        else:
            more = load_rows >= num_rows
        out.append(num_rows * w * (1 if l == 0 else 2) if more and not exchange else None)
    return out


def first_layer_whole_faster(num_rows: int, width: int, load_rows: int, first_rows: int,
                             stores: int) -> bool:
    """Whether the first layer's forward pass takes less link time copying all
    its ``num_rows`` rows at the start than loading the plan's ``load_rows``
    step by step (``first_rows`` at its first step), given the ``stores``
    elements per row it writes back (its output rows and cached aggregate).

    Whole, nothing is computed or stored before the copy ends: ``n·w + n·s``.
    Step by step, the pass waits for its first step's rows, then the other
    steps' rows travel while it stores (each direction at the link's rate):
    ``r0·w + max((r - r0)·w, n·s)``. A pass that stores more than it loads
    gains from starting early (products-like GCN 3×256, nvidia-h200: forward
    pass 68 against 86 ms, epoch 0.376 against 0.390 s). Never whole when the
    plan loads no more rows than there are (R-MAT 2^22 GCN 2×256, each row
    loaded once: 0.204 s step by step against 0.218 s whole).
    """
    whole = num_rows * (width + stores)
    plan = first_rows * width + max((load_rows - first_rows) * width, num_rows * stores)
    return load_rows > num_rows and whole < plan


def first_layer_stores(widths: list[int], cached: list[bool]) -> int:
    """Elements per row the first layer's forward pass writes to host memory:
    its output rows and, when cached, its aggregate (the output counted even
    where ``h^1`` stays on the device: the rule then leans to step by step)."""
    return widths[1] + (widths[0] if cached[0] else 0)


def grown_row_memory(memory: int, spare_bytes: int | None, num_rows: int, widths: list[int],
                     load_rows: int, exchange: bool, itemsize: int = 4,
                     keep_rows: bool = False, first_rows: int | None = None,
                     first_stores: int = 0) -> int:
    """The row memory to allocate (elements): the plan's ``memory``, grown by at
    most ``spare_bytes`` when that lets more layers move whole
    (:func:`whole_layer_needs`, with ``first_rows`` and ``first_stores``): to
    the largest need that fits. With
    ``keep_rows`` (the second layer reads its rows in its forward aggregation
    only, :func:`~hongtu.engine.executor.reads_rows_once`), room for ``h^1``
    after the first layer's plan memory also counts: the first layer's pass
    leaves those rows on the device (:func:`~hongtu.engine.executor.rows_kept_at`). No
    budget (``None``) or nothing to gain: the plan's."""
    if not spare_bytes or spare_bytes <= 0:
        return int(memory)
    top = int(memory) + int(spare_bytes) // itemsize
    needs = whole_layer_needs(num_rows, widths, load_rows, exchange, first_rows, first_stores)
    if keep_rows and len(needs) > 1 and needs[1] is not None:
        size = num_rows * widths[1]
        needs.append(size + max(size, int(memory)))
    return max([n for n in needs if n is not None and n <= top] + [int(memory)])


def _piece_rows(width: int, itemsize: int, max_rows: int) -> tuple[int, int]:
    """``(bytes of a row, rows)`` of a whole piece of :func:`flush_piece_rows`."""
    row = max(1, width * itemsize)
    return row, max(1, min(int(max_rows), FLUSH_PIECE_BYTES // row))


def flush_piece_rows(width: int, itemsize: int, max_rows: int, reserve: int = 0) -> int:
    """Rows of a piece of the first layer's backward run on layer 1's flushes
    (:func:`~hongtu.engine.executor.first_backward_in_flushes`): at most
    :data:`FLUSH_PIECE_BYTES` of aggregates ``width`` wide and no more than a
    chunk's ``max_rows`` destinations (what that layer's own backward step
    computes on at once), each of the two pieces giving up half of
    ``reserve`` bytes (:func:`aggregate_positions_bytes`), down to a quarter
    of its rows."""
    row, rows = _piece_rows(width, itemsize, max_rows)
    return max(rows - -(-int(reserve) // (2 * row)), -(-rows // 4))


def flush_piece_spare(width: int, itemsize: int, max_rows: int, reserve: int = 0) -> int:
    """Bytes the two pieces of :func:`flush_piece_rows` can give up beyond
    ``reserve`` before they reach their floor (a quarter of their rows): room
    for more index arrays within what the estimate counts for them."""
    row, rows = _piece_rows(width, itemsize, max_rows)
    return max(0, 2 * (rows - -(-rows // 4)) * row - int(reserve))


def first_layer_may_fold(model: GNN) -> bool:
    """Whether ``model`` lets its first layer's backward run on layer 1's
    gradient flushes (:func:`~hongtu.engine.executor.first_backward_in_flushes`
    adds what the plan and the device decide): two layers or more, and a
    cacheable first layer that reads no own rows (it needs no gradient of
    its inputs)."""
    first = model.layers[0]
    return model.num_layers >= 2 and first.cacheable and not first.needs_dst


def aggregate_positions_bytes(model: GNN, num_nodes: int, gpu: bool) -> int:
    """Device bytes of where each row's first-layer aggregate lies in host
    memory (int32 per row) where training on a GPU may store ``a^0`` once, in
    the order layer 1 first loads it (:func:`~hongtu.engine.executor.aggregates_in_load_order`),
    and gather it from there for the first layer's backward on layer 1's
    flushes: where the model may run that backward (:func:`first_layer_may_fold`)
    and its aggregates are narrower than layer 1's rows (whether the plan
    lets it is known after the estimate: counted either way)."""
    widths = model.row_widths()
    if not gpu or not first_layer_may_fold(model) or widths[0] >= widths[1]:
        return 0
    return 4 * int(num_nodes)


def flush_pieces_bytes(model: GNN, max_rows: int, itemsize: int, num_nodes: int = 0,
                       gpu: bool = False) -> int:
    """Device bytes of the two pieces of aggregates the first layer's backward
    on layer 1's flushes gathers, where the model may run it
    (:func:`first_layer_may_fold`; whether the plan lets it is known after the
    estimate: counted either way), and of their rows' positions
    (:func:`aggregate_positions_bytes`, of ``num_nodes`` rows on a ``gpu``),
    which the pieces make room for."""
    if not first_layer_may_fold(model):
        return 0
    w = model.row_widths()[0]
    reserve = aggregate_positions_bytes(model, num_nodes, gpu)
    return 2 * flush_piece_rows(w, itemsize, max_rows, reserve) * w * itemsize + reserve


def slot_widths(model: GNN, cached: list[bool] | None = None,
                copied_dst: list[bool] | None = None) -> dict[str, int]:
    """Widths of the destination-row slots a pass fills: a layer's own rows
    (``copied_dst``: the layers that copy them from host memory, default those
    that read them), the cached aggregate (``cached``: the layers that
    store one, default :meth:`~hongtu.nn.model.GNN.stored_aggregates`), and
    ``∇h^{l+1}`` (0: unused)."""
    cached = model.stored_aggregates() if cached is None else cached
    copied = [x.needs_dst for x in model.layers] if copied_dst is None else copied_dst
    widths = model.row_widths()
    layers = range(model.num_layers)
    return {"dst": max((widths[l] for l in layers if copied[l]), default=0),
            "aux": max((widths[l] for l in layers if cached[l]), default=0),
            "grad": max(widths[1:])}


def estimate_device_bytes(model: GNN, sizes: ChunkSizes, itemsize: int = 4,
                          training: bool = True, num_nodes: int = 0,
                          buffer_rows: int | None = None, overlap: bool = True,
                          load_rows: int | None = None, resident: bool = False,
                          copied_dst: list[bool] | None = None,
                          device: str | None = None, direct: bool = False,
                          cached: list[bool] | None = None, exchange: bool = False) -> int:
    """Estimated peak device bytes of training ``model`` chunk by chunk.

    Args:
        model: the GNN.
        sizes: the chunks' sizes.
        itemsize: bytes per element (4 for float32).
        training: include dropout masks and gradients.
        num_nodes: vertex count (labels and masks live on the device).
        buffer_rows: rows of the transition buffer (the plan's
            ``buffer_rows``); default the largest chunk's neighbour count.
        overlap: transfers run one batch ahead (staging is double-buffered).
        load_rows: the most rows a step after the first loads (staged with
            overlap); default ``buffer_rows``.
        resident: the buffers live on the device (not counted here: see
            :meth:`~hongtu.engine.buffers.BufferPlan.resident_bytes`), so
            destination rows need no staging.
        copied_dst: the layers whose passes copy their own rows from host memory
            (default: those that read them; :func:`slot_widths`).
        device: the device type training runs on (``"cuda"``, ``"cpu"``), whose
            kernels decide which temporaries exist (a GPU's fused dropout makes
            no mask: :func:`~hongtu.nn.ops.planning_for`); ``None``: this
            machine's.
        direct: resident in one process, where the executor reads the rows in
            place and keeps no transition buffer or staging area (one row;
            ``buffer_rows`` and ``load_rows`` are then not used).
        cached: the layers that keep their aggregate in host memory (the
            resolved ``engine.checkpoint``; default
            :meth:`~hongtu.nn.GNN.cached_layers`), whose steps need less.
        exchange: one process of several (rows of other parts are exchanged:
            the first layer gathers its sources, :func:`aggregates_in_place`).
    """
    with ops.planning_for(device):
        gpu = device == "cuda" if device is not None else torch.cuda.is_available()
        return _estimate(model, sizes, itemsize, training, num_nodes, buffer_rows, overlap,
                         load_rows, resident, copied_dst, direct, cached, exchange,
                         gpu and not resident)


def _estimate(model: GNN, sizes: ChunkSizes, itemsize: int, training: bool, num_nodes: int,
              buffer_rows: int | None, overlap: bool, load_rows: int | None, resident: bool,
              copied_dst: list[bool] | None, direct: bool = False,
              cached: list[bool] | None = None, exchange: bool = False,
              gpu: bool = False) -> int:
    widths = model.row_widths()
    max_src, max_dst = int(sizes.num_src.max()), int(sizes.num_dst.max())
    rows = 1 if direct else max_src if buffer_rows is None else int(buffer_rows)
    stage = 0 if direct else (rows if load_rows is None else int(load_rows)) if overlap else 0
    ring = 0 if resident else (2 if overlap else 1)
    fixed = (row_memory(rows, widths, stage)
             + ring * max_dst * sum(slot_widths(model, copied_dst=copied_dst).values())) \
        * itemsize
    params = sum(p.numel() for p in model.parameters()) * itemsize
    fixed += params * (4 + 3 * step_ahead(params))
    fixed += num_nodes * 11  # labels (int64) and three masks (bool)
    fixed += flush_pieces_bytes(model, max_dst, itemsize, num_nodes, gpu) if training else 0
    fixed += _FIXED_EXTRA
    fixed += held_store_bytes(model, max_dst, itemsize) if gpu and overlap and not direct else 0
    return int(fixed + _SLACK * max(_batch_bytes(model, sizes, itemsize, training, cached,
                                                  exchange, direct)))


def held_store_bytes(model: GNN, max_dst: int, itemsize: int = 4) -> int:
    """Device bytes a GPU with overlap holds for the stores of the batches before
    while a batch computes: what a batch stores stays allocated until compute
    waits for its store, :data:`~hongtu.engine.transfer.HOLD_BATCHES` batches
    later (:meth:`~hongtu.engine.transfer.Mover._keep`; before, the allocator
    took it back only once this thread saw the store done, and took more
    memory meanwhile). Counted as the largest chunk's rows at the model's
    widest row per batch held beyond its own (R-MAT 2^24 GCN 2x128 on an
    H200: the measured peak rose by 0.77 GiB with them held, against 0.67 GiB
    here; the estimate has ``_SLACK`` on the batch's own bytes;
    ``bench/HISTORY.md``, 2026-11-28, twelfth)."""
    return (HOLD_BATCHES - 1) * int(max_dst) * max(model.row_widths()) * itemsize


def aggregates_in_place(model: GNN, cached: list[bool], exchange: bool = False,
                        direct: bool = False) -> list[bool]:
    """Layers whose chunks aggregate their sources where they lie on the device,
    in the transition buffer's slots or a whole layer's rows, instead of
    gathering a copy (``ops.aggregate_rows``): those with the built-in
    aggregation that read their rows as they are kept (``z^l`` or
    ``drop(h^l)``: no dropout to apply first), and a cached first layer of a
    lone process (``exchange`` false), whose rows are dropped out once where
    they lie. None when the buffers are on one device (``direct``: the rows
    are read from them)."""
    return [bool(not direct and (cached[0] and not exchange if l == 0
                                 else layer.cacheable and model.reads_as_kept(l)))
            for l, layer in enumerate(model.layers)]


def batch_bytes(model: GNN, sizes: ChunkSizes, itemsize: int = 4, training: bool = True,
                device: str | None = None, cached: list[bool] | None = None,
                exchange: bool = False, direct: bool = False) -> list[int]:
    """Per layer, the estimate's largest batch: device bytes one chunk's step
    adds to what is allocated for the whole run (its block, activations and
    gradients, and the layer's ``extra_device_bytes``), before the estimate's
    slack. ``cached``: the layers that keep their aggregate (default
    :meth:`~hongtu.nn.GNN.cached_layers`); ``exchange``: one process of
    several; ``direct``: resident in one process.
    :func:`estimate_device_bytes` is the fixed part plus the largest of these
    times its slack; ``bench/bench_memory.py`` sets each beside the measured
    peak of the layer's passes."""
    with ops.planning_for(device):
        return _batch_bytes(model, sizes, itemsize, training, cached, exchange, direct)


def _batch_bytes(model: GNN, sizes: ChunkSizes, itemsize: int, training: bool,
                 cached: list[bool] | None, exchange: bool, direct: bool) -> list[int]:
    widths, true = model.row_widths(), model.widths()
    cached = model.cached_layers() if cached is None else cached
    fused = itemsize == 4 and ops.fused_dropout()
    masks = training and model.p > 0
    here = aggregates_in_place(model, cached, exchange, direct)
    src, dst, e = sizes.num_src, sizes.num_dst, sizes.num_edges
    # the chunk's block: indices both ways with the transpose's permutation,
    # edge weights, and its vertex arrays
    block = e * (3 * 8 + itemsize + 8) + (src + dst) * (8 + itemsize) + src * 8
    out = []
    for l, layer in enumerate(model.layers):
        w_in, w_out = widths[l], widths[l + 1]
        extra = np.array([layer.extra_device_bytes(int(a), int(b), int(c), itemsize)
                          for a, b, c in zip(src, dst, e)], dtype=np.int64)
        out_drop = _MASK_BYTES if masks and not fused and model.reads_as_kept(l + 1) else 0
        if cached[l]:
            act = _cached_step_bytes(model, l, src, dst, e, itemsize, training, here[l],
                                     fused) + dst * true[l + 1] * out_drop
            out.append(int((block + act + extra).max()))
            continue
        # (no mask for rows read as kept: the layer before dropped them)
        drop = _MASK_BYTES if masks and not (fused and layer.cacheable) \
            and not model.reads_as_kept(l) else 0
        act = src * w_in * (2 * itemsize + drop) + dst * (3 * w_in + 3 * w_out) * itemsize
        if w_out != true[l + 1]:  # the next layer transforms first: h^{l+1}[V], then z
            act = act + dst * true[l + 1] * (3 * itemsize + out_drop)
        else:  # (its dropout, when the next layer reads h^{l+1} dropped out)
            act = act + dst * w_out * out_drop
        if training and layer.needs_dst and layer.cacheable:
            # a built-in aggregation's layer reading its own rows (SAGE, GIN;
            # recomputed where its own rows are among its sources) holds their
            # gradient beside the aggregate's in backward, and the transpose's
            # edge weights gathered (products-like SAGE 2x256: 113 MiB past the
            # estimate without them, measured per pass on an H200)
            act = act + dst * w_in * itemsize + e * itemsize
        out.append(int((block + act + extra).max()))
    return out


def _cached_step_bytes(model: GNN, l: int, src, dst, e, itemsize: int, training: bool,
                       in_place: bool, fused: bool):
    """Device bytes of a cached layer's step beyond its block and the layer's
    ``extra_device_bytes`` (its update's intermediates), per chunk: the larger
    of its forward and its backward (measured per pass, allocation by
    allocation, with ``bench/bench_memory.py --sites`` on an H200: GCN, SAGE
    and GIN on products-like, R-MAT 2^22 and reddit-like).

    Forward: the edge weights; the sources gathered (and dropped out), or,
    aggregated where they lie (``in_place``, :func:`aggregates_in_place`), the
    adjacency's columns as rows of the table (int64), unless no fused kernel
    drops them out there; the aggregate (the sparse product writes it into
    its own input, ``ops._csr_mm``: no copy beside it, and cuSPARSE's
    buffer is under a MiB); ``z^{l+1}`` where the next layer transforms
    first. Backward: the update's (the aggregate's gradient, or the wider
    gradient through the next layer's map where that layer transforms
    first, and the output rows'), or, where the layer's inputs take a
    gradient (not the first), the aggregation's transpose, whose output (the
    sources' gradient) lies beside the aggregate's gradient (or the gradient
    dropped out, where the layer drops its inputs). A layer reading its own
    rows also holds their gradient and the transpose's edge weights."""
    widths, true = model.row_widths(), model.widths()
    w_in, w_out = widths[l], widths[l + 1]
    layer = model.layers[l]
    sources = src * w_in * itemsize
    drops = training and model.p > 0 and not model.reads_as_kept(l)
    unfused = drops and not fused
    mask = src * w_in * _MASK_BYTES if unfused else 0
    # (where no fused kernel drops the rows out where they lie, the pieces
    # dropped out as they arrive take as much as a gathered chunk's)
    gathered = e * 8 if in_place and not unfused else sources * (2 if drops else 1) + mask
    z = dst * w_out * itemsize if w_out != true[l + 1] else 0
    forward = e * itemsize + gathered + dst * w_in * itemsize + z
    if not training:
        return forward
    own = dst * w_in * itemsize + e * itemsize if layer.needs_dst else 0
    # Where the next layer transforms first, the model's written-out backward
    # takes the gradient through that layer's map, as wide as this layer's
    # output, beside z^{l+1} and the gradient through ReLU-dropout (the layer's
    # own two rows); the aggregate's gradient comes after it is freed. (R-MAT
    # 2^22 GCN 2x256 on an H200, layer 0's backward: three 256-wide rows per
    # destination, bench_memory.py --sites; with 8 input columns the count had
    # been 0.76 of them and the chunk's block.)
    w_grad = max(w_in, true[l + 1]) if w_out != true[l + 1] else w_in
    update = e * itemsize + dst * (w_grad + w_out) * itemsize + own
    transpose = e * itemsize + sources + dst * w_in * itemsize + mask + own \
        if l > 0 else 0
    return np.maximum(forward, np.maximum(update, transpose))


#: ``engine.device_memory: auto`` on a GPU: this share of its free memory
AUTO_BUDGET_FRACTION = 0.9


def kept_graph_layers(model: GNN, cached: list[bool], stored: list[bool]) -> list[bool]:
    """Layers whose update a resident run may keep under autograd from forward to
    backward instead of running it again (``Executor(keep_graphs=True)``): cached
    ones with a stored aggregate whose update is not one linear map written out
    (:meth:`~hongtu.nn.GNN.writes_linear_backward` is false: SAGE, GIN, custom
    layers), as PyG keeps them; GCN's written-out backward recomputes only
    its one product, where the others' would recompute their whole update."""
    return [c and s and not model.writes_linear_backward(l)
            for l, (c, s) in enumerate(zip(cached, stored))]


def kept_graph_bytes(model: GNN, sizes: ChunkSizes, itemsize: int, layers: list[bool],
                     device: str | None = None) -> int:
    """Device bytes of the update graphs of ``layers`` (:func:`kept_graph_layers`)
    kept for every chunk from forward to backward in training, on ``device``
    (``"cuda"``, ``"cpu"``; ``None``: this machine's, as
    :func:`estimate_device_bytes`).

    Per chunk and layer: the update's input and a copy of its own rows, which
    the executor holds; its own rows dropped out, where the layer drops them;
    what the update itself saves
    (:meth:`~hongtu.nn.GNNLayer.update_saved_bytes`); and its output as the
    engine emits it, with what the activation and the next layer's dropout
    save for backward (an output-wide row more, but for ReLU without dropout;
    a CPU's dropout keeps its boolean mask too) and ``z^{l+1}`` where the next
    layer transforms first. Own rows dropped out are counted whether or not
    the update saves them (GIN does not)."""
    with ops.planning_for(device):
        fused = itemsize == 4 and ops.fused_dropout()
    widths, true = model.row_widths(), model.widths()
    dst = sizes.num_dst.astype(np.int64)
    last = model.num_layers - 1
    drops = model.p > 0
    total = 0
    for l, layer in enumerate(model.layers):
        if not layers[l]:
            continue
        w_in, out = widths[l], true[l + 1]
        own = drops and layer.needs_dst and not model.keeps_dropped(l)
        elements = w_in * (1 + layer.needs_dst + own)  # a, own rows' copy, dropped
        masks = w_in if own and l > 0 and not fused else 0  # (bytes; saved where ∇x_dst is)
        if l == last:
            elements += out
        elif drops and model.reads_as_kept(l + 1):  # σ's saved rows and drop(σ(out))
            elements += 2 * out
            masks += 0 if fused else out
        else:  # σ(out): ReLU saves it, ELU its input as well
            elements += out * (1 + (model.activation != "relu"))
        if l < last and model.transforms_first(l + 1):  # z^{l+1}, from the rows above
            elements += widths[l + 1]
        total += int(dst.sum()) * (elements * itemsize + masks)
        total += sum(layer.update_saved_bytes(int(d), itemsize) for d in dst)
    return total


def kept_graph_need(model: GNN, checkpoint: str, rows: int, itemsize: int = 4,
                    device: str | None = None) -> int:
    """Bytes of the update graphs a resident run on one device keeps for ``rows``
    vertices where they fit (:func:`kept_graph_bytes` of the layers
    :func:`kept_graph_layers` names under ``engine.checkpoint``), at most
    what any chunk count of :data:`CHUNK_CANDIDATES` holds (a layer may save
    a few bytes per chunk: GIN's 1 + eps): what :func:`choose_resident` leaves
    room for."""
    layers = kept_graph_layers(model, model.cached_layers(checkpoint),
                               model.stored_aggregates(checkpoint))
    if not any(layers):
        return 0
    most = max(CHUNK_CANDIDATES)
    dst = np.zeros(most, dtype=np.int64)
    dst[0] = rows
    sizes = ChunkSizes(np.zeros(most, dtype=np.int64), dst, np.zeros(most, dtype=np.int64))
    return kept_graph_bytes(model, sizes, itemsize, layers, device)


def kept_graphs(model: GNN, sizes: ChunkSizes, itemsize: int, cached: list[bool],
                stored: list[bool], room: int | None, estimate: int,
                device: str | None = None) -> tuple[list[bool], int]:
    """The layers whose update graphs a resident run on one device keeps from
    forward to backward, and their bytes (:func:`kept_graph_bytes`): all those
    :func:`kept_graph_layers` names where they fit ``room`` (the budget the
    buffers leave; ``None``: no budget) beside ``estimate`` (the batches'),
    else none."""
    layers = kept_graph_layers(model, cached, stored)
    need = kept_graph_bytes(model, sizes, itemsize, layers, device) if any(layers) else 0
    if need == 0 or (room is not None and estimate + need > room):
        return [False] * len(layers), 0
    return layers, need


def check_device_budget(budget: int, free: int, total: int, device: str) -> None:
    """Stop with one line when ``engine.device_memory`` asks for more than the GPU
    ``device`` has free (``free`` of ``total`` bytes)."""
    if budget > free:
        raise UserError(f"engine.device_memory={format_size(budget)} is more than {device} has "
                        f"free ({format_size(free)} of {format_size(total)}); set it to at most "
                        f"{format_size(free)}, or to auto ({AUTO_BUDGET_FRACTION:.0%} of the "
                        "free memory)")


def resident_block_bytes(sizes: ChunkSizes, itemsize: int = 4, parts: int = 1) -> int:
    """Device bytes of the chunk blocks one process keeps resident, with their
    cached edge data: every chunk's, or with ``parts`` processes (one part
    each; the chunks part by part) the largest part's."""
    e, src, dst = sizes.num_edges, sizes.num_src, sizes.num_dst
    each = e * (3 * 8 + itemsize + 8) + (src + dst) * (8 + itemsize) + src * 8
    return int(each.reshape(parts, -1).sum(axis=1).max())


def spare_rows(room: int | None, need: int, row_width: int, itemsize: int = 4) -> int:
    """Rows the budget left after a plan's ``need`` keeps resident across batches:
    each costs a slot of the row buffer and of its gradient twin (``row_width``
    elements each). No budget: none.

    Kept rows come before the chunk blocks, which stay on the device only in
    what the plan with its kept rows leaves (:func:`leftover_bytes`). A kept
    row saves a load of its row in each pass that reads it again; a block kept
    saves a copy of its index arrays, a few bytes per edge per pass. R-MAT
    2^22 GCN 3×256 at 40 chunks on an H200: blocks first kept 213,049 rows
    and moved 23.2 GiB host→device per epoch in 0.595 s, rows first 1.89M
    rows, 13.98 GiB, 0.402 s. Where the blocks fit beside every row worth
    keeping, they stay as before.
    """
    spare, _ = leftover_bytes(room, need, 0)
    if spare is None:
        return 0
    return max(0, int(spare) // (2 * int(row_width) * int(itemsize)))


def leftover_bytes(room: int | None, need: int, blocks: int) -> tuple[int | None, bool]:
    """What the budget ``room`` leaves after ``need``, and after the chunk blocks
    when all of them fit next to it: ``(bytes, blocks fit)``; ``(None, True)``
    without a budget."""
    if room is None:
        return None, True
    blocks_fit = need + blocks <= room
    return room - need - (blocks if blocks_fit else 0), blocks_fit


class Chunkings:
    """The chunkings of one assignment tried for the chunk count, with their sizes.

    The renumbering is shared by every count (:class:`~hongtu.partition.Chunker`),
    and so are the in-edge segments of the vertices in its order: a count is
    then one bitmap pass over the edges
    (:func:`~hongtu.graph._kernels.unique_union`), and so are several
    (:meth:`count`). :meth:`bound` gives,
    without looking at the edges, sizes no chunking's are below (every
    chunk's destinations and edges, no sources), so a count whose bound
    already misses the budget is never cut for real.
    """

    def __init__(self, graph: Graph, assignment: np.ndarray, num_parts: int) -> None:
        self.graph = graph
        self.chunker = Chunker(graph, assignment, num_parts)
        indptr = np.asarray(graph.indptr, dtype=np.int64)
        self._cum = (indptr if indptr[0] == 0 else indptr - indptr[0]) \
            if self.chunker.ordered else _in_edge_prefix(graph, self.chunker.perm)
        self._cut: dict[int, tuple[Partition, ChunkSizes]] = {}
        self._segments: tuple[np.ndarray, np.ndarray] | None = None
        self._runs: tuple[RunBitmaps, set[int]] | None = None  # (the last count's)

    def get(self, n: int) -> tuple[Partition, ChunkSizes]:
        """``n`` chunks per part and their sizes."""
        if n not in self._cut:
            p = self.chunker.cut(n)
            num_src = unique_union(self.graph.indices, p.chunk_ptr, *self._segments_of(p),
                                   self.graph.num_nodes, seg_ptr=self._cum)
            self._cut[n] = p, _sizes(self._cum, p.chunk_ptr, num_src)
        return self._cut[n]

    def count(self, ns) -> None:
        """Cut and size the counts ``ns``, the first not sized yet, with one pass
        over the edges (:class:`~hongtu.graph._kernels.RunBitmaps`), where
        their bitmaps fit; :meth:`get` then has them (and cuts any left one by
        one). Nothing is done when the first is sized already. The bitmaps of
        the pass are kept for :meth:`sets`."""
        new = [n for n in dict.fromkeys(ns) if n not in self._cut]
        if len(new) < 2 or new[0] != ns[0]:
            return
        parts = [self.chunker.cut(n) for n in new]
        runs = RunBitmaps.mark(self.graph.indices, [p.chunk_ptr for p in parts],
                               *self._segments_of(parts[0]), self.graph.num_nodes,
                               seg_ptr=self._cum)
        if runs is None:
            return
        for n, p in zip(new, parts):
            self._cut[n] = p, _sizes(self._cum, p.chunk_ptr, runs.counts(p.chunk_ptr))
        self._runs = runs, set(new)

    def sets(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The neighbour sets of ``n`` chunks per part, as
        :func:`~hongtu.dedup.neighbour_sets` gives them on the renumbered
        graph, when the last :meth:`count` sized ``n`` and the renumbering
        keeps the ids (its bitmaps then hold them: no pass over the edges);
        else ``None``."""
        if self._runs is None or n not in self._runs[1] or not self.chunker.ordered:
            return None
        return self._runs[0].sets(self._cut[n][0].chunk_ptr)

    def _segments_of(self, p: Partition) -> tuple[np.ndarray, np.ndarray]:
        """The in-edge segments of the vertices in the chunker's order."""
        if self._segments is None:
            indptr = np.asarray(self.graph.indptr, dtype=np.int64)
            self._segments = (indptr[:-1], indptr[1:]) if self.chunker.ordered \
                else (indptr[p.perm], indptr[p.perm + 1])
        return self._segments

    def bound(self, n: int) -> ChunkSizes:
        """Lower bounds of the sizes of ``n`` chunks per part (sources counted as 0)."""
        if n in self._cut:
            return self._cut[n][1]
        chunk_ptr = self.chunker.cut(n).chunk_ptr
        return _sizes(self._cum, chunk_ptr, np.zeros(chunk_ptr.shape[0] - 1, dtype=np.int64))


def choose_chunks(graph: Graph, assignment: np.ndarray, num_parts: int, model: GNN,
                  budget: int | None, itemsize: int = 4,
                  candidates: tuple[int, ...] = CHUNK_CANDIDATES,
                  chunkings: Chunkings | None = None, **estimate) -> tuple[int, int]:
    """The fewest chunks per part whose estimated peak fits ``budget``.

    ``chunkings`` keeps the chunkings tried for the caller (one is made when
    ``None``); ``estimate`` holds further arguments of
    :func:`estimate_device_bytes` (``overlap``, ``resident``, ``device``). The estimate
    must not fall as a chunk's sources grow (true of every built-in layer).

    Returns:
        ``(chunks, estimated_bytes)``.

    Raises:
        UserError: no chunk count fits; the message gives the smallest need.
    """
    chunkings = chunkings or Chunkings(graph, assignment, num_parts)
    smallest = int(chunkings.chunker.part_sizes.min())
    cands = [n for n in candidates if n <= smallest] or [1]
    seen: dict[int, int] = {}

    def estimate_of(sizes: ChunkSizes) -> int:
        return estimate_device_bytes(model, sizes, itemsize, num_nodes=graph.num_nodes,
                                     **estimate)

    def need(i: int) -> int:
        n = cands[i]
        if n not in seen:
            chunkings.count(cands[i:i + _AHEAD])  # (one pass over the edges for these)
            seen[n] = estimate_of(chunkings.get(n)[1])
        return seen[n]

    if budget is None:
        return cands[0], estimate_of(chunkings.get(cands[0])[1])
    # Counts whose bound (no pass over the edges) misses the budget cannot fit:
    # walk up from the first that might (the bound is most often one or two
    # short) to the first that fits; a pass over the edges sizes the next
    # _AHEAD counts at once.
    start = next((i for i in range(len(cands))
                  if estimate_of(chunkings.bound(cands[i])) <= budget), len(cands))
    for i in range(start, len(cands)):
        if need(i) <= budget:
            return cands[i], need(i)
    # Nothing fits: report the most chunks' real need (the smallest estimate).
    n, least = cands[-1], need(len(cands) - 1)
    raise UserError(
        f"engine.device_memory={format_size(budget)} is too small: even {n} chunks per part "
        f"need {format_size(least)} on the device; raise engine.device_memory to at least "
        f"{format_size(least * 1.1)}, or lower model.hidden")


#: ``engine.chunks: auto`` out of core, keeping rows (``engine.dedup.cache``):
#: where the fewest chunks that fit load rows again within a pass (rows the
#: budget left no room to keep through their gaps) by more than
#: :data:`RELOADS_FOR_MORE_CHUNKS` of the distinct rows they load, the next
#: count of :data:`CHUNK_CANDIDATES` is planned too (:func:`more_chunks`), and
#: taken where its plan fits and loads at least :data:`FEWER_LOADS_FOR_MORE_CHUNKS`
#: fewer rows (:func:`takes_more_chunks`): smaller chunks leave more of the
#: budget for kept rows. On an H200, GCN 3×256 at a quarter of PyG's memory:
#: products-like 24 chunks load 1.32× their distinct rows per pass and 32
#: chunks 1.02× (0.268 against 0.255 s per epoch), R-MAT 2^22 1.20× against
#: 1.00× (0.412 against 0.391 s); GIN and SAGE 2×256 on products-like 1.11× and
#: 1.18× at 24 chunks, 1.5% and 6% faster at 32 (``bench/HISTORY.md``). Where
#: the fewest load each row about once (GCN 2×256: products-like 1.02× at 16
#: chunks, R-MAT 2^22 1.00×, R-MAT 2^24 1.03×, reddit-like 1.00×) more chunks
#: were not faster (0.072 s at 16 against 0.073-0.076 s at 20-32 on
#: products-like), and no second plan is made: the setup stays one plan there.
RELOADS_FOR_MORE_CHUNKS = 0.05
FEWER_LOADS_FOR_MORE_CHUNKS = 0.10


def plan_loads(plans) -> tuple[int, int]:
    """Rows the device plans ``plans`` (of a transfer plan) load per layer pass
    from host memory (the plan's ``h2d_rows``), and how many of them are
    distinct (per device, summed): ``(loaded, distinct)``. (Bitmaps marked in
    parallel, :func:`~hongtu.graph._kernels.unique_union`: 0.03 s for 17M
    random loads of 2^24 rows on 2 cores, against 0.09 s for a flag per row
    and 11 s for ``np.unique``.)"""
    loaded = rows = 0
    for p in plans:
        ids = np.asarray(p.load_ids)
        loaded += int(ids.shape[0])
        if ids.size:
            rows += int(unique_union(ids, np.array([0, 1]), np.array([0]),
                                     np.array([ids.shape[0]]), int(ids.max()) + 1)[0])
    return loaded, rows


def more_chunks(chunks: int, loaded: int, distinct: int, smallest: int,
                candidates: tuple[int, ...] = CHUNK_CANDIDATES) -> int | None:
    """The chunk count ``engine.chunks: auto`` plans besides ``chunks`` (the fewest
    that fit), whose plan loads ``loaded`` rows per pass, ``distinct`` of them
    distinct: the next of ``candidates`` up to ``smallest`` (the smallest
    part's vertices) where the plan loads rows again by more than
    :data:`RELOADS_FOR_MORE_CHUNKS` of the distinct ones; ``None`` otherwise."""
    if distinct <= 0 or loaded <= distinct * (1 + RELOADS_FOR_MORE_CHUNKS):
        return None
    return next((c for c in candidates if chunks < c <= smallest), None)


def takes_more_chunks(loaded: int, loaded_more: int) -> bool:
    """Does ``auto`` take the count of :func:`more_chunks`, whose plan loads
    ``loaded_more`` rows per pass against ``loaded``?"""
    return loaded_more <= loaded * (1 - FEWER_LOADS_FOR_MORE_CHUNKS)


def more_chunks_text(fewest: int, reloads: float, more: int, more_reloads: float,
                     chosen: int) -> str:
    """What ``engine.chunks: auto`` said of the count of :func:`more_chunks`: the
    fewest that fit loaded ``reloads`` times their distinct rows per pass, the
    other count ``more_reloads`` times the same rows."""
    return (f"engine.chunks=auto: {fewest} chunks per part, the fewest that fit, load "
            f"{reloads:.2f}x their distinct rows per pass; {more} load {more_reloads:.2f}x: "
            f"{chosen} taken")


#: Resident, a graph of this many vertices or more per chunk added keeps the
#: updates' graphs at a larger chunk count (:func:`choose_resident`). Measured on
#: an H200 with the allocator held to the budget: a resident chunk more cost
#: 2-3.5 ms an epoch (R-MAT 2^22 GIN 2×256 at 4 and 8 chunks 0.160 and 0.172 s,
#: SAGE at 2 and 8 0.117 and 0.138 s, products-like GIN at 6 and 12 0.115 and
#: 0.128 s), and keeping the graphs saved about 8 (GIN) and 3 (SAGE) ns per
#: vertex before it. Against the fewest chunks without graphs, on R-MAT 2^22
#: (4.2M vertices: 6 chunks more allowed): GIN at 71 GiB 4 chunks 0.160 s
#: against 2 0.186 s, at 65 GiB 6 0.166 against 0.186 s, at 60 GiB 12 (not
#: taken) 0.183 against 0.186 s; SAGE at 71 GiB 2 0.117 against 1 0.127 s, at
#: 50 GiB 8 0.137 against 2 0.141 s; products-like GIN (2.45M: 4 more) at 40
#: GiB 6 0.115 against 2 0.124 s (these counts with the resident estimate of
#: the time, which still counted a transition buffer: ``bench/HISTORY.md``).
#: Graphs of a few thousand vertices stay at their fewest chunks.
ROWS_PER_EXTRA_CHUNK = 600_000


def choose_resident(resident, budget: int | None, buffers_bytes: int, chunks, graph: Graph,
                    assignment: np.ndarray, num_parts: int, model: GNN, itemsize: int = 4,
                    chunkings: Chunkings | None = None, graphs_bytes: int = 0, **estimate
                    ) -> tuple[bool, int | None, int | None]:
    """Does every buffer live on the device (HongTu-IM), as ``engine.resident`` decides?

    Yes when the buffers (``buffers_bytes``: :meth:`BufferPlan.resident_bytes`) and
    the batches of ``chunks`` (a count, or ``"auto"``: the fewest that fit what
    the buffers leave) both fit ``budget`` (``resident``: ``"auto"``), or when
    asked (``True``). Only on a GPU: the caller passes ``resident=False``
    elsewhere. ``estimate``: further arguments of :func:`estimate_device_bytes`.

    ``graphs_bytes``: the update graphs a resident run keeps where they fit
    (:func:`kept_graph_need`). ``"auto"`` then takes the fewest chunks whose
    batches leave room for them too, instead of the fewest whose batches fit
    alone, where that adds at most one chunk per
    :data:`ROWS_PER_EXTRA_CHUNK` vertices: smaller batches for graphs kept.

    Returns:
        ``(resident, budget left for the batches, chunks or None)``; out of core
        ``(False, budget, None)``.

    Raises:
        UserError: ``resident`` is ``True`` and they do not fit.
    """
    room = None if budget is None else budget - buffers_bytes
    if resident is not False and room is not None and room > 0:
        try:
            if chunks == "auto":
                n, _ = choose_chunks(graph, assignment, num_parts, model, room, itemsize,
                                     chunkings=chunkings, resident=True, **estimate)
                if 0 < graphs_bytes < room:  # (fewer rows a batch: room for the graphs)
                    try:
                        k, _ = choose_chunks(graph, assignment, num_parts, model,
                                             room - graphs_bytes, itemsize,
                                             chunkings=chunkings, resident=True, **estimate)
                        n = k if k - n <= graph.num_nodes // ROWS_PER_EXTRA_CHUNK else n
                    except UserError:
                        pass
                return True, room, n
            _, sizes = (chunkings or Chunkings(graph, assignment, num_parts)).get(chunks)
            if estimate_device_bytes(model, sizes, itemsize, num_nodes=graph.num_nodes,
                                     resident=True, **estimate) <= room:
                return True, room, chunks
        except UserError:
            pass
    if resident is True:
        raise UserError(f"engine.resident=true but the buffers alone need "
                        f"{format_size(buffers_bytes)} of the "
                        f"{'unset' if budget is None else format_size(budget)} device budget, "
                        "with too little left for a batch; set engine.resident=auto (trains "
                        "out of core) or raise engine.device_memory")
    return False, budget, None
