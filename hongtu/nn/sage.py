r"""GraphSAGE with mean aggregation (Hamilton et al., NeurIPS 2017)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from hongtu.nn import ops
from hongtu.nn.layer import GNNLayer

__all__ = ["SAGE"]


class SAGE(GNNLayer):
    r"""GraphSAGE convolution with a mean aggregator and a root weight.

    .. math::
        h'_v = W_l \, \frac{1}{d_v} \sum_{u \to v} h_u + b + W_r h_v

    with :math:`d_v` the in-degree of :math:`v`. The mean is a built-in,
    parameter-free aggregation, so the layer is cacheable; :meth:`update`
    also reads the destinations' own rows (``needs_dst``). The result equals
    PyG's ``SAGEConv(in_channels, out_channels)`` with the same weights
    (``lin_l`` carries the bias, ``lin_r`` has none).

    Args:
        in_channels: input width.
        out_channels: output width.
        bias: add a learnable bias (default ``True``).

    Shapes:
        ``x_src``: ``(num_src, in)``; ``x_dst``: ``(num_dst, in)``;
        result ``(num_dst, out)``.

    Example::

        >>> conv = SAGE(16, 4)
        >>> conv
        SAGE(16, 4)
    """

    aggr = "mean"
    needs_dst = True

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels)
        self.lin_l = nn.Linear(in_channels, out_channels, bias=bias)
        self.lin_r = nn.Linear(in_channels, out_channels, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.lin_l.reset_parameters()
        self.lin_r.reset_parameters()

    def update(self, a: Tensor, x_dst: Tensor | None) -> Tensor:
        if x_dst is None:
            raise ValueError("SAGE needs the destinations' own rows (x_dst)")
        return self.lin_l(a) + self.lin_r(x_dst)

    def update_vjp(self, a: Tensor, x_dst: Tensor | None):
        if x_dst is None:
            return None  # (autograd: the error update() gives)
        out = F.linear(a, self.lin_l.weight, self.lin_l.bias) + \
            F.linear(x_dst, self.lin_r.weight, self.lin_r.bias)

        def backward(grad: Tensor, need_a: bool, need_x: bool):
            return (ops.add_linear_grads(a, self.lin_l.weight, self.lin_l.bias, grad, need_a),
                    ops.add_linear_grads(x_dst, self.lin_r.weight, self.lin_r.bias, grad,
                                         need_x))

        return out, backward

    def update_saved_bytes(self, num_dst: int, itemsize: int) -> int:
        return 0  # (the two Linears save their inputs, a and x_dst)
