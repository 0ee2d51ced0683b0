"""Resident mode (HongTu-IM): every buffer on the device when it fits the budget."""

from __future__ import annotations

import pytest

from hongtu.cli import main
from hongtu.config import load_config
from hongtu.engine.trainer import Trainer
from tests.conftest import REPO

CFG = str(REPO / "configs" / "gcn_example.yaml")


def trainer(tmp_path, *overrides) -> Trainer:
    cfg = load_config(CFG, [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                            "engine.partitioner=range", "model.hidden=16", *overrides])
    return Trainer(cfg, overwrite=True, out=lambda s: None)


def test_resident_true_on_cpu_is_a_clear_error(tmp_path, capsys):
    code = main(["train", CFG, f"output.dir={tmp_path}", "engine.accelerator=cpu",
                 "engine.resident=true", "-q"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.resident=true" in err[0] and "auto" in err[0]
    assert not (tmp_path / "model.pt").exists()


def test_cpu_runs_out_of_core_with_resident_auto(tmp_path):
    tr = trainer(tmp_path, "engine.accelerator=cpu")
    assert not tr.resident and not tr.executor.resident


@pytest.mark.gpu
def test_resident_auto_when_it_fits_and_same_losses_as_out_of_core(tmp_path):
    res = trainer(tmp_path / "a", "engine.accelerator=cuda")
    assert res.resident and res.executor.resident
    ooc = trainer(tmp_path / "b", "engine.accelerator=cuda", "engine.resident=false",
                  "engine.chunks=4")
    assert not ooc.resident
    for e in range(3):
        a, b = res.run_epoch(e), ooc.run_epoch(e)
        assert a["h2d_bytes"] == 0 and b["h2d_bytes"] > 0
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (e, a["loss"], b["loss"])


@pytest.mark.gpu
def test_resident_true_that_does_not_fit_is_a_clear_error(tmp_path):
    from hongtu.errors import UserError

    with pytest.raises(UserError, match=r"engine\.resident=true"):
        trainer(tmp_path, "engine.accelerator=cuda", "engine.resident=true",
                "engine.device_memory=1MiB")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["gin", "sage"])
def test_resident_keeps_update_graphs_where_they_fit(tmp_path, layer):
    """Resident, a layer whose update's backward autograd runs keeps its graph from
    forward to backward where the budget holds it beside the buffers and the
    batches (budget.kept_graph_bytes), with the same losses as out of core; with
    a budget that holds all but the graphs it trains resident without them."""
    res = trainer(tmp_path / "a", "engine.accelerator=cuda", f"model.layer={layer}")
    assert res.resident and res.executor.kept_graphs == [0, 1] and res.graph_bytes > 0
    assert res.executor.buf.agg == [None, None]  # (no aggregate stored: no buffer)
    buffers = res.budget - res.room
    tight = buffers + res.estimate - res.graph_bytes // 2
    less = trainer(tmp_path / "c", "engine.accelerator=cuda", f"model.layer={layer}",
                   f"engine.device_memory={tight}")
    assert less.resident and less.executor.kept_graphs == [] and less.graph_bytes == 0
    assert all(t is not None for t in less.executor.buf.agg)
    ooc = trainer(tmp_path / "b", "engine.accelerator=cuda", f"model.layer={layer}",
                  "engine.resident=false", "engine.chunks=4")
    for e in range(3):
        a, b, c = res.run_epoch(e), ooc.run_epoch(e), less.run_epoch(e)
        for x in (a, c):
            assert abs(x["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (e, x["loss"], b["loss"])
    assert not res.executor._graphs  # (each backward took its graphs)
