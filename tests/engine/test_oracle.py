"""Oracle tests: one out-of-core step == in-memory full-graph training.

For every layer type, chunk count, part count and checkpoint mode, the loss and
every parameter gradient of one step of the chunked executor (float32) equal
a plain in-memory full-graph reference computed in float64.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor

from hongtu.engine import BufferPlan, ChunkSet, Executor, HostBuffers, budget, executor
from hongtu.engine.transfer import BLOCK_LAYOUT, Mover
from hongtu.graph.transforms import has_self_loops
from hongtu.nn import GNN, build_block, layer_seed, ops, resolve_layer
from hongtu.nn.block import Block
from hongtu.nn.model import reference_loss
from hongtu.partition import chunk_partition
from hongtu.reorg import plan_batches
from tests.cases import CASES, NUM_CLASSES, NUM_FEATURES

LAYERS = ["gcn", "sage", "gin", "gat", "examples.edge_weighted_conv:EdgeWeightedConv"]
RTOL = 1e-5
#: a chunked step sums over chunks in another order than the plain step: where
#: float32 rounding alone takes the plain step near RTOL, this many times its error
FP32_SLACK = 4.0


def make_model(layer: str, seed: int = 0, dropout: float = 0.5,
               transform_first: bool = True, keep_dropped: bool = True) -> GNN:
    """Two layers, 6 -> 8 -> 3 wide (GCN's second layer transforms first, the
    others' reads its rows dropped out by the first, as the engine has it)."""
    torch.manual_seed(seed)
    cls = resolve_layer(layer)
    if layer == "gat":
        layers = [cls(NUM_FEATURES, 4, heads=2, concat=True, dropout=dropout),
                  cls(8, NUM_CLASSES, heads=1, concat=False, dropout=dropout)]
    else:
        layers = [cls(NUM_FEATURES, 8), cls(8, NUM_CLASSES)]
    return GNN(layers, dropout=dropout, activation="relu", transform_first=transform_first,
               keep_dropped=keep_dropped)


def masks_of(g):
    return {k: torch.from_numpy(getattr(g, f"{k}_mask")) for k in ("train", "val", "test")}


def chunked_step(model: GNN, graph, parts: int, chunks: int, checkpoint: str, epoch: int = 3,
                 assignment=None, device: str = "cpu", reuse: bool = True, p2p: bool = True,
                 reorg: bool = True, overlap: bool = True, resident: bool = False,
                 cache_rows: int = 0, resident_blocks: bool = True, whole: bool = False,
                 ordered: bool = False, ordered_rows: bool = False, own: bool | None = None,
                 first_in_flushes: bool = True, keep_graphs: bool = False):
    """One executor step on ``graph`` split into ``parts`` x ``chunks`` on ``device``
    (``cache_rows``: spare slots for rows kept across batches; ``whole``: layers
    whose rows fit the transition buffer move them all at once, which on these
    small graphs is every layer, so the plan's row paths are tested without it;
    ``ordered``: the first layer loads from a copy of its inputs in load order;
    ``ordered_rows``: later layers' rows are written in load order in training;
    ``own``: chunks take their own rows from their sources, default where every
    vertex has a self-loop, a layer reads its own rows and ``p2p``, as the
    Trainer has it; ``first_in_flushes``: the first layer's backward may run
    on layer 1's flushes, as the Trainer has it on GPUs; ``keep_graphs``: resident,
    updates keep their autograd graph from forward to backward)."""
    if assignment is None:
        assignment = np.arange(graph.num_nodes) % parts
    p = chunk_partition(graph, assignment, chunks, num_parts=parts)
    g = p.apply(graph)
    cs = ChunkSet.build(g, p.chunk_ptr, parts, chunks)
    cached = model.stored_aggregates(checkpoint)  # (host buffers as the Trainer makes them)
    dev = torch.device(device)
    buf = HostBuffers(BufferPlan(g.num_nodes, model.row_widths(), cached), g.x,
                      pin=dev.type == "cuda", device=dev if resident else None)
    model.to(dev)
    _, plan = plan_batches(g.indptr, g.indices, p.chunk_ptr, parts, chunks, reuse=reuse,
                           p2p=p2p, reorg=reorg, cache_rows=lambda _: cache_rows)
    ex = Executor(model, cs, buf, torch.from_numpy(g.y), masks_of(g), dev, plan.plans[0],
                  checkpoint=checkpoint, seed=0, overlap=overlap,
                  resident_blocks=resident_blocks, whole_layers=whole, ordered_inputs=ordered,
                  ordered_rows=ordered_rows, first_in_flushes=first_in_flushes,
                  keep_graphs=keep_graphs, own_in_sources=own if own is not None else (
                      p2p and any(x.needs_dst for x in model.layers) and has_self_loops(g)))
    ex.transfer_plan = plan
    res = ex.step(epoch)
    return res, g, ex


def held(ex: Executor) -> int:
    """Rows of ∇h^1 the executor's layer 1 backward holds on the device instead
    of flushing them (:func:`~hongtu.engine.executor.gradients_held`)."""
    return executor.held_rows(ex.transfer_plan.plans[0]) if ex._hold else 0


class Reference(dict):
    """Parameter gradients of :func:`reference_step` (float64), and in
    ``fp32_error`` the relative error that the same plain in-memory step in
    float32 makes in each."""

    fp32_error: dict[str, float]


def _plain_step(model: GNN, g, epoch: int, dtype: torch.dtype) -> tuple[float, dict]:
    ref = copy.deepcopy(model).to(dtype).cpu()
    ref.transform_first = ref.keep_dropped = False
    ref.zero_grad(set_to_none=True)
    ref.train()
    block = build_block(g.indptr, g.indices, g.in_degree(), 0, g.num_nodes, dtype,
                        src_ids=np.arange(g.num_nodes))
    seeds = [layer_seed(0, epoch, l) for l in range(ref.num_layers)]
    loss = reference_loss(ref, block, torch.from_numpy(g.x).to(dtype), torch.from_numpy(g.y),
                          torch.from_numpy(g.train_mask), seeds)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def reference_step(model: GNN, g, epoch: int = 3):
    """Plain in-memory full-graph loss and gradients in float64 (every layer
    drops out and aggregates h, whatever the model's transform_first and
    keep_dropped), as ``(loss, Reference)``."""
    loss, grads = _plain_step(model, g, epoch, torch.float64)
    ref = Reference(grads)
    _, single = _plain_step(model, g, epoch, torch.float32)
    ref.fp32_error = {n: _relative_error(single[n], r) for n, r in grads.items()
                      if single.get(n) is not None and r is not None}
    return loss, ref


def _relative_error(g: Tensor, r: Tensor) -> float:
    return float((g.double().cpu() - r).norm() / r.norm().clamp(min=1e-30))


def assert_matches(model: GNN, loss: float, ref_loss: float, ref_grads: dict) -> None:
    """Loss and every parameter gradient within :data:`RTOL` of the float64
    reference, or, for a gradient whose float32 rounding alone comes near that
    (GAT's ``att_dst``: the softmax over a destination's edges cancels its
    term but for LeakyReLU's kink, so what is left is small), within
    :data:`FP32_SLACK` times the error of the plain in-memory float32 step."""
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
    fp32 = getattr(ref_grads, "fp32_error", {})
    for name, p in model.named_parameters():
        err = _relative_error(p.grad, ref_grads[name])
        limit = max(RTOL, FP32_SLACK * fp32.get(name, 0.0))
        assert err <= limit, f"{name}: relative error {err:.2e} (limit {limit:.2e})"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_step_equals_full_graph(case, layer, chunks, checkpoint):
    graph = CASES[case](seed=1)
    model = make_model(layer)
    res, g, _ = chunked_step(model, graph, 1, chunks, checkpoint)
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


@pytest.mark.parametrize("parts,chunks", [(1, 5), (2, 3), (3, 3)])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
@pytest.mark.parametrize("layer", ["sage", "gin", "gat"])
def test_own_rows_come_from_the_sources(layer, checkpoint, parts, chunks):
    """Where every vertex has a self-loop, a chunk's own rows are among its
    sources: layers that gather their sources take them from there instead of
    copying them from host memory, and every layer adds their gradients at
    their slots with the sources' (no own-row adds in host memory). The same
    step as the reference and as without, fewer rows each way."""
    graph = CASES["self_loops"](seed=4)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint)
    assert ex._own_at is not None and not ex._own_host
    # forward: every layer (a cached first one from its slots, which hold its rows
    # dropped out); backward: layers that gather their sources
    fwd, bwd = ex._fwd_own, executor.own_rows_in_sources(model, ex.cached)
    assert fwd == [True] * model.num_layers
    assert ex._in_slots[0] == ex.cached[0]
    assert bwd == [checkpoint == "recompute" or layer == "gat"] * model.num_layers
    assert ex.own_rows_from_sources == [l for l in range(model.num_layers) if fwd[l] or bwd[l]]
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    _, _, plain = chunked_step(make_model(layer), graph, parts, chunks, checkpoint, own=False)
    assert plain._own_at is None and plain._own_host
    n, layers = g.num_nodes, model.layers
    t, p = ex.mover.traffic, plain.mover.traffic
    assert p.h2d_rows - t.h2d_rows == n * (sum(fwd) + sum(bwd))
    assert p.d2h_rows - t.d2h_rows == n * sum(x.needs_dst for x in layers[1:])


