"""Host buffers, transfers, the batch executor and the training loop."""

from hongtu.engine.buffers import BufferPlan, HostBuffers
from hongtu.engine.chunks import ChunkSet
from hongtu.engine.executor import Executor, StepResult
from hongtu.engine.transfer import Mover, Traffic

__all__ = ["BufferPlan", "HostBuffers", "ChunkSet", "Executor", "StepResult", "Mover", "Traffic"]
