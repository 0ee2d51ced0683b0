r"""Load a :class:`~hongtu.graph.Graph` from a file, with validation at the boundary.

:func:`load_graph` accepts four kinds of ``path``:

- ``builtin:NAME`` — a built-in dataset (:func:`hongtu.graph.datasets.load_builtin`);
- ``*.npz`` — arrays ``edge_index`` (``2 × E`` int, row 0 source, row 1
  destination), optional ``x`` (``N × F`` numeric), ``y`` (``N`` int),
  ``train_mask`` / ``val_mask`` / ``test_mask`` (``N`` bool). Read with
  ``allow_pickle=False``: a user's file is never unpickled.
- ``*.pt`` / ``*.pth`` — a PyTorch Geometric ``Data`` object, or a plain
  dict of tensors with those names, saved with ``torch.save``. Read with
  ``torch.load(weights_only=True)`` and an explicit allow-list of the PyG
  classes a ``Data`` pickles to: any other Python object is refused, never
  unpickled. Needs ``torch_geometric`` only for a ``Data`` object.
- a directory of ``.npy`` files with those names (``edge_index.npy``, ...),
  memory-mapped, so graphs larger than RAM load; a float32 ``x`` stays a
  ``np.memmap`` unless a transform has to rewrite it;
- any other file — an edge list (SNAP style): one ``src dst`` pair of
  integers per line, whitespace separated, ``#`` starting a comment; further
  columns (weights, timestamps) are ignored.

Ids are kept as given (not compacted): ``N = x.shape[0]`` when ``x`` is
present, else ``max id + 1`` (refused when that would make almost every
vertex isolated, ``N > 2**20 + 64 E``: renumber such ids first). Without
``x`` (always for an edge list), features are drawn from a seeded standard
normal, ``num_features`` wide; the values depend only on ``seed`` and the
shape, not on the number of threads.
Labels are optional: a graph without ``y`` gets ``y = None`` and no masks;
a graph with any of ``y`` / masks must have ``y`` and ``train_mask``, while
``val_mask`` / ``test_mask`` may be missing (``None``).

Every problem raises :class:`~hongtu.errors.UserError` with one line naming
the file, what is wrong and how to fix it. Nothing is ever written.
"""

from __future__ import annotations

import os
import struct
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hongtu.errors import UserError
from hongtu.graph import transforms
from hongtu.graph.graph import Graph, csc_from_edges, index_dtype

__all__ = ["load_graph"]

_KEYS = ("edge_index", "x", "y", "train_mask", "val_mask", "test_mask")
_MASKS = ("train_mask", "val_mask", "test_mask")
# Everything a corrupt, truncated or hostile npy/npz file can raise while decoding.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError, KeyError,
                struct.error, NotImplementedError, RuntimeError, OverflowError, TypeError,
                MemoryError)
# Without x, N comes from the largest id; refuse ids so sparse that N would be
# mostly isolated vertices (a sign the ids need compacting, and a memory trap).
_MAX_ISOLATED = 1 << 20
_SLAB_ELEMENTS = 1 << 24


def load_graph(path: str, *, undirected: bool = True, self_loops: bool = True,
               normalize_features: bool = False, num_features: int = 64,
               seed: int = 0) -> Graph:
    r"""Load, validate and prepare a graph.

    Args:
        path: ``builtin:NAME``, an ``.npz`` file, a directory of ``.npy``
            files, or an edge-list text file (see the module docstring).
        undirected: add reverse edges and drop duplicate edges
            (:func:`~hongtu.graph.transforms.to_undirected`). Default ``True``.
        self_loops: give every vertex exactly one self-loop
            (:func:`~hongtu.graph.transforms.add_self_loops`). ``False``
            leaves existing self-loops alone. Default ``True``.
        normalize_features: row-normalise ``x`` to sum 1
            (:func:`~hongtu.graph.transforms.normalize_features`); makes an
            in-memory copy of ``x``. Default ``False``.
        num_features: width of the random features generated when the file
            has no ``x``. Default 64.
        seed: seed of those random features. Default 0.

    Returns:
        A validated :class:`Graph` named after the file stem (or ``NAME``),
        with int32 ``indices`` when ids fit and float32 ``x``.

    Raises:
        UserError: the file is missing, unreadable or malformed.

    Example::

        >>> g = load_graph("data/cora.npz", self_loops=False)
        >>> g.num_nodes, g.num_edges
        (2708, 10556)
    """
    if num_features < 1:
        raise UserError(f"num_features={num_features}: generated features need at least "
                        "1 dimension; set num_features to 1 or more")
    if seed < 0:
        raise UserError(f"seed={seed}: the feature seed must be 0 or more")
    if path.startswith("builtin:"):
        from hongtu.graph.datasets import load_builtin

        graph = load_builtin(path[len("builtin:"):])
    else:
        graph = _load_file(Path(path), num_features, seed)
    if undirected:
        graph = transforms.to_undirected(graph)
    if self_loops:
        graph = transforms.add_self_loops(graph)
    if normalize_features:
        graph = transforms.normalize_features(graph)
    return graph


