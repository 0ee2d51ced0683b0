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

import numpy as np
import torch
from torch import Tensor

__all__ = ["Block", "build_block"]


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
        return self.indices.device

    def dst_ids(self) -> Tensor:
        """Global ids of the destinations (a contiguous range)."""
        return torch.arange(self.dst_start, self.dst_start + self.num_dst, device=self.device)

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

    def edge_src(self) -> Tensor:
        """Local source position of each edge (CSR order)."""
        return self.indices

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Block:
        """A copy with every tensor on ``device`` (the per-pass cache is dropped)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        """Mark every tensor as used on ``stream`` (for blocks copied on another stream)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v.record_stream(stream)

    def pin_memory(self) -> Block:
        """A copy in pinned host memory, so copies to a GPU are DMA transfers."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> Block:
        kw = {}
        for f in fields(self):
            if f.name == "_cache":
                continue
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, Tensor) else v
        return Block(**kw)

    def nbytes(self) -> int:
        """Bytes of the block's tensors (its device footprint before caching)."""
        return sum(getattr(self, f.name).nbytes for f in fields(self)
                   if isinstance(getattr(self, f.name), Tensor))


def build_block(indptr: np.ndarray, indices: np.ndarray, in_deg: np.ndarray,
                dst_start: int, dst_stop: int, dtype: torch.dtype = torch.float32,
                src_ids: np.ndarray | None = None) -> Block:
    """Cut the block of destinations ``[dst_start, dst_stop)`` out of a global CSC.

    Args:
        indptr: global CSC row pointer (int64).
        indices: global CSC sources.
        in_deg: global in-degree of every vertex.
        dst_start, dst_stop: the chunk's destination range.
        dtype: floating type of the degree tensors.
        src_ids: the source rows, sorted; default: exactly the chunk's
            neighbours. Pass ``np.arange(N)`` for a full-graph block whose
            source buffer is the whole ``h``.
    """
    e0, e1 = int(indptr[dst_start]), int(indptr[dst_stop])
    src = np.asarray(indices[e0:e1], dtype=np.int64)
    if src_ids is None:
        src_ids, local = np.unique(src, return_inverse=True)
    else:
        src_ids = np.asarray(src_ids, dtype=np.int64)
        local = np.searchsorted(src_ids, src)
    local = local.astype(np.int64).reshape(-1)
    row_ptr = (np.asarray(indptr[dst_start:dst_stop + 1]) - e0).astype(np.int64)
    num_dst = dst_stop - dst_start
    dst_of_edge = np.repeat(np.arange(num_dst, dtype=np.int64), np.diff(row_ptr))
    t_perm = np.argsort(local, kind="stable").astype(np.int64)
    t_counts = np.bincount(local, minlength=src_ids.shape[0])
    t_indptr = np.zeros(src_ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(t_counts, out=t_indptr[1:])
    deg = np.asarray(in_deg)
    return Block(
        indptr=torch.from_numpy(row_ptr),
        indices=torch.from_numpy(local),
        t_indptr=torch.from_numpy(t_indptr),
        t_indices=torch.from_numpy(dst_of_edge[t_perm]),
        t_perm=torch.from_numpy(t_perm),
        src_ids=torch.from_numpy(src_ids.astype(np.int64)),
        src_in_deg=torch.from_numpy(deg[src_ids]).to(dtype),
        dst_in_deg=torch.from_numpy(deg[dst_start:dst_stop]).to(dtype),
        dst_start=int(dst_start),
        edge_start=e0,
    )
