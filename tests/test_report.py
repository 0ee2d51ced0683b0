"""``hongtu report`` and ``hongtu calibrate``: figures equal the planner's, files load back.

All on ``builtin:sbm-small`` with the ``range`` or ``random`` partitioner (no
METIS), a temporary ``engine.cache_dir`` and a CPU; a few seconds in all.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hongtu import cli
from hongtu.calibrate import resolve_throughput
from hongtu.config import load_config, parse_size
from hongtu.dedup import TransferPlan, plan_transfers
from hongtu.dedup.sets import identity_order
from hongtu.engine.budget import row_memory
from hongtu.engine.executor import first_layer_busy, layers_moved_whole, rows_kept_at
from hongtu.engine.trainer import Trainer, load_data
from hongtu.errors import UserError
from hongtu.partition import partition_graph, partition_stats
from hongtu.reorg import reorganize
from hongtu.report import build_report, format_report
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "gcn_example.yaml")


def base(tmp_path, *extra: str) -> list[str]:
    return ["data.path=builtin:sbm-small", "engine.partitioner=range", "engine.parts=2",
            "engine.chunks=4", "engine.accelerator=cpu", f"engine.cache_dir={tmp_path / 'cache'}",
            *extra]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def executor_index_bytes(ex) -> int:
    """Host bytes of the index arrays an executor keeps for rows written in
    first-load order (and for ``a^0`` stored once)."""
    fl, agg = ex._first_loads, ex._agg_layout
    arrays = [] if fl is None else [t for _, t in fl.steps] + list(fl.chunks.values())
    arrays += [] if agg is None else list(agg.orders.values())
    return sum(t.nbytes for t in arrays)


@pytest.fixture(scope="module")
def report_json(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    cfg = load_config(CONFIG, base(tmp))
    return cfg, build_report(cfg).data


# ---------------------------------------------------------------- the text
def test_text_report_has_every_section(capsys, tmp_path):
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path), "--parts-list", "2,4,8")
    assert rc == 0, err
    for phrase in ("graph sbm-small: 3,000 vertices", "replication factor α (HongTu Table 3)",
                   "transfer volumes of one layer pass", "(HongTu Table 8)",
                   "identity (no reorg)", "host traffic V_+ru vs V_ori",
                   "predicted transfers of one training step", "gradient flushes",
                   "cached aggregates", "cost C (Eq. 4) per epoch", "transfer lower bound",
                   "device memory per chunk", "<- this config", "throughput (GB/s)",
                   "host memory of one training process", "chunk blocks", "transfer plan",
                   "available now: the buffers fit",
                   "the transfer plan's index arrays on the device, not in the estimate"):
        assert phrase in out, phrase


def test_several_devices_bound_says_it_counts_one_link(capsys, tmp_path):
    """With several devices the transfer lower bound puts every device's bytes
    over one link, and the report says so (their links may carry at once)."""
    _, one, _ = run(capsys, "report", CONFIG, *base(tmp_path))
    rc, two, err = run(capsys, "report", CONFIG, *base(tmp_path), "engine.devices=2")
    assert rc == 0, err
    note = "all 2 devices' bytes over one link at that rate"
    assert note in two and "bench/bench_host_links.py" in two
    assert "devices' bytes over one link" not in one


def test_host_buffers_set_against_available_memory(capsys, tmp_path, monkeypatch):
    """Where this machine's available host memory is below the buffers, the report
    says training would stop, as training's own check then does."""
    import hongtu.engine.buffers
    from hongtu.errors import UserError

    monkeypatch.setattr(hongtu.engine.buffers, "available_host_memory", lambda: 1000)
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path), "--parts-list", "2")
    assert rc == 0, err
    assert "1000 B available now: the buffers do not fit, training would stop with " \
        "'host memory too small'" in out
    with pytest.raises(UserError, match="host memory too small"):
        Trainer(load_config(CONFIG, base(tmp_path, f"output.dir={tmp_path / 'run'}")),
                out=lambda _: None)


# ---------------------------------------------------------------- the JSON
def test_json_volumes_equal_the_planner(capsys, tmp_path, report_json):
    cfg, _ = report_json
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path), "--json", "--parts-list", "2")
    assert rc == 0, err
    d = json.loads(out)  # one JSON document, nothing else on stdout
    graph = load_data(cfg)
    p = partition_graph(graph, 2, 4, method="range")
    g = p.apply(graph)
    n = g.num_nodes
    rb = 4 * max(d["model"]["widths"])
    direct = {"identity": plan_transfers(g.indptr, g.indices, p.chunk_ptr, 2, 4, row_bytes=rb)}
    order = reorganize(g.indptr, g.indices, p.chunk_ptr, 2, 4, row_bytes=rb)
    chosen = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 2, 4, order=order, row_bytes=rb)
    direct[d["volumes"]["chosen"]] = chosen
    for name, plan in direct.items():
        c = d["volumes"]["candidates"][name]
        assert (c["v_ori"], c["v_p2p"], c["v_ru"]) == (plan.v_ori, plan.v_p2p, plan.v_ru)
        assert c["v_ori_norm"] == pytest.approx(plan.v_ori / n)
        assert c["p2p_saved_norm"] == pytest.approx((plan.v_ori - plan.v_p2p) / n)
        assert c["ru_saved_norm"] == pytest.approx((plan.v_p2p - plan.v_ru) / n)
        # the reduction figure is V_+ru against V_ori
        assert c["reduction_pct"] == pytest.approx(100 * (1 - plan.v_ru / plan.v_ori))
        assert 0 < c["reduction_pct"] < 100
    assert d["volumes"]["plan"]["h2d_rows"] == chosen.h2d_rows
    # what the report calls "with reorg" is never costlier than "without"
    cands = d["volumes"]["candidates"]
    assert cands[d["volumes"]["with_reorg"]]["cost_s"] <= cands["identity"]["cost_s"]
    # per-layer bytes are rows x width x 4: the plan's rows, or all of them for a
    # layer whose rows fit the device row memory (layers_moved_whole), none for
    # h^1 left on the device by the first layer's pass (rows_kept_at)
    dp = chosen.plans[0]
    memory = row_memory(dp.buffer_rows, d["model"]["widths"], dp.max_later_load)
    # (no budget: the plan's memory)
    widths = d["model"]["widths"]
    whole = layers_moved_whole(n, widths, memory, dp.load_ids.shape[0], False)
    busy = first_layer_busy(n, widths, dp.buffer_rows, dp.max_later_load, whole[0])
    kept = rows_kept_at(n, widths, memory, whole, [True, True], busy) is not None
    assert kept  # (GCN: the second layer reads its rows in forward only)
    for l, (layer, all_rows) in enumerate(zip(d["transfers"]["layers"], whole)):
        assert layer["whole"] == all_rows
        rows = 0 if l == 1 and kept else n if all_rows else chosen.h2d_rows
        assert layer["forward_bytes"] == rows * layer["width"] * 4


