"""A layer that fails in rank 1 only: the injected failure of the multi-process tests."""

import os

from hongtu.errors import UserError
from hongtu.nn import GCN


class FailOnRank1(GCN):
    """GCN, except that rank 1 stops with an error in its first forward pass."""

    def update(self, a, x_dst):
        if os.environ.get("RANK") == "1":
            raise UserError("injected failure for the test")
        return super().update(a, x_dst)
