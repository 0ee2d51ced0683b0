r"""The local graph of one chunk, as a layer sees it.

A chunk owns a contiguous range of destination vertices ``V`` (global ids
``dst_start .. dst_start + num_dst``) and reads a set of source rows ``N``
(global ids ``src_ids``, sorted). Its edges are the in-edges of ``V``: a
contiguous range of the global CSC starting at ``edge_start``. The block stores
them twice, as a CSR over local ids (rows = destinations, columns = positions
in the source buffer) and as its transpose, so that aggregation and its
gradient are both plain sparse products.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numba
import numpy as np
import torch
from torch import Tensor

from hongtu.graph._kernels import unique_union

__all__ = ["Block", "block_scratch", "build_block"]


@dataclass
class Block:
    r"""A bipartite chunk graph ``N -> V`` with local ids.

    Args:
        indptr: ``(num_dst + 1,)`` int64 CSR row pointer over destinations.
        indices: ``(E,)`` int64 local source position of each edge.
        t_indptr: ``(num_src + 1,)`` row pointer of the transpose (sources).
        t_indices: ``(E,)`` destination of each transposed edge.
        t_perm: ``(E,)`` edge id (CSR order) of each transposed edge.
        src_ids: ``(num_src,)`` global ids of the source rows, sorted.
        src_in_deg, dst_in_deg: global in-degrees (float) of sources and
            destinations; every in-edge of a destination is in its block, so
            ``dst_in_deg`` is also the local row length.
        dst_start: global id of the first destination.
        edge_start: global id (CSC position) of the first edge.

    Shapes:
        ``num_dst = len(indptr) - 1``, ``num_src = len(src_ids)``, ``E = len(indices)``.
    """

    indptr: Tensor
    indices: Tensor
    t_indptr: Tensor
    t_indices: Tensor
    t_perm: Tensor
    src_ids: Tensor
    src_in_deg: Tensor
    dst_in_deg: Tensor
    dst_start: int
    edge_start: int
    #: the fields of the transpose (read for gradients only, by built-in ops)
    TRANSPOSE = ("t_indptr", "t_indices", "t_perm")
    #: the per-edge fields that a built-in aggregation's transpose
    #: (``ops.aggregate_transpose``) does not read
    NOT_TRANSPOSED = ("indices", "t_perm")
    # Per-call state set by the engine: the dropout stream of this pass.
    seed: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_dst(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_src(self) -> int:
        return int(self.src_ids.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def device(self) -> torch.device:
        return self.indptr.device  # (every pass copies indptr; some leave others behind)

    def dst_ids(self, device: torch.device | None = None) -> Tensor:
        """Global ids of the destinations (a contiguous range), on ``device``
        (default the block's)."""
        return torch.arange(self.dst_start, self.dst_start + self.num_dst,
                            device=self.device if device is None else device)

    def edge_ids(self) -> Tensor:
        """Global ids of the edges, in local CSR order."""
        return torch.arange(self.edge_start, self.edge_start + self.num_edges, device=self.device)

    def edge_dst(self) -> Tensor:
        """Local destination of each edge (CSR order)."""
        key = "edge_dst"
        if key not in self._cache:
            counts = self.indptr[1:] - self.indptr[:-1]
            # output_size: no device->host sync to learn the length.
            self._cache[key] = torch.repeat_interleave(
                torch.arange(self.num_dst, device=self.device), counts,
                output_size=self.num_edges)
        return self._cache[key]

    def edge_src_t(self) -> Tensor:
        """Local source position of each edge of the transpose (its order)."""
        key = "edge_src_t"
        if key not in self._cache:
            counts = self.t_indptr[1:] - self.t_indptr[:-1]
            self._cache[key] = torch.repeat_interleave(
                torch.arange(self.num_src, device=self.t_indptr.device), counts,
                output_size=self.t_indices.shape[0])
        return self._cache[key]

    def edge_src(self) -> Tensor:
        """Local source position of each edge (CSR order)."""
        return self.indices

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Block:
        """A copy with every tensor on ``device`` (the per-pass cache is dropped)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        """Mark every device tensor as used on ``stream`` (for blocks copied on another
        stream)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and v.is_cuda:
                v.record_stream(stream)

    def pin_memory(self) -> Block:
        """A copy in pinned host memory, so copies to a GPU are DMA transfers."""
        return self._map(lambda t: t.pin_memory())

    def tensors(self) -> list[Tensor]:
        """The block's tensors, in field order."""
        return [getattr(self, n) for n in self.tensor_names()]

    def tensor_names(self) -> list[str]:
        """Names of the block's tensor fields, in field order."""
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), Tensor)]

    def replace_tensors(self, tensors: dict[str, Tensor]) -> Block:
        """A copy with the tensors named in ``tensors`` replaced (the per-pass cache
        dropped)."""
        return Block(**{f.name: tensors.get(f.name, getattr(self, f.name))
                        for f in fields(self) if f.name != "_cache"})

    def _map(self, fn) -> Block:
        """A copy with ``fn`` applied to every tensor (the per-pass cache dropped)."""
        return self.replace_tensors({n: fn(getattr(self, n)) for n in self.tensor_names()})

    def nbytes(self, skip: tuple[str, ...] = ()) -> int:
        """Bytes of the block's tensors (its device footprint before caching), but
        those named in ``skip``."""
        return sum(getattr(self, f.name).nbytes for f in fields(self)
                   if isinstance(getattr(self, f.name), Tensor) and f.name not in skip)


