r"""A stack of :class:`GNNLayer` s with input dropout and activations.

The engine drives the model one layer and one chunk at a time through the
``step_*`` methods; :meth:`GNN.full_forward` runs the same computation on a
single block that spans the whole graph (the in-memory reference).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hongtu.errors import UserError
from hongtu.nn import ops
from hongtu.nn.block import Block
from hongtu.nn.layer import GNNLayer, grad_hooked

__all__ = ["GNN", "build_model", "resolve_layer", "layer_seed"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "elu": F.elu}
_M64 = (1 << 64) - 1


def _linear_backward(a: Tensor, weight: Tensor, bias: Tensor | None, grad: Tensor,
                     need_a: bool, need_x: bool) -> tuple[Tensor | None, None]:
    """The backward of ``ops.linear(a, weight, bias)`` for ``grad`` (as
    :meth:`GNNLayer.update_vjp`'s ``backward``; no own rows)."""
    g_a, gw, gb = ops.linear_grads(grad, a, weight, need_a, weight.requires_grad,
                                   bias is not None and bias.requires_grad)
    if gw is not None:
        ops.accumulate_grad(weight, gw)
    if gb is not None:
        ops.accumulate_grad(bias, gb)
    return g_a, None


def layer_seed(seed: int, epoch: int, layer: int) -> int:
    """The dropout stream of (run seed, epoch, layer): a 63-bit splitmix64 hash."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + layer * 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


class GNN(nn.Module):
    r"""``L`` layers; layer ``l`` reads ``dropout(h^l)`` and writes ``h^{l+1}``.

    .. math::
        h^{l+1} = \sigma\big(f_l(\mathrm{drop}(h^l))\big)

    with :math:`\sigma` the identity on the last layer.

    With ``transform_first``, a layer ``l > 0`` that can
    (:attr:`GNNLayer.can_transform_first`) and narrows its rows is split:
    the engine keeps :math:`z^l = W_l\,\mathrm{drop}(h^l)` instead of
    :math:`h^l` (layer ``l-1``'s step computes it for its own rows), and layer
    ``l`` aggregates :math:`z^l` and finishes (bias, activation). The function
    is the same; the rows layer ``l`` reads are ``out`` wide instead of ``in``.
    The ``step_*`` methods take and return the rows as the engine keeps them
    (:meth:`row_widths`).

    With ``keep_dropped``, each layer ``l > 0`` that does not transform first
    reads its rows as the engine keeps them, :math:`\mathrm{drop}(h^l)`: layer ``l-1``'s step drops
    out its own rows once (with layer ``l``'s stream, one kernel with the
    activation each way on a GPU) instead of layer ``l`` dropping each chunk's
    copy of its neighbour rows (:meth:`keeps_dropped`). The function is the
    same; the rows a training pass leaves in ``h^l`` are dropped out
    (evaluation drops nothing).

    Args:
        layers: the layers, first to last.
        dropout: drop probability on every layer's input.
        activation: ``relu`` or ``elu``.
        transform_first: split narrowing layers as above (default ``False``:
            every step reads and writes ``h``).
        keep_dropped: keep the other layers' rows dropped out, as above
            (default ``False``: each step drops its own inputs).
    """

    def __init__(self, layers: list[GNNLayer], dropout: float = 0.0,
                 activation: str = "relu", transform_first: bool = False,
                 keep_dropped: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.p = float(dropout)
        self.activation = activation
        self._act = _ACTIVATIONS[activation]
        self.transform_first = bool(transform_first)
        self.keep_dropped = bool(keep_dropped)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cached_layers(self, checkpoint: str = "auto") -> list[bool]:
        """Which layers keep their aggregate in host memory under ``engine.checkpoint``.

        ``auto`` (the recomputation-caching hybrid) caches every cacheable
        layer; ``recompute`` caches none; ``own``, as ``auto`` is run out of core
        where every chunk reads its own rows among its sources
        (:func:`~hongtu.engine.executor.resolved_checkpoint`), caches those that
        read no own rows (a cached layer's backward copies them beside its
        aggregate; a recomputed one finds them among the rows it loads).
        """
        return [bool(layer.cacheable and (checkpoint == "auto"
                                          or (checkpoint == "own" and not layer.needs_dst)))
                for layer in self.layers]

    def stored_aggregates(self, checkpoint: str = "auto") -> list[bool]:
        """Which cached layers store their aggregate in host memory for backward.

        All but a last layer that transforms first and whose finish only adds
        (:attr:`GNNLayer.finish_reads_input` false, e.g. GCN's bias): its output
        is ``finish(a)``, so the aggregate's gradient is the output's and
        backward needs nothing of ``a``.
        """
        last = self.num_layers - 1
        return [c and not (l == last and self.transforms_first(l)
                           and not self.layers[l].finish_reads_input)
                for l, c in enumerate(self.cached_layers(checkpoint))]

    def widths(self) -> list[int]:
        """Row width of ``h^0 .. h^L``."""
        return [self.layers[0].in_channels] + [layer.out_width for layer in self.layers]

    def transforms_first(self, l: int) -> bool:
        """Whether layer ``l`` reads ``z^l = W_l drop(h^l)`` (see ``transform_first``)."""
        if not self.transform_first or not 0 < l < self.num_layers:
            return False
        layer = self.layers[l]
        return layer.can_transform_first and layer.out_width < layer.in_channels

    def keeps_dropped(self, l: int) -> bool:
        """Whether layer ``l`` reads ``drop(h^l)`` as kept, its dropout applied by
        layer ``l-1``'s step (see ``keep_dropped``)."""
        return self.keep_dropped and 0 < l < self.num_layers and not self.transforms_first(l)

    def reads_as_kept(self, l: int) -> bool:
        """Whether layer ``l`` applies no dropout to the rows it reads: they are
        ``z^l`` (:meth:`transforms_first`) or ``drop(h^l)`` (:meth:`keeps_dropped`)."""
        return self.transforms_first(l) or self.keeps_dropped(l)

    def row_widths(self) -> list[int]:
        """Width of the rows the engine keeps per layer: ``h^0``, then ``z^l`` or ``h^l``.

        The host buffers of layer ``l`` (rows, their gradient, the cached
        aggregate) all have this width.
        """
        return [layer.out_width if self.transforms_first(l) else w
                for l, (w, layer) in enumerate(zip(self.widths(), [*self.layers, None]))]

    def _drop(self, x: Tensor, ids: Tensor, seed: int) -> Tensor:
        return ops.dropout(x, ids, self.p, seed, self.training)

    def _drop_input(self, l: int, x: Tensor, ids: Tensor, seed: int) -> Tensor:
        """Layer ``l``'s dropout of rows it reads (none when they are kept dropped)."""
        return x if self.keeps_dropped(l) else self._drop(x, ids, seed)

    def _emit(self, l: int, out: Tensor, block: Block | None, next_seed: int | None,
              ids: Tensor | None = None) -> Tensor:
        """Layer ``l``'s output rows as the engine keeps them, from its update
        ``out``: ``h^{l+1}[V] = σ(out)`` (``out`` on the last layer),
        ``drop(σ(out))`` when layer ``l+1`` keeps its rows dropped, or
        ``z^{l+1}[V] = W_{l+1} drop(σ(out))`` when it transforms first (ReLU and
        dropout then one kernel each way on a GPU). The rows are the block's
        destinations, or the global ``ids`` given."""
        if not self.reads_as_kept(l + 1):
            return out if l == self.num_layers - 1 else self._act(out)
        if next_seed is None:
            raise ValueError(f"layer {l + 1} reads its rows dropped out by layer {l}: "
                             "pass next_seed (its dropout seed)")
        if ids is None:
            ids = block.dst_ids(out.device)  # the block may wait in host memory
        if self.activation == "relu":
            h = ops.relu_dropout(out, ids, self.p, next_seed, self.training)
        else:
            h = self._drop(self._act(out), ids, next_seed)
        return self.layers[l + 1].transform(h) if self.transforms_first(l + 1) else h

    # ---------------------------------------------------------- engine steps
    def step_forward(self, l: int, block: Block, x_src: Tensor, x_dst: Tensor | None,
                     seed: int, next_seed: int | None = None) -> Tensor:
        """Full layer ``l`` on one chunk: ``h^{l+1}[V]`` from ``h^l[N]`` and ``h^l[V]``.

        ``next_seed`` is layer ``l+1``'s dropout seed, needed when that layer
        reads its rows as kept (:meth:`reads_as_kept`: the rows are then
        ``z^{l+1}`` or ``drop(h^{l+1})``; ``x_src`` is ``z^l`` or ``drop(h^l)``
        when layer ``l`` does).
        """
        layer = self.layers[l]
        block.seed = seed
        if self.transforms_first(l):
            out = layer.finish(layer.aggregate(block, x_src))
        else:
            xs = self._drop_input(l, x_src, block.src_ids, seed)
            xd = self._drop_input(l, x_dst, block.dst_ids(), seed) if x_dst is not None \
                else None
            out = layer(block, xs, xd)
        return self._emit(l, out, block, next_seed)

    def step_aggregate(self, l: int, block: Block, x_src: Tensor, seed: int) -> Tensor:
        """Cacheable layers: the aggregate ``a^l[V] = A drop(h^l[N])`` (``A z^l[N]``)."""
        block.seed = seed
        if self.transforms_first(l):
            return self.layers[l].aggregate(block, x_src)
        return self.layers[l].aggregate(block, self._drop_input(l, x_src, block.src_ids, seed))

    def step_update(self, l: int, block: Block, a: Tensor, x_dst: Tensor | None,
                    seed: int, next_seed: int | None = None,
                    dst_dropped: bool = False) -> Tensor:
        """Cacheable layers: ``h^{l+1}[V]`` from the aggregate and the own rows
        (``dst_dropped``: ``x_dst`` has layer ``l``'s dropout applied already,
        as :meth:`drop_sources_into` puts rows in their slots)."""
        block.seed = seed
        layer = self.layers[l]
        if self.transforms_first(l):
            out = layer.finish(a)
        else:
            xd = None if x_dst is None else x_dst if dst_dropped else \
                self._drop_input(l, x_dst, block.dst_ids(x_dst.device), seed)
            out = layer.update(a, xd)
        return self._emit(l, out, block, next_seed)

    def emit_rows(self, l: int, a: Tensor, ids: Tensor, next_seed: int | None) -> Tensor:
        """Layer ``l``'s output rows as the engine keeps them (:meth:`step_update`)
        from their aggregate ``a`` alone, for the rows of global ``ids``: a
        layer whose update reads no own rows (``needs_dst`` false) and that
        does not transform first. The engine's layer 1 may load the first
        layer's aggregates, narrower than ``h^1``, and make its rows so
        (``Executor``, rows written in first-load order)."""
        layer = self.layers[l]
        if layer.needs_dst or self.transforms_first(l):
            raise ValueError(f"layer {l}'s rows need more than its aggregate")
        return self._emit(l, layer.update(a, None), None, next_seed, ids=ids)

    def update_backward(self, l: int, block: Block, a: Tensor, grad: Tensor,
                        next_seed: int | None = None, need_input: bool = False,
                        x_dst: Tensor | None = None, seed: int | None = None
                        ) -> tuple[bool, Tensor | None]:
        """The backward of :meth:`step_update` ``(l, block, a, x_dst, seed, next_seed)``
        for ``grad``, its output's gradient, with its matrix products written
        out (no autograd graph; the same values as autograd's): adds into the
        parameters' gradients, and into ``x_dst.grad`` where ``x_dst`` requires
        one, and returns ``(True, ∇a)`` (``∇a`` with ``need_input``, else ``None``).

        Where the update is a linear map (:attr:`GNNLayer.linear_params`), or
        the layer writes its backward out (:meth:`GNNLayer.update_vjp`),
        followed by ReLU, then layer ``l+1``'s dropout when it reads its rows
        dropped and its linear map when it transforms first
        (:attr:`GNNLayer.linear_transform`), or on the last layer by nothing;
        returns ``(False, None)``, having added nothing, elsewhere (and where a
        parameter has gradient hooks), for the caller to run autograd.
        """
        layer, last = self.layers[l], l == self.num_layers - 1
        linear = self.writes_linear_backward(l)
        if not (linear or self._writes_vjp(l)):
            return False, None
        after = self.layers[l + 1].linear_transform \
            if not last and self.transforms_first(l + 1) else None
        if not last and self.reads_as_kept(l + 1) and next_seed is None:
            raise ValueError(f"layer {l + 1} reads its rows dropped out by layer {l}: "
                             "pass next_seed (its dropout seed)")
        if layer.needs_dst and x_dst is None:
            raise ValueError(f"layer {l} reads its own rows: pass x_dst")
        if (layer.needs_dst and seed is None and self.training and self.p > 0
                and not self.keeps_dropped(l)):
            raise ValueError(f"layer {l} drops its own rows out: pass seed (its dropout seed)")
        p, nseed = (self.p, next_seed) if not last and self.reads_as_kept(l + 1) else (0.0, 0)
        with torch.no_grad():
            ids = block.dst_ids(a.device)
            xd = self._drop_input(l, x_dst, ids, seed) if layer.needs_dst else None
            if linear:
                weight, bias = layer.linear_params
                z = F.linear(a, weight, bias)
                backward = functools.partial(_linear_backward, a, weight, bias)
            else:
                written = layer.update_vjp(a, xd)  # (writes_update: checked above)
                if written is None:  # (the layer's own check declined)
                    return False, None
                z, backward = written
            if not last:
                if after is not None:  # z^{l+1} = drop(relu(z)) W^T, as autograd takes mm's
                    h = ops.relu_dropout(z, ids, p, nseed, self.training)
                    if after.requires_grad:
                        ops.accumulate_grad(after, grad.t().mm(h))
                    del h
                    grad = grad.mm(after)
                grad = ops.relu_dropout_grad(grad, z, ids, p, nseed, self.training)
            del z  # (no more than autograd's backward holds at once)
            need_x = xd is not None and x_dst.requires_grad
            g_a, g_x = backward(grad, need_input, need_x)
            del grad
            if need_x and g_x is not None:
                if xd is not x_dst:  # (layer l dropped them: the same mask and scale)
                    g_x = ops.dropout_grad(g_x, ids, self.p, seed, self.training)
                ops.accumulate_grad(x_dst, g_x)
            return True, g_a

    def writes_update_backward(self, l: int) -> bool:
        """Does :meth:`update_backward` write layer ``l``'s update backward out
        (a linear map, or a layer's :meth:`~GNNLayer.update_vjp`, then ReLU or,
        on the last layer, nothing; see there), rather than leave it to
        autograd? (A layer's ``update_vjp`` may still decline when called.)"""
        return self.writes_linear_backward(l) or self._writes_vjp(l)

    def _writes_vjp(self, l: int) -> bool:
        """:meth:`writes_update_backward` through the layer's ``update_vjp``."""
        return (self.layers[l].writes_update and not self.transforms_first(l)
                and self._emit_written(l))

    def writes_linear_backward(self, l: int) -> bool:
        """Does :meth:`update_backward` write layer ``l``'s update backward out as
        the linear map it declares (:attr:`GNNLayer.linear_params`: one product
        run again), a ReLU, then the next layer's dropout and linear map?"""
        layer = self.layers[l]
        lin = layer.linear_params
        if (lin is None or layer.needs_dst or self.transforms_first(l)
                or l == self.num_layers - 1):
            return False
        return self._emit_written(l) and not any(
            grad_hooked(t) for t in lin if t is not None and t.requires_grad)

    def _emit_written(self, l: int) -> bool:
        """Whether :meth:`update_backward` writes :meth:`_emit` ``(l, ...)``'s
        backward out: the last layer's (nothing), or ReLU, the next layer's
        dropout and, where it transforms first, its declared linear map."""
        if l == self.num_layers - 1:
            return True
        if self.activation != "relu":
            return False
        if not self.transforms_first(l + 1):
            return True
        after = self.layers[l + 1].linear_transform
        return after is not None and not grad_hooked(after)

    def drop_sources_into(self, l: int, x: Tensor, ids: Tensor, seed: int, out: Tensor,
                          at: Tensor, x_at: Tensor | None = None) -> None:
        """``out[at] =`` layer ``l``'s dropout of source rows ``x`` (global ``ids``)
        as :meth:`step_aggregate` applies it (none where the layer reads its
        rows as kept: they were dropped before), the rows of ``x`` read
        at ``x_at`` when given; ``out`` may be ``x`` (in place). Rows dropped
        once, as they arrive, may then be aggregated in place
        (``ops.aggregate_rows``). On a GPU one kernel, no copy of the rows
        (:func:`~hongtu.nn.ops.dropout_into`)."""
        p = 0.0 if self.reads_as_kept(l) else self.p
        ops.dropout_into(x, ids, p, seed, out, at, x_at, self.training)

    def finish_backward(self, l: int, grad_sum: Tensor) -> None:
        """Parameter gradients of layer ``l``'s :meth:`~GNNLayer.finish` where it
        adds one row to every row (``finish_adds_only``, e.g. the bias), from
        ``grad_sum``, the column sums of its output's gradient over all rows:
        the gradient of ``finish`` of one row of zeros for that sum."""
        with torch.enable_grad():
            out = self.layers[l].finish(grad_sum.new_zeros(1, grad_sum.shape[0]))
            if out.requires_grad:
                out.backward(grad_sum.unsqueeze(0))

    def step_aggregate_transpose(self, l: int, block: Block, grad_a: Tensor,
                                 seed: int) -> Tensor:
        """Cacheable layers: ``∇h^l[N]`` (``∇z^l[N]``) contributed through the aggregate."""
        g = ops.aggregate_transpose(block, grad_a, self.layers[l].aggr)
        if self.training and self.p > 0 and not self.reads_as_kept(l):
            # Dropout is diagonal: its transpose is the same mask and scale.
            g = self._drop(g, block.src_ids, seed)
        return g

    # ---------------------------------------------------------------- oracle
    def full_forward(self, block: Block, x: Tensor, seeds: list[int]) -> Tensor:
        """All layers on one block spanning the graph.

        The block must read every vertex as a source (``build_block(...,
        src_ids=np.arange(N))``), so that ``h`` serves as both ``x_src`` and ``x_dst``.
        """
        if block.num_src != x.shape[0] or block.num_dst != x.shape[0]:
            raise ValueError("full_forward needs a block over all vertices "
                             "(build_block(..., src_ids=np.arange(N)))")
        h, L = x, self.num_layers
        for l in range(L):
            h = self.step_forward(l, block, h, h if self.layers[l].needs_dst else None, seeds[l],
                                  seeds[l + 1] if l + 1 < L else None)
        return h


def describe_layers(names: list[str], cached: list[bool], first: list[bool]) -> str:
    """``GCN(100, 64) [cached], GCN(64, 7) [cached, weight first]``: each layer
    with how the engine trains it (cached aggregate; weight applied before the
    aggregation, :meth:`GNN.transforms_first`)."""
    def tags(c: bool, f: bool) -> str:
        t = ", ".join(x for x, on in (("cached", c), ("weight first", f)) if on)
        return f" [{t}]" if t else ""

    return ", ".join(n + tags(c, f) for n, c, f in zip(names, cached, first))


# ------------------------------------------------------------------ builder
def _builtin_layers() -> dict[str, type]:
    from hongtu.nn import gat, gcn, gin, sage

    return {"gcn": gcn.GCN, "sage": sage.SAGE, "gin": gin.GIN, "gat": gat.GAT}


def resolve_layer(name: str) -> type:
    """``gcn`` | ``sage`` | ``gin`` | ``gat`` or ``package.module:ClassName`` to a class."""
    builtins = _builtin_layers()
    if name in builtins:
        return builtins[name]
    mod_name, _, cls_name = name.partition(":")
    # The `hongtu` script's sys.path lacks the working directory; a user's
    # module next to their config is found there, as with `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"model.layer '{name}': cannot import module '{mod_name}' ({e}); "
                        "check the dotted path and that the package is on PYTHONPATH") from None
    obj = module
    for part in cls_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(f"model.layer '{name}': module '{mod_name}' has no '{cls_name}'")
    if not (isinstance(obj, type) and issubclass(obj, GNNLayer)):
        raise UserError(f"model.layer '{name}' is not a subclass of hongtu.nn.GNNLayer; "
                        "derive your layer from GNNLayer")
    return obj


def build_model(cfg, in_dim: int, num_classes: int, transform_first: bool = False,
                keep_dropped: bool = False) -> GNN:
    """Build the :class:`GNN` described by a :class:`~hongtu.config.ModelConfig`
    (``transform_first``, ``keep_dropped``: see :class:`GNN`)."""
    cls = resolve_layer(cfg.layer)
    layers: list[GNNLayer] = []
    width = in_dim
    for l in range(cfg.layers):
        last = l == cfg.layers - 1
        out = num_classes if last else cfg.hidden
        if cfg.layer == "gat":
            layer = cls(width, out, heads=cfg.out_heads if last else cfg.heads,
                        concat=not last, dropout=cfg.dropout)
        else:
            layer = cls(width, out)
        layers.append(layer)
        width = layer.out_width
    return GNN(layers, dropout=cfg.dropout, activation=cfg.activation,
               transform_first=transform_first, keep_dropped=keep_dropped)


def reference_loss(model: GNN, block: Block, x: Tensor, y: Tensor, train_mask: Tensor,
                   seeds: list[int]) -> Tensor:
    """In-memory full-graph loss: the quantity the engine reproduces exactly."""
    out = model.full_forward(block, x, seeds)
    return F.cross_entropy(out[train_mask], y[train_mask], reduction="sum") / max(
        int(train_mask.sum()), 1)

