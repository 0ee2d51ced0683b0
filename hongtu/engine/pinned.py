r"""Pinned host memory, registered in place, and device views of it.

``Tensor.pin_memory()`` copies (doubling host memory) and the caching host
allocator may round sizes up; instead the engine allocates ordinary host
slabs and registers them with ``cudaHostRegister`` in pieces of at most
64 GiB. A registered slab can be read by GPU kernels directly (zero-copy):
:func:`device_view` wraps it as a CUDA tensor through
``__cuda_array_interface__``, so ``index_select`` on the view gathers rows
over the host link without a CPU gather.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor

__all__ = ["pinned_empty", "pin_in_place", "device_view", "unpin"]

_SLAB = 64 << 30
_PAGE = 4096


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, bool]:
    """An uninitialised host tensor on pages of its own, registered in place.

    The slab is page-aligned and a whole number of pages long, so its
    registration never overlaps another allocation's (CUDA refuses ranges that
    are already registered). It is unregistered when the last tensor using it
    is freed, before the memory goes back to the allocator. Returns the tensor
    and whether pinning succeeded.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = max(numel * itemsize, 1)
    padded = -(-nbytes // _PAGE) * _PAGE
    raw = np.empty(padded + _PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % _PAGE
    region = torch.from_numpy(raw[off:off + padded])
    ok = pin_in_place(region)
    if ok:
        # numpy clears weak references before it frees the data: unregister then.
        weakref.finalize(raw, _unregister, region.data_ptr(), padded)
    t = region[: numel * itemsize].view(dtype).view(shape)
    return t, ok
_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2",
            torch.int64: "<i8", torch.int32: "<i4"}


def pin_in_place(t: Tensor) -> bool:
    """Page-lock ``t``'s memory without copying; ``False`` if CUDA refused."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    done = []
    for off in range(0, nbytes, _SLAB):
        err = cudart.cudaHostRegister(ptr + off, min(_SLAB, nbytes - off), 0)
        if int(err) != 0:
            for o in done:
                cudart.cudaHostUnregister(ptr + o)
            # A failed call leaves a sticky "last error" that the next kernel
            # launch would report as its own: clear it.
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:
                clear()
            return False
        done.append(off)
    return True


def unpin(t: Tensor) -> None:
    """Undo :func:`pin_in_place`."""
    _unregister(t.data_ptr(), t.numel() * t.element_size())


def _unregister(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    for off in range(0, nbytes, _SLAB):
        cudart.cudaHostUnregister(ptr + off)


class _HostArray:
    """A ``__cuda_array_interface__`` over pinned host memory (UVA makes it addressable)."""

    def __init__(self, t: Tensor) -> None:
        self._t = t  # keep the host tensor alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False), "version": 3,
            "strides": tuple(s * t.element_size() for s in t.stride()),
        }


def device_view(t: Tensor, device: torch.device) -> Tensor:
    """A CUDA tensor aliasing the pinned host tensor ``t`` (no copy)."""
    view = torch.as_tensor(_HostArray(t), device=device)
    view._hongtu_host = t  # the view must not outlive the host memory
    return view