def test_own_rows_need_them_among_the_sources():
    """Without a self-loop on every vertex a chunk need not read its own rows
    (isolated vertices read nothing): asked to take them there, the executor
    refuses with the chunk it lacks them in."""
    with pytest.raises(ValueError, match=r"chunk \d+ does not read all its own rows"):
        chunked_step(make_model("gat"), CASES["isolated"](seed=1), 1, 3, "auto", own=True)


@pytest.mark.parametrize("whole", [False, True], ids=["plan-rows", "whole"])
@pytest.mark.parametrize("layer", LAYERS)
def test_several_parts_on_one_device(layer, whole):
    graph = CASES["skewed"](seed=2)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 3, 4, "auto", whole=whole)
    assert ex._whole == [whole] * model.num_layers  # (the plan loads some rows twice)
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


# (in the others the plan loads fewer rows than the graph has: no layer after
# the first moves all)
@pytest.mark.parametrize("case", sorted(set(CASES) - {"isolated", "self_loops"}))
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
@pytest.mark.parametrize("chunks", [3, 6])
def test_whole_layer_passes_equal_full_graph(case, layer, checkpoint, chunks):
    """Every layer moving all its rows per pass (they fit the row memory here)
    is the same step as plain full-graph training; the first layer only when its
    plan loads more rows than it has (at 6 chunks, not at 3)."""
    graph = CASES[case](seed=1)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 1, chunks, checkpoint, whole=True)
    more = ex.plan.plan.load_ids.shape[0] > g.num_nodes
    assert more == (chunks == 6)
    assert ex._whole == [more] + [True] * (model.num_layers - 1)
    # (a cached first layer moving all its rows drops them out where they lie
    # and aggregates them there)
    assert ex._in_place[0] == (more and ex.cached[0])
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    if ex._kept[1]:  # (where the next forward's first rows may not go ahead)
        start = ex._offset(ex._grad_rows(1))
        assert ex._prefetch_start(start + 1) is None and ex._prefetch_start(start) == 0


@pytest.mark.parametrize("transform_first", [True, False])
@pytest.mark.parametrize("parts,chunks,whole", [(1, 1, False), (1, 5, False), (2, 3, False),
                                                (1, 5, True)])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_transform_first_equals_plain_training(transform_first, parts, chunks, whole,
                                               checkpoint):
    """Three GCN layers 6 -> 16 -> 8 -> 3: with transform_first the last two keep
    z^l = W_l drop(h^l) (8 and 3 wide) instead of h^l (16 and 8), and the step
    is still plain training's; fewer bytes cross the link."""
    graph = CASES["skewed"](seed=7)
    torch.manual_seed(0)
    layers = [resolve_layer("gcn")(NUM_FEATURES, 16), resolve_layer("gcn")(16, 8),
              resolve_layer("gcn")(8, NUM_CLASSES)]
    model = GNN(layers, dropout=0.5, transform_first=transform_first)
    assert model.row_widths() == ([NUM_FEATURES, 8, 3, 3] if transform_first
                                  else [NUM_FEATURES, 16, 8, 3])
    other = copy.deepcopy(model)
    other.transform_first = not transform_first
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint, whole=whole)
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    _, _, ex_other = chunked_step(other, graph, parts, chunks, checkpoint, whole=whole)
    narrow, wide = (ex, ex_other) if transform_first else (ex_other, ex)
    assert narrow.mover.traffic.h2d_bytes < wide.mover.traffic.h2d_bytes


def three_layers(layer: str, keep_dropped: bool) -> GNN:
    """6 -> 16 -> 16 -> 3: the middle layer neither narrows nor transforms first."""
    torch.manual_seed(0)
    cls = resolve_layer(layer)
    if layer == "gat":
        layers = [cls(NUM_FEATURES, 8, heads=2, concat=True, dropout=0.5),
                  cls(16, 8, heads=2, concat=True, dropout=0.5),
                  cls(16, NUM_CLASSES, heads=1, concat=False, dropout=0.5)]
    else:
        layers = [cls(NUM_FEATURES, 16), cls(16, 16), cls(16, NUM_CLASSES)]
    return GNN(layers, dropout=0.5, transform_first=True, keep_dropped=keep_dropped)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("parts,chunks,whole", [(1, 5, False), (2, 3, False), (1, 5, True)])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_rows_kept_dropped_equal_plain_training(layer, parts, chunks, whole, checkpoint):
    """Three layers: the middle one reads drop(h^1) as the first layer wrote it
    (aggregated where the rows lie when its aggregation is built in) and the
    step is plain training's; the h^1 a training pass leaves in host memory is
    layer 1's dropout of what each layer dropping its own inputs leaves."""
    graph = CASES["halo_heavy"](seed=9)
    model = three_layers(layer, keep_dropped=True)
    assert model.keeps_dropped(1)
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint, whole=whole)
    aggregates = model.layers[1].cacheable
    assert ex._in_slots[1] == (aggregates and not ex._whole[1])
    assert ex._in_place[1] == (aggregates and ex._whole[1])
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    if whole:
        return  # (h^1 may stay on the device)
    _, _, plain = chunked_step(three_layers(layer, keep_dropped=False), graph, parts, chunks,
                               checkpoint)
    ids = torch.arange(g.num_nodes)
    want = ops.dropout(plain.buf.h[1], ids, 0.5, layer_seed(0, 3, 1))
    torch.testing.assert_close(ex.buf.h[1], want, rtol=1e-6, atol=1e-7)
    assert (ex.buf.h[1] == 0).sum() > (plain.buf.h[1] == 0).sum()


@pytest.mark.parametrize("layer", ["gcn", "sage", "gin"])
@pytest.mark.parametrize("parts,chunks,cache_rows,ordered", [
    (1, 5, 0, False), (2, 3, 0, False), (1, 5, 12, False), (1, 5, 0, True)])
def test_first_layer_aggregates_its_buffer_in_place(layer, parts, chunks, cache_rows, ordered):
    """A cached first layer drops its rows out once as they arrive and aggregates
    them where they lie in the transition buffer: the same step (with kept rows,
    inputs in load order, several parts), and evaluation the same logits."""
    graph = CASES["halo_heavy"](seed=8)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, parts, chunks, "auto", cache_rows=cache_rows,
                              ordered=ordered)
    assert ex._in_slots[0] and not ex._whole[0]
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    _, _, plain = chunked_step(model, graph, parts, chunks, "recompute")
    assert not plain._in_slots[0]  # (backward reads the rows again)
    ex.evaluate(0)
    plain.evaluate(0)
    torch.testing.assert_close(ex.buf.h[-1], plain.buf.h[-1], rtol=1e-5, atol=1e-6)


def _one_part(chunks: int):
    """The skewed case in one part of ``chunks`` chunks: ``(graph, chunks, plan)``."""
    graph = CASES["skewed"](seed=5)
    p = chunk_partition(graph, np.arange(graph.num_nodes) % 1, chunks, num_parts=1)
    g = p.apply(graph)
    _, plan = plan_batches(g.indptr, g.indices, p.chunk_ptr, 1, chunks)
    return g, ChunkSet.build(g, p.chunk_ptr, 1, chunks), plan.plans[0]


def test_executor_refuses_buffers_without_a_gradient_it_moves():
    """A host gradient buffer may be left out only where the executor keeps
    that gradient on the device (the Trainer leaves out no more)."""
    model = make_model("gcn")
    g, cs, plan = _one_part(6)
    widths = model.row_widths()
    no_grads = BufferPlan(g.num_nodes, widths, model.stored_aggregates(), grads=[False] * 3)

    def make(whole: bool) -> Executor:
        return Executor(model, cs, HostBuffers(no_grads, g.x, pin=False), torch.from_numpy(g.y),
                        masks_of(g), torch.device("cpu"), plan, whole_layers=whole)

    assert make(True)._kept == [False, True, True]  # (every layer whole: both stay there)
    with pytest.raises(ValueError, match="lack grad h"):
        make(False)


