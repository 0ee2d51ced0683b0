"""The on-disk cache of part assignments: hits, atomic writes, corruption."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hongtu.partition import assign, assign_parts, partition_graph
from hongtu.partition.cache import cache_key, cache_path, save_assignment


@pytest.fixture
def graph(make_random_graph):
    return make_random_graph(3000, 24000, seed=11)


@pytest.fixture
def metis_calls(monkeypatch):
    """Counts real METIS runs."""
    calls = []
    real = assign.metis_parts

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(assign, "metis_parts", counting)
    return calls


def the_file(graph, tmp_path, method="metis", parts=4, seed=0):
    key = cache_key(graph.fingerprint(structure_only=True), method, parts, seed)
    return cache_path(tmp_path, key)


def test_second_call_loads_cache(graph, tmp_path, metis_calls, caplog):
    a, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True)
    assert not hit and metis_calls == [4]
    assert the_file(graph, tmp_path).exists()
    with caplog.at_level(logging.INFO, logger="hongtu.partition"):
        b, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True)
    assert hit and metis_calls == [4]
    assert np.array_equal(a, b) and b.dtype == np.int32
    assert "from cache" in caplog.text
    # Only the final file remains: the temporary file was renamed over it.
    assert [f.name for f in tmp_path.iterdir()] == [the_file(graph, tmp_path).name]


def test_given_fingerprint_is_the_key(graph, tmp_path, metis_calls, monkeypatch):
    """A caller's structure fingerprint (hashed before a barrier) keys the cache
    as the one assign_parts would take, and the graph is not hashed again."""
    structure = graph.fingerprint(structure_only=True)
    a = assign_parts(graph, 4, cache_dir=tmp_path)
    monkeypatch.setattr(type(graph), "fingerprint", lambda *a, **k: pytest.fail("hashed"))
    b, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True, fingerprint=structure)
    assert hit and metis_calls == [4] and np.array_equal(a, b)
    _, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True, fingerprint="other")
    assert not hit and metis_calls == [4, 4]


def test_other_chunk_counts_reuse_parts(graph, tmp_path, metis_calls):
    p2 = partition_graph(graph, 4, 2, cache_dir=tmp_path)
    p5 = partition_graph(graph, 4, 5, cache_dir=tmp_path)
    assert metis_calls == [4]
    assert np.array_equal(p2.part_ptr, p5.part_ptr) and np.array_equal(p2.perm, p5.perm)


def test_key_separates_parameters(graph, tmp_path, metis_calls):
    assign_parts(graph, 4, cache_dir=tmp_path)
    assign_parts(graph, 2, cache_dir=tmp_path)
    assign_parts(graph, 4, seed=1, cache_dir=tmp_path)
    _, hit = assign_parts(graph, 4, method="range", cache_dir=tmp_path, return_hit=True)
    assert not hit and metis_calls == [4, 2, 4]
    assert len(list(tmp_path.glob("parts-*.npz"))) == 4


def damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_flip(path):
    data = bytearray(path.read_bytes())
    # Inside the assignment array (it follows a short zip and .npy header).
    for pos in (300, 301, 2000):
        data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_empty(path):
    path.write_bytes(b"")


def damage_checksum(path):
    """A well-formed file whose contents no longer match its checksum."""
    with np.load(path) as f:
        fields = {k: f[k] for k in f.files}
    fields["assignment"] = (fields["assignment"] + 1) % 4
    np.savez(path, **fields)


def damage_stale(path):
    """A valid file written for another key (e.g. copied by hand)."""
    with np.load(path) as f:
        assignment = f["assignment"]
    save_assignment(path.parent, "0" * 32, assignment)
    (path.parent / "parts-" f"{'0' * 32}.npz").replace(path)


def damage_shape(path):
    save_assignment(path.parent, "tmp", np.zeros(7, dtype=np.int32))
    (path.parent / "parts-tmp.npz").replace(path)


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_empty, damage_checksum,
                                    damage_stale, damage_shape])
def test_corrupt_cache_is_rebuilt(graph, tmp_path, metis_calls, caplog, damage):
    good = assign_parts(graph, 4, cache_dir=tmp_path)
    path = the_file(graph, tmp_path)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="hongtu.partition"):
        again, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True)
    assert not hit and len(metis_calls) == 2
    assert any(r.levelno == logging.WARNING and "rebuilding" in r.getMessage()
               for r in caplog.records)
    assert np.array_equal(again, good)
    # The rebuilt file is good again.
    _, hit = assign_parts(graph, 4, cache_dir=tmp_path, return_hit=True)
    assert hit and len(metis_calls) == 2


def test_unwritable_cache_dir_is_not_fatal(graph, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hongtu.partition"):
        parts, hit = assign_parts(graph, 2, method="range", cache_dir=blocker / "sub",
                                  return_hit=True)
    assert not hit and parts.shape == (graph.num_nodes,)
    assert "could not write" in caplog.text


def test_feature_change_keeps_partition_cache(tmp_path):
    """The partition depends on the structure only: new features reuse the cached parts."""
    import numpy as np

    from hongtu.graph import Graph
    from hongtu.partition import assign_parts

    rng = np.random.default_rng(0)
    ei = rng.integers(0, 200, (2, 1500))
    g1 = Graph.from_edge_index(ei, 200, x=rng.standard_normal((200, 4)).astype(np.float32))
    g2 = Graph.from_edge_index(ei, 200, x=rng.standard_normal((200, 4)).astype(np.float32))
    _, hit1 = assign_parts(g1, 2, method="random", cache_dir=tmp_path, return_hit=True)
    _, hit2 = assign_parts(g2, 2, method="random", cache_dir=tmp_path, return_hit=True)
    assert (hit1, hit2) == (False, True)
