r"""Host buffers: every layer's representations, gradients and cached aggregates.

Allocated once before training, as one slab each (pinned when the device is a
GPU, so transfers are DMA). ``h^0`` is the input features as given — a
memory-mapped array stays memory-mapped. Before anything is allocated, the
plan is checked against the host memory that is available.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hongtu.config import format_size
from hongtu.engine.pinned import pinned_empty
from hongtu.errors import UserError

__all__ = ["BufferPlan", "HostBuffers", "available_host_memory"]


def available_host_memory() -> int:
    """Bytes of host memory available now (``MemAvailable``; total RAM as a fallback)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class BufferPlan:
    """Shapes of the host buffers of an ``L``-layer model on ``N`` vertices.

    Args:
        num_nodes: vertex count ``N``.
        widths: row widths of ``h^0 .. h^L``.
        cached: ``cached[l]`` is true when layer ``l``'s aggregate is cached
            (its width is ``widths[l]``: built-in aggregations keep the width).
        itemsize: bytes per element.
        grads: ``grads[l]`` (``l = 0 .. L``) is false where ``∇h^l`` needs no
            host buffer (it stays on the device between passes,
            :func:`~hongtu.engine.executor.gradients_kept`); default every
            ``l >= 1`` has one.
    """

    num_nodes: int
    widths: list[int]
    cached: list[bool]
    itemsize: int = 4
    grads: list[bool] | None = None

    def has_grad(self, l: int) -> bool:
        """Whether ``∇h^l`` has a host buffer."""
        return l > 0 and (self.grads is None or bool(self.grads[l]))

    def entries(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of every buffer that is allocated (h^0 is the input)."""
        n, s = self.num_nodes, self.itemsize
        out = []
        L = len(self.widths) - 1
        for l in range(1, L + 1):
            out.append((f"h^{l}", n * self.widths[l] * s))
            if self.has_grad(l):
                out.append((f"grad h^{l}", n * self.widths[l] * s))
        for l in range(L):
            if self.cached[l]:
                out.append((f"a^{l}", n * self.widths[l] * s))
        return out

    def total_bytes(self) -> int:
        return sum(b for _, b in self.entries())

    def resident_bytes(self) -> int:
        """Device bytes of every buffer, ``h^0`` included (resident mode)."""
        return self.total_bytes() + self.num_nodes * self.widths[0] * self.itemsize

    def format(self) -> str:
        rows = [f"  {name:<10} {format_size(b):>12}" for name, b in self.entries()]
        rows.append(f"  {'total':<10} {format_size(self.total_bytes()):>12}")
        return "\n".join(rows)

    def check_host_memory(self, available: int | None = None, input_copy: bool = False) -> None:
        """Raise :class:`UserError` when the buffers cannot fit in host memory
        (``input_copy``: with a copy of the input as ``h^0``, as
        :class:`HostBuffers` makes to renumber or pin it)."""
        copy = self.num_nodes * self.widths[0] * self.itemsize if input_copy else 0
        need = self.total_bytes() + copy
        avail = available_host_memory() if available is None else available
        if need > avail:
            with_copy = f" ({format_size(copy)} of them a copy of the features)" if copy else ""
            raise UserError(
                f"host memory too small: the buffers need {format_size(need)}{with_copy} but "
                f"{format_size(avail)} is available; use fewer layers or a smaller hidden "
                "width, engine.checkpoint=recompute (drops the cached aggregates), or more "
                "machines (engine.devices)")


_SLAB_BYTES = 256 << 20  # the input is copied into h^0 this much at a time


class HostBuffers:
    """The slabs of a :class:`BufferPlan`: in host memory, or with ``device`` given
    (resident mode, everything fits the device budget) on the device.

    Attributes:
        h: ``h[l]`` for ``l = 0..L`` (``h[0]`` wraps the input features).
        grad: ``grad[l]`` for ``l = 1..L`` (``grad[0]`` is ``None``: inputs need no
            grad; so is one the plan keeps on the device, :meth:`BufferPlan.has_grad`).
        agg: ``agg[l]`` for cached layers, else ``None``.

    ``rows`` renumbers the input: vertex ``k``'s features are ``x[rows[k]]``,
    gathered straight into ``h[0]`` (no renumbered copy of ``x`` first).
    """

    def __init__(self, plan: BufferPlan, x: np.ndarray | Tensor, pin: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 rows: np.ndarray | None = None) -> None:
        on_device = device is not None and device.type != "cpu"
        if not on_device:  # (h^0 a copy of the input, below, where renumbered or pinned)
            plan.check_host_memory(input_copy=rows is not None or pin)
        n = plan.num_nodes
        L = len(plan.widths) - 1

        self.pinned = pin and not on_device

        def slab(width: int) -> Tensor:
            if on_device:
                return torch.empty((n, width), dtype=dtype, device=device)
            if not pin:
                return torch.empty((n, width), dtype=dtype)
            t, ok = pinned_empty((n, width), dtype)
            self.pinned = self.pinned and ok
            return t

        if rows is not None or pin or on_device:
            # The GPU reads h^0 in place: copy the input (which may be memory
            # mapped) into a slab that can be registered, in slabs of rows.
            x0 = slab(plan.widths[0])
            step = max(1, _SLAB_BYTES // max(1, plan.widths[0] * 4))
            whole = isinstance(x, np.ndarray) and not isinstance(x, np.memmap) \
                and x.flags.c_contiguous and torch.from_numpy(x[:0]).dtype == dtype
            for s in range(0, n, step):
                if rows is None:
                    x0[s:s + step] = torch.from_numpy(np.asarray(x[s:s + step])).to(dtype)
                elif whole and not on_device:  # gathered by torch's threads, in place
                    torch.index_select(torch.from_numpy(x), 0, torch.from_numpy(
                        np.ascontiguousarray(rows[s:s + step], dtype=np.int64)),
                        out=x0[s:s + step])
                else:  # (a memory-mapped file is read for these rows alone)
                    x0[s:s + step] = torch.from_numpy(np.asarray(x[rows[s:s + step]])).to(dtype)
        else:
            if isinstance(x, Tensor):
                x0 = x
            else:  # (a read-only memory map is used in place: h^0 is never written)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given NumPy array is not "
                                            "writable")
                    x0 = torch.from_numpy(np.asarray(x))
            x0 = x0.to(dtype)
        self.h: list[Tensor] = [x0] + [slab(plan.widths[l]) for l in range(1, L + 1)]
        self.grad: list[Tensor | None] = [slab(plan.widths[l]) if plan.has_grad(l) else None
                                          for l in range(L + 1)]
        self.agg: list[Tensor | None] = [slab(plan.widths[l]) if plan.cached[l] else None
                                         for l in range(L)]
        self.plan = plan