# ------------------------------------------------------------------ readers
def _load_file(p: Path, num_features: int, seed: int) -> Graph:
    where = str(p)
    try:
        if not p.exists():
            raise UserError(f"graph file {where}: not found; check the path, or use "
                            "builtin:NAME for a built-in dataset")
        if not p.is_dir():
            with p.open("rb"):  # an unreadable file fails here, with a clear reason
                pass
        if p.is_dir():
            arrays = _read_npy_dir(p, where)
        elif p.suffix.lower() == ".npz":
            arrays = _read_npz(p, where)
        elif p.suffix.lower() in (".pt", ".pth"):
            from hongtu.graph.torch_io import read_torch

            arrays = read_torch(p, where)
        elif p.suffix.lower() == ".npy":
            raise UserError(f"graph file {where}: a single .npy array is not a graph; put "
                            f"{', '.join(k + '.npy' for k in _KEYS)} in a directory and pass "
                            "the directory, or save them together with np.savez")
        else:
            arrays = _read_edge_list(p, where)
    except OSError as exc:
        raise UserError(f"graph file {where}: cannot be read ({_short(exc)}); check that it "
                        "exists and its permissions allow reading") from exc
    declared = arrays.pop("num_nodes", None)
    graph = _assemble(where, arrays, num_features, seed)
    if declared is not None and declared != graph.num_nodes:
        raise UserError(f"graph file {where}: num_nodes is {declared} but the arrays give "
                        f"N={graph.num_nodes} (rows of 'x', or max id + 1); fix num_nodes or "
                        "add an 'x' array with one row per vertex")
    graph.validate(where)
    graph.name = p.stem
    return graph


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _read_npz(p: Path, where: str) -> dict[str, np.ndarray]:
    hint = "re-create it with np.savez(path, edge_index=..., x=..., ...)"
    try:
        data = np.load(p, allow_pickle=False)
    except _READ_ERRORS as exc:
        raise UserError(f"graph file {where}: not a valid .npz archive ({_short(exc)}); "
                        f"{hint}") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UserError(f"graph file {where}: holds a single array, not an .npz archive of "
                        f"named arrays; {hint}")
    with data:
        present = list(data.files)
        _require_edge_index(where, present, "'edge_index'", "arrays")
        arrays = {}
        for key in _KEYS:
            if key not in present:
                continue
            try:
                arrays[key] = data[key]
            except _READ_ERRORS as exc:
                raise UserError(f"graph file {where}: array '{key}' is corrupt or truncated "
                                f"({_short(exc)}); {hint}") from exc
    return arrays


def _read_npy_dir(p: Path, where: str) -> dict[str, np.ndarray]:
    present = sorted(f.name for f in p.iterdir() if f.suffix == ".npy")
    _require_edge_index(where, present, "edge_index.npy", ".npy files")
    present = [name[:-4] for name in present]
    arrays = {}
    for key in _KEYS:
        f = p / f"{key}.npy"
        if key not in present:
            continue
        try:
            arrays[key] = np.load(f, mmap_mode="r", allow_pickle=False)
        except _READ_ERRORS as exc:
            raise UserError(f"graph file {f}: not a valid .npy array ({_short(exc)}); "
                            f"re-create it with np.save('{f.name}', array)") from exc
        if not isinstance(arrays[key], np.ndarray):
            arrays[key].close()
            raise UserError(f"graph file {f}: not a single .npy array; save it with np.save")
    return arrays


# The classes a torch_geometric ``Data`` object pickles to (2.4 and later; older
# releases use a subset). With torch's own tensor types, nothing else is unpickled.
def _require_edge_index(where: str, present: list[str], name: str, what: str) -> None:
    if name.strip("'") not in present:
        found = ", ".join(present) or "none"
        raise UserError(f"graph file {where}: missing required array {name} ({what} present: "
                        f"{found}); add the 2 x E integer edge array as {name}")