def test_executor_refuses_buffers_without_an_aggregate_it_stores():
    """A host aggregate buffer may be left out only where the executor keeps the
    layer's update graph instead (resident on one device, ``keep_graphs``)."""
    model = make_model("sage")
    g, cs, plan = _one_part(3)
    none = BufferPlan(g.num_nodes, model.row_widths(), [False, False])
    assert model.stored_aggregates() == [True, True]
    with pytest.raises(ValueError, match="lack the aggregate of layer 0"):
        Executor(model, cs, HostBuffers(none, g.x, pin=False), torch.from_numpy(g.y),
                 masks_of(g), torch.device("cpu"), plan, keep_graphs=True)


class ReadingFinish(resolve_layer("gcn")):
    """GCN with the same finish redefined and no ``finish_adds_only``: the engine
    must assume the finish reads the aggregate."""

    def finish(self, a):
        return a if self.bias is None else a + self.bias


@pytest.mark.parametrize("parts,chunks,whole", [(1, 4, False), (2, 3, False), (1, 6, True)])
def test_last_layer_that_only_adds_stores_no_aggregate(parts, chunks, whole):
    """GCN's last layer transforms first and finishes with its bias: backward
    gets the aggregate's gradient from the output's, so forward stores no
    aggregate and backward loads none; the step is the same as for a layer
    whose finish may read it."""
    graph = CASES["skewed"](seed=3)
    model = make_model("gcn")
    res, g, ex = chunked_step(model, graph, parts, chunks, "auto", whole=whole)
    assert ex.stored == [True, False] and ex.buf.agg[1] is None
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    other = make_model("gcn")
    other.layers[1].__class__ = ReadingFinish
    res2, _, ex2 = chunked_step(other, graph, parts, chunks, "auto", whole=whole)
    assert ex2.stored == [True, True]
    assert_matches(other, res2.loss, ref_loss, ref_grads)
    n, row = g.num_nodes, NUM_CLASSES * 4
    t, t2 = ex.mover.traffic, ex2.mover.traffic
    assert (t2.h2d_bytes - t.h2d_bytes, t2.d2h_bytes - t.d2h_bytes) == (n * row, n * row)


DEDUP = [dict(reuse=r, p2p=p, reorg=o) for r in (False, True) for p in (False, True)
         for o in (False, True)]


@pytest.mark.parametrize("flags", DEDUP, ids=lambda f: "-".join(k for k, v in f.items() if v)
                         or "baseline")
@pytest.mark.parametrize("layer", ["gcn", "gat"])
@pytest.mark.parametrize("parts", [1, 3])
def test_dedup_switches_do_not_change_the_step(flags, layer, parts):
    graph = CASES["halo_heavy"](seed=4)
    model = make_model(layer)
    res, g, _ = chunked_step(model, graph, parts, 3, "auto", **flags)
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


@pytest.mark.parametrize("flags", DEDUP, ids=lambda f: "-".join(k for k, v in f.items() if v)
                         or "baseline")
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_counted_rows_equal_the_plan(flags, checkpoint):
    """Rows the engine moves each way equal the planner's volumes."""
    graph = CASES["skewed"](seed=5)
    model = make_model("sage")
    _, _, ex = chunked_step(model, graph, 2, 4, checkpoint, **flags)
    plan = ex.transfer_plan
    t = ex.mover.traffic
    L = model.num_layers
    n = graph.num_nodes
    # forward loads every layer's neighbours once; backward reloads them for
    # recomputed layers only; SAGE also reads its own rows (fwd, bwd) and,
    # when cached, its aggregate in backward; ∇h^{l+1} rows come back once.
    reloads = 0 if checkpoint == "auto" else L
    own = 2 * L * n + (L * n if checkpoint == "auto" else 0) + L * n
    assert t.h2d_rows == (L + reloads) * plan.h2d_rows + own
    if flags == dict(reuse=False, p2p=False, reorg=False):
        assert plan.h2d_rows == plan.v_ori
    if flags["reuse"] and flags["p2p"]:
        assert plan.h2d_rows == plan.v_ru
    # flushes: ∇h^l for l ≥ 1 (one layer here) but the last step's (held on the
    # device for layer 0's backward), plus own-row gradients and the stores of
    # h^{l+1}, a^l and ∇h^L ranges.
    assert ex._hold
    stores = (L - 1) * n + (L * n if checkpoint == "auto" else 0) + n
    assert t.d2h_rows == (L - 1) * (plan.d2h_rows - held(ex)) + (L - 1) * n + stores


@pytest.mark.parametrize("layer", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_whole_layers_move_all_rows_once(layer, checkpoint):
    """A layer whose rows fit the transition buffer's memory moves all of them in
    one copy (and its gradients back in one) instead of the plan's neighbour
    rows and flushes: the same step, the counted rows follow. Where both layers
    are cached, ∇h^2 (the loss gradient) and ∇h^1 stay on the device between
    passes: neither is stored nor loaded; so does h^1 where the second layer
    reads no rows of its own (GCN)."""
    graph = CASES["skewed"](seed=5)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 1, 6, checkpoint, whole=True)
    assert ex._whole == [True, True]  # (a small graph: its rows fit)
    cached = checkpoint == "auto" and layer != "gat"
    assert ex._kept == [False, cached, cached]
    kept_rows = cached and layer == "gcn"
    assert ex.rows_kept == kept_rows
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    # (the plan's rows with ∇h^1 through host memory, as a whole layer 1 has it)
    _, _, plain = chunked_step(make_model(layer), graph, 1, 6, checkpoint,
                               first_in_flushes=False)
    assert plain._whole == [False, False] and not any(plain._kept)
    n, L, rows = g.num_nodes, model.num_layers, plain.transfer_plan.h2d_rows
    assert rows > n  # (the plan would move more)
    passes = L + (0 if cached else L)
    t, p = ex.mover.traffic, plain.mover.traffic
    # (and forward steps take their own rows from the whole rows: a view)
    assert ex._fwd_own == [x.needs_dst for x in model.layers] and not any(plain._fwd_own)
    assert p.h2d_rows - t.h2d_rows == (passes * (rows - n) + 2 * n * cached + n * kept_rows
                                       + n * sum(ex._fwd_own))
    # ∇h^1: one whole write (none when kept) instead of the flushes and the
    # own-row adds; ∇h^2 not stored when kept
    own = n if model.layers[1].needs_dst else 0
    assert p.d2h_rows - t.d2h_rows == (plain.transfer_plan.d2h_rows - held(plain) + own - n
                                       + 2 * n * cached
                                       + n * kept_rows)


@pytest.mark.parametrize("which", ["gcn", "gcn-dropped", "gcn3", "gcn-gat", "gcn-sage"])
@pytest.mark.parametrize("chunks", [1, 5])
def test_first_backward_runs_on_layer_1_flushes(which, chunks):
    """Where layer 1 moves the plan's rows, the first layer's backward (cached,
    no own rows: GCN) runs on layer 1's gradient flushes: each flushed partial
    ∇h^1 through the first layer's update's backward at its rows' aggregates.
    The same step as the reference and as with ∇h^1 through host memory and a
    first-layer pass, whatever layer 1 is (a GAT or SAGE layer 1 adds its own
    rows' gradients at their slots) and with the first layer's output dropped
    out by it (its dropout keyed by the flushed rows' ids). It stores no ∇h^1
    and loads, instead of ∇h^1 and a^0 of every row, a^0 of the flushed rows."""
    graph = CASES["self_loops"](seed=7)

    def model():
        torch.manual_seed(0)
        if which == "gcn3":
            return three_layers("gcn", True)
        if which in ("gcn", "gcn-dropped"):
            return make_model("gcn", transform_first=which == "gcn",
                              keep_dropped=which == "gcn-dropped")
        second = resolve_layer(which.split("-")[1])
        return GNN([resolve_layer("gcn")(NUM_FEATURES, 8), second(8, NUM_CLASSES)],
                   dropout=0.5, keep_dropped=True)

    on, off = model(), model()
    res, g, ex = chunked_step(on, graph, 1, chunks, "auto")
    assert ex.first_in_flushes and ex.batches_per_epoch(False) == chunks * (
        2 * on.num_layers - 1)
    ref_loss, ref_grads = reference_step(model(), g)
    assert_matches(on, res.loss, ref_loss, ref_grads)
    res2, _, plain = chunked_step(off, graph, 1, chunks, "auto", first_in_flushes=False)
    assert not plain.first_in_flushes
    assert_matches(off, res2.loss, ref_loss, ref_grads)
    n, (w0, w1) = g.num_nodes, on.row_widths()[:2]
    flushed = ex.transfer_plan.d2h_rows
    t, p = ex.mover.traffic, plain.mover.traffic
    assert p.h2d_bytes - t.h2d_bytes == 4 * (n * w1 + n * w0 - flushed * w0)
    assert p.d2h_bytes - t.d2h_bytes == 4 * (flushed - held(plain)) * w1