def test_alpha_is_partition_stats_and_grows_with_parts(report_json, tmp_path):
    cfg, d = report_json
    rows = d["replication"]
    assert [r["parts"] for r in rows] == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    alphas = [r["alpha"] for r in rows]
    assert all(a >= 1 for a in alphas)
    assert all(b >= a for a, b in zip(alphas, alphas[1:])), alphas  # true for range here
    graph = load_data(cfg)
    for r in rows[:3]:
        stats = partition_stats(graph, partition_graph(graph, r["parts"], 1, method="range"))
        assert r["alpha"] == pytest.approx(stats["alpha_parts"])
        assert r["cut_fraction"] == pytest.approx(stats["cut_fraction"])


def test_alpha_skips_part_counts_above_half_the_vertices(tmp_path):
    cfg = load_config(CONFIG, base(tmp_path, "engine.partitioner=random"))
    d = build_report(cfg, parts_list=[2, 1500, 1501, 4096], chunks_list=[]).data
    assert [r["parts"] for r in d["replication"]] == [2, 1500]
    assert d["replication_skipped"] == [1501, 4096]


def test_alpha_table_stops_where_metis_fails(capsys, tmp_path, monkeypatch):
    """METIS out of memory at some part count (pymetis raises): the α table stops
    there with METIS's line, and the rest of the report is made; the same
    failure for the config's own parts is one line and exit code 2."""
    import pymetis

    real = pymetis.part_graph

    def part_graph(nparts, *args, **kwargs):
        if nparts >= 4:
            raise RuntimeError("Caught an unknown exception!")
        return real(nparts, *args, **kwargs)

    monkeypatch.setattr(pymetis, "part_graph", part_graph)
    args = [*base(tmp_path, "engine.partitioner=metis"), "--parts-list", "2,4,8"]
    rc, out, err = run(capsys, "report", CONFIG, *args, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert [r["parts"] for r in d["replication"]] == [2]
    assert d["replication_failed"]["parts"] == 4
    assert "METIS could not split the graph" in d["replication_failed"]["message"]
    assert d["volumes"]  # (the config's own 2 parts: METIS did those)
    rc, out, err = run(capsys, "report", CONFIG, *args)
    assert rc == 0 and "  stopped at 4 parts (--parts-list sets the counts): METIS could not" \
        in out, err
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path, "engine.partitioner=metis",
                                                        "engine.parts=4"), "--parts-list", "2")
    assert rc == 2 and err.startswith("hongtu: error: METIS could not split the graph")
    assert err.count("\n") == 1, err


def test_alpha_table_starts_no_count_past_its_time(capsys, tmp_path, monkeypatch):
    """Past --alpha-seconds no further part count is started (each took one
    simulated minute here); the counts done are cached, so the next report
    goes further."""
    import hongtu.report as report

    now = [0.0]
    real = report.assign_parts

    def assign_parts(*args, **kwargs):
        now[0] += 60.0
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "assign_parts", assign_parts)
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    args = [*base(tmp_path, "engine.partitioner=metis"), "--parts-list", "2,4,8,16"]
    rc, out, err = run(capsys, "report", CONFIG, *args, "--json", "--alpha-seconds", "100")
    assert rc == 0, err
    d = json.loads(out)
    assert [r["parts"] for r in d["replication"]] == [2, 4]
    assert d["replication_stopped"]["parts"] == 8 and d["replication_stopped"]["seconds"] >= 100
    assert d["replication_failed"] is None
    assert not any(r["cached"] for r in d["replication"])
    rc, out, err = run(capsys, "report", CONFIG, *args, "--alpha-seconds", "100")
    assert rc == 0 and "  stopped before 8 parts: the counts before took" in out, err
    rc, out, err = run(capsys, "report", CONFIG, *args, "--json", "--alpha-seconds", "0")
    d = json.loads(out)
    assert [r["parts"] for r in d["replication"]] == [2, 4, 8, 16]
    assert [r["cached"] for r in d["replication"]] == [True, True, False, False]
    assert d["replication_stopped"] is None


@pytest.mark.parametrize("extra", [
    [],
    ["model.layer=sage", "model.layers=3", "engine.dedup.reuse=false"],
    ["model.layer=gat", "model.heads=2", "model.hidden=8", "engine.partitioner=random"],
    ["model.layer=gat", "model.heads=2", "model.hidden=8", "engine.dedup.p2p=false"],
    ["engine.parts=1"],
    ["engine.parts=1", "model.layers=3"],
    ["engine.whole_layers=false"],
    ["engine.whole_layers=false", "model.layers=3", "model.layer=sage"],
    ["engine.parts=1", "model.layers=3", "engine.chunks=8"],
    ["engine.parts=1", "model.layers=3", "engine.chunks=16"],
    ["engine.parts=1", "model.layer=sage"],
    ["model.layer=sage", "engine.dedup.p2p=false", "engine.whole_layers=false"],
    ["model.layer=gin", "engine.checkpoint=recompute", "engine.whole_layers=false"],
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "engine.ordered_inputs=false"],
                 marks=pytest.mark.gpu),
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "engine.ordered_inputs=false", "model.layers=3"],
                 marks=pytest.mark.gpu),
    # (layer 1's rows in load order as the first layer's aggregates, narrower than
    # the hidden rows: 128 features (512-byte rows) under 256; sbm-small's 100
    # (400-byte rows) under 128)
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "engine.ordered_inputs=false", "model.layers=3",
                  "model.hidden=256", "data.path=builtin:rmat-16"], marks=pytest.mark.gpu),
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "engine.ordered_inputs=false", "model.layers=3",
                  "model.hidden=128"], marks=pytest.mark.gpu),
    # (a budget the blocks do not fit beside the plan: each pass copies them)
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "engine.ordered_inputs=false",
                  "engine.device_memory=68.5MiB"], marks=pytest.mark.gpu),
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.ordered_inputs=false", "model.layers=3", "engine.device_memory=69.5MiB"],
                 marks=pytest.mark.gpu),
    # (own rows' gradients added in host memory: no self-loops)
    pytest.param(["engine.accelerator=cuda", "engine.resident=false",
                  "engine.whole_layers=false", "model.layer=sage", "model.layers=3",
                  "data.self_loops=false"], marks=pytest.mark.gpu),
], ids=["gcn-cached", "sage-no-reuse", "gat-recomputed", "gat-no-p2p", "gcn-whole", "gcn3-whole",
        "gcn-plan-rows", "sage3-plan-rows", "gcn3-last-rows", "gcn3-last-rows-plan",
        "sage-whole", "sage-no-p2p", "gin-recomputed",
        "gpu-ordered-rows", "gpu3-ordered-rows", "gpu3-ordered-aggregates",
        "gpu3-ordered-aggregates-400", "gpu-blocks-copied",
        "gpu3-blocks-copied",
        "gpu-sage3-no-self-loops"])
