r"""Built-in generated datasets, used from a config as ``data.path: builtin:NAME``.

Each entry is a seeded call of a generator in :mod:`hongtu.graph.generators`,
so a name always means the same bytes. The ``sbm-*`` graphs are learnable
node-classification tasks (a 2-layer GCN beats an MLP on them); the
``rmat-*`` graphs are skewed Graph500-style graphs for measuring systems
cost, with random features and labels.

Example::

    >>> g = load_builtin("sbm-small")
    >>> g.name, g.num_classes
    ('sbm-small', 7)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from hongtu.errors import UserError
from hongtu.graph.generators import rmat_graph, sbm_graph
from hongtu.graph.graph import Graph

__all__ = ["BUILTIN_DATASETS", "BuiltinDataset", "load_builtin"]

_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinDataset:
    """One registry entry.

    Args:
        description: one line for listings and error messages.
        build: returns the graph; called on every :func:`load_builtin`.
    """

    description: str
    build: Callable[[], Graph]


def _sbm(num_nodes: int, **kw) -> Callable[[], Graph]:
    return lambda: sbm_graph(num_nodes, seed=0, **kw)


def _rmat(scale: int) -> Callable[[], Graph]:
    return lambda: rmat_graph(scale, edge_factor=16, num_features=128, num_classes=16, seed=0)


BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    "sbm-small": BuiltinDataset(
        "SBM, 3,000 vertices, ~24K edges, 100 features, 7 classes, 140/500/1000 split "
        "(Cora-sized; trains in seconds on a CPU)",
        _sbm(3000, num_classes=7, num_features=100, avg_degree=8,
             train_per_class=20, val=500, test=1000)),
    "sbm-medium": BuiltinDataset(
        "SBM, 100,000 vertices, ~1.6M edges, 128 features, 16 classes, "
        "3200/5000/10000 split",
        _sbm(100_000, num_classes=16, num_features=128, avg_degree=16,
             train_per_class=200, val=5000, test=10_000)),
    "sbm-large": BuiltinDataset(
        "SBM, 2,000,000 vertices, ~32M edges, 128 features, 32 classes, "
        "32000/20000/100000 split (~1 GiB of features)",
        _sbm(2_000_000, num_classes=32, num_features=128, avg_degree=16,
             train_per_class=1000, val=20_000, test=100_000)),
    "rmat-16": BuiltinDataset(
        "R-MAT scale 16: 65,536 vertices, ~0.96M directed edges, 128 random features, 16 classes",
        _rmat(16)),
    "rmat-20": BuiltinDataset(
        "R-MAT scale 20: 1,048,576 vertices, ~16M directed edges, 128 random features, "
        "16 classes (~0.5 GiB of features)",
        _rmat(20)),
    "rmat-22": BuiltinDataset(
        "R-MAT scale 22: 4,194,304 vertices, ~65M directed edges, 128 random features, "
        "16 classes (~2 GiB of features)",
        _rmat(22)),
}


def load_builtin(name: str) -> Graph:
    """Generate the built-in dataset ``name`` (a leading ``builtin:`` is accepted).

    Args:
        name: a key of :data:`BUILTIN_DATASETS`, e.g. ``"sbm-small"``.

    Returns:
        The generated :class:`Graph`, with ``Graph.name`` set to ``name``.

    Raises:
        UserError: ``name`` is not a built-in dataset.
    """
    key = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    entry = BUILTIN_DATASETS.get(key)
    if entry is None:
        raise UserError(f"unknown built-in dataset {key!r}; choose one of: "
                        f"{', '.join(BUILTIN_DATASETS)}")
    return replace(entry.build(), name=key)
