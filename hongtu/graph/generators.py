r"""Synthetic graph generators: R-MAT (Graph500) and a learnable stochastic block model.

Every random number comes from a counter-based hash (splitmix64's finaliser)
of ``(seed, stream, counter)``: edge ``e`` or feature ``(i, j)`` always gets
the same bits, whichever thread of a numba ``prange`` computes it. The
generated arrays are therefore byte-identical for a given seed, on any number
of threads.

Example::

    >>> rmat_graph(10, edge_factor=8, num_features=16).num_nodes
    1024
    >>> int(sbm_graph(500, num_classes=4, num_features=8).train_mask.sum())
    80
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from hongtu.graph._kernels import bucket_fill
from hongtu.graph.graph import Graph, index_dtype

__all__ = ["rmat_edges", "rmat_graph", "rmat_sized_graph", "sbm_graph"]

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                  0x94D049BB133111EB))
_LO24, _LO32 = np.uint64(0xFFFFFF), np.uint64(0xFFFFFFFF)
_U1, _U27, _U30, _U31, _U32, _U40 = (np.uint64(s) for s in (1, 27, 30, 31, 32, 40))
_TWO_PI = 2.0 * np.pi

# Stream tags keep the draws of different arrays independent for one seed.
_S_RMAT, _S_PERM, _S_X, _S_Y, _S_SPLIT, _S_SBM, _S_CENTROID = range(1, 8)


# ------------------------------------------------------------------ hashing
def _key(seed: int, stream: int) -> np.uint64:
    """Hash ``(seed, stream)`` into the 64-bit key of one random stream."""
    z = 0
    for word in (seed & _MASK64, stream):
        z = (z + word * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return np.uint64(z)


def _rng(seed: int, stream: int) -> np.random.Generator:
    """A numpy generator for the small serial draws (permutations, centroids)."""
    return np.random.default_rng(int(_key(seed, stream)))


@njit(inline="always", cache=True)
def _draw(key, counter):
    """64 random bits for ``counter`` of the stream ``key`` (splitmix64)."""
    z = key + np.uint64(counter) * _GOLDEN
    z = (z ^ (z >> _U30)) * _MIX1
    z = (z ^ (z >> _U27)) * _MIX2
    return z ^ (z >> _U31)


@njit(inline="always", cache=True)
def _below(bits32, bound):
    """Map 32 random bits to ``0 <= k < bound`` (multiply-shift, ``bound < 2**32``)."""
    return np.int64((bits32 * np.uint64(bound)) >> _U32)


# ------------------------------------------------------------------ kernels
@njit(inline="always", cache=True)
def _quadrant(u, v, r, t_a, t_ab, t_abc):
    """Descend one R-MAT level: append the row bit to ``u`` and the column bit to ``v``."""
    # Branch-free: a data-dependent branch per level costs more than the hash.
    u = (u << _U1) | np.uint64(r >= t_ab)
    v = (v << _U1) | np.uint64(((r >= t_a) & (r < t_ab)) | (r >= t_abc))
    return u, v


@njit(parallel=True, cache=True)
def _rmat_kernel(key, scale, t_a, t_ab, t_abc, perm, src, dst):
    words = np.uint64((scale + 1) // 2)
    for e in prange(src.shape[0]):
        u = np.uint64(0)
        v = np.uint64(0)
        base = np.uint64(e) * words
        # One hash feeds two levels: 32 bits of resolution per choice.
        for w in range(scale // 2):
            bits = _draw(key, base + np.uint64(w))
            u, v = _quadrant(u, v, np.uint32(bits >> _U32), t_a, t_ab, t_abc)
            u, v = _quadrant(u, v, np.uint32(bits & _LO32), t_a, t_ab, t_abc)
        if scale & 1:
            bits = _draw(key, base + np.uint64(scale // 2))
            u, v = _quadrant(u, v, np.uint32(bits >> _U32), t_a, t_ab, t_abc)
        src[e] = u
        dst[e] = v
    # Relabel in separate passes: interleaved with the hashing, the random
    # reads of ``perm`` cannot overlap and take twice as long as the hashing.
    for e in prange(src.shape[0]):
        src[e] = perm[src[e]]
    for e in prange(dst.shape[0]):
        dst[e] = perm[dst[e]]


@njit(inline="always", cache=True)
def _box_muller(bits):
    """Two independent N(0, 1) values from 64 random bits."""
    u1 = (np.float64(bits >> _U32) + 1.0) * (1.0 / 4294967296.0)  # (0, 1]: finite log
    u2 = np.float64(bits & _LO32) * (_TWO_PI / 4294967296.0)
    r = np.sqrt(-2.0 * np.log(u1))
    return r * np.cos(u2), r * np.sin(u2)


@njit(parallel=True, cache=True)
def _normal_kernel(key, x, scale, centroids, labels):
    """``x[i] = centroids[labels[i]] + scale * N(0, I)``."""
    n, f = x.shape
    pairs = (f + 1) // 2
    for i in prange(n):
        row = x[i]
        mu = centroids[labels[i]]
        base = np.uint64(i) * np.uint64(pairs)
        for p in range(f // 2):
            z0, z1 = _box_muller(_draw(key, base + np.uint64(p)))
            row[2 * p] = mu[2 * p] + scale * z0
            row[2 * p + 1] = mu[2 * p + 1] + scale * z1
        if f & 1:
            z0, _ = _box_muller(_draw(key, base + np.uint64(f // 2)))
            row[f - 1] = mu[f - 1] + scale * z0


@njit(parallel=True, cache=True)
def _uniform_kernel(key, x):
    """i.i.d. uniform on ``[-sqrt(3), sqrt(3))``: zero mean, unit variance."""
    n, f = x.shape
    pairs = (f + 1) // 2
    step = np.float32(2.0 * np.sqrt(3.0) / 16777216.0)
    low = np.float32(-np.sqrt(3.0))
    for i in prange(n):
        row = x[i]
        base = np.uint64(i) * np.uint64(pairs)
        # Branch-free pairs so the loop vectorises; 24 bits per float32 value.
        for p in range(f // 2):
            bits = _draw(key, base + np.uint64(p))
            row[2 * p] = low + step * np.float32(bits >> _U40)
            row[2 * p + 1] = low + step * np.float32(bits & _LO24)
        if f & 1:
            row[f - 1] = low + step * np.float32(_draw(key, base + np.uint64(f // 2)) >> _U40)


@njit(parallel=True, cache=True)
def _labels_kernel(key, num_classes, y):
    for i in prange(y.shape[0]):
        y[i] = _below(_draw(key, i) >> _U32, num_classes)


@njit(parallel=True, cache=True)
def _sbm_kernel(key, t_intra, labels, class_ptr, members, src, dst):
    n = labels.shape[0]
    num_classes = class_ptr.shape[0] - 1
    for e in prange(src.shape[0]):
        h1 = _draw(key, np.uint64(2 * e))
        h2 = _draw(key, np.uint64(2 * e + 1))
        u = _below(h1 >> _U32, n)
        c = labels[u]
        if num_classes > 1 and (h1 & _LO32) >= t_intra:
            k = _below(h2 >> _U32, num_classes - 1)
            c = k if k < c else k + 1
        size = class_ptr[c + 1] - class_ptr[c]
        src[e] = u
        # An empty class yields a self-loop, which the caller drops.
        dst[e] = u if size == 0 else members[class_ptr[c] + _below(h2 & _LO32, size)]


@njit(parallel=True, cache=True)
def _sort_segments(indptr, indices, dedup, keep):
    for v in prange(indptr.shape[0] - 1):
        s, t = indptr[v], indptr[v + 1]
        seg = indices[s:t]
        seg.sort()
        k = t - s
        if dedup and k > 1:
            k = 1
            for q in range(1, t - s):
                if seg[q] != seg[k - 1]:
                    seg[k] = seg[q]
                    k += 1
        keep[v] = k


@njit(parallel=True, cache=True)
def _compact(indptr, indices, new_indptr, out):
    for v in prange(indptr.shape[0] - 1):
        s, o = indptr[v], new_indptr[v]
        for q in range(new_indptr[v + 1] - o):
            out[o + q] = indices[s + q]


def _csc(src: np.ndarray, dst: np.ndarray, n: int, dedup: bool) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC with sources sorted within each destination, optionally de-duplicated.

    A counting sort by destination followed by a parallel per-segment sort is
    O(E log d) and several times faster than one global sort of 64-bit keys.
    """
    counts = np.bincount(dst, minlength=n)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.empty(src.shape[0], dtype=index_dtype(n))
    bucket_fill(src, dst, indptr, indices)
    keep = np.empty(n, dtype=np.int64)
    _sort_segments(indptr, indices, dedup, keep)
    if not dedup:
        return indptr, indices
    new_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(keep, out=new_indptr[1:])
    out = np.empty(int(new_indptr[-1]), dtype=indices.dtype)
    _compact(indptr, indices, new_indptr, out)
    return new_indptr, out


