r"""Collectives between ranks (torch.distributed): row exchange and reductions.

One process per device; rank ``r`` owns part ``r``. Rows a rank's chunk needs
from another part, and did not hold from the step before, travel
device-to-device with one ``all_to_all_single`` per step (NCCL on GPUs, gloo
on CPU), in the layout the planner fixed (:class:`hongtu.dedup.DevicePlan`:
send lists and arrivals grouped by peer). Gradients of received rows go back
the same way, reversed, when the rows leave the receiving rank's area.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Comm", "init_from_env", "in_distributed_launch"]


def in_distributed_launch() -> bool:
    """True inside a worker started by torchrun or hongtu's own launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class Comm:
    """This rank's view of the process group."""

    rank: int
    world: int
    local_rank: int
    owned: bool = False  # this Comm joined the group, so it is the one to leave it

    def exchange(self, out: Tensor, out_counts: list[int], inp: Tensor,
                 in_counts: list[int]) -> None:
        """``all_to_all_single``: ``inp`` split by ``in_counts`` to the peers, ``out`` filled."""
        dist.all_to_all_single(out, inp, out_counts, in_counts)

    def all_reduce_(self, t: Tensor) -> Tensor:
        """Sum ``t`` over ranks in place."""
        dist.all_reduce(t)
        return t

    def all_reduce_grads(self, params) -> None:
        """Sum the parameter gradients over ranks (one flat bucket)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        o = 0
        for g in grads:
            g.copy_(flat[o:o + g.numel()].view_as(g))
            o += g.numel()

    @staticmethod
    def _ints(values: list[int]) -> Tensor:
        """``values`` as int64 where the backend reduces them (NCCL: this rank's GPU)."""
        nccl = dist.get_backend() == "nccl"
        return torch.tensor([int(v) for v in values], dtype=torch.int64,
                            device=torch.device("cuda", torch.cuda.current_device()) if nccl
                            else "cpu")

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (so that every rank plans alike)."""
        t = self._ints([value])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def max_int(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        return -self.min_int(-value)

    def sum_ints(self, values: list[int]) -> list[int]:
        """``values`` summed over ranks, element by element (one collective)."""
        t = self._ints(values)
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def same_ints(self, values: list[int]) -> bool:
        """Whether every rank holds these ``values`` (one collective, every rank the
        same answer)."""
        t = self._ints(list(values) + [-int(v) for v in values])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = len(values)
        return all(int(a) == -int(b) for a, b in zip(t[:n].tolist(), t[n:].tolist()))

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Leave the process group together, once every rank is done with it.

        The barrier keeps a rank from tearing its end down while a peer still
        talks to it; destroying the group before the interpreter exits keeps
        the backend's worker threads from outliving it (a rank that dies at
        exit fails the whole launch, and torchrun's other nodes then wait out
        their exit barrier). A group this Comm did not create is left alone.
        """
        if self.owned and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self.owned = False


def init_from_env(cuda: bool, timeout_s: float) -> Comm:
    """Join the process group described by torchrun's environment variables."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    owned = not dist.is_initialized()
    if owned:
        if cuda:
            torch.cuda.set_device(local)
        # (NCCL told this process's GPU: its communicator set up here, its
        # barriers on that GPU, not one guessed from the rank)
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local) if cuda else None)
    return Comm(rank, world, local, owned)
