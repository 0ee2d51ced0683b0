r"""The batch executor: one training step of full-graph GNN training, chunk by chunk.

Follows HongTu Algorithm 1 (DESIGN.md §1) on one device, executing a
deduplicated transfer plan (:class:`hongtu.dedup.DevicePlan`):

* forward, layer by layer and step by step: bring the step's new neighbour
  rows ``𝕅^cpu`` from host into their slots of the device transition buffer
  (rows shared with the previous step stay in place), gather each chunk's
  ``h^l[N_c]`` from the buffer, compute layer ``l``, write ``h^{l+1}[V_c]`` —
  and, for cacheable layers, the aggregate ``a^l[V_c]`` — back to host;
* at the last layer, the loss of the chunk's train vertices (cross-entropy,
  normalised by the total train count) and its gradient ``∇h^L[V_c]``;
* backward, layer by layer and in the same step order: load the checkpoint
  (``a^l[V_c]`` for cacheable layers; the neighbour rows, with the same
  reuse, otherwise) and ``∇h^{l+1}[V_c]``, recompute the layer under
  autograd, backward, accumulate the neighbours' gradients at their slots on
  the device while the rows stay resident, and flush rows that leave into the
  host ``∇h^l``.

Parameter gradients accumulate over chunks, so after :meth:`Executor.step`
they are exactly the full-graph gradients; the caller takes the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hongtu.dedup import DevicePlan
from hongtu.engine.buffers import HostBuffers
from hongtu.engine.chunks import ChunkSet
from hongtu.engine.comm import Comm
from hongtu.engine.transfer import Mover
from hongtu.nn.block import Block
from hongtu.nn.model import GNN, layer_seed

__all__ = ["Executor", "StepResult"]


@dataclass
class StepResult:
    """What one pass over the graph produced."""

    loss: float = 0.0
    correct: dict | None = None
    total: dict | None = None

    def accuracy(self, split: str) -> float:
        t = self.total.get(split, 0) if self.total else 0
        return self.correct[split] / t if t else float("nan")


class _PlanOnDevice:
    """A :class:`DevicePlan`'s index arrays on the compute device, sliced per step."""

    def __init__(self, plan: DevicePlan, device: torch.device, row0: int = 0) -> None:
        def dev(a: np.ndarray, shift: int = 0) -> Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64) - shift).to(device)

        self.plan = plan
        # Host ids become rows of this process's own host buffers (which start at row0).
        self.load_ids, self.load_slots = dev(plan.load_ids, row0), dev(plan.load_slots)
        self.flush_slots = dev(plan.flush_slots)
        self.flush_ids = np.asarray(plan.flush_ids, dtype=np.int64) - row0  # for host adds
        self.chunk_slots = dev(plan.chunk_slots)
        self.send_slots = dev(plan.send_slots)
        self.send_counts = plan.send_counts.tolist()
        self.recv_counts = plan.recv_counts.tolist()

    def steps(self):
        """``(s, [(q, chunk id), ...])`` in processing order."""
        p = self.plan
        for s in range(p.num_steps):
            yield s, [(q, int(p.chunk_ids[q])) for q in range(p.step_ptr[s], p.step_ptr[s + 1])]

    def load(self, s: int) -> tuple[Tensor, Tensor]:
        a, b = int(self.plan.load_ptr[s]), int(self.plan.load_ptr[s + 1])
        return self.load_ids[a:b], self.load_slots[a:b]

    def flush(self, s: int) -> tuple[np.ndarray, Tensor]:
        a, b = int(self.plan.flush_ptr[s]), int(self.plan.flush_ptr[s + 1])
        return self.flush_ids[a:b], self.flush_slots[a:b]

    def sends(self, s: int) -> tuple[Tensor, list[int], list[int]]:
        """Step ``s``'s send slots and the per-peer send and receive counts."""
        a, b = int(self.plan.send_ptr[s]), int(self.plan.send_ptr[s + 1])
        return self.send_slots[a:b], self.send_counts[s], self.recv_counts[s]

    def slots(self, q: int) -> Tensor:
        p = self.plan.chunk_slot_ptr
        return self.chunk_slots[int(p[q]):int(p[q + 1])]