@numba.njit(nogil=True, cache=True)
def _block_sources(indptr, indices, dst_start, dst_stop, pos):
    """The distinct sources of destinations ``[dst_start, dst_stop)``, sorted.

    ``pos`` (``|V|``, all ``-1``) is scratch, left as found.
    """
    e0, e1 = indptr[dst_start], indptr[dst_stop]
    uniq = np.empty(e1 - e0, dtype=np.int64)
    k = 0
    for e in range(e0, e1):
        u = indices[e]
        if pos[u] == -1:
            pos[u] = -2
            uniq[k] = u
            k += 1
    src_ids = np.sort(uniq[:k])
    for i in range(k):
        pos[src_ids[i]] = -1
    return src_ids


@numba.njit(nogil=True, cache=True)
def _block_arrays(indptr, indices, dst_start, dst_stop, src_ids, pos):
    """Local CSR and transpose of destinations ``[dst_start, dst_stop)`` over ``src_ids``.

    ``src_ids`` (sorted, unique) must hold every source of the range; ``pos``
    (``|V|``, all ``-1``) is scratch, left as found. The transpose is a stable
    counting sort of the edges by source (edges of a source in CSR order).
    """
    e0, e1 = indptr[dst_start], indptr[dst_stop]
    num_e = e1 - e0
    k = src_ids.shape[0]
    for i in range(k):
        pos[src_ids[i]] = i
    local = np.empty(num_e, dtype=np.int64)
    missing = False
    for e in range(num_e):
        q = pos[indices[e0 + e]]
        missing |= q < 0
        local[e] = q
    for i in range(k):
        pos[src_ids[i]] = -1
    if missing:
        raise ValueError("src_ids lacks a source of the block's edges")
    num_dst = dst_stop - dst_start
    row_ptr = np.empty(num_dst + 1, dtype=np.int64)
    for d in range(num_dst + 1):
        row_ptr[d] = indptr[dst_start + d] - e0
    t_indptr = np.zeros(k + 1, dtype=np.int64)
    for e in range(num_e):
        t_indptr[local[e] + 1] += 1
    for i in range(k):
        t_indptr[i + 1] += t_indptr[i]
    fill = t_indptr[:-1].copy()
    t_perm = np.empty(num_e, dtype=np.int64)
    t_indices = np.empty(num_e, dtype=np.int64)
    for d in range(num_dst):
        for e in range(row_ptr[d], row_ptr[d + 1]):
            q = fill[local[e]]
            fill[local[e]] += 1
            t_perm[q] = e
            t_indices[q] = d
    return local, row_ptr, t_indptr, t_perm, t_indices


