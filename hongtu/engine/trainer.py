r"""The training loop: from a :class:`~hongtu.config.Config` to a trained model.

Setup (once): load and validate the graph, partition it (cached), pick the
chunk count that fits the device budget, renumber, build the chunk blocks,
print the memory plan, allocate the host buffers. Then one full-graph
optimizer step per epoch, an evaluation pass, a line and a metrics record per
epoch, and the final model under ``output.dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hongtu.calibrate import resolve_throughput
from hongtu.config import Config, format_size, parse_size
from hongtu.dedup import neighbour_sets
from hongtu.engine.budget import (
    AUTO_BUDGET_FRACTION,
    Chunkings,
    check_device_budget,
    choose_chunks,
    choose_resident,
    estimate_device_bytes,
    grown_row_memory,
    kept_graph_need,
    kept_graphs,
    leftover_bytes,
    more_chunks,
    more_chunks_text,
    plan_loads,
    resident_block_bytes,
    row_memory,
    slot_widths,
    spare_rows,
    step_ahead,
    takes_more_chunks,
)
from hongtu.engine.buffers import BufferPlan, HostBuffers
from hongtu.engine.checkpoint import CHECKPOINT, atomic_torch_save, load_checkpoint, save_checkpoint
from hongtu.engine.chunks import ChunkSet
from hongtu.engine.comm import in_distributed_launch, init_from_env
from hongtu.engine.executor import (
    Executor,
    first_backward_in_flushes,
    first_layer_rows,
    ordered_rows_room,
    own_rows_copied,
    own_rows_read,
    plan_handoffs,
    reads_rows_once,
    resolved_checkpoint,
)
from hongtu.engine.transfer import pin_blocks
from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.nn.model import GNN, build_model, describe_layers
from hongtu.partition import assign_parts
from hongtu.reorg import plan_batches

__all__ = ["Trainer", "resolve_device", "load_data", "check_output_dir"]

log = logging.getLogger("hongtu")
_RESULT_FILES = ("model.pt", CHECKPOINT)


def resolve_device(accelerator: str, devices: int, local_rank: int = 0) -> torch.device:
    """``auto | cpu | cuda`` to this process's device, with one clear error when it is not there.

    Args:
        accelerator: ``engine.accelerator``.
        devices: GPUs used on this machine (``engine.devices``).
        local_rank: this process's index on its machine.
    """
    if accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("engine.accelerator=cuda but no CUDA device is available "
                            "(torch.cuda.is_available() is False); use engine.accelerator=cpu")
        have = torch.cuda.device_count()
        if devices > have or local_rank >= have:
            raise UserError(f"engine.devices={max(devices, local_rank + 1)} but this machine "
                            f"has {have} GPU(s); set engine.devices ≤ {have}")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


#: the environment variables PyTorch reads its allocator's settings from
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Have PyTorch's CUDA allocator map new memory into expandable segments
    (``expandable_segments:True``), unless the environment's allocator settings
    (:data:`ALLOC_CONF_VARS`) already say whether to: theirs stand. Whether
    they are on.

    A budget is what training may hold; with a segment per allocation the
    allocator's free pieces between segments cannot serve a larger request,
    and on a GPU the size of the budget training stopped out of memory where
    the peak was within it (products-like and R-MAT 2^22 GCN 3×256, R-MAT 2^24
    GCN 2×128 at the suite's budgets: ``bench/HISTORY.md``, 2026-11-28,
    eleventh). Expandable segments hand the pages of free pieces back and map
    new ones where the request is. The setting holds for this process's
    segments made from then on.
    """
    for var in ALLOC_CONF_VARS:
        conf = os.environ.get(var, "").replace(" ", "").lower()
        if "expandable_segments:" in conf:
            return "expandable_segments:true" in conf
    # (newer PyTorch names one setter for every accelerator and deprecates the CUDA one)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
        or getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # (a PyTorch without them)
        return False
    try:
        setter("expandable_segments:True")
    except RuntimeError:  # (a platform without them)
        return False
    return True


def agree_resident(comm, choice: tuple[bool, int | None, int | None], budget: int | None
                   ) -> tuple[bool, int | None, int | None]:
    """Every process's :func:`~hongtu.engine.budget.choose_resident` made one:
    each weighs its own part's buffers against its own budget, and processes
    whose plans differ there would exchange rows that do not match. Resident
    only where every part is (a process whose part fits trains out of core
    with the others: ``(False, budget, None)``), at the most chunks any part
    needs (the fewest that fit the part with the least room)."""
    resident, room, chunks = choice
    if comm is None:
        return choice
    if not comm.min_int(int(resident)):  # (choose_resident's out-of-core choice)
        return False, budget, None
    most = comm.max_int(-1 if chunks is None else chunks)  # (every rank calls it)
    return True, room, None if most < 0 else most


