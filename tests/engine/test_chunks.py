"""Chunk blocks: cut from the plan's neighbour sets or found per block, the same blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hongtu.dedup import neighbour_sets
from hongtu.engine import ChunkSet
from hongtu.engine import chunks as chunks_mod
from hongtu.partition import chunk_partition
from tests.cases import CASES


def same_blocks(a: ChunkSet, b: ChunkSet) -> None:
    assert (a.num_parts, a.num_chunks, a.row0) == (b.num_parts, b.num_chunks, b.row0)
    for x, y in zip(a.blocks, b.blocks):
        assert (x is None) == (y is None)
        if x is not None:
            assert all(torch.equal(s, t) for s, t in zip(x.tensors(), y.tensors()))
            assert (x.dst_start, x.edge_start) == (y.dst_start, y.edge_start)


@pytest.mark.parametrize("case", ["isolated", "skewed", "halo_heavy"])
@pytest.mark.parametrize("parts,chunks,part", [(1, 1, None), (1, 4, None), (2, 3, None),
                                               (2, 3, 1)])
@pytest.mark.parametrize("lone", [False, True])
def test_blocks_from_the_plans_sources(case, parts, chunks, part, lone, monkeypatch):
    """Given the neighbour sets, ChunkSet.build gives the blocks it finds alone, on the
    thread pool and (a lone block: ``lone``) cut on all threads."""
    if lone:  # every graph here counts as big enough to cut one block on all threads
        monkeypatch.setattr(chunks_mod, "_PARALLEL_EDGES", 0)
    g = CASES[case](seed=2)
    p = chunk_partition(g, np.arange(g.num_nodes) % parts, chunks, num_parts=parts)
    g = p.apply(g)
    found = ChunkSet.build(g, p.chunk_ptr, parts, chunks, part=part)
    nb = neighbour_sets(g.indptr, g.indices, p.chunk_ptr)
    given = ChunkSet.build(g, p.chunk_ptr, parts, chunks, part=part, sources=nb)
    same_blocks(given, found)
    for c, blk in enumerate(given.blocks):
        if blk is not None:
            assert np.array_equal(blk.src_ids.numpy(), nb[1][nb[0][c]:nb[0][c + 1]])