def test_flush_staging_is_the_largest_staged_flush():
    """The pinned flush staging a GPU step needs (in elements): the most rows
    one step of a layer ``l >= 1`` flushes at its width (only those added,
    where flushes are written), none for a layer moving whole, ∇h^1 into the
    first layer's backward or layer 1's last step where it holds them, and a
    chunk's own rows where they are added in host memory. (The GPU oracle
    checks every executor's figure against the flushes it stages.)"""
    from types import SimpleNamespace

    plan = SimpleNamespace(flush_ptr=np.array([0, 5, 7, 17]))  # 5, 2, 10 rows a step
    split = np.array([3, 6, 12])  # 2, 1, 5 of them added
    widths, no = [8, 4, 6, 3], [False] * 4

    def most(written=no, whole=no, into=False, held=False, adds=no, dst=30):
        return executor.flush_staging_elements(plan, split, written, widths, whole, into,
                                               held, adds, dst)

    assert most() == 10 * 6
    assert most(written=[True] * 4) == 5 * 6
    assert most(written=[False, False, True, False]) == 10 * 4
    assert most(whole=[False, False, True, False]) == 10 * 4
    assert most(whole=[False, False, True, False], held=True) == 5 * 4
    assert most(whole=[False, False, True, False], into=True) == 0
    assert most(into=True) == 10 * 6
    assert most(adds=[False, True, False, False]) == 30 * 4
    assert most(whole=[False, True, False, False], adds=[False, True, False, False]) == 10 * 6
    assert most(adds=[True, False, False, False], dst=100) == 10 * 6  # (no ∇h^0)


@pytest.mark.parametrize("chunks", [6, 12])
@pytest.mark.parametrize("without", ["grads", "rows"])
def test_narrow_last_layer_stays_on_the_device(chunks, without, monkeypatch):
    """Three GCN layers, the last (3 wide, weight first) moving whole and the
    middle one the plan's rows, which leaves the row memory's gradient twin
    alone in forward and the transition buffer in backward: h^2 stays in the
    twin from the middle layer's forward pass to the last layer's, and ∇h^2,
    added up over those rows, goes to the transition buffer for the middle
    layer's backward. The same step and evaluation as with either through host
    memory (``without``), which moves n rows more each way."""
    graph = CASES["self_loops"](seed=5)
    res, g, ex = chunked_step(three_layers("gcn", True), graph, 1, chunks, "auto", whole=True)
    assert ex._whole[1:] == [False, True] and ex._kept == [False, False, True, True]
    assert ex.rows_kept and ex._rows_layer == 2
    assert ex._at[2][0] == ex._tbuf.numel()  # (the twin's start)
    ref_loss, ref_grads = reference_step(three_layers("gcn", True), g)
    assert_matches(ex.model, res.loss, ref_loss, ref_grads)

    if without == "grads":  # (the rule without the transition buffer's room)
        rule = executor.gradients_kept
        monkeypatch.setattr(executor, "gradients_kept",
                            lambda w, c, widths, *_: rule(w, c, widths))
    else:
        rows = executor.rows_kept_at
        monkeypatch.setattr(executor, "rows_kept_at",
                            lambda *a, layer=1: rows(*a) if layer == 1 else None)
    res2, _, host = chunked_step(three_layers("gcn", True), graph, 1, chunks, "auto",
                                 whole=True)
    assert host._kept[2] == (without == "rows") and host.rows_kept == (without == "grads")
    assert_matches(host.model, res2.loss, ref_loss, ref_grads)
    n, t, h = g.num_nodes, ex.mover.traffic, host.mover.traffic
    assert (h.h2d_rows - t.h2d_rows, h.d2h_rows - t.d2h_rows) == (n, n)
    a, b = ex.evaluate(4), host.evaluate(4)
    assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.correct == b.correct


@pytest.mark.parametrize("layer", LAYERS[1:])
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
def test_first_layer_whole_beside_plan_rows(layer, checkpoint):
    """The first layer's rows need no gradient twin, so they may fill all of the
    row memory and move whole while a wider layer after them moves the plan's
    rows (in the same memory): the same step; only the first layer's passes
    move fewer rows."""
    graph = CASES["self_loops"](seed=5)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 1, 6, checkpoint, whole=True)
    n, w = g.num_nodes, model.row_widths()
    assert ex._whole == [True, False]  # (its rows fit the memory; the second's do not)
    assert n * w[0] <= ex._rowmem.numel() < 2 * n * w[1]
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    _, _, plain = chunked_step(make_model(layer), graph, 1, 6, checkpoint)
    rows = plain.transfer_plan.h2d_rows
    passes = 1 if ex.cached[0] else 2  # forward, and backward when it reloads them
    t, p = ex.mover.traffic, plain.mover.traffic
    # (forward steps take their own rows from the device either way: from the
    # whole rows, or from the sources or slots)
    assert ex._fwd_own == plain._fwd_own
    assert p.h2d_rows - t.h2d_rows == passes * (rows - n)
    # (the first layer flushes no gradient; the second its last step's where
    # the first layer's backward leaves them on the device)
    assert p.d2h_rows + held(plain) == t.d2h_rows + held(ex)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("parts,chunks,checkpoint", [(1, 5, "auto"), (3, 3, "recompute"),
                                                     (2, 4, "auto")])
def test_first_layer_loads_from_ordered_inputs(layer, parts, chunks, checkpoint, monkeypatch):
    """The first layer's rows read from a copy of h^0 in the order the plan loads
    them (one contiguous run per step) give the same step and the same traffic;
    every step of the first layer takes that path."""
    from hongtu.engine.transfer import Mover

    graph = CASES["skewed"](seed=4)
    model = make_model(layer)
    _, _, plain = chunked_step(copy.deepcopy(model), graph, parts, chunks, checkpoint)
    runs = []
    orig = Mover.fetch_run

    def fetch_run(self, host, start, stop, *a, **kw):
        runs.append((start, stop))
        return orig(self, host, start, stop, *a, **kw)

    monkeypatch.setattr(Mover, "fetch_run", fetch_run)
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint, ordered=True)
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
    plan = ex.plan.plan
    assert torch.equal(ex._ordered, ex.buf.h[0][torch.from_numpy(plan.load_ids)])
    # (steps after the first, and the first when its slots are 0..n-1)
    steps = [(int(plan.load_ptr[s]), int(plan.load_ptr[s + 1])) for s in range(plan.num_steps)
             if s > 0 or ex._first_in_place]
    passes = 1 if ex.cached[0] else 2
    assert runs == steps * passes and any(b > a for a, b in steps)
    t, p = ex.mover.traffic, plain.mover.traffic
    assert (t.h2d_rows, t.d2h_rows, t.h2d_bytes) == (p.h2d_rows, p.d2h_rows, p.h2d_bytes)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("parts,chunks,checkpoint", [(1, 5, "auto"), (2, 3, "auto"),
                                                     (3, 3, "recompute")])
