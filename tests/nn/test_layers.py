"""Built-in layers against PyG, chunked against full-graph, and the engine's step hooks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

from examples.edge_weighted_conv import EdgeWeightedConv
from hongtu.nn import GAT, GCN, GIN, GNN, SAGE, build_block, build_model, ops
from hongtu.nn.block import Block
from hongtu.nn.layer import GNNLayer

N, F_IN, F_OUT = 40, 6, 5
ATOL = 1e-10


def random_graph(num_nodes: int = N, avg_degree: float = 4.0, seed: int = 0):
    """Random directed edges plus exactly one self-loop per vertex, in CSC order.

    Vertex 3 reads only its self-loop; some vertices have no out-edges.
    Returns ``(edge_index, indptr, indices, in_deg)``.
    """
    rng = np.random.default_rng(seed)
    m = int(avg_degree * num_nodes)
    src = rng.integers(0, num_nodes, m)
    dst = rng.integers(0, num_nodes, m)
    keep = (src != dst) & (dst != 3)
    pairs = np.unique(np.stack([dst[keep], src[keep]], 1), axis=0)  # sorted by (dst, src)
    loops = np.arange(num_nodes)
    dst = np.concatenate([pairs[:, 0], loops])
    src = np.concatenate([pairs[:, 1], loops])
    order = np.lexsort((src, dst))
    src, dst = src[order], dst[order]
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
    edge_index = torch.from_numpy(np.stack([src, dst]).astype(np.int64))
    return edge_index, indptr, src.astype(np.int64), np.diff(indptr).astype(np.float64)


EDGE_INDEX, INDPTR, INDICES, IN_DEG = random_graph()


def full_block() -> Block:
    return build_block(INDPTR, INDICES, IN_DEG, 0, N, dtype=torch.float64)


def chunk_blocks(bounds=(0, 11, 27, N)) -> list[Block]:
    return [build_block(INDPTR, INDICES, IN_DEG, a, b, dtype=torch.float64)
            for a, b in itertools.pairwise(bounds)]


def features(width: int = F_IN, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, width, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def run_block(layer: GNNLayer, block: Block, x: torch.Tensor) -> torch.Tensor:
    x_dst = x[block.dst_start:block.dst_start + block.num_dst]
    return layer(block, x[block.src_ids], x_dst)


def make(cls, *args, **kwargs) -> GNNLayer:
    torch.manual_seed(0)
    return cls(*args, **kwargs).double()


# --------------------------------------------------------------- PyG oracles
def test_graph_has_the_cases():
    assert torch.equal(EDGE_INDEX[0][EDGE_INDEX[1] == 3], torch.tensor([3]))
    assert (EDGE_INDEX[0] == EDGE_INDEX[1]).sum() == N
    assert torch.equal(full_block().src_ids, torch.arange(N))


def test_gcn_matches_pyg():
    ours = make(GCN, F_IN, F_OUT)
    with torch.no_grad():
        ours.bias.uniform_(-1, 1)  # a non-zero bias, so the test sees it
    ref = GCNConv(F_IN, F_OUT).double()  # adds no loops: the graph has one per vertex
    with torch.no_grad():
        ref.lin.weight.copy_(ours.lin.weight)
        ref.bias.copy_(ours.bias)
    x = features()
    torch.testing.assert_close(run_block(ours, full_block(), x), ref(x, EDGE_INDEX),
                               rtol=0, atol=ATOL)


def test_sage_matches_pyg():
    ours = make(SAGE, F_IN, F_OUT)
    ref = SAGEConv(F_IN, F_OUT).double()
    with torch.no_grad():
        ref.lin_l.weight.copy_(ours.lin_l.weight)
        ref.lin_l.bias.copy_(ours.lin_l.bias)
        ref.lin_r.weight.copy_(ours.lin_r.weight)
    x = features()
    torch.testing.assert_close(run_block(ours, full_block(), x), ref(x, EDGE_INDEX),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("eps,train_eps", [(0.0, False), (0.3, True)])
def test_gin_matches_pyg(eps, train_eps):
    ours = make(GIN, F_IN, F_OUT, hidden=7, eps=eps, train_eps=train_eps)
    assert isinstance(ours.eps, torch.nn.Parameter) == train_eps
    ref = GINConv(ours.mlp, eps=eps, train_eps=train_eps).double()  # the same MLP object
    x = features()
    torch.testing.assert_close(run_block(ours, full_block(), x), ref(x, EDGE_INDEX),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("heads,concat", [(1, True), (1, False), (3, True), (3, False)])
def test_gat_matches_pyg(heads, concat):
    ours = make(GAT, F_IN, F_OUT, heads=heads, concat=concat, negative_slope=0.1)
    with torch.no_grad():
        ours.bias.uniform_(-1, 1)
    ref = GATConv(F_IN, F_OUT, heads=heads, concat=concat, negative_slope=0.1,
                  add_self_loops=False).double()
    with torch.no_grad():
        ref.lin.weight.copy_(ours.lin.weight)
        ref.att_src.copy_(ours.att_src)
        ref.att_dst.copy_(ours.att_dst)
        ref.bias.copy_(ours.bias)
    ours.eval()
    ref.eval()
    x = features()
    out = run_block(ours, full_block(), x)
    assert out.shape == (N, ours.out_width) == (N, heads * F_OUT if concat else F_OUT)
    torch.testing.assert_close(out, ref(x, EDGE_INDEX), rtol=0, atol=ATOL)


# ------------------------------------------------------------ layer surface
LAYERS = {
    "gcn": lambda: make(GCN, F_IN, F_OUT),
    "sage": lambda: make(SAGE, F_IN, F_OUT),
    "gin": lambda: make(GIN, F_IN, F_OUT),
    "gat1": lambda: make(GAT, F_IN, F_OUT),
    "gat3": lambda: make(GAT, F_IN, F_OUT, heads=3),
    "gat3-mean": lambda: make(GAT, F_IN, F_OUT, heads=3, concat=False),
    "gat3-drop": lambda: make(GAT, F_IN, F_OUT, heads=3, dropout=0.5),
    "edge-weighted": lambda: make(EdgeWeightedConv, F_IN, F_OUT),
}


def test_cacheable():
    expected = {"gcn": True, "sage": True, "gin": True, "gat1": False, "gat3": False,
                "gat3-mean": False, "gat3-drop": False, "edge-weighted": False}
    assert {name: f().cacheable for name, f in LAYERS.items()} == expected


def test_reads_transpose():
    """Forward passes copy blocks without their transpose unless a layer may read it:
    built-ins never do; a layer overriding forward is assumed to unless it says not."""
    expected = {name: name == "edge-weighted" for name in LAYERS}
    assert {name: f().reads_transpose for name, f in LAYERS.items()} == expected

    class Declared(EdgeWeightedConv):
        forward_reads_transpose = False

    assert not Declared(F_IN, F_OUT).reads_transpose


def test_repr_and_width():
    assert repr(GCN(128, 64)) == "GCN(128, 64)"
    assert repr(SAGE(128, 64)) == "SAGE(128, 64)"
    assert repr(GIN(128, 64, hidden=32)) == "GIN(128, 64)"
    assert repr(GAT(128, 8, heads=8)) == "GAT(128, 8, heads=8)"
    assert repr(EdgeWeightedConv(16, 4)) == "EdgeWeightedConv(16, 4)"
    assert GAT(128, 8, heads=8).out_width == 64
    assert GAT(128, 8, heads=8, concat=False).out_width == 8
    assert SAGE(3, 4, bias=False).lin_l.bias is None
    assert GAT(3, 4, bias=False).bias is None


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("training", [False, True])
def test_chunked_equals_full_graph(name, training):
    layer = LAYERS[name]()
    layer.train(training)
    x = features()
    full = full_block()
    full.seed = 12345
    expected = run_block(layer, full, x)
    parts = []
    for block in chunk_blocks():
        block.seed = 12345
        parts.append(run_block(layer, block, x))
    torch.testing.assert_close(torch.cat(parts), expected, rtol=0, atol=ATOL)


def test_gat_attention_dropout_is_keyed_by_seed_and_edge():
    layer = LAYERS["gat3-drop"]().train()
    x = features()
    block = full_block()
    block.seed = 1
    a, b = run_block(layer, block, x), run_block(layer, block, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation draws the same mask
    block.seed = 2
    assert not torch.allclose(run_block(layer, block, x), a)
    layer.eval()
    block.seed = 1
    assert not torch.allclose(run_block(layer, block, x), a)


def test_gat_gradients_chunked_equal_full():
    layer = LAYERS["gat3-drop"]().train()
    x = features().requires_grad_()
    w = torch.randn(N, layer.out_width, dtype=torch.float64)
    full = full_block()
    full.seed = 7
    (run_block(layer, full, x) * w).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    for block in chunk_blocks():
        block.seed = 7
        out = run_block(layer, block, x)
        (out * w[block.dst_start:block.dst_start + block.num_dst]).sum().backward()
    got = [p.grad for p in layer.parameters()] + [x.grad]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=ATOL)


def test_extra_device_bytes_counts_edges():
    gat, gcn = GAT(64, 8, heads=8), GCN(64, 64)
    small = gat.extra_device_bytes(1000, 100, 10_000, 4)
    large = gat.extra_device_bytes(1000, 100, 100_000, 4)
    assert large - small >= 90_000 * 8 * 4 * 4  # several floats per edge and head
    assert small > gcn.extra_device_bytes(1000, 100, 10_000, 4)


def test_layers_need_own_rows():
    x = features()
    block = full_block()
    for layer in (make(SAGE, F_IN, F_OUT), make(GIN, F_IN, F_OUT), make(GAT, F_IN, F_OUT)):
        assert layer.needs_dst
        with pytest.raises(ValueError, match="x_dst"):
            layer(block, x, None)


# ------------------------------------------------------- engine step hooks
CACHEABLE = ["gcn", "sage", "gin"]


def two_layer_model(name: str, p: float = 0.5) -> GNN:
    torch.manual_seed(0)
    cls = {"gcn": GCN, "sage": SAGE, "gin": GIN}[name]
    return GNN([cls(F_IN, 8), cls(8, F_OUT)], dropout=p).double().train()


@pytest.mark.parametrize("name", CACHEABLE)
@pytest.mark.parametrize("l", [0, 1])
def test_step_update_of_aggregate_equals_step_forward(name, l):
    model = two_layer_model(name)
    x = features(model.widths()[l])
    seed = 4242 + l
    for block in [full_block()] + chunk_blocks():
        x_src = x[block.src_ids]
        x_dst = x[block.dst_start:block.dst_start + block.num_dst]
        x_dst = x_dst if model.layers[l].needs_dst else None
        a = model.step_aggregate(l, block, x_src, seed)
        got = model.step_update(l, block, a, x_dst, seed)
        expected = model.step_forward(l, block, x_src, x_dst, seed)
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", CACHEABLE)
@pytest.mark.parametrize("training", [True, False])
def test_step_aggregate_transpose_is_the_gradient(name, training):
    model = two_layer_model(name).train(training)
    x = features()
    for block in [full_block()] + chunk_blocks():
        x_src = x[block.src_ids].clone().requires_grad_()
        a = model.step_aggregate(0, block, x_src, seed=99)
        g = torch.randn_like(a)
        (expected,) = torch.autograd.grad(a, x_src, g)
        got = model.step_aggregate_transpose(0, block, g, seed=99)
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat", "edge"])
def test_full_forward_equals_chunked_steps(name):
    """Two layers, dropout on: the chunked step sequence equals the in-memory model."""
    torch.manual_seed(0)
    if name == "gat":
        layers = [GAT(F_IN, 4, heads=2, dropout=0.5), GAT(8, F_OUT, concat=False, dropout=0.5)]
    elif name == "edge":
        layers = [EdgeWeightedConv(F_IN, 8), EdgeWeightedConv(8, F_OUT)]
    else:
        cls = {"gcn": GCN, "sage": SAGE, "gin": GIN}[name]
        layers = [cls(F_IN, 8), cls(8, F_OUT)]
    model = GNN(layers, dropout=0.5).double().train()
    seeds = [11, 22]
    x = features()
    expected = model.full_forward(full_block(), x, seeds)
    h = x
    for l in range(model.num_layers):
        outs = []
        for block in chunk_blocks():
            x_dst = h[block.dst_start:block.dst_start + block.num_dst]
            outs.append(model.step_forward(l, block, h[block.src_ids],
                                           x_dst if model.layers[l].needs_dst else None,
                                           seeds[l]))
        h = torch.cat(outs)
    torch.testing.assert_close(h, expected, rtol=0, atol=ATOL)


def test_build_model_builds_every_builtin():
    from hongtu.config import ModelConfig

    for layer in ("gcn", "sage", "gin", "gat"):
        model = build_model(ModelConfig(layer=layer, hidden=8, layers=2, heads=2), 6, 3)
        assert model.widths() == [6, 16 if layer == "gat" else 8, 3]
    custom = build_model(
        ModelConfig(layer="examples.edge_weighted_conv:EdgeWeightedConv", hidden=8), 6, 3)
    assert [repr(m) for m in custom.layers] == ["EdgeWeightedConv(6, 8)",
                                                "EdgeWeightedConv(8, 3)"]


@pytest.mark.parametrize("name", list(LAYERS))
def test_empty_blocks(name):
    """A chunk with no destinations, and one whose destinations have no in-edges."""
    layer = LAYERS[name]().train()
    indptr = np.array([0, 0, 0, 2], dtype=np.int64)  # vertices 0, 1 isolated; 0, 1 -> 2
    indices = np.array([0, 1], dtype=np.int64)
    deg = np.diff(indptr).astype(np.float64)
    x = torch.randn(3, F_IN, dtype=torch.float64, requires_grad=True)
    for a, b in [(1, 1), (0, 2)]:
        block = build_block(indptr, indices, deg, a, b, dtype=torch.float64)
        out = layer(block, x[block.src_ids], x[a:b])
        assert out.shape == (b - a, layer.out_width)
        out.sum().backward()
        assert torch.isfinite(out).all()


# ---------------------------------------------------------- transform first
def three_gcn(transform_first: bool) -> GNN:
    """6 -> 16 -> 8 -> 3: the last two layers narrow their rows."""
    torch.manual_seed(0)
    layers = [GCN(F_IN, 16), GCN(16, 8), GCN(8, F_OUT)]
    return GNN(layers, dropout=0.5, transform_first=transform_first).double().train()


def test_which_layers_transform_first():
    assert [three_gcn(True).transforms_first(l) for l in range(3)] == [False, True, True]
    assert three_gcn(True).row_widths() == [F_IN, 8, F_OUT, F_OUT]
    plain = three_gcn(False)
    assert not any(plain.transforms_first(l) for l in range(3))
    assert plain.row_widths() == plain.widths() == [F_IN, 16, 8, F_OUT]
    # widening GCN layers, layers that read their own rows or have no separate
    # linear map (SAGE, GIN, GAT, a custom update) keep aggregating h
    widening = GNN([GCN(F_IN, 4), GCN(4, 8)], transform_first=True)
    assert not widening.transforms_first(1)
    for second in (SAGE(16, 4), GIN(16, 4), GAT(16, 4, concat=False)):
        assert not GNN([GCN(F_IN, 16), second], transform_first=True).transforms_first(1)

    class NoTransform(GCN):
        def update(self, a, x_dst):
            return torch.tanh(super().update(a, x_dst))

    assert not NoTransform(16, 4).can_transform_first
    assert GCN(16, 4).can_transform_first


class ScaledFinish(GCN):
    """GCN whose finish reads its input (a custom per-row step)."""

    def finish(self, a):
        return super().finish(2.0 * a)


class BiasOnly(ScaledFinish):
    """Declares an adding finish of its own: counts again."""

    finish_adds_only = True

    def finish(self, a):
        return a + self.bias


def test_stored_aggregates_skip_a_last_layer_that_only_adds():
    """A last layer that transforms first and finishes with a bias needs no
    aggregate in backward; every other cached layer stores its aggregate."""
    assert three_gcn(True).stored_aggregates() == [True, True, False]
    assert three_gcn(False).stored_aggregates() == [True, True, True]
    assert three_gcn(True).stored_aggregates("recompute") == [False, False, False]
    assert not GCN(8, 3).finish_reads_input
    # the promise only counts from the class that defines finish
    assert ScaledFinish(8, 3).finish_reads_input and not BiasOnly(8, 3).finish_reads_input
    for last, stored in ((ScaledFinish(8, 3), True), (BiasOnly(8, 3), False)):
        m = GNN([GCN(F_IN, 8), last], transform_first=True)
        assert m.transforms_first(1) and m.stored_aggregates() == [True, stored]
    # SAGE reads its own rows: it never transforms first, its aggregate is kept
    assert GNN([GCN(F_IN, 16), SAGE(16, 4)], transform_first=True).stored_aggregates() \
        == [True, True]


@pytest.mark.parametrize("l", [0, 1, 2])
def test_transform_first_steps_agree(l):
    """Each step keeps z^{l+1} = W drop(h^{l+1}) where the next layer transforms
    first; its aggregate-then-update path equals its full step, and its
    aggregate transpose is the gradient in z^l."""
    model = three_gcn(True)
    seeds = [5, 6, 7, None]
    x = features(model.row_widths()[l])
    for block in [full_block()] + chunk_blocks():
        x_src = x[block.src_ids].clone().requires_grad_()
        a = model.step_aggregate(l, block, x_src, seeds[l])
        got = model.step_update(l, block, a, None, seeds[l], seeds[l + 1])
        expected = model.step_forward(l, block, x_src, None, seeds[l], seeds[l + 1])
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
        assert got.shape[1] == model.row_widths()[l + 1]
        g = torch.randn_like(a)
        (want,) = torch.autograd.grad(a, x_src, g)
        torch.testing.assert_close(model.step_aggregate_transpose(l, block, g, seeds[l]), want,
                                   rtol=0, atol=ATOL)


def assert_same_function(model: GNN, plain: GNN, x: torch.Tensor, seeds: list[int]) -> None:
    """``model`` and ``plain`` give the same full-graph forward and the same
    gradient of every parameter."""
    out = model.full_forward(full_block(), x, seeds)
    ref = plain.full_forward(full_block(), x, seeds)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_transform_first_is_the_same_function():
    """Forward and every parameter gradient equal plain aggregate-then-transform."""
    assert_same_function(three_gcn(True), three_gcn(False), features(), [5, 6, 7])


# ------------------------------------------------------------ kept dropped
def kept_model(name: str, keep_dropped: bool, activation: str = "relu") -> GNN:
    """6 -> 16 -> 16 -> 3 with GCN's last layer transforming first; the middle
    layer (and a non-GCN stack's last) reads drop(h^l) as kept."""
    torch.manual_seed(0)
    cls = {"gcn": GCN, "sage": SAGE, "gin": GIN, "gat": GAT}[name]
    kw = {"concat": False} if name == "gat" else {}
    layers = [cls(F_IN, 16, **kw), cls(16, 16, **kw), cls(16, F_OUT, **kw)]
    return GNN(layers, dropout=0.5, activation=activation, transform_first=True,
               keep_dropped=keep_dropped).double().train()


def test_which_layers_keep_their_rows_dropped():
    assert [kept_model("gcn", True).keeps_dropped(l) for l in range(3)] == [False, True, False]
    assert [kept_model("gcn", True).reads_as_kept(l) for l in range(3)] == [False, True, True]
    assert [kept_model("sage", True).keeps_dropped(l) for l in range(3)] == [False, True, True]
    assert not any(kept_model("sage", False).reads_as_kept(l) for l in range(3))
    # the rows keep their width: only their values are dropped out
    assert kept_model("sage", True).row_widths() == kept_model("sage", False).row_widths()


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
@pytest.mark.parametrize("activation", ["relu", "elu"])
def test_kept_dropped_rows_are_the_same_function(name, activation):
    """Forward and every parameter gradient equal each layer dropping its own
    inputs; the rows layer 0 writes are layer 1's dropout of h^1."""
    model, plain = kept_model(name, True, activation), kept_model(name, False, activation)
    x = features()
    assert_same_function(model, plain, x, [5, 6, 7])
    block, x_dst = full_block(), x if model.layers[0].needs_dst else None
    with torch.no_grad():
        h1 = plain.step_forward(0, block, x, x_dst, 5)
        d1 = model.step_forward(0, block, x, x_dst, 5, 6)
        torch.testing.assert_close(d1, ops.dropout(h1, block.dst_ids(), 0.5, 6),
                                   rtol=0, atol=0)
        assert (d1 == 0).sum() > (h1 == 0).sum()  # (some rows were dropped)
        model.eval()  # evaluation drops nothing: the rows are h^1 itself
        plain.eval()
        torch.testing.assert_close(model.step_forward(0, block, x, x_dst, 5, 6),
                                   plain.step_forward(0, block, x, x_dst, 5), rtol=0, atol=0)


def test_kept_dropped_steps_agree():
    """The middle layer of a kept-dropped stack: aggregate-then-update equals the
    full step, and the aggregate's transpose is the gradient in drop(h^1)."""
    model = kept_model("gcn", True)
    x = features(16)
    for block in [full_block()] + chunk_blocks():
        x_src = x[block.src_ids].clone().requires_grad_()
        a = model.step_aggregate(1, block, x_src, 6)
        torch.testing.assert_close(a, ops.aggregate(block, x_src, "gcn"), rtol=0, atol=0)
        got = model.step_update(1, block, a, None, 6, 7)
        expected = model.step_forward(1, block, x_src, None, 6, 7)
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
        g = torch.randn_like(a)
        (want,) = torch.autograd.grad(a, x_src, g)
        torch.testing.assert_close(model.step_aggregate_transpose(1, block, g, 6), want,
                                   rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="next_seed"):
        model.step_forward(0, full_block(), features(), None, 5)


def test_transform_first_needs_the_next_seed():
    model = three_gcn(True)
    block = full_block()
    with pytest.raises(ValueError, match="next_seed"):
        model.step_forward(0, block, features(), None, 5)


# ------------------------------------------- update backward written out
def _grads(model: GNN) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("keep_dropped", [True, False])
@pytest.mark.parametrize("transform_first", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_update_backward_equals_autograd(keep_dropped, transform_first, training, bias,
                                         device):
    """GCN's update written out (linear, ReLU, the next layer's dropout when it
    keeps its rows dropped, its linear map when it transforms first) gives
    autograd's parameter and input gradients bit for bit, the parameters'
    added to those already there; on a GPU through the fused dropout kernel."""
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    layers = [GCN(F_IN, 16, bias=bias), GCN(16, 16, bias=bias), GCN(16, F_OUT, bias=bias)]
    model = GNN(layers, dropout=0.5, keep_dropped=keep_dropped,
                transform_first=transform_first).to(device, dtype).train(training)
    assert model.transforms_first(2) == transform_first
    seeds = [5, 6, 7, None]
    for l in (0, 1):
        x = features(model.row_widths()[l]).to(device, dtype)
        for block in [full_block()] + chunk_blocks():
            block = block.to(device)
            with torch.no_grad():
                a = model.step_aggregate(l, block, x[block.src_ids.to(device)], seeds[l])
            g = torch.randn(a.shape[0], model.row_widths()[l + 1], dtype=dtype, device=device)
            model.zero_grad(set_to_none=True)
            a_ref = a.clone().requires_grad_()
            model.step_update(l, block, a_ref, None, seeds[l], seeds[l + 1]).backward(g)
            want = _grads(model)
            model.zero_grad(set_to_none=True)
            done, g_a = model.update_backward(l, block, a, g, seeds[l + 1], need_input=True)
            assert done and torch.equal(g_a, a_ref.grad)
            got = _grads(model)
            assert sum(v is not None for v in got) == (2 if bias else 1) + \
                (l == 1 and transform_first)
            for w, v in zip(want, got):
                assert (w is None and v is None) or torch.equal(w, v)
            assert model.update_backward(l, block, a, g, seeds[l + 1]) == (True, None)
            for w, v in zip(want, _grads(model)):  # accumulated
                assert (w is None and v is None) or torch.equal(v, 2 * w)
    x = torch.zeros(3, F_IN, dtype=dtype, device=device)
    if keep_dropped or transform_first:
        with pytest.raises(ValueError, match="next_seed"):
            model.update_backward(1, full_block().to(device), x, x[:, :1], None)


class _ScaledGCN(GCN):
    """Changes ``update`` alone: GCN's ``linear_update`` no longer describes it."""

    def update(self, a, x_dst):
        return 2.0 * super().update(a, x_dst)


class _ScaledTransformGCN(GCN):
    """Changes ``update`` and ``transform`` alike, not ``linear_update``."""

    def update(self, a, x_dst):
        return self.finish(self.transform(a))

    def transform(self, x):
        return 2.0 * self.lin(x)


class _ScaledGIN(GIN):
    """Changes ``update`` alone: GIN's ``update_vjp`` no longer describes it."""

    def update(self, a, x_dst):
        return 2.0 * super().update(a, x_dst)


@pytest.mark.parametrize("kind", ["gin", "sage", "sage-gcn"])
@pytest.mark.parametrize("keep_dropped", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype,device", [
    (torch.float64, "cpu"), (torch.float32, "cpu"),
    pytest.param(torch.float32, "cuda", marks=pytest.mark.gpu)])
def test_written_update_equals_autograd(kind, keep_dropped, training, dtype, device):
    """A layer's update written out with its own rows (GIN's MLP and SAGE's two
    maps, :meth:`GNNLayer.update_vjp`), then ReLU and the next layer's dropout
    or, on the last layer, nothing (or, before a GCN layer that applies its
    weight first, that weight too), gives autograd's parameter, aggregate and
    own-row gradients bit for bit (the own rows' through the layer's dropout
    where it drops them), the parameters' added to those already there."""
    torch.manual_seed(0)
    if kind == "gin":
        layers = [GIN(F_IN, 16, hidden=12, eps=0.25), GIN(16, 16, eps=-0.5),
                  GIN(16, F_OUT, eps=0.75)]
    elif kind == "sage":
        layers = [SAGE(F_IN, 16), SAGE(16, 16, bias=False), SAGE(16, F_OUT)]
    else:
        layers = [SAGE(F_IN, 16), SAGE(16, 16), GCN(16, F_OUT)]
    model = GNN(layers, dropout=0.5, keep_dropped=keep_dropped,
                transform_first=kind == "sage-gcn").to(device, dtype).train(training)
    assert model.transforms_first(2) == (kind == "sage-gcn")
    seeds = [5, 6, 7, None]
    for l in range(2 if kind == "sage-gcn" else 3):
        assert model.writes_update_backward(l) and not model.writes_linear_backward(l)
        x = features(model.row_widths()[l]).to(device, dtype)
        for block in [full_block()] + chunk_blocks():
            block = block.to(device)
            with torch.no_grad():
                a = model.step_aggregate(l, block, x[block.src_ids.to(device)], seeds[l])
            own = x[block.dst_ids(device)]
            g = torch.randn(a.shape[0], model.row_widths()[l + 1], dtype=dtype, device=device)
            model.zero_grad(set_to_none=True)
            a_ref, x_ref = a.clone().requires_grad_(), own.clone().requires_grad_(l > 0)
            model.step_update(l, block, a_ref, x_ref, seeds[l], seeds[l + 1]).backward(g)
            want = _grads(model)
            model.zero_grad(set_to_none=True)
            x_got = own.clone().requires_grad_(l > 0)
            done, g_a = model.update_backward(l, block, a, g, seeds[l + 1], need_input=True,
                                              x_dst=x_got, seed=seeds[l])
            assert done and torch.equal(g_a, a_ref.grad)
            assert (x_got.grad is None) == (l == 0)
            assert l == 0 or torch.equal(x_got.grad, x_ref.grad)
            got = _grads(model)
            assert sum(v is not None for v in got) == len(list(model.layers[l].parameters())) \
                + (l == 1 and kind == "sage-gcn")
            for w, v in zip(want, got):
                assert (w is None and v is None) or torch.equal(w, v)
            assert model.update_backward(l, block, a, g, seeds[l + 1], x_dst=own,
                                         seed=seeds[l]) == (True, None)
            for w, v in zip(want, _grads(model)):  # accumulated
                assert (w is None and v is None) or torch.equal(v, 2 * w)
    with pytest.raises(ValueError, match="x_dst"):
        model.update_backward(l, full_block().to(device), a, g, 9)
    if training and not keep_dropped:
        with pytest.raises(ValueError, match="pass seed"):
            model.update_backward(l, full_block().to(device), a, g, 9, x_dst=own)


def test_update_backward_declines_what_it_does_not_know():
    """Other updates (a subclass changing ``update`` alone), GCN's last layer,
    ELU, a next layer transforming first by a map it does not declare,
    parameters with hooks, and an ``update_vjp`` that declines (GIN's with a
    trainable eps or another MLP) or whose layer's submodules have hooks:
    ``(False, None)``, no gradient touched, own rows' included."""
    torch.manual_seed(0)
    block = full_block()

    def declines(model: GNN, l: int = 0, x_dst: bool = False) -> bool:
        model = model.double()
        model.zero_grad(set_to_none=True)
        a = torch.randn(N, model.layers[l].in_channels, dtype=torch.float64)
        g = torch.randn(N, model.row_widths()[l + 1], dtype=torch.float64)
        x = a.clone().requires_grad_() if x_dst else None
        done = model.update_backward(l, block, a, g, 9, need_input=True, x_dst=x, seed=8)
        return (done == (False, None) and all(p.grad is None for p in model.parameters())
                and (x is None or x.grad is None))

    assert _ScaledGCN(F_IN, 16).linear_params is None
    assert GCN(F_IN, 16).linear_params is not None
    assert SAGE(F_IN, 16).linear_params is None
    conv = GCN(16, 4)
    assert conv.linear_transform is conv.lin.weight
    assert _ScaledTransformGCN(16, 4).linear_transform is None
    assert _ScaledTransformGCN(16, 4).can_transform_first
    assert declines(GNN([_ScaledGCN(F_IN, 16), GCN(16, F_OUT)], dropout=0.5))
    assert SAGE(F_IN, 16).writes_update and GIN(F_IN, 16).writes_update
    assert not _ScaledGIN(F_IN, 16).writes_update
    assert declines(GNN([_ScaledGIN(F_IN, 16), GIN(16, F_OUT)], dropout=0.5), x_dst=True)
    trained = GNN([GIN(F_IN, 16, train_eps=True), GIN(16, F_OUT)], dropout=0.5)
    assert trained.writes_update_backward(0)  # (its update_vjp declines when called)
    assert declines(trained, x_dst=True)
    other = GNN([GIN(F_IN, 16), GIN(16, F_OUT)], dropout=0.5)
    other.layers[0].mlp.append(torch.nn.ReLU())
    assert declines(other, x_dst=True)
    hooked_mlp = GNN([GIN(F_IN, 16), GIN(16, F_OUT)], dropout=0.5)
    hooked_mlp.layers[0].mlp[0].register_forward_hook(lambda m, i, o: o)
    assert not hooked_mlp.layers[0].writes_update and declines(hooked_mlp, x_dst=True)
    hooked_sage = GNN([SAGE(F_IN, 16), SAGE(16, F_OUT)], dropout=0.5)
    hooked_sage.layers[0].lin_r.register_full_backward_hook(lambda m, gi, go: None)
    assert declines(hooked_sage, x_dst=True)
    replaced = GNN([GIN(F_IN, 16), GIN(16, F_OUT)], dropout=0.5)
    replaced.layers[0].mlp = torch.nn.Linear(F_IN, 16)  # (any module may serve)
    assert declines(replaced, x_dst=True)
    assert declines(GNN([SAGE(F_IN, 16), SAGE(16, F_OUT)], dropout=0.5, activation="elu"),
                    x_dst=True)
    assert declines(GNN([GCN(F_IN, 16), GCN(16, F_OUT)], dropout=0.5), l=1)  # the last layer
    assert declines(GNN([GCN(F_IN, 16), GCN(16, F_OUT)], dropout=0.5, activation="elu"))
    assert declines(GNN([GCN(F_IN, 16), _ScaledTransformGCN(16, F_OUT)], dropout=0.5,
                        transform_first=True))
    hooked = GNN([GCN(F_IN, 16), GCN(16, F_OUT)], dropout=0.5)
    hooked.layers[0].lin.weight.register_hook(lambda g: g)
    assert declines(hooked)
    plain = GNN([GCN(F_IN, 16), GCN(16, F_OUT)], dropout=0.5).double()
    assert plain.update_backward(0, block, torch.randn(N, F_IN, dtype=torch.float64),
                                 torch.randn(N, 16, dtype=torch.float64), 9)[0]