def check_plans_agree(comm, resident: bool, chunks: int, steps: int, cached: list[bool],
                      sent: int, received: int) -> None:
    """Stop every process with an error where their plans differ in what the
    executor's collectives follow: resident or not, the chunk count, the steps
    of a pass, the layers that recompute, and the rows exchanged (all sent as
    many as all receive). Each process plans its own part; plans that differ
    there would exchange rows no peer expects and wait on each other until
    ``engine.timeout`` (the 4-GPU stop of 2026-11-28: chunk counts 6 and 8,
    before :func:`agree_resident`)."""
    if comm is None:
        return
    mine = [int(resident), int(chunks), int(steps), *map(int, cached)]
    same = comm.same_ints(mine)
    all_sent, all_received = comm.sum_ints([sent, received])
    if not same or all_sent != all_received:
        raise RuntimeError(
            f"the processes planned differently (rank {comm.rank}: resident={bool(resident)}, "
            f"{chunks} chunks, {steps} steps, layers cached {[bool(c) for c in cached]}; "
            f"all ranks send {all_sent} rows a pass and receive {all_received}); this is a "
            "bug in hongtu: please report it with the config and this line")


def load_data(cfg: Config) -> Graph:
    """The graph named by ``cfg.data``, validated, with labels and a train split."""
    from hongtu.graph.io import load_graph

    d = cfg.data
    graph = load_graph(d.path, undirected=d.undirected, self_loops=d.self_loops,
                       normalize_features=d.normalize_features, num_features=d.num_features,
                       seed=cfg.train.seed)
    if graph.y is None or graph.train_mask is None:
        raise UserError(f"{d.path}: the graph has no labels or train mask, so there is nothing "
                        "to train on; add 'y' and 'train_mask' arrays to the dataset")
    if not graph.train_mask.any():
        raise UserError(f"{d.path}: the train mask selects no vertex; mark at least one "
                        "vertex in 'train_mask'")
    return graph


def check_output_dir(outdir: Path, overwrite: bool) -> None:
    """Refuse an ``output.dir`` that holds a run's results, unless ``overwrite``."""
    if not overwrite:
        existing = [f for f in _RESULT_FILES if (outdir / f).exists()]
        if existing:
            raise UserError(f"output.dir '{outdir}' already holds a run's results "
                            f"({', '.join(existing)}); pass --overwrite to replace them, "
                            "or set output.dir to a new directory")