def test_later_layers_load_rows_written_in_load_order(layer, depth, parts, chunks, checkpoint,
                                                      monkeypatch):
    """A training forward pass writes the rows of each later layer that reads
    them only through its loads in the order the plan first loads them (each
    loaded row once); that layer's steps bring their first loads as one run
    and gather the rows loaded again. Its first step's rows it writes on the
    device instead, for that step to copy there, and to host memory only
    those a later step loads again. The step is exact, the copy is what the
    plain run leaves in ``h^m`` in that order (where written), the loads are
    the plain run's but the first step's, and the stores skip rows never
    loaded and rows only the first step loads; evaluation still writes
    ``h^m`` (embeddings) and gives the same logits."""
    from hongtu.engine.transfer import Mover

    graph = CASES["halo_heavy"](seed=9)

    def build():
        return make_model(layer) if depth == 2 else three_layers(layer, keep_dropped=True)

    _, _, plain = chunked_step(build(), graph, parts, chunks, checkpoint)
    runs = []

    def spy(orig):
        def call(self, host, start, stop, *a, **kw):
            runs.append((host.data_ptr(), start, stop))
            return orig(self, host, start, stop, *a, **kw)
        return call

    monkeypatch.setattr(Mover, "fetch_run", spy(Mover.fetch_run))
    model = build()
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint, ordered_rows=True)
    assert_matches(model, res.loss, *reference_step(model, g))
    once = executor.reads_rows_once(model, checkpoint)
    assert ex.ordered_rows == [m for m in range(1, depth) if once[m]]
    assert bool(ex.ordered_rows) or layer != "gcn" or checkpoint != "auto"
    plan = ex.plan.plan
    ids = np.asarray(plan.load_ids, dtype=np.int64)
    firsts = torch.from_numpy(ids[np.sort(np.unique(ids, return_index=True)[1])])
    again = ids.shape[0] - firsts.shape[0]  # loads of rows loaded before
    assert ex._first_in_place or not ex.ordered_rows
    runs_of = np.cumsum([0] + [len(np.setdiff1d(ids[a:b], ids[:a])) for a, b in
                               zip(plan.load_ptr[:-1], plan.load_ptr[1:])])
    first, only = executor.first_step_rows(plan)
    p1 = int(plan.load_ptr[1])
    written = torch.ones(firsts.shape[0], dtype=torch.bool)  # (in host memory)
    written[:p1] = torch.from_numpy(np.isin(ids[:p1], ids[p1:]))
    assert first == p1 and only == int((~written).sum())
    early = [m for m in ex.ordered_rows if ex._early(m)]
    for m in ex.ordered_rows:
        mask = written if m in early else torch.ones_like(written)
        assert torch.equal(ex._ordered_rows[m][mask], plain.buf.h[m][firsts][mask])
        got = [r[1:] for r in runs if r[0] == ex._ordered_rows[m].data_ptr()]
        want = list(zip(runs_of[:-1], runs_of[1:]))
        assert got == (want[1:] if m in early else want)  # (the first step's: on the device)
    assert bool(early) == bool(ex.ordered_rows)
    t, p = ex.mover.traffic, plain.mover.traffic
    assert t.h2d_rows == p.h2d_rows - len(early) * first
    never = g.num_nodes - int(firsts.shape[0])  # rows no step loads: not written
    assert t.d2h_rows == p.d2h_rows - len(ex.ordered_rows) * never - len(early) * only
    if layer == "gcn" and (parts, chunks) == (1, 5):
        assert again > 0  # (rows loaded again come by the gather)
    got, want = ex.evaluate(3), plain.evaluate(3)
    assert (got.correct, got.total) == (want.correct, want.total)
    for m in range(1, depth + 1):
        torch.testing.assert_close(ex.buf.h[m], plain.buf.h[m], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("parts,chunks", [(1, 5), (2, 3), (1, 8)])
@pytest.mark.parametrize("into_first", [False, True])
def test_layer_1_rows_made_from_the_first_layers_aggregates(parts, chunks, device, into_first,
                                                            monkeypatch):
    """Where the first layer's aggregates are narrower than layer 1's rows
    (6 features, 16 wide), a training forward pass writes ``a^0`` in first-load
    order for layer 1 instead of ``drop(h^1)``, and layer 1's steps after the
    first make each row they load from it on the device (by default on GPUs;
    forced here, and off for the plain run). The step is the plain one
    (the same loss, the gradients of the in-memory reference), the copy holds
    the aggregates the plain run stores, and the bytes fall by the narrower
    rows stored and loaded, the rows themselves unchanged; evaluation is
    unchanged. Where the first layer's backward runs on layer 1's flushes
    (``into_first``), ``a^0`` is stored once, in that order
    (:func:`~hongtu.engine.executor.aggregates_in_load_order`): the copy is
    the aggregate's first rows, every row of it lies at its position, and
    the loaded rows are not stored a second time."""
    graph = CASES["halo_heavy"](seed=9)
    init, narrow = Executor.__init__, [False]
    monkeypatch.setattr(Executor, "__init__",
                        lambda self, *a, **kw: init(self, *a, narrow_rows=narrow[0], **kw))
    before, _, plain = chunked_step(three_layers("gcn", True), graph, parts, chunks, "auto",
                                    device=device, ordered_rows=True,
                                    first_in_flushes=into_first)
    narrow[0] = True
    model = three_layers("gcn", True)
    res, g, ex = chunked_step(model, graph, parts, chunks, "auto", device=device,
                              ordered_rows=True, first_in_flushes=into_first)
    assert ex.rows_from_aggregates and not plain.rows_from_aggregates
    assert ex.first_in_flushes == into_first and (ex._agg_layout is not None) == into_first
    assert ex._ordered_rows[1].shape == (plain._ordered_rows[1].shape[0], NUM_FEATURES)
    assert_matches(model, res.loss, *reference_step(model, g))
    assert res.loss == pytest.approx(before.loss, rel=1e-6)
    plan = ex.plan.plan
    ids = np.asarray(plan.load_ids, dtype=np.int64)
    firsts = torch.from_numpy(ids[np.sort(np.unique(ids, return_index=True)[1])])
    p1 = int(plan.load_ptr[1])
    written = torch.ones(firsts.shape[0], dtype=torch.bool)
    written[:p1] = torch.from_numpy(np.isin(ids[:p1], ids[p1:]))
    want = plain.buf.agg[0].cpu()
    assert torch.equal(ex._ordered_rows[1][written].cpu(), want[firsts][written])
    t, p = ex.mover.traffic, plain.mover.traffic
    narrower = (16 - NUM_FEATURES) * 4
    assert t.h2d_rows == p.h2d_rows
    if into_first:
        pos = ex._agg_layout.pos.long().cpu()
        assert torch.equal(ex.buf.agg[0].cpu()[pos], want)
        assert torch.equal(ex._ordered_rows[1].cpu(), want[firsts])
        assert ex._ordered_rows[1].data_ptr() == ex.buf.agg[0].data_ptr()
        assert ex.ordered_row_bytes == plain.ordered_row_bytes - plain._ordered_rows[1].nbytes
        # (plain: a^0, then the loaded rows again; here a^0 alone; on a GPU each
        # chunk's positions travel with it, 8 bytes a row, against 16 a loaded row)
        stored = int(written.sum())
        assert p.d2h_rows - t.d2h_rows == stored
        assert p.d2h_bytes - t.d2h_bytes == stored * 16 * 4
        rows = sum(np.diff(ex.chunks.range(int(c)))[0] for c in set(plan.chunk_ids.tolist()))
        index = 8 * int(rows) - 16 * firsts.shape[0] if device == "cuda" else 0
        assert p.h2d_bytes - t.h2d_bytes == (ids.shape[0] - p1) * narrower - index
    else:
        assert t.d2h_rows == p.d2h_rows
        assert p.h2d_bytes - t.h2d_bytes == (ids.shape[0] - p1) * narrower
        assert p.d2h_bytes - t.d2h_bytes == int(written.sum()) * narrower
    if (parts, chunks) != (2, 3):
        assert ids.shape[0] > p1 and written.any()  # (rows made from aggregates)
    got, want = ex.evaluate(3), plain.evaluate(3)
    assert (got.correct, got.total) == (want.correct, want.total)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("chunks", [5, 8])
def test_layer_1_backward_in_reverse_brings_first_loads_as_runs(chunks, device, monkeypatch):
    """Where ``a^0`` is stored once in layer 1's load order, layer 1's backward
    visits the steps last to first (:func:`~hongtu.engine.executor.backward_in_reverse`):
    the rows a step flushes are the rows it loads, so the first layer's
    backward brings the aggregates of the rows each step loads first as runs
    of that buffer and gathers only the rows it loads again. Pieces of 3 rows
    (so they straddle the two kinds): the loss and gradients are the
    in-memory reference's and the forward-order fold's, every loaded row's
    aggregate comes once, and the runs are exactly the steps' first loads.
    Layer 1's aggregates of the forward pass's last chunk, which the reversed
    backward visits first, stay on the device (never stored, never loaded:
    a second step with NaN in their host rows is the first step)."""
    graph = CASES["halo_heavy"](seed=9)
    init = Executor.__init__
    monkeypatch.setattr(Executor, "__init__",
                        lambda self, *a, **kw: init(self, *a, narrow_rows=True, **kw))
    monkeypatch.setattr(executor, "flush_piece_rows", lambda *a, **kw: 3)
    # (the pieces of these small chunks cannot give up the room its arrays take:
    # test_layer_1_backward_keeps_step_order_where_its_arrays_do_not_fit_the_pieces)
    monkeypatch.setattr(executor, "flush_piece_spare", lambda *a, **kw: 1 << 40)
    brought = []  # (run rows, gathered rows) per piece
    gather = Mover.gather_rows

    def spy(self, host, ids, out, free=None, at=None, run=(0, 0)):
        brought.append((run, int(ids.shape[0])))
        return gather(self, host, ids, out, free, at, run)

    monkeypatch.setattr(Mover, "gather_rows", spy)
    model = three_layers("gcn", True)
    res, g, ex = chunked_step(model, graph, 1, chunks, "auto", device=device,
                              ordered_rows=True)
    assert ex._reverse and ex._flush_piece == 3 and ex._keep_last
    assert_matches(model, res.loss, *reference_step(model, g))
    plan, fl = ex.plan.plan, ex._first_loads
    loads = int(plan.load_ptr[-1])
    again = loads - fl.count
    assert again > 0  # (rows loaded again: gathered)
    assert sum(r[1] - r[0] for r, _ in brought) == fl.count
    assert sum(n for _, n in brought) == again
    runs = sorted(r for r, _ in brought if r[1] > r[0])
    assert runs[0][0] == 0 and runs[-1][1] == fl.count
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # (each first load once)
    brought.clear()
    monkeypatch.setattr(executor, "backward_in_reverse", lambda *a: False)
    before, _, plain = chunked_step(three_layers("gcn", True), graph, 1, chunks, "auto",
                                    device=device, ordered_rows=True)
    assert not plain._reverse and all(r == (0, 0) for r, _ in brought)
    assert sum(n for _, n in brought) == loads  # (every flushed row gathered)
    assert res.loss == pytest.approx(before.loss, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    agg, (v0, v1) = ex.buf.agg[1], ex.chunks.range(ex.plan.items[-1][2])
    kept = (v1 - v0) * agg.shape[1] * agg.element_size()  # (its bytes, either way)
    assert kept > 0 and not plain._keep_last
    assert ex.mover.traffic.h2d_bytes == plain.mover.traffic.h2d_bytes - kept
    assert ex.mover.traffic.d2h_bytes == plain.mover.traffic.d2h_bytes - kept
    assert ex._fold.nbytes() == executor._FoldOrder.bytes_for(loads, again, torch.device(device))
    # (the index arrays of rows in first-load order and of a^0's order, as the
    # report counts them in host memory)
    held = [t for _, t in fl.steps] + list(fl.chunks.values()) \
        + list(ex._agg_layout.orders.values())
    assert sum(t.nbytes for t in held) == executor.first_load_host_bytes(plan, g.num_nodes)
    held = [t for _, t in plain._first_loads.steps] + list(plain._first_loads.chunks.values())
    assert sum(t.nbytes for t in held) == executor.first_load_host_bytes(plan)
    # A second step with NaN where host memory holds layer 1's aggregates is the
    # first: the last chunk's are neither written there nor read back.
    grads = [p.grad.clone() for p in model.parameters()]
    agg.fill_(float("nan"))
    second = ex.step(3)
    ex.mover.settle()
    assert torch.isnan(agg[v0:v1]).all()
    assert not torch.isnan(agg[:v0]).any() and not torch.isnan(agg[v1:]).any()
    assert second.loss == pytest.approx(res.loss, rel=1e-6)
    for p, q in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, q, rtol=1e-5, atol=1e-6)


def test_layer_1_backward_keeps_step_order_where_its_arrays_do_not_fit_the_pieces(monkeypatch):
    """Its index arrays (:class:`~hongtu.engine.executor._FoldOrder`) come out
    of the room the flush pieces can give up (``budget.flush_piece_spare``),
    which the estimate counts: where they do not fit it (as in these small
    chunks' pieces), layer 1's backward keeps the steps' order; where they
    just fit, it reverses, and the pieces give up their bytes."""
    init = Executor.__init__
    monkeypatch.setattr(Executor, "__init__",
                        lambda self, *a, **kw: init(self, *a, narrow_rows=True, **kw))
    graph = CASES["halo_heavy"](seed=9)
    model = three_layers("gcn", True)
    res, g, ex = chunked_step(model, graph, 1, 5, "auto", ordered_rows=True)
    assert ex._agg_layout is not None and not ex.backward_reversed and ex._fold is None
    assert_matches(model, res.loss, *reference_step(model, g))
    loads = int(ex.plan.plan.load_ptr[-1])
    need = executor._FoldOrder.bytes_for(loads, loads - ex._first_loads.count, ex.device)
    pieces = ex._flush_piece
    for room, reversed_ in ((need - 1, False), (need, True)):
        monkeypatch.setattr(executor, "flush_piece_spare", lambda *a, room=room, **kw: room)
        model = three_layers("gcn", True)
        res, g, ex = chunked_step(model, graph, 1, 5, "auto", ordered_rows=True)
        assert ex.backward_reversed == reversed_
        assert_matches(model, res.loss, *reference_step(model, g))
    assert ex._fold.nbytes() == need
    assert ex._flush_piece < pieces  # (the arrays' room came out of the pieces)


def test_aggregates_as_layer_1_rows_where_narrower_whatever_their_bytes():
    """Layer 1's rows are the first layer's aggregates where those are narrower
    than layer 1's rows, whatever their width in bytes (R-MAT's 128 features,
    products-like's 100), its rows written in load order with the first
    step's early, and the aggregate stored."""
    def gcn3(features: int, hidden: int) -> GNN:
        cls = resolve_layer("gcn")
        return GNN([cls(features, hidden), cls(hidden, hidden), cls(hidden, NUM_CLASSES)],
                   dropout=0.5, transform_first=True, keep_dropped=True)

    on, rule = [False, True, True, False], executor.first_aggregates_ordered
    stored = [True, True, False]
    assert rule(gcn3(128, 256), stored, on, on) and rule(gcn3(100, 256), stored, on, on)
    assert rule(gcn3(48, 64), stored, on, on)
    assert not rule(gcn3(256, 256), stored, on, on)  # (not narrower)
    assert not rule(gcn3(128, 256), [False, True, False], on, on)  # (a^0 not stored)
    assert not rule(gcn3(128, 256), stored, on, [False] * 4)  # (first-step rows loaded)
    assert not rule(gcn3(128, 256), stored, [False] * 4, on)  # (layer 1's rows gathered)


def test_rows_in_load_order_take_room_only_where_forward_leaves_none():
    """Their index arrays (two of a chunk's and of a step's, int64) cost no device
    memory where they fit the gradient slots forward passes leave unused; else
    they need room the budget leaves, or rows are gathered."""
    graph = CASES["halo_heavy"](seed=9)
    _, _, ex = chunked_step(make_model("gcn"), graph, 1, 5, "auto", ordered_rows=True)
    plan, once = ex.plan.plan, [True, True]
    most = ex.chunks.max_rows()[1]
    p = np.asarray(plan.load_ptr)
    arrays = 8 * (2 * most + 2 * int(np.diff(p)[1:].max()))
    assert executor.first_load_index_bytes(plan, most, arrays) == 0
    assert executor.first_load_index_bytes(plan, most, arrays - 1) == 2 * arrays
    room = executor.ordered_rows_room
    assert room(plan, once, True, None, most, 0) == 2 * arrays
    assert room(plan, once, True, 2 * arrays - 1, most, 0) is None
    assert room(plan, once, True, 0, most, arrays) == 0
    assert room(plan, once, False, None, most, arrays) is None
    assert room(plan, [True, False], True, None, most, arrays) is None  # (no layer reads once)
    # (the executor's own arrays are no longer than those bounds)
    chunk, step = ex._first_loads.largest()
    assert 8 * (chunk + step) <= arrays


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["gcn", "sage"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_next_forward_rows_travel_during_backward(layer, chunks):
    """With a cached first layer reading its inputs in load order, the first
    layer's backward pass brings the next forward's first rows and block; the
    next step (and an evaluation) then starts from them and stays exact."""
    graph = CASES["skewed"](seed=6)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 1, chunks, "auto", device="cuda", ordered=True)
    assert ex._prefetch and ex._ahead is not None
    assert_matches(model, res.loss, *reference_step(model, g))
    asked, rows = [], []
    orig = ex._fetch_rows
    ex._fetch_rows = lambda l, i, *a: asked.append((l, i)) or orig(l, i, *a)
    first = ex.mover.traffic.h2d_rows
    for epoch in (4, 5):
        before = ex.mover.traffic.h2d_rows
        res = ex.step(epoch)
        rows.append(ex.mover.traffic.h2d_rows - before)
        assert (0, 0) not in asked and ex._ahead is not None
        assert_matches(model, res.loss, *reference_step(model, g, epoch))
    # a step moves what one without it would: the next step's first rows
    # instead of its own
    p = ex.plan.plan.load_ptr
    assert rows[0] == rows[1] == first - int(p[1] - p[0])
    ex.evaluate(6)
    logits = ex.buf.h[-1].clone()
    assert (0, 0) not in asked and ex._ahead is None
    ex._prefetch = False
    ex.evaluate(7)
    assert torch.equal(ex.buf.h[-1], logits)
    assert (0, 0) in asked


def _kept_grad_at(ex: Executor, l: int) -> int:
    return ex._offset(ex._kept_grads(l))


def test_kept_gradients_at_the_transition_buffers_end_keep_steps_exact(monkeypatch):
    """Where the next forward's first rows travel during backward (a GPU:
    ``Executor._clear_first_rows``, called here by hand), a narrow last layer
    moving whole keeps the loss gradient ∇h^3 and ∇h^2 on the device at the
    transition buffer's end, clear of those rows, ∇h^2 copied there from
    where layer 2's backward added it up: the steps stay exact."""
    rule = executor.layers_moved_whole
    monkeypatch.setattr(executor, "layers_moved_whole",
                        lambda *a, **k: [False] + rule(*a, **k)[1:])
    graph = CASES["self_loops"](seed=5)
    model = three_layers("gcn", True)
    res, g, ex = chunked_step(model, graph, 1, 24, "auto", ordered=True, whole=True)
    assert ex._kept[2] and ex._kept[3] and ex._kept_end is None
    assert _kept_grad_at(ex, 2) == _kept_grad_at(ex, 3) == 0 and ex._prefetch_in == 1
    assert_matches(model, res.loss, *reference_step(model, g))  # (at the start)
    first = int(ex.plan.plan.load_ptr[1]) * ex._widths[0]
    ex._clear_first_rows(first)
    end = ex._tbuf.numel() - g.num_nodes * ex._widths[2]
    assert _kept_grad_at(ex, 2) == _kept_grad_at(ex, 3) == end >= first
    assert ex._prefetch_in == 2 and ex._prefetch_start(first) == 0
    for epoch in (4, 5):
        assert_matches(model, ex.step(epoch).loss, *reference_step(model, g, epoch))


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [24, 40])
def test_next_forward_rows_travel_beside_the_kept_gradient(chunks, monkeypatch):
    """Where the first layer's backward runs on layer 1's flushes, a backward
    pass brings the next forward's first rows into the transition buffer's
    first rows. ∇h^3 and ∇h^2 kept on the device (a narrow last
    layer moving whole) go to the buffer's end, so they travel from the first
    item of the last layer's backward (24 chunks); where that still covers
    them (40 chunks: a smaller buffer), during layer 1's from the second item
    after the last whose chunk reads rows of ∇h^2 lying under them (on this
    small graph near the end). The steps stay exact. (The first layer moves
    the plan's rows here, as its inputs kept in load order need.)"""
    rule = executor.layers_moved_whole
    monkeypatch.setattr(executor, "layers_moved_whole",
                        lambda *a, **k: [False] + rule(*a, **k)[1:])
    graph = CASES["self_loops"](seed=5)
    model = three_layers("gcn", True)
    res, g, ex = chunked_step(model, graph, 1, chunks, "auto", device="cuda",
                              ordered=True, whole=True)
    assert ex.first_in_flushes and ex._kept[2]
    assert _kept_grad_at(ex, 2) == ex._tbuf.numel() - g.num_nodes * ex._widths[2]
    if chunks == 24:
        assert ex._prefetch and ex._prefetch_in == 2 and ex._prefetch_from == 0
    else:
        assert ex._prefetch and ex._prefetch_in == 1
        assert 0 < ex._prefetch_from < len(ex.plan.items)
    assert_matches(model, res.loss, *reference_step(model, g))
    asked = []
    orig = ex._fetch_rows
    ex._fetch_rows = lambda l, i, *a: asked.append((l, i)) or orig(l, i, *a)
    for epoch in (4, 5):
        res = ex.step(epoch)
        assert (0, 0) not in asked and ex._ahead is not None
        assert_matches(model, res.loss, *reference_step(model, g, epoch))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("parts", [1, 3])
