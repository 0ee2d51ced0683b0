r"""Quality numbers of a partition: balance, edge cut, neighbour replication.

The replication factor of a set of vertex groups (HongTu Table 3) is

.. math::

    \alpha = \frac{1}{|V|} \sum_{P} |N(P)|,

where :math:`N(P)` is the set of distinct sources of in-edges into group
:math:`P`: the rows a GPU must read to aggregate ``P``. It is reported for the
``m`` parts and for the ``m * n`` chunks.
"""

from __future__ import annotations

import numpy as np

from hongtu.graph import Graph
from hongtu.partition._kernels import count_cut_edges, distinct_sources
from hongtu.partition.partition import Partition

__all__ = ["format_stats", "partition_stats"]


def _balance(counts: np.ndarray) -> float:
    """max / mean; 1.0 means perfectly balanced (and for no edges at all)."""
    mean = float(counts.mean()) if counts.size else 0.0
    return float(counts.max()) / mean if mean > 0 else 1.0


def partition_stats(graph: Graph, partition: Partition) -> dict:
    r"""Balance, cut and replication of a partition of ``graph``.

    Args:
        graph: the graph in the user's (original) ids, as given to
            :func:`partition_graph`.
        partition: its partition.

    Returns:
        A JSON-serialisable dict with keys ``method``, ``num_parts``,
        ``num_chunks``, ``num_nodes``, ``num_edges``, ``part_vertices``,
        ``part_edges`` (in-edges per part), ``part_neighbors`` (:math:`|N(P)|`),
        ``chunk_vertices``, ``chunk_edges``, ``chunk_neighbors`` (flat, chunk
        ``(i, j)`` at ``i*n + j``), ``edge_balance`` and ``chunk_edge_balance``
        (max / mean in-edges), ``cut_edges``, ``cut_fraction``, ``alpha_parts``
        and ``alpha_chunks``.
    """
    if graph.num_nodes != partition.num_nodes:
        raise ValueError(f"partition is for {partition.num_nodes} vertices, "
                         f"graph has {graph.num_nodes}")
    n_nodes, n_edges = graph.num_nodes, graph.num_edges
    m, n = partition.num_parts, partition.num_chunks
    # In-edges of a new-id range: prefix sums of the in-degree in new order.
    edge_prefix = np.zeros(n_nodes + 1, dtype=np.int64)
    np.cumsum(graph.in_degree()[partition.perm], out=edge_prefix[1:])
    part_edges = np.diff(edge_prefix[partition.part_ptr])
    chunk_edges = np.diff(edge_prefix[partition.chunk_ptr])
    part_of = np.repeat(np.arange(m, dtype=np.int32), np.diff(partition.part_ptr))[partition.inv]
    cut = count_cut_edges(graph.indptr, graph.indices, part_of)
    part_nbrs = distinct_sources(graph.indptr, graph.indices, partition.perm, partition.part_ptr)
    chunk_nbrs = distinct_sources(graph.indptr, graph.indices, partition.perm, partition.chunk_ptr)
    denom = max(n_nodes, 1)
    return {
        "method": partition.method,
        "num_parts": m,
        "num_chunks": n,
        "num_nodes": n_nodes,
        "num_edges": n_edges,
        "part_vertices": np.diff(partition.part_ptr).tolist(),
        "part_edges": part_edges.tolist(),
        "part_neighbors": part_nbrs.tolist(),
        "chunk_vertices": np.diff(partition.chunk_ptr).tolist(),
        "chunk_edges": chunk_edges.tolist(),
        "chunk_neighbors": chunk_nbrs.tolist(),
        "edge_balance": _balance(part_edges),
        "chunk_edge_balance": _balance(chunk_edges),
        "cut_edges": cut,
        "cut_fraction": cut / n_edges if n_edges else 0.0,
        "alpha_parts": float(part_nbrs.sum()) / denom,
        "alpha_chunks": float(chunk_nbrs.sum()) / denom,
    }


def format_stats(stats: dict) -> str:
    """A plain-text table of :func:`partition_stats` for the command line.

    One row per part (vertices, in-edges, distinct in-neighbours, and the
    smallest / largest chunk by in-edges), then a summary line.
    """
    m, n = stats["num_parts"], stats["num_chunks"]
    chunk_edges = np.asarray(stats["chunk_edges"], dtype=np.int64).reshape(m, n)
    header = ("part", "vertices", "in-edges", "|N(P)|", "chunk edges min", "chunk edges max")
    rows = [header]
    for i in range(m):
        rows.append((str(i), f"{stats['part_vertices'][i]:,}", f"{stats['part_edges'][i]:,}",
                     f"{stats['part_neighbors'][i]:,}", f"{int(chunk_edges[i].min()):,}",
                     f"{int(chunk_edges[i].max()):,}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    title = (f"partition: {stats['method']}, {m} parts x {n} chunks, "
             f"{stats['num_nodes']:,} vertices, {stats['num_edges']:,} edges")
    lines = [title]
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(r, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"edge balance {stats['edge_balance']:.3f} (parts), "
                 f"{stats['chunk_edge_balance']:.3f} (chunks); "
                 f"cut {stats['cut_edges']:,} edges ({100 * stats['cut_fraction']:.1f}%); "
                 f"alpha {stats['alpha_parts']:.3f} (parts), {stats['alpha_chunks']:.3f} (chunks)")
    return "\n".join(lines)
