r"""A custom hongtu layer: mean aggregation with a learned gate on every edge.

.. math::
    w_{uv} = \sigma\big(a_{src}^\top x_u + a_{dst}^\top x_v\big), \qquad
    h'_v = W \, \frac{1}{d_v} \sum_{u \to v} w_{uv} x_u + b

Train it with ``hongtu train examples/custom_layer.yaml`` (from the repo root),
which names it as ``model.layer: examples.edge_weighted_conv:EdgeWeightedConv``.

The gate depends on parameters, so the aggregation is not a fixed linear op:
the layer overrides :meth:`forward`, and the engine recomputes it in full in
backward (``cacheable`` is ``False``). That is all a custom layer needs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hongtu.nn import GNNLayer, ops
from hongtu.nn.block import Block

__all__ = ["EdgeWeightedConv"]


class EdgeWeightedConv(GNNLayer):
    r"""Gated mean aggregation followed by a linear map.

    Args:
        in_channels: input width.
        out_channels: output width.
        bias: add a learnable bias (default ``True``).

    Shapes:
        ``x_src``: ``(num_src, in)``; ``x_dst``: ``(num_dst, in)``;
        result ``(num_dst, out)``.

    Example::

        >>> conv = EdgeWeightedConv(16, 4)
        >>> conv, conv.cacheable
        (EdgeWeightedConv(16, 4), False)
    """

    needs_dst = True  # the gate reads the destination's own row x_v

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels)
        self.att_src = nn.Parameter(torch.empty(in_channels))
        self.att_dst = nn.Parameter(torch.empty(in_channels))
        self.lin = nn.Linear(in_channels, out_channels, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / self.in_channels ** 0.5
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)
        self.lin.reset_parameters()

    def forward(self, block: Block, x_src: Tensor, x_dst: Tensor | None) -> Tensor:
        # Score vertices first, then gather the scalars onto edges: cheaper
        # than gathering whole rows for both ends of every edge.
        score_src = x_src @ self.att_src                    # (num_src,)
        score_dst = x_dst @ self.att_dst                    # (num_dst,)
        gate = torch.sigmoid(ops.gather_src(block, score_src)
                             + ops.gather_dst(block, score_dst))  # (E,)
        # Messages w_uv * x_u, averaged over each destination's in-edges. The
        # block holds every in-edge of its destinations, so the mean is exact.
        messages = gate.unsqueeze(-1) * ops.gather_src(block, x_src)  # (E, in)
        a = ops.scatter_dst(block, messages, reduce="mean")          # (num_dst, in)
        return self.lin(a)
