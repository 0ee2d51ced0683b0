"""Graph container, loaders, generators and built-in datasets."""

from hongtu.graph.graph import Graph, csc_from_edges, index_dtype

__all__ = ["Graph", "csc_from_edges", "index_dtype"]
