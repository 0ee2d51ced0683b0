r"""Level 2 of the partitioner and the renumbering (HongTu §4.1).

Given the part of every vertex, each part keeps its vertices in their
original relative order and is cut into ``n`` contiguous chunks of about
equal in-edge count (running sum of :math:`d_{in}(v) + 1`). Vertices are then
renumbered so that chunk ``(i, j)`` is the id range
``[chunk_ptr[i*n + j], chunk_ptr[i*n + j + 1])`` and part ``i`` is
``[part_ptr[i], part_ptr[i+1])``: a chunk's destinations, and so its in-edges
in the renumbered CSC, are one contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.partition.assign import OffsetPrefix, assign_parts, prefix_cuts

__all__ = ["Chunker", "Partition", "chunk_partition", "partition_graph"]


@dataclass
class Partition:
    r"""A 2-level partition plus the renumbering it implies.

    Args:
        num_parts: number of parts ``m``.
        num_chunks: chunks per part ``n``.
        perm: int64, new id -> original id.
        inv: int64, original id -> new id (``inv[perm[k]] == k``).
        part_ptr: int64 ``(m + 1,)``; part ``i`` is new ids
            ``[part_ptr[i], part_ptr[i+1])``.
        chunk_ptr: int64 ``(m * n + 1,)``; chunk ``(i, j)`` is new ids
            ``[chunk_ptr[i*n + j], chunk_ptr[i*n + j + 1])``.
        method: level-1 method that produced the parts.
        seed: seed given to that method.

    Example::

        >>> p = partition_graph(graph, parts=2, chunks=4, method="range")
        >>> g = p.apply(graph)              # renumbered graph
        >>> start, stop = p.chunk_range(1, 0)
        >>> h = p.to_original(h_new)        # rows back in the user's order
    """

    num_parts: int
    num_chunks: int
    perm: np.ndarray
    inv: np.ndarray
    part_ptr: np.ndarray
    chunk_ptr: np.ndarray
    method: str
    seed: int = 0

    @property
    def num_nodes(self) -> int:
        return int(self.perm.shape[0])

    def apply(self, graph: Graph) -> Graph:
        """The graph renumbered so that every chunk is a contiguous id range."""
        if graph.num_nodes != self.num_nodes:
            raise UserError(f"partition is for {self.num_nodes} vertices but the graph has "
                            f"{graph.num_nodes}; partition this graph again")
        return graph.permute(self.perm, self.inv)

    def chunk_range(self, i: int, j: int) -> tuple[int, int]:
        """``(start, stop)`` new ids of chunk ``j`` of part ``i``."""
        if not (0 <= i < self.num_parts and 0 <= j < self.num_chunks):
            raise IndexError(f"chunk ({i}, {j}) outside {self.num_parts} parts x "
                             f"{self.num_chunks} chunks")
        c = i * self.num_chunks + j
        return int(self.chunk_ptr[c]), int(self.chunk_ptr[c + 1])

    def part_range(self, i: int) -> tuple[int, int]:
        """``(start, stop)`` new ids of part ``i``."""
        if not 0 <= i < self.num_parts:
            raise IndexError(f"part {i} outside {self.num_parts} parts")
        return int(self.part_ptr[i]), int(self.part_ptr[i + 1])

    def to_original(self, values: np.ndarray) -> np.ndarray:
        """Reorder rows indexed by new id into the user's original order."""
        values = np.asarray(values)
        if values.shape[0] != self.num_nodes:
            raise ValueError(f"{values.shape[0]} rows for {self.num_nodes} vertices")
        return values[self.inv]

    def assignment(self) -> tuple[np.ndarray, np.ndarray]:
        """``(part, chunk)`` of every original vertex, chunk numbered within its part."""
        flat = np.repeat(np.arange(self.num_parts * self.num_chunks, dtype=np.int64),
                         np.diff(self.chunk_ptr))[self.inv]
        return flat // self.num_chunks, flat % self.num_chunks


