r"""2-level partitioner (HongTu §4.1): METIS parts, range chunks, renumbering.

Level 1 assigns every vertex to one of ``m`` parts (:func:`assign_parts`;
METIS by default, cached on disk). Level 2 cuts each part, in original id
order, into ``n`` contiguous chunks of about equal in-edge count
(:func:`chunk_partition`). The result, a :class:`Partition`, renumbers the
vertices so chunk ``(i, j)`` is one contiguous id range.

Example::

    >>> from hongtu.partition import partition_graph, partition_stats, format_stats
    >>> p = partition_graph(graph, parts=4, chunks=8, method="metis", cache_dir="cache")
    >>> g = p.apply(graph)
    >>> print(format_stats(partition_stats(graph, p)))
"""

from hongtu.partition.assign import METHODS, MetisError, assign_parts
from hongtu.partition.partition import Chunker, Partition, chunk_partition, partition_graph
from hongtu.partition.stats import format_stats, partition_stats

__all__ = [
    "METHODS",
    "Chunker",
    "MetisError",
    "Partition",
    "assign_parts",
    "chunk_partition",
    "format_stats",
    "partition_graph",
    "partition_stats",
]
