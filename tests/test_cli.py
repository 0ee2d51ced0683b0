"""The ``hongtu`` command end to end: help, partition, train, plot, predict, PyG input.

One tiny training run (2 epochs of ``configs/gcn_example.yaml``) is shared by
the plot and predict tests. Commands run in-process through
:func:`hongtu.cli.main` (fast); one test runs the real console entry point in
a subprocess to check the exit code the shell sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hongtu import cli
from hongtu.config import load_config
from hongtu.engine.trainer import load_data
from hongtu.graph.io import load_graph
from hongtu.nn import build_block, build_model
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "gcn_example.yaml")
METRIC_KEYS = {"epoch", "loss", "train_acc", "val_acc", "test_acc", "epoch_s", "h2d_bytes",
               "d2h_bytes", "d2d_bytes", "peak_device_bytes"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ---------------------------------------------------------------------- help
def test_help_lists_exactly_the_commands(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    start = lines.index("  COMMAND") + 1
    listed = {}
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        name, _, description = line.strip().partition(" ")
        listed[name] = description.strip()
    assert set(listed) == set(cli._COMMANDS)
    assert {"train", "partition", "plot", "predict"} <= set(listed)
    assert all(listed.values()), listed  # every command has its one-line description


def test_console_entry_point_help_and_exit_code(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "hongtu", "--help"], capture_output=True,
                        text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0 and "predict" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "hongtu", "plot", str(tmp_path / "none.jsonl")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("hongtu: error: metrics file")


# ----------------------------------------------------------------- partition
def test_partition_prints_the_summary(capsys, tmp_path):
    # An override after an option still counts as an override.
    rc, out, err = run(capsys, "partition", CONFIG, "engine.partitioner=range", "--debug",
                       f"engine.cache_dir={tmp_path / 'cache'}")
    assert rc == 0, err
    assert "graph sbm-small: 3000 vertices" in out
    assert "partition: range, 1 part(s) x 4 chunk(s)" in out
    assert "α" in out or "alpha" in out.lower()
    assert f"(cache: {tmp_path / 'cache'})" in out  # the override after --debug applied


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["partition", CONFIG, "--bogus"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# --------------------------------------------------------------------- train
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-epoch run of gcn_example: its directory, config overrides and printed output."""
    run_dir = tmp_path_factory.mktemp("run")
    overrides = ["train.epochs=2", f"output.dir={run_dir}", "engine.accelerator=cpu",
                 f"engine.cache_dir={run_dir / 'cache'}"]
    rc = cli.main(["train", CONFIG, *overrides, "--metrics", str(run_dir / "m.jsonl")])
    assert rc == 0
    return run_dir, overrides


