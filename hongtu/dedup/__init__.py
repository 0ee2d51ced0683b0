r"""Deduplicated transfers (HongTu §5): neighbour and transition sets, slots, volumes.

The planner is pure numpy + numba: it reads the renumbered graph's CSC and
the chunk boundaries and returns a :class:`TransferPlan` of flat arrays that
the engine executes (see :class:`DevicePlan` for the exact protocol).

Example::

    >>> from hongtu.dedup import plan_transfers
    >>> plan = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 4, 8, devices=4, row_bytes=512)
    >>> plan.v_ori, plan.v_p2p, plan.v_ru, plan.h2d_bytes
    >>> np.savez("plan.npz", **plan.to_npz_dict())
"""

from hongtu.dedup.plan import plan_transfers
from hongtu.dedup.sets import (
    Volumes,
    check_order,
    consecutive_overlaps,
    identity_order,
    neighbour_sets,
    transfer_volumes,
    transition_sets,
    union_sets,
)
from hongtu.dedup.types import DevicePlan, TransferPlan

__all__ = [
    "DevicePlan",
    "TransferPlan",
    "Volumes",
    "check_order",
    "consecutive_overlaps",
    "identity_order",
    "neighbour_sets",
    "plan_transfers",
    "transfer_volumes",
    "transition_sets",
    "union_sets",
]
