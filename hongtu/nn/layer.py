r"""The :class:`GNNLayer` base class: aggregate, then update.

A layer maps the rows of its chunk's sources ``x_src`` (and its destinations'
own rows ``x_dst``) to new destination rows. Two hooks, after PyG's
``MessagePassing``:

* :meth:`GNNLayer.aggregate` — by default the built-in, parameter-free linear
  aggregation named by the class attribute ``aggr`` (``sum``, ``mean`` or
  ``gcn``);
* :meth:`GNNLayer.update` — the learnable part, applied to the aggregate and,
  when ``needs_dst`` is true, to the destinations' own rows.

A layer that keeps both defaults is *cacheable*: the engine stores its
aggregate in host memory during forward, and in backward recomputes only
:meth:`update`, getting the sources' gradient from the aggregation's
transpose without reloading the neighbour rows. A layer that overrides
:meth:`forward` (edge networks such as GAT, any custom message function) is
recomputed in full in backward. Nothing else is needed from a subclass.

A cacheable layer whose update is a linear map followed by a per-row step,
``update(a, None) == finish(transform(a))``, may also implement
:meth:`transform` and :meth:`finish`. Since the aggregation is linear,
``A (x W) = (A x) W``: when the map narrows the rows, the engine applies it to
each vertex's own row before the aggregation (``engine.transform_first``,
as DGL's ``GraphConv`` and PyG's ``GCNConv`` do), and the neighbour rows that
cross the host link are the narrow ones.
"""

from __future__ import annotations

from torch import Tensor, nn

from hongtu.nn import ops
from hongtu.nn.block import Block

__all__ = ["GNNLayer"]


def grad_hooked(t: Tensor) -> bool:
    """Whether a tensor has gradient hooks (a backward written out would skip them)."""
    return bool(t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None))


