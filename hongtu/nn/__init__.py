"""Layers and graph ops: ``GNNLayer`` and the built-in GCN, SAGE, GIN and GAT."""

from hongtu.nn.block import Block, build_block
from hongtu.nn.gat import GAT
from hongtu.nn.gcn import GCN
from hongtu.nn.gin import GIN
from hongtu.nn.layer import GNNLayer
from hongtu.nn.model import GNN, build_model, layer_seed, resolve_layer
from hongtu.nn.sage import SAGE

__all__ = [
    "GAT",
    "GCN",
    "GIN",
    "GNN",
    "SAGE",
    "Block",
    "GNNLayer",
    "build_block",
    "build_model",
    "layer_seed",
    "resolve_layer",
]