def test_predicted_bytes_equal_what_the_engine_moves(tmp_path, extra):

    cfg = load_config(CONFIG, base(tmp_path, f"output.dir={tmp_path / 'run'}", *extra))
    data = build_report(cfg, parts_list=[], chunks_list=[]).data
    transfers = data["transfers"]
    epoch = transfers["epoch"]
    trainer = Trainer(cfg, out=lambda _: None)
    # The host buffers the report lists are those training allocates, h^0's copy too.
    buf = trainer.executor.buf
    made = [("h^0", buf.h[0].nbytes)] + [
        (f"{kind}^{l}", t.nbytes) for kind, ts in (("h", buf.h), ("grad h", buf.grad),
                                                  ("a", buf.agg))
        for l, t in enumerate(ts) if t is not None and (kind != "h" or l > 0)]
    host = data["host"]
    assert not host["resident"]
    assert sorted(map(tuple, host["entries"])) == sorted(made)
    # and so are the blocks (int64 on a CPU, pinned int32 on a GPU, none in host
    # memory where they stay on the device), the structure and the plan
    g, blocks = trainer.graph, [b for b in trainer.chunks.blocks if b is not None]
    assert dict(map(tuple, host["others"])) == {
        "chunk blocks": 0 if trainer.blocks_fit and "engine.accelerator=cuda" in extra
        else sum(b.nbytes() for b in blocks),
        "structure": sum(a.nbytes for a in (g.indptr, g.indices, g.y, g.train_mask,
                                            g.val_mask, g.test_mask)),
        "transfer plan": sum(a.nbytes for a in trainer.transfer_plan.to_npz_dict().values()),
        "flush staging": sum(t.nbytes for t in trainer.executor.mover._stages or [])}
    # the plan's index arrays on the device, which the estimate leaves out
    assert data["memory"]["plan_index_bytes"] == sum(
        t.nbytes for t in vars(trainer.executor.plan).values() if isinstance(t, torch.Tensor))
    # (copies in load order on a GPU: all of them where host memory holds them, as
    # here; the rows' index arrays too)
    assert host["ordered_index_bytes"] == executor_index_bytes(trainer.executor)
    assert sum(host["ordered_bytes"]) == (trainer.executor.ordered_input_bytes
                                          + trainer.executor.ordered_row_bytes)
    if extra[:2] == ["engine.parts=1", "model.layers=3"] and len(extra) == 3:
        # the last layer's rows stay from the forward pass before it
        assert trainer.executor.rows_kept and trainer.executor._rows_layer == 2
    elif "engine.parts=1" in extra:  # every layer whole; gradients kept on the device
        ex = trainer.executor
        assert all(ex._whole)
        assert ex._kept[1] == ex._kept[-1] == all(ex.cached)
        # a pass counts for forward and for each gradient flush that happens
        assert [x["passes"] for x in transfers["layers"]] == [
            1 + (not ex.cached[l]) + (l > 0 and not ex._kept[l]) for l in range(len(ex._whole))]
    if any(x in extra for x in ("model.layer=gat", "model.layer=sage", "model.layer=gin")):
        # (own rows among the sources: self-loops, p2p)
        assert (trainer.executor._own_at is not None) == (
            "engine.dedup.p2p=false" not in extra and "data.self_loops=false" not in extra)
    # (on a GPU the training forward writes later GCN layers' rows in load order,
    # where the budget leaves room for their index arrays)
    budget = any(x.startswith("engine.device_memory") for x in extra)
    if not budget:
        assert bool(trainer.executor.ordered_rows) == (
            "engine.accelerator=cuda" in extra and "model.layer=sage" not in extra)
    # (layer 1's as the first layer's aggregates where narrower: 100 or 128
    # features under a hidden width of 128 or 256, not 64)
    assert trainer.executor.rows_from_aggregates == any(
        x in extra for x in ("model.hidden=128", "model.hidden=256"))
    # (chunk blocks copied pass by pass where they do not stay on the device)
    assert (epoch["block_h2d_bytes"] > 0) == (not trainer.blocks_fit)
    assert trainer.blocks_fit == (not budget)
    if not trainer.blocks_fit:
        # The trainer pinned and narrowed the blocks as it built them, and it and
        # the executor hold only those copies (no int64 host blocks beside them).
        ex = trainer.executor
        assert trainer.chunks is ex.chunks and trainer.chunks.blocks is ex._blocks
        for b in ex._blocks:
            assert b.indices.dtype == b.t_perm.dtype == torch.int32
            assert all(t.is_pinned() for t in b.tensors())
    # (where the first layer's backward leaves the transition buffer alone, the
    # next pass's first rows travel during it: the first epoch loads them twice,
    # and an evaluation after a training epoch starts with them)
    ex, itemsize = trainer.executor, 4
    p = ex.plan.plan.load_ptr
    ahead = int(p[1] - p[0]) * data["model"]["widths"][0] * itemsize if ex._prefetch else 0
    step = trainer.run_epoch(0, evaluate=False)
    assert (step["h2d_bytes"] - ahead, step["d2h_bytes"]) == (epoch["h2d_bytes"],
                                                              epoch["d2h_bytes"])
    both = trainer.run_epoch(1, evaluate=True)
    moved = both["h2d_bytes"] + both["d2h_bytes"] + step["h2d_bytes"] + step["d2h_bytes"]
    assert moved == 2 * (epoch["h2d_bytes"] + epoch["d2h_bytes"]) + epoch["evaluation_bytes"]
    # (the flush staging the report lists is what the largest flush staged)
    mover = trainer.executor.mover
    assert mover.staging_grown == 0
    assert mover.staged_most * 4 * 3 == dict(map(tuple, host["others"]))["flush staging"]


