r"""Graph attention (Veličković et al., ICLR 2018)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hongtu.nn import ops
from hongtu.nn.block import Block
from hongtu.nn.layer import GNNLayer

__all__ = ["GAT"]

#: mixed into the block's seed so attention dropout draws a stream of its own
_ATTN_SEED_SALT = 0x5BD1E995


class GAT(GNNLayer):
    r"""Multi-head graph attention.

    .. math::
        e^k_{uv} = \mathrm{LeakyReLU}\big(a_{src}^{k\top} W^k h_u + a_{dst}^{k\top} W^k h_v\big),
        \qquad
        \alpha^k_{uv} = \operatorname*{softmax}_{u \to v} e^k_{uv},

        h'_v = \big\Vert_{k=1}^{K} \sum_{u \to v} \alpha^k_{uv} W^k h_u + b
        \quad\text{(or the mean over } k \text{ when } \texttt{concat=False)}

    The softmax runs over each destination's full in-edge set, which its
    block always holds. Attention weights depend on parameters, so the layer
    overrides :meth:`forward` and the engine recomputes it in full in
    backward. Attention dropout is counter-based on the global edge id, so
    the recomputation draws the same mask. Self-loops come from the graph;
    the result equals PyG's ``GATConv(in, out, heads, concat, negative_slope,
    add_self_loops=False)`` with the same weights (in eval mode).

    Args:
        in_channels: input width.
        out_channels: output width per head.
        heads: number of attention heads :math:`K` (default ``1``).
        concat: concatenate the heads (default ``True``); otherwise average them.
        negative_slope: slope of the LeakyReLU (default ``0.2``).
        dropout: drop probability of the attention weights (default ``0.0``).
        bias: add a learnable bias (default ``True``).

    Shapes:
        ``x_src``: ``(num_src, in)``; ``x_dst``: ``(num_dst, in)``;
        result ``(num_dst, heads * out)`` when ``concat`` else ``(num_dst, out)``.

    Example::

        >>> conv = GAT(16, 8, heads=4)
        >>> conv, conv.out_width
        (GAT(16, 8, heads=4), 32)
    """

    aggr = None
    needs_dst = True
    forward_reads_transpose = False

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels)
        if heads < 1:
            raise ValueError(f"GAT heads must be >= 1, got {heads}")
        self.heads = int(heads)
        self.concat = bool(concat)
        self.negative_slope = float(negative_slope)
        self.dropout = float(dropout)
        self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(self.out_width)) if bias else None
        self.reset_parameters()

    @property
    def out_width(self) -> int:
        return self.heads * self.out_channels if self.concat else self.out_channels

    def reset_parameters(self) -> None:
        # Glorot over the last two dimensions, as PyG's ``glorot``.
        nn.init.xavier_uniform_(self.lin.weight)
        bound = math.sqrt(6.0 / (self.heads + self.out_channels))
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, block: Block, x_src: Tensor, x_dst: Tensor | None) -> Tensor:
        if x_dst is None:
            raise ValueError("GAT needs the destinations' own rows (x_dst)")
        H, C = self.heads, self.out_channels
        xs = self.lin(x_src).view(-1, H, C)
        # einsum, not (xs * att_src).sum(-1): no (num_src, H, C) product to keep.
        alpha_src = torch.einsum("nhc,hc->nh", xs, self.att_src[0])            # (num_src, H)
        # Only a_dst·W x_dst is needed from the destinations: fold a_dst into W
        # instead of projecting them, saving a (num_dst, H, C) intermediate.
        w_dst = (self.lin.weight.view(H, C, -1) * self.att_dst.view(H, C, 1)).sum(1)
        alpha_dst = x_dst @ w_dst.t()                                          # (num_dst, H)

        e = ops.gather_src(block, alpha_src) + ops.gather_dst(block, alpha_dst)  # (E, H)
        alpha = ops.edge_softmax(block, F.leaky_relu(e, self.negative_slope))
        alpha = ops.dropout(alpha, block.edge_ids(), self.dropout,
                            seed=block.seed ^ _ATTN_SEED_SALT, training=self.training)

        # One weighted spmm per head: never materialises (E, H, C) messages.
        out = torch.stack([ops.spmm(block, xs_k, alpha_k)
                           for xs_k, alpha_k in zip(xs.unbind(1), alpha.unbind(1))], dim=1)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def extra_device_bytes(self, num_src: int, num_dst: int, num_edges: int,
                           itemsize: int) -> int:
        # The largest of the phases of forward + backward. Calibrated against
        # torch.cuda.max_memory_allocated on an H200 (fp32, 1-8 heads): it
        # bounds the measured peaks, 5-30% above where edges dominate.
        H, C = self.heads, self.out_channels
        v_src = num_src * H * C * itemsize       # projected sources (saved)
        v_dst = num_dst * H * C * itemsize       # stacked per-head outputs
        eh = num_edges * H                       # one attention weight per edge and head
        # Edge tensors: gathered logits, LeakyReLU, softmax pieces (~6 floats
        # per edge and head saved or live); counter-based dropout hashes in
        # int64 (~48 bytes per element while the mask is drawn).
        edge = eh * (6 * itemsize + (48 if self.dropout > 0 else 0))
        forward = max(2 * v_src + v_dst, v_src + edge)
        # Backward of one head's spmm: the attention weights' gradient is a
        # dot product per edge, which gathers (E, C) gradient and source rows
        # and multiplies them unless the fused GPU kernel does it (then one
        # (E, C)-sized allowance stays as margin); heads run one after another.
        # The sources' gradient (num_src, H, C) is assembled from heads and logits.
        gathers = 1 if itemsize == 4 and ops.fused_edge_dots() else 3  # the kernel: float32
        messages = v_src + 6 * eh * itemsize + gathers * num_edges * C * itemsize + v_dst
        vertex = 4 * v_src + v_dst
        return max(forward, messages, vertex)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"
