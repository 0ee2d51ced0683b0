r"""Moving rows between host buffers and the device, and counting every byte.

All host↔device traffic of the engine goes through one :class:`Mover`, so the
byte and row counters it keeps are the engine's real traffic. On CPU the
"device" is host memory too: the same calls copy between tensors, so the
algorithm and the counters are identical in both modes.

On a GPU, host buffers are pinned in place; neighbour rows are gathered by the
GPU straight from them through a device view (zero-copy, sorted ids),
contiguous ranges move by DMA, and gradients leaving the device are compacted
on the GPU, then either written by the GPU straight into pinned host memory (a
flush that reaches a row first in a pass, :meth:`Mover.write_rows`) or copied to pinned
staging and added into the host buffer by a parallel numba kernel on a worker
thread (ids of one flush are unique, so rows never collide).

**Overlap.** Work runs on four CUDA streams: host→device loads on one,
device→host stores and flushes on another, the widening of copied block
index arrays on a third, compute on the caller's current stream. The
executor asks for the next batch's rows (:meth:`Mover.fetch_rows`,
:meth:`Mover.fetch_range`) before it computes the current one, so they travel
while it computes; :meth:`Mover.take` makes compute wait for exactly the
copy it needs. Destination-row slots are double-buffered, and neighbour rows
of a step land in a staging area first and are moved into their slots of the
transition buffer by compute itself (in-place slot reuse would otherwise race
with the step still reading those slots). A load into memory compute used
waits for the compute issued before it; a block's copy, into memory of its
own, does not, and a pass's first loads wait only for the stores before
them (:meth:`Mover.barrier`). Events order everything; the batch
loop neither synchronises with the host nor allocates host memory; it waits
only when all pinned staging areas still hold flushes the CPU has not added.

**Resident buffers.** When the "host" buffers were allocated on the device
(resident mode, everything fits the budget) the same calls become device-local
copies and gradients are added on the device; nothing crosses the host link and
nothing is counted.

Device staging areas are allocated once (sized by the largest chunk and the
largest step load) and handed out as views.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import queue
import threading
import time
import weakref
from dataclasses import dataclass, fields

import numba
import numpy as np
import torch
from torch import Tensor

from hongtu.engine.pinned import device_view, is_device_view, pinned_copies, pinned_tensor

__all__ = ["IndexRing", "Mover", "Ticket", "Traffic", "add_rows", "block_copy_bytes",
           "copy_rows"]


@numba.njit(parallel=True, cache=True, nogil=True)
def _scatter_add_rows(host, ids, vals):
    for i in numba.prange(ids.shape[0]):
        r = ids[i]
        for k in range(vals.shape[1]):
            host[r, k] += vals[i, k]


@dataclass
class Traffic:
    """Bytes and rows moved in one epoch, by direction, and where the time went.

    Times are per stream: with overlap they add up to more than the epoch.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    h2d_rows: int = 0
    d2h_rows: int = 0
    d2d_rows: int = 0
    time_h2d_s: float = 0.0
    time_d2h_s: float = 0.0
    time_d2d_s: float = 0.0
    time_cpu_s: float = 0.0
    time_compute_s: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(0))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Ticket:
    """Rows on their way to the device: :meth:`Mover.take` or :meth:`Mover.place` them.

    Attributes:
        value: the rows (a device staging view; valid once ``ready`` has passed).
        ready: the event the copy records (``None``: ready already).
        slots, buf: for neighbour rows, where they go in the transition buffer
            (``None`` once they are there).
        ring: ``(IndexRing, slot)`` holding ``slots`` (and what the copy read),
            its slot free once :meth:`Mover.place` put the rows.
    """

    value: Tensor | None
    ready: object = None
    slots: Tensor | None = None
    buf: Tensor | None = None
    ring: tuple | None = None
    #: device memory the copy wrote on its way (a block's int32 arrays before
    #: they were widened), kept until the ticket is taken
    keep: list | None = None


#: Grids ``(programs, rows per program and loop iteration)`` of the row-copy
#: kernel (:mod:`hongtu.engine._triton_rows`) when it reads (loads) or writes
#: (stores) pinned host rows of :data:`WIDE_ROW_BYTES` or more; ``None`` and
#: all other copies: half a program per SM of 4 rows; ``ROW_KERNEL = False``
#: uses torch's index ops. ``bench/bench_rows.py`` on an H200, rows of 1 KB,
#: beside a 100K×256×256 GEMM and a cuSPARSE product (their time against
#: alone): stores at 2 programs of 64 rows 51.5 GB/s, ×1.20 and ×1.05, against
#: 52.2 GB/s, ×3.25 and ×3.89 at half a program per SM, and DMA loads beside
#: them kept 45 against 31 GB/s (GCN 3×256 epochs 0.398 against 0.415 s on
#: products-like, 0.631 against 0.655 s on R-MAT 2^22). Narrower stores lose
#: rate on 2 programs (47 wide: 20 against 34 GB/s) and stay as they were.
#: Loads at 8 programs of 64 rows left the GEMM ×1.25 against ×1.74 (51 GB/s
#: either way), but products-like GCN 2×256's second-layer passes took longer
#: with them in both runs beside the wider grid (forward L1 11.5 and 13.0
#: against 10.3 ms, backward L1 13.1 and 11.8 against 9.8), so loads keep it.
ROW_KERNEL = True
ROW_LOADS: tuple[int, int] | None = None
ROW_STORES: tuple[int, int] | None = (2, 64)
WIDE_ROW_BYTES = 1024
#: Grid of :meth:`Mover.gather_rows`' zero-copy gathers, whatever the row width:
#: the first layer's aggregates (400 B rows on products-like) gathered beside
#: layer 1's backward, whose products the default grid slowed. On an H200,
#: products-like GCN 3×256, that pass took 102-103 ms against 108.6-109.5 ms
#: (epochs 0.271-0.274 against 0.278-0.280 s, four processes each; 16 programs
#: 108.5 ms, 4 or 32 slower), the gathers as fast (72-73 ms beside the pass).
GATHER_LOADS: tuple[int, int] | None = (8, 64)


@functools.cache
def engine_kernels(kind: str):
    """The Triton kernels module ``hongtu.engine._triton_<kind>`` (``rows``:
    :mod:`hongtu.engine._triton_rows`, ``loss``: :mod:`hongtu.engine._triton_loss`)
    when Triton is importable (GPU machines), else ``None``."""
    try:
        return importlib.import_module(f"hongtu.engine._triton_{kind}")
    except ImportError:
        return None


def _columns(buf: Tensor, width: int) -> Tensor:
    """``buf``'s first ``width`` columns (``buf`` itself at its width)."""
    return buf if int(buf.shape[1]) == width else buf[:, :width]


