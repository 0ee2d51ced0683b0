r"""Level 1 of the partitioner: assign every vertex to one of ``m`` parts.

Methods (``engine.partitioner``):

* ``metis`` — pymetis k-way on the symmetrised simple graph, vertex weight
  :math:`d_{in}(v) + 1`, so parts balance in-edges (the work of a GPU) and an
  isolated vertex still counts.
* ``range`` — contiguous original ids, cut where the running sum of
  :math:`d_{in}(v) + 1` crosses :math:`k/m` of the total.
* ``random`` — the same balanced cut over a seeded random permutation.

The result is cached on disk (:mod:`hongtu.partition.cache`) because METIS
dominates preprocessing time.
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np

from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.partition._kernels import symmetric_csr
from hongtu.partition.cache import cache_key, load_assignment, save_assignment

__all__ = [
    "METHODS",
    "assign_parts",
    "balanced_cuts",
    "metis_parts",
    "prefix_cuts",
    "random_parts",
    "range_parts",
]

logger = logging.getLogger("hongtu.partition")

METHODS = ("metis", "range", "random")


def balanced_cuts(weights: np.ndarray, k: int, min_size: int = 1) -> np.ndarray:
    r"""Cut a sequence into ``k`` contiguous pieces of about equal total weight.

    Boundary ``b_t`` is the prefix length whose weight sum is closest to
    :math:`t/k` of the total; boundaries are then nudged so that every piece
    holds at least ``min_size`` items.

    Args:
        weights: non-negative weight of each item, in sequence order.
        k: number of pieces (``k >= 1``).
        min_size: fewest items per piece; needs ``len(weights) >= k * min_size``.

    Returns:
        int64 array of ``k + 1`` boundaries, ``0`` first and ``len(weights)`` last.
    """
    size = int(weights.shape[0])
    if size < k * min_size:
        raise ValueError(f"cannot cut {size} items into {k} pieces of at least {min_size}")
    prefix = np.zeros(size + 1, dtype=np.float64)
    np.cumsum(weights, out=prefix[1:])
    return prefix_cuts(prefix, k, min_size)


def prefix_cuts(prefix: np.ndarray, k: int, min_size: int = 1) -> np.ndarray:
    """:func:`balanced_cuts` from the weights' prefix sums (``prefix[0] == 0``; float, or
    integer below 2**53, or an :class:`OffsetPrefix`), so cutting one sequence for many
    ``k`` sums it once."""
    size = int(prefix.shape[0]) - 1
    targets = float(prefix[-1]) * np.arange(1, k, dtype=np.float64) / k
    # (An integer prefix is searched for the targets rounded up, which finds
    # the same positions without casting the prefix to float.)
    probe = np.ceil(targets).astype(prefix.dtype) if prefix.dtype.kind in "iu" else targets
    hi = np.clip(prefix.searchsorted(probe, side="left"), 1, size)
    lo = hi - 1
    cut = np.where(prefix[hi] - targets <= targets - prefix[lo], hi, lo)
    bounds = np.concatenate(([0], cut, [size])).astype(np.int64)
    # Forward then backward pass: each piece gets min_size items, staying
    # as close to the weight-balanced cut as that allows.
    for t in range(1, k):
        bounds[t] = max(bounds[t], bounds[t - 1] + min_size)
    for t in range(k - 1, 0, -1):
        bounds[t] = min(bounds[t], bounds[t + 1] - min_size)
    return bounds


class OffsetPrefix:
    """:func:`prefix_cuts`' prefix of the weights ``in-degree + 1`` of vertices ``a..b``,
    read from the in-edge offsets as it is needed (``prefix[i] = indptr[a + i] -
    indptr[a] + i``, strictly increasing) instead of written out."""

    dtype = np.dtype(np.int64)

    def __init__(self, indptr: np.ndarray, a: int, b: int) -> None:
        self._ptr = np.asarray(indptr, dtype=np.int64)[a:b + 1]
        self.shape = (b - a + 1,)

    def __getitem__(self, i):
        i = np.asarray(i)
        i = np.where(i < 0, i + self.shape[0], i)
        return self._ptr[i] - self._ptr[0] + i

    def searchsorted(self, values: np.ndarray, side: str = "left") -> np.ndarray:
        """``np.searchsorted`` of ``values`` (``side='left'``), by bisection on all at once."""
        if side != "left":
            raise ValueError("only side='left' is supported")
        values = np.asarray(values)
        lo = np.zeros(values.shape, dtype=np.int64)
        hi = np.full(values.shape, self.shape[0], dtype=np.int64)
        while np.any(lo < hi):
            active = lo < hi
            mid = (lo + hi) // 2
            below = active & (self[np.minimum(mid, self.shape[0] - 1)] < values)
            lo = np.where(below, mid + 1, lo)
            hi = np.where(active & ~below, mid, hi)
        return lo


def _vertex_weights(graph: Graph) -> np.ndarray:
    return graph.in_degree() + 1


def range_parts(graph: Graph, num_parts: int) -> np.ndarray:
    """Contiguous ranges of original ids, balanced by in-edges plus vertices."""
    bounds = balanced_cuts(_vertex_weights(graph), num_parts)
    return np.repeat(np.arange(num_parts, dtype=np.int32), np.diff(bounds))


def random_parts(graph: Graph, num_parts: int, seed: int = 0) -> np.ndarray:
    """Balanced range cut of a seeded random permutation of the vertices."""
    order = np.random.default_rng(seed).permutation(graph.num_nodes)
    bounds = balanced_cuts(_vertex_weights(graph)[order], num_parts)
    parts = np.empty(graph.num_nodes, dtype=np.int32)
    parts[order] = np.repeat(np.arange(num_parts, dtype=np.int32), np.diff(bounds))
    return parts


class MetisError(UserError):
    """METIS failed to partition (most often out of host memory)."""


def metis_parts(graph: Graph, num_parts: int, seed: int = 0,
                timings: dict[str, float] | None = None) -> np.ndarray:
    """METIS k-way partition of the symmetrised graph, in-edge balanced.

    Args:
        graph: the graph (directed; symmetrised here, self-loops and
            duplicate arcs dropped).
        num_parts: number of parts ``m``.
        seed: METIS random seed (``Options.seed``).
        timings: if given, receives ``symmetrize_s`` and ``metis_s``.
    """
    import pymetis

    if num_parts == 1:
        return np.zeros(graph.num_nodes, dtype=np.int32)
    t0 = time.perf_counter()
    xadj, adjncy = symmetric_csr(graph.indptr, graph.indices)
    vweights = _vertex_weights(graph).astype(np.int64)
    t1 = time.perf_counter()
    options = pymetis.Options()
    options.seed = int(seed)
    with warnings.catch_warnings():
        # Older pymetis only takes xadj/adjncy and newer ones deprecate them.
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            if hasattr(pymetis, "CSRAdjacency"):
                result = pymetis.part_graph(num_parts,
                                            adjacency=pymetis.CSRAdjacency(xadj, adjncy),
                                            vweights=vweights, options=options)
            else:
                result = pymetis.part_graph(num_parts, xadj=xadj, adjncy=adjncy,
                                            vweights=vweights, options=options)
        except (RuntimeError, MemoryError) as err:
            # (R-MAT 2^22, 16 parts: the process peaked at 21.6 GB alone on a 24 GiB
            # machine; beside a report's other data pymetis raised "Caught an
            # unknown exception!")
            raise MetisError(
                f"METIS could not split the graph ({graph.num_nodes:,} vertices, "
                f"{adjncy.shape[0]:,} arcs) into {num_parts} parts ({type(err).__name__}: "
                f"{err}); on a large graph that is most often host memory (a 128M-arc graph "
                "peaked at 21.6 GB in 16 parts): free memory, use fewer parts, or set "
                "engine.partitioner=range") from err
    t2 = time.perf_counter()
    parts = np.asarray(result[1], dtype=np.int32)
    if timings is not None:
        timings["symmetrize_s"] = t1 - t0
        timings["metis_s"] = t2 - t1
    logger.info("METIS: %d parts of %d vertices / %d arcs: symmetrise %.2fs, METIS %.2fs, "
                "edge cut %d", num_parts, graph.num_nodes, adjncy.shape[0], t1 - t0, t2 - t1,
                result[0])
    return parts


def _check_args(graph: Graph, num_parts: int, method: str) -> None:
    if method not in METHODS:
        raise UserError(f"unknown partition method {method!r}; "
                        f"set engine.partitioner to one of {', '.join(METHODS)}")
    if not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise UserError(f"number of parts must be a positive integer, got {num_parts!r}")
    if graph.num_nodes < num_parts:
        raise UserError(f"cannot split a graph of {graph.num_nodes} vertices into {num_parts} "
                        f"parts; use at most {max(graph.num_nodes, 1)} parts")


def assign_parts(graph: Graph, num_parts: int, method: str = "metis", seed: int = 0,
                 cache_dir: str | None = None, *, return_hit: bool = False,
                 timings: dict[str, float] | None = None,
                 fingerprint: str | None = None) -> np.ndarray | tuple[np.ndarray, bool]:
    r"""Level-1 partition: the part of every vertex, in the user's ids.

    Args:
        graph: the graph to partition.
        num_parts: number of parts ``m`` (usually one per GPU).
        method: ``'metis'`` (default), ``'range'`` or ``'random'``.
        seed: seed for METIS and for ``random``.
        cache_dir: directory of the on-disk cache; ``None`` disables it.
        return_hit: also return whether the result came from the cache.
        timings: if given, receives the seconds of each step
            (``symmetrize_s``, ``metis_s`` for METIS; ``assign_s`` always).
        fingerprint: ``graph.fingerprint(structure_only=True)``, where the
            caller has it already (the cache key; computed when ``None``).

    Returns:
        int32 array ``parts`` of length ``N`` with values in ``[0, m)``, or
        ``(parts, hit)`` when ``return_hit`` is set.

    Example::

        >>> parts = assign_parts(graph, 4, method="range")
        >>> np.bincount(parts).size
        4
    """
    _check_args(graph, num_parts, method)
    num_parts = int(num_parts)
    t0 = time.perf_counter()
    key = None
    parts = None
    if cache_dir is not None and num_parts > 1:
        if fingerprint is None:
            fingerprint = graph.fingerprint(structure_only=True)
        key = cache_key(fingerprint, method, num_parts, int(seed))
        parts = load_assignment(cache_dir, key, graph.num_nodes, num_parts)
        if parts is not None:
            logger.info("loaded %s part assignment (%d parts) from cache %s",
                        method, num_parts, cache_dir)
    hit = parts is not None
    if parts is None:
        if num_parts == 1:
            parts = np.zeros(graph.num_nodes, dtype=np.int32)
        elif method == "metis":
            parts = metis_parts(graph, num_parts, seed, timings)
        elif method == "range":
            parts = range_parts(graph, num_parts)
        else:
            parts = random_parts(graph, num_parts, seed)
        if key is not None:
            save_assignment(cache_dir, key, parts)
    if timings is not None:
        timings["assign_s"] = time.perf_counter() - t0
    return (parts, hit) if return_hit else parts
