"""Every input a user can get wrong: one line on stderr, exit code 2, nothing clobbered.

Each test runs a command in-process through :func:`hongtu.cli.main` against
an output directory that already holds a file, then checks the exit code,
that stderr is exactly one ``hongtu: error:`` line with the key phrase and no
traceback, and that the file is byte-for-byte unchanged (and nothing was
added). Graph files are written with numpy into ``tmp_path``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hongtu import cli
from hongtu.config import Config
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "gcn_example.yaml")
SENTINEL = b"results of another run\n"


@pytest.fixture
def env(tmp_path):
    """An output directory holding a file, and the overrides that point a run at it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_bytes(SENTINEL)
    base = [f"output.dir={out}", f"engine.cache_dir={tmp_path / 'cache'}",
            "engine.accelerator=cpu", "engine.partitioner=range", "train.epochs=1"]
    return out, base


def fails(capsys, out: Path, phrase: str, *argv) -> str:
    """Run ``hongtu ARGV``; assert the error contract; return the message."""
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("hongtu: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert phrase in err, err
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # nothing changed, nothing added (no partial output)
    return err


def graph_file(tmp_path: Path, name: str = "g.npz", n: int = 10, **override) -> Path:
    """A small valid labelled graph as .npz; ``override`` replaces (or, with None, drops) arrays."""
    arrays = {"edge_index": np.stack([np.arange(n), (np.arange(n) + 1) % n]),
              "x": np.ones((n, 4), dtype=np.float32),
              "y": np.arange(n) % 2,
              "train_mask": np.arange(n) < 4,
              "val_mask": (np.arange(n) >= 4) & (np.arange(n) < 7),
              "test_mask": np.arange(n) >= 7}
    arrays.update(override)
    path = tmp_path / name
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


# ------------------------------------------------------------------- config
def test_malformed_yaml(capsys, tmp_path, env):
    out, base = env
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 3\n  lr: [0.01\nmodel:\n  hidden: 8\n")
    fails(capsys, out, "malformed YAML at line", "train", bad, *base)


def test_unknown_key(capsys, env):
    out, base = env
    err = fails(capsys, out, "unknown key 'train.epohcs'", "train", CONFIG, *base,
                "train.epohcs=3")
    assert "valid keys in train: epochs" in err


def test_wrong_type(capsys, env):
    out, base = env
    fails(capsys, out, "'train.epochs' is 'many'; expected int", "train", CONFIG, *base,
          "train.epochs=many")


def test_missing_config_file(capsys, tmp_path, env):
    out, base = env
    fails(capsys, out, "config file", "train", tmp_path / "nope.yaml", *base)


# -------------------------------------------------------------- graph files
def test_missing_data_file(capsys, tmp_path, env):
    out, base = env
    fails(capsys, out, "not found", "train", CONFIG, *base, f"data.path={tmp_path / 'no.npz'}")


def test_unreadable_data_file(capsys, tmp_path, env, monkeypatch):
    out, base = env
    path = graph_file(tmp_path)
    real_open = pathlib.Path.open

    def deny(self, *args, **kwargs):  # we run as root, so chmod 000 would not stop a read
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", deny)
    fails(capsys, out, "cannot be read (", "train", CONFIG, *base, f"data.path={path}")


def test_truncated_npz(capsys, tmp_path, env):
    out, base = env
    path = graph_file(tmp_path)
    path.write_bytes(path.read_bytes()[:300])
    fails(capsys, out, "not a valid .npz archive", "train", CONFIG, *base, f"data.path={path}")


def test_edge_ids_out_of_range(capsys, tmp_path, env):
    out, base = env
    path = graph_file(tmp_path, edge_index=np.array([[0, 1, 2], [1, 2, 10]]))
    fails(capsys, out, "edge 2 has destination id 10, outside 0..9", "train", CONFIG, *base,
          f"data.path={path}")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_features_not_finite(capsys, tmp_path, env, value):
    out, base = env
    x = np.ones((10, 4), dtype=np.float32)
    x[3, 1] = value
    path = graph_file(tmp_path, x=x)
    fails(capsys, out, "'x' row 3 contains NaN or Inf", "train", CONFIG, *base,
          f"data.path={path}")


def test_negative_label(capsys, tmp_path, env):
    out, base = env
    y = np.arange(10) % 2
    y[5] = -1
    path = graph_file(tmp_path, y=y)
    fails(capsys, out, "'y' of vertex 5 is -1; labels must be class ids", "train", CONFIG,
          *base, f"data.path={path}")


def test_empty_train_mask(capsys, tmp_path, env):
    out, base = env
    path = graph_file(tmp_path, train_mask=np.zeros(10, dtype=bool))
    fails(capsys, out, "'train_mask' selects no vertex", "train", CONFIG, *base,
          f"data.path={path}")


# ------------------------------------------------------------- PyG .pt files
class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pt_with_a_foreign_object_is_not_unpickled(capsys, tmp_path, env):
    out, base = env
    path = tmp_path / "g.pt"
    torch.save({"edge_index": torch.zeros(2, 1, dtype=torch.long), "extra": _Payload()}, path)
    err = fails(capsys, out, "needs the Python global 'print' to unpickle", "train", CONFIG,
                *base, f"data.path={path}")
    assert "this must never run" not in capsys.readouterr().out + err


def test_pt_without_torch_geometric(capsys, tmp_path, env, monkeypatch):
    from torch_geometric.data import Data

    out, base = env
    path = tmp_path / "g.pt"
    torch.save(Data(edge_index=torch.zeros(2, 1, dtype=torch.long)), path)
    for name in ("torch_geometric", "torch_geometric.data", "torch_geometric.data.data",
                 "torch_geometric.data.storage"):
        monkeypatch.setitem(sys.modules, name, None)  # import now fails
    fails(capsys, out, "torch_geometric is not installed; pip install torch_geometric, or "
          "convert the graph to .npz", "train", CONFIG, *base, f"data.path={path}")


def test_truncated_pt(capsys, tmp_path, env):
    out, base = env
    path = tmp_path / "g.pt"
    torch.save({"edge_index": torch.zeros(2, 1, dtype=torch.long)}, path)
    path.write_bytes(path.read_bytes()[:200])
    fails(capsys, out, "not a valid torch.save file, or corrupt or truncated", "train", CONFIG,
          *base, f"data.path={path}")


# ---------------------------------------------------------------- resources
def test_out_of_gpu_memory_is_one_line(capsys, env, monkeypatch):
    """A GPU out of memory (PyTorch's error, raised here by a stand-in for
    training) stops with one line saying what to change; other errors still
    surface as they are."""
    out, base = env

    def oom(args):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 494.00 MiB. GPU 0 has a total capacity of "
            "79.18 GiB of which 74.26 GiB is free. 4.37 GiB allowed; Of the allocated memory "
            "3.56 GiB is allocated by PyTorch")

    monkeypatch.setitem(cli._COMMANDS, "train", oom)
    err = fails(capsys, out, "out of GPU memory (tried to allocate 494.00 MiB): lower "
                "engine.device_memory", "train", CONFIG, *base)
    assert "expandable_segments off" in err and "--resume" in err

    def broken(args):
        raise RuntimeError("not a memory problem")

    monkeypatch.setitem(cli._COMMANDS, "train", broken)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        cli.main(["train", CONFIG, *base])


def test_device_memory_too_small_for_any_chunking(capsys, env):
    out, base = env
    fails(capsys, out, "engine.device_memory=1.00 KiB is too small: even", "train", CONFIG,
          *base, "engine.chunks=auto", "engine.device_memory=1KiB")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_asked_for_but_absent(capsys, env):
    out, base = env
    fails(capsys, out, "engine.accelerator=cuda but no CUDA device is available", "train",
          CONFIG, *base, "engine.accelerator=cuda")


def test_more_gpus_than_present(capsys, env, monkeypatch):
    import torch

    out, base = env
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    base = [b for b in base if not b.startswith("engine.accelerator")]
    fails(capsys, out, "engine.devices=4 but this machine has 2 GPU(s)", "train",
          CONFIG, *base, "engine.accelerator=cuda", "engine.devices=4")


def test_host_memory_too_small(capsys, env, monkeypatch):
    import hongtu.engine.buffers

    out, base = env
    monkeypatch.setattr(hongtu.engine.buffers, "available_host_memory", lambda: 1)
    fails(capsys, out, "host memory too small: the buffers need", "train", CONFIG, *base)


# ------------------------------------------------------------------ outputs
def test_output_dir_holding_another_run(capsys, env):
    out, base = env
    (out / "model.pt").write_bytes(b"another run's model")
    fails(capsys, out, "already holds a run's results (model.pt); pass --overwrite", "train",
          CONFIG, *base)


def test_metrics_file_already_exists(capsys, env):
    out, base = env
    metrics = out / "m.jsonl"
    metrics.write_text('{"epoch": 0, "loss": 1.0}\n')
    fails(capsys, out, "metrics file", "train", CONFIG, *base, "--metrics", metrics)


def test_metrics_file_that_cannot_be_written_fails_before_training(capsys, env, monkeypatch):
    out, base = env
    (out / "m").write_text("a file, where the metrics file's directory should be")
    loaded = []
    monkeypatch.setattr("hongtu.engine.trainer.load_data", lambda *a: loaded.append(a))
    fails(capsys, out, "metrics file", "train", CONFIG, *base, "--metrics", out / "m" / "x.jsonl")
    assert loaded == []  # (refused before the graph was loaded)


@pytest.mark.parametrize("where,phrase", [("out/notes.txt", "is a file, not a directory"),
                                           ("out/notes.txt/run", "cannot be created")])
def test_output_dir_that_cannot_be_made_fails_before_training(capsys, tmp_path, env, monkeypatch,
                                                              where, phrase):
    out, base = env
    loaded = []
    monkeypatch.setattr("hongtu.engine.trainer.load_data", lambda *a: loaded.append(a))
    fails(capsys, out, phrase, "train", CONFIG, *base, f"output.dir={tmp_path / where}")
    assert loaded == []


def test_a_new_output_dir_is_not_left_behind_by_a_failing_run(capsys, tmp_path, env):
    out, base = env
    fails(capsys, out, "engine.chunks", "train", CONFIG, *base, "engine.chunks=100000",
          f"output.dir={out / 'a' / 'b'}")
    assert not (out / "a").exists()


def test_resume_without_checkpoint_fails_before_training(capsys, env, monkeypatch):
    out, base = env
    loaded = []
    monkeypatch.setattr("hongtu.engine.trainer.load_data", lambda *a: loaded.append(a))
    fails(capsys, out, "--resume: no checkpoint at", "train", CONFIG, *base, "--resume")
    assert loaded == []


def test_exit_code_seen_by_the_shell(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "hongtu", "train", CONFIG, "train.epohcs=3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.startswith("hongtu: error: ") and bad.stderr.count("\n") == 1
    assert "unknown key 'train.epohcs'" in bad.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------- plot
def test_plot_missing_metrics_file(capsys, tmp_path, env):
    out, _ = env
    fails(capsys, out, "not found", "plot", tmp_path / "none.jsonl", "-o", out / "p.png")


def test_plot_empty_metrics_file(capsys, env):
    out, _ = env
    (out / "m.jsonl").write_text("\n")
    fails(capsys, out, "is empty", "plot", out / "m.jsonl", "-o", out / "p.png")


def test_plot_line_not_json(capsys, env):
    out, _ = env
    (out / "m.jsonl").write_text('{"epoch": 0, "loss": 1.0}\n{"epoch": 1, "loss": \n')
    fails(capsys, out, "line 2 is not JSON", "plot", out / "m.jsonl", "-o", out / "p.png")


@pytest.mark.parametrize("key", ["epoch", "loss"])
def test_plot_record_missing_key(capsys, env, key):
    out, _ = env
    rec = {"epoch": 0, "loss": 1.0}
    del rec[key]
    (out / "m.jsonl").write_text(json.dumps(rec) + "\n")
    fails(capsys, out, f"line 1 has no '{key}'", "plot", out / "m.jsonl", "-o", out / "p.png")


def test_plot_refuses_existing_image(capsys, env):
    out, _ = env
    (out / "m.jsonl").write_text('{"epoch": 0, "loss": 1.0}\n')
    (out / "p.png").write_bytes(b"an earlier plot")
    fails(capsys, out, "already exists; pass --overwrite", "plot", out / "m.jsonl",
          "-o", out / "p.png")


# ------------------------------------------------------------------ predict
def test_predict_missing_checkpoint(capsys, env):
    out, base = env
    fails(capsys, out, "checkpoint", "predict", CONFIG, *base, "-o", out / "p.npy")


def test_predict_corrupt_checkpoint(capsys, env):
    out, base = env
    (out / "model.pt").write_bytes(b"PK\x03\x04 truncated")
    fails(capsys, out, "cannot be loaded", "predict", CONFIG, *base, "-o", out / "p.npy")


def test_predict_checkpoint_of_another_model(capsys, env):
    out, base = env
    stored = Config().to_dict()
    stored["model"]["hidden"] = 32
    torch.save({"state_dict": {}, "config": stored, "perm": torch.arange(3)}, out / "model.pt")
    fails(capsys, out, "was trained with model.hidden=32 but the config gives model.hidden=64",
          "predict", CONFIG, *base, "-o", out / "p.npy")


def test_predict_refuses_existing_output(capsys, env):
    out, base = env
    (out / "p.npy").write_bytes(b"earlier predictions")
    fails(capsys, out, "already exists; pass --overwrite", "predict", CONFIG, *base,
          "-o", out / "p.npy")


@pytest.mark.parametrize("command", ["predict", "plot"])
def test_an_output_that_cannot_be_written_fails_before_the_work(capsys, env, monkeypatch,
                                                                command):
    out, base = env
    ran = []
    monkeypatch.setattr("hongtu.predict.predict", lambda *a, **k: ran.append(a))
    monkeypatch.setattr("hongtu.plot.read_metrics", lambda *a, **k: ran.append(a))
    argv = ["predict", CONFIG, *base, "-o", out / "notes.txt" / "p.npy"] if command == "predict" \
        else ["plot", out / "m.jsonl", "-o", out / "notes.txt" / "p.png"]
    fails(capsys, out, "cannot be written", *argv)
    assert ran == []
