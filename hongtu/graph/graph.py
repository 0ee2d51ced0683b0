r"""The :class:`Graph` container: in-edge CSC structure plus vertex data.

Edges are stored by destination (CSC): the in-neighbours (sources) of vertex
``v`` are ``indices[indptr[v]:indptr[v + 1]]``. This is the layout a GNN
layer aggregates over, and the layout chunks are cut from: a contiguous range
of destinations owns one contiguous range of edges.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np

from hongtu.errors import UserError

__all__ = ["Graph", "index_dtype", "csc_from_edges"]

# int32 indices halve the memory of the largest array as long as ids fit.
_INT32_LIMIT = np.iinfo(np.int32).max


def index_dtype(num_nodes: int) -> np.dtype:
    """Smallest id type able to hold ``num_nodes`` vertex ids (int32 or int64)."""
    return np.dtype(np.int32) if num_nodes <= _INT32_LIMIT else np.dtype(np.int64)


def csc_from_edges(src: np.ndarray, dst: np.ndarray,
                   num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Build ``(indptr, indices)`` of the in-edge CSC from parallel edge arrays.

    Edges are grouped by destination with a counting sort (linear time: one
    bincount, one scatter), so within one destination the sources keep their
    input order. Ids must already be in range.

    Args:
        src: source id of each edge.
        dst: destination id of each edge.
        num_nodes: number of vertices; every id must be below it.

    Returns:
        ``indptr`` (int64, ``num_nodes + 1``) and ``indices`` (int32 or int64).
    """
    from hongtu.graph._kernels import bucket_fill

    dst = np.ascontiguousarray(dst)
    counts = np.bincount(dst, minlength=num_nodes).astype(np.int64)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.empty(dst.shape[0], dtype=index_dtype(num_nodes))
    bucket_fill(np.ascontiguousarray(src), dst, indptr, indices)
    return indptr, indices


