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

import mmap
import weakref

import numpy as np
import torch
from torch import Tensor

__all__ = ["pinned_empty", "pinned_tensor", "pinned_copies", "slab_copies", "pin_in_place",
           "device_view", "is_device_view", "unpin"]

_SLAB = 64 << 30
_PAGE = 4096


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, bool]:
    """A zeroed host tensor on pages of its own, registered in place.

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
    # An anonymous mapping of its own (page-aligned), on huge pages where the
    # kernel allows, touched by all of torch's threads before it is registered:
    # measured on the H200 host for 8 GiB, plain pages registered cold 2.0 s,
    # huge pages zeroed in parallel then registered 0.41 s.
    mm = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mm, dtype=np.uint8)
    region = torch.from_numpy(raw)
    region.zero_()
    ok = pin_in_place(region)
    if ok:
        # numpy clears weak references before it frees the data: unregister then.
        weakref.finalize(raw, _unregister, region.data_ptr(), padded)
    t = region[: numel * itemsize].view(dtype).view(shape)
    return t, ok


def pinned_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A pinned host tensor: registered in place (:func:`pinned_empty`), else from
    torch's pinned allocator."""
    t, ok = pinned_empty(shape, dtype)
    return t if ok else torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned_copies(tensors: list[Tensor]) -> list[Tensor]:
    """Pinned copies of many small host tensors, carved from one registered slab.

    One registration instead of one pinned allocation per tensor (torch's
    pinned allocator also rounds each up to a power of two). Each copy starts
    on a 128-byte boundary. Falls back to ``Tensor.pin_memory()`` when CUDA
    refuses the registration.
    """
    out = slab_copies(tensors, lambda n: pinned_empty((n,), torch.uint8))
    return out if out is not None else [t.pin_memory() for t in tensors]


def slab_copies(tensors: list[Tensor], alloc) -> list[Tensor] | None:
    """Copies of ``tensors`` carved from one byte slab ``alloc(nbytes) -> (tensor,
    ok)`` (``None`` when not ok), in order, each on a 128-byte boundary."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 128) * 128
    slab, ok = alloc(max(total, 1))
    if not ok:
        return None
    out = []
    for t, o in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        view = slab[o:o + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


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


def is_device_view(t: Tensor) -> bool:
    """Whether ``t`` is a :func:`device_view` (itself, not a slice of one)."""
    return hasattr(t, "_hongtu_host")
