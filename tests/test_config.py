"""Config loading: every shipped YAML validates; every bad key/type/value is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hongtu.config import Config, load_config, parse_size
from hongtu.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(REPO.glob("configs/*.yaml")) + sorted(REPO.glob("examples/*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "hongtu " in first, \
        f"{path.name} must start with a comment giving the command that runs it"


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.epochs=3", "engine.chunks=8", "engine.dedup.reuse=false",
                             "model.layer=gat", "engine.device_memory=8GiB", "train.lr=1e-3"])
    assert cfg.train.epochs == 3 and cfg.engine.chunks == 8
    assert cfg.engine.dedup.reuse is False and cfg.engine.dedup.p2p is True
    assert cfg.model.layer == "gat" and cfg.train.lr == 1e-3
    assert Config().engine.chunks == "auto"


def test_configs_do_not_share_defaults():
    a, b = Config(), Config()
    a.engine.dedup.reuse = False
    assert b.engine.dedup.reuse is True


def write(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


BAD = [
    ("train:\n  epochs: 3\n  epohcs: 4\n", ["unknown key 'train.epohcs'", "epochs, lr"]),
    ("trian:\n  epochs: 3\n", ["unknown key 'trian'", "data, model, train, engine, output"]),
    ("train:\n  epochs: three\n", ["'train.epochs'", "expected int"]),
    ("train:\n  epochs: 2.5\n", ["'train.epochs'", "expected int"]),
    ("train:\n  epochs: -1\n", ["'train.epochs' is -1", "≥ 0"]),
    ("train:\n  lr: yes\n", ["'train.lr'", "expected float"]),
    ("model:\n  dropout: 1.5\n", ["'model.dropout' is 1.5", "between 0.0 and 0.99"]),
    ("engine:\n  accelerator: gpu\n", ["'engine.accelerator' is 'gpu'", "auto, cpu, cuda"]),
    ("engine:\n  chunks: many\n", ["'engine.chunks'", "auto or int"]),
    ("engine:\n  chunks: 0\n", ["'engine.chunks' is 0"]),
    ("engine:\n  device_memory: 8 jiggabytes\n", ["'engine.device_memory'", "8GiB"]),
    ("engine:\n  partitioner: kmeans\n", ["'engine.partitioner'", "metis, range, random"]),
    ("engine:\n  dedup: true\n", ["'engine.dedup' must be a mapping",
                                   "set its keys (reuse, p2p, cache) one by one"]),
    ("engine:\n  throughput: cal.json\n", ["'engine.throughput' must be a mapping",
                                            "e.g. engine.throughput.host_to_device=..."]),
    ("engine:\n  dedup: {reuse: maybe}\n", ["'engine.dedup.reuse'", "expected bool"]),
    ("model:\n  layer: not a path\n", ["'model.layer'", "package.module:ClassName"]),
    ("data:\n  path: 3\n", ["'data.path' is 3", "expected str"]),
    ("- a\n- b\n", ["must hold a mapping"]),
    ("train:\n  epochs: [1\n", ["malformed YAML", "line"]),
    ("train: {epochs: 3\n", ["malformed YAML"]),
]


@pytest.mark.parametrize("text,phrases", BAD, ids=[b[1][0][:30] for b in BAD])
def test_bad_config_is_one_clear_line(tmp_path, text, phrases):
    p = write(tmp_path, text)
    with pytest.raises(UserError) as e:
        load_config(p)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(p) in msg
    for phrase in phrases:
        assert phrase in msg, msg


@pytest.mark.parametrize("item,phrase", [
    ("train.epochs", "section.key=value"),
    ("epochs=3", "not a dotted key"),
    ("train.nope=3", "unknown key 'train.nope'"),
    ("train.epochs.x=3", "'epochs' is a value, not a section"),
    ("trian.epochs=3", "unknown key 'trian'"),
])
def test_bad_override(item, phrase):
    with pytest.raises(UserError, match=phrase):
        load_config(None, [item])


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_parse_size():
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1024") == 1024
    assert parse_size(7) == 7
    with pytest.raises(ValueError):
        parse_size("lots")