def _read_edge_list(p: Path, where: str) -> dict[str, np.ndarray]:
    hint = "expected one 'src dst' pair of integer vertex ids per line, '#' for comments"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contains no data" is checked below
            # One comment character keeps numpy on its C parser (a tuple goes through Python).
            edges = np.loadtxt(p, dtype=np.int64, comments="#", usecols=(0, 1),
                               ndmin=2, encoding="latin-1")
    except (ValueError, OverflowError, IndexError) as exc:
        raise UserError(f"graph file {where}: not a valid edge list "
                        f"({_first_bad_line(p) or _short(exc)}); {hint}") from exc
    if edges.shape[0] == 0:
        raise UserError(f"graph file {where}: the edge list has no edges; {hint}")
    return {"edge_index": edges.T}


def _first_bad_line(p: Path) -> str | None:
    """Describe the first line that is not two integer ids (slow; error path only).

    numpy's own message counts rows from 0, sometimes skipping comment lines,
    so the line number a user can find in an editor is recomputed here.
    """
    with p.open(encoding="latin-1") as f:
        for number, line in enumerate(f, start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            try:
                ok = len(fields) >= 2 and all(-(2**63) <= int(t) < 2**63 for t in fields[:2])
            except ValueError:
                ok = False
            if not ok:
                text = " ".join(line.split())
                text = text if len(text) <= 60 else text[:57] + "..."
                return f"line {number} is {text!r}"
    return None


# --------------------------------------------------------------- validation
def _assemble(where: str, arrays: dict[str, np.ndarray], num_features: int,
              seed: int) -> Graph:
    ei = arrays["edge_index"]
    if ei.ndim != 2 or ei.shape[0] != 2:
        raise UserError(f"graph file {where}: 'edge_index' has shape {ei.shape}, expected "
                        "(2, E) with row 0 sources and row 1 destinations; transpose an "
                        "(E, 2) array")
    if not np.issubdtype(ei.dtype, np.integer):
        raise UserError(f"graph file {where}: 'edge_index' has dtype {ei.dtype}, expected an "
                        "integer type; store vertex ids as int32 or int64")
    x = arrays.get("x")
    if x is not None:
        x = _check_x_shape(where, x)
    n = _check_ids(where, ei, None if x is None else x.shape[0])
    labels = _check_labels(where, arrays, n)
    if x is None:
        x = _random_features(n, num_features, seed)
    else:
        x = _checked_features(where, x)
    idt = index_dtype(n)
    indptr, indices = csc_from_edges(np.asarray(ei[0]).astype(idt, copy=False),
                                              np.asarray(ei[1]).astype(idt, copy=False), n)
    return Graph(indptr=indptr, indices=indices, x=x, **labels)


def _random_features(n: int, f: int, seed: int) -> np.ndarray:
    """Standard-normal float32 ``(n, f)``, filled slab by slab on a thread pool.

    Each slab has its own generator spawned from ``seed`` (numpy releases the
    GIL while filling), so the result is reproducible whatever the thread count.
    """
    x = np.empty((n, f), dtype=np.float32)
    rows = max(1, _SLAB_ELEMENTS // f)
    starts = range(0, n, rows)
    seqs = np.random.SeedSequence(seed).spawn(len(starts))

    def fill(i: int) -> None:
        block = x[starts[i]:starts[i] + rows]
        np.random.default_rng(seqs[i]).standard_normal(out=block, dtype=np.float32)

    with ThreadPoolExecutor(max_workers=min(len(starts), os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(len(starts))))
    return x


def _check_x_shape(where: str, x: np.ndarray) -> np.ndarray:
    if x.ndim != 2:
        raise UserError(f"graph file {where}: 'x' has shape {x.shape}, expected (N, F) with one "
                        "row of features per vertex")
    kind = x.dtype.kind
    if kind not in "biuf":
        raise UserError(f"graph file {where}: 'x' has dtype {x.dtype}, expected numbers; store "
                        "features as float32")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise UserError(f"graph file {where}: 'x' has shape {x.shape}; it needs at least one "
                        "row (vertex) and one column (feature)")
    return x


def _check_ids(where: str, ei: np.ndarray, rows: int | None) -> int:
    """Check every id is in range; return the vertex count N."""
    e = ei.shape[1]
    if e == 0:
        if rows is None:
            raise UserError(f"graph file {where}: no edges and no 'x', so the number of "
                            "vertices is unknown; add edges or an 'x' array")
        return rows
    lo, hi = int(ei.min()), int(ei.max())
    n = hi + 1 if rows is None else rows
    if lo < 0 or hi >= n:
        src, dst = np.asarray(ei[0]), np.asarray(ei[1])
        bad_src = (src < 0) | (src >= n)
        pos = int(np.flatnonzero(bad_src | (dst < 0) | (dst >= n))[0])
        role, val = ("source", src[pos]) if bad_src[pos] else ("destination", dst[pos])
        origin = "the rows of 'x'" if rows is not None else "max id + 1"
        raise UserError(f"graph file {where}: edge {pos} has {role} id {int(val)}, outside "
                        f"0..{n - 1} (N={n} from {origin}); vertex ids must be in 0..N-1")
    if rows is None and n > _MAX_ISOLATED + 64 * e:
        raise UserError(f"graph file {where}: largest vertex id {hi} implies N={n} vertices "
                        f"for only {e} edges, almost all isolated; renumber the ids to "
                        "0..N-1 or add an 'x' array with one row per vertex")
    return n


def _check_labels(where: str, arrays: dict[str, np.ndarray], n: int) -> dict:
    present = [k for k in ("y",) + _MASKS if k in arrays]
    if not present:
        return {}
    for key in ("y", "train_mask"):
        if key not in arrays:
            raise UserError(f"graph file {where}: has {', '.join(present)} but no '{key}'; a "
                            "labelled graph needs both 'y' and 'train_mask'")
    y = arrays["y"]
    _check_vector(where, "y", y, n)
    if not np.issubdtype(y.dtype, np.integer):
        raise UserError(f"graph file {where}: 'y' has dtype {y.dtype}, expected integer class "
                        "ids 0..C-1; store labels as int64")
    if y.size and int(y.min()) < 0:
        v = int(np.flatnonzero(np.asarray(y) < 0)[0])
        raise UserError(f"graph file {where}: 'y' of vertex {v} is {int(y[v])}; labels must be "
                        "class ids 0..C-1 (mask unlabelled vertices out instead)")
    y = np.array(y, dtype=np.int64)  # an in-memory copy, not a view of the file
    out = {"y": y}
    for key in _MASKS:
        if key in arrays:
            out[key] = _checked_mask(where, key, arrays[key], n)
    for i, a in enumerate(_MASKS):
        for b in _MASKS[i + 1:]:
            if a in out and b in out:
                both = out[a] & out[b]
                if both.any():
                    v = int(np.flatnonzero(both)[0])
                    raise UserError(f"graph file {where}: vertex {v} is in both '{a}' and "
                                    f"'{b}'; the splits must not overlap")
    if not out["train_mask"].any():
        raise UserError(f"graph file {where}: 'train_mask' selects no vertex; mark at least "
                        "one training vertex")
    return out


def _check_vector(where: str, key: str, a: np.ndarray, n: int) -> None:
    if a.shape != (n,):
        raise UserError(f"graph file {where}: '{key}' has shape {a.shape}, expected ({n},): one "
                        "entry per vertex")


def _checked_mask(where: str, key: str, m: np.ndarray, n: int) -> np.ndarray:
    _check_vector(where, key, m, n)
    if m.dtype.kind == "b":
        return np.array(m)
    if m.dtype.kind in "iuf":
        m = np.asarray(m)
        with np.errstate(invalid="ignore"):
            ok = bool(((m == 0) | (m == 1)).all())
        if ok:
            return m.astype(bool)
    raise UserError(f"graph file {where}: '{key}' (dtype {m.dtype}) is not a boolean mask; "
                    "store it as bool (or 0/1 integers)")


def _checked_features(where: str, x: np.ndarray) -> np.ndarray:
    """Check ``x`` is finite, in slabs; cast to C-contiguous float32 if needed."""
    keep = x.dtype == np.float32 and x.flags.c_contiguous
    out = x if keep else np.empty(x.shape, dtype=np.float32)
    step = max(1, _SLAB_ELEMENTS // max(x.shape[1], 1))
    for s in range(0, x.shape[0], step):
        with np.errstate(over="ignore", invalid="ignore"):
            block = np.asarray(x[s:s + step], dtype=np.float32)
        if not keep:
            out[s:s + step] = block
        if x.dtype.kind == "f":
            finite = np.isfinite(block).all(axis=1)
            if not finite.all():
                v = s + int(np.flatnonzero(~finite)[0])
                raise UserError(f"graph file {where}: 'x' row {v} contains NaN or Inf (or a "
                                "value too large for float32); clean the features first")
    return out
