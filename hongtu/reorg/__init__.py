r"""Chunk reorganizer (HongTu Alg. 4) and the transfer cost model (Eq. 4).

Example::

    >>> from hongtu.reorg import reorganize, cost
    >>> order = reorganize(g.indptr, g.indices, p.chunk_ptr, num_parts=4, num_chunks=8)
    >>> plan = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 4, 8, order=order)
    >>> cost(plan)          # seconds per pass
"""

from hongtu.reorg.reorg import (
    DEFAULT_ROW_BYTES,
    T_DD,
    T_HD,
    T_RU,
    ReorgResult,
    cost,
    group_batches,
    order_batches,
    plan_batches,
    reorganize,
    reorganize_report,
)

__all__ = [
    "DEFAULT_ROW_BYTES",
    "T_DD",
    "T_HD",
    "T_RU",
    "ReorgResult",
    "cost",
    "group_batches",
    "order_batches",
    "plan_batches",
    "reorganize",
    "reorganize_report",
]