@dataclass
class Graph:
    r"""A directed graph with vertex features, labels and split masks.

    Args:
        indptr: int64 array of length ``num_nodes + 1``; the in-edges of
            vertex ``v`` are positions ``indptr[v]:indptr[v+1]`` of ``indices``.
        indices: source vertex of each in-edge (int32 when ids fit, else int64).
        x: vertex features, ``(num_nodes, F)`` float32; may be a ``np.memmap``.
        y: integer labels, ``(num_nodes,)``; ``None`` for an unlabelled graph.
        train_mask, val_mask, test_mask: boolean ``(num_nodes,)`` split masks.
        name: a label used in logs and reports.

    Shapes:
        ``E = indptr[-1]`` edges, ``N = len(indptr) - 1`` vertices.

    Example::

        >>> g = Graph.from_edge_index(np.array([[0, 1], [1, 2]]), num_nodes=3)
        >>> g.in_degree().tolist()
        [0, 1, 1]
    """

    indptr: np.ndarray
    indices: np.ndarray
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    train_mask: np.ndarray | None = None
    val_mask: np.ndarray | None = None
    test_mask: np.ndarray | None = None
    name: str = "graph"
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_edge_index(cls, edge_index: np.ndarray, num_nodes: int, **data) -> Graph:
        """Build from a ``2 × E`` array (row 0 source, row 1 destination)."""
        edge_index = np.asarray(edge_index)
        indptr, indices = csc_from_edges(edge_index[0], edge_index[1], num_nodes)
        return cls(indptr=indptr, indices=indices, **data)

    # ------------------------------------------------------------- properties
    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indptr[-1])

    @property
    def num_features(self) -> int:
        return 0 if self.x is None else int(self.x.shape[1])

    @property
    def num_classes(self) -> int:
        return 0 if self.y is None or self.y.size == 0 else int(self.y.max()) + 1

    def in_degree(self) -> np.ndarray:
        """In-degree of every vertex (int64)."""
        return np.diff(self.indptr)

    def out_degree(self) -> np.ndarray:
        """Out-degree of every vertex (int64)."""
        return np.bincount(self.indices, minlength=self.num_nodes).astype(np.int64)

    def dst(self) -> np.ndarray:
        """Destination of each edge, aligned with ``indices``."""
        return np.repeat(np.arange(self.num_nodes, dtype=self.indices.dtype), self.in_degree())

    def edge_index(self) -> np.ndarray:
        """The ``2 × E`` edge array (row 0 source, row 1 destination)."""
        return np.stack([self.indices, self.dst()])

    def __repr__(self) -> str:
        return (
            f"Graph(name={self.name!r}, num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"num_features={self.num_features}, num_classes={self.num_classes})"
        )

    # -------------------------------------------------------------- transform
    def permute(self, perm: np.ndarray, inv: np.ndarray | None = None) -> Graph:
        """Renumber vertices: new vertex ``k`` is old vertex ``perm[k]``.

        Edges keep their per-destination order; vertex data is reordered, so
        ``permute(perm).x[k] == x[perm[k]]``. ``inv`` (old id -> new id) is
        computed when not given. The identity (one part, range parts) returns
        this graph itself where its ``indptr`` is already what renumbering
        makes (int64 from 0, every edge used): nothing is copied (R-MAT 2^24's
        1.1 GB of edges took 0.55-0.65 s to renumber on 16 cores).
        """
        from hongtu.graph._kernels import is_identity

        perm = np.asarray(perm, dtype=np.int64)
        n = self.num_nodes
        if perm.shape != (n,):
            raise ValueError(f"permutation has shape {perm.shape}, expected ({n},)")
        if (self.indptr.dtype == np.int64 and int(self.indptr[0]) == 0
                and int(self.indptr[-1]) == self.indices.shape[0] and is_identity(perm)):
            return self
        if inv is None:
            inv = np.empty(n, dtype=self.indices.dtype)
            inv[perm] = np.arange(n, dtype=self.indices.dtype)
        deg = self.in_degree()[perm]
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(deg, out=indptr[1:])
        indices = _gather_ranges(self.indices, self.indptr, perm, indptr, relabel=inv)

        def take(a):
            return None if a is None else np.asarray(a)[perm]

        return replace(
            self, indptr=indptr, indices=indices, x=take(self.x), y=take(self.y),
            train_mask=take(self.train_mask), val_mask=take(self.val_mask),
            test_mask=take(self.test_mask), _fingerprint=None,
        )

    def fingerprint(self, structure_only: bool = False) -> str:
        """A content hash for cache keys.

        Args:
            structure_only: hash only ``indptr`` and ``indices`` — what a
                partition depends on — and not the (possibly huge) features.
        """
        if structure_only:
            return _hash_arrays((self.indptr, self.indices))
        if self._fingerprint is None:
            self._fingerprint = _hash_arrays((self.indptr, self.indices, self.x, self.y,
                                              self.train_mask, self.val_mask, self.test_mask))
        return self._fingerprint

    def validate(self, where: str = "graph") -> None:
        """Check structural invariants; raise :class:`UserError` naming ``where``."""
        n = self.num_nodes
        if self.indptr.dtype != np.int64 or self.indptr[0] != 0 or np.any(np.diff(self.indptr) < 0):
            raise UserError(f"{where}: indptr must be int64, start at 0 and never decrease")
        if self.indices.shape != (self.num_edges,):
            raise UserError(f"{where}: {self.indices.shape[0]} edge sources for "
                            f"{self.num_edges} edges")
        if self.num_edges and (self.indices.min() < 0 or self.indices.max() >= n):
            bad = int(np.flatnonzero((self.indices < 0) | (self.indices >= n))[0])
            raise UserError(f"{where}: edge {bad} has source id {int(self.indices[bad])}, "
                            f"outside 0..{n - 1}; vertex ids must be below num_nodes={n}")
        for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
            arr = getattr(self, key)
            if arr is not None and arr.shape[0] != n:
                raise UserError(f"{where}: '{key}' has {arr.shape[0]} rows but the graph has "
                                f"{n} vertices; every per-vertex array needs one row per vertex")


def _hash_arrays(arrays) -> str:
    h = hashlib.blake2b(digest_size=16)
    for arr in arrays:
        if arr is None:
            h.update(b"none")
            continue
        a = np.ascontiguousarray(arr)
        h.update(str((a.dtype.str, a.shape)).encode())
        # Hash in slabs so a memory-mapped array is never read whole.
        flat = a.reshape(-1).view(np.uint8)
        step = 1 << 26
        for s in range(0, flat.size, step):
            h.update(flat[s:s + step])
    return h.hexdigest()


def _gather_ranges(values: np.ndarray, indptr: np.ndarray, order: np.ndarray,
                   new_indptr: np.ndarray, relabel: np.ndarray | None = None) -> np.ndarray:
    """Concatenate ``values[indptr[v]:indptr[v+1]]`` for ``v`` in ``order`` (relabelled)."""
    from hongtu.graph._kernels import gather_ranges

    return gather_ranges(values, indptr, order.astype(np.int64), new_indptr, relabel)