def test_rows_kept_across_batches_do_not_change_the_step(layer, parts):
    """Rows kept through the batches that do not read them (spare memory) are
    loaded once, and their gradients flushed once, with the same step."""
    graph = CASES["skewed"](seed=6)
    model = make_model(layer)
    _, _, plain = chunked_step(copy.deepcopy(model), graph, parts, 6, "recompute")
    res, g, ex = chunked_step(model, graph, parts, 6, "recompute", cache_rows=4)
    plan = ex.transfer_plan
    assert plan.cached_rows > 0 and plan.h2d_rows < plain.transfer_plan.h2d_rows
    saved = plain.transfer_plan.h2d_rows - plan.h2d_rows
    L = model.num_layers
    # every pass loads the neighbour rows (recompute: forward and backward)
    assert plain.mover.traffic.h2d_rows - ex.mover.traffic.h2d_rows == 2 * L * saved
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


def test_cached_and_recompute_paths_move_different_rows():
    """The hybrid reloads aggregates instead of neighbour rows in backward."""
    graph = CASES["halo_heavy"](seed=0)
    model = make_model("gcn")
    _, _, ex_auto = chunked_step(copy.deepcopy(model), graph, 1, 4, "auto")
    _, _, ex_rec = chunked_step(copy.deepcopy(model), graph, 1, 4, "recompute")
    assert ex_auto.mover.traffic.h2d_rows < ex_rec.mover.traffic.h2d_rows