def copy_rows(src: Tensor, dst: Tensor, src_ids: Tensor | None = None,
              dst_ids: Tensor | None = None, grid: tuple[int, int] | str | None = "auto"
              ) -> None:
    """``dst[dst_ids] = src[src_ids]`` on the current stream (``None``: rows in order).

    On a GPU one kernel on a bounded grid (few programs, :data:`ROW_LOADS` /
    :data:`ROW_STORES`, for wide rows with a side a zero-copy view of pinned
    host memory), so zero-copy reads and writes of host rows leave compute
    its SMs and the link room for copies going the other way; elsewhere
    torch's index ops. ``grid``: the kernel's grid instead of that choice.
    """
    kernels = engine_kernels("rows") if dst.is_cuda and ROW_KERNEL else None
    if kernels is not None:
        if grid == "auto":
            grid = None
            if dst.shape[1] * dst.element_size() >= WIDE_ROW_BYTES:
                grid = ROW_STORES if is_device_view(dst) else ROW_LOADS if is_device_view(src) \
                    else None
        kernels.copy_rows_triton(src, dst, src_ids, dst_ids, grid)
        return
    rows = src if src_ids is None else src.index_select(0, src_ids)
    if dst_ids is None:
        dst[: rows.shape[0]].copy_(rows)
    else:
        dst.index_copy_(0, dst_ids, rows)


def add_rows(dst: Tensor, ids: Tensor, src: Tensor) -> None:
    """``dst[ids] += src`` for unique ``ids`` (a chunk's source slots).

    On a GPU one kernel that reads, adds and writes each row (no atomics:
    the ids are unique); elsewhere ``index_add_``.
    """
    kernels = engine_kernels("rows") if dst.is_cuda and src.dim() == 2 else None
    if kernels is not None:
        kernels.add_rows_triton(dst, ids, src.contiguous())
    else:
        dst.index_add_(0, ids, src)


#: Block tensors in the order :func:`pin_blocks` lays them out: each pass's
#: index arrays are one run (forward without the transpose: ``indices`` ..
#: ``src_ids``; a cached layer's backward: ``indptr`` .. ``t_indices``; all),
#: and so are the degrees.
BLOCK_LAYOUT = ("indices", "indptr", "src_ids", "t_indptr", "t_indices", "t_perm",
                "src_in_deg", "dst_in_deg")


def narrow_index(t: Tensor) -> Tensor:
    """An int64 index array as int32 when its values fit (widened again on the device)."""
    if t.dtype != torch.int64 or t.numel() == 0:
        return t
    return t.to(torch.int32) if int(t.max()) < 2**31 and int(t.min()) >= 0 else t


def pin_blocks(blocks: list, narrow=narrow_index, copies=pinned_copies,
               in_place: bool = False) -> list:
    """Pinned copies of the blocks (``None`` kept), every tensor passed through
    ``narrow`` first (default :func:`narrow_index`), each block in a slab of
    its own (``copies``: :func:`~hongtu.engine.pinned.pinned_copies`) with its
    tensors side by side in :data:`BLOCK_LAYOUT` order, so that
    :meth:`Mover.fetch_block` moves a pass's arrays in one or two copies.

    Block by block, so that host memory holds one block's narrowed arrays
    beside the blocks at a time; with ``in_place``, ``blocks[i]`` is replaced
    by its copy as soon as it is made (the list returned is ``blocks``), and a
    block the caller holds nowhere else is freed before the next is copied."""
    out = blocks if in_place else list(blocks)
    for i, b in enumerate(blocks):
        if b is None:
            continue
        names = ([n for n in BLOCK_LAYOUT if isinstance(getattr(b, n), Tensor)]
                 + [t for t in b.tensor_names() if t not in BLOCK_LAYOUT])
        out[i] = b.replace_tensors(dict(zip(names, copies([narrow(getattr(b, n))
                                                           for n in names]))))
    return out


# Tensors of one dtype at most this many bytes apart in one slab travel as one
# copy (pinned_copies aligns each tensor to 128 bytes).
_RUN_GAP = 128


def _block_runs(block, skip: tuple[str, ...]) -> list[tuple[Tensor, list[tuple[str, int, int]]]]:
    """What :meth:`Mover.fetch_block` copies for ``block`` without ``skip``: host
    spans, each one run of same-dtype 1-D tensors side by side in one storage
    (in byte order), with every tensor's ``(name, start, stop)`` in its span.
    Empty tensors are in no run: nothing of them travels."""
    items = sorted(((getattr(block, n), n) for n in block.tensor_names()
                    if n not in skip and getattr(block, n).numel()),
                   key=lambda x: (x[0].untyped_storage().data_ptr(),
                                  x[0].storage_offset() * x[0].element_size()))
    runs: list[list] = []
    for t, n in items:
        if runs:
            last = runs[-1][-1][0]
            gap = (t.storage_offset() - last.storage_offset() - last.numel()) * t.element_size()
            if (t.dtype == last.dtype and t.dim() == last.dim() == 1
                    and t.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
                    and 0 <= gap <= _RUN_GAP):
                runs[-1].append((t, n))
                continue
        runs.append([(t, n)])
    out = []
    for run in runs:
        first, last = run[0][0], run[-1][0]
        if len(run) == 1:
            out.append((first, [(run[0][1], None, None)]))
            continue
        lo = first.storage_offset()
        span = first.as_strided((last.storage_offset() + last.numel() - lo,), (1,), lo)
        out.append((span, [(n, t.storage_offset() - lo, t.storage_offset() - lo + t.numel())
                           for t, n in run]))
    return out


def _block_arrays(num_src: int, num_dst: int, num_edges: int, num_nodes: int, itemsize: int,
                  narrow: bool = True) -> list[tuple[str, int, int, str]]:
    """``(name, elements, element size, kind)`` of a block's arrays of these sizes in
    :data:`BLOCK_LAYOUT` order: index arrays narrowed to int32 where their values
    fit (``narrow``, as :func:`narrow_index`; values are local positions and
    edge counts, global ids for ``src_ids``; an empty array stays int64),
    degrees ``itemsize`` wide."""
    numel = {"indices": num_edges, "indptr": num_dst + 1, "src_ids": num_src,
             "t_indptr": num_src + 1, "t_indices": num_edges, "t_perm": num_edges,
             "src_in_deg": num_src, "dst_in_deg": num_dst}
    out = []
    for name in BLOCK_LAYOUT:
        if name.endswith("_deg"):
            out.append((name, numel[name], itemsize, "float"))
            continue
        fits = narrow and (num_nodes if name == "src_ids" else num_edges) < 2**31 \
            and numel[name]
        out.append((name, numel[name], 4 if fits else 8, "int"))
    return out


