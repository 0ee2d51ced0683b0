"""The trainer's setup accounting: where the time before the first epoch went."""

from __future__ import annotations

import math
import os

import pytest

from hongtu.config import load_config
from hongtu.engine.trainer import ALLOC_CONF_VARS, Trainer
from tests.conftest import REPO


def test_setup_times_add_up(tmp_path):
    cfg = load_config(REPO / "configs" / "gcn_example.yaml",
                      [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                       "engine.accelerator=cpu", "model.hidden=16", "engine.chunks=3"])
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    times, split = tr.setup_times, tr.other_split
    assert set(times) == {"load_s", "partition_s", "plan_s", "other_s"}
    assert set(split) == {"renumber_s", "blocks_s", "buffers_s", "executor_s"}
    assert all(v >= 0 for v in [*times.values(), *split.values()])
    assert math.isclose(sum(times.values()), tr.preprocess_s, rel_tol=1e-9)
    assert sum(split.values()) <= times["other_s"] + 1e-9  # parts of the rest, timed inside it
    # one process: no waits; the chunk-count search left the neighbour sets, or
    # they were computed inside the planning step
    assert tr.plan_split["waits_s"] == 0 and 0 <= tr.plan_split["sets_s"] <= times["plan_s"]


def test_setup_names_the_layers_moved_whole(tmp_path):
    """The setup lines say which layers move all their rows, as the executor has it."""
    lines = []
    base = [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
            "engine.accelerator=cpu", "model.hidden=16", "engine.chunks=3"]
    tr = Trainer(load_config(REPO / "configs" / "gcn_example.yaml", base), overwrite=True,
                 out=lines.append)
    assert tr.executor.whole_layers  # (a small graph: its rows fit)
    named = ", ".join(map(str, tr.executor.whole_layers))
    said = "\n".join(lines).splitlines()
    assert f"layers moving all their rows per pass (engine.whole_layers): {named}" in said
    kept = "kept on the device from pass to pass in training (not moved): "
    assert kept + ", ".join(tr.executor.kept_on_device) in said
    assert "grad h^2" in tr.executor.kept_on_device  # (GCN: the last layer is cached)
    # ... and gradients kept there get no host buffer
    for name in ("grad h^1", "grad h^2"):
        assert (name in tr.executor.kept_on_device) == (not any(
            x.strip().startswith(name + " ") for x in said))
    assert tr.executor.buf.grad[2] is None
    tr.run_epoch(0, evaluate=True)  # (a step and an evaluation without them)
    assert tr.executor.ordered_input_bytes == 0  # (CPU: no ordered copy)
    lines.clear()
    off = Trainer(load_config(REPO / "configs" / "gcn_example.yaml",
                              [*base, "engine.whole_layers=false"]), overwrite=True,
                  out=lines.append)
    assert off.executor.whole_layers == []
    assert not any("all their rows" in x for x in lines)
    # (the second layer moves the plan's rows: its last step's gradients wait
    # on the device for the first layer's backward)
    assert kept + "the last step's grad h^1 rows" in "\n".join(lines).splitlines()


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_first_backward_runs_on_layer_1_flushes_on_gpus(tmp_path, accelerator):
    """Out of core on a GPU, a GCN's first layer has no backward pass of its
    own: layer 1's runs it on its gradient flushes, ∇h^1 gets no host buffer
    and the setup says so; on a CPU (no link bytes to save) it keeps its pass."""
    lines = []
    cfg = load_config(REPO / "configs" / "gcn_example.yaml",
                      [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                       f"engine.accelerator={accelerator}", "model.hidden=16",
                       "engine.chunks=3", "engine.resident=false", "engine.whole_layers=false"])
    tr = Trainer(cfg, overwrite=True, out=lines.append)
    gpu = accelerator == "cuda"
    assert tr.executor.first_in_flushes == gpu and (tr.executor.buf.grad[1] is None) == gpu
    said = "\n".join(lines).splitlines()
    assert ("first layer's backward run on layer 1's gradient flushes (grad h^1 never "
            "goes to host memory)" in said) == gpu
    assert any(x.strip().startswith("grad h^1 ") for x in said) != gpu
    res = tr.run_epoch(0, evaluate=True)
    assert math.isfinite(res["loss"])


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_auto_recomputes_layers_reading_own_rows_among_their_sources(tmp_path, accelerator):
    """checkpoint auto out of core on a GPU: with a self-loop on every vertex (the
    example's data.self_loops) and p2p, layers that read their own rows (SAGE)
    are recomputed, not cached; without p2p (own rows copied), resident, or on
    a CPU (no link to spare) they stay cached; recompute as asked."""
    def executor(*extra):
        cfg = load_config(REPO / "configs" / "gcn_example.yaml",
                          [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                           f"engine.accelerator={accelerator}", "model.hidden=16",
                           "engine.chunks=3", "engine.resident=false", "model.layer=sage",
                           *extra])
        return Trainer(cfg, overwrite=True, out=lambda s: None).executor

    gpu = accelerator == "cuda"
    assert executor().cached == [not gpu, not gpu]
    assert executor().own_rows_from_sources == [0, 1]
    assert executor("engine.dedup.p2p=false").cached == [True, True]
    assert executor("model.layer=gcn").cached == [True, True]  # (reads no own rows)
    assert executor("engine.checkpoint=recompute").cached == [False, False]
    if gpu:
        assert executor("engine.resident=auto").cached == [True, True]  # (it fits)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [2, 3])
