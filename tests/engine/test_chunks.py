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


@pytest.mark.parametrize("lone", [False, True])
def test_each_block_finished_as_it_is_cut(lone, monkeypatch):
    """``finish`` takes every block once, as it is cut (on the thread pool, or a lone
    block cut on all threads), and its result stands in the block's place: the
    trainer pins and narrows blocks so."""
    from hongtu.engine.pinned import slab_copies
    from hongtu.engine.transfer import pin_blocks

    if lone:
        monkeypatch.setattr(chunks_mod, "_PARALLEL_EDGES", 0)
    g = CASES["skewed"](seed=2)
    p = chunk_partition(g, np.arange(g.num_nodes) % 2, 3, num_parts=2)
    g = p.apply(g)

    def copies(tensors):
        return slab_copies(tensors, lambda n: (torch.zeros(n, dtype=torch.uint8), True))

    seen = []

    def finish(block):
        seen.append(block.dst_start)
        return pin_blocks([block], copies=copies)[0]

    done = ChunkSet.build(g, p.chunk_ptr, 2, 3, part=1, finish=finish)
    plain = ChunkSet.build(g, p.chunk_ptr, 2, 3, part=1)
    assert sorted(seen) == sorted(b.dst_start for b in plain.blocks if b is not None)
    same_blocks(done, ChunkSet(pin_blocks(plain.blocks, copies=copies), 2, 3,
                               plain.chunk_ptr, plain.row0))
    assert all(b.indices.dtype == torch.int32 for b in done.blocks if b is not None)