def _normal(seed: int, scale: float, centroids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    x = np.empty((labels.shape[0], centroids.shape[1]), dtype=np.float32)
    _normal_kernel(_key(seed, _S_X), x, float(scale), np.ascontiguousarray(centroids, np.float64),
                   labels)
    return x


def _uniform(seed: int, n: int, f: int) -> np.ndarray:
    x = np.empty((n, f), dtype=np.float32)
    _uniform_kernel(_key(seed, _S_X), x)
    return x


def _labels(seed: int, n: int, num_classes: int) -> np.ndarray:
    y = np.empty(n, dtype=np.int64)
    _labels_kernel(_key(seed, _S_Y), num_classes, y)
    return y


def _masks(n: int, parts: list[np.ndarray]) -> list[np.ndarray]:
    masks = [np.zeros(n, dtype=bool) for _ in parts]
    for m, ids in zip(masks, parts):
        m[ids] = True
    return masks


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ------------------------------------------------------------------ R-MAT
def rmat_edges(scale: int, edge_factor: int = 16, a: float = 0.57, b: float = 0.19,
               c: float = 0.19, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    r"""Directed R-MAT edges with the Graph500 parameters.

    Each of the ``edge_factor * 2**scale`` edges descends ``scale`` levels of
    the adjacency matrix, picking quadrant top-left / top-right / bottom-left /
    bottom-right with probability ``a`` / ``b`` / ``c`` / ``d = 1 - a - b - c``.
    Vertex ids are then relabelled by a seeded random permutation, as Graph500
    does, so the hubs are spread over the id range. Duplicate edges and
    self-loops are kept.

    Args:
        scale: ``log2`` of the vertex count.
        edge_factor: edges per vertex (default 16).
        a, b, c: quadrant probabilities (defaults 0.57, 0.19, 0.19).
        seed: random seed; equal seeds give byte-identical arrays.

    Returns:
        ``(src, dst)``, each of length ``edge_factor * 2**scale``, int32 when
        the ids fit, else int64.
    """
    _check(1 <= scale <= 40, f"rmat scale must be in 1..40, got {scale}")
    _check(edge_factor >= 1, f"rmat edge_factor must be >= 1, got {edge_factor}")
    _check(min(a, b, c) >= 0 and a + b + c <= 1, f"rmat needs a, b, c >= 0 with a+b+c <= 1, "
           f"got {a}, {b}, {c}")
    n = 1 << scale
    m = edge_factor * n
    dtype = index_dtype(n)
    perm = _rng(seed, _S_PERM).permutation(n).astype(dtype)
    src = np.empty(m, dtype=dtype)
    dst = np.empty(m, dtype=dtype)

    def thr(p: float) -> np.uint32:
        return np.uint32(min(round(p * 2**32), 2**32 - 1))

    _rmat_kernel(_key(seed, _S_RMAT), scale, thr(a), thr(a + b), thr(a + b + c), perm, src, dst)
    return src, dst


def rmat_graph(scale: int, edge_factor: int = 16, num_features: int = 128, num_classes: int = 16,
               seed: int = 0, undirected: bool = False, dedup: bool = True) -> Graph:
    r"""An R-MAT graph with random features, labels and a 60/20/20 split.

    Features are i.i.d. uniform on ``[-sqrt(3), sqrt(3))`` (zero mean, unit
    variance; uniform because it is far cheaper to draw than normal), labels
    uniform; both are independent of the structure. This is a systems
    benchmark, not a learnable task: see :func:`sbm_graph` for one.

    Args:
        scale: ``log2`` of the vertex count.
        edge_factor: generated edges per vertex, before de-duplication (default 16).
        num_features: feature columns (float32, default 128).
        num_classes: label range (default 16).
        seed: random seed; equal seeds give byte-identical graphs.
        undirected: also store the reverse of every edge (default False).
        dedup: drop repeated edges; self-loops are kept (default True).

    Returns:
        A :class:`Graph` with ``2**scale`` vertices named ``rmat-{scale}``.
    """
    _check(num_classes >= 1, f"num_classes must be >= 1, got {num_classes}")
    src, dst = rmat_edges(scale, edge_factor, seed=seed)
    n = 1 << scale
    if undirected:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    indptr, indices = _csc(src, dst, n, dedup)
    del src, dst
    return _with_data(indptr, indices, num_features, num_classes, seed, f"rmat-{scale}")


def rmat_sized_graph(num_nodes: int, num_edges: int, num_features: int = 128,
                     num_classes: int = 16, seed: int = 0, name: str | None = None) -> Graph:
    r"""An R-MAT graph with exactly ``num_nodes`` vertices and ``num_edges`` edges.

    Edges are drawn at the next power-of-two scale and those with an endpoint
    beyond ``num_nodes`` (after Graph500's random relabelling) are dropped: the
    graph is R-MAT induced on a random vertex subset, so it keeps R-MAT's skew.
    The first ``num_edges`` kept edges are used; repeated edges are kept (each
    is a message), which is what makes the edge count exact. Features, labels
    and split as :func:`rmat_graph`.

    Args:
        num_nodes: vertex count.
        num_edges: directed edge count.
        num_features, num_classes, seed: as :func:`rmat_graph`.
        name: the graph's name (default ``rmat-{num_nodes}-{num_edges}``).
    """
    _check(num_nodes >= 2 and num_edges >= 1, f"rmat_sized_graph needs num_nodes >= 2 and "
           f"num_edges >= 1, got {num_nodes}, {num_edges}")
    _check(num_classes >= 1, f"num_classes must be >= 1, got {num_classes}")
    scale = int(np.ceil(np.log2(num_nodes)))
    keep = (num_nodes / (1 << scale)) ** 2  # chance both endpoints are below num_nodes
    factor = int(np.ceil(num_edges / keep * 1.01 / (1 << scale))) + 1
    while True:
        src, dst = rmat_edges(scale, factor, seed=seed)
        kept = np.flatnonzero((src < num_nodes) & (dst < num_nodes))
        if kept.shape[0] >= num_edges:
            break
        factor = int(np.ceil(factor * 1.05)) + 1  # rare: fewer kept than expected
    kept = kept[:num_edges]
    src, dst = src[kept].astype(index_dtype(num_nodes)), dst[kept].astype(index_dtype(num_nodes))
    del kept
    indptr, indices = _csc(src, dst, num_nodes, dedup=False)
    del src, dst
    return _with_data(indptr, indices, num_features, num_classes, seed,
                      name or f"rmat-{num_nodes}-{num_edges}")


def _with_data(indptr: np.ndarray, indices: np.ndarray, num_features: int, num_classes: int,
               seed: int, name: str) -> Graph:
    """A graph on this structure with uniform features, labels and a 60/20/20 split."""
    n = indptr.shape[0] - 1
    order = _rng(seed, _S_SPLIT).permutation(n)
    n_train, n_val = int(0.6 * n), int(0.2 * n)
    train, val, test = _masks(n, [order[:n_train], order[n_train:n_train + n_val],
                                  order[n_train + n_val:]])
    return Graph(indptr=indptr, indices=indices, x=_uniform(seed, n, num_features),
                 y=_labels(seed, n, num_classes), train_mask=train, val_mask=val,
                 test_mask=test, name=name)


# ------------------------------------------------------------------ SBM
def sbm_graph(num_nodes: int, num_classes: int = 8, num_features: int = 64,
              avg_degree: float = 10, p_intra: float = 0.8, feature_noise: float = 1.0,
              seed: int = 0, train_per_class: int = 20, val: int = 500,
              test: int = 1000) -> Graph:
    r"""A learnable node-classification task drawn from a stochastic block model.

    Every vertex gets a uniform class. ``num_nodes * avg_degree / 2`` edges
    are drawn: a uniform source ``u``, then a target inside ``u``'s class
    with probability ``p_intra``, else in a uniform other class. Edges are
    stored in both directions, without self-loops or duplicates, so the mean
    in-degree is just under ``avg_degree``. Features are

    .. math:: x_i = \mu_{y_i} + \sigma \varepsilon_i,\quad
              \varepsilon_i \sim \mathcal{N}(0, I),

    with one random unit-norm centroid :math:`\mu_c` per class and
    :math:`\sigma` = ``feature_noise``. With the default noise one vertex's
    features barely identify its class, while the mean over its (mostly
    same-class) neighbours does, so a 2-layer GCN clearly beats an MLP.

    The split is planetoid-style: ``train_per_class`` random vertices of each
    class, then ``val`` and ``test`` random vertices of the rest, each count
    clipped to what is left on small graphs.

    Args:
        num_nodes: vertex count.
        num_classes: number of classes / blocks (default 8).
        num_features: feature columns (float32, default 64).
        avg_degree: target mean degree (default 10).
        p_intra: probability an edge stays within its class (default 0.8).
        feature_noise: standard deviation of the feature noise (default 1.0).
        seed: random seed; equal seeds give byte-identical graphs.
        train_per_class: training vertices per class (default 20).
        val: validation vertices (default 500).
        test: test vertices (default 1000).

    Returns:
        An undirected :class:`Graph` named ``sbm-{num_nodes}``.
    """
    n = int(num_nodes)
    _check(1 <= n < 2**32, f"sbm num_nodes must be in 1..2**32-1, got {n}")
    _check(num_classes >= 1, f"sbm num_classes must be >= 1, got {num_classes}")
    _check(0.0 <= p_intra <= 1.0, f"sbm p_intra must be in [0, 1], got {p_intra}")
    _check(avg_degree >= 0, f"sbm avg_degree must be >= 0, got {avg_degree}")
    y = _labels(seed, n, num_classes)
    members = np.argsort(y, kind="stable").astype(np.int64)
    class_ptr = np.zeros(num_classes + 1, dtype=np.int64)
    np.cumsum(np.bincount(y, minlength=num_classes), out=class_ptr[1:])

    m = int(n * avg_degree) // 2
    dtype = index_dtype(n)
    src = np.empty(m, dtype=dtype)
    dst = np.empty(m, dtype=dtype)
    t_intra = np.uint64(min(round(p_intra * 2**32), 2**32))
    _sbm_kernel(_key(seed, _S_SBM), t_intra, y, class_ptr, members, src, dst)
    loop = src == dst
    if loop.any():
        src, dst = src[~loop], dst[~loop]
    indptr, indices = _csc(np.concatenate([src, dst]), np.concatenate([dst, src]), n, True)
    del src, dst

    rng = _rng(seed, _S_CENTROID)
    centroids = rng.standard_normal((num_classes, num_features))
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    x = _normal(seed, feature_noise, centroids, y)

    order = _rng(seed, _S_SPLIT).permutation(n)
    y_order = y[order]
    train_ids = np.concatenate([order[y_order == k][:train_per_class] for k in range(num_classes)])
    taken = np.zeros(n, dtype=bool)
    taken[train_ids] = True
    rest = order[~taken[order]]
    n_val = min(val, rest.shape[0])
    n_test = min(test, rest.shape[0] - n_val)
    train, val_m, test_m = _masks(n, [train_ids, rest[:n_val], rest[n_val:n_val + n_test]])
    return Graph(indptr=indptr, indices=indices, x=x, y=y, train_mask=train, val_mask=val_m,
                 test_mask=test_m, name=f"sbm-{n}")