def test_train_writes_metrics_and_model(trained):
    run_dir, _ = trained
    lines = (run_dir / "m.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    for i, rec in enumerate(records):
        assert set(rec) >= METRIC_KEYS, METRIC_KEYS - set(rec)
        assert rec["epoch"] == i and np.isfinite(rec["loss"])
    ckpt = torch.load(run_dir / "model.pt", weights_only=True)
    assert {"state_dict", "config", "perm"} <= set(ckpt)
    assert ckpt["perm"].shape == (3000,)


# ---------------------------------------------------------------------- plot
def test_plot_draws_a_png(trained, capsys, tmp_path):
    import matplotlib.image

    run_dir, _ = trained
    png = tmp_path / "curves.png"
    rc, out, err = run(capsys, "plot", run_dir / "m.jsonl", "-o", png)
    assert rc == 0, err
    assert "plotted 2 epoch(s)" in out
    image = matplotlib.image.imread(png)
    records = [json.loads(line) for line in (run_dir / "m.jsonl").read_text().splitlines()]
    panels = 3 if any(k.startswith("time_") for k in records[0]) else 2
    # figsize (9, 2.8 per panel) inches at 100 dpi
    assert image.shape[:2] == (round(280 * panels), 900)
    assert image[..., :3].std() > 0.05  # something was drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no temp file left


def test_plot_refuses_to_overwrite_without_flag(trained, capsys, tmp_path):
    run_dir, _ = trained
    png = tmp_path / "curves.png"
    png.write_bytes(b"not an image")
    rc, _, err = run(capsys, "plot", run_dir / "m.jsonl", "-o", png)
    assert rc == 2 and "already exists; pass --overwrite" in err
    assert png.read_bytes() == b"not an image"
    rc, _, err = run(capsys, "plot", run_dir / "m.jsonl", "-o", png, "--overwrite")
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_time_split_and_with_sparse_accuracy(capsys, tmp_path):
    import matplotlib.image

    metrics = tmp_path / "m.jsonl"
    recs = [{"epoch": e, "loss": 2.0 - 0.1 * e, "train_acc": None if e % 2 else 0.5,
             "val_acc": None, "test_acc": None} for e in range(5)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    rc, _, err = run(capsys, "plot", metrics)  # default output: METRICS with .png
    assert rc == 0, err
    assert matplotlib.image.imread(tmp_path / "m.png").shape[:2] == (560, 900)


# ------------------------------------------------------------------- predict
def _reference(cfg, ckpt):
    """Logits and last hidden layer of the whole graph in one block, in original ids."""
    graph = load_data(cfg)
    perm = ckpt["perm"].numpy()
    g = graph.permute(perm)
    n = g.num_nodes
    model = build_model(cfg.model, g.num_features, graph.num_classes)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    block = build_block(g.indptr, g.indices, g.in_degree(), 0, n, src_ids=np.arange(n))
    x = torch.from_numpy(np.asarray(g.x))
    with torch.no_grad():
        hidden = model.step_forward(0, block, x, None, 0)
        logits = model.full_forward(block, x, [0] * model.num_layers)
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n)
    return logits.numpy()[inv], hidden.numpy()[inv]


def test_predict_matches_a_full_graph_forward_in_original_ids(trained, capsys, tmp_path):
    run_dir, overrides = trained
    cfg = load_config(CONFIG, overrides)
    ckpt = torch.load(run_dir / "model.pt", weights_only=True)
    logits, hidden = _reference(cfg, ckpt)
    before = sorted(p.name for p in run_dir.iterdir())

    out = tmp_path / "pred.npy"
    rc, text, err = run(capsys, "predict", CONFIG, *overrides, "-o", out)
    assert rc == 0, err
    assert "class predictions for 3000 vertices" in text
    pred = np.load(out)
    assert pred.dtype == np.int64 and pred.shape == (3000,)
    # Ties in the argmax are the only allowed difference.
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4
    np.testing.assert_array_equal(pred[clear], logits.argmax(1)[clear])

    emb = tmp_path / "emb.npy"
    rc, text, err = run(capsys, "predict", CONFIG, *overrides, "--checkpoint",
                        run_dir / "model.pt", "-o", emb, "--embeddings")
    assert rc == 0, err
    h = np.load(emb)
    assert h.dtype == np.float32 and h.shape == (3000, 64)
    np.testing.assert_allclose(h, hidden, rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in run_dir.iterdir()) == before  # predict wrote nothing there


def test_predict_accuracy_matches_the_last_training_epoch(trained, capsys, tmp_path):
    run_dir, overrides = trained
    last = json.loads((run_dir / "m.jsonl").read_text().splitlines()[-1])
    rc, text, err = run(capsys, "predict", CONFIG, *overrides, "-o", tmp_path / "p.npy")
    assert rc == 0, err
    assert f"test {last['test_acc']:.4f}" in text


def test_a_config_of_several_devices_predicts_in_one_process(trained, capsys, tmp_path):
    """The config a model trained on several GPUs with predicts on one device,
    whatever its parts and chunks: the same predictions."""
    _, overrides = trained
    rc, _, err = run(capsys, "predict", CONFIG, *overrides, "-o", tmp_path / "one.npy")
    assert rc == 0, err
    rc, _, err = run(capsys, "predict", CONFIG, *overrides, "engine.devices=2",
                     "engine.chunks=3", "-o", tmp_path / "two.npy")
    assert rc == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy"))


# ---------------------------------------------------------------- PyG input
def _tiny_arrays(n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"edge_index": rng.integers(0, n, size=(2, 20)),
            "x": rng.standard_normal((n, 4)).astype(np.float32),
            "y": np.arange(n) % 3,
            "train_mask": np.arange(n) < 4,
            "val_mask": (np.arange(n) >= 4) & (np.arange(n) < 6),
            "test_mask": np.arange(n) >= 6}


def _same_graph(a, b) -> None:
    for key in ("indptr", "indices", "x", "y", "train_mask", "val_mask", "test_mask"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)


def test_pyg_data_file_loads_like_npz(tmp_path):
    from torch_geometric.data import Data

    arrays = _tiny_arrays()
    np.savez(tmp_path / "g.npz", **arrays)
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    torch.save(Data(**tensors, name="tiny"), tmp_path / "g.pt")
    torch.save(tensors, tmp_path / "d.pth")
    ref = load_graph(str(tmp_path / "g.npz"))
    _same_graph(load_graph(str(tmp_path / "g.pt")), ref)
    _same_graph(load_graph(str(tmp_path / "d.pth")), ref)


def test_train_on_a_pyg_file(capsys, tmp_path):
    from torch_geometric.data import Data

    arrays = {k: torch.from_numpy(v) for k, v in _tiny_arrays().items()}
    torch.save(Data(**arrays), tmp_path / "g.pt")
    rc, out, err = run(capsys, "train", CONFIG, f"data.path={tmp_path / 'g.pt'}",
                       "train.epochs=1", "engine.chunks=2", "engine.partitioner=range",
                       "engine.accelerator=cpu", f"output.dir={tmp_path / 'out'}",
                       f"engine.cache_dir={tmp_path / 'cache'}")
    assert rc == 0, err
    assert "graph g: 8 vertices" in out
    assert (tmp_path / "out" / "model.pt").is_file()


def test_metrics_record_fields_are_documented():
    """The README lists the metrics keys the CLI tests rely on."""
    readme = Path(REPO / "README.md").read_text()
    for key in METRIC_KEYS:
        assert key in readme, key
