"""Graph ops against dense references, gradients by finite differences, dropout streams."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hongtu.nn import ops
from hongtu.nn.block import Block, block_scratch, build_block

# ------------------------------------------------------------------ fixtures


def random_csc(num_nodes: int, seed: int = 0, max_in: int = 5,
               duplicates: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random CSC with isolated destinations, self-loops and (optionally) repeated sources.

    Returns ``(indptr, indices, in_deg)``; every third vertex has no in-edges,
    every fourth a self-loop, and with ``duplicates`` vertex 1 reads vertex 0 twice.
    """
    rng = np.random.default_rng(seed)
    lists = []
    for v in range(num_nodes):
        if v % 3 == 2:
            lists.append(np.zeros(0, dtype=np.int64))
            continue
        k = int(rng.integers(1, max_in + 1))
        src = (rng.integers(0, num_nodes, size=k) if duplicates
               else rng.choice(num_nodes, size=min(k, num_nodes), replace=False))
        if v % 4 == 0 and v not in src:
            src = np.append(src, v)
        if duplicates and v == 1:
            src = np.append(src, [0, 0])
        lists.append(np.sort(src).astype(np.int64))
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum([len(s) for s in lists], out=indptr[1:])
    indices = np.concatenate(lists)
    return indptr, indices, np.diff(indptr).astype(np.float64)


def dense_adjacency(block: Block, values: torch.Tensor) -> torch.Tensor:
    """``A[v, u] = sum of values of edges u -> v`` (local ids), parallel edges summed."""
    a = torch.zeros(block.num_dst, block.num_src, dtype=values.dtype)
    return a.index_put_((block.edge_dst(), block.indices), values, accumulate=True)


