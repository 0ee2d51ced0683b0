"""hongtu: out-of-core full-graph GNN training (HongTu, SIGMOD 2023)."""

__version__ = "0.1.0"