class GNNLayer(nn.Module):
    r"""Base class of every hongtu layer.

    Args:
        in_channels: width of the input rows.
        out_channels: width of the output rows (see :attr:`out_width`).

    Subclasses set ``aggr`` and implement :meth:`update`, or override
    :meth:`forward` entirely. Example::

        class MeanConv(GNNLayer):
            aggr = "mean"
            needs_dst = False

            def __init__(self, in_channels, out_channels):
                super().__init__(in_channels, out_channels)
                self.lin = torch.nn.Linear(in_channels, out_channels)

            def reset_parameters(self):
                self.lin.reset_parameters()

            def update(self, a, x_dst):
                return self.lin(a)
    """

    #: built-in aggregation used by the default :meth:`aggregate`
    aggr: str | None = None
    #: whether :meth:`update` reads the destinations' own rows
    needs_dst: bool = True
    #: whether :meth:`forward` reads the block's transpose (``t_indptr``,
    #: ``t_indices``, ``t_perm``) when no gradient is taken; ``None``: only a
    #: layer that overrides :meth:`forward` or :meth:`aggregate` may. Out of
    #: core, a layer's forward pass copies its blocks without the transpose when
    #: the layer does not read it.
    forward_reads_transpose: bool | None = None
    #: whether :meth:`finish` only adds one row, the same to every row of its
    #: input (a bias), so that its gradient does not read the input and its
    #: parameters' gradient is that of one row for the column sums of the
    #: output's gradient; counts only where set by the class that defines
    #: :meth:`finish` (the default, the identity, needs none)
    finish_adds_only: bool = False

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)

    @property
    def out_width(self) -> int:
        """Width of the rows this layer writes (``heads * out`` for concatenating GAT)."""
        return self.out_channels

    @property
    def _default_steps(self) -> bool:
        """Whether forward and aggregate are this base class's own."""
        cls = type(self)
        return cls.forward is GNNLayer.forward and cls.aggregate is GNNLayer.aggregate

    @property
    def cacheable(self) -> bool:
        """True when forward is exactly ``update(aggregate(x_src), x_dst)`` with a built-in op."""
        return self.aggr in ops.BUILTIN_AGGREGATIONS and self._default_steps

    @property
    def reads_transpose(self) -> bool:
        """Whether a forward pass without gradients needs the block's transpose."""
        if self.forward_reads_transpose is not None:
            return bool(self.forward_reads_transpose)
        return not self._default_steps

    def reset_parameters(self) -> None:
        """Re-initialise the parameters (subclasses override)."""

    def aggregate(self, block: Block, x_src: Tensor) -> Tensor:
        """The built-in aggregation ``A_aggr @ x_src``: ``(num_src, F) -> (num_dst, F)``."""
        if self.aggr not in ops.BUILTIN_AGGREGATIONS:
            raise NotImplementedError(
                f"{type(self).__name__} sets no built-in aggr ({ops.BUILTIN_AGGREGATIONS}); "
                "set one or override forward()")
        return ops.aggregate(block, x_src, self.aggr)

    def update(self, a: Tensor, x_dst: Tensor | None) -> Tensor:
        """The learnable part: aggregate (and own rows) to output rows."""
        raise NotImplementedError(f"{type(self).__name__} must implement update() or forward()")

    def transform(self, x: Tensor) -> Tensor:
        """Optional: the linear map of the update, ``(rows, in) -> (rows, out_width)``.

        A layer that implements it (and :meth:`finish`) promises
        ``update(a, None) == finish(transform(a))`` with ``transform`` linear
        (no bias: ``transform(x + y) == transform(x) + transform(y)``).
        """
        raise NotImplementedError(f"{type(self).__name__} has no separate linear transform")

    def finish(self, a: Tensor) -> Tensor:
        """Optional: the per-row rest of the update after :meth:`transform` (e.g. the bias)."""
        return a

    def linear_update(self) -> tuple[Tensor, Tensor | None] | None:
        """Optional: ``(weight, bias)`` where ``update(a, None)`` is exactly
        ``ops.linear(a, weight, bias)`` (``bias`` may be ``None``) and, where the
        layer defines :meth:`transform`, ``transform(x)`` is exactly
        ``torch.nn.functional.linear(x, weight)``.

        Where a layer declares it, the engine runs the update's backward (and
        that of the linear map of a layer before it which transforms first)
        with the matrix products written out, without building an autograd
        graph (:meth:`~hongtu.nn.GNN.update_backward`). ``None`` (default):
        autograd.
        """
        return None

    def update_vjp(self, a: Tensor, x_dst: Tensor | None):
        """Optional: :meth:`update` with its backward written out, as
        ``torch.func.vjp`` pairs them: ``(out, backward)``, ``out`` the values
        ``update(a, x_dst)`` gives and ``backward(grad, need_a, need_x)``, for
        ``grad`` (``out``'s gradient), ``(∇a, ∇x_dst)`` (each ``None`` where not
        needed) after adding into the parameters' ``.grad``
        (:func:`~hongtu.nn.ops.accumulate_grad`) what autograd would add.

        The engine calls it without gradients (``torch.no_grad``) where a
        backward pass runs the update again, and so runs it without an
        autograd graph: one kernel launch per product, not autograd's
        bookkeeping per operation, which a GPU otherwise waits for at many
        chunks. Only where it comes from the class that defines
        :meth:`update` (or one below it). ``None`` (default, or where a
        layer's own check declines, e.g. a trainable ``eps``): autograd.
        """
        return None

    @property
    def writes_update(self) -> bool:
        """Whether the engine may call :meth:`update_vjp`: it comes from the class
        that defines :meth:`update` (or one below it; a subclass that changes
        ``update`` alone breaks the promise its parent made), no parameter has
        gradient hooks and no submodule hooks (the written-out update calls no
        module)."""
        made = self._owner("update_vjp")
        return (made is not GNNLayer and issubclass(made, self._owner("update"))
                and not any(map(grad_hooked, self.parameters()))
                and not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                            or m._backward_pre_hooks for m in self.modules() if m is not self))

    def _owner(self, name: str) -> type:
        """The class whose own attribute ``name`` this layer uses."""
        return next(k for k in type(self).__mro__ if name in vars(k))

    @property
    def linear_params(self) -> tuple[Tensor, Tensor | None] | None:
        """:meth:`linear_update`, where it comes from the class that defines
        :meth:`update` (or one below it): a subclass that changes ``update``
        alone breaks the promise its parent made. ``None`` otherwise."""
        made = self._owner("linear_update")
        if made is GNNLayer or not issubclass(made, self._owner("update")):
            return None
        return self.linear_update()

    @property
    def linear_transform(self) -> Tensor | None:
        """The weight of :meth:`transform` as :meth:`linear_update` declares it,
        where the engine may apply it first (:attr:`can_transform_first`) and the
        declaration comes from the class that defines :meth:`transform` (or one
        below it); ``None`` otherwise."""
        lin = self.linear_params
        if (lin is None or not self.can_transform_first
                or not issubclass(self._owner("linear_update"), self._owner("transform"))):
            return None
        return lin[0]

    @property
    def finish_reads_input(self) -> bool:
        """Whether the gradient of :meth:`finish` needs the aggregate it was given
        (false for the identity and for a class that sets ``finish_adds_only``
        beside its own :meth:`finish`)."""
        owner = self._owner("finish")
        return not (owner is GNNLayer or vars(owner).get("finish_adds_only", False))

    @property
    def can_transform_first(self) -> bool:
        """Whether the engine may apply :meth:`transform` before the aggregation.

        Only where :meth:`transform` comes from the class that defines
        :meth:`update` (or one below it): a subclass that changes ``update``
        alone breaks the promise its parent's ``transform`` made.
        """
        made = self._owner("transform")
        return (self.cacheable and not self.needs_dst and made is not GNNLayer
                and issubclass(made, self._owner("update")))

    def forward(self, block: Block, x_src: Tensor, x_dst: Tensor | None) -> Tensor:
        """Compute the destinations' new rows.

        Shapes:
            ``x_src``: ``(num_src, in)``; ``x_dst``: ``(num_dst, in)``;
            result ``(num_dst, out_width)``.
        """
        return self.update(self.aggregate(block, x_src), x_dst)

    def extra_device_bytes(self, num_src: int, num_dst: int, num_edges: int,
                           itemsize: int) -> int:
        """Device bytes of intermediates beyond inputs, outputs and the block.

        Used by the memory planner to pick a chunk count; layers with per-edge
        tensors (attention) override it.
        """
        return 2 * num_dst * max(self.in_channels, self.out_width) * itemsize

    def update_saved_bytes(self, num_dst: int, itemsize: int) -> int:
        """Device bytes :meth:`update` on ``num_dst`` rows saves for its backward
        under autograd, beyond its inputs ``a`` and ``x_dst``, its output and the
        parameters: its intermediates (GIN: the MLP's input and hidden rows).

        A resident run keeps them for every chunk from the forward to the
        backward pass (``engine.resident``), and the memory planner counts them
        to decide whether that fits. The default, :meth:`extra_device_bytes` of
        a chunk with no sources or edges, bounds an update of a few row-wise
        steps; a layer that knows what its update saves says so exactly.
        """
        return self.extra_device_bytes(0, num_dst, 0, itemsize)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels})"