def test_rows_written_in_load_order_are_the_loaded_rows():
    """The report's model of rows written in load order (engine.ordered_rows,
    GPU): a training step stores only the rows the plan loads of that layer
    (each once), and loads what it loaded before; evaluation is unchanged."""
    from hongtu.engine.executor import Handoffs
    from hongtu.report import _traffic

    hand = Handoffs([False, False, False], [False] * 4, None)
    args = ([8, 16, 16, 3], [True] * 3, [True] * 3, [False] * 3, 4, 100, 300, 200, hand)
    plain, ordered = _traffic(*args), _traffic(*args, [False, True, True], 90)
    p, o = plain["epoch"], ordered["epoch"]
    assert (o["h2d_bytes"], o["evaluation_bytes"]) == (p["h2d_bytes"], p["evaluation_bytes"])
    assert p["d2h_bytes"] - o["d2h_bytes"] == 2 * 10 * 16 * 4  # h^1 and h^2, 10 rows each


def test_layer_1_rows_as_first_aggregates_move_narrower():
    """The report's model of layer 1's rows written in load order as the first
    layer's aggregates (GPUs; the engine's bytes: test_oracle's
    test_layer_1_rows_made_from_the_first_layers_aggregates): the rows the
    first layer's pass stores and layer 1's steps after the first load are as
    wide as h^0; evaluation is unchanged."""
    from hongtu.engine.executor import Handoffs
    from hongtu.report import _traffic

    hand = Handoffs([False, False, False], [False] * 4, None)
    widths, loads, first = [8, 16, 16, 3], 300, (20, 5)
    args = (widths, [True] * 3, [True] * 3, [False] * 3, 4, 100, loads, 200, hand,
            [False, True, True], 90, (0, 0), 0, [False, True, True], first)
    rows, narrow = _traffic(*args)["epoch"], _traffic(*args, narrow=True)["epoch"]
    assert rows["h2d_bytes"] - narrow["h2d_bytes"] == (loads - first[0]) * (16 - 8) * 4
    assert rows["d2h_bytes"] - narrow["d2h_bytes"] == (90 - first[1]) * (16 - 8) * 4
    assert rows["evaluation_bytes"] == narrow["evaluation_bytes"]


def test_first_backward_on_flushes_moves_no_grad_h1():
    """The report's model of the first layer's backward run on layer 1's
    gradient flushes (GPUs; the engine's bytes: test_oracle's
    test_first_backward_runs_on_layer_1_flushes, and the GPU cases above):
    no ∇h^1 flushed, nor read back with a^0 of every row; a^0 of the
    flushed rows gathered instead."""
    from hongtu.engine.executor import Handoffs
    from hongtu.report import _traffic

    hand = Handoffs([False, False, False], [False] * 4, None)
    n, (w0, w1), flushed = 100, (8, 16), 200
    args = ([w0, w1, 16, 3], [True] * 3, [True] * 3, [False] * 3, 4, n, 300, flushed, hand)
    plain, into = _traffic(*args, held=30), _traffic(*args, into_first=True)
    p, o = plain["epoch"], into["epoch"]
    assert p["h2d_bytes"] - o["h2d_bytes"] == 4 * (n * w1 + n * w0 - flushed * w0)
    assert p["d2h_bytes"] - o["d2h_bytes"] == 4 * (flushed - 30) * w1
    assert p["evaluation_bytes"] == o["evaluation_bytes"]
    assert [x["passes"] for x in into["layers"]] == [1, 1, 2]


def _midpoint_budget(tmp_path) -> int:
    """A budget between the estimates of 1 and 16 chunks per part."""
    cfg = load_config(CONFIG, base(tmp_path))
    rows = {r["chunks"]: r for r in build_report(cfg, [], [1, 16]).data["memory"]["rows"]}
    assert rows[1]["device_bytes"] > rows[16]["device_bytes"]  # more chunks, less memory
    return (rows[1]["device_bytes"] + rows[16]["device_bytes"]) // 2


def test_memory_table_marks_fit_and_the_chosen_count(tmp_path):
    budget = _midpoint_budget(tmp_path)
    # (Without kept rows or whole layers: with them the spare budget of 16 chunks
    # buys back the traffic.)
    cfg = load_config(CONFIG, base(tmp_path, f"engine.device_memory={budget}",
                                   "engine.dedup.cache=false", "engine.whole_layers=false"))
    d = build_report(cfg, parts_list=[]).data
    rows = {r["chunks"]: r for r in d["memory"]["rows"]}
    assert set(rows) == {1, 2, 4, 6, 8, 16}  # n = 4, the two above, about n/4, n/2, 2n, 4n
    assert d["memory"]["budget"] == budget
    for r in rows.values():
        assert r["fits"] == (r["device_bytes"] <= budget)
    assert rows[16]["fits"] and not rows[1]["fits"]
    assert rows[16]["neighbour_bytes"] > rows[1]["neighbour_bytes"]  # ... more host traffic
    assert d["memory"]["suggested_chunks"] == min(k for k, r in rows.items() if r["fits"])


def test_spare_budget_keeps_rows_as_training_does(tmp_path):
    budget = _midpoint_budget(tmp_path)
    # (Whole layers off: at this budget they move the first layer's rows once
    # already, with or without kept rows.)
    args = [f"engine.device_memory={budget}", "engine.chunks=16", "engine.whole_layers=false"]
    plain = build_report(load_config(CONFIG, base(tmp_path, *args, "engine.dedup.cache=false")),
                         parts_list=[], chunks_list=[16])
    rep = build_report(load_config(CONFIG, base(tmp_path, *args)), parts_list=[],
                       chunks_list=[16])
    kept = rep.data["volumes"]["plan"]["cached_rows"]
    assert plain.data["volumes"]["plan"]["cached_rows"] == 0 < kept
    assert rep.data["memory"]["rows"][0]["device_bytes"] <= budget
    ep, ep0 = rep.data["transfers"]["epoch"], plain.data["transfers"]["epoch"]
    assert ep["neighbour_bytes"] < ep0["neighbour_bytes"]
    assert f"keeps {kept:,} reused rows" in format_report(rep.data)
    cfg = load_config(CONFIG, base(tmp_path, *args))
    trainer = Trainer(cfg, overwrite=True, out=lambda _: None)
    assert trainer.transfer_plan.cached_rows == kept  # same plan as the report's
    assert trainer.run_epoch(0, evaluate=False)["h2d_bytes"] == ep["h2d_bytes"]