@numba.njit(parallel=True, cache=True)
def _block_arrays_parallel(indptr, indices, dst_start, dst_stop, src_ids, pos, workers):
    """:func:`_block_arrays` for one big block, on all threads.

    The transpose is split by source: worker ``t`` owns the sources
    ``[t*k/workers, (t+1)*k/workers)`` and scans every edge in CSR order twice
    (count, then place), so each source's edges keep their order.
    """
    e0, e1 = indptr[dst_start], indptr[dst_stop]
    num_e = e1 - e0
    k = src_ids.shape[0]
    for i in numba.prange(k):
        pos[src_ids[i]] = i
    local = np.empty(num_e, dtype=np.int64)
    missing = 0
    for e in numba.prange(num_e):
        q = pos[indices[e0 + e]]
        missing += q < 0
        local[e] = q
    for i in numba.prange(k):
        pos[src_ids[i]] = -1
    if missing:
        raise ValueError("src_ids lacks a source of the block's edges")
    num_dst = dst_stop - dst_start
    row_ptr = np.empty(num_dst + 1, dtype=np.int64)
    for d in numba.prange(num_dst + 1):
        row_ptr[d] = indptr[dst_start + d] - e0
    t_indptr = np.zeros(k + 1, dtype=np.int64)
    for t in numba.prange(workers):
        a, b = t * k // workers, (t + 1) * k // workers
        for e in range(num_e):
            q = local[e]
            if a <= q < b:
                t_indptr[q + 1] += 1
    for i in range(k):
        t_indptr[i + 1] += t_indptr[i]
    t_perm = np.empty(num_e, dtype=np.int64)
    t_indices = np.empty(num_e, dtype=np.int64)
    fill = t_indptr[:-1].copy()
    for t in numba.prange(workers):
        a, b = t * k // workers, (t + 1) * k // workers
        for d in range(num_dst):
            for e in range(row_ptr[d], row_ptr[d + 1]):
                q = local[e]
                if a <= q < b:
                    f = fill[q]
                    fill[q] = f + 1
                    t_perm[f] = e
                    t_indices[f] = d
    return local, row_ptr, t_indptr, t_perm, t_indices


def block_scratch(num_nodes: int) -> np.ndarray:
    """Scratch for :func:`build_block` (one per thread building blocks)."""
    return np.full(num_nodes, -1, dtype=np.int32 if num_nodes < 2**31 else np.int64)


def build_block(indptr: np.ndarray, indices: np.ndarray, in_deg: np.ndarray,
                dst_start: int, dst_stop: int, dtype: torch.dtype = torch.float32,
                src_ids: np.ndarray | None = None, scratch: np.ndarray | None = None,
                parallel: bool = False) -> Block:
    """Cut the block of destinations ``[dst_start, dst_stop)`` out of a global CSC.

    Args:
        indptr: global CSC row pointer (int64).
        indices: global CSC sources.
        in_deg: global in-degree of every vertex.
        dst_start, dst_stop: the chunk's destination range.
        dtype: floating type of the degree tensors.
        src_ids: the source rows, sorted and unique, holding every source of
            the range (``ValueError`` if one is missing); default: exactly the
            chunk's neighbours, found here. Pass them when already known (the
            plan's neighbour sets), or ``np.arange(N)`` for a full-graph block
            whose source buffer is the whole ``h``.
        scratch: :func:`block_scratch` of the graph, reused across calls
            (default: a new one).
        parallel: cut it on all threads (for a block too big to build
            alone while others are built beside it); the same arrays.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices)
    pos = block_scratch(indptr.shape[0] - 1) if scratch is None else scratch
    if src_ids is None and parallel:  # distinct sources from a bitmap on all threads
        e0, e1 = indptr[dst_start], indptr[dst_stop]
        _, src_ids = unique_union(indices, np.array([0, 1]), np.array([e0]), np.array([e1]),
                                  indptr.shape[0] - 1, sets=True)
    elif src_ids is None:
        src_ids = _block_sources(indptr, indices, int(dst_start), int(dst_stop), pos)
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    if parallel:
        local, row_ptr, t_indptr, t_perm, t_indices = _block_arrays_parallel(
            indptr, indices, int(dst_start), int(dst_stop), src_ids, pos,
            numba.get_num_threads())
    else:
        local, row_ptr, t_indptr, t_perm, t_indices = _block_arrays(
            indptr, indices, int(dst_start), int(dst_stop), src_ids, pos)
    deg = np.asarray(in_deg)
    return Block(
        indptr=torch.from_numpy(row_ptr),
        indices=torch.from_numpy(local.astype(np.int64, copy=False)),
        t_indptr=torch.from_numpy(t_indptr),
        t_indices=torch.from_numpy(t_indices),
        t_perm=torch.from_numpy(t_perm),
        src_ids=torch.from_numpy(src_ids),
        src_in_deg=torch.from_numpy(deg[src_ids]).to(dtype),
        dst_in_deg=torch.from_numpy(deg[dst_start:dst_stop]).to(dtype),
        dst_start=int(dst_start),
        edge_start=int(indptr[dst_start]),
    )
