r"""Graph convolution (Kipf & Welling, ICLR 2017)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hongtu.nn import ops
from hongtu.nn.layer import GNNLayer

__all__ = ["GCN"]


class GCN(GNNLayer):
    r"""Graph convolution with symmetric normalisation.

    .. math::
        h'_v = W \sum_{u \to v} \frac{1}{\sqrt{d_u d_v}} h_u + b

    with :math:`d` the in-degree. Self-loops come from the graph
    (``data.self_loops: true``), as ``GCNConv`` adds them. Aggregating before
    the linear map makes the layer cacheable; the result equals PyG's
    ``GCNConv`` with the same weights. Where the layer narrows its rows, the
    engine may apply the linear map first (:meth:`transform`, as
    ``GCNConv`` always does): the same function, narrower rows to move.

    Args:
        in_channels: input width.
        out_channels: output width.
        bias: add a learnable bias (default ``True``).

    Example::

        >>> conv = GCN(16, 4)
        >>> conv
        GCN(16, 4)
    """

    aggr = "gcn"
    needs_dst = False
    finish_adds_only = True  # the bias

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels)
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def update(self, a: Tensor, x_dst: Tensor | None) -> Tensor:
        # finish(transform(a)), the bias added by the matrix product (one kernel;
        # its gradient one matrix-vector product)
        return ops.linear(a, self.lin.weight, self.bias)

    def linear_update(self) -> tuple[Tensor, Tensor | None]:
        return self.lin.weight, self.bias

    def transform(self, x: Tensor) -> Tensor:
        return self.lin(x)

    def finish(self, a: Tensor) -> Tensor:
        return a if self.bias is None else a + self.bias
