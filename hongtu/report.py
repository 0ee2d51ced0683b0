r"""``hongtu report``: what training a config would move, and what it would need, on paper.

No GPU, no host buffers: the partitioner (cached), the dedup planner, the
reorganizer and the memory planner's estimate give (1) the replication factor
:math:`\alpha = \sum_P |N(P)| / |V|` for 2, 4, ..., 512 parts (HongTu Table 3);
(2) for ``m`` parts x ``n`` chunks, :math:`V_{ori}`, :math:`V_{ori} - V_{+p2p}`,
:math:`V_{+p2p} - V_{+ru}` over :math:`|V|` (Table 8) for each batch order the
reorganizer tries; (3) the bytes of every layer and of a training step, and
the cost :math:`C` (Eq. 4) at ``engine.throughput``; (4) the estimated device
memory of ``n`` and nearby chunk counts against ``engine.device_memory``.

Example::

    >>> rep = build_report(load_config("configs/gcn_example.yaml"))
    >>> print(format_report(rep.data))
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hongtu.calibrate import resolve_throughput
from hongtu.config import Config, format_size, parse_size
from hongtu.dedup import TransferPlan, neighbour_sets, plan_transfers
from hongtu.dedup.sets import identity_order
from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.partition import MetisError, Partition, assign_parts, chunk_partition
from hongtu.partition._kernels import count_cut_edges, distinct_sources
from hongtu.reorg import cost, reorganize_report

if TYPE_CHECKING:
    from hongtu.engine.budget import ChunkSizes

__all__ = ["ALPHA_SECONDS", "FASTEST_MARGIN", "PARTS_LIST", "Report", "build_report", "dump_plan",
           "fastest_count", "format_report", "parse_counts", "plot_report"]

#: Part counts of the replication table (HongTu Table 3).
PARTS_LIST = (2, 4, 8, 16, 32, 64, 128, 256, 512)

#: the α table starts no further part count once it has taken this long (s)
ALPHA_SECONDS = 120.0
_CPU_CHUNKS = 8
#: chunk counts whose lower bounds are this close count as equally fast
FASTEST_MARGIN = 0.02
_ORDER_LABELS = {"identity": "identity (no reorg)", "order": "order (phase 2)",
                 "group+order": "group+order (phases 1+2)"}


@dataclass
class Report:
    """The report: ``data`` (JSON-serialisable) and the plan it describes."""

    data: dict
    partition: Partition
    plan: TransferPlan


def parse_counts(text: str | None, what: str) -> list[int] | None:
    """``"2,4,8"`` -> ``[2, 4, 8]`` (``None`` stays ``None``)."""
    if text is None:
        return None
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise UserError(f"{what} '{text}': give positive whole numbers separated by commas, "
                        "e.g. 2,4,8")
    return counts


# ----------------------------------------------------------------- analysis
def _replication(graph: Graph, method: str, seed: int, cache_dir: str,
                 counts: list[int], seconds: float | None = None
                 ) -> tuple[list[dict], list[int], dict | None, dict | None]:
    """α and cut fraction of ``method`` for each part count (level 1 only, cached);
    the counts skipped; where METIS failed (``{"parts", "message"}``), the table
    stops there (more parts take more of its memory), else ``None``; where the
    counts so far took ``seconds`` or more (``{"parts", "seconds"}``), the next
    count is not started (each cached count makes the next report's table
    reach further), else ``None``."""
    rows, skipped = [], []
    start = time.perf_counter()
    for m in counts:
        if m > graph.num_nodes // 2:
            skipped.append(m)
            continue
        spent = time.perf_counter() - start
        if rows and seconds and spent >= seconds:
            return rows, skipped, None, {"parts": m, "seconds": spent}
        t0 = time.perf_counter()
        try:
            assignment, hit = assign_parts(graph, m, method=method, seed=seed,
                                           cache_dir=cache_dir, return_hit=True)
        except MetisError as err:
            return rows, skipped, {"parts": m, "message": str(err)}, None
        perm = np.argsort(assignment, kind="stable")
        part_ptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(np.bincount(assignment, minlength=m), out=part_ptr[1:])
        nbrs = distinct_sources(graph.indptr, graph.indices, perm, part_ptr)
        cut = count_cut_edges(graph.indptr, graph.indices, assignment)
        rows.append({"parts": m, "alpha": float(nbrs.sum()) / max(graph.num_nodes, 1),
                     "cut_fraction": cut / max(graph.num_edges, 1), "cached": bool(hit),
                     "seconds": time.perf_counter() - t0})
    return rows, skipped, None, None


def _traffic(widths, cached, stored, needs_dst, itemsize: int, num_nodes: int, h2d_rows: int,
             d2h_rows: int, hand, ordered: list[bool] | None = None, loaded: int = 0,
             index: tuple[int, int] = (0, 0), held: int = 0,
             early: list[bool] | None = None, first: tuple[int, int] = (0, 0),
             own: list[bool] | None = None, own_forward: list[bool] | None = None,
             into_first: bool = False, blocks: list[tuple[int, int]] | None = None,
             narrow: bool = False, d2d_rows: int = 0, agg_once: bool = False,
             kept_agg: int = 0) -> dict:
    """Bytes of one training step (forward, loss, backward) as the executor moves them.

    ``cached[l]``: layer ``l``'s backward reads no rows, ``stored[l]``: its
    aggregate goes to host memory and back. ``hand``
    (:class:`~hongtu.engine.executor.Handoffs`): ``whole[l]``, its passes move all
    its rows (and gradients) at once instead of the plan's rows; gradients that
    stay on the device between passes move not at all, nor does ``h^1`` in
    training where it stays. ``ordered[m]``: training writes ``h^m`` in the
    order the plan first loads its rows, only the ``loaded`` rows it loads
    (:func:`~hongtu.engine.executor.ordered_row_layers`), the passes writing and
    loading them copying ``index`` bytes of index arrays to the device
    (:func:`~hongtu.engine.executor.first_load_traffic`). ``held``: rows of
    ``∇h^1`` that layer 1's backward leaves on the device for the first layer's
    (:func:`~hongtu.engine.executor.gradients_held`), not flushed. ``early[m]``:
    the pass before writes layer ``m``'s first-step rows on the device
    (:func:`~hongtu.engine.executor.early_layers`): of ``first`` (the first
    step's rows, those only it loads;
    :func:`~hongtu.engine.executor.first_step_rows`) the first are not loaded,
    the second not stored. ``own``: every chunk reads its own rows among its
    sources (``Executor(own_in_sources=True)``), ``own[l]``: layer ``l``'s
    backward steps take them from there
    (:func:`~hongtu.engine.executor.own_rows_in_sources`), and no own-row
    gradient goes to host memory (it is added at the rows' slots).
    ``own_forward[l]``: layer ``l``'s forward steps take them from the device
    (:func:`~hongtu.engine.executor.own_rows_forward`). ``into_first``: layer
    1's backward runs the first layer's on its gradient flushes
    (:func:`~hongtu.engine.executor.first_backward_in_flushes`): no flush of
    ``∇h^1`` goes to host memory and no first-layer pass reads it back with
    ``a^0``; the flushed rows' ``a^0`` is gathered instead. ``blocks[l]``: the
    bytes of the chunks' blocks layer ``l``'s forward and backward passes copy
    (:func:`_block_bytes`; none where they stay on the device). ``narrow``:
    training writes layer 1's rows in first-load order as the first layer's
    aggregates (:func:`~hongtu.engine.executor.first_aggregates_ordered`), as
    wide as ``h^0``; with ``agg_once`` stored once, in that order
    (:func:`~hongtu.engine.executor.aggregates_in_load_order`): no loaded row
    goes out a second time, and each chunk's positions (8 bytes a row)
    replace the loaded rows' index arrays of the first layer's pass.
    ``d2d_rows``: the rows all devices send one another per pass (the plan's):
    every forward pass (evaluation's too) and the backward reload of a layer
    that is not cached send them at its width, and every backward pass but
    the first layer's returns their gradients (``d2d_bytes``,
    ``evaluation_d2d_bytes``). ``kept_agg``: rows of layer 1's aggregates
    that stay on the device from its forward pass to its backward
    (:func:`~hongtu.engine.executor.keeps_last_aggregate`), neither stored nor
    loaded.
    """
    n = num_nodes
    ordered = list(ordered or []) + [False] * (len(widths) - len(ordered or []))
    early = list(early or []) + [False] * (len(widths) - len(early or []))
    whole, kept, rows_kept = hand.whole, hand.kept, hand.rows_at is not None
    blocks = blocks or [(0, 0)] * (len(widths) - 1)
    layers = []
    for l in range(len(widths) - 1):
        row, out = widths[l] * itemsize, widths[l + 1] * itemsize
        dst = n * row if needs_dst[l] else 0
        # own rows h^l[V] read in forward and backward (none where taken from the device)
        dst_fwd = 0 if own_forward and own_forward[l] else dst
        dst_bwd = 0 if own and own[l] else dst
        all_rows = whole[l]
        loads = n * row if all_rows else h2d_rows * row
        # (h^m left on the device in training, not in evaluation)
        m = hand.rows_layer
        # h^{l+1} (∇h^L) stored; in training the first layer's aggregates for layer 1
        once = l == 0 and agg_once
        made = 0 if (rows_kept and l == m - 1) or once else (
            loaded - first[1] * early[l + 1] if ordered[l + 1] else n) * (
            row if l == 0 and narrow else out)
        # (layer 1's loads in training: as wide as h^0 where they are aggregates)
        frow = widths[0] * itemsize if l == 1 and narrow else row
        fwd_loads = h2d_rows * frow if l == 1 and narrow else loads
        layers.append({
            "layer": l, "width": widths[l], "row_bytes": row, "cached": cached[l],
            "whole": all_rows,
            # forward, backward reload, gradient flush (none for ∇h^0, a kept ∇h^l
            # or ∇h^1 into the first layer's backward)
            "passes": 1 + (not cached[l]) + (l > 0 and not kept[l]
                                             and not (l == 1 and into_first)),
            "forward_bytes": 0 if rows_kept and l == m else fwd_loads - first[0] * frow * early[l],
            "backward_reload_bytes": 0 if cached[l] else loads,
            "flush_bytes": 0 if l == 0 or kept[l] or (l == 1 and into_first) else (
                n if all_rows else d2h_rows - (held if l == 1 else 0)) * row,
            "aggregate_d2h_bytes": (n - kept_agg * (l == 1)) * row if stored[l] else 0,
            # (the first layer's: of the rows layer 1 flushes, into_first)
            "aggregate_h2d_bytes": ((d2h_rows if l == 0 and into_first else n - kept_agg * (l == 1))
                                    * row if stored[l] else 0),
            # own rows h^l[V] (forward and backward), ∇h^{l+1}[V] in backward
            "range_h2d_bytes": dst_fwd + dst_bwd + (
                0 if kept[l + 1] or (l == 0 and into_first) else n * out),
            # where rows written in first-load order go and come from
            "index_h2d_bytes": (8 * n if once else index[0]) * ordered[l + 1]
            + index[1] * ordered[l],
            # the chunks' blocks (graph structure), forward and backward
            "block_h2d_bytes": blocks[l][0] + blocks[l][1],
            # h^{l+1}[V] (∇h^L for the last layer), ∇h^l[V] of the own rows
            # (added on the device when the layer's gradients stay there whole,
            # or at the rows' slots with ``own``)
            "range_d2h_bytes": (0 if l == len(widths) - 2 and kept[-1] else made)
            + (dst if l > 0 and not all_rows and not own else 0),
            "evaluation_bytes": loads + dst_fwd + n * out + blocks[l][0],
            # rows between devices: forward, backward reload, gradients returned
            "d2d_bytes": d2d_rows * row * (1 + (not cached[l]) + (l > 0)),
            "evaluation_d2d_bytes": d2d_rows * row,
        })
    t = {k: sum(x[k] for x in layers) for k in layers[0] if k.endswith("_bytes")}
    t.pop("row_bytes")
    t["neighbour_bytes"] = t["forward_bytes"] + t["backward_reload_bytes"] + t["flush_bytes"]
    t["h2d_bytes"] = (t["forward_bytes"] + t["backward_reload_bytes"] + t["aggregate_h2d_bytes"]
                      + t["range_h2d_bytes"] + t["index_h2d_bytes"] + t["block_h2d_bytes"])
    t["d2h_bytes"] = t["flush_bytes"] + t["aggregate_d2h_bytes"] + t["range_d2h_bytes"]
    t["contiguous_bytes"] = t["h2d_bytes"] + t["d2h_bytes"] - t["neighbour_bytes"]
    # ∇h^l with a host buffer: none stays on the device, nor ∇h^1 into the first
    # layer's backward (as the trainer's BufferPlan)
    grads = [not k and not (l == 1 and into_first) for l, k in enumerate(kept)]
    return {"layers": layers, "epoch": t, "host_grads": grads}


def _volumes(vol, c: float) -> dict:
    nv = vol.normalised()
    return {"v_ori": vol.v_ori, "v_p2p": vol.v_p2p, "v_ru": vol.v_ru,
            "v_ori_norm": nv["v_ori"], "p2p_saved_norm": nv["p2p_saved"],
            "ru_saved_norm": nv["ru_saved"], "v_ru_norm": nv["v_ru"],
            "reduction_pct": 100.0 * (1 - vol.v_ru / vol.v_ori) if vol.v_ori else 0.0,
            "cost_s": c}


@dataclass
class _Setting:
    """Everything the report needs about one chunk count."""

    partition: Partition
    plan: TransferPlan
    order_name: str
    candidates: dict
    device_bytes: int
    #: elements of the device row memory (:func:`~hongtu.engine.budget.grown_row_memory`)
    row_elements: int
    #: training writes rows in first-load order (:func:`~hongtu.engine.executor.ordered_rows_room`)
    ordered: bool = False
    #: the chunks' sizes, and whether their blocks stay on the device (else each
    #: pass copies them: :func:`_block_bytes`)
    sizes: ChunkSizes | None = None
    blocks_fit: bool = True
    #: the estimate before the plan (a chunk's whole neighbour set in the
    #: transition buffer), which training checks a chunk count against first
    need_unplanned: int = 0


def _block_bytes(model, s: _Setting, cached: list[bool], num_nodes: int, itemsize: int,
                 into_first: bool) -> list[tuple[int, int]] | None:
    """Per layer, the bytes of the chunks' blocks its forward and its backward pass
    copy to the device (as the executor fetches them: a forward pass without the
    transpose unless the layer reads it, a cached layer's backward without the
    forward edges, none for a cached first layer or one run on layer 1's
    flushes); ``None`` where the blocks stay on the device."""
    from hongtu.engine.transfer import block_copy_bytes
    from hongtu.nn.block import Block

    if s.blocks_fit:
        return None
    sz = s.sizes

    @functools.cache  # (per skip: most layers' passes copy the same arrays)
    def total(skip) -> int:
        return sum(block_copy_bytes(int(a), int(b), int(c), skip, num_nodes, itemsize)
                   for a, b, c in zip(sz.num_src, sz.num_dst, sz.num_edges))

    out = []
    for l, layer in enumerate(model.layers):
        fwd = total(() if layer.reads_transpose else Block.TRANSPOSE)
        none = l == 0 and (into_first or cached[0])
        out.append((fwd, 0 if none else total(Block.NOT_TRANSPOSED if cached[l] else ())))
    return out


def _plan_chunks(graph: Graph, assignment: np.ndarray, m: int, n: int, ctx: dict,
                 compare: bool = True) -> _Setting:
    """Partition, order and plan ``m x n`` chunks as training would (``compare``: every
    reorganizer candidate's volumes too, else only what ``engine.reorg`` needs)."""
    from hongtu.engine.budget import (
        chunk_sizes,
        estimate_device_bytes,
        grown_row_memory,
        leftover_bytes,
        resident_block_bytes,
        row_memory,
        slot_widths,
        spare_rows,
    )
    from hongtu.engine.executor import first_layer_rows, ordered_rows_room, reads_rows_once

    e = ctx["engine"]
    part = chunk_partition(graph, assignment, n, num_parts=m, method=e.partitioner,
                           seed=ctx["seed"])
    g = part.apply(graph)
    nb = neighbour_sets(g.indptr, g.indices, part.chunk_ptr)
    tp, rb = ctx["throughput"], ctx["row_bytes"]
    order, name, candidates = identity_order(m, n), "identity", {}
    if compare or e.reorg:
        rep = reorganize_report(g.indptr, g.indices, part.chunk_ptr, m, n, neighbours=nb,
                                row_bytes=rb, t_hd=tp["host_to_device"],
                                t_dd=tp["device_to_device"], t_ru=tp["reuse"])
        candidates = {k: _volumes(v, rep.costs[k]) for k, v in rep.volumes.items()}
        if e.reorg:
            order, name = rep.order, rep.chosen
    sizes = chunk_sizes(graph, part.perm, part.chunk_ptr)

    def need_of(devs) -> int:  # DevicePlans, or their needs before slots
        return estimate_device_bytes(
            ctx["model"], sizes, ctx["itemsize"], num_nodes=graph.num_nodes,
            buffer_rows=max(p.buffer_rows for p in devs), overlap=e.overlap,
            load_rows=max(p.max_later_load for p in devs), copied_dst=ctx["copied_dst"],
            device=ctx["device"], cached=ctx["cached"], exchange=ctx["devices"] > 1)

    once = reads_rows_once(ctx["model"], ctx["checkpoint"])

    def cache_rows(needs) -> int:
        # As training does: the budget the plan leaves keeps reused rows resident.
        extra = spare_rows(ctx["budget"], need_of(needs), max(ctx["model"].row_widths()),
                           ctx["itemsize"])
        return extra if e.dedup.cache else 0

    plan = plan_transfers(g.indptr, g.indices, part.chunk_ptr, m, n, order=order,
                          reuse=e.dedup.reuse, p2p=e.dedup.p2p, devices=ctx["devices"],
                          row_bytes=rb, neighbours=nb, cache_rows=cache_rows)
    # As training does: what the budget still leaves may let a layer move whole.
    need, first, widths = need_of(plan.plans), plan.plans[0], ctx["model"].row_widths()
    most = int(sizes.num_dst.max())
    # (as training decides: rows written in first-load order where their index arrays fit)
    blocks = resident_block_bytes(sizes, ctx["itemsize"], m if ctx["devices"] > 1 else 1)
    spare = leftover_bytes(ctx["budget"], need, blocks)[0]
    index_bytes = ordered_rows_room(first, once, e.ordered_rows and ctx["overlapped"], spare,
                                    most, most * slot_widths(ctx["model"])["grad"]
                                    * ctx["itemsize"])
    need += index_bytes or 0
    plan_rows = row_memory(first.buffer_rows, widths, first.max_later_load if e.overlap else 0)
    left, blocks_fit = leftover_bytes(ctx["budget"], need, blocks)
    left = left if e.whole_layers else None
    first_rows, first_stores = first_layer_rows(
        first, widths, ctx["model"].cached_layers(ctx["checkpoint"]), ctx["overlapped"])
    rows = grown_row_memory(plan_rows, left, graph.num_nodes, widths,
                            int(first.load_ids.shape[0]), ctx["devices"] > 1, ctx["itemsize"],
                            keep_rows=len(once) > 1 and once[1], first_rows=first_rows,
                            first_stores=first_stores)
    unplanned = estimate_device_bytes(ctx["model"], sizes, ctx["itemsize"],
                                      num_nodes=graph.num_nodes, overlap=e.overlap,
                                      copied_dst=ctx["copied_dst"], device=ctx["device"],
                                      cached=ctx["cached"], exchange=ctx["devices"] > 1)
    return _Setting(part, plan, name, candidates, need + (rows - plan_rows) * ctx["itemsize"],
                    rows, index_bytes is not None, sizes, blocks_fit, unplanned)


def _alternatives(n: int, smallest: int, chosen_list: list[int] | None) -> list[int]:
    """Chunk counts to compare: ``n``, the two :data:`CHUNK_CANDIDATES` above it
    (where more chunks leave more of the budget for kept rows) and those nearest
    n/4, n/2, 2n, 4n."""
    from hongtu.engine.budget import CHUNK_CANDIDATES

    if chosen_list is not None:
        return sorted({c for c in [*chosen_list, n] if c <= smallest})
    out = {n, *[c for c in CHUNK_CANDIDATES if n < c <= smallest][:2]}
    for f in (0.25, 0.5, 2.0, 4.0):
        target = n * f
        if target < 1 or target > smallest:
            continue
        best = min(CHUNK_CANDIDATES, key=lambda c: (abs(math.log(c / target)), c))
        if best <= smallest:
            out.add(best)
    return sorted(out)


def fastest_count(rows: list[dict], margin: float = FASTEST_MARGIN) -> int | None:
    """The chunk count predicted fastest among ``rows`` (the report's memory rows):
    the fewest that fit whose transfer lower bound is within ``margin`` of the
    lowest of those that fit (more chunks cost more steps, which the bound does
    not count); ``None`` where none fits or there is no budget."""
    fit = [r for r in rows if r["fits"]]
    if not fit:
        return None
    low = min(r["lower_bound_s"] for r in fit)
    return min(r["chunks"] for r in fit if r["lower_bound_s"] <= low * (1 + margin))


def _costs(plan: TransferPlan, traffic: dict, tp: dict) -> dict:
    """C (Eq. 4) of each layer pass and of an epoch, on the volumes the plan executes
    (a layer's passes: forward, backward reload, gradient flush, as ``traffic`` has them)."""
    from hongtu.dedup import Volumes

    v_p2p = plan.v_p2p if plan.p2p or plan.num_parts == 1 else plan.v_ori
    eff = Volumes(plan.v_ori, v_p2p, min(plan.h2d_rows, v_p2p))  # = the paper's with dedup on
    # (a layer that moves all its rows does so in one contiguous copy)
    per_layer = [x["forward_bytes"] / tp["contiguous"] if x["whole"] else
                 cost(eff, tp["host_to_device"], tp["device_to_device"], tp["reuse"],
                      row_bytes=x["row_bytes"]) for x in traffic["layers"]]
    passes = [x["passes"] for x in traffic["layers"]]
    c_epoch = sum(c * p for c, p in zip(per_layer, passes))
    contiguous_s = traffic["epoch"]["contiguous_bytes"] / tp["contiguous"]
    return {"per_layer_pass_s": per_layer, "passes": passes, "epoch_s": c_epoch,
            "contiguous_s": contiguous_s, "lower_bound_s": c_epoch + contiguous_s}


def _budget_and_chunks(cfg: Config, graph: Graph, assignment: np.ndarray, m: int, model,
                       notes: list[str], copied_dst: list[bool] | None = None,
                       gpu: bool = False, chunkings=None,
                       itemsize: int = 4,
                       cached: list[bool] | None = None) -> tuple[int | None, int, str]:
    """``(budget, n, how n was chosen)``, as the trainer chooses (8 chunks without a
    budget; ``copied_dst``: :func:`~hongtu.engine.executor.own_rows_copied`;
    ``cached``: the layers keeping their aggregate, as resolved; ``gpu``:
    training runs on a GPU; ``chunkings``: the
    :class:`~hongtu.engine.budget.Chunkings` to try counts with)."""
    import torch

    from hongtu.engine.budget import AUTO_BUDGET_FRACTION, choose_chunks

    e = cfg.engine
    smallest = int(np.bincount(assignment, minlength=m).min())
    budget = None if e.device_memory == "auto" else parse_size(e.device_memory)
    if budget is None and e.accelerator != "cpu" and torch.cuda.is_available():
        budget = int(torch.cuda.mem_get_info()[0] * AUTO_BUDGET_FRACTION)
        notes.append(f"engine.device_memory=auto: {AUTO_BUDGET_FRACTION:.0%} of this GPU's "
                     f"free memory, {format_size(budget)}")
    if e.chunks != "auto":
        if e.chunks > smallest:
            raise UserError(f"engine.chunks={e.chunks} but the smallest part has only "
                            f"{smallest} vertices; use engine.chunks ≤ {smallest}")
        return budget, e.chunks, "configured"
    if budget is None:
        n = min(_CPU_CHUNKS, smallest)
        notes.append(f"engine.chunks=auto with engine.device_memory=auto has no budget on a "
                     f"machine without CUDA: the report uses {n} chunks per part; set "
                     "engine.device_memory to the target GPU's memory to choose as training will")
        return None, n, "auto without a budget"
    n, _ = choose_chunks(graph, assignment, m, model, budget, itemsize, chunkings=chunkings,
                         overlap=e.overlap, copied_dst=copied_dst,
                         device="cuda" if gpu else "cpu", cached=cached, exchange=e.devices > 1)
    return budget, n, f"auto: fewest that fit {format_size(budget)}"


def _resident(cfg: Config, graph: Graph, assignment: np.ndarray, m: int, model, budget,
              gpu: bool, notes: list[str], itemsize: int = 4,
              chunkings=None) -> dict | None:
    """Would training keep every buffer on the GPU (``engine.resident``)? As the
    trainer decides (``chunkings``: as for :func:`_budget_and_chunks`); ``None``
    where it cannot tell (no GPU run, no budget, or ``engine.resident: false``)."""
    from hongtu.engine.budget import choose_resident, kept_graph_need
    from hongtu.engine.buffers import BufferPlan

    e = cfg.engine
    if not gpu or budget is None or e.resident is False:
        return None
    # (each process holds its own part's rows; the largest part decides)
    one = e.devices == 1  # (one process: rows read in place, update graphs may be kept)
    rows = graph.num_nodes if one else int(np.bincount(assignment, minlength=m).max())
    need = BufferPlan(rows, model.row_widths(), model.stored_aggregates(e.checkpoint),
                      itemsize).resident_bytes()
    room_for = kept_graph_need(model, e.checkpoint, rows, itemsize, "cuda") \
        if one else 0  # (the update graphs)
    try:
        yes, _, chunks = choose_resident(e.resident, budget, need, e.chunks, graph, assignment,
                                         m, model, itemsize, chunkings=chunkings,
                                         graphs_bytes=room_for, overlap=e.overlap,
                                         device="cuda", direct=one, exchange=not one,
                                         cached=model.cached_layers(e.checkpoint))
    except UserError as err:
        notes.append(f"training stops before its first epoch: {err}")
        return {"resident": False, "buffers_bytes": need, "chunks": None,
                "kept_graph_layers": [], "kept_graph_bytes": 0}
    graphs, graph_bytes = [], 0
    if yes:
        notes.append(f"resident: every buffer ({format_size(need)}) and the batches of "
                     f"{chunks} chunk(s) fit the {format_size(budget)} budget, so training "
                     "keeps them on the GPU and moves no rows over the host link, nor the "
                     "chunk blocks where they fit beside the batches (the setup says when "
                     "they are copied batch by batch) "
                     f"(engine.resident={str(e.resident).lower()}); the plan below is what "
                     "engine.resident=false would move")
        if one:
            graphs, graph_bytes = _kept_graphs(cfg, graph, assignment, m, model, budget - need,
                                               chunks, itemsize, chunkings, notes)
    return {"resident": yes, "buffers_bytes": need, "chunks": chunks,
            "kept_graph_layers": graphs, "kept_graph_bytes": graph_bytes}


def _kept_graphs(cfg: Config, graph: Graph, assignment: np.ndarray, m: int, model, room: int,
                 chunks: int, itemsize: int, chunkings, notes: list[str]) -> tuple[list[int], int]:
    """Resident on one GPU, which layers keep their update's autograd graph from
    forward to backward (``Executor(keep_graphs=True)``), as training decides
    from the batches' estimate before its transfer plan (which may add a little)."""
    from hongtu.engine.budget import (
        Chunkings,
        estimate_device_bytes,
        kept_graph_bytes,
        kept_graph_layers,
        kept_graphs,
    )

    e = cfg.engine
    cached, stored = model.cached_layers(e.checkpoint), model.stored_aggregates(e.checkpoint)
    layers = kept_graph_layers(model, cached, stored)
    if not any(layers):
        return [], 0
    _, sizes = (chunkings or Chunkings(graph, assignment, m)).get(chunks)
    estimate = estimate_device_bytes(model, sizes, itemsize, num_nodes=graph.num_nodes,
                                     overlap=e.overlap, resident=True, device="cuda",
                                     direct=True)
    kept, need = kept_graphs(model, sizes, itemsize, cached, stored, room, estimate, "cuda")
    names = ", ".join(str(l) for l, k in enumerate(layers) if k)
    if need:
        notes.append(f"resident: the update graphs of layers {names} ({format_size(need)}) fit "
                     "beside the batches, so training keeps them from forward to backward and "
                     "runs those updates once per epoch, as PyG does; their aggregates are not "
                     "stored")
    else:
        want = kept_graph_bytes(model, sizes, itemsize, layers, "cuda")
        notes.append(f"resident: the update graphs of layers {names} ({format_size(want)}) do "
                     f"not fit beside the batches ({format_size(max(room - estimate, 0))} "
                     "left), so each backward pass runs those updates again; a larger "
                     "engine.device_memory, or more engine.chunks, may keep them")
    return [l for l, k in enumerate(kept) if k], need


def build_report(cfg: Config, parts_list: list[int] | None = None,
                 chunks_list: list[int] | None = None,
                 alpha_seconds: float | None = ALPHA_SECONDS) -> Report:
    """Compute the report of ``cfg`` (see the module docstring).

    Args:
        cfg: the run's configuration.
        parts_list: part counts of the α table (default :data:`PARTS_LIST`).
        chunks_list: chunk counts to compare (default ``n`` and its neighbours).
        alpha_seconds: no further part count of the α table is started once
            the table has taken this long (``None`` or 0: every count).
    """
    import torch

    from hongtu.engine.budget import (
        Chunkings,
        aggregate_positions_bytes,
        more_chunks,
        more_chunks_text,
        plan_loads,
        takes_more_chunks,
    )
    from hongtu.engine.executor import (
        aggregates_in_load_order,
        backward_in_reverse,
        early_layers,
        first_aggregates_ordered,
        first_backward_in_flushes,
        first_in_place,
        first_load_host_bytes,
        first_load_traffic,
        first_loaded_rows,
        first_step_rows,
        flush_staging_elements,
        fold_fits,
        held_rows,
        keeps_last_aggregate,
        ordered_row_layers,
        own_rows_copied,
        own_rows_forward,
        own_rows_in_sources,
        own_rows_read,
        plan_handoffs,
        plan_index_bytes,
        reads_rows_once,
        resolved_checkpoint,
        written_first,
    )
    from hongtu.engine.trainer import load_data
    from hongtu.nn.model import build_model

    e, notes, t = cfg.engine, [], {}
    t0 = time.perf_counter()
    full = load_data(cfg)
    model = build_model(cfg.model, full.num_features, full.num_classes,
                        transform_first=e.transform_first, keep_dropped=True)
    info = {"name": full.name, "num_nodes": full.num_nodes, "num_edges": full.num_edges,
            "num_features": full.num_features, "num_classes": full.num_classes}
    # (training keeps the renumbered structure, labels and masks: the same sizes)
    structure_bytes = sum(a.nbytes for a in (full.indptr, full.indices, full.y, full.train_mask,
                                             full.val_mask, full.test_mask) if a is not None)
    # The report never needs vertex data: keep the structure alone.
    graph = replace(full, x=None, y=None, train_mask=None, val_mask=None, test_mask=None)
    del full
    t["load_s"] = time.perf_counter() - t0
    m = e.devices if e.parts == "auto" else e.parts
    if e.devices > 1 and m != e.devices:
        notes.append(f"engine.devices={e.devices} trains one part per device: the plan is "
                     f"made for engine.parts={e.devices}, not {m}")
        m = e.devices
    widths, itemsize = model.row_widths(), 4
    # (as training: chunks read their own rows among their sources with self-loops;
    # out of core on a GPU, layers reading them then recompute under checkpoint auto)
    own_read = own_rows_read(e, model, graph)
    # Plan for the device training will use: engine.accelerator=cuda is a GPU run
    # even where this machine has none (a laptop planning for a server); auto is
    # this machine's.
    gpu = e.accelerator == "cuda" or (e.accelerator == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        notes.append("engine.accelerator=cuda on a machine without CUDA: planned as a GPU "
                     "run, with the GPU's fused kernels (Triton, as torch's CUDA builds ship)")
    checkpoint = resolved_checkpoint(e.checkpoint, own_read and gpu, graph)
    cached = model.cached_layers(checkpoint)
    stored = model.stored_aggregates(checkpoint)
    once = reads_rows_once(model, checkpoint)
    needs_dst = [bool(layer.needs_dst) for layer in model.layers]
    own = own_rows_in_sources(model, cached) if own_read else None
    copied = own_rows_copied(model, cached, own_read)
    tp = resolve_throughput(e)

    t0 = time.perf_counter()
    alpha, skipped, failed, stopped = _replication(
        graph, e.partitioner, cfg.train.seed, e.cache_dir,
        list(PARTS_LIST if parts_list is None else parts_list), alpha_seconds)
    t["replication_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    assignment = assign_parts(graph, m, method=e.partitioner, seed=cfg.train.seed,
                              cache_dir=e.cache_dir)
    # (one set of chunkings for the counts tried, out of core and resident, as training)
    chunkings = Chunkings(graph, assignment, m)
    budget, n, chunks_how = _budget_and_chunks(cfg, graph, assignment, m, model, notes,
                                               copied, gpu, chunkings, itemsize, cached)
    resident = _resident(cfg, graph, assignment, m, model, budget, gpu, notes, itemsize,
                         chunkings)
    ctx = {"engine": e, "seed": cfg.train.seed, "throughput": tp, "devices": e.devices,
           "row_bytes": itemsize * max(widths), "model": model, "itemsize": itemsize,
           "budget": budget, "copied_dst": copied, "checkpoint": checkpoint, "cached": cached,
           # (as training decides where loads and stores overlap: a GPU with overlap)
           "overlapped": e.overlap and gpu, "device": "cuda" if gpu else "cpu"}
    main = _plan_chunks(graph, assignment, m, n, ctx)
    # (as training: out of core with kept rows, auto plans one count more where
    # the fewest that fit load rows again, and takes it where it loads fewer)
    planned = {n: main}
    smallest = int(np.bincount(assignment, minlength=m).min())  # (a part's vertices)
    if (e.chunks == "auto" and budget is not None and e.dedup.reuse and e.dedup.cache
            and not (resident and resident["resident"])):
        loaded, distinct = plan_loads(main.plan.plans)
        more = more_chunks(n, loaded, distinct, smallest)
        if more is not None:
            other = _plan_chunks(graph, assignment, m, more, ctx)
            if other.need_unplanned <= budget:
                planned[more] = other
                more_loaded = other.plan.h2d_rows
                chosen = more if (takes_more_chunks(loaded, more_loaded)
                                  and other.device_bytes <= budget) else n
                notes.append(more_chunks_text(n, loaded / distinct, more,
                                              more_loaded / distinct, chosen))
                if chosen == more:
                    main, n = other, more
                    chunks_how += f", then {more}: fewer rows loaded again"
    t["plan_s"] = time.perf_counter() - t0

    def traffic_of(s: _Setting, staging: bool = False) -> dict:
        """The epoch's traffic of a setting (``staging``: and its flush staging,
        ``host_staging``, which only the chosen count's host memory needs)."""
        plan, first, n = s.plan, s.plan.plans[0], graph.num_nodes
        hand = plan_handoffs(n, widths, s.row_elements, first,
                             first.max_later_load if e.overlap else 0, e.devices > 1, cached,
                             once, enabled=e.whole_layers, overlapped=ctx["overlapped"])
        # (the rows every process loads; modelled where each one's first step fills 0..n-1)
        ordered = ordered_row_layers(first, hand.whole, once, s.ordered
                                     and all(first_in_place(p) for p in plan.plans))
        counts = [first_loaded_rows(p) for p in plan.plans] if any(ordered) else []
        index = tuple(map(sum, zip(*(first_load_traffic(p, k) for p, k in
                                     zip(plan.plans, counts))))) or (0, 0)
        into = gpu and first_backward_in_flushes(model, cached, hand.whole, hand.kept, own_read)
        held = sum(map(held_rows, plan.plans)) if hand.held and not into else 0
        early = early_layers(ordered, hand.whole, hand.kept_layer)
        narrow = gpu and first_aggregates_ordered(model, stored, ordered, early)
        first = tuple(map(sum, zip(*map(first_step_rows, plan.plans)))) if any(early) \
            else (0, 0)
        fwd = own_rows_forward(model, hand.whole, own_read)
        # (blocks are copied pass by pass on a GPU where they do not stay there)
        blocks = _block_bytes(model, s, cached, n, itemsize, into) if gpu else None
        agg_once = aggregates_in_load_order(narrow, into)
        # (layer 1's backward reversed, one process: the last chunk's aggregates
        # of layer 1 stay on the device)
        once1 = agg_once and len(ordered) > 1 and ordered[1] and bool(counts) and counts[0] > 0
        one = plan.plans[0]
        reverse = e.devices == 1 and backward_in_reverse(once1, None, once1 and fold_fits(
            one, counts[0], widths[0], itemsize, max(int(s.sizes.num_dst.max()), 1),
            aggregate_positions_bytes(model, n, gpu), torch.device(ctx["device"])))
        kept_agg = int(s.sizes.num_dst[int(np.asarray(one.chunk_ids)[-1])]) \
            if keeps_last_aggregate(reverse, stored) else 0
        out = _traffic(widths, cached, stored, needs_dst, itemsize, n, plan.h2d_rows,
                       plan.d2h_rows, hand, ordered, sum(counts), index, held, early, first,
                       own, fwd, into, blocks, narrow, plan.d2d_rows, agg_once, kept_agg)
        # (host copies in load order, one process's: the inputs' loads, the rows' first loads)
        loads = max(int(p.load_ids.shape[0]) for p in plan.plans)
        # (the most elements one gradient flush stages in pinned host memory, of any
        # process: its plan's flushes, those written going straight to host memory)
        span = s.partition.chunk_ptr
        out["host_staging"] = 0 if not staging else max(flush_staging_elements(
            p, written_first(p, n, (lambda c: (int(span[c]), int(span[c + 1])))
                             if not own_read and any(needs_dst[1:]) else None)[2],
            [True] * len(widths), widths, hand.whole, into, hand.held and not into,
            [d and not own_read for d in needs_dst],
            int(s.sizes.num_dst[np.unique(np.asarray(p.chunk_ids))].max(initial=0)))
            for p in plan.plans) if gpu else 0
        out["host_ordered"] = (
            loads * widths[0] * itemsize
            if gpu and e.ordered_inputs and e.overlap and not hand.whole[0] else 0,
            max(counts, default=0) * itemsize * sum(
                widths[0] if m == 1 and narrow else w
                for m, (w, o) in enumerate(zip(widths, ordered))
                if o and not (m == 1 and agg_once)),
            # (their index arrays, pinned; with a^0 stored once, its rows' order too)
            max((first_load_host_bytes(p, int(s.sizes.num_dst[np.unique(
                np.asarray(p.chunk_ids))].sum()) if agg_once else 0) for p in plan.plans),
                default=0) if any(ordered) else 0)
        return out

    t0 = time.perf_counter()
    memory, traffic = [], None
    for k in sorted({*_alternatives(n, smallest, chunks_list), *planned}):
        s = planned[k] if k in planned else _plan_chunks(graph, assignment, m, k, ctx,
                                                          compare=False)
        tr = traffic_of(s, staging=s is main)
        traffic = tr if s is main else traffic  # (the chosen count's, listed with the rest)
        memory.append({"chunks": k, "device_bytes": s.device_bytes,
                       # (as training: the count's estimate before the plan, then with it)
                       "fits": None if budget is None
                       else max(s.need_unplanned, s.device_bytes) <= budget,
                       "buffer_rows": max(p.buffer_rows for p in s.plan.plans),
                       "v_ru_norm": s.plan.v_ru / max(graph.num_nodes, 1), "order": s.order_name,
                       "neighbour_bytes": tr["epoch"]["neighbour_bytes"],
                       "h2d_bytes": tr["epoch"]["h2d_bytes"],
                       "lower_bound_s": _costs(s.plan, tr, tp)["lower_bound_s"]})
    t["alternatives_s"] = time.perf_counter() - t0
    fitting = [r["chunks"] for r in memory if r["fits"]]
    cands = main.candidates
    # (each process holds its own part's rows; the largest part decides)
    rows = graph.num_nodes if e.devices == 1 else int(np.bincount(assignment,
                                                                  minlength=m).max())
    host = _host_memory(main, rows, widths, stored, itemsize, traffic.pop("host_grads"),
                        bool(resident and resident["resident"]), gpu, structure_bytes,
                        traffic.pop("host_ordered"), traffic.pop("host_staging"), e.devices)
    data = {
        "graph": info,
        "model": {"layers": [repr(x) for x in model.layers], "widths": widths,
                  "cached": cached, "needs_dst": needs_dst, "itemsize": itemsize,
                  "transform_first": [model.transforms_first(l) for l in range(len(cached))]},
        "engine": {"partitioner": e.partitioner, "parts": m, "chunks": n,
                   "chunks_how": chunks_how, "devices": e.devices, "reuse": e.dedup.reuse,
                   "p2p": e.dedup.p2p, "reorg": e.reorg, "checkpoint": e.checkpoint,
                   "device_memory": budget, "smallest_part": smallest,
                   "resident": resident,
                   # (the products' precision: TF32 where engine.tf32 asks on a GPU)
                   "precision": "tf32" if e.tf32 and gpu else "fp32"},
        "throughput": {k: v / 1e9 for k, v in tp.items() if k != "source"}
                      | {"source": tp["source"]},
        "replication": alpha, "replication_skipped": skipped,
        "replication_failed": failed, "replication_stopped": stopped,
        "volumes": {"candidates": cands, "chosen": main.order_name, "without_reorg": "identity",
                    "with_reorg": min(cands, key=lambda k: cands[k]["cost_s"]),
                    "plan": {k: int(v) for k, v in main.plan.volumes().items()
                             if not k.endswith("_bytes")}},
        "transfers": traffic, "cost": _costs(main.plan, traffic, tp),
        "memory": {"budget": budget, "chunks": n, "rows": memory,
                   "suggested_chunks": min(fitting) if fitting else None,
                   "fastest_chunks": fastest_count(memory),
                   # (the largest process's; the estimate leaves them out)
                   "plan_index_bytes": max(map(plan_index_bytes, main.plan.plans))},
        "host": host, "notes": notes, "timings": t,
    }
    return Report(data, main.partition, main.plan)


def _host_memory(s: _Setting, rows: int, widths: list[int], stored: list[bool], itemsize: int,
                 grads: list[bool], resident: bool, gpu: bool, structure_bytes: int,
                 ordered: tuple[int, int, int], staged: int, devices: int) -> dict:
    """What one training process holds in host memory out of core, as the trainer
    allocates it: its buffers (the trainer's
    :class:`~hongtu.engine.buffers.BufferPlan`, the check it makes before
    allocating them, ``h^0`` the copy of the input features in the partition's
    order), its chunks' blocks (int32 where they fit and pinned on a GPU, unless
    they stay on the device; int64 on a CPU), the renumbered structure with
    labels and masks, the transfer plan, on a GPU the pinned areas gradient
    flushes are staged in (each of ``staged`` elements, the largest flush), and,
    up to ``ordered``, the
    copies kept in load order (inputs, later rows; then the later rows' index
    arrays), which training takes where 80% of the memory then available
    holds them. Set against the host
    memory this machine has available now. Resident training allocates the
    buffers on the device instead."""
    from hongtu.engine.buffers import BufferPlan, available_host_memory
    from hongtu.engine.transfer import block_host_bytes, flush_staging_bytes

    plan = BufferPlan(rows, widths, stored, itemsize, grads=grads)
    buffers = [("h^0", rows * widths[0] * itemsize), *plan.entries()]
    sz, n = s.sizes, s.partition.num_chunks
    per_chunk = [0 if gpu and s.blocks_fit else
                 block_host_bytes(int(a), int(b), int(c), int(s.partition.chunk_ptr[-1]),
                                  itemsize, narrow=gpu)
                 for a, b, c in zip(sz.num_src, sz.num_dst, sz.num_edges)]
    # (each process builds its own part's blocks)
    blocks = max(sum(per_chunk[i * n:(i + 1) * n]) for i in range(len(per_chunk) // n)) \
        if devices > 1 else sum(per_chunk)
    # (each process plans its own device's steps: the shared arrays and the largest's)
    own = [0] * (devices + 1)  # (device d's arrays; the last, the shared ones)
    for k, a in s.plan.to_npz_dict().items():
        d = k.split(".")[0]
        own[int(d[3:]) if "." in k else -1] += a.nbytes
    plan_bytes = own[-1] + max(own[:-1])
    # (a GPU's pinned areas that receive gradient flushes while a thread adds them)
    staging = flush_staging_bytes(staged, itemsize) if gpu else 0
    others = [("chunk blocks", blocks), ("structure", structure_bytes),
              ("transfer plan", plan_bytes), ("flush staging", staging)]
    total = sum(b for _, b in buffers + others)
    return {"resident": resident, "entries": [list(x) for x in buffers],
            "buffers_bytes": sum(b for _, b in buffers),
            "others": [list(x) for x in others], "total_bytes": total,
            "ordered_bytes": list(ordered[:2]) if gpu else [0, 0],
            "ordered_index_bytes": ordered[2] if gpu else 0,
            "available_bytes": available_host_memory()}


# -------------------------------------------------------------------- text
def _table(rows: list[tuple], right: set[int]) -> list[str]:
    """Aligned columns (``right``: right-aligned ones), a rule under the header."""
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        cells = [str(x).rjust(w) if c in right else str(x).ljust(w)
                 for c, (x, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
        if k == 0:
            out.append("  " + "  ".join(("-" if h else " ") * w
                                        for h, w in zip(r, widths)).rstrip())
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:,.2f} s"


def _header(d: dict) -> list[str]:
    g, en, tp = d["graph"], d["engine"], d["throughput"]
    from hongtu.nn.model import describe_layers

    m = d["model"]
    model = describe_layers(m["layers"], m["cached"], m["transform_first"])
    src = {k: v if v in ("config", "default") else "calibrated" for k, v in tp["source"].items()}
    return [
        f"graph {g['name']}: {g['num_nodes']:,} vertices, {g['num_edges']:,} edges; model: {model}",
        f"engine: {en['partitioner']} partitioner, {en['parts']} part(s) x {en['chunks']} "
        f"chunk(s) ({en['chunks_how']}), {en['devices']} device(s); reuse={en['reuse']}, "
        f"p2p={en['p2p']}, reorg={en['reorg']}, checkpoint={en['checkpoint']}, "
        + ("fp32 (TF32 matrix products)" if en["precision"] == "tf32" else "fp32"),
        "throughput (GB/s): " + ", ".join(
            f"{k.replace('_', ' ')} {tp[k]:,.1f} ({src[k]})"
            for k in ("host_to_device", "device_to_device", "reuse", "contiguous")),
        *(f"note: {x}" for x in d["notes"])]


def _alpha_section(d: dict) -> list[str]:
    rep = d["replication"]
    lines = ["", f"replication factor α (HongTu Table 3), {d['engine']['partitioner']} "
             "partitioner: rows each layer reads per vertex when every part loads its own "
             "neighbours"]
    if rep:
        lines += _table([("parts", *(str(r["parts"]) for r in rep)),
                         ("α", *(f"{r['alpha']:.3f}" for r in rep)),
                         ("cut %", *(f"{100 * r['cut_fraction']:.1f}" for r in rep))],
                        right=set(range(1, len(rep) + 1)))
    if d["replication_skipped"]:
        lines.append(f"  skipped {', '.join(map(str, d['replication_skipped']))} parts: more "
                     f"than |V|/2 = {d['graph']['num_nodes'] // 2:,}")
    failed, stopped = d["replication_failed"], d.get("replication_stopped")
    if failed:
        lines.append(f"  stopped at {failed['parts']} parts (--parts-list sets the counts): "
                     f"{failed['message']}")
    if stopped:
        lines.append(f"  stopped before {stopped['parts']} parts: the counts before took "
                     f"{stopped['seconds']:.0f} s (--alpha-seconds; each count is cached, so "
                     "the next report goes further, or --parts-list chooses the counts)")
    return lines


def _volume_section(d: dict) -> list[str]:
    v, en = d["volumes"], d["engine"]
    lines = ["", f"transfer volumes of one layer pass, {en['parts']} part(s) x {en['chunks']} "
             "chunk(s), rows / |V| (HongTu Table 8)"]
    rows = [("batch order", "V_ori", "V_ori-V_+p2p", "V_+p2p-V_+ru", "V_+ru", "host saved",
             "C / pass", "")]
    for name, c in v["candidates"].items():
        rows.append((_ORDER_LABELS.get(name, name), f"{c['v_ori_norm']:.3f}",
                     f"{c['p2p_saved_norm']:.3f}", f"{c['ru_saved_norm']:.3f}",
                     f"{c['v_ru_norm']:.3f}", f"{c['reduction_pct']:.1f}%", _ms(c["cost_s"]),
                     "<- used" if name == v["chosen"] else ""))
    lines += _table(rows, right={1, 2, 3, 4, 5, 6})
    wo, wr = v["candidates"][v["without_reorg"]], v["candidates"][v["with_reorg"]]
    lines.append(f"  host traffic V_+ru vs V_ori: -{wo['reduction_pct']:.1f}% without reorg, "
                 f"-{wr['reduction_pct']:.1f}% with reorg ({v['with_reorg']}); C at "
                 f"{d['model']['itemsize'] * max(d['model']['widths'])} B rows")
    return lines


def _transfer_section(d: dict) -> list[str]:
    fs, n = format_size, d["graph"]["num_nodes"]
    t, c, p, tp = d["transfers"], d["cost"], d["volumes"]["plan"], d["throughput"]
    lines = ["", "predicted transfers of one training step (plan: batch order "
             f"'{d['volumes']['chosen']}'; loads {p['h2d_rows'] / n:.3f} |V| rows per pass, "
             f"flushes {p['d2h_rows'] / n:.3f} |V|)"]
    if p.get("cached_rows"):
        lines.append(f"  the budget left after the plan keeps {p['cached_rows']:,} reused rows "
                     "on the device across batches (engine.dedup.cache)")
    rows = [("layer", "width", "cached", "rows", "forward", "bwd reload", "grad flush",
             "aggregates", "ranges", "blocks", "C / pass", "passes")]
    for x, cl, ps in zip(t["layers"], c["per_layer_pass_s"], c["passes"]):
        rows.append((str(x["layer"]), str(x["width"]), "yes" if x["cached"] else "no",
                     "all" if x["whole"] else "plan",
                     fs(x["forward_bytes"]), fs(x["backward_reload_bytes"]), fs(x["flush_bytes"]),
                     fs(x["aggregate_d2h_bytes"] + x["aggregate_h2d_bytes"]),
                     fs(x["range_h2d_bytes"] + x["range_d2h_bytes"]), fs(x["block_h2d_bytes"]),
                     _ms(cl), str(ps)))
    lines += _table(rows, right=set(range(1, 12)) - {2, 3})
    ep, several = t["epoch"], d["engine"]["devices"] > 1
    return lines + [
        f"  epoch: neighbour rows {fs(ep['neighbour_bytes'])} (forward {fs(ep['forward_bytes'])}"
        f" + backward reloads {fs(ep['backward_reload_bytes'])} + gradient flushes "
        f"{fs(ep['flush_bytes'])}); cached aggregates "
        f"{fs(ep['aggregate_d2h_bytes'] + ep['aggregate_h2d_bytes'])}, contiguous ranges "
        f"{fs(ep['range_h2d_bytes'] + ep['range_d2h_bytes'])} and chunk blocks "
        f"{fs(ep['block_h2d_bytes'])} besides",
        f"  epoch totals: host->device {fs(ep['h2d_bytes'])}, device->host "
        f"{fs(ep['d2h_bytes'])}" + (
            f", GPU-to-GPU {fs(ep['d2d_bytes'])} (all devices)" if several else "")
        + f"; an evaluation pass adds {fs(ep['evaluation_bytes'])}" + (
            f" and {fs(ep['evaluation_d2d_bytes'])} GPU-to-GPU" if several else ""),
        f"  cost C (Eq. 4) per epoch {_ms(c['epoch_s'])} + contiguous {_ms(c['contiguous_s'])} "
        f"at {tp['contiguous']:,.1f} GB/s = transfer lower bound {_ms(c['lower_bound_s'])} "
        f"per epoch at host link {tp['host_to_device']:,.1f} GB/s"] + ([
        f"  (all {d['engine']['devices']} devices' bytes over one link at that rate: where "
        "their links carry at once, the bound falls by up to that many times; "
        "bench/bench_host_links.py measures how far they add up)"] if several else [])


def _memory_section(d: dict) -> list[str]:
    mem = d["memory"]
    budget = "none" if mem["budget"] is None else format_size(mem["budget"])
    lines = ["", "device memory per chunk (estimated peak with the plan's buffer) vs host "
             f"traffic, budget {budget}"]
    rows = [("chunks", "buffer rows", "est. peak", "fits", "V_+ru/|V|", "neighbour/epoch",
             "lower bound", "")]
    for r in mem["rows"]:
        rows.append((str(r["chunks"]), f"{r['buffer_rows']:,}", format_size(r["device_bytes"]),
                     "-" if r["fits"] is None else ("yes" if r["fits"] else "no"),
                     f"{r['v_ru_norm']:.3f}", format_size(r["neighbour_bytes"]),
                     _ms(r["lower_bound_s"]),
                     "<- this config" if r["chunks"] == mem["chunks"] else ""))
    lines += _table(rows, right={1, 2, 3, 4, 5, 6})
    lines.append(f"  the transfer plan's index arrays on the device, not in the estimate: "
                 f"{format_size(mem['plan_index_bytes'])} at {mem['chunks']} chunks")
    if mem["budget"] is None:
        lines.append("  no budget: set engine.device_memory to mark which chunk counts fit")
    elif mem["suggested_chunks"] is not None:
        lines.append(f"  fewest chunks listed that fit: engine.chunks={mem['suggested_chunks']}")
        fast = mem["fastest_chunks"]
        if fast is not None and fast != mem["suggested_chunks"]:
            bound = {r["chunks"]: r["lower_bound_s"] for r in mem["rows"]}
            few = mem["suggested_chunks"]
            lines.append(f"  predicted fastest: engine.chunks={fast} (lower bound "
                         f"{_ms(bound[fast])}, {1 - bound[fast] / bound[few]:.0%} below "
                         f"{few}'s); engine.chunks=auto takes the fewest that fit, or the "
                         "next count where those load rows again and it loads fewer")
    else:
        lines.append("  none listed fits: try more chunks (--chunks-list) or raise "
                     "engine.device_memory")
    return lines


def _host_section(d: dict) -> list[str]:
    h, fs = d["host"], format_size
    if h["resident"]:
        return ["", "host memory: no buffers (resident: training keeps them on the device)"]
    buffers = ", ".join(f"{name} {fs(b)}" for name, b in h["entries"])
    others = ", ".join(f"{name} {fs(b)}" for name, b in h["others"])
    inputs, rows = h["ordered_bytes"]
    index = h["ordered_index_bytes"]
    lines = ["", f"host memory of one training process: {fs(h['total_bytes'])}: buffers "
             f"{fs(h['buffers_bytes'])} ({buffers}; h^0 is the features copied in the "
             f"partition's order), {others}"]
    if inputs or rows or index:
        lines.append(f"  and on a GPU up to {fs(inputs + rows)} of copies in load order "
                     f"(inputs {fs(inputs)}, rows {fs(rows)}), each kept where 80% of the "
                     "host memory then available holds it"
                     + (f", and {fs(index)} of the rows' index arrays (pinned)" if index
                        else ""))
    fits = h["buffers_bytes"] <= h["available_bytes"]
    lines.append(f"  this machine has {fs(h['available_bytes'])} available now: the buffers "
                 + ("fit" if fits else "do not fit, training would stop with 'host memory "
                                       "too small'")
                 + "; Python, torch and the input as loaded come on top")
    return lines


def format_report(d: dict) -> str:
    """The report as plain-text tables (what ``hongtu report`` prints)."""
    tm = d["timings"]
    lines = [*_header(d), *_alpha_section(d), *_volume_section(d), *_transfer_section(d),
             *_memory_section(d), *_host_section(d),
             f"\nreport computed in {sum(tm.values()):.1f} s (load {tm['load_s']:.1f} s, "
             f"α {tm['replication_s']:.1f} s, plan {tm['plan_s']:.1f} s, other chunk counts "
             f"{tm['alternatives_s']:.1f} s)"]
    return "\n".join(lines)


# -------------------------------------------------------------------- plot
def plot_report(d: dict, out: str | Path, overwrite: bool = False) -> Path:
    """Draw α, the volumes with and without reorg, and the chunk-count trade-off."""
    from matplotlib.figure import Figure

    from hongtu.plot import FORMATS, check_output, write_atomic

    out = Path(out)
    check_output(out, overwrite, FORMATS, "plot")
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    parts = [r["parts"] for r in d["replication"]]
    ax1.plot(parts, [r["alpha"] for r in d["replication"]], marker="o")
    if parts:
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(parts, labels=[str(k) for k in parts])
    ax1.set(xlabel="parts", ylabel="replication factor α",
            title=f"α, {d['engine']['partitioner']} partitioner")

    cands, chosen = d["volumes"]["candidates"], d["volumes"]["chosen"]
    names = [k + (" (used)" if k == chosen else "") for k in cands]
    bottom = np.zeros(len(names))
    for key, label in (("v_ru_norm", "V_+ru (host)"), ("ru_saved_norm", "V_+p2p − V_+ru (reuse)"),
                       ("p2p_saved_norm", "V_ori − V_+p2p (p2p)")):
        vals = np.array([c[key] for c in cands.values()])
        ax2.bar(names, vals, bottom=bottom, label=label)
        bottom += vals
    ax2.set(ylabel="rows per layer pass / |V|", ylim=(0, 1.4 * max(bottom.max(), 1e-9)),
            title=f"volumes, {d['engine']['parts']} parts x {d['engine']['chunks']} chunks")
    ax2.legend(fontsize="small", loc="upper center", ncols=2)

    mem = d["memory"]["rows"]
    ks = [r["chunks"] for r in mem]
    ax3.plot(ks, [r["device_bytes"] / 2**30 for r in mem], marker="o", color="C0",
             label="device memory (est.)")
    if d["memory"]["budget"] is not None:
        ax3.axhline(d["memory"]["budget"] / 2**30, color="C0", linestyle="--", label="budget")
    ax3.axvline(d["engine"]["chunks"], color="gray", linestyle=":", label="this config")
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(ks, labels=[str(k) for k in ks])
    ax3.set(xlabel="chunks per part", ylabel="GiB per chunk on the device",
            title="chunk count trade-off")
    twin = ax3.twinx()
    twin.plot(ks, [r["neighbour_bytes"] / 2**30 for r in mem], marker="s", color="C3",
              label="host traffic / epoch")
    twin.set_ylabel("GiB of neighbour rows per epoch")
    ax3.legend(*(a + b for a, b in zip(ax3.get_legend_handles_labels(),
                                       twin.get_legend_handles_labels())),
               fontsize="small", loc="upper center")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle(f"hongtu report: {d['graph']['name']}")
    fmt = out.suffix.lower().lstrip(".")
    write_atomic(out, lambda f: fig.savefig(f, format=fmt, dpi=100))
    return out


# -------------------------------------------------------------------- dump
def check_dump_dir(path: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty directory without ``overwrite``."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--dump-plan '{path}' is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"--dump-plan directory '{path}' is not empty; pass --overwrite to "
                        "replace its plan files, or choose an empty directory")


def dump_plan(rep: Report, path: str | Path, overwrite: bool = False) -> list[Path]:
    """Write ``partition.npz`` and ``plan.npz`` (no pickles) into the directory ``path``.

    ``partition.npz``: ``part`` and ``chunk`` of every original vertex, ``perm``
    (new id -> original), ``part_ptr``, ``chunk_ptr``, ``num_parts``,
    ``num_chunks``, ``method``, ``seed``. ``plan.npz``:
    :meth:`TransferPlan.to_npz_dict` (its ``order`` is the batch order) and
    ``order_name``, the reorganizer candidate used.
    """
    from hongtu.plot import write_atomic

    path = Path(path)
    check_dump_dir(path, overwrite)
    p = rep.partition
    part, chunk = p.assignment()
    files = {
        "partition.npz": {"part": part, "chunk": chunk, "perm": p.perm, "part_ptr": p.part_ptr,
                          "chunk_ptr": p.chunk_ptr, "num_parts": np.asarray(p.num_parts),
                          "num_chunks": np.asarray(p.num_chunks),
                          "method": np.asarray(p.method), "seed": np.asarray(p.seed)},
        "plan.npz": {**rep.plan.to_npz_dict(),
                     "order_name": np.asarray(rep.data["volumes"]["chosen"])},
    }
    for name, arrays in files.items():
        write_atomic(path / name, lambda f, a=arrays: np.savez(f, **a))
    return [path / name for name in files]