class Trainer:
    """Out-of-core full-graph training of ``cfg``.

    Args:
        cfg: the run's configuration.
        overwrite: allow ``output.dir`` to hold an earlier run's results.
        out: where epoch lines go (``print`` by default).
        dtype: element type of buffers and parameters (float64 for oracle tests).
    """

    def __init__(self, cfg: Config, overwrite: bool = False,
                 out: Callable[[str], None] = print, dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        self.out = out
        self.dtype = dtype
        self.outdir = Path(cfg.output.dir)
        check_output_dir(self.outdir, overwrite)
        e = cfg.engine
        self.comm = None
        launched = in_distributed_launch()
        if launched:
            local = int(os.environ.get("LOCAL_RANK", 0))
            self.device = resolve_device(e.accelerator, e.devices, local)
        else:
            if e.devices > 1:
                raise UserError(f"engine.devices={e.devices} needs one process per device; "
                                "start it with 'hongtu train' (which launches them) or torchrun")
            self.device = resolve_device(e.accelerator, 1)
        #: PyTorch's allocator maps its memory in expandable segments (a GPU; set
        #: before NCCL starts)
        self.expandable = self.device.type == "cuda" and use_expandable_segments()
        if launched:
            self.comm = init_from_env(self.device.type == "cuda", e.timeout)
        world, rank = (self.comm.world, self.comm.rank) if self.comm else (1, 0)
        self.rank, self.world = rank, world
        if rank != 0:
            self.out = _silent  # one voice: rank 0 reports for all
        t0 = time.perf_counter()
        graph = load_data(cfg)
        t_part = time.perf_counter()
        self.num_classes = graph.num_classes
        torch.manual_seed(cfg.train.seed)
        self.model: GNN = build_model(cfg.model, graph.num_features, self.num_classes,
                                      transform_first=e.transform_first, keep_dropped=True)
        self.model.to(device=self.device, dtype=dtype)
        parts = world if e.parts == "auto" else e.parts
        if world > 1 and parts != world:
            raise UserError(f"engine.parts={parts} with {world} processes: each process trains "
                            "one part; set engine.parts=auto")
        if world > 1 and not e.dedup.p2p:
            raise UserError(f"engine.dedup.p2p=false with {world} processes: a process holds "
                            "only its own part's host rows, so rows of other parts must travel "
                            "GPU-to-GPU; set engine.dedup.p2p=true")
        # (the cache key's hash of the structure taken before the barrier: the other
        # processes hash while rank 0 partitions, not after it)
        structure = graph.fingerprint(structure_only=True) \
            if e.cache_dir is not None and parts > 1 else None
        if rank != 0:
            self.comm.barrier()  # rank 0 partitions and caches; the others read the cache
        assignment = assign_parts(graph, parts, method=e.partitioner, seed=cfg.train.seed,
                                  cache_dir=e.cache_dir, fingerprint=structure)
        if rank == 0 and self.comm:
            self.comm.barrier()
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.budget = self._budget()
        # Chunks read their own rows among their sources (self-loops): layers
        # that take them from there need no device slots to copy them into.
        own_src = own_rows_read(e, self.model, graph)
        self._chunkings = Chunkings(graph, assignment, parts)  # the chunk counts tried
        own_rows = int(self._chunkings.chunker.part_sizes[rank]) if world > 1 else graph.num_nodes
        self.resident, self.room, chunks = self._resident(
            graph, assignment, parts,
            BufferPlan(own_rows, self.model.row_widths(),
                       self.model.stored_aggregates(e.checkpoint), itemsize), itemsize)
        # (out of core on a GPU, layers reading their own rows among their sources
        # recompute, where the graph is not dense)
        self.checkpoint_mode = resolved_checkpoint(
            e.checkpoint, own_src and not self.resident and self.device.type == "cuda", graph)
        cached = self.model.cached_layers(self.checkpoint_mode)
        stored = self.model.stored_aggregates(self.checkpoint_mode)  # host buffers of aggregates
        once = reads_rows_once(self.model, self.checkpoint_mode)  # (h^1 may stay on the device)
        copied = own_rows_copied(self.model, cached, own_src)
        chunkings = self._chunkings  # the chunkings tried for the chunk count
        del self._chunkings
        if chunks is None and e.chunks == "auto":
            chunks, _ = choose_chunks(graph, assignment, parts, self.model, self.room, itemsize,
                                      chunkings=chunkings, overlap=e.overlap,
                                      copied_dst=copied, device=self.device.type,
                                      cached=cached, exchange=world > 1)
        elif chunks is None:
            chunks = e.chunks
        part, sizes = chunkings.get(chunks)  # (a part too small for them: UserError)
        self.partition = dataclasses.replace(part, method=e.partitioner, seed=cfg.train.seed)
        # (From the chunk-count search's bitmaps, when they hold them: no pass.)
        neighbours = chunkings.sets(chunks)
        partition_s = time.perf_counter() - t_part
        # (resident in one process: rows read in place, no transition buffer; the
        # executor's direct mode, where update graphs may be kept)
        direct = self.resident and world == 1

        def unplanned(sizes, num_nodes=graph.num_nodes) -> int:  # (before its plan)
            return estimate_device_bytes(self.model, sizes, itemsize,
                                         num_nodes=num_nodes, overlap=e.overlap,
                                         resident=self.resident, copied_dst=copied,
                                         device=self.device.type, direct=direct,
                                         cached=cached, exchange=world > 1)

        self.estimate = unplanned(sizes)
        if self.room is not None and self.estimate > self.room:
            raise UserError(f"engine.chunks={chunks} needs about {format_size(self.estimate)} "
                            f"on the device but engine.device_memory is "
                            f"{format_size(self.budget)}; use engine.chunks=auto or more chunks")
        # Renumber the structure; each process takes only its own rows of the
        # features (a memory-mapped file is read for those rows alone).
        a, b = (int(self.partition.part_ptr[rank]), int(self.partition.part_ptr[rank + 1])) \
            if world > 1 else (0, graph.num_nodes)
        t_renumber = time.perf_counter()
        g = self.partition.apply(dataclasses.replace(graph, x=None))
        x, rows = graph.x, self.partition.perm[a:b]  # gathered into h^0 by HostBuffers
        del graph
        self.graph = g
        t_plan = time.perf_counter()
        split = {"renumber_s": t_plan - t_renumber}
        tp = resolve_throughput(e)  # the same cost model hongtu report shows
        #: where planning went: the neighbour sets (where the chunk-count search
        #: left none) and, with several processes, waiting in their agreements
        self.plan_split = {"sets_s": 0.0, "waits_s": 0.0}

        def agreed(op: str, value):
            """``value`` agreed by every process through ``Comm.<op>`` (one process:
            ``value``), the wait for the others timed."""
            if not self.comm:
                return value
            t = time.perf_counter()
            value = getattr(self.comm, op)(value)
            self.plan_split["waits_s"] += time.perf_counter() - t
            return value

        def estimate(dplan, sizes) -> int:  # a DevicePlan, or its DeviceNeeds before slots
            return estimate_device_bytes(
                self.model, sizes, itemsize, num_nodes=b - a, buffer_rows=dplan.buffer_rows,
                overlap=e.overlap, load_rows=dplan.max_later_load, resident=self.resident,
                copied_dst=copied, device=self.device.type, direct=direct, cached=cached,
                exchange=world > 1)

        def plan_count(n: int, chunk_ptr: np.ndarray, sizes, neighbours) -> tuple:
            """``(neighbour sets, batch order, transfer plan)`` of ``n`` chunks per part."""
            if neighbours is None:  # (their sizes are the sources the count was chosen by)
                t = time.perf_counter()
                neighbours = neighbour_sets(g.indptr, g.indices, chunk_ptr,
                                            counts=sizes.num_src)
                self.plan_split["sets_s"] += time.perf_counter() - t

            def cache_rows(needs) -> int:
                """Rows the budget left after the plan keeps resident across batches."""
                extra = spare_rows(self.room, estimate(needs[rank], sizes),
                                   max(self.model.row_widths()), itemsize)
                extra = extra if e.dedup.cache and not self.resident else 0
                return agreed("min_int", extra)  # one plan for all

            return neighbours, *plan_batches(
                g.indptr, g.indices, chunk_ptr, parts, n,
                reuse=e.dedup.reuse, p2p=e.dedup.p2p, reorg=e.reorg, devices=world,
                row_bytes=itemsize * max(self.model.row_widths()), t_hd=tp["host_to_device"],
                t_dd=tp["device_to_device"], t_ru=tp["reuse"], cache_rows=cache_rows,
                neighbours=neighbours, only=rank if self.comm else None)

        neighbours, self.order, self.transfer_plan = plan_count(
            chunks, self.partition.chunk_ptr, sizes, neighbours)
        # Out of core with kept rows, auto plans one count more where the fewest
        # that fit load rows again within a pass, and takes it where it loads
        # fewer (budget.more_chunks). (Every process plans alike: one choice.)
        self.more_chunks = None  # (fewest, their loads / distinct rows, the other's)
        want = (e.chunks == "auto" and not self.resident and self.room is not None
                and e.dedup.reuse and e.dedup.cache)
        # (every process alike: planning is collective, cache_rows)
        want = bool(agreed("min_int", int(want)))
        # (each process plans its own device's steps: counts over all are sums)
        def total(*counts: int) -> list[int]:
            return agreed("sum_ints", list(counts))

        if want:
            loaded, distinct = total(*plan_loads([self.transfer_plan.plans[rank]]))
            more = more_chunks(chunks, loaded, distinct,
                               int(chunkings.chunker.part_sizes.min()))
            if more is not None:
                # (the same renumbering as every count's: only the chunk bounds differ)
                more_part, more_sizes = chunkings.get(more)
                fits = bool(agreed("min_int",
                                   int(unplanned(more_sizes) <= self.room)))
                if fits:
                    other = plan_count(more, more_part.chunk_ptr, more_sizes, chunkings.sets(more))
                    more_loaded = total(other[2].h2d_rows)[0]
                    self.more_chunks = (chunks, loaded / distinct, more, more_loaded / distinct)
                    take = bool(agreed("min_int", int(
                        takes_more_chunks(loaded, more_loaded)
                        and estimate(other[2].plans[rank], more_sizes) <= self.room)))
                    if take:
                        chunks, sizes = more, more_sizes
                        self.partition = dataclasses.replace(more_part, method=e.partitioner,
                                                             seed=cfg.train.seed)
                        neighbours, self.order, self.transfer_plan = other
                    del other
        del chunkings
        self.loaded_rows = total(self.transfer_plan.h2d_rows)[0]  # (per pass, every process)
        # (a process of several keeps its own part's blocks)
        self.block_bytes = resident_block_bytes(sizes, itemsize, parts if world > 1 else 1)
        self.chunk_sizes = sizes  # (every part's chunks: rows and edges, as estimated)
        dplan, widths = self.transfer_plan.plans[rank], self.model.row_widths()
        check_plans_agree(self.comm, self.resident, chunks, dplan.num_steps, cached,
                          int(dplan.send_counts.sum()), int(dplan.recv_counts.sum()))
        self.plan_s = time.perf_counter() - t_plan
        self.estimate = estimate(dplan, sizes)
        # Rows written in first-load order where the budget holds their index arrays.
        most = int(sizes.num_dst.max())
        index_bytes = ordered_rows_room(
            dplan, once, e.ordered_rows and self.device.type == "cuda" and e.overlap
            and not self.resident, leftover_bytes(self.room, self.estimate, self.block_bytes)[0],
            most, most * slot_widths(self.model, stored)["grad"] * itemsize)
        self.estimate += index_bytes or 0
        # (The blocks stay on the device in what the plan and its kept rows leave.) What
        # the budget still leaves may let a layer's rows move whole.
        left, self.blocks_fit = leftover_bytes(self.room, self.estimate, self.block_bytes)
        left = None if self.resident or not e.whole_layers else left
        stage = dplan.max_later_load if e.overlap else 0  # staging rows of the row memory
        plan_rows = row_memory(dplan.buffer_rows, widths, stage)
        overlapped = e.overlap and self.device.type == "cuda"  # (loads beside stores)
        first_rows, first_stores = first_layer_rows(dplan, widths, cached, overlapped)
        row_elements = grown_row_memory(
            plan_rows, left, b - a, widths, int(dplan.load_ids.shape[0]), world > 1, itemsize,
            keep_rows=len(once) > 1 and once[1], first_rows=first_rows,
            first_stores=first_stores)
        self.estimate += (row_elements - plan_rows) * itemsize
        if self.room is not None and self.estimate > self.room:
            raise UserError(f"the transfer plan's buffers need about "
                            f"{format_size(self.estimate)} on the device but "
                            f"engine.device_memory is {format_size(self.budget)}; use more "
                            "engine.chunks or raise engine.device_memory")
        t = time.perf_counter()
        # Pinned and narrowed as each is cut, where they travel, each int64 block
        # going as its copy is made: host memory never holds them beside the buffers.
        pin = self.device.type == "cuda" and not self.blocks_fit
        self.chunks = ChunkSet.build(g, self.partition.chunk_ptr, parts, chunks, dtype,
                                     part=rank if world > 1 else None, sources=neighbours,
                                     finish=(lambda b: pin_blocks([b])[0]) if pin else None)
        del neighbours  # each block holds its own sources now
        split["blocks_s"] = time.perf_counter() - t
        # Gradients the executor will keep on the device need no host buffer
        # (its row memory is at least row_elements: it keeps at least these).
        hand = plan_handoffs(b - a, widths, row_elements, dplan, stage, world > 1, cached, once,
                             enabled=e.whole_layers and not self.resident,
                             overlapped=overlapped)
        # nor ∇h^1 where layer 1's backward runs the first layer's on its flushes
        into_first = self.device.type == "cuda" and first_backward_in_flushes(
            self.model, cached, hand.whole, hand.kept, own_src, direct)
        # Resident on one device, updates that are more than one linear map keep
        # their graph from forward to backward where the budget holds it (as PyG
        # does), instead of running the update again.
        graphs, self.graph_bytes = kept_graphs(
            self.model, sizes, itemsize, cached, stored, self.room, self.estimate,
            self.device.type) if direct else ([False] * len(stored), 0)
        self.estimate += self.graph_bytes  # (counted in the estimate)
        # (no aggregate buffer where the update's graph is kept)
        aggregates = [s and not g for s, g in zip(stored, graphs)]
        plan = BufferPlan(b - a, widths, aggregates, itemsize,
                          grads=[not k and not (l == 1 and into_first)
                                 for l, k in enumerate(hand.kept)])
        self.out(self._plan_text(plan, parts, chunks))
        t = time.perf_counter()
        buffers = HostBuffers(plan, x, pin=self.device.type == "cuda", dtype=dtype,
                              device=self.device if self.resident else None, rows=rows)
        del x, rows  # h^0 holds the features now (a pinned copy on GPUs)
        split["buffers_s"] = time.perf_counter() - t

        def own(mask):
            mask = np.zeros(g.num_nodes, bool) if mask is None else np.asarray(mask)
            return torch.from_numpy(mask[a:b].copy())

        masks = {k: own(getattr(g, f"{k}_mask")) for k in ("train", "val", "test")}
        t = time.perf_counter()
        self.executor = Executor(
            self.model, self.chunks, buffers,
            torch.from_numpy(np.asarray(g.y[a:b], dtype=np.int64)), masks, self.device,
            self.transfer_plan.plans[rank], self.checkpoint_mode, cfg.train.seed,
            resident_blocks=self.blocks_fit, comm=self.comm, num_train=int(np.sum(g.train_mask)),
            overlap=e.overlap, whole_layers=e.whole_layers,
            row_elements=None if self.resident else row_elements,
            ordered_inputs=e.ordered_inputs and self.device.type == "cuda",
            ordered_rows=index_bytes is not None,
            own_in_sources=own_src, first_in_flushes=into_first, keep_graphs=self.graph_bytes > 0)
        split["executor_s"] = time.perf_counter() - t
        self.chunks = self.executor.chunks  # (on a GPU without the int64 host blocks)
        ex, rows = self.executor, []
        if self.device.type == "cuda" and not self.blocks_fit:
            rows.append(f"chunk blocks: copied to the device batch by batch (all of them, "
                        f"{format_size(self.block_bytes)}, do not fit beside the estimated "
                        f"{format_size(self.estimate)} within the budget)")
        if ex.whole_layers:
            rows.append("layers moving all their rows per pass (engine.whole_layers): "
                        + ", ".join(map(str, ex.whole_layers)))
        if ex.kept_on_device:
            rows.append("kept on the device from pass to pass in training (not moved): "
                        + ", ".join(ex.kept_on_device))
        if ex.own_rows_from_sources:
            rows.append("own rows taken from the chunks' sources (every vertex has a "
                        "self-loop), not copied: layers "
                        + ", ".join(map(str, ex.own_rows_from_sources)))
        if ex.kept_graphs:
            rows.append("update graphs kept from forward to backward (resident, no update run "
                        "again; their aggregates not stored): layers "
                        + ", ".join(map(str, ex.kept_graphs)))
        if ex.first_in_flushes:
            rows.append("first layer's backward run on layer 1's gradient flushes "
                        "(grad h^1 never goes to host memory)")
        if ex.backward_reversed:
            rows.append("layer 1's backward visits the batches last to first (the "
                        "aggregates of each batch's new rows come as one copy"
                        + ("; layer 1's aggregates of the last batch stay on the device"
                           if ex.keeps_last_aggregate else "") + ")")
        if ex.ordered_input_bytes:
            rows.append(f"first layer's inputs kept in load order (engine.ordered_inputs): "
                        f"{format_size(ex.ordered_input_bytes)} of pinned host memory")
        if ex.ordered_rows:
            names = [f"h^{m}" + (" (as the first layer's aggregates a^0)"
                                 if m == 1 and ex.rows_from_aggregates else "")
                     for m in ex.ordered_rows]
            rows.append("rows written in load order by the training forward pass "
                        "(engine.ordered_rows): " + ", ".join(names)
                        + f", {format_size(ex.ordered_row_bytes)} of pinned host memory")
        if e.tf32:
            rows.append("dense matrix products in TF32 (engine.tf32): faster, not exactly FP32 "
                        "training" if self.device.type == "cuda" else
                        f"engine.tf32 has no effect on {self.device.type} (TF32 is a GPU's)")
        if rows:
            self.out("\n".join(rows))
        self.optimizer = self._optimizer()
        # (the optimizer step issued behind backward where a copy of what it
        # changes, parameters and Adam's two moments, is small: run_epoch)
        self._step_ahead = step_ahead(sum(p.numel() * p.element_size()
                                          for p in self.model.parameters()))
        self.preprocess_s = time.perf_counter() - t0
        #: where setup went: loading, partitioning (parts, chunk count, chunks),
        #: planning (transfer plan + reorganiser), and the rest (renumbering,
        #: chunk blocks, buffers)
        self.setup_times = {"load_s": t_part - t0, "partition_s": partition_s,
                            "plan_s": self.plan_s}
        self.setup_times["other_s"] = self.preprocess_s - sum(self.setup_times.values())
        #: the parts of other_s: renumbering, chunk blocks, host buffers (allocation,
        #: pinning, features into h^0), executor (blocks and plan onto the device)
        self.other_split = split

    # ------------------------------------------------------------------ setup
    def _budget(self) -> int | None:
        dm = self.cfg.engine.device_memory
        budget = None if dm == "auto" else parse_size(dm)
        if self.device.type != "cuda":
            return budget
        free, total = torch.cuda.mem_get_info(self.device)
        if budget is None:  # (the least any GPU leaves: every process plans alike)
            budget = int(free * AUTO_BUDGET_FRACTION)
            return budget if self.comm is None else self.comm.min_int(budget)
        # (what this process's allocator holds unused is free to it too)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        check_device_budget(budget, free + cached, total, str(self.device))
        return budget

    def _resident(self, graph: Graph, assignment: np.ndarray, parts: int, plan: BufferPlan,
                  itemsize: int) -> tuple[bool, int | None, int | None]:
        """Should every buffer live on the device (HongTu-IM)?

        Yes when the buffers and the batches both fit the budget (``engine.resident:
        auto``), or when asked (``true``; a clear error when they do not fit).
        Returns ``(resident, budget left for batches, chunks or None)``.
        """
        e = self.cfg.engine
        if self.device.type != "cuda" and e.resident is True:
            raise UserError("engine.resident=true keeps the buffers in GPU memory, but "
                            f"this run's device is {self.device.type}; set "
                            "engine.resident=auto")
        cuda = self.device.type == "cuda"
        graphs = kept_graph_need(self.model, e.checkpoint, plan.num_nodes, itemsize, "cuda") \
            if cuda and self.world == 1 else 0  # (kept on one device only)
        choice = choose_resident(e.resident if cuda else False,
                                 self.budget, plan.resident_bytes(), e.chunks, graph,
                                 assignment, parts, self.model, itemsize,
                                 chunkings=self._chunkings, graphs_bytes=graphs,
                                 overlap=e.overlap, device=self.device.type,
                                 direct=self.world == 1, exchange=self.world > 1,
                                 cached=self.model.cached_layers(e.checkpoint))
        return agree_resident(self.comm, choice, self.budget)

    def _optimizer(self) -> torch.optim.Optimizer:
        t = self.cfg.train
        if t.weight_decay_layers == "first":
            first = list(self.model.layers[0].parameters())
            rest = [p for layer in self.model.layers[1:] for p in layer.parameters()]
            groups = [{"params": first, "weight_decay": t.weight_decay},
                      {"params": rest, "weight_decay": 0.0}]
            return torch.optim.Adam(groups, lr=t.lr)
        return torch.optim.Adam(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)

    def _plan_split_text(self) -> str:
        """Where planning went, besides the plan itself, where it is worth saying."""
        sets, waits = self.plan_split["sets_s"], self.plan_split["waits_s"]
        said = ([f"neighbour sets {sets:.2f} s"] if sets >= 0.005 else []) + \
            ([f"waiting for the other processes {waits:.2f} s"] if self.comm else [])
        return ", of which " + ", ".join(said) if said else ""

    def _plan_text(self, plan: BufferPlan, parts: int, chunks: int) -> str:
        budget = "none" if self.budget is None else format_size(self.budget)
        m = self.model
        layers = describe_layers([repr(x) for x in m.layers],
                                 m.cached_layers(self.checkpoint_mode),
                                 [m.transforms_first(l) for l in range(m.num_layers)])
        tp = self.transfer_plan
        n = max(tp.num_nodes, 1)
        where = ("device buffers (resident: everything fits the budget, nothing crosses the "
                 "host link)" if self.resident and self.blocks_fit else
                 "device buffers (resident: the buffers fit the budget; only the chunk blocks "
                 "cross the host link)" if self.resident else "host buffers")
        transfers = (f"transfers per layer pass (rows / |V|): V_ori {tp.v_ori / n:.3f}, "
                     f"V_+p2p {tp.v_p2p / n:.3f}, V_+ru {tp.v_ru / n:.3f}; this plan loads "
                     f"{self.loaded_rows / n:.3f} (reuse={tp.reuse}, p2p={tp.p2p}, "
                     f"reorg={self.cfg.engine.reorg}; planned in {self.plan_s:.2f} s"
                     f"{self._plan_split_text()})")
        if tp.cached_rows:
            transfers += (f"\nspare device memory keeps {tp.cached_rows} reused rows on the "
                          "device across batches (engine.dedup.cache)")
        if self.more_chunks is not None:
            transfers += "\n" + more_chunks_text(*self.more_chunks, chunks)
        return (f"graph {self.graph.name}: {self.graph.num_nodes} vertices, "
                f"{self.graph.num_edges} edges, {self.model.widths()[0]} features, "
                f"{self.num_classes} classes\n"
                f"model: {layers}\n"
                f"device {self.device}: {parts} part(s) x {chunks} chunk(s); "
                f"estimated peak {format_size(self.estimate)} per batch (budget {budget})\n"
                f"{transfers}\n"
                f"{where}:\n{plan.format()}")

    # ---------------------------------------------------------------- training
    def fit(self, metrics_path: str | None = None, progress: bool | None = None,
            resume: bool = False) -> list[dict]:
        """Train up to ``train.epochs`` epochs; returns the records of the epochs run.

        With ``resume`` the run continues from ``output.dir/checkpoint.pt``.
        SIGINT/SIGTERM finish the current epoch, write a checkpoint and raise
        :class:`Interrupted`; a second signal aborts at once.
        """
        cfg = self.cfg
        self.outdir.mkdir(parents=True, exist_ok=True)
        start = load_checkpoint(self.outdir, self.model, self.optimizer,
                                cfg.to_dict()) if resume else 0
        self.start_epoch = start  # (epochs the checkpoint had done)
        if resume:
            self.out(f"resuming after epoch {start} from {self.outdir / CHECKPOINT}")
        records = []
        every = cfg.output.checkpoint_every
        show = (sys.stderr.isatty() if progress is None else progress) and self.rank == 0
        if self.rank != 0:
            metrics_path = None  # rank 0 writes the run's files
        # With several processes the launcher owns the signals (it stops every rank).
        stop_ctx = _StopOnSignal() if self.world == 1 else contextlib.nullcontext(_NoSignal())
        with _metrics_file(metrics_path) as metrics, stop_ctx as stop:
            for epoch in range(start, cfg.train.epochs):
                rec = self.run_epoch(epoch, show)
                records.append(rec)
                self.out(_epoch_line(rec, cfg.train.epochs))
                if metrics:
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                done = epoch + 1
                if stop.signal is not None:
                    self._checkpoint(done)
                    raise Interrupted(f"stopped by {stop.signal} after epoch {done}; "
                                      f"checkpoint in {self.outdir / CHECKPOINT}; continue with "
                                      "hongtu train CONFIG --resume")
                if every and done % every == 0 and done < cfg.train.epochs:
                    self._checkpoint(done)
        if records:  # (a resumed run with its epochs done already rewrites nothing)
            self._checkpoint(cfg.train.epochs)
            self.save()
        return records

    def _checkpoint(self, epochs_done: int) -> None:
        if self.rank == 0:
            save_checkpoint(self.outdir, epochs_done, self.model, self.optimizer,
                            self.cfg.to_dict())

    @contextlib.contextmanager
    def matmul_precision(self):
        """The model's work in here runs its dense matrix products in TF32 where
        ``engine.tf32`` asks for it on a GPU (PyTorch's flag, restored after)."""
        if not (self.cfg.engine.tf32 and self.device.type == "cuda"):
            yield
            return
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    def run_epoch(self, epoch: int, progress: bool = False,
                  evaluate: bool | None = None) -> dict:
        """One optimizer step and (every ``eval_every`` epochs) an evaluation pass.

        ``evaluate`` forces the evaluation pass on or off (benchmarks time the
        training step alone).
        """
        with self.matmul_precision():
            return self._run_epoch(epoch, progress, evaluate)

    def _run_epoch(self, epoch: int, progress: bool, evaluate: bool | None) -> dict:
        ex = self.executor
        if evaluate is None:
            evaluate = (epoch + 1) % self.cfg.train.eval_every == 0 or (
                epoch + 1 == self.cfg.train.epochs)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=ex.batches_per_epoch(evaluate), desc=f"epoch {epoch}",
                       leave=False, unit="chunk", file=sys.stderr)
        tick = None
        if bar:
            moved = ex.mover.traffic

            def tick(k: int) -> None:
                bar.update(k)
                if bar.n % 8 == 0:  # keep the bar cheap: refresh the figure now and then
                    bar.set_postfix_str(f"rows h2d {moved.h2d_rows:,} d2h {moved.d2h_rows:,}",
                                        refresh=False)
        ex.mover.traffic.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        # Where the parameters and the optimizer's state are small, the optimizer
        # step is issued behind backward, before the loss is read, so the device
        # runs it at once; a non-finite loss or gradient then undoes it.
        undo: list = []

        def issue_step() -> None:
            undo.append(self._optimizer_snapshot())
            self.optimizer.step()

        res = ex.step(epoch, progress=tick,
                      after_backward=issue_step if self._step_ahead else None)
        try:
            self._check_finite(epoch, res.loss)
        except Diverged:
            if undo:
                self._optimizer_restore(undo[0])
            raise
        if not undo:
            self.optimizer.step()
        acc = ex.evaluate(epoch, progress=tick) if evaluate else None
        ex.mover.settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak, measured = torch.cuda.max_memory_allocated(self.device), True
        else:
            peak, measured = self.estimate, False
        dt = time.perf_counter() - t0
        if bar:
            bar.close()
        traffic = ex.mover.traffic.as_dict()
        per_rank = None
        if self.comm is not None:
            # Every rank's own traffic, and the run's totals in the usual keys.
            keys = sorted(traffic)
            t = torch.zeros((self.world, len(keys)), dtype=torch.float64, device=self.device)
            t[self.rank] = torch.tensor([float(traffic[k]) for k in keys], dtype=torch.float64)
            self.comm.all_reduce_(t)
            per_rank = [{k: (int(v) if k.endswith(("bytes", "rows")) else v)
                         for k, v in zip(keys, row)} for row in t.tolist()]
            traffic = {k: (max if k.startswith("time_") else sum)(r[k] for r in per_rank)
                       for k in keys}
            if measured:
                peak_t = torch.tensor([float(peak)], device=self.device)
                torch.distributed.all_reduce(peak_t, op=torch.distributed.ReduceOp.MAX)
                peak = int(peak_t.item())
        rec = {"epoch": epoch, "loss": res.loss,
               "train_acc": acc.accuracy("train") if acc else None,
               "val_acc": acc.accuracy("val") if acc else None,
               "test_acc": acc.accuracy("test") if acc else None,
               "epoch_s": dt, **traffic,
               "peak_device_bytes": int(peak), "peak_measured": measured}
        if per_rank is not None:
            rec["ranks"] = per_rank
        return rec

    def _optimizer_snapshot(self) -> tuple[list[Tensor], dict]:
        """Copies of the parameters and the optimizer's state (what a step changes)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
                 for p, st in self.optimizer.state.items()}
        return [p.detach().clone() for p in params], state

    def _optimizer_restore(self, snapshot: tuple[list[Tensor], dict]) -> None:
        """Parameters and optimizer state as :meth:`_optimizer_snapshot` copied them."""
        values, state = snapshot
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        self.optimizer.state.clear()
        self.optimizer.state.update(state)

    def _check_finite(self, epoch: int, loss: float) -> None:
        """Stop on a non-finite loss or gradient, naming the epoch and the layer."""
        where = f"epoch {epoch + 1}"
        if not np.isfinite(loss):
            raise Diverged(f"{where}: the loss is {loss}; training stopped before the "
                           "optimizer step (the last checkpoint is kept); lower train.lr or "
                           "check the input features")
        grads = [(l, layer, name, p.grad) for l, layer in enumerate(self.model.layers)
                 for name, p in layer.named_parameters() if p.grad is not None]
        # (one synchronisation for all of them; the culprit is looked for only on failure)
        if not grads or bool(torch.stack([torch.isfinite(g).all() for *_, g in grads]).all()):
            return
        for l, layer, name, g in grads:
            if not torch.isfinite(g).all():
                raise Diverged(f"{where}: layer {l} ({layer!r}) has a non-finite gradient "
                               f"in '{name}'; training stopped before the optimizer step "
                               "(the last checkpoint is kept); lower train.lr")

    def close(self) -> None:
        """Leave the process group (all ranks together) after a distributed run."""
        if self.comm is not None:
            self.comm.close()

    def save(self) -> Path:
        """Write the model (with the id permutation) to ``output.dir/model.pt`` atomically."""
        path = self.outdir / "model.pt"
        if self.rank != 0:
            return path
        atomic_torch_save({"state_dict": self.model.state_dict(), "config": self.cfg.to_dict(),
                           "perm": torch.from_numpy(self.partition.perm)}, path)
        return path


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint (exit code 130)."""


class Diverged(UserError):
    """A non-finite loss or gradient stopped training."""


class _NoSignal:
    signal = None


class _StopOnSignal:
    """Turn the first SIGINT/SIGTERM into a flag; a second one aborts at once."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        log.warning("%s: finishing the current epoch, then writing a checkpoint "
                    "(send it again to abort now)", self.signal)

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _metrics_file(path: str | None):
    if not path:
        yield None
        return
    with open(path, "a") as f:
        yield f


def _silent(_: str) -> None:
    pass


def _epoch_line(rec: dict, epochs: int) -> str:
    def acc(k):
        return "  -  " if rec[k] is None else f"{rec[k]:.4f}"

    return (f"epoch {rec['epoch'] + 1:>4}/{epochs}  loss {rec['loss']:.4f}  "
            f"train {acc('train_acc')}  val {acc('val_acc')}  test {acc('test_acc')}  "
            f"{rec['epoch_s']:.3f} s  h2d {format_size(rec['h2d_bytes'])}  "
            f"d2h {format_size(rec['d2h_bytes'])}  peak {format_size(rec['peak_device_bytes'])}"
            f"{'' if rec['peak_measured'] else ' (est.)'}")