def test_training_allocates_no_more_than_the_estimate(tmp_path, layers):
    """What training holds on the GPU stays under the estimate it was planned
    with, and training runs with PyTorch's allocator limited to the budget (a
    GPU the size of ``engine.device_memory``): a GCN with a 256-wide hidden
    layer on an R-MAT graph, the budget filled with kept rows. (Counting a
    cached hidden layer's sources once, as it holds them, ran 8% faster on
    products-like but ran out of memory under such a cap: the allocator found
    no room among its free pieces for a 256-wide row per source of the largest
    chunk; ``bench/HISTORY.md``, 2026-11-25, last.)"""
    import torch

    from hongtu.graph.datasets import BUILTIN_DATASETS, BuiltinDataset
    from hongtu.graph.generators import rmat_graph
    from hongtu.graph.transforms import add_self_loops

    graph = add_self_loops(rmat_graph(17, 16, 64, 8, seed=0))
    BUILTIN_DATASETS["rmat17_budget"] = BuiltinDataset("rmat17_budget", lambda: graph)
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + (1 << 30)) / total))
        cfg = load_config(REPO / "configs" / "gcn_example.yaml", [
            "data.path=builtin:rmat17_budget", "data.undirected=false", "data.self_loops=false",
            f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
            "engine.accelerator=cuda", "model.hidden=256", f"model.layers={layers}",
            "engine.partitioner=range", "engine.chunks=4", "engine.device_memory=1GiB",
            "engine.resident=false"])
        tr = Trainer(cfg, overwrite=True, out=lambda s: None)
        assert tr.transfer_plan.cached_rows > 0  # (the budget's rest keeps rows)
        for epoch in range(2):
            tr.run_epoch(epoch, evaluate=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= tr.estimate <= 1 << 30, (peak, tr.estimate)
        if not any("expandable_segments" in os.environ.get(v, "") for v in ALLOC_CONF_VARS):
            # (the trainer turned them on: its segments are expandable)
            assert tr.expandable
            assert any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del BUILTIN_DATASETS["rmat17_budget"]


def tf32_at_steps(tr, monkeypatch) -> list[bool]:
    """PyTorch's TF32 flag as each of the trainer's executor steps starts."""
    import torch

    seen = []
    step = tr.executor.step
    monkeypatch.setattr(tr.executor, "step", lambda *a, **k: seen.append(
        torch.backends.cuda.matmul.allow_tf32) or step(*a, **k))
    return seen


@pytest.mark.parametrize("conf, turned_on, result", [
    ({}, True, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}, False, True),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:false"}, False, False),
])
def test_expandable_segments_unless_the_environment_says(monkeypatch, conf, turned_on, result):
    """The trainer turns on the allocator's expandable segments on a GPU; an
    environment that already says whether to use them is left as it is."""
    import torch

    from hongtu.engine import trainer

    calls = []
    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in conf.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append,
                        raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    assert trainer.use_expandable_segments() is result
    assert calls == (["expandable_segments:True"] if turned_on else [])


def test_tf32_is_a_gpu_setting_set_for_the_run_alone(tmp_path, monkeypatch):
    """engine.tf32: on a CPU a line says it has no effect and PyTorch's flag is not
    touched; on a GPU the flag is on inside the run's work and restored after."""
    import torch

    lines = []
    cfg = load_config(REPO / "configs" / "gcn_example.yaml",
                      [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                       "engine.accelerator=cpu", "model.hidden=16", "engine.chunks=3",
                       "engine.tf32=true"])
    tr = Trainer(cfg, overwrite=True, out=lines.append)
    assert "engine.tf32 has no effect on cpu (TF32 is a GPU's)" in "\n".join(lines)
    seen = tf32_at_steps(tr, monkeypatch)
    before = torch.backends.cuda.matmul.allow_tf32
    tr.run_epoch(0)
    assert seen == [before]
    # (a GPU's: the device as the trainer sees it; the flag itself needs no GPU)
    monkeypatch.setattr(tr, "device", torch.device("cuda"))
    with tr.matmul_precision():
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before
    with pytest.raises(RuntimeError), tr.matmul_precision():
        raise RuntimeError("the run failed")
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.gpu
def test_tf32_on_inside_a_gpu_epoch(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = load_config(REPO / "configs" / "gcn_example.yaml",
                      [f"output.dir={tmp_path}", f"engine.cache_dir={tmp_path}/cache",
                       "engine.accelerator=cuda", "model.hidden=16", "engine.tf32=true"])
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    seen = tf32_at_steps(tr, monkeypatch)
    before = torch.backends.cuda.matmul.allow_tf32
    tr.run_epoch(0)
    assert seen == [True] and torch.backends.cuda.matmul.allow_tf32 == before
