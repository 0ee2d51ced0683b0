r"""Moving rows between host buffers and the device, and counting every byte.

All host↔device traffic of the engine goes through one :class:`Mover`, so the
byte and row counters it keeps are the engine's real traffic. On CPU the
"device" is host memory too: the same calls copy between tensors, so the
algorithm and the counters are identical in both modes.

On a GPU, host buffers are pinned in place; neighbour rows are gathered by the
GPU straight from them through a device view (zero-copy, sorted ids),
contiguous ranges move by DMA, and gradients leaving the device are copied to a
pinned staging area and added into the host buffer by a parallel numba kernel
(ids of one flush are unique, so rows never collide).

Device staging slots are allocated once (sized by the largest chunk) and
handed out as views; the batch loop does not allocate host memory.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import numba
import numpy as np
import torch
from torch import Tensor

from hongtu.engine.pinned import device_view

__all__ = ["Mover", "Traffic"]


@numba.njit(parallel=True, cache=True)
def _scatter_add_rows(host, ids, vals):
    for i in numba.prange(ids.shape[0]):
        r = ids[i]
        for k in range(vals.shape[1]):
            host[r, k] += vals[i, k]


@dataclass
class Traffic:
    """Bytes and rows moved in one epoch, by direction, and where the time went."""

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

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(0))

    def moving_s(self) -> float:
        """Seconds spent moving data (transfers and CPU accumulation)."""
        return self.time_h2d_s + self.time_d2h_s + self.time_d2d_s + self.time_cpu_s

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Mover:
    """Host↔device row transfers with counters.

    Args:
        device: the compute device.
        slots: staging slot name -> the most rows it must hold (one slot per
            input that is live at the same time as the others).
        max_width: the widest row (elements).
        dtype: element type of the buffers.
        stage_rows: rows of the pinned host staging area (the most rows one
            load or flush moves); default the largest slot.
        timed: attribute time to transfers. On a GPU each transfer is
            bracketed by CUDA events (no synchronisation in the batch loop);
            :meth:`settle` reads them once per epoch.
    """

    def __init__(self, device: torch.device, slots: dict[str, int], max_width: int,
                 dtype: torch.dtype, timed: bool = True, stage_rows: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        self.traffic = Traffic()
        self.cuda = device.type == "cuda"
        self.timed = timed
        sizes = {s: max(int(rows) * int(max_width), 1) for s, rows in slots.items()}
        self._dev = {s: torch.empty(n, dtype=dtype, device=device) for s, n in sizes.items()}
        # Two pinned staging areas for gradient flushes: one receives a flush by
        # DMA while the CPU adds the previous one (from the other) into host memory.
        stage = max(max(sizes.values()), int(stage_rows) * int(max_width))
        self._stages = ([torch.empty(stage, dtype=dtype, pin_memory=True) for _ in range(2)]
                        if self.cuda else None)
        self._flip = 0
        self._pending: tuple | None = None
        self._views: dict[int, Tensor] = {}
        self._events: list = []
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def _slot(self, slot: str, rows: int, width: int) -> Tensor:
        return self._dev[slot][: rows * width].view(rows, width)

    def _view(self, host: Tensor) -> Tensor | None:
        """The zero-copy device view of a pinned host buffer (``None`` if not pinned)."""
        key = host.data_ptr()
        if key not in self._views:
            self._views[key] = device_view(host, self.device) if host.is_pinned() else None
        return self._views[key]

    @contextlib.contextmanager
    def _timing(self, field: str):
        """Add the time of the enclosed work to ``traffic.<field>``."""
        if not self.timed:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((field, start, end))
        else:
            t0 = time.perf_counter()
            yield
            setattr(self.traffic, field, getattr(self.traffic, field) + time.perf_counter() - t0)

    def settle(self) -> None:
        """Finish pending flushes, wait for the device, fold event times into ``traffic``."""
        self.drain()
        if self._events:
            torch.cuda.current_stream(self.device).synchronize()
            for field, start, end in self._events:
                setattr(self.traffic, field,
                        getattr(self.traffic, field) + start.elapsed_time(end) / 1000.0)
            self._events.clear()

    # ----------------------------------------------------------- host -> dev
    def load_rows_into(self, host: Tensor, ids: Tensor, slots: Tensor, buf: Tensor) -> None:
        """``buf[slots] = host[ids]``: rows from host into their buffer slots.

        ``ids`` (sorted) and ``slots`` are int64 tensors on the device.
        """
        rows, width = int(ids.shape[0]), int(host.shape[1])
        if rows == 0:
            return
        with self._timing("time_h2d_s"):
            view = self._view(host) if self.cuda else host
            if view is not None:
                buf.index_copy_(0, slots, view.index_select(0, ids))
            else:  # unpinned host memory: gather on the CPU, then one copy
                self.drain()  # the staging areas may still hold a flush
                stage = self._stages[0][: rows * width].view(rows, width)
                torch.index_select(host, 0, ids.cpu(), out=stage)
                buf.index_copy_(0, slots, stage.to(self.device, non_blocking=True))
                torch.cuda.current_stream(self.device).synchronize()
        self.traffic.h2d_rows += rows
        self.traffic.h2d_bytes += rows * width * self.itemsize

    def load_range(self, host: Tensor, start: int, stop: int, slot: str = "dst") -> Tensor:
        """``host[start:stop]`` on the device (one contiguous copy)."""
        rows, width = stop - start, int(host.shape[1])
        out = self._slot(slot, rows, width)
        with self._timing("time_h2d_s"):
            out.copy_(host[start:stop], non_blocking=True)
        self.traffic.h2d_rows += rows
        self.traffic.h2d_bytes += rows * width * self.itemsize
        return out

    # ----------------------------------------------------------- dev -> host
    def store_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] = value``."""
        rows = int(value.shape[0])
        with self._timing("time_d2h_s"):
            host[start:start + rows].copy_(value.detach(), non_blocking=True)
        self.traffic.d2h_rows += rows
        self.traffic.d2h_bytes += value.numel() * self.itemsize

    def exchange(self, comm, out: Tensor, out_counts: list[int], inp: Tensor,
                 in_counts: list[int]) -> None:
        """Device-to-device rows between ranks (all-to-all), counted as d2d."""
        with self._timing("time_d2d_s"):
            comm.exchange(out, out_counts, inp, in_counts)
        rows = int(inp.shape[0])
        self.traffic.d2d_rows += rows
        self.traffic.d2d_bytes += inp.numel() * self.itemsize

    def add_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] += value``."""
        self._flush(host, start, value.detach())

    def flush_rows(self, host: Tensor, ids: np.ndarray, slots: Tensor, buf: Tensor) -> None:
        """``host[ids] += buf[slots]``: gradients of rows leaving the device buffer.

        ``ids`` (unique) is a host int64 array, ``slots`` a device tensor.
        """
        if ids.shape[0] == 0:
            return
        with self._timing("time_d2h_s"):
            value = buf.index_select(0, slots)
        self._flush(host, ids, value)

    def _flush(self, host: Tensor, where, value: Tensor) -> None:
        """Add ``value`` into host rows ``where`` (an id array, or a start row).

        On a GPU the rows are copied to pinned staging asynchronously and added
        on the CPU at the *next* flush (or :meth:`drain`), so the CPU's work
        overlaps the GPU's; on CPU they are added at once.
        """
        self.traffic.d2h_rows += int(value.shape[0])
        self.traffic.d2h_bytes += value.numel() * self.itemsize
        if not self.cuda:
            self._add(host, where, value.contiguous().numpy())
            return
        stage = self._stages[self._flip][: value.numel()].view(value.shape)
        with self._timing("time_d2h_s"):
            stage.copy_(value, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.drain()
        self._pending = (host, where, stage, done)
        self._flip ^= 1

    def drain(self) -> None:
        """Finish the pending flush: wait for its copy, add it into host memory."""
        if self._pending is None:
            return
        host, where, stage, done = self._pending
        self._pending = None
        done.synchronize()
        self._add(host, where, stage.numpy())

    def _add(self, host: Tensor, where, vals: np.ndarray) -> None:
        with self._cpu_timing():
            if isinstance(where, np.ndarray):
                _scatter_add_rows(host.numpy(), where, vals.reshape(vals.shape[0], -1))
            else:
                rows = host[where:where + vals.shape[0]].numpy()
                np.add(rows, vals.reshape(rows.shape), out=rows)

    @contextlib.contextmanager
    def _cpu_timing(self):
        t0 = time.perf_counter()
        yield
        self.traffic.time_cpu_s += time.perf_counter() - t0