def test_no_dropout_step_is_independent_of_epoch():
    graph = CASES["isolated"](seed=0)
    model = make_model("sage", dropout=0.0)
    r1, _, _ = chunked_step(copy.deepcopy(model), graph, 1, 3, "auto", epoch=0)
    r2, _, _ = chunked_step(copy.deepcopy(model), graph, 1, 3, "auto", epoch=5)
    assert r1.loss == r2.loss


def test_dropout_masks_change_between_epochs():
    graph = CASES["isolated"](seed=0)
    model = make_model("gcn", dropout=0.5)
    r1, _, _ = chunked_step(copy.deepcopy(model), graph, 1, 3, "auto", epoch=0)
    r2, _, _ = chunked_step(copy.deepcopy(model), graph, 1, 3, "auto", epoch=1)
    assert r1.loss != r2.loss


@pytest.mark.parametrize("layer,whole", [("gat", False), ("gcn", False), ("gcn", True)])
def test_evaluation_matches_full_graph_logits(layer, whole):
    """Evaluation logits and accuracy counts equal the in-memory model's (with
    whole layers, the first layer and GCN's weight-first layer read their rows
    in place)."""
    graph = CASES["skewed"](seed=0)
    model = make_model(layer)
    _, g, ex = chunked_step(model, graph, 1, 4, "auto", whole=whole)
    assert ex._in_place == [whole, whole]
    res = ex.evaluate(epoch=0)
    ref = copy.deepcopy(model).double().eval()
    ref.transform_first = False
    block = build_block(g.indptr, g.indices, g.in_degree(), 0, g.num_nodes, torch.float64,
                        src_ids=np.arange(g.num_nodes))
    with torch.no_grad():
        logits = ref.full_forward(block, torch.from_numpy(g.x).double(), [0, 0])
    torch.testing.assert_close(ex.buf.h[-1].double(), logits, rtol=1e-5, atol=1e-5)
    pred = logits.argmax(-1).numpy()
    for split in ("train", "val", "test"):
        m = getattr(g, f"{split}_mask")
        assert res.correct[split] == int((pred[m] == g.y[m]).sum())
        assert res.total[split] == int(m.sum())


def _as_resident(monkeypatch) -> None:
    """Executors built from here on take their CPU buffers for resident ones (chunks
    read h^l and add into ∇h^l in place), as a resident executor has its paths."""
    orig = Executor.__init__

    def resident_init(self, *a, **kw):
        orig(self, *a, **kw)
        self._direct = self.resident = True
        self._whole = [False] * len(self._whole)  # (as a resident executor has it)
        self._in_flushes = False
        self._in_place = self._in_slots = [False] * len(self._whole)

    monkeypatch.setattr(Executor, "__init__", resident_init)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("chunks", [1, 3])
def test_resident_arithmetic_on_cpu(layer, chunks, monkeypatch):
    """The resident path (chunks read h^l and add into ∇h^l in place, no transition
    buffer) checked on CPU: the executor is told its buffers are resident."""
    _as_resident(monkeypatch)
    graph = CASES["skewed"](seed=6)
    model = make_model(layer)
    res, g, _ = chunked_step(model, graph, 1, chunks, "auto")
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