def segment_reference(block: Block, fn, t: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` applied to each destination's edge rows, one destination at a time."""
    ptr = block.indptr.tolist()
    return [fn(t[ptr[v]:ptr[v + 1]]) for v in range(block.num_dst)]


N = 23
CSC = random_csc(N, seed=1)


def blocks() -> list[tuple[str, Block]]:
    indptr, indices, deg = CSC
    empty_dst = next(v for v in range(N) if indptr[v] == indptr[v + 1])
    return [
        ("full", build_block(indptr, indices, deg, 0, N, dtype=torch.float64)),
        ("middle", build_block(indptr, indices, deg, 7, 16, dtype=torch.float64)),
        ("no-edges", build_block(indptr, indices, deg, empty_dst, empty_dst + 1,
                                 dtype=torch.float64)),
        ("no-dst", build_block(indptr, indices, deg, 5, 5, dtype=torch.float64)),
    ]


BLOCKS = blocks()
BLOCK_IDS = [name for name, _ in BLOCKS]


@pytest.fixture(params=[b for _, b in BLOCKS], ids=BLOCK_IDS)
def block(request) -> Block:
    b = request.param
    b._cache.clear()
    return b


def test_fixture_covers_the_cases():
    indptr, indices, _ = CSC
    dst = np.repeat(np.arange(N), np.diff(indptr))
    assert (np.diff(indptr) == 0).any(), "isolated destinations"
    assert (dst == indices).any(), "self-loops"
    pairs = set()
    dup = False
    for p in zip(dst.tolist(), indices.tolist()):
        dup |= p in pairs
        pairs.add(p)
    assert dup, "parallel edges (duplicate sources)"
    assert BLOCKS[2][1].num_edges == 0 and BLOCKS[3][1].num_dst == 0


def test_block_structure(block):
    e = block.num_edges
    assert block.indptr[-1] == e and block.t_indptr[-1] == e
    assert torch.equal(block.t_perm.sort().values, torch.arange(e))
    # The stored transpose lists the same edges.
    assert torch.equal(block.t_indices, block.edge_dst()[block.t_perm])
    counts = torch.bincount(block.indices, minlength=block.num_src)
    assert torch.equal(block.t_indptr[1:] - block.t_indptr[:-1], counts)
    assert torch.equal(block.dst_in_deg, (block.indptr[1:] - block.indptr[:-1]).double())


# ---------------------------------------------------------------- spmm & co.
@pytest.mark.parametrize("trailing", [(3,), (2, 3)])
def test_spmm_matches_dense(block, trailing):
    torch.manual_seed(0)
    x = torch.randn((block.num_src,) + trailing, dtype=torch.float64)
    w = torch.randn(block.num_edges, dtype=torch.float64)
    out = ops.spmm(block, x, w)
    ref = (dense_adjacency(block, w) @ x.flatten(1)).reshape(out.shape)
    assert out.shape == (block.num_dst,) + trailing
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_spmm_gradcheck(block):
    torch.manual_seed(1)
    x = torch.randn(block.num_src, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(block.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ops.spmm(block, x, w), (x, w))


def test_spmm_gradcheck_multihead():
    block = BLOCKS[1][1]
    torch.manual_seed(2)
    x = torch.randn(block.num_src, 2, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(block.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ops.spmm(block, x, w), (x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 5, 64, 300])
def test_spmm_weight_gradient_on_gpu(block, width):
    """The fused per-edge dot products (float32 on a GPU) match the gathers on CPU,
    for a strided per-head view of the sources as GAT passes."""
    torch.manual_seed(3)
    x = torch.randn(block.num_src, 2, width)
    w = torch.randn(block.num_edges)
    g = torch.randn(block.num_dst, width)
    grads = []
    for dev in ("cpu", "cuda"):
        wd = w.to(dev).detach().requires_grad_(True)
        b = block.to(dev)
        ops.spmm(b, x.to(dev)[:, 1], wd).backward(g.to(dev))
        grads.append(wd.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def expected_weights(block: Block, op: str) -> torch.Tensor:
    """Edge weights of a built-in aggregation from their definitions."""
    deg = torch.from_numpy(CSC[2])
    src = block.src_ids[block.indices]
    dst = block.edge_dst() + block.dst_start
    if op == "sum":
        return torch.ones(block.num_edges, dtype=torch.float64)
    if op == "mean":
        return 1.0 / deg.clamp(min=1)[dst]
    # Degrees clamp at 1: a source without in-edges counts as degree 1.
    deg = deg.clamp(min=1)
    return 1.0 / torch.sqrt(deg[src] * deg[dst])


@pytest.mark.parametrize("op", ops.BUILTIN_AGGREGATIONS)
def test_aggregate_matches_dense(block, op):
    torch.manual_seed(3)
    x = torch.randn(block.num_src, 4, dtype=torch.float64, requires_grad=True)
    a_dense = dense_adjacency(block, expected_weights(block, op))
    out = ops.aggregate(block, x, op)
    torch.testing.assert_close(out, a_dense @ x, rtol=0, atol=1e-12)
    if block.num_dst:
        x2 = x[:, :2].detach().requires_grad_()  # two columns suffice for the gradient
        assert torch.autograd.gradcheck(lambda x: ops.aggregate(block, x, op), (x2,))
    g = torch.randn(block.num_dst, 4, dtype=torch.float64)
    torch.testing.assert_close(ops.aggregate_transpose(block, g, op), a_dense.t() @ g,
                               rtol=0, atol=1e-12)
    if block.num_dst:  # (differentiable too, as a custom layer may call it)
        g2 = g[:, :2].clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda g: ops.aggregate_transpose(block, g, op), (g2,))


@pytest.mark.parametrize("op", ops.BUILTIN_AGGREGATIONS)
def test_aggregate_rows_reads_the_sources_in_place(block, op):
    """The aggregation of sources read from a table of all rows by their global
    ids equals that of the gathered rows."""
    torch.manual_seed(4)
    rows = torch.randn(N, 3, dtype=torch.float64)
    expect = ops.aggregate(block, rows[block.src_ids], op)
    torch.testing.assert_close(ops.aggregate_rows(block, rows, op), expect, rtol=0, atol=1e-12)
    # a table holding source i at row at[i] (a transition buffer's slots)
    at = torch.randperm(block.num_src + 5)[:block.num_src]
    table = torch.randn(block.num_src + 5, 3, dtype=torch.float64)
    expect = ops.aggregate(block, table[at], op)
    torch.testing.assert_close(ops.aggregate_rows(block, table, op, at), expect, rtol=0,
                               atol=1e-12)


def test_mean_of_isolated_destination_is_zero():
    block = BLOCKS[2][1]
    x = torch.randn(block.num_src, 3, dtype=torch.float64)
    assert torch.equal(ops.aggregate(block, x, "mean"), torch.zeros(1, 3, dtype=torch.float64))


@pytest.mark.parametrize("op", ops.BUILTIN_AGGREGATIONS)
def test_transposed_weights_are_the_weights_in_transpose_order(block, op):
    w = ops.edge_weights(block, op, torch.float64)
    wt = ops.edge_weights(block, op, torch.float64, transpose=True)
    assert torch.equal(wt, w[block.t_perm])
    assert ops.edge_weights(block, op, torch.float64, transpose=True) is wt  # cached


@pytest.mark.parametrize("op", ops.BUILTIN_AGGREGATIONS)
def test_aggregate_transpose_reads_no_forward_edges(block, op):
    """A cached layer's backward leaves ``Block.NOT_TRANSPOSED`` in host memory: the
    transposed aggregation must give the same result without them."""
    torch.manual_seed(7)
    g = torch.randn(block.num_dst, 3, dtype=torch.float64)
    expect = ops.aggregate_transpose(block, g, op)
    bad = {f: torch.full_like(getattr(block, f), -(2**40)) for f in Block.NOT_TRANSPOSED}
    stripped = dataclasses.replace(block, **bad, _cache={})
    assert torch.equal(ops.aggregate_transpose(stripped, g, op), expect)


def _float32_blocks(parts: int = 3, seed: int = 5) -> list[Block]:
    """Float32 blocks of a bigger random graph (power-law-ish in-degrees, isolated
    vertices, repeated sources) for the GPU kernels' checks."""
    rng = np.random.default_rng(seed)
    n = 5000
    deg = np.where(rng.random(n) < 0.2, 0, rng.zipf(1.8, n).clip(1, 700))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = rng.integers(0, n, indptr[-1])
    cuts = np.linspace(0, n, parts + 1).astype(int)
    return [build_block(indptr, indices, deg.astype(np.float64), a, b)
            for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gcn", "mean"])
def test_fused_edge_weights_match_the_tensor_ops(op, monkeypatch):
    """One Triton launch per block gives the GPU tensor ops' weights bit for bit, in
    CSR order and in the transpose's; a block with no edges and one with no
    destinations too."""
    pytest.importorskip("triton")
    indptr, indices, deg = CSC
    blocks = _float32_blocks() + [build_block(indptr, indices, deg, 5, 5),
                                 build_block(indptr, indices, deg, 2, 3)]
    fused = [b.to("cuda") for b in blocks]
    for d in fused:
        assert ops.fused_edge_weights(d, torch.float32)
        ops.edge_weights(d, op, torch.float32)
        ops.edge_weights(d, op, torch.float32, transpose=True)
    monkeypatch.setattr(ops, "fused_edge_weights", lambda block, dtype: False)
    for b, d in zip(blocks, fused):
        ref = ops.edge_weights(b.to("cuda"), op, torch.float32)
        assert torch.equal(d._cache[("w", op, torch.float32, False)], ref)
        assert torch.equal(d._cache[("w", op, torch.float32, True)], ref[d.t_perm])


@pytest.mark.gpu
def test_fused_edge_weights_compile_once_for_any_block():
    """Blocks differ in edges and rows every chunk: no kernel compiled per size."""
    pytest.importorskip("triton")
    from hongtu.nn import _triton_weights as K

    blocks = [b.to("cuda") for b in _float32_blocks(parts=5)]
    ops.edge_weights(blocks[0], "gcn", torch.float32)
    caches = getattr(K._weights_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no inspectable kernel cache")
    before = sum(len(c[0]) for c in caches.values())
    for b in blocks[1:]:
        ops.edge_weights(b, "gcn", torch.float32)
        ops.edge_weights(b, "gcn", torch.float32, transpose=True)
    assert sum(len(c[0]) for c in caches.values()) == before


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="built-ins"):
        ops.aggregate(BLOCKS[0][1], torch.zeros(N, 1, dtype=torch.float64), "max")


# -------------------------------------------------------------- edge helpers
def test_gather_and_scatter(block):
    torch.manual_seed(4)
    x_src = torch.randn(block.num_src, 3, dtype=torch.float64)
    x_dst = torch.randn(block.num_dst, 3, dtype=torch.float64)
    torch.testing.assert_close(ops.gather_src(block, x_src), x_src[block.indices])
    torch.testing.assert_close(ops.gather_dst(block, x_dst), x_dst[block.edge_dst()])
    msg = torch.randn(block.num_edges, 3, dtype=torch.float64)
    s = ops.scatter_dst(block, msg, "sum")
    m = ops.scatter_dst(block, msg, "mean")
    zero = torch.zeros(3, dtype=torch.float64)
    ref_s = segment_reference(block, lambda t: t.sum(0), msg)
    ref_m = segment_reference(block, lambda t: t.mean(0) if len(t) else zero, msg)
    assert s.shape == m.shape == (block.num_dst, 3)
    for v in range(block.num_dst):
        torch.testing.assert_close(s[v], ref_s[v], rtol=0, atol=1e-12)
        torch.testing.assert_close(m[v], ref_m[v], rtol=0, atol=1e-12)
    # scatter_dst(mean) over unit messages is aggregate(mean).
    torch.testing.assert_close(ops.scatter_dst(block, ops.gather_src(block, x_src), "mean"),
                               ops.aggregate(block, x_src, "mean"), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="reduce"):
        ops.scatter_dst(block, msg, "max")


@pytest.mark.parametrize("heads", [None, 3])
def test_edge_softmax(block, heads):
    torch.manual_seed(5)
    shape = (block.num_edges,) if heads is None else (block.num_edges, heads)
    scores = (torch.randn(shape, dtype=torch.float64) * 5).requires_grad_()
    alpha = ops.edge_softmax(block, scores)
    assert alpha.shape == scores.shape
    sums = ops.scatter_dst(block, alpha, "sum")
    has_edges = block.dst_in_deg > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]))
    ref = segment_reference(block, lambda t: torch.softmax(t, dim=0), scores.detach())
    if block.num_edges:
        torch.testing.assert_close(alpha.detach(), torch.cat(ref), rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(lambda s: ops.edge_softmax(block, s), (scores,))


def test_edge_softmax_matches_dense_masked_softmax():
    indptr, indices, deg = random_csc(17, seed=7, duplicates=False)
    block = build_block(indptr, indices, deg, 0, 17, dtype=torch.float64)
    torch.manual_seed(6)
    scores = torch.randn(block.num_edges, dtype=torch.float64) * 3
    dense = torch.full((block.num_dst, block.num_src), float("-inf"), dtype=torch.float64)
    dense[block.edge_dst(), block.indices] = scores
    rows = block.dst_in_deg > 0
    soft = torch.zeros_like(dense)
    soft[rows] = torch.softmax(dense[rows], dim=1)
    alpha = ops.edge_softmax(block, scores)
    torch.testing.assert_close(alpha, soft[block.edge_dst(), block.indices], rtol=0, atol=1e-12)


def test_edge_softmax_is_shift_stable():
    block = BLOCKS[0][1]
    scores = torch.randn(block.num_edges, dtype=torch.float64)
    big = ops.edge_softmax(block, scores + 1000.0)
    assert torch.isfinite(big).all()
    torch.testing.assert_close(big, ops.edge_softmax(block, scores), rtol=0, atol=1e-12)


# ------------------------------------------------------------------- dropout
def test_dropout_mask_depends_on_id_only():
    ids = torch.arange(1000, 1400)
    full = ops.dropout_mask(ids, 7, 0.5, seed=1234)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    subset = perm[:150]
    assert torch.equal(ops.dropout_mask(ids[perm], 7, 0.5, seed=1234), full[perm])
    assert torch.equal(ops.dropout_mask(ids[subset], 7, 0.5, seed=1234), full[subset])
    x = torch.ones(len(ids), 7)
    out_full = ops.dropout(x, ids, 0.5, seed=1234)
    out_sub = ops.dropout(x[subset], ids[subset], 0.5, seed=1234)
    assert torch.equal(out_sub, out_full[subset])


def test_dropout_different_seed_different_mask():
    ids = torch.arange(5000)
    a = ops.dropout_mask(ids, 4, 0.5, seed=1)
    b = ops.dropout_mask(ids, 4, 0.5, seed=2)
    c = ops.dropout_mask(ids, 4, 0.5, seed=1 + (1 << 40))  # high bits of a 63-bit seed matter
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert 0.4 < (a == b).double().mean() < 0.6


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_fraction_and_scale(p):
    ids = torch.arange(10_000, 20_000) * 7919  # sparse, large global ids
    x = torch.ones(len(ids), 10, dtype=torch.float64)
    out = ops.dropout(x, ids, p, seed=99)
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - p) < 0.02
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (1.0 - p)))
    # Columns draw independent bits: no column is all-kept or all-dropped.
    per_col = (out == 0).double().mean(0)
    assert ((per_col - p).abs() < 0.05).all()


def test_dropout_identity_when_off():
    x = torch.randn(50, 3)
    ids = torch.arange(50)
    assert ops.dropout(x, ids, 0.5, seed=3, training=False) is x
    assert ops.dropout(x, ids, 0.0, seed=3) is x
    empty = torch.zeros(0, 3)
    assert ops.dropout(empty, ids[:0], 0.5, seed=3).shape == (0, 3)


def test_dropout_multidim_rows():
    ids = torch.arange(300)
    x = torch.ones(300, 2, 3)
    out = ops.dropout(x, ids, 0.3, seed=5)
    mask = ops.dropout_mask(ids, 6, 0.3, seed=5).view(300, 2, 3)
    torch.testing.assert_close(out, mask.float() / 0.7)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("training", [True, False])
def test_dropout_into_puts_dropped_rows_at_their_slots(dev, p, training):
    """``out[at] = dropout(x)`` bit for bit, from rows in order (a staging area) and
    in place (rows read at their slots); on a GPU (float32) one Triton kernel."""
    torch.manual_seed(6)
    i, a = torch.randperm(10_000)[:300].to(dev), torch.randperm(400)[:300].to(dev)
    x = torch.randn(300, 37, device=dev)
    expect = torch.zeros(400, 37, device=dev)
    expect[a] = ops.dropout(x, i, p, 9, training)
    out = torch.zeros(400, 37, device=dev)
    ops.dropout_into(x, i, p, 9, out, a, training=training)
    assert torch.equal(out.view(torch.int32), expect.view(torch.int32))
    table = torch.zeros(400, 37, device=dev)
    table[a] = x
    ops.dropout_into(table, i, p, 9, table, a, x_at=a, training=training)
    assert torch.equal(table.view(torch.int32), expect.view(torch.int32))


def numpy_cut(indptr, indices, a, b, src_ids):
    """The block arrays of destinations ``[a, b)`` over ``src_ids``, by sorting."""
    e0, e1 = indptr[a], indptr[b]
    local = np.searchsorted(src_ids, indices[e0:e1].astype(np.int64))
    row_ptr = indptr[a:b + 1] - e0
    t_perm = np.argsort(local, kind="stable")
    t_indptr = np.zeros(src_ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(local, minlength=src_ids.shape[0]), out=t_indptr[1:])
    t_indices = np.repeat(np.arange(b - a), np.diff(row_ptr))[t_perm]
    return {"indptr": row_ptr, "indices": local, "t_indptr": t_indptr, "t_indices": t_indices,
            "t_perm": t_perm, "src_ids": src_ids}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_block_kernel_equals_the_numpy_cut(parallel, dtype):
    """The numba cuts (distinct sources by stamping or from a bitmap, or given; the
    transpose by a counting sort, serial or split by source over the threads) give
    the block that sorting gives: sources from np.unique, the transpose by a stable
    argsort."""
    rng = np.random.default_rng(0)
    n, e = 300, 4000
    indices = rng.integers(0, n, e).astype(dtype)
    indices[::9] = indices[1::9][: indices[::9].shape[0]]  # repeated sources
    indptr = np.zeros(n + 1, dtype=np.int64)
    indptr[1:] = np.sort(rng.integers(0, e + 1, n))
    indptr[-1] = e
    deg = np.diff(indptr).astype(np.float64)
    scratch = block_scratch(n)
    for a, b in [(0, n), (10, 11), (37, 200), (5, 5)]:
        exact = np.unique(indices[indptr[a]:indptr[b]]).astype(np.int64)
        for given in (None, exact.astype(dtype), np.arange(n)):  # found, the plan's, a superset
            fast = build_block(indptr, indices, deg, a, b, src_ids=given, scratch=scratch,
                               parallel=parallel)
            want = numpy_cut(indptr, indices, a, b, exact if given is None else given)
            for f, v in want.items():
                assert np.array_equal(getattr(fast, f).numpy(), v), (a, b, f, given is None)
            assert np.array_equal(fast.src_in_deg.numpy(), deg[want["src_ids"]])
            assert np.array_equal(fast.dst_in_deg.numpy(), deg[a:b])
            assert np.all(scratch == -1)  # scratch left clean for the next block
    lacking = np.unique(indices[indptr[37]:indptr[200]])[1:]
    with pytest.raises(ValueError, match="lacks a source"):
        build_block(indptr, indices, deg, 37, 200, src_ids=lacking, scratch=scratch,
                    parallel=parallel)
    assert np.all(scratch == -1)


def test_spmm_with_more_repeated_edges_than_cells():
    """A block whose repeated edges outnumber its matrix cells (cuSPARSE refuses to
    build such a CSR) still aggregates and differentiates exactly."""
    indptr = np.array([0, 0, 4, 6], dtype=np.int64)  # vertex 1 <- 0 x3, 2; vertex 2 <- 0 x2
    indices = np.array([0, 0, 0, 2, 0, 0], dtype=np.int64)
    deg = np.diff(indptr).astype(np.float64)
    for a, b in [(1, 2), (2, 3), (1, 3)]:
        block = build_block(indptr, indices, deg, a, b, dtype=torch.float64)
        assert block.num_edges > block.num_dst * block.num_src
        x = torch.randn(block.num_src, 3, dtype=torch.float64, requires_grad=True)
        w = torch.rand(block.num_edges, dtype=torch.float64, requires_grad=True)
        dense = torch.zeros(block.num_dst, block.num_src, dtype=torch.float64)
        dense = dense.index_put((block.edge_dst(), block.indices), w, accumulate=True)
        assert torch.allclose(ops.spmm(block, x, w), dense @ x)
        assert torch.autograd.gradcheck(lambda x, w, b=block: ops.spmm(b, x, w), (x, w))


@pytest.mark.gpu
def test_cuda_sparse_product_writes_every_row():
    """On a GPU the product's output is not zeroed first (beta=0): rows without
    edges are zero and nothing of what the memory held shows, NaN included."""
    indptr = torch.tensor([0, 0, 2, 2, 3, 3], device="cuda")
    indices = torch.tensor([1, 3, 0], device="cuda")
    values = torch.tensor([0.5, 2.0, -1.0], device="cuda")
    x = torch.randn(4, 47, device="cuda")
    dense = torch.zeros(5, 4, device="cuda")
    dense[1, 1], dense[1, 3], dense[3, 0] = 0.5, 2.0, -1.0
    for _ in range(3):
        torch.full((5, 47), float("nan"), device="cuda")  # freed: its memory comes back
        out = ops._csr_mm(indptr, indices, values, x, 5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, dense @ x)
        assert (out[[0, 2, 4]] == 0).all()


@pytest.mark.gpu
def test_cuda_sparse_product_holds_its_output_once():
    """The product is written into its own input: at its peak the device holds
    the output once and cuSPARSE's small buffer (out of place, ``torch.addmm``
    on a CSR matrix allocates its result beside that input and copies it in:
    twice the output)."""
    g = torch.Generator().manual_seed(0)
    n, m, w, e = 20_000, 30_000, 256, 200_000
    rows = torch.sort(torch.randint(0, n, (e,), generator=g)).values
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    indices = torch.randint(0, m, (e,), generator=g).cuda()
    values, indptr = torch.rand(e, generator=g).cuda(), indptr.cuda()
    x = torch.randn(m, w, device="cuda")
    ops._csr_mm(indptr, indices, values, x, n)  # (cuSPARSE's handle made once)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = ops._csr_mm(indptr, indices, values, x, n)
    rise = torch.cuda.max_memory_allocated() - before
    assert out.numel() * 4 <= rise < 1.2 * out.numel() * 4


@pytest.mark.parametrize("bias", [True, False])
def test_linear_has_the_gradients_of_torch_linear(bias):
    """ops.linear: the bias gradient as a matrix-vector product, the same value."""
    torch.manual_seed(0)
    x = torch.randn(50, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True) if bias else None
    g = torch.randn(50, 4, dtype=torch.float64)
    ours = ops.linear(x, w, b)
    ours.backward(g)
    mine = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(g)
    torch.testing.assert_close(ours, ref)
    for got, t in zip(mine, [t for t in (x, w, b) if t is not None]):
        torch.testing.assert_close(got, t.grad)
    w.grad = None
    ops.linear(x.detach(), w, b).sum().backward()  # (inputs needing no gradient)
    assert w.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(ops.linear(x, w, b), ref)
