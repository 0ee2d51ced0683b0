"""Tests of :func:`hongtu.graph.io.load_graph`: formats, round trips and every bad input."""

from __future__ import annotations

import io
import pathlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hongtu.errors import UserError
from hongtu.graph import Graph
from hongtu.graph.io import load_graph

CORA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "cora.npz"


def _arrays(n: int = 6, **override) -> dict:
    """A small valid labelled graph: a directed path plus features and splits."""
    arrays = {
        "edge_index": np.array([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]),
        "x": np.arange(n * 3, dtype=np.float32).reshape(n, 3),
        "y": np.arange(n) % 2,
        "train_mask": np.arange(n) < 2,
        "val_mask": (np.arange(n) >= 2) & (np.arange(n) < 4),
        "test_mask": np.arange(n) >= 4,
    }
    arrays.update(override)
    return {k: v for k, v in arrays.items() if v is not None}


def _npz(tmp_path: Path, name: str = "g.npz", **override) -> Path:
    path = tmp_path / name
    np.savez(path, **_arrays(**override))
    return path


def _npy_dir(tmp_path: Path, name: str = "gdir", **override) -> Path:
    path = tmp_path / name
    path.mkdir()
    for key, value in _arrays(**override).items():
        np.save(path / f"{key}.npy", value)
    return path