def test_forward_passes_end_before_their_stores_only_where_loads_wait_for_them(monkeypatch):
    """A training forward pass may end before its stores are done
    (``Executor._ends_before_stores``) out of core in one process, where every
    later read of what they write is a load that waits for them; not where
    the pass writes the next layer's rows in first-load order (index arrays
    the store stream reads from memory backward passes load into), nor
    resident, where later passes read those buffers in place."""
    graph = CASES["halo_heavy"](seed=9)
    _, _, ex = chunked_step(three_layers("gcn", True), graph, 1, 5, "auto")
    assert [ex._ends_before_stores(l) for l in range(3)] == [True] * 3
    _, _, ex = chunked_step(three_layers("gcn", True), graph, 1, 5, "auto", ordered_rows=True)
    written = [ex._ordered_rows[l + 1] is not None for l in range(3)]
    assert any(written)
    assert [ex._ends_before_stores(l) for l in range(3)] == [not w for w in written]
    _as_resident(monkeypatch)
    _, _, ex = chunked_step(three_layers("gcn", True), graph, 1, 5, "auto")
    assert not any(ex._ends_before_stores(l) for l in range(3))


#: layers whose update graph a resident run keeps (two-layer models of make_model):
#: GCN writes its update's backward out (and its last layer stores no aggregate),
#: GAT and the example's gated layer are not cacheable (recomputed in full)
KEPT_GRAPHS = {"gcn": [], "sage": [0, 1], "gin": [0, 1], "gat": [],
               "examples.edge_weighted_conv:EdgeWeightedConv": []}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("chunks", [1, 3])
def test_resident_kept_update_graphs_equal_full_graph(layer, chunks, monkeypatch):
    """Resident, with the updates' autograd graphs kept from forward to backward
    (``keep_graphs``, checked on CPU as above): the same step, those layers run no
    update again in backward and store no aggregate, and no graph is left."""
    _as_resident(monkeypatch)
    again, stored = [], []
    update_backward, store_range = executor._update_backward, Mover.store_range
    monkeypatch.setattr(executor, "_update_backward",
                        lambda model, l, *a, **kw: again.append(l) or update_backward(
                            model, l, *a, **kw))
    monkeypatch.setattr(Mover, "store_range",
                        lambda self, host, *a: stored.append(host.data_ptr())
                        or store_range(self, host, *a))
    graph = CASES["skewed"](seed=6)
    model = make_model(layer)
    res, g, ex = chunked_step(model, graph, 1, chunks, "auto", keep_graphs=True)
    assert ex.kept_graphs == KEPT_GRAPHS[layer]
    assert not set(again) & set(ex.kept_graphs)
    assert not {ex.buf.agg[l].data_ptr() for l in ex.kept_graphs} & set(stored)
    assert not ex._graphs
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("checkpoint", ["auto", "recompute"])
@pytest.mark.parametrize("mode", ["overlap", "serial", "kept", "copied-blocks", "resident",
                                  "resident-1", "resident-graphs", "whole", "whole-serial",
                                  "first-whole", "first-by-time", "ordered", "ordered-rows"])
def test_cuda_step_equals_full_graph(layer, checkpoint, mode, monkeypatch):
    """The GPU paths are exact too: pinned buffers with zero-copy gathers and staged
    flushes, with transfers one batch ahead on their own streams or in program
    order, with rows kept across batches, with chunk blocks copied batch by batch
    (int32 on the host), with every buffer resident on the device (and the
    updates' autograd graphs kept from forward to backward), with
    every layer's rows moved whole (one copy each way per pass), with the
    first layer's alone (the others' plan rows in the same memory), and with
    the first layer's rows copied from its inputs stored in load order (and
    later layers' from rows the forward pass wrote in load order). With
    loads beside stores (a GPU, overlap) the first layer moves whole only where
    its pass is shorter by link time ("first-by-time"); the whole modes have it
    move whole wherever its plan loads more rows, as on a CPU."""
    if "whole" in mode:
        monkeypatch.setattr(budget, "first_layer_whole_faster",
                            lambda n, width, load_rows, first_rows, stores: load_rows > n)
    if mode == "first-by-time":  # (and the CPU run beside it decides as the GPU's)
        by_time = executor.first_layer_rows
        monkeypatch.setattr(executor, "first_layer_rows",
                            lambda plan, widths, cached, overlapped:
                            by_time(plan, widths, cached, True))
    graph = CASES["self_loops" if mode == "first-whole" else "skewed"](seed=3)
    model = make_model(layer)
    parts, chunks = {"resident-1": (1, 1), "kept": (2, 6), "whole": (2, 6),
                     "whole-serial": (2, 6), "first-whole": (1, 6),
                     "first-by-time": (1, 6)}.get(mode, (2, 3))
    kept = 4 if mode == "kept" else 0
    whole, serial = "whole" in mode or mode == "first-by-time", mode.endswith("serial")
    ordered, rows = mode.startswith("ordered"), mode == "ordered-rows"
    _, _, on_cpu = chunked_step(copy.deepcopy(model), graph, parts, chunks, checkpoint,
                                cache_rows=kept, whole=whole, ordered_rows=rows)
    res, g, ex = chunked_step(model, graph, parts, chunks, checkpoint, device="cuda",
                              overlap=not serial, resident=mode.startswith("resident"),
                              cache_rows=kept, resident_blocks=mode != "copied-blocks",
                              whole=whole, ordered=ordered, ordered_rows=rows,
                              keep_graphs=mode == "resident-graphs")
    assert ex.kept_graphs == (KEPT_GRAPHS[layer] if mode == "resident-graphs"
                              and checkpoint == "auto" else [])
    assert (ex._ordered is not None) == ordered
    assert ex.ordered_rows == on_cpu.ordered_rows
    assert bool(ex.ordered_rows) == (rows and checkpoint == "auto" and layer == "gcn")
    if ex.ordered_rows:
        assert ex._ordered_rows[1].is_pinned()
    if mode == "first-whole":
        # (GCN's rows are as narrow in both layers: both move whole.)
        assert ex._whole == on_cpu._whole == [True, layer == "gcn"]
    elif mode == "first-by-time":
        # the plan loads more rows than the graph has, yet by link time its
        # first pass is shorter step by step
        assert int(ex.plan.plan.load_ids.shape[0]) > g.num_nodes
        assert ex._whole == on_cpu._whole and ex._whole[1:] == [True] * (model.num_layers - 1)
        assert not ex._whole[0]
    else:
        assert ex._whole == [whole] * model.num_layers  # (the plan loads some rows twice)
    assert (ex.transfer_plan.cached_rows > 0) == (mode == "kept")
    assert ex._copy_blocks == (mode == "copied-blocks")
    # the loss read after backward is issued: everything in pinned host memory
    assert ex._late_result == (not mode.startswith("resident"))
    moved, expect = ex.mover.traffic, on_cpu.mover.traffic
    # The pinned flush staging is as large as the largest flush the step staged.
    stages = ex.mover._stages
    assert ex.mover.staging_grown == 0
    assert ex.mover.staged_most == (stages[0].numel() if stages else 0)
    if mode.startswith("resident"):
        assert ex.resident and moved.h2d_bytes == moved.d2h_bytes == 0
    else:
        assert ex.buf.pinned and ex.mover.overlap == (not serial)
        # (and, ordered, the next step's first rows during the first layer's backward)
        p = ex.plan.plan.load_ptr
        ahead = int(p[1] - p[0]) if ex._prefetch else 0
        assert ordered or not ex._prefetch
        assert (moved.h2d_rows, moved.d2h_rows) == (expect.h2d_rows + ahead, expect.d2h_rows)
    if mode == "copied-blocks":
        # Blocks travel for every pass but the first layer's backward when that
        # recomputes only a cached update (no graph: its inputs get no gradient;
        # its own rows, where it reads them, come as a range);
        # forward passes leave the transpose behind unless the layer reads it,
        # and a cached layer's backward the edges its transpose does not read.
        own = {it[2] for it in ex.plan.items}

        def moves(skip):  # (arrays side by side travel as one copy, with their padding)
            got = sum(ex.mover.block_bytes(ex._blocks[c], skip) for c in own)
            payload = sum(ex._blocks[c].nbytes(skip=skip) for c in own)
            assert 0 <= got - payload <= 128 * len(BLOCK_LAYOUT) * len(own)
            return got

        full, lean, grad = moves(()), moves(Block.TRANSPOSE), moves(Block.NOT_TRANSPOSED)
        assert lean < full and grad < full
        forward = sum(full if layer.reads_transpose else lean for layer in model.layers)
        backward = sum(grad if ex.cached[l] else full for l, layer in enumerate(model.layers)
                       if not (l == 0 and ex.cached[0]))
        assert moved.h2d_bytes - expect.h2d_bytes == forward + backward
    ref_loss, ref_grads = reference_step(model, g)
    assert_matches(model, res.loss, ref_loss, ref_grads)