def block_host_bytes(num_src: int, num_dst: int, num_edges: int, num_nodes: int,
                     itemsize: int = 4, narrow: bool = True) -> int:
    """Bytes of a block's arrays in host memory: narrowed as :func:`pin_blocks` keeps
    them for a GPU (``narrow``), or int64 as built (a CPU run computes with those)."""
    return sum(k * size for _, k, size, _ in _block_arrays(num_src, num_dst, num_edges,
                                                             num_nodes, itemsize, narrow))


def block_copy_bytes(num_src: int, num_dst: int, num_edges: int, skip: tuple[str, ...] = (),
                     num_nodes: int = 0, itemsize: int = 4) -> int:
    """Host bytes :meth:`Mover.fetch_block` moves for a block of these sizes without
    ``skip``, laid out as :func:`pin_blocks` lays out the executor's blocks (index
    arrays narrowed to int32 where their values fit, as :func:`narrow_index`
    does; degrees ``itemsize`` wide; ``num_nodes``: the global ids' range), and
    copied as :func:`_block_runs` groups them: what ``hongtu report`` counts
    for a chunk's block without building it."""
    layout, at = [], 0
    for name, k, size, kind in _block_arrays(num_src, num_dst, num_edges, num_nodes, itemsize):
        layout.append((name, at, k * size, (kind, size)))
        at += -(-k * size // 128) * 128
    total, run = 0, None  # run: (start, end, kind) in bytes
    for name, start, nbytes, kind in layout:
        if name in skip or not nbytes:
            continue
        if run is not None and kind == run[2] and 0 <= start - run[1] <= _RUN_GAP:
            run = (run[0], start + nbytes, kind)
            continue
        total += 0 if run is None else run[1] - run[0]
        run = (start, start + nbytes, kind)
    return total + (0 if run is None else run[1] - run[0])


class Mover:
    """Host↔device row transfers with counters.

    Args:
        device: the compute device.
        slots: destination-row slot name -> ``(rows, width)``: the most rows it
            must hold and their widest row (elements).
        max_width: the widest row (elements).
        dtype: element type of the buffers.
        timed: attribute time to transfers and compute. On a GPU each piece of
            work is bracketed by CUDA events on its stream (no synchronisation
            in the batch loop); :meth:`settle` reads them once per epoch.
        flush_elements: the most elements one gradient flush moves, which sizes
            the pinned staging areas (the executor's exact figure,
            :func:`~hongtu.engine.executor.flush_staging_elements`); a larger
            flush grows them (``staging_grown`` counts it). ``None``: the most
            rows of a slot at the widest row.
        load_rows: the most neighbour rows a step after the first loads (the
            device staging area that lets them travel during the previous step).
        overlap: run transfers on their own streams, one batch ahead; otherwise
            everything runs on the current stream in program order.
        stage: device memory for the staging area of neighbour rows (at least
            ``load_rows * max_width`` elements; allocated here when ``None``).
    """

    def __init__(self, device: torch.device, slots: dict[str, tuple[int, int]], max_width: int,
                 dtype: torch.dtype, timed: bool = True, load_rows: int = 0,
                 overlap: bool = True, stage: Tensor | None = None,
                 flush_elements: int | None = None) -> None:
        self.device = device
        self.dtype = dtype
        self.traffic = Traffic()
        self.cuda = device.type == "cuda"
        self.timed = timed
        self.overlap = overlap and self.cuda
        w = int(max_width)
        ring = 2 if self.overlap else 1
        self._dev = {s: [torch.empty(max(int(r) * int(sw), 1), dtype=dtype, device=device)
                         for _ in range(ring)] for s, (r, sw) in slots.items()}
        self._turn = dict.fromkeys(slots, 0)
        if not self.overlap:
            self._rows_stage = None
        elif stage is None:
            self._rows_stage = torch.empty(max(int(load_rows) * w, 1), dtype=dtype, device=device)
        else:
            if stage.numel() < int(load_rows) * w:
                raise ValueError(f"stage holds {stage.numel()} elements; "
                                 f"{int(load_rows)} rows of {w} need more")
            self._rows_stage = stage
        # Pinned staging areas for gradient flushes: they receive flushes by DMA
        # while a worker thread adds earlier ones into host memory.
        stage = (max(max(r for r, _ in slots.values()), 1) * w
                 if flush_elements is None else int(flush_elements))
        self._stages = ([pinned_tensor((stage,), dtype) for _ in range(_STAGES)]
                        if self.cuda and stage > 0 else [])  # (flush_staging_bytes)
        #: times a flush (or a gather from unpinned memory) found the staging areas
        #: too small, and the most elements one of them staged
        self.staging_grown = self.staged_most = 0
        self._flip = 0
        self._adder = _Adder(self.traffic) if self.cuda else None
        if self._adder is not None:
            weakref.finalize(self, self._adder.stop)
        self._views: dict[tuple, Tensor | None] = {}
        self._events: list = []
        self._spare: list = []  # timing events read by fold, to record again
        #: set to ``[]`` to record, at the next :meth:`settle`, every timed piece of
        #: work as ``(field, start ms, end ms)`` from the first (GPU only); layer
        #: passes start at ``("pass", t, t)`` entries (:meth:`barrier`)
        self.timeline: list | None = None
        #: with :attr:`timeline`, the traffic counters ``(h2d bytes, d2h bytes)`` at
        #: each pass start
        self.pass_bytes: list = []
        self.compute = self.s_in = self.s_out = self.s_widen = self.s_gather = None
        self._marks: dict = {}  # per stream: the event _follow records on it
        # the stores issued before this pass (barrier), which loads of rows
        # and ranges wait for; whether the load stream waits already; any
        # store issued since (join)
        self._stores_before = None
        self._saw_stores = False
        self._stored = False
        # Tensors compute made whose stores still read them: (batch, tensor,
        # the store's event), given back in stream order (step)
        self._held: collections.deque = collections.deque()
        self._batch = 0
        if self.cuda:
            # work is issued on this stream but where the mover selects another (_on)
            self.compute = torch.cuda.current_stream(device)
            self.s_in = torch.cuda.Stream(device) if self.overlap else self.compute
            self.s_out = torch.cuda.Stream(device) if self.overlap else self.compute
            # index arrays of blocks are widened to int64 here (fetch_block)
            self.s_widen = torch.cuda.Stream(device) if self.overlap else self.compute
            # zero-copy gathers beside the load stream's copies (gather_rows)
            self.s_gather = torch.cuda.Stream(device) if self.overlap else self.compute
        self._current = self.compute  # the stream _on selected last
        self._runs: dict = {}  # per (block, skip): what fetch_block copies
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------- plumbing
    def _view(self, host: Tensor) -> Tensor | None:
        """What the device reads ``host`` through: itself on CPU or when it is on
        the device, its zero-copy device view when pinned, else ``None``."""
        if not self.cuda or host.device.type == "cuda":
            return host
        key = (host.data_ptr(), tuple(host.shape))  # (a slice may start where its base does)
        if key not in self._views:
            self._views[key] = device_view(host, self.device) if host.is_pinned() else None
        return self._views[key]

    def forward_spare(self, sizes: list[int]) -> list[list[Tensor]] | None:
        """Device memory forward passes leave unused, as int64 arrays of
        ``sizes`` elements, two of each (one per slot of the gradient ring,
        which only backward passes fill); ``None`` where they do not fit.
        Whoever writes them there must not let a backward pass's load of
        ``∇h^{l+1}`` overtake its last read (loads wait for compute issued
        before them, and a pass's first for the stores before it)."""
        ring = self._dev.get("grad")
        if not self.overlap or not ring:
            return None
        out = [[], []]
        for buf in ring:
            if buf.element_size() not in (4, 8):
                return None
            words = buf[: buf.numel() - buf.numel() % (8 // buf.element_size())]
            words = words.view(torch.int64)
            if words.numel() < sum(sizes):
                return None
            at = 0
            for k, n in enumerate(sizes):
                out[k].append(words[at:at + n])
                at += n
        return out

    def _count(self, host: Tensor, direction: str, rows: int, width: int) -> None:
        """Count rows crossing the host link (nothing when ``host`` lives on the device)."""
        if self.cuda and host.device.type == "cuda":
            return
        t = self.traffic
        setattr(t, f"{direction}_rows", getattr(t, f"{direction}_rows") + rows)
        nbytes = rows * width * self.itemsize
        setattr(t, f"{direction}_bytes", getattr(t, f"{direction}_bytes") + nbytes)

    @contextlib.contextmanager
    def _on(self, stream, after_compute: bool = True):
        """Run the enclosed work on ``stream`` (after what compute has issued so far,
        unless not ``after_compute``: work that writes only memory it allocates)."""
        if not self.cuda or stream is self.compute:
            yield
            return
        if after_compute:
            self._follow(stream, self.compute)
        self._stored = self._stored or stream is self.s_out
        prev, self._current = self._current, stream
        torch.cuda.set_stream(stream)  # (a tenth of torch.cuda.stream's host time)
        try:
            yield
        finally:
            torch.cuda.set_stream(prev)
            self._current = prev

    def _follow(self, stream, other) -> None:
        """Work issued on ``stream`` from now on waits for what ``other`` has so far
        (``stream.wait_stream(other)`` with one event per stream, recorded again
        each time: a wait holds the record current when it was issued)."""
        mark = self._marks.get(id(other))
        if mark is None:
            mark = self._marks[id(other)] = torch.cuda.Event()
        mark.record(other)
        stream.wait_event(mark)

    @contextlib.contextmanager
    def timing(self, field: str, stream=None):
        """Add the time of the enclosed work to ``traffic.<field>``."""
        if not self.timed:
            yield
        elif self.cuda:
            stream = self.compute if stream is None else stream
            start, end = self._timer(), self._timer()
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((field, start, end))
        else:
            t0 = time.perf_counter()
            yield
            setattr(self.traffic, field, getattr(self.traffic, field) + time.perf_counter() - t0)

    def _timer(self):
        """A timing event: one :meth:`fold` has read, else a new one."""
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def _ready_event(self, stream):
        if not self.cuda or stream is self.compute:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def barrier(self) -> None:
        """Loads of rows and ranges issued from now on see every store issued so far.

        Call at the start of a layer pass: it reads what the passes before
        wrote. The load stream waits for those stores at the first such load
        (:meth:`_loading`); copies of what no store writes (blocks, index
        arrays) do not wait, so a pass that begins with them starts while the
        stores of the pass before, which did not wait for them
        (:meth:`join`), still go. (A load into device memory that compute used
        waits for the compute issued before it, :meth:`_on`, and so does a
        block's copy, into memory compute may have freed, :meth:`fetch_block`:
        issued at a pass's last batch, the next pass's first block travels
        while that batch computes.)
        """
        if self.overlap:
            self._stores_before = self._ready_event(self.s_out)
            self._saw_stores = False
            self._stored = False
        if self.timeline is not None and self.cuda:
            mark = self._timer()
            mark.record(self.compute)
            self._events.append(("pass", mark, mark))
            self.pass_bytes.append((self.traffic.h2d_bytes, self.traffic.d2h_bytes))

    def join(self, loads_until=None, stores: bool = True) -> None:
        """Compute waits for every transfer issued so far (the end of a pass); for
        loads, with ``loads_until`` (a :meth:`load_mark`), only for those issued
        before it (later ones are the next pass's, which takes each as it
        needs it). Without ``stores``, not for stores: where each read memory
        of its own (a tensor compute made for it, held until compute waits
        for the store, :meth:`_keep`), the next pass computes while
        they go, and its loads of rows see them (:meth:`barrier`)."""
        if self.overlap:
            if loads_until is None:
                self._follow(self.compute, self.s_in)
            else:
                self.compute.wait_event(loads_until)
            if stores:
                self._follow(self.compute, self.s_out)
                self._release(wait=False)  # (compute waits for them all now)

    @property
    def stored_in_pass(self) -> bool:
        """Whether work went to the store stream since the pass began (:meth:`barrier`)."""
        return self._stored

    @contextlib.contextmanager
    def _loading(self):
        """Issue the enclosed load of rows or a range on the load stream, timed:
        after the compute issued so far (:meth:`_on`) and after the stores
        issued before the pass (:meth:`barrier`), which may have written what
        it reads (the load stream waits for those once a pass)."""
        if self._stores_before is not None and not self._saw_stores:
            self.s_in.wait_event(self._stores_before)
            self._saw_stores = True
        with self._on(self.s_in), self.timing("time_h2d_s", self.s_in):
            yield

    def step(self) -> None:
        """A batch begins: the tensors that the stores of the batch before the
        last read are given back to the allocator (:meth:`_keep`), compute
        waiting for those stores first (on the device; this thread does not
        wait)."""
        self._batch += 1
        self._release(self._batch - HOLD_BATCHES + 1)

    def _release(self, before: int | None = None, wait: bool = True,
                 most: int | None = None) -> None:
        """Give back the held tensors of batches before ``before`` (all: ``None``;
        the ``most`` oldest at most), compute waiting first for the last of
        their stores (the store stream runs in order), unless not ``wait`` (it
        waits for them already)."""
        n, last = 0, None
        for batch, _, event in self._held:
            if (before is not None and batch >= before) or (most is not None and n >= most):
                break
            n, last = n + 1, event
        if not n:
            return
        if wait:
            self.compute.wait_event(last)
        for _ in range(n):  # (after the wait: what compute allocates next comes after it)
            self._held.popleft()

    def load_mark(self):
        """An event after the loads issued so far (for :meth:`join`), or ``None``."""
        return self._ready_event(self.s_in) if self.overlap else None

    def settle(self) -> None:
        """Finish pending flushes, wait for the device, fold event times into ``traffic``.

        It waits for every stream of the mover, not only compute: work that the
        next pass takes when it needs it (the next forward's first rows,
        :meth:`fetch_ahead`) may still go on the gather's stream, and its times
        can be read only once it is done."""
        self.drain()
        if self.cuda:
            self.join()
            for stream in (self.compute, self.s_in, self.s_out, self.s_widen, self.s_gather):
                stream.synchronize()
        self._held.clear()
        if self.timeline is not None and self._events:
            base = self._events[0][1]
            self.timeline = [(f, base.elapsed_time(a), base.elapsed_time(b))
                             for f, a, b in self._events]
        self.fold()

    def fold(self, done_only: bool = False) -> None:
        """Add the times of timed work into ``traffic``: all of it (after a
        synchronisation, :meth:`settle`) or, with ``done_only``, what the device
        has finished, while this thread would otherwise wait for it (reading
        the ~250 pairs of a products-like epoch took 2.5 ms after its last
        kernel under the profiler).
        With a :attr:`timeline` recording, :meth:`settle` reads them all."""
        if done_only and self.timeline is not None:
            return
        left = []
        for item in self._events:
            field, start, end = item
            if done_only and not end.query():
                left.append(item)
            else:
                if field != "pass":
                    setattr(self.traffic, field,
                            getattr(self.traffic, field) + start.elapsed_time(end) / 1000.0)
                self._spare.extend((start,) if start is end else (start, end))
        self._events = left

    # ----------------------------------------------------------- host -> dev
    def fetch_rows(self, host: Tensor, ids: Tensor, slots: Tensor, buf: Tensor,
                   direct: bool = False) -> Ticket:
        """Start ``buf[slots] = host[ids]``; finish it with :meth:`place`.

        ``ids`` (sorted) and ``slots`` are int64 tensors on the device. Rows go
        to the staging area, unless ``direct`` (nothing in ``buf`` is in use:
        the first step of a pass) or there is no overlap.
        """
        rows, width = int(ids.shape[0]), int(host.shape[1])
        if rows == 0:
            return Ticket(None)
        self._count(host, "h2d", rows, width)
        view = self._view(host)
        if view is None:  # unpinned host memory: gather on the CPU, then one copy
            self.drain()  # the staging areas may still hold a flush
            stage = self._stage(0, rows * width).view(rows, width)
            with self.timing("time_h2d_s"):
                torch.index_select(host, 0, ids.cpu(), out=stage)
                buf.index_copy_(0, slots, stage.to(self.device, non_blocking=True))
                self.compute.synchronize()
            return Ticket(None)
        if not self.overlap or direct:
            with self._loading():
                copy_rows(view, buf, ids, slots)
            return Ticket(None, self._ready_event(self.s_in))
        out = self._rows_stage[: rows * width].view(rows, width)
        with self._loading():
            copy_rows(view, out, ids)
        return Ticket(out, self._ready_event(self.s_in), slots, buf)

    def fetch_run(self, host: Tensor, start: int, stop: int, slots: Tensor | None,
                  buf: Tensor, direct: bool = False, at: int = 0, ids: Tensor | None = None,
                  ring: tuple | None = None) -> Ticket:
        """Start ``buf[slots] = host[start:stop]`` (then ``host[ids]``, with ``ids``):
        rows stored in the order they load, so one contiguous copy (DMA) brings
        them, and rows loaded again, gathered after them (zero-copy on a GPU);
        finish it with :meth:`place`.

        With overlap they land in the staging area, unless ``direct`` (nothing in
        those rows of ``buf`` is in use: the first step of a pass; no ``ids``) and
        ``slots`` are ``at .. at+n-1`` (the caller's promise), when they land in
        ``buf`` itself. Without overlap on a GPU there is no staging area:
        ``direct`` only. ``ids`` and ``slots`` are int64 tensors on the device
        (``ring``: the :class:`IndexRing` slot holding them, freed by :meth:`place`).
        Rows narrower than ``buf``'s land in its first columns (the caller
        makes the rest: ``Executor``, the first layer's aggregates).
        """
        k, width = stop - start, int(host.shape[1])
        rows = k + (0 if ids is None else int(ids.shape[0]))
        if rows == 0:
            return Ticket(None)
        self._count(host, "h2d", rows, width)
        src = host[start:stop]
        if not self.cuda or host.device.type == "cuda":
            if ids is not None:
                src = torch.cat([src, host.index_select(0, ids)])
            if slots is None:
                _columns(buf, width)[at:at + rows].copy_(src)
            else:
                _columns(buf, width).index_copy_(0, slots, src)
            return Ticket(None)
        if direct and ids is None:
            with self._loading():
                _columns(buf, width)[at:at + rows].copy_(src, non_blocking=True)
            return Ticket(None, self._ready_event(self.s_in))
        if not self.overlap:
            raise ValueError("fetch_run without overlap lands a run directly only "
                             "(direct=True, no ids)")
        out = self._rows_stage[: rows * width].view(rows, width)
        with self._loading():
            out[:k].copy_(src, non_blocking=True)
            if ids is not None:
                copy_rows(self._view(host), out[k:], ids)
        return Ticket(out, self._ready_event(self.s_in), slots, buf, ring)

    def fetch_ahead(self, host: Tensor, start: int, stop: int, buf: Tensor, at: int,
                    first: bool) -> Ticket:
        """Start ``buf[at:at+n] = host[start:stop]`` (rows for a later pass, from
        host memory no store writes), in one copy; finish it with :meth:`place`.
        On a GPU with overlap on the gather's stream, beside the pass's own
        loads, which it never holds up: the ``first`` piece after the compute
        issued so far (``buf``'s rows may still be read), the others after it."""
        rows, width = stop - start, int(host.shape[1])
        if rows == 0:
            return Ticket(None)
        self._count(host, "h2d", rows, width)
        out = _columns(buf, width)[at:at + rows]
        if not self.overlap:
            out.copy_(host[start:stop])
            return Ticket(None)
        with self._on(self.s_gather, after_compute=first), \
                self.timing("time_h2d_s", self.s_gather):
            out.copy_(host[start:stop], non_blocking=True)
        return Ticket(None, self._ready_event(self.s_gather))

    def take_early(self, src: Tensor, dst: Tensor, rows: int) -> Ticket:
        """``dst[:rows] = src[:rows]`` on the device, rows compute wrote there
        during an earlier pass (on the load stream, after compute issued so
        far); finish it with :meth:`place`."""
        if not self.cuda:
            dst[:rows].copy_(src[:rows])
            return Ticket(None)
        with self._on(self.s_in):
            dst[:rows].copy_(src[:rows], non_blocking=True)
        return Ticket(None, self._ready_event(self.s_in))

    def place(self, t: Ticket, put=None) -> bool:
        """Wait for a :meth:`fetch_rows` (:meth:`fetch_run`) and put its rows into their
        slots (on compute). Returns whether they came through the staging area
        and were put now: by ``put(rows, buf, slots)`` when given, else copied.
        Otherwise they landed in their slots directly."""
        self._wait(t)
        if t.buf is None:
            return False
        if put is None:
            _columns(t.buf, int(t.value.shape[1])).index_copy_(0, t.slots, t.value)
        else:
            put(t.value, t.buf, t.slots)
        if t.ring is not None:
            ring, k = t.ring
            ring.release(k, self.compute)
        return True

    def gather_rows(self, host: Tensor, ids: Tensor, out: Tensor, free=None,
                    at: Tensor | None = None, run: tuple[int, int] = (0, 0)) -> Ticket:
        """Start ``out[:len(ids)] = host[ids]`` (``ids``: int64 on the device; with
        ``at``, a device array of each row's position in ``host``: ``host[at[ids]]``);
        :meth:`take` gives the rows. On a GPU with overlap a zero-copy gather
        from pinned host memory on a stream of its own, beside the load
        stream's copies (DMA, which the gather kernel would otherwise wait
        behind), after the stores issued so far and after ``free`` (an event
        compute recorded once done with ``out``; ``None``: it never read it);
        elsewhere at once. With ``run = (start, stop)``, rows ``host[start:stop]``
        come first, as one copy (DMA), and the gathered rows after them: both on
        the gather's stream, whose waits for ``free`` hold up no load of the
        load stream."""
        r = run[1] - run[0]
        n = r + int(ids.shape[0])
        self._count(host, "h2d", n, int(host.shape[1]))
        dst, view = out[:n], self._view(host)

        def where() -> Tensor:  # (on the stream that gathers)
            return ids if at is None else at.index_select(0, ids).long()

        if view is None:  # unpinned host memory: gathered on the CPU, then one copy
            dst[:r].copy_(host[run[0]:run[1]])
            dst[r:].copy_(host.index_select(0, where().cpu()))
            return Ticket(dst)
        if not self.overlap or view is host:
            with self.timing("time_h2d_s"):
                dst[:r].copy_(view[run[0]:run[1]])
                copy_rows(view, dst[r:], where())
            return Ticket(dst)
        with self._on(self.s_gather, after_compute=False):
            self._follow(self.s_gather, self.s_out)
            if free is not None:
                self.s_gather.wait_event(free)
            with self.timing("time_h2d_s", self.s_gather):  # (timed after the waits)
                if r:
                    dst[:r].copy_(host[run[0]:run[1]], non_blocking=True)
                copy_rows(view, dst[r:], where(), grid=GATHER_LOADS)
        return Ticket(dst, self._ready_event(self.s_gather))

    def fetch_range(self, host: Tensor, start: int, stop: int, slot: str) -> Ticket:
        """Start copying ``host[start:stop]`` to the device; :meth:`take` gives it.

        On the device the rows are a view of ``host`` itself (no copy). Slots
        are double-buffered: a slot is refilled only after compute finished
        with what it held two fetches ago.
        """
        rows, width = stop - start, int(host.shape[1])
        if self.cuda and host.device.type == "cuda":
            return Ticket(host[start:stop])
        self._count(host, "h2d", rows, width)
        out = self._next_slot(slot, rows, width)
        with self._loading():
            out.copy_(host[start:stop], non_blocking=True)
        return Ticket(out, self._ready_event(self.s_in))

    def keep_range(self, value: Tensor, slot: str) -> Ticket:
        """Put ``value`` (rows compute made) where the next :meth:`fetch_range`
        into ``slot`` would land them, instead of storing them and fetching
        them back (on compute; no link traffic); :meth:`take` gives them. The
        caller fetches nothing into ``slot`` before it takes them."""
        out = self._next_slot(slot, int(value.shape[0]), int(value.shape[1]))
        with self.timing("time_compute_s"):
            out.copy_(value)
        return Ticket(out)

    def _next_slot(self, slot: str, rows: int, width: int) -> Tensor:
        """The next of ``slot``'s device slots, taken in turn, as ``(rows, width)``."""
        k = self._turn[slot]
        self._turn[slot] = (k + 1) % len(self._dev[slot])
        return self._dev[slot][k][: rows * width].view(rows, width)

    def fetch_all(self, host: Tensor, out: Tensor) -> Ticket:
        """Start copying all of ``host`` into ``out`` on the device (one DMA);
        :meth:`place` waits for it."""
        rows, width = int(host.shape[0]), int(host.shape[1])
        self._count(host, "h2d", rows, width)
        with self._loading():
            out.copy_(host, non_blocking=True)
        return Ticket(None, self._ready_event(self.s_in))

    def fetch_block(self, block, skip: tuple[str, ...] = ()) -> Ticket:
        """Start copying a chunk's :class:`~hongtu.nn.block.Block` (pinned) to the device.

        Its bytes count as host→device traffic (no rows). The tensors named in
        ``skip`` stay in host memory (a pass that does not read them). Tensors
        that lie next to each other in the block's pinned slab (:func:`pin_blocks`)
        travel as one copy; index arrays kept as int32 on the host are widened
        to int64 on the device, one kernel per copy, on a stream of its own
        (a kernel on the copy stream would hold up the copies behind it while
        compute fills the GPU).
        """
        runs, empty = self._block_copies(block, skip)
        # Its memory is compute's, as if compute allocated it (here, before the
        # copies): wherever the block is freed, what compute allocates next
        # reuses it in compute's order, which waits for the copies when it
        # takes the block. The copies wait for the compute issued so far, which
        # may still read what that memory held before.
        dev = [torch.empty(span.shape, dtype=span.dtype, device=self.device) for span, _ in runs]
        wide = [torch.empty(d.shape, dtype=torch.int64, device=self.device)
                if d.dtype == torch.int32 else d for d in dev]
        out = {}
        for name in empty:  # (made on the device)
            t = getattr(block, name)
            out[name] = torch.empty(t.shape, device=self.device,
                                    dtype=torch.int64 if t.dtype == torch.int32 else t.dtype)
        with self._on(self.s_in), self.timing("time_h2d_s", self.s_in):
            for (span, _), d in zip(runs, dev):
                self.traffic.h2d_bytes += span.nbytes
                d.copy_(span, non_blocking=True)
        ready = self._ready_event(self.s_in)
        narrow = [(d, w) for d, w in zip(dev, wide) if w is not d]
        if narrow:
            if ready is not None:
                self.s_widen.wait_event(ready)
            with self._on(self.s_widen, after_compute=False), \
                    self.timing("time_h2d_s", self.s_widen):
                for d, w in narrow:
                    w.copy_(d)
            ready = self._ready_event(self.s_widen)
        for (_, parts), w in zip(runs, wide):
            out.update((name, w if a is None else w[a:b]) for name, a, b in parts)
        return Ticket(block.replace_tensors(out), ready,
                      keep=[d for d, _ in narrow] if narrow and self.overlap else None)

    def _block_copies(self, block, skip: tuple[str, ...]) -> tuple[list, list[str]]:
        """:func:`_block_runs` of ``block`` without ``skip``, and the names of its
        empty tensors (in no run), worked out once per block and skip."""
        key = (id(block), tuple(skip))
        if key not in self._runs:
            empty = [n for n in block.tensor_names()
                     if n not in skip and not getattr(block, n).numel()]
            self._runs[key] = (block, _block_runs(block, skip), empty)  # (keeps the id's block)
        return self._runs[key][1:]

    def block_bytes(self, block, skip: tuple[str, ...] = ()) -> int:
        """Host bytes :meth:`fetch_block` moves for ``block`` without ``skip``: its
        tensors' and, where they travel as one copy, the few alignment bytes
        between them."""
        return sum(span.nbytes for span, _ in self._block_copies(block, skip)[0])

    def take_block(self, t: Ticket):
        """The block of a :meth:`fetch_block`, once compute may read it (its memory
        is compute's: freed wherever it ends, it is reused after what compute
        issued before)."""
        self._wait(t)
        t.keep = None  # (the widening that read them is done before compute goes on)
        return t.value

    def take(self, t: Ticket) -> Tensor:
        """The rows of a :meth:`fetch_range`, once compute may read them."""
        self._wait(t)
        return t.value

    def _wait(self, t: Ticket) -> None:
        if t.ready is not None:
            self.compute.wait_event(t.ready)
            t.ready = None

    # ----------------------------------------------------------- dev -> host
    def store_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] = value`` (on the store stream)."""
        self.store_runs(host, value, [(start, 0, int(value.shape[0]))])

    def store_runs(self, host: Tensor, value: Tensor, runs: list) -> None:
        """``host[p:p+k] = value[o:o+k]`` for each run ``(p, o, k)`` (on the store
        stream: one copy each, DMA on a GPU)."""
        rows = sum(k for _, _, k in runs)
        self._count(host, "d2h", rows, int(value.shape[1]) if rows else 0)
        value = value.detach()
        with self._on(self.s_out), self.timing("time_d2h_s", self.s_out):
            for p, o, k in runs:
                host[p:p + k].copy_(value[o:o + k], non_blocking=True)
        self._keep(value)

    def _keep(self, value: Tensor) -> None:
        """``value`` (memory compute allocated, or device memory the run keeps)
        stays allocated until the store stream is done with it: held until
        the batch :data:`HOLD_BATCHES` after its own begins (:meth:`step`), or
        compute waits for every store (:meth:`join`), and given back after
        compute waits for its store on the device. What compute allocates then takes its place in
        compute's order. (``record_stream`` would hand it back only once this
        thread, allocating, saw the store done: running batches ahead of the
        device, it found it not done yet, and the allocator took more memory,
        or, held to a GPU's size, synchronised the device to free its cache;
        ``bench/HISTORY.md``, 2026-11-28, twelfth.)"""
        if not self.overlap:
            return
        self._held.append((self._batch, value, self._ready_event(self.s_out)))
        if len(self._held) > _HELD_MOST:  # (stores with no batches between them)
            self._release(most=len(self._held) - _HELD_LAST)

    def exchange(self, comm, out: Tensor, out_counts: list[int], inp: Tensor,
                 in_counts: list[int]) -> None:
        """Device-to-device rows between ranks (all-to-all), counted as d2d."""
        with self.timing("time_d2d_s"):
            comm.exchange(out, out_counts, inp, in_counts)
        rows = int(inp.shape[0])
        self.traffic.d2d_rows += rows
        self.traffic.d2d_bytes += inp.numel() * self.itemsize

    def add_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] += value``."""
        self._flush(host, start, value.detach())

    def can_write(self, host: Tensor) -> bool:
        """Can :meth:`write_rows` write into ``host`` (on CPU, or pinned host memory)?"""
        return not self.cuda or (host.device.type == "cpu" and self._view(host) is not None)

    def write_rows(self, host: Tensor, ids: Tensor, slots: Tensor, buf: Tensor) -> None:
        """``host[ids] = buf[slots]``: compacted on the device, then scattered by the
        GPU straight into pinned host memory (zero-copy, on the store stream)."""
        if ids.shape[0] == 0:
            return
        self.store_rows(host, ids, buf.index_select(0, slots))

    def store_rows(self, host: Tensor, ids: Tensor, value: Tensor,
                   rows: Tensor | None = None) -> None:
        """``host[ids] = value[rows]`` (``ids`` unique, ``rows`` may repeat; ``None``:
        ``value`` in order; device tensors): on a GPU one kernel on the store
        stream, scattering the rows straight into pinned host memory (zero-copy)."""
        n = int(ids.shape[0])
        if n == 0:
            return
        self._count(host, "d2h", n, int(value.shape[1]))
        value = value.detach()
        if not self.cuda or host.device.type == "cuda":
            host.index_copy_(0, ids, value if rows is None else value.index_select(0, rows))
            return
        with self._on(self.s_out), self.timing("time_d2h_s", self.s_out):
            copy_rows(value, self._view(host), src_ids=rows, dst_ids=ids)
        self._keep(value)

    def flush_rows(self, host: Tensor, ids: np.ndarray, slots: Tensor, buf: Tensor,
                   ids_dev: Tensor | None = None) -> None:
        """``host[ids] += buf[slots]``: gradients of rows leaving the device buffer.

        ``ids`` (unique) is a host int64 array, ``slots`` a device tensor;
        ``ids_dev`` is ``ids`` on the device (needed when ``host`` is resident).
        """
        if ids.shape[0] == 0:
            return
        if self.cuda and host.device.type == "cuda":
            host.index_add_(0, ids_dev, buf.index_select(0, slots))
            return
        self._flush(host, ids, buf.index_select(0, slots))  # compacted on the device

    def _flush(self, host: Tensor, where, value: Tensor) -> None:
        """Add ``value`` into host rows ``where`` (an id array, or a start row).

        On a GPU the rows are copied to pinned staging on the store stream and
        a worker thread adds them on the CPU once the copy is done, while this
        thread goes on issuing GPU work (:meth:`drain` waits for it); on CPU
        they are added at once.
        """
        if self.cuda and host.device.type == "cuda":
            host[where:where + value.shape[0]].add_(value)
            return
        self._count(host, "d2h", int(value.shape[0]), int(value.shape[1]))
        if not self.cuda:
            self._add(host, where, value.contiguous().numpy())
            return
        k = self._flip
        self._flip = (k + 1) % _STAGES
        self._adder.wait_free(k)  # the add that last used this staging area is done
        stage = self._stage(k, value.numel()).view(value.shape)
        with self._on(self.s_out), self.timing("time_d2h_s", self.s_out):
            stage.copy_(value, non_blocking=True)
        self._keep(value)
        done = torch.cuda.Event()
        done.record(self.s_out)
        self._adder.submit(k, host, where, stage, done)

    def _stage(self, k: int, numel: int) -> Tensor:
        """The first ``numel`` elements of pinned staging area ``k``. Areas too
        small for them are all replaced by larger ones first (after every add
        that reads them is done)."""
        if numel == 0:
            return torch.empty(0, dtype=self.dtype)
        if not self._stages or self._stages[0].numel() < numel:
            self.drain()
            self._stages = [pinned_tensor((numel,), self.dtype) for _ in range(_STAGES)]
            self.staging_grown += 1
        self.staged_most = max(self.staged_most, numel)
        return self._stages[k][:numel]

    def drain(self) -> None:
        """Wait until every flush so far has been added into host memory."""
        if self._adder is not None:
            self._adder.drain()

    def _add(self, host: Tensor, where, vals: np.ndarray) -> None:
        t0 = time.perf_counter()
        _add_into(host, where, vals)
        self.traffic.time_cpu_s += time.perf_counter() - t0


class IndexRing:
    """Small int64 index arrays on their way to the device, two in flight.

    :meth:`fetch` copies a pinned host array into the next of two device
    slots on the load stream, after whatever read that slot last is done
    (:meth:`release`, on the stream that read it), and counts its bytes as
    host→device traffic. Without a GPU (or overlap) the host array is used
    as it is.
    """

    def __init__(self, mover: Mover, numel: int, memory: list[Tensor] | None = None) -> None:
        self.mover = mover
        if not (mover.cuda and mover.overlap):
            self.bufs = None
        elif memory:  # (int64 views of memory forward passes leave unused)
            self.bufs = memory
        else:
            self.bufs = [torch.empty(max(int(numel), 1), dtype=torch.int64, device=mover.device)
                         for _ in range(2)]
        self.free: list = [None] * 2
        self.turn = 0

    def fetch(self, host: Tensor) -> tuple[Ticket, int]:
        """``(ticket, slot)``: the array on the device (:meth:`Mover.take` it, or
        use it on the load stream) and the slot to :meth:`release`."""
        if self.bufs is None:
            return Ticket(host), 0
        mv, k = self.mover, self.turn
        self.turn = (k + 1) % len(self.bufs)
        out = self.bufs[k][: host.numel()]
        # (after compute issued so far: the slot may be memory backward reads;
        # the wait for its last reader is not copy time)
        with mv._on(mv.s_in):
            if self.free[k] is not None:
                mv.s_in.wait_event(self.free[k])
            with mv.timing("time_h2d_s", mv.s_in):
                out.copy_(host, non_blocking=True)
        mv.traffic.h2d_bytes += host.numel() * host.element_size()
        return Ticket(out, mv._ready_event(mv.s_in)), k

    def release(self, k: int, stream) -> None:
        """Slot ``k``'s array is read by work issued so far on ``stream`` only."""
        if self.bufs is not None:
            self.free[k] = torch.cuda.Event()
            self.free[k].record(stream)


def _add_into(host: Tensor, where, vals: np.ndarray) -> None:
    """``host[where] += vals`` (``where``: unique row ids, or the first row of a range)."""
    if isinstance(where, np.ndarray):
        _scatter_add_rows(host.numpy(), where, vals.reshape(vals.shape[0], -1))
    else:
        rows = host[where:where + vals.shape[0]].numpy()
        np.add(rows, vals.reshape(rows.shape), out=rows)


_STAGES = 3  # pinned flush staging areas (flushes in flight to the CPU adder)
# Held stores' tensors (Mover._keep) past which, with no batch begun between
# them, all but the last _HELD_LAST are given back (compute waiting for them).
_HELD_MOST, _HELD_LAST = 64, 16
#: A store's tensor is given back when the batch this many after its own
#: begins (Mover.step): at 2, while a batch computes, the batch before's
#: stores may still go (the estimate counts one batch's: held_store_bytes).
HOLD_BATCHES = 2


def flush_staging_bytes(elements: int, itemsize: int) -> int:
    """Pinned host bytes of a GPU :class:`Mover`'s flush staging areas: ``_STAGES``
    of ``elements``, the largest flush
    (:func:`~hongtu.engine.executor.flush_staging_elements`)."""
    return _STAGES * int(elements) * int(itemsize)


class _Adder:
    """A worker thread that adds staged gradient flushes into host memory.

    The numba kernel releases the GIL, so the adds run while the main thread
    issues the next batches' GPU work. Adds run one at a time, in order.
    """

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic  # CPU time is added to traffic.time_cpu_s
        self.jobs: queue.Queue = queue.Queue()
        self.free = [threading.Event() for _ in range(_STAGES)]
        for f in self.free:
            f.set()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hongtu-adder", daemon=True)
        self.thread.start()

    def submit(self, k: int, host: Tensor, where, stage: Tensor, done) -> None:
        self.free[k].clear()
        self.jobs.put((k, host, where, stage, done))

    def wait_free(self, k: int) -> None:
        self.free[k].wait()
        self._raise()

    def drain(self) -> None:
        self.jobs.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            k, host, where, stage, done = job
            try:
                if self.error is None:
                    done.synchronize()
                    t0 = time.perf_counter()
                    _add_into(host, where, stage.numpy())
                    self.traffic.time_cpu_s += time.perf_counter() - t0
            except BaseException as exc:  # reported to the main thread at its next wait
                self.error = exc
            finally:
                self.free[k].set()
                self.jobs.task_done()