class Chunker:
    r"""Level 2 for one assignment, for any number of chunks per part.

    The renumbering (a stable sort of the vertices by part) and the vertex
    weights do not depend on the chunk count, so they are computed once here
    and shared by every :meth:`cut` (the memory planner tries several counts).

    Args:
        graph: the graph in the user's ids.
        assignment: part of every vertex (length ``N``, values in ``[0, m)``).
        num_parts: ``m``; defaults to ``assignment.max() + 1``.
        method: recorded in the partitions cut.
        seed: recorded in the partitions cut.

    Example::

        >>> chunker = Chunker(graph, assign_parts(graph, 2, "range"))
        >>> chunker.cut(8).chunk_ptr.shape
        (17,)
    """

    def __init__(self, graph: Graph, assignment: np.ndarray, num_parts: int | None = None, *,
                 method: str = "given", seed: int = 0) -> None:
        n_nodes = graph.num_nodes
        assignment = np.asarray(assignment)
        if assignment.shape != (n_nodes,):
            raise ValueError(f"assignment has shape {assignment.shape}, expected ({n_nodes},)")
        if num_parts is None:
            num_parts = int(assignment.max()) + 1 if n_nodes else 1
        if n_nodes and (assignment.min() < 0 or assignment.max() >= num_parts):
            raise ValueError(f"assignment has part ids outside 0..{num_parts - 1}")
        self.num_parts, self.method, self.seed = int(num_parts), method, int(seed)
        # Stable sort: within a part, vertices keep their original relative order.
        ordered = n_nodes == 0 or bool(np.all(assignment[1:] >= assignment[:-1]))
        #: the parts are already in id order: ``perm`` is the identity
        self.ordered = ordered
        if ordered:  # one part, or range parts: no renumbering (perm is its own inverse)
            self.part_sizes = np.diff(np.searchsorted(
                assignment, np.arange(self.num_parts + 1), side="left")).astype(np.int64)
            self.perm = self.inv = np.arange(n_nodes, dtype=np.int64)
        else:
            self.part_sizes = np.bincount(assignment, minlength=self.num_parts)
            if self.num_parts <= 16:  # a pass per part beats a sort
                self.perm = np.concatenate([np.flatnonzero(assignment == i)
                                            for i in range(self.num_parts)]).astype(np.int64)
            else:
                self.perm = np.argsort(assignment, kind="stable").astype(np.int64)
            self.inv = np.empty(n_nodes, dtype=np.int64)
            self.inv[self.perm] = np.arange(n_nodes, dtype=np.int64)
        self.part_ptr = np.zeros(self.num_parts + 1, dtype=np.int64)
        np.cumsum(self.part_sizes, out=self.part_ptr[1:])
        # Each part's running weight (in-edges plus one per vertex), summed once
        # for every count cut; in id order that is the in-edge offsets plus ids.
        indptr = np.asarray(graph.indptr, dtype=np.int64)
        if not ordered:
            cum = np.zeros(n_nodes + 1, dtype=np.int64)
            np.cumsum(np.diff(indptr)[self.perm] + 1, out=cum[1:])
        self._prefix = []
        for i in range(self.num_parts):
            a, b = int(self.part_ptr[i]), int(self.part_ptr[i + 1])
            if ordered:
                prefix = OffsetPrefix(indptr, a, b)  # (not written out: big graphs)
            else:
                prefix = cum[a:b + 1] - cum[a]
            self._prefix.append(prefix)

    def cut(self, num_chunks: int) -> Partition:
        """Each part cut into ``num_chunks`` chunks of about equal in-edge count.

        Raises:
            UserError: ``num_chunks`` is not a positive integer, or a part has
                fewer vertices.
        """
        if not isinstance(num_chunks, (int, np.integer)) or num_chunks < 1:
            raise UserError(f"number of chunks must be a positive integer, got {num_chunks!r}")
        m, n = self.num_parts, int(num_chunks)
        if self.part_sizes.min() < n:
            i = int(np.argmin(self.part_sizes))
            raise UserError(f"part {i} has {int(self.part_sizes[i])} vertices, fewer than the "
                            f"{n} chunks asked per part; set engine.chunks <= "
                            f"{int(self.part_sizes[i])} or use fewer parts")
        chunk_ptr = np.empty(m * n + 1, dtype=np.int64)
        for i in range(m):
            chunk_ptr[i * n:(i + 1) * n + 1] = self.part_ptr[i] + prefix_cuts(self._prefix[i], n)
        return Partition(num_parts=m, num_chunks=n, perm=self.perm, inv=self.inv,
                         part_ptr=self.part_ptr, chunk_ptr=chunk_ptr, method=self.method,
                         seed=self.seed)


def chunk_partition(graph: Graph, assignment: np.ndarray, num_chunks: int,
                    num_parts: int | None = None, *, method: str = "given",
                    seed: int = 0) -> Partition:
    r"""Level 2: cut each part of a given assignment into balanced chunks.

    Args:
        graph: the graph in the user's ids.
        assignment: part of every vertex (length ``N``, values in ``[0, m)``).
        num_chunks: chunks per part ``n``.
        num_parts: ``m``; defaults to ``assignment.max() + 1``.
        method: recorded in the result.
        seed: recorded in the result.

    Returns:
        The :class:`Partition` (see :class:`Chunker` to cut one assignment
        for several chunk counts).

    Raises:
        UserError: a part has fewer vertices than ``num_chunks``.
    """
    return Chunker(graph, assignment, num_parts, method=method, seed=seed).cut(num_chunks)


def partition_graph(graph: Graph, parts: int, chunks: int, method: str = "metis",
                    seed: int = 0, cache_dir: str | None = None) -> Partition:
    r"""Two-level partition: ``parts`` parts (cached), each cut into ``chunks`` chunks.

    Level 1 (:func:`assign_parts`) is the expensive step and is cached on
    disk, so trying other chunk counts only repeats the cheap level 2.

    Args:
        graph: the graph in the user's ids.
        parts: number of parts ``m``.
        chunks: chunks per part ``n``.
        method: ``'metis'`` (default), ``'range'`` or ``'random'``.
        seed: seed for METIS and ``random``.
        cache_dir: on-disk cache directory; ``None`` disables caching.

    Returns:
        The :class:`Partition`.

    Example::

        >>> p = partition_graph(graph, parts=4, chunks=8, cache_dir="cache")
        >>> p.chunk_ptr.shape
        (33,)
    """
    # Fail before the expensive level 1 when no assignment could give every
    # part `chunks` vertices.
    if not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise UserError(f"number of chunks must be a positive integer, got {chunks!r}")
    if isinstance(parts, (int, np.integer)) and parts >= 1 and graph.num_nodes < parts * chunks:
        raise UserError(f"{parts} parts x {chunks} chunks need at least {parts * chunks} vertices "
                        f"but the graph has {graph.num_nodes}; use fewer parts or chunks")
    assignment = assign_parts(graph, parts, method=method, seed=seed, cache_dir=cache_dir)
    return chunk_partition(graph, assignment, chunks, num_parts=parts, method=method, seed=seed)
