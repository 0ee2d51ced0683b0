r"""Moving rows between host buffers and the device, and counting every byte.

All host↔device traffic of the engine goes through one :class:`Mover`, so the
byte and row counters it keeps are the engine's real traffic. On CPU the
"device" is host memory too: the same calls copy between tensors, so the
algorithm and the counters are identical in both modes.

Device staging buffers are allocated once (sized by the largest chunk) and
handed out as views; the batch loop does not allocate host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["Traffic", "Mover"]


@dataclass
class Traffic:
    """Bytes and rows moved in one epoch, by direction."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    h2d_rows: int = 0
    d2h_rows: int = 0
    d2d_rows: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

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
    """

    def __init__(self, device: torch.device, slots: dict[str, int], max_width: int,
                 dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.traffic = Traffic()
        self.cuda = device.type == "cuda"
        sizes = {s: max(int(rows) * int(max_width), 1) for s, rows in slots.items()}
        self._dev = {s: torch.empty(n, dtype=dtype, device=device) for s, n in sizes.items()}
        # Host-side staging for gathers when the device is a GPU: pinned, so the
        # copy is a DMA transfer.
        self._stage = (torch.empty(max(sizes.values()), dtype=dtype, pin_memory=True)
                       if self.cuda else None)
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def _slot(self, slot: str, rows: int, width: int) -> Tensor:
        return self._dev[slot][: rows * width].view(rows, width)

    def device_bytes(self) -> int:
        """Bytes of the staging slots on the device."""
        return sum(t.numel() for t in self._dev.values()) * self.itemsize

    # ----------------------------------------------------------- host -> dev
    def load_rows(self, host: Tensor, ids: Tensor, slot: str = "src") -> Tensor:
        """``host[ids]`` on the device (``ids`` is a host int64 tensor, sorted)."""
        rows, width = int(ids.shape[0]), int(host.shape[1])
        out = self._slot(slot, rows, width)
        if self.cuda:
            stage = self._stage[: rows * width].view(rows, width)
            torch.index_select(host, 0, ids, out=stage)
            out.copy_(stage, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            torch.index_select(host, 0, ids, out=out)
        self.traffic.h2d_rows += rows
        self.traffic.h2d_bytes += rows * width * self.itemsize
        return out

    def load_range(self, host: Tensor, start: int, stop: int, slot: str = "dst") -> Tensor:
        """``host[start:stop]`` on the device (one contiguous copy)."""
        rows, width = stop - start, int(host.shape[1])
        out = self._slot(slot, rows, width)
        out.copy_(host[start:stop], non_blocking=False)
        self.traffic.h2d_rows += rows
        self.traffic.h2d_bytes += rows * width * self.itemsize
        return out

    # ----------------------------------------------------------- dev -> host
    def store_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] = value``."""
        rows = int(value.shape[0])
        host[start:start + rows].copy_(value.detach())
        self.traffic.d2h_rows += rows
        self.traffic.d2h_bytes += value.numel() * self.itemsize

    def add_range(self, host: Tensor, start: int, value: Tensor) -> None:
        """``host[start:start+len(value)] += value``."""
        rows = int(value.shape[0])
        host[start:start + rows] += value.detach().to(host.device)
        self.traffic.d2h_rows += rows
        self.traffic.d2h_bytes += value.numel() * self.itemsize

    def add_rows(self, host: Tensor, ids: Tensor, value: Tensor) -> None:
        """``host[ids] += value`` (``ids`` unique, host int64)."""
        rows = int(ids.shape[0])
        host.index_add_(0, ids, value.detach().to(host.device))
        self.traffic.d2h_rows += rows
        self.traffic.d2h_bytes += value.numel() * self.itemsize
