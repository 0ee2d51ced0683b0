r"""Graph isomorphism network (Xu et al., ICLR 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hongtu.nn import ops
from hongtu.nn.layer import GNNLayer

__all__ = ["GIN"]


class GIN(GNNLayer):
    r"""GIN convolution: sum the neighbours, add the weighted root, apply an MLP.

    .. math::
        h'_v = \mathrm{MLP}\Big((1 + \epsilon)\, h_v + \sum_{u \to v} h_u\Big)

    with :math:`\mathrm{MLP} = \mathrm{Linear}(in, hidden) \to \mathrm{ReLU}
    \to \mathrm{Linear}(hidden, out)`. The sum is a built-in aggregation, so
    the layer is cacheable; :meth:`update` reads the destinations' own rows.
    The result equals PyG's ``GINConv(nn=mlp, eps=eps, train_eps=train_eps)``
    with the same MLP. Without self-loops in the graph the root term is the
    only place :math:`h_v` enters; with them it enters twice, as in PyG.

    Args:
        in_channels: input width.
        out_channels: output width.
        hidden: width of the MLP's hidden layer (default ``None``: ``out_channels``).
        eps: initial :math:`\epsilon` (default ``0.0``).
        train_eps: learn :math:`\epsilon` (default ``False``: a fixed buffer).

    Shapes:
        ``x_src``: ``(num_src, in)``; ``x_dst``: ``(num_dst, in)``;
        result ``(num_dst, out)``.

    Example::

        >>> conv = GIN(16, 4, hidden=32)
        >>> conv
        GIN(16, 4)
    """

    aggr = "sum"
    needs_dst = True

    def __init__(self, in_channels: int, out_channels: int, hidden: int | None = None,
                 eps: float = 0.0, train_eps: bool = False) -> None:
        super().__init__(in_channels, out_channels)
        self.hidden = int(hidden) if hidden is not None else int(out_channels)
        self.initial_eps = float(eps)
        self.mlp = nn.Sequential(
            nn.Linear(in_channels, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, out_channels),
        )
        if train_eps:
            self.eps = nn.Parameter(torch.empty(1))
        else:
            self.register_buffer("eps", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        with torch.no_grad():
            self.eps.fill_(self.initial_eps)

    def update(self, a: Tensor, x_dst: Tensor | None) -> Tensor:
        if x_dst is None:
            raise ValueError("GIN needs the destinations' own rows (x_dst)")
        return self.mlp(a + (1 + self.eps) * x_dst)

    def update_vjp(self, a: Tensor, x_dst: Tensor | None):
        mlp = self.mlp
        if (x_dst is None or self.eps.requires_grad or type(mlp) is not nn.Sequential
                or [type(m) for m in mlp] != [nn.Linear, nn.ReLU, nn.Linear]):
            return None  # (autograd: a trainable eps, an MLP of another shape)
        lin1, lin2 = mlp[0], mlp[2]
        scale = 1 + self.eps
        s = a + scale * x_dst
        r = torch.relu(F.linear(s, lin1.weight, lin1.bias))
        out = F.linear(r, lin2.weight, lin2.bias)

        def backward(grad: Tensor, need_a: bool, need_x: bool):
            g = ops.add_linear_grads(r, lin2.weight, lin2.bias, grad, True)
            g = ops.add_linear_grads(s, lin1.weight, lin1.bias,
                                     torch.ops.aten.threshold_backward(g, r, 0),
                                     need_a or need_x)
            return (g if need_a else None), (g * scale if need_x else None)

        return out, backward

    def update_saved_bytes(self, num_dst: int, itemsize: int) -> int:
        # The first Linear's input (the root sum), the ReLU's output (the second
        # Linear's input too) and 1 + eps (the product saves it; x_dst is an input).
        return (num_dst * (self.in_channels + self.hidden) + 1) * itemsize

    def extra_device_bytes(self, num_src: int, num_dst: int, num_edges: int,
                           itemsize: int) -> int:
        # Root sum, hidden pre- and post-activation, output.
        width = max(self.in_channels, self.hidden, self.out_channels)
        return 4 * num_dst * width * itemsize
