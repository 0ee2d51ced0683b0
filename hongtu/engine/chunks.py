r"""Chunk blocks: the local graph of every chunk, built once from the partition.

After renumbering, chunk ``(i, j)`` owns the destination range
``chunk_ptr[i*n+j] .. chunk_ptr[i*n+j+1]``; its block holds a local CSR over
the positions of its neighbours ``N_ij`` (sorted global ids) and the transpose.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np
import torch

from hongtu.graph import Graph
from hongtu.nn.block import Block, block_scratch, build_block

__all__ = ["ChunkSet"]

#: threads cutting blocks side by side, at most (each holds a |V| scratch)
_MAX_WORKERS = 16
#: edges from which a lone block is cut on all threads (below, waking them costs more)
_PARALLEL_EDGES = 1 << 20


@dataclass
class ChunkSet:
    """All chunk blocks of a renumbered graph.

    Args:
        blocks: ``blocks[i * n + j]`` is chunk ``(i, j)`` (``None`` for chunks
            of parts this process does not train).
        num_parts: ``m``.
        num_chunks: ``n`` per part.
        chunk_ptr: flat destination boundaries (``m * n + 1``).
        row0: first vertex of the host rows this process owns: chunk ranges
            are reported relative to it (0 when one process owns all rows).
    """

    blocks: list[Block | None]
    num_parts: int
    num_chunks: int
    chunk_ptr: np.ndarray
    row0: int = 0

    @classmethod
    def build(cls, graph: Graph, chunk_ptr: np.ndarray, num_parts: int, num_chunks: int,
              dtype: torch.dtype = torch.float32, part: int | None = None,
              sources: tuple[np.ndarray, np.ndarray] | None = None,
              finish: Callable[[Block], Block] | None = None) -> ChunkSet:
        """Cut the chunks' blocks out of ``graph`` (already renumbered).

        With ``part`` only that part's chunks are built, and ranges are local
        to the part's rows (a rank of a multi-process run). ``sources``: the
        chunks' neighbour sets as CSR ``(ptr, ids)``
        (:func:`hongtu.dedup.neighbour_sets`), when the plan has them already;
        otherwise each block finds its own. ``finish``: applied to each block
        as soon as it is cut, on the thread that cut it, and kept in its place
        (the trainer pins and narrows blocks so: no int64 block waits for the
        others).
        """
        in_deg = graph.in_degree()
        n = num_chunks
        mine = list(range(num_parts * n) if part is None else range(part * n, (part + 1) * n))
        blocks: list[Block | None] = [None] * (num_parts * n)

        def cut(c: int, scratch: np.ndarray, parallel: bool) -> None:
            ids = None if sources is None else sources[1][sources[0][c]:sources[0][c + 1]]
            block = build_block(graph.indptr, graph.indices, in_deg, int(chunk_ptr[c]),
                                int(chunk_ptr[c + 1]), dtype, src_ids=ids, scratch=scratch,
                                parallel=parallel)
            blocks[c] = block if finish is None else finish(block)
        # Blocks are cut by a numba kernel that releases the GIL: a few threads,
        # each with its own |V| scratch, build them side by side. Fewer big
        # blocks than half the threads are each cut on all threads, in turn.
        if 2 * len(mine) <= numba.get_num_threads() and graph.num_edges >= _PARALLEL_EDGES:
            scratch = block_scratch(graph.num_nodes)
            for c in mine:
                cut(c, scratch, parallel=True)
        else:
            workers = max(1, min(len(mine), numba.get_num_threads(), _MAX_WORKERS))

            def build(group: list[int]) -> None:
                scratch = block_scratch(graph.num_nodes)
                for c in group:
                    cut(c, scratch, parallel=False)

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(build, [mine[w::workers] for w in range(workers)]))
        row0 = 0 if part is None else int(chunk_ptr[part * n])
        return cls(blocks, num_parts, n, np.asarray(chunk_ptr, dtype=np.int64), row0)

    def batches(self) -> list[list[int]]:
        """Batch ``j`` = chunk ``j`` of every part (the identity order)."""
        n = self.num_chunks
        return [[i * n + j for i in range(self.num_parts)] for j in range(n)]

    def max_rows(self) -> tuple[int, int]:
        """The most neighbour rows and the most destination rows of any chunk."""
        own = [b for b in self.blocks if b is not None]
        return (max(b.num_src for b in own), max(b.num_dst for b in own))

    def range(self, c: int) -> tuple[int, int]:
        """Chunk ``c``'s destination rows in this process's host buffers."""
        return int(self.chunk_ptr[c]) - self.row0, int(self.chunk_ptr[c + 1]) - self.row0