def _fails(path, phrase: str, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_graph(str(path), **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and phrase in msg, msg
    if not str(path).startswith("builtin:"):
        assert str(path) in msg or Path(path).name in msg, msg
    return msg


# ----------------------------------------------------------------- round trips
def test_npz_round_trip(tmp_path: Path) -> None:
    path = _npz(tmp_path)
    g = load_graph(str(path), undirected=False, self_loops=False)
    a = _arrays()
    assert g.name == "g" and g.num_nodes == 6 and g.num_edges == 5
    assert g.indices.dtype == np.int32 and g.x.dtype == np.float32
    assert sorted(zip(*g.edge_index().tolist())) == sorted(zip(*a["edge_index"].tolist()))
    for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
        assert np.array_equal(getattr(g, key), a[key]), key
    g.validate()


def test_npz_transforms_applied(tmp_path: Path) -> None:
    path = _npz(tmp_path)
    assert load_graph(str(path), self_loops=False).num_edges == 10
    g = load_graph(str(path))
    assert g.num_edges == 10 + 6
    assert load_graph(str(path), undirected=False).num_edges == 5 + 6
    x = load_graph(str(path), normalize_features=True).x
    np.testing.assert_allclose(x.sum(1)[1:], 1.0, rtol=1e-6)
    assert x[0].sum() == 1.0  # row 0 is [0, 1, 2]


def test_npy_dir_round_trip_is_memory_mapped(tmp_path: Path) -> None:
    path = _npy_dir(tmp_path)
    g = load_graph(str(path), undirected=False, self_loops=False)
    assert isinstance(g.x, np.memmap) and g.name == "gdir"
    assert np.array_equal(g.x, _arrays()["x"]) and g.train_mask.sum() == 2
    assert isinstance(load_graph(str(path)).x, np.memmap)  # structure transforms share x
    assert not isinstance(load_graph(str(path), normalize_features=True).x, np.memmap)


def test_npy_dir_casts_float64_features(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((6, 4))
    g = load_graph(str(_npy_dir(tmp_path, x=x)))
    assert g.x.dtype == np.float32 and np.allclose(g.x, x)
    g = load_graph(str(_npz(tmp_path, x=np.ones((6, 2), dtype=np.int16))))
    assert g.x.dtype == np.float32


def test_unlabelled_npz_and_int_masks(tmp_path: Path) -> None:
    g = load_graph(str(_npz(tmp_path, y=None, train_mask=None, val_mask=None, test_mask=None)))
    assert g.y is None and g.train_mask is None and g.num_features == 3
    g = load_graph(str(_npz(tmp_path, "m.npz", train_mask=np.array([1, 1, 0, 0, 0, 0]),
                            val_mask=None, test_mask=None)))
    assert g.train_mask.dtype == bool and g.val_mask is None


def test_edge_list_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "web.txt"
    path.write_text("# Directed graph\n# FromNodeId\tToNodeId\n0\t1\n1\t2\n\n7 2  # tail\n"
                    "2 0 3.5\n")
    g = load_graph(str(path), undirected=False, self_loops=False, num_features=5, seed=3)
    assert g.name == "web" and g.num_nodes == 8 and g.num_edges == 4
    assert sorted(zip(*g.edge_index().tolist())) == [(0, 1), (1, 2), (2, 0), (7, 2)]
    assert g.x.shape == (8, 5) and g.x.dtype == np.float32 and g.y is None
    assert g.train_mask is None and g.val_mask is None and g.test_mask is None
    same = load_graph(str(path), num_features=5, seed=3)
    assert np.array_equal(same.x, g.x)
    assert not np.array_equal(load_graph(str(path), num_features=5, seed=4).x, g.x)


def test_builtin_dispatches_to_datasets(monkeypatch) -> None:
    fake = types.ModuleType("hongtu.graph.datasets")
    seen = []

    def load_builtin(name: str) -> Graph:
        seen.append(name)
        return Graph.from_edge_index(np.array([[0], [1]]), 2, name=name)

    fake.load_builtin = load_builtin
    monkeypatch.setitem(sys.modules, "hongtu.graph.datasets", fake)
    g = load_graph("builtin:tiny")
    assert seen == ["tiny"] and g.name == "tiny" and g.num_edges == 2 + 2


@pytest.mark.parametrize("make", ["npz", "dir", "txt"])
def test_load_graph_writes_nothing(tmp_path: Path, make: str) -> None:
    if make == "npz":
        path = _npz(tmp_path)
    elif make == "dir":
        path = _npy_dir(tmp_path)
    else:
        path = tmp_path / "e.el"
        path.write_text("0 1\n1 2\n")

    def listing():
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in tmp_path.rglob("*"))

    before = listing()
    load_graph(str(path), normalize_features=True)
    assert listing() == before


def test_cora() -> None:
    if not CORA.exists():
        pytest.skip(f"real-data test needs {CORA} (the shared Planetoid Cora export)")
    g = load_graph(str(CORA), self_loops=False)
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (2708, 10556, 1433, 7)
    assert [int(m.sum()) for m in (g.train_mask, g.val_mask, g.test_mask)] == [140, 500, 1000]
    assert g.name == "cora"
    assert load_graph(str(CORA)).num_edges == 10556 + 2708


# ------------------------------------------------------------ file-level errors
def test_missing_file(tmp_path: Path) -> None:
    _fails(tmp_path / "nope.npz", "not found")


def test_unreadable_file(tmp_path: Path, monkeypatch) -> None:
    path = _npz(tmp_path)
    real_open = pathlib.Path.open

    def deny(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", deny)
    _fails(path, "cannot be read")


def test_truncated_npz(tmp_path: Path) -> None:
    data = _npz(tmp_path).read_bytes()
    bad = tmp_path / "cut.npz"
    bad.write_bytes(data[: len(data) // 2])
    _fails(bad, "not a valid .npz")


def test_garbage_npz_and_npy_in_disguise(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip archive at all")
    _fails(junk, "not a valid .npz")
    single = tmp_path / "single.npz"
    with single.open("wb") as f:
        np.save(f, np.zeros((2, 3), dtype=np.int64))
    _fails(single, "single array")
    np.save(tmp_path / "x.npy", np.zeros(3))
    _fails(tmp_path / "x.npy", "single .npy array")


def test_pickled_arrays_are_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    obj = np.empty(1, dtype=object)
    obj[0] = _Exploit(str(marker))
    path = tmp_path / "evil.npz"
    np.savez(path, edge_index=obj)
    _fails(path, "corrupt")
    dirpath = _npy_dir(tmp_path)
    np.save(dirpath / "x.npy", obj, allow_pickle=True)
    _fails(dirpath, "not a valid .npy")
    assert not marker.exists()


class _Exploit:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_missing_edge_index_names_present_keys(tmp_path: Path) -> None:
    path = tmp_path / "noedges.npz"
    np.savez(path, x=np.zeros((2, 2)), labels=np.zeros(2))
    msg = _fails(path, "missing required array 'edge_index'")
    assert "x" in msg and "labels" in msg
    d = tmp_path / "emptydir"
    d.mkdir()
    _fails(d, "edge_index.npy")


# ---------------------------------------------------------- array-level errors
@pytest.mark.parametrize("edge_index, phrase", [
    (np.zeros((3, 4), dtype=np.int64), "expected (2, E)"),
    (np.zeros((5, 2), dtype=np.int64), "transpose"),
    (np.zeros(4, dtype=np.int64), "shape (4,)"),
    (np.array([[0.0, 1.0], [1.0, 2.0]]), "integer type"),
])
def test_bad_edge_index(tmp_path: Path, edge_index, phrase: str) -> None:
    _fails(_npz(tmp_path, edge_index=edge_index), phrase)


def test_negative_vertex_id(tmp_path: Path) -> None:
    ei = np.array([[0, 1, 2], [1, -4, 0]])
    msg = _fails(_npz(tmp_path, edge_index=ei), "edge 1 has destination id -4")
    assert "N=6" in msg


def test_vertex_id_beyond_x_rows(tmp_path: Path) -> None:
    ei = np.array([[0, 1, 9], [1, 2, 0]])
    _fails(_npz(tmp_path, edge_index=ei), "edge 2 has source id 9, outside 0..5 (N=6")


def test_sparse_ids_in_edge_list(tmp_path: Path) -> None:
    path = tmp_path / "sparse.tsv"
    path.write_text("0\t1\n5\t123456789012\n")
    _fails(path, "renumber the ids")


def test_bad_edge_list_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("# header\n0 1\n1 x\n")
    _fails(path, "line 3")
    lonely = tmp_path / "lonely.txt"
    lonely.write_text("0 1\n2\n")
    _fails(lonely, "line 2")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n")
    _fails(empty, "no edges")


@pytest.mark.parametrize("x, phrase", [
    (np.zeros(6, dtype=np.float32), "'x' has shape (6,)"),
    (np.array([["a"]] * 6), "expected numbers"),
    (np.zeros((6, 2), dtype=np.complex64), "expected numbers"),
    (np.zeros((0, 3), dtype=np.float32), "at least one row"),
])
def test_bad_x(tmp_path: Path, x, phrase: str) -> None:
    _fails(_npz(tmp_path, x=x), phrase)


def test_x_with_fewer_rows_than_ids(tmp_path: Path) -> None:
    x = np.zeros((4, 3), np.float32)
    _fails(_npz(tmp_path, x=x), "edge 3 has destination id 4, outside 0..3")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_non_finite_features_name_the_row(tmp_path: Path, bad: float) -> None:
    x = np.ones((6, 3))
    x[4, 1] = bad
    _fails(_npz(tmp_path, x=x), "'x' row 4 contains NaN or Inf")
    _fails(_npy_dir(tmp_path, x=x), "'x' row 4")


@pytest.mark.parametrize("y, phrase", [
    (np.zeros(5, dtype=np.int64), "'y' has shape (5,), expected (6,)"),
    (np.zeros(6, dtype=np.float32), "integer class ids"),
    (np.array([0, 1, 0, -1, 0, 1]), "'y' of vertex 3 is -1"),
])
def test_bad_labels(tmp_path: Path, y, phrase: str) -> None:
    _fails(_npz(tmp_path, y=y), phrase)


@pytest.mark.parametrize("mask, phrase", [
    (np.ones(7, dtype=bool), "'val_mask' has shape (7,)"),
    (np.full(6, 0.5), "not a boolean mask"),
    (np.array(["yes"] * 6), "not a boolean mask"),
])
def test_bad_masks(tmp_path: Path, mask, phrase: str) -> None:
    _fails(_npz(tmp_path, val_mask=mask), phrase)


def test_overlapping_masks_name_the_vertex(tmp_path: Path) -> None:
    test_mask = np.array([False, False, False, True, True, True])
    _fails(_npz(tmp_path, test_mask=test_mask), "vertex 3 is in both 'val_mask' and 'test_mask'")


def test_empty_train_mask(tmp_path: Path) -> None:
    _fails(_npz(tmp_path, train_mask=np.zeros(6, dtype=bool)), "'train_mask' selects no vertex")


def test_labels_without_train_mask(tmp_path: Path) -> None:
    _fails(_npz(tmp_path, train_mask=None), "no 'train_mask'")
    _fails(_npz(tmp_path, "noy.npz", y=None), "no 'y'")


def test_bad_num_features(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="num_features"):
        load_graph(str(_npz(tmp_path)), num_features=0)


# ------------------------------------------------------------- fuzzing
_dtypes = st.sampled_from([np.int32, np.int64, np.uint8, np.float32, np.float64, bool, "U2"])


@st.composite
def _array(draw, shape):
    dtype = draw(_dtypes)
    values = draw(st.lists(st.sampled_from([0, 1, 2, 5, -1, 1.5, np.nan, np.inf]),
                           min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    with np.errstate(all="ignore"):
        arr = np.array(values, dtype=np.float64).reshape(shape)
        if dtype == "U2":
            return arr.astype("U2")
        return arr.astype(dtype)


@st.composite
def _malformed(draw):
    """Arrays each drawn valid, malformed (shape, dtype, values) or absent, in some format."""
    n = draw(st.integers(1, 6))
    e = draw(st.integers(0, 8))
    ints = st.lists(st.integers(0, n - 1), min_size=2 * e, max_size=2 * e)
    floats = st.lists(st.floats(-3, 3) | st.sampled_from([np.nan, np.inf]), min_size=2 * n,
                      max_size=2 * n)
    bools = st.lists(st.booleans(), min_size=n, max_size=n)
    good = {
        "edge_index": lambda: np.array(draw(ints), dtype=np.int64).reshape(2, e),
        "x": lambda: np.array(draw(floats), dtype=np.float32).reshape(n, 2),
        "y": lambda: np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))),
        "train_mask": lambda: np.array(draw(bools), dtype=bool),
        "val_mask": lambda: np.array(draw(bools), dtype=bool),
        "test_mask": lambda: np.array(draw(bools), dtype=bool),
    }
    bad_shapes = {
        "edge_index": [(2, e), (e, 2), (3, e), (e,)],
        "x": [(n, 2), (n + 1, 2), (n - 1, 2), (n, 0), (n,)],
        "y": [(n,), (n - 1,), (n, 1)],
        "train_mask": [(n,), (n + 1,)], "val_mask": [(n,)], "test_mask": [(n,)],
    }
    arrays = {}
    for key, make in good.items():
        mode = draw(st.sampled_from(["good", "good", "bad", "absent"]))
        if mode == "good":
            arrays[key] = make()
        elif mode == "bad":
            arrays[key] = draw(_array(draw(st.sampled_from(bad_shapes[key]))))
    fmt = draw(st.sampled_from(["npz", "cut", "dir", "txt"]))
    cut = draw(st.floats(0.0, 1.0))
    text = draw(st.text(alphabet="0123456789 -#\t\n.x", max_size=40))
    return arrays, fmt, cut, text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_malformed())
def test_fuzz_only_user_errors(tmp_path_factory, case) -> None:
    arrays, fmt, cut, text = case
    base = tmp_path_factory.mktemp("fuzz")
    if fmt in ("npz", "cut"):
        path = base / "g.npz"
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        path.write_bytes(data[: int(len(data) * cut)] if fmt == "cut" else data)
    elif fmt == "dir":
        path = base / "g"
        path.mkdir()
        for key, value in arrays.items():
            np.save(path / f"{key}.npy", value)
    else:
        path = base / "g.txt"
        path.write_text(text)
    try:
        g = load_graph(str(path), num_features=3)
    except UserError as exc:
        assert "\n" not in str(exc)
    else:
        g.validate()
        assert g.x.dtype == np.float32 and np.isfinite(g.x).all()
