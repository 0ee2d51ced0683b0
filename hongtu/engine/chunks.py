r"""Chunk blocks: the local graph of every chunk, built once from the partition.

After renumbering, chunk ``(i, j)`` owns the destination range
``chunk_ptr[i*n+j] .. chunk_ptr[i*n+j+1]``; its block holds a local CSR over
the positions of its neighbours ``N_ij`` (sorted global ids) and the transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hongtu.graph import Graph
from hongtu.nn.block import Block, build_block

__all__ = ["ChunkSet"]


@dataclass
class ChunkSet:
    """All chunk blocks of a renumbered graph.

    Args:
        blocks: ``blocks[i * n + j]`` is chunk ``(i, j)``.
        num_parts: ``m``.
        num_chunks: ``n`` per part.
        chunk_ptr: flat destination boundaries (``m * n + 1``).
    """

    blocks: list[Block]
    num_parts: int
    num_chunks: int
    chunk_ptr: np.ndarray

    @classmethod
    def build(cls, graph: Graph, chunk_ptr: np.ndarray, num_parts: int, num_chunks: int,
              dtype: torch.dtype = torch.float32) -> ChunkSet:
        """Cut every chunk's block out of ``graph`` (already renumbered)."""
        in_deg = graph.in_degree()
        blocks = [build_block(graph.indptr, graph.indices, in_deg, int(chunk_ptr[c]),
                              int(chunk_ptr[c + 1]), dtype)
                  for c in range(num_parts * num_chunks)]
        return cls(blocks, num_parts, num_chunks, np.asarray(chunk_ptr, dtype=np.int64))

    def batches(self) -> list[list[int]]:
        """Batch ``j`` = chunk ``j`` of every part (the identity order)."""
        n = self.num_chunks
        return [[i * n + j for i in range(self.num_parts)] for j in range(n)]

    def max_rows(self) -> tuple[int, int]:
        """The most neighbour rows and the most destination rows of any chunk."""
        return (max(b.num_src for b in self.blocks), max(b.num_dst for b in self.blocks))

    def range(self, c: int) -> tuple[int, int]:
        return int(self.chunk_ptr[c]), int(self.chunk_ptr[c + 1])