def test_chunks_auto(tmp_path):
    from hongtu.engine.budget import choose_chunks
    from hongtu.nn.model import build_model
    from hongtu.partition import assign_parts

    cfg = load_config(CONFIG, base(tmp_path, "engine.chunks=auto"))
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    assert d["engine"]["chunks"] == 8 and any("8 chunks per part" in x for x in d["notes"])
    budget = _midpoint_budget(tmp_path)
    cfg = load_config(CONFIG, base(tmp_path, "engine.chunks=auto",
                                   f"engine.device_memory={budget}"))
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    graph = load_data(cfg)
    # (the model as training builds it: the estimate counts what it aggregates in place)
    model = build_model(cfg.model, graph.num_features, graph.num_classes,
                        transform_first=cfg.engine.transform_first, keep_dropped=True)
    expect, _ = choose_chunks(graph, assign_parts(graph, 2, "range"), 2, model, budget)
    assert d["engine"]["chunks"] == expect


def _rmat16_gcn3(tmp_path, *extra: str):
    return load_config(CONFIG, ["data.path=builtin:rmat-16", "engine.partitioner=range",
                                "engine.parts=1", "engine.accelerator=cpu", "model.layers=3",
                                "model.hidden=256", "engine.device_memory=200MiB",
                                f"engine.cache_dir={tmp_path / 'cache'}",
                                f"output.dir={tmp_path / 'run'}", *extra])


def test_chunks_auto_plans_one_count_more_where_rows_load_again(tmp_path):
    # 24 chunks, the fewest that fit, load rows again (1.36x their distinct
    # rows per pass); 32 leave room to keep more of them (1.09x): training and
    # the report take 32 and plan, predict and move the same bytes.
    cfg = _rmat16_gcn3(tmp_path, "engine.chunks=auto")
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    said = "engine.chunks=auto: 24 chunks per part, the fewest that fit, load 1.36x"
    assert d["engine"]["chunks"] == 32 and d["engine"]["chunks_how"].endswith(
        ", then 32: fewer rows loaded again")
    assert any(x.startswith(said) and x.endswith("32 load 1.09x: 32 taken")
               for x in d["notes"])
    assert d["memory"]["suggested_chunks"] == 24  # (the fewest that fit, as before)
    lines = []
    tr = Trainer(cfg, overwrite=True, out=lines.append)
    assert tr.partition.num_chunks == tr.chunks.num_chunks == 32
    assert tr.more_chunks[0] == 24 and tr.more_chunks[2] == 32
    assert said in "\n".join(lines)
    assert tr.transfer_plan.h2d_rows == d["volumes"]["plan"]["h2d_rows"]
    assert tr.estimate <= tr.room
    fewest = Trainer(_rmat16_gcn3(tmp_path, "engine.chunks=24"), overwrite=True,
                     out=lambda _: None)
    assert fewest.more_chunks is None  # (a count configured: one plan)
    assert tr.transfer_plan.h2d_rows < 0.9 * fewest.transfer_plan.h2d_rows
    a, b = tr.run_epoch(0, evaluate=False), fewest.run_epoch(0, evaluate=False)
    assert a["h2d_bytes"] == d["transfers"]["epoch"]["h2d_bytes"] < b["h2d_bytes"]
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
    # Where the next count loads hardly fewer rows, it is planned and not taken.
    tight = _rmat16_gcn3(tmp_path, "engine.chunks=auto", "engine.device_memory=120MiB")
    d = build_report(tight, parts_list=[], chunks_list=[]).data
    assert d["engine"]["chunks"] == 192 and d["engine"]["chunks_how"].endswith("120.00 MiB")
    assert any(x.endswith(": 192 taken") and " 256 load " in x for x in d["notes"])
    tr = Trainer(tight, overwrite=True, out=lambda _: None)
    assert tr.chunks.num_chunks == 192 and tr.more_chunks[2] == 256
    assert tr.transfer_plan.h2d_rows == d["volumes"]["plan"]["h2d_rows"]
    # Without kept rows more chunks buy nothing: auto stays at the fewest.
    plain = build_report(_rmat16_gcn3(tmp_path, "engine.chunks=auto",
                                      "engine.dedup.cache=false"), parts_list=[],
                         chunks_list=[]).data
    assert plain["engine"]["chunks"] == 24 and not any("taken" in x for x in plain["notes"])


def test_report_allocates_no_training_buffers(tmp_path, monkeypatch):
    from hongtu.engine import buffers

    def refuse(*a, **k):
        raise AssertionError("the report allocated host buffers")

    monkeypatch.setattr(buffers.HostBuffers, "__init__", refuse)
    build_report(load_config(CONFIG, base(tmp_path)), parts_list=[2], chunks_list=[])


# --------------------------------------------------------- plot and plan files
def test_plot_writes_a_png_and_refuses_to_overwrite(capsys, tmp_path):
    from matplotlib.image import imread

    png = tmp_path / "report.png"
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path), "--plot", png,
                       "--parts-list", "2,4,8", "--chunks-list", "2,8")
    assert rc == 0, err
    assert f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.shape[0] >= 300 and image.shape[1] >= 1000
    assert png.stat().st_size > 20_000
    assert not list(tmp_path.glob(".report.png.*"))  # no temporary left behind
    rc, _, err = run(capsys, "report", CONFIG, *base(tmp_path), "--plot", png)
    assert rc == 2 and "already exists" in err and err.count("\n") == 1