class Executor:
    """Runs forward, loss and backward over a :class:`ChunkSet` following a plan.

    Args:
        model: the GNN (parameters on ``device``).
        chunks: the chunk blocks (host tensors).
        buffers: the host buffers.
        labels: ``(N,)`` int64 labels.
        masks: ``{"train": ..., "val": ..., "test": ...}`` boolean ``(N,)`` masks.
        device: the compute device.
        plan: the device's transfer plan (:func:`hongtu.dedup.plan_transfers`).
        checkpoint: ``auto`` caches aggregates of cacheable layers; ``recompute``
            recomputes every layer in full in backward.
        seed: the run seed (dropout streams derive from it).
        resident_blocks: keep every chunk's block on the device (when the
            budget allows); otherwise blocks wait in pinned host memory and
            are copied to the device for each use.
        comm: the process group when several ranks train together (rank ``r``
            trains part ``r``; its host buffers, labels and masks hold only
            that part's rows, starting at ``chunks.row0``).
        num_train: train vertices of the whole graph (the loss is normalised
            by it); default ``masks["train"].sum()``.
    """

    def __init__(self, model: GNN, chunks: ChunkSet, buffers: HostBuffers, labels: Tensor,
                 masks: dict[str, Tensor], device: torch.device, plan: DevicePlan,
                 checkpoint: str = "auto", seed: int = 0, resident_blocks: bool = True,
                 comm: Comm | None = None, num_train: int | None = None) -> None:
        self.model = model
        self.chunks = chunks
        self.buf = buffers
        self.device = device
        self.seed = seed
        self.cached = model.cached_layers(checkpoint)
        self.dtype = buffers.h[1].dtype
        widths = model.widths()
        self.comm = comm
        max_dst = chunks.max_rows()[1]
        self.mover = Mover(device, {"dst": max_dst, "aux": max_dst, "grad": max_dst},
                           max(widths), self.dtype, stage_rows=plan.buffer_rows)
        self.plan = _PlanOnDevice(plan, device, chunks.row0)
        # The transition buffer (rows of h^l) and its gradient twin, allocated once.
        rows = max(plan.buffer_rows, 1)
        self._tbuf = torch.empty(rows * max(widths), dtype=self.dtype, device=device)
        self._gbuf = torch.empty(rows * max(widths), dtype=self.dtype, device=device)
        self.labels = labels.to(device)
        self.masks = {k: m.to(device) for k, m in masks.items()}
        self.num_train = max(int(masks["train"].sum()) if num_train is None else num_train, 1)
        if device.type == "cpu":
            self._blocks = chunks.blocks
        elif resident_blocks:
            self._blocks = [b if b is None else b.to(device) for b in chunks.blocks]
        else:
            self._blocks = [b if b is None else b.pin_memory() for b in chunks.blocks]
        self._copy_blocks = device.type != "cpu" and not resident_blocks

    # ------------------------------------------------------------- helpers
    def _block(self, c: int) -> Block:
        block = self._blocks[c]
        return block.to(self.device, non_blocking=True) if self._copy_blocks else block

    def _seed(self, epoch: int, l: int) -> int:
        return layer_seed(self.seed, epoch, l)

    def _buffer(self, which: Tensor, width: int) -> Tensor:
        rows = self.plan.plan.buffer_rows
        return which[: rows * width].view(rows, width)

    # ------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, epoch: int, train: bool, progress=None) -> StepResult:
        """Forward over all layers; in training mode also the loss and ``∇h^L``."""
        model, buf, mv, plan = self.model, self.buf, self.mover, self.plan
        model.train(train)
        L = model.num_layers
        res = StepResult(0.0, {"train": 0, "val": 0, "test": 0}, {"train": 0, "val": 0, "test": 0})
        for l in range(L):
            layer = model.layers[l]
            seed = self._seed(epoch, l)
            tbuf = self._buffer(self._tbuf, buf.h[l].shape[1])
            for s, chunks in plan.steps():
                mv.load_rows_into(buf.h[l], *plan.load(s), tbuf)
                self._exchange(s, tbuf)
                for q, c in chunks:
                    block = self._block(c)
                    v0, v1 = self.chunks.range(c)
                    x_src = tbuf.index_select(0, plan.slots(q))
                    x_dst = mv.load_range(buf.h[l], v0, v1, "dst") if layer.needs_dst else None
                    if self.cached[l] and train:
                        a = model.step_aggregate(l, block, x_src, seed)
                        mv.store_range(buf.agg[l], v0, a)
                        out = model.step_update(l, block, a, x_dst, seed)
                    else:
                        out = model.step_forward(l, block, x_src, x_dst, seed)
                    if l == L - 1:
                        self._output(out, v0, v1, train, res)
                    else:
                        mv.store_range(buf.h[l + 1], v0, out)
                    if progress is not None:
                        progress(1)
        if self.comm is not None:
            self._reduce(res)
        return res

    def _exchange(self, s: int, tbuf: Tensor) -> None:
        """Rows other ranks need go to them; rows this rank needs land in the receive area."""
        if self.comm is None:
            return
        slots, send, recv = self.plan.sends(s)
        area = tbuf.narrow(0, self.plan.plan.num_slots, sum(recv))
        self.mover.exchange(self.comm, area, recv, tbuf.index_select(0, slots), send)

    def _exchange_back(self, s: int, gbuf: Tensor) -> None:
        """Gradients of received rows return to their owners and are added at their slots."""
        if self.comm is None:
            return
        slots, send, recv = self.plan.sends(s)
        area = gbuf.narrow(0, self.plan.plan.num_slots, sum(recv))
        back = gbuf.new_empty((slots.shape[0], gbuf.shape[1]))
        self.mover.exchange(self.comm, back, send, area.contiguous(), recv)
        gbuf.index_add_(0, slots, back)

    def _reduce(self, res: StepResult) -> None:
        """Loss and accuracy counts of all ranks."""
        keys = sorted(res.correct)
        t = torch.tensor([res.loss] + [res.correct[k] for k in keys]
                         + [res.total[k] for k in keys], dtype=torch.float64, device=self.device)
        self.comm.all_reduce_(t)
        v = t.tolist()
        res.loss = v[0]
        for i, k in enumerate(keys):
            res.correct[k], res.total[k] = int(v[1 + i]), int(v[1 + len(keys) + i])

    def _output(self, logits: Tensor, v0: int, v1: int, train: bool, res: StepResult) -> None:
        y = self.labels[v0:v1]
        pred = logits.argmax(dim=-1)
        for split, mask in self.masks.items():
            m = mask[v0:v1]
            res.correct[split] += int((pred[m] == y[m]).sum())
            res.total[split] += int(m.sum())
        if not train:
            self.mover.store_range(self.buf.h[-1], v0, logits)
            return
        m = self.masks["train"][v0:v1]
        with torch.enable_grad():
            z = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(z[m], y[m], reduction="sum") / self.num_train
            if m.any():
                loss.backward()
                grad = z.grad
            else:
                grad = torch.zeros_like(z)
        res.loss += float(loss)
        self.mover.store_range(self.buf.grad[-1], v0, grad)

    # ------------------------------------------------------------ backward
    def backward(self, epoch: int, progress=None) -> None:
        """Backward over all layers; parameter gradients accumulate in ``.grad``."""
        model, buf, mv, plan = self.model, self.buf, self.mover, self.plan
        model.train(True)
        for l in reversed(range(model.num_layers)):
            layer = model.layers[l]
            seed = self._seed(epoch, l)
            need_in = l > 0  # ∇h^0 is never needed: inputs carry no gradient
            width = buf.h[l].shape[1]
            tbuf = self._buffer(self._tbuf, width)
            gbuf = self._buffer(self._gbuf, width)
            if need_in:
                buf.grad[l].zero_()
            for s, chunks in plan.steps():
                ids, slots = plan.load(s)
                if not self.cached[l]:
                    mv.load_rows_into(buf.h[l], ids, slots, tbuf)
                    self._exchange(s, tbuf)
                if need_in:
                    gbuf.index_fill_(0, slots, 0)  # rows entering start with no gradient
                    gbuf[plan.plan.num_slots:].zero_()  # and so does the receive area
                for q, c in chunks:
                    self._backward_chunk(l, layer, q, c, tbuf, gbuf, need_in, seed)
                    if progress is not None:
                        progress(1)
                if need_in:
                    self._exchange_back(s, gbuf)
                    mv.flush_rows(buf.grad[l], *plan.flush(s), gbuf)
            mv.drain()  # ∇h^l complete in host memory before layer l-1 reads it
        if self.comm is not None:
            self.comm.all_reduce_grads(self.model.parameters())

    def _backward_chunk(self, l: int, layer, q: int, c: int, tbuf: Tensor, gbuf: Tensor,
                        need_in: bool, seed: int) -> None:
        model, buf, mv = self.model, self.buf, self.mover
        block = self._block(c)
        v0, v1 = self.chunks.range(c)
        g_out = mv.load_range(buf.grad[l + 1], v0, v1, "grad")
        x_dst = None
        if layer.needs_dst:
            x_dst = mv.load_range(buf.h[l], v0, v1, "dst").detach().requires_grad_(need_in)
        with torch.enable_grad():
            if self.cached[l]:
                a = mv.load_range(buf.agg[l], v0, v1, "aux").detach().requires_grad_(need_in)
                out = model.step_update(l, block, a, x_dst, seed)
                _backward(out, g_out)
                g_src = (model.step_aggregate_transpose(l, block, a.grad, seed)
                         if need_in and a.grad is not None else None)
            else:
                x_src = tbuf.index_select(0, self.plan.slots(q)).requires_grad_(need_in)
                out = model.step_forward(l, block, x_src, x_dst, seed)
                _backward(out, g_out)
                g_src = x_src.grad if need_in else None
        if g_src is not None:
            gbuf.index_add_(0, self.plan.slots(q), g_src)
        if need_in and x_dst is not None and x_dst.grad is not None:
            mv.add_range(buf.grad[l], v0, x_dst.grad)

    def step(self, epoch: int, progress=None) -> StepResult:
        """Forward + loss + backward: leaves the full-graph gradients in the parameters."""
        self.model.zero_grad(set_to_none=True)
        res = self.forward(epoch, train=True, progress=progress)
        self.backward(epoch, progress=progress)
        return res

    def evaluate(self, epoch: int, progress=None) -> StepResult:
        """Forward without dropout; accuracies per split, logits in ``h^L``."""
        return self.forward(epoch, train=False, progress=progress)

    def batches_per_epoch(self, evaluate: bool) -> int:
        """Chunk visits of one epoch (for progress bars)."""
        per_pass = (self.plan.plan.chunk_ids.shape[0]) * self.model.num_layers
        return per_pass * (3 if evaluate else 2)


def _backward(out: Tensor, grad: Tensor) -> None:
    if out.requires_grad:
        out.backward(grad)
