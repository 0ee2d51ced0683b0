r"""The batch executor: one training step of full-graph GNN training, chunk by chunk.

Follows HongTu Algorithm 1 (DESIGN.md §1) on one device:

* forward, layer by layer and batch by batch: load ``h^l[N_c]`` (and
  ``h^l[V_c]`` when the layer reads its own rows), compute layer ``l`` on
  chunk ``c``, write ``h^{l+1}[V_c]`` — and, for cacheable layers, the
  aggregate ``a^l[V_c]`` — back to host;
* at the last layer, the loss of the chunk's train vertices (cross-entropy,
  normalised by the total train count) and its gradient ``∇h^L[V_c]``;
* backward, layer by layer: load the checkpoint (``a^l[V_c]`` for cacheable
  layers, ``h^l[N_c]`` otherwise) and ``∇h^{l+1}[V_c]``, recompute the layer
  under autograd, backward, and add ``∇h^l`` into the host buffer.

Parameter gradients accumulate over chunks, so after :meth:`Executor.step`
they are exactly the full-graph gradients; the caller takes the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hongtu.engine.buffers import HostBuffers
from hongtu.engine.chunks import ChunkSet
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


class Executor:
    """Runs forward, loss and backward over a :class:`ChunkSet`.

    Args:
        model: the GNN (parameters on ``device``).
        chunks: the chunk blocks (host tensors).
        buffers: the host buffers.
        labels: ``(N,)`` int64 labels.
        masks: ``{"train": ..., "val": ..., "test": ...}`` boolean ``(N,)`` masks.
        device: the compute device.
        checkpoint: ``auto`` caches aggregates of cacheable layers; ``recompute``
            recomputes every layer in full in backward.
        seed: the run seed (dropout streams derive from it).
        resident_blocks: keep every chunk's block on the device (when the
            budget allows); otherwise blocks wait in pinned host memory and
            are copied to the device for each use.
    """

    def __init__(self, model: GNN, chunks: ChunkSet, buffers: HostBuffers, labels: Tensor,
                 masks: dict[str, Tensor], device: torch.device, checkpoint: str = "auto",
                 seed: int = 0, resident_blocks: bool = True) -> None:
        self.model = model
        self.chunks = chunks
        self.buf = buffers
        self.device = device
        self.seed = seed
        self.cached = [bool(layer.cacheable and checkpoint == "auto") for layer in model.layers]
        self.dtype = buffers.h[1].dtype
        widths = model.widths()
        max_src, max_dst = chunks.max_rows()
        self.mover = Mover(device, {"src": max_src, "dst": max_dst, "aux": max_dst,
                                    "grad": max_dst}, max(widths), self.dtype)
        self.labels = labels.to(device)
        self.masks = {k: m.to(device) for k, m in masks.items()}
        self.num_train = max(int(masks["train"].sum()), 1)
        self._src_np = [b.src_ids.numpy() for b in chunks.blocks]
        if device.type == "cpu":
            self._blocks = chunks.blocks
        elif resident_blocks:
            self._blocks = [b.to(device) for b in chunks.blocks]
        else:
            self._blocks = [b.pin_memory() for b in chunks.blocks]
        self._copy_blocks = device.type != "cpu" and not resident_blocks

    # ------------------------------------------------------------- helpers
    def _device_block(self, c: int) -> Block:
        block = self._blocks[c]
        return block.to(self.device, non_blocking=True) if self._copy_blocks else block

    def _seed(self, epoch: int, l: int) -> int:
        return layer_seed(self.seed, epoch, l)

    def _chunk_order(self):
        for batch in self.chunks.batches():
            yield from batch

    # ------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, epoch: int, train: bool, progress=None) -> StepResult:
        """Forward over all layers; in training mode also the loss and ``∇h^L``."""
        model, buf, mv = self.model, self.buf, self.mover
        model.train(train)
        L = model.num_layers
        res = StepResult(0.0, {"train": 0, "val": 0, "test": 0}, {"train": 0, "val": 0, "test": 0})
        for l in range(L):
            layer = model.layers[l]
            seed = self._seed(epoch, l)
            for c in self._chunk_order():
                block = self._device_block(c)
                v0, v1 = self.chunks.range(c)
                x_src = mv.load_rows(buf.h[l], block.src_ids, "src")
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
        return res

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
        model, buf, mv = self.model, self.buf, self.mover
        model.train(True)
        for l in reversed(range(model.num_layers)):
            layer = model.layers[l]
            seed = self._seed(epoch, l)
            need_in = l > 0  # ∇h^0 is never needed: inputs carry no gradient
            if need_in:
                buf.grad[l].zero_()
            for c in self._chunk_order():
                block = self._device_block(c)
                v0, v1 = self.chunks.range(c)
                g_out = mv.load_range(buf.grad[l + 1], v0, v1, "grad")
                x_dst = None
                if layer.needs_dst:
                    x_dst = mv.load_range(buf.h[l], v0, v1, "dst").detach().requires_grad_(need_in)
                with torch.enable_grad():
                    if self.cached[l]:
                        a = mv.load_range(buf.agg[l], v0, v1, "aux")
                        a = a.detach().requires_grad_(need_in)
                        out = model.step_update(l, block, a, x_dst, seed)
                        _backward(out, g_out)
                        g_src = (model.step_aggregate_transpose(l, block, a.grad, seed)
                                 if need_in and a.grad is not None else None)
                    else:
                        x_src = mv.load_rows(buf.h[l], block.src_ids, "src")
                        x_src = x_src.detach().requires_grad_(need_in)
                        out = model.step_forward(l, block, x_src, x_dst, seed)
                        _backward(out, g_out)
                        g_src = x_src.grad if need_in else None
                if g_src is not None:
                    mv.add_rows(buf.grad[l], self._src_np[c], g_src)
                if need_in and x_dst is not None and x_dst.grad is not None:
                    mv.add_range(buf.grad[l], v0, x_dst.grad)
                if progress is not None:
                    progress(1)

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
        per_pass = len(self.chunks.blocks) * self.model.num_layers
        return per_pass * (3 if evaluate else 2)


def _backward(out: Tensor, grad: Tensor) -> None:
    if out.requires_grad:
        out.backward(grad)