def test_dump_plan_round_trips(capsys, tmp_path, report_json):
    cfg, _ = report_json
    out_dir = tmp_path / "plan"
    rc, out, err = run(capsys, "report", CONFIG, *base(tmp_path), "--dump-plan", out_dir,
                       "--parts-list", "2", "--chunks-list", "4", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert "plan written to" in err  # stdout stays one JSON document
    graph = load_data(cfg)
    with np.load(out_dir / "partition.npz", allow_pickle=False) as z:
        part, chunk, perm = z["part"], z["chunk"], z["perm"]
        chunk_ptr, m, n = z["chunk_ptr"], int(z["num_parts"]), int(z["num_chunks"])
        assert str(z["method"]) == "range"
    p = partition_graph(graph, 2, 4, method="range")
    ref_part, ref_chunk = p.assignment()
    assert (m, n) == (2, 4)
    np.testing.assert_array_equal(part, ref_part)
    np.testing.assert_array_equal(chunk, ref_chunk)
    np.testing.assert_array_equal(perm, p.perm)
    # the assignment alone rebuilds the renumbering: chunk (i, j) = one id range
    flat = part * n + chunk
    np.testing.assert_array_equal(np.argsort(flat, kind="stable"), perm)
    np.testing.assert_array_equal(np.searchsorted(flat[perm], np.arange(m * n + 1)), chunk_ptr)
    with np.load(out_dir / "plan.npz", allow_pickle=False) as z:
        plan = TransferPlan.from_npz_dict(z)
        assert str(z["order_name"]) == d["volumes"]["chosen"]
    assert plan.order.shape == (4, 2)
    g = p.apply(graph)
    again = plan_transfers(g.indptr, g.indices, p.chunk_ptr, 2, 4, order=plan.order)
    assert (again.v_ori, again.v_p2p, again.v_ru) == (plan.v_ori, plan.v_p2p, plan.v_ru)
    if d["volumes"]["chosen"] == "identity":
        np.testing.assert_array_equal(plan.order, identity_order(2, 4))
    assert plan.h2d_rows == d["volumes"]["plan"]["h2d_rows"]
    assert plan.plans[0].buffer_rows == d["memory"]["rows"][0]["buffer_rows"]
    rc, _, err = run(capsys, "report", CONFIG, *base(tmp_path), "--dump-plan", out_dir)
    assert rc == 2 and "not empty" in err and "--overwrite" in err
    rc, _, err = run(capsys, "report", CONFIG, *base(tmp_path), "--dump-plan", out_dir,
                     "--overwrite", "--parts-list", "2", "--chunks-list", "4")
    assert rc == 0, err


@pytest.mark.parametrize("args,phrase", [
    (["--parts-list", "2,x"], "--parts-list '2,x'"),
    (["--chunks-list", "0"], "--chunks-list '0'"),
    (["--alpha-seconds", "-1"], "--alpha-seconds '-1'"),
    (["--alpha-seconds", "soon"], "--alpha-seconds 'soon'"),
    (["engine.chunks=2000"], "engine.chunks=2000"),
])
def test_report_user_errors_are_one_line(capsys, tmp_path, args, phrase):
    rc, _, err = run(capsys, "report", CONFIG, *base(tmp_path), *args)
    assert rc == 2 and phrase in err and err.count("\n") == 1, err


# ------------------------------------------------------------ calibration
def test_calibrate_on_cpu_writes_json_and_refuses_to_overwrite(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "cal.json"
    rc, text, err = run(capsys, "calibrate", "-o", out, "--size", "4")
    assert rc == 0, err
    assert "no CUDA device: measured the CPU equivalents" in text and "GB/s" in text
    record = json.loads(out.read_text())
    assert record["device"] == "cpu"
    assert all(v > 0 for v in record["measurements"].values())
    assert set(record["throughput"]) == {"host_to_device", "reuse", "contiguous"}
    assert all(v > 0 for v in record["throughput"].values())
    before = out.read_text()
    rc, _, err = run(capsys, "calibrate", "-o", out, "--size", "4")
    assert rc == 2 and "already exists" in err and "--overwrite" in err
    assert out.read_text() == before
    rc, _, err = run(capsys, "calibrate", "-o", out, "--size", "4", "--overwrite")
    assert rc == 0, err


def test_throughput_auto_reads_the_calibration_file(tmp_path):
    cfg = load_config(CONFIG, base(tmp_path))
    tp = resolve_throughput(cfg.engine)
    assert (tp["host_to_device"], tp["device_to_device"], tp["reuse"]) == (21e9, 393e9, 2000e9)
    assert set(tp["source"].values()) == {"default"}
    cal = tmp_path / "cache" / "calibration.json"
    cal.parent.mkdir(parents=True, exist_ok=True)
    cal.write_text(json.dumps({"throughput": {"host_to_device": 50.0, "reuse": 900.0}}))
    cfg = load_config(CONFIG, base(tmp_path, "engine.throughput.reuse=1000"))
    tp = resolve_throughput(cfg.engine)
    assert tp["host_to_device"] == 50e9 and tp["source"]["host_to_device"] == str(cal)
    assert tp["reuse"] == 1000e9 and tp["source"]["reuse"] == "config"
    assert tp["device_to_device"] == 393e9 and tp["source"]["device_to_device"] == "default"
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    assert d["throughput"]["host_to_device"] == 50.0
    cal.write_text("{not json")
    with pytest.raises(UserError, match="not a calibration record"):
        resolve_throughput(cfg.engine)


@pytest.mark.parametrize("value,phrase", [
    ("0", "positive number of GB/s"), ("-3", "positive number of GB/s"),
    (".inf", "positive number of GB/s"), ("fast", "expected one of auto or float"),
    ("true", "expected one of auto or float"),
])
@pytest.mark.parametrize("key", ["host_to_device", "device_to_device", "reuse"])
def test_throughput_config_is_validated(key, value, phrase):
    with pytest.raises(UserError, match=phrase) as e:
        load_config(None, [f"engine.throughput.{key}={value}"])
    assert f"'engine.throughput.{key}'" in str(e.value)
    cfg = load_config(None, [f"engine.throughput.{key}=12.5"])
    assert getattr(cfg.engine.throughput, key) == 12.5
    assert load_config(None).engine.throughput.reuse == "auto"


def test_a_report_for_a_gpu_made_without_one_plans_the_gpu_run(tmp_path, monkeypatch):
    """``engine.accelerator=cuda`` on a machine without CUDA (a laptop planning for
    a server) plans the GPU's run, as the report made on the GPU machine does:
    the chunk count its estimate picks, the first layer's backward on layer 1's
    flushes and rows written in load order; not the CPU's run."""
    import torch

    from hongtu.nn import ops

    def report(*extra):
        cfg = load_config(CONFIG, base(tmp_path, "engine.chunks=auto", "engine.parts=1",
                                       "model.layers=3", "engine.device_memory=74.5MiB",
                                       "engine.resident=false", "engine.whole_layers=false",
                                       *extra))
        return build_report(cfg, parts_list=[], chunks_list=[]).data

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ops, "_triton", lambda kind="dropout": None)  # torch's CPU build
    laptop = report("engine.accelerator=cuda")
    cpu = report("engine.accelerator=cpu")
    assert any("planned as a GPU run" in n for n in laptop["notes"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU machine
    monkeypatch.setattr(ops, "_triton", lambda kind="dropout": object())
    server = report("engine.accelerator=cuda")
    for key in ("engine", "transfers", "memory", "cost"):
        assert laptop[key] == server[key], key
    # (no dropout masks: 2 chunks fit 74.5 MiB planned for a GPU, with about
    # half a MiB to spare, and not for the CPU)
    assert laptop["engine"]["chunks"] < cpu["engine"]["chunks"]
    layer1 = laptop["transfers"]["layers"][1]
    assert layer1["flush_bytes"] == 0 < cpu["transfers"]["layers"][1]["flush_bytes"]


@pytest.mark.parametrize("layers, mib, trains", [
    ("2", "70.74MiB", False), ("2", "70.80MiB", True), ("3", "71.01MiB", False),
    ("3", "71.07MiB", True)])
def test_a_count_fits_where_training_takes_it(tmp_path, layers, mib, trains):
    """The report's ``fits`` is training's test: a chunk count whose estimate
    before the plan (a chunk's whole neighbour set buffered) exceeds the budget
    is refused, although the plan's smaller buffer would fit it."""
    cfg = load_config(CONFIG, base(tmp_path, f"output.dir={tmp_path / 'run'}",
                                   f"engine.device_memory={mib}", f"model.layers={layers}"))
    row = build_report(cfg, parts_list=[], chunks_list=[]).data["memory"]["rows"][0]
    assert row["device_bytes"] <= parse_size(mib)  # (the planned estimate fits either way)
    assert row["fits"] == trains
    if trains:
        Trainer(cfg, out=lambda _: None)
    else:
        with pytest.raises(UserError, match=r"engine\.chunks=4 needs about"):
            Trainer(cfg, out=lambda _: None)


# ---------------------------------------------------------------- resident mode
def gpu_report(tmp_path, *extra):
    cfg = load_config(CONFIG, base(tmp_path, "engine.accelerator=cuda", "engine.parts=1",
                                   "engine.chunks=auto", "model.layers=3",
                                   f"output.dir={tmp_path / 'run'}", *extra))
    return cfg, build_report(cfg, parts_list=[], chunks_list=[]).data


def test_report_says_when_training_keeps_everything_on_the_gpu(tmp_path):
    """With a budget that holds every buffer and a batch, GPU training goes
    resident (``engine.resident: auto``): the report says so and with how many
    chunks; below that edge, or with ``engine.resident: false``, it plans out of
    core and says nothing; ``engine.resident: true`` that does not fit is the
    line training would stop with."""
    _, big = gpu_report(tmp_path, "engine.device_memory=70MiB")
    res = big["engine"]["resident"]
    assert res["resident"] and res["chunks"] == 48
    assert res["buffers_bytes"] < parse_size("70MiB")
    assert any(n.startswith("resident: every buffer") and "48 chunk(s)" in n
               for n in big["notes"])
    assert "resident: every buffer" in format_report(big)
    _, small = gpu_report(tmp_path, "engine.device_memory=69MiB")
    assert small["engine"]["resident"] == {**res, "resident": False, "chunks": None}
    assert not any(n.startswith("resident") for n in small["notes"])
    assert small["memory"]["suggested_chunks"] is not None  # (out of core it fits)
    _, off = gpu_report(tmp_path, "engine.device_memory=70MiB", "engine.resident=false")
    assert off["engine"]["resident"] is None
    assert off["transfers"] == big["transfers"]  # (the plan shown is the out-of-core one)
    _, forced = gpu_report(tmp_path, "engine.device_memory=69MiB", "engine.resident=true")
    assert any("training stops before its first epoch: engine.resident=true" in n
               for n in forced["notes"])
    _, cpu = gpu_report(tmp_path, "engine.device_memory=70MiB", "engine.accelerator=cpu")
    assert cpu["engine"]["resident"] is None  # (a CPU run is never resident)


@pytest.mark.gpu
@pytest.mark.parametrize("layer, mib", [("gcn", "69MiB"), ("gcn", "70MiB"), ("gcn", "72MiB"),
                                        ("gin", "80MiB"), ("gin", "90MiB"), ("gin", "120MiB")])
def test_report_resident_is_trainings(tmp_path, layer, mib):
    """The report's resident verdict, chunk count and kept update graphs are
    training's (GIN at 80 and 90 MiB keeps none, at 120 MiB keeps them)."""
    cfg, d = gpu_report(tmp_path, f"engine.device_memory={mib}", f"model.layer={layer}")
    trainer = Trainer(cfg, out=lambda _: None)
    res = d["engine"]["resident"]
    assert res["resident"] == trainer.resident
    if trainer.resident:
        assert res["chunks"] == trainer.partition.num_chunks
        assert res["kept_graph_layers"] == trainer.executor.kept_graphs
        assert res["kept_graph_bytes"] == trainer.graph_bytes


def test_report_says_which_update_graphs_a_resident_run_keeps(tmp_path, monkeypatch):
    """Resident, GIN keeps its updates' graphs where they fit beside the batches
    (120 MiB: at one chunk). Where the fewest chunks leave too little room, the
    count grows until they fit only by one chunk per ROWS_PER_EXTRA_CHUNK
    vertices: at 90 MiB 3 chunks would hold them and 1 the batches alone, so
    this graph of 3,000 vertices trains at 1 without them, and the report says
    why; allowed 2 more chunks it takes 3, allowed 1 it stays at 1. GCN with
    ReLU writes its backward out and keeps none."""
    import hongtu.engine.budget as budget

    def resident(mib, layer="gin"):
        _, d = gpu_report(tmp_path, f"engine.device_memory={mib}", f"model.layer={layer}")
        return d["engine"]["resident"], [n for n in d["notes"]
                                         if n.startswith("resident: the update graphs")]

    for mib, kept, chunks in (("120MiB", True, 1), ("90MiB", False, 1)):
        res, said = resident(mib)
        assert res["resident"] and res["chunks"] == chunks, (mib, res)
        assert (res["kept_graph_layers"] == [0, 1, 2]) == kept
        assert (res["kept_graph_bytes"] > 0) == kept
        assert len(said) == 1 and ("do not fit" in said[0]) != kept, said
        assert "(13.53 MiB)" in said[0]
    monkeypatch.setattr(budget, "ROWS_PER_EXTRA_CHUNK", 1500)  # (3,000 // 1,500: 2 more)
    res, said = resident("90MiB")
    assert res["chunks"] == 3 and res["kept_graph_layers"] == [0, 1, 2], res
    assert "do not fit" not in said[0]
    monkeypatch.setattr(budget, "ROWS_PER_EXTRA_CHUNK", 3000)  # (1 more)
    assert resident("90MiB")[0]["chunks"] == 1
    res, said = resident("120MiB", "gcn")
    assert res["kept_graph_layers"] == [] and not said


# ---------------------------------------------------------------- chunk counts
def row(chunks, bound, fits=True):
    return {"chunks": chunks, "lower_bound_s": bound, "fits": fits}


def test_fastest_count_is_the_fewest_near_the_lowest_bound():
    from hongtu.report import fastest_count

    # products-like GCN 3x256 at its suite budget (the report's bounds, ms):
    # 28, 32, 40 and 48 chunks measured 0.256, 0.255, 0.256, 0.270 s; 24: 0.268 s
    rows = [row(24, 433.44), row(28, 396.75), row(32, 381.21), row(40, 379.94),
            row(48, 382.55)]
    assert fastest_count(rows) == 32
    assert fastest_count(rows, margin=0.0) == 40
    # GCN 2x256: 16 measured fastest, 20's bound 0.1% lower
    assert fastest_count([row(16, 104.98), row(20, 104.85), row(24, 105.52)]) == 16
    # counts that do not fit are not candidates; none fitting gives None
    assert fastest_count([row(8, 1.0, fits=False), row(16, 2.0)]) == 16
    assert fastest_count([row(8, 1.0, fits=False)]) is None
    assert fastest_count([row(8, 1.0, fits=None)]) is None  # (no budget)


def test_report_names_the_predicted_fastest_count(tmp_path):
    """The memory table lists the two counts above the chosen one; where one of
    them is predicted faster by more than the margin, the text names it."""
    from hongtu.report import fastest_count

    cfg, _ = gpu_report(tmp_path, "engine.device_memory=70MiB", "engine.resident=false")
    mem = build_report(cfg, parts_list=[]).data["memory"]
    bound = {r["chunks"]: r["lower_bound_s"] for r in mem["rows"]}
    assert mem["chunks"] == mem["suggested_chunks"] == 6
    assert [c for c in bound if c > 6][:2] == [8, 12]
    fastest = mem["fastest_chunks"]
    assert fastest == fastest_count(mem["rows"]) in (8, 12)
    assert bound[fastest] < bound[6] / 1.02
    text = format_report(build_report(cfg, parts_list=[]).data)
    assert f"predicted fastest: engine.chunks={fastest} (lower bound" in text
    # with the chosen count predicted fastest, no such line
    cfg, _ = gpu_report(tmp_path, "engine.device_memory=80MiB", "engine.resident=false")
    d = build_report(cfg, parts_list=[]).data
    assert d["memory"]["fastest_chunks"] == d["memory"]["suggested_chunks"]
    assert "predicted fastest" not in format_report(d)


def test_own_rows_recomputed_only_below_the_degree(tmp_path, monkeypatch):
    """A GPU run out of core recomputes layers reading their own rows among their
    sources (checkpoint auto) only on graphs with fewer edges per vertex than
    OWN_RECOMPUTE_BELOW_DEGREE; the report plans it as training would."""
    from types import SimpleNamespace

    from hongtu.engine import executor
    from hongtu.engine.executor import resolved_checkpoint

    def graph_of(degree):
        return SimpleNamespace(num_edges=degree * 1000, num_nodes=1000)

    sparse, dense = graph_of(26), graph_of(494)
    # the graphs measured (H200, GIN and SAGE 2x256): recomputing was faster at
    # 26 and 61 edges per vertex, even or slower at 101, slower at 151, 221, 494
    for degree, mode in ((26, "own"), (61, "own"), (101, "auto"), (151, "auto"), (221, "auto")):
        assert resolved_checkpoint("auto", True, graph_of(degree)) == mode, degree
    assert resolved_checkpoint("auto", True, dense) == "auto"
    assert resolved_checkpoint("auto", False, sparse) == "auto"
    assert resolved_checkpoint("recompute", True, dense) == "recompute"
    cfg = load_config(CONFIG, base(tmp_path, "engine.accelerator=cuda", "model.layer=sage"))
    graph = load_data(cfg)
    assert graph.num_edges / graph.num_nodes < executor.OWN_RECOMPUTE_BELOW_DEGREE
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    assert d["model"]["cached"] == [False, False]
    monkeypatch.setattr(executor, "OWN_RECOMPUTE_BELOW_DEGREE", 1.0)
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    assert d["model"]["cached"] == [True, True]


@pytest.mark.parametrize("accelerator,precision,said", [
    ("cuda", "tf32", "fp32 (TF32 matrix products)"), ("cpu", "fp32", "fp32")])
def test_engine_line_names_tf32_products_for_a_gpu_run(tmp_path, accelerator, precision, said):
    """engine.tf32 is a GPU's: the report planned for one says its products are
    TF32, and for a CPU run says fp32."""
    cfg = load_config(CONFIG, base(tmp_path, "engine.tf32=true",
                                   f"engine.accelerator={accelerator}"))
    d = build_report(cfg, parts_list=[], chunks_list=[]).data
    assert d["engine"]["precision"] == precision
    assert any(line.endswith(f"checkpoint=auto, {said}") for line in format_report(d).splitlines())


def test_report_moves_no_bytes_of_layer_1s_aggregates_kept_on_the_device(tmp_path, monkeypatch):
    """Where layer 1's backward visits the steps in reverse (a GPU, one process,
    ``a^0`` stored once in its load order), the aggregates layer 1 makes for its
    forward pass's last chunk stay on the device for that backward
    (:func:`~hongtu.engine.executor.keeps_last_aggregate`): the report's epoch
    moves their bytes neither way, and nothing else changes. (The GPU variants
    of ``test_predicted_bytes_equal_what_the_engine_moves`` check the bytes
    against training's.)"""
    from hongtu.engine import executor

    # (room in the flush pieces for the reversed fold's index arrays)
    monkeypatch.setattr(executor, "flush_piece_spare", lambda *a, **kw: 1 << 40)
    args = ("engine.resident=false", "engine.whole_layers=false", "engine.chunks=8",
            "engine.ordered_inputs=false", "model.hidden=256", "data.path=builtin:rmat-16")
    _, kept = gpu_report(tmp_path, *args)
    monkeypatch.setattr(executor, "keeps_last_aggregate", lambda *a: False)
    _, plain = gpu_report(tmp_path, *args)
    a, b = kept["transfers"], plain["transfers"]
    moved = b["layers"][1]["aggregate_d2h_bytes"] - a["layers"][1]["aggregate_d2h_bytes"]
    assert moved > 0 and moved % (256 * 4) == 0  # (a chunk's rows of a^1)
    assert b["layers"][1]["aggregate_h2d_bytes"] - a["layers"][1]["aggregate_h2d_bytes"] == moved
    assert (b["epoch"]["h2d_bytes"] - a["epoch"]["h2d_bytes"],
            b["epoch"]["d2h_bytes"] - a["epoch"]["d2h_bytes"]) == (moved, moved)
    for x, y in zip(a["layers"], b["layers"]):
        if x["layer"] != 1:
            assert x == y
