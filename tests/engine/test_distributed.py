"""Several ranks (gloo, CPU) give the loss and gradients of one process and of the reference.

Each world size is one process group that runs every job in turn (spawning is
the slow part), and the tests check the saved results.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.cases import CASES
from tests.engine.dist_worker import agree_rank, check_rank, run_rank
from tests.engine.test_oracle import (
    LAYERS,
    assert_matches,
    chunked_step,
    make_model,
    reference_step,
    three_layers,
)

ON = {"reuse": True, "p2p": True, "reorg": True}
OFF = {"reuse": False, "p2p": True, "reorg": False}  # p2p is how rows reach other ranks
LAYER_JOBS = [dict(case="skewed", layer=layer, chunks=2, checkpoint="auto", flags=flags)
              for flags in (ON, OFF) for layer in LAYERS]


def flags_name(flags: dict) -> str:
    return "dedup" if flags is ON else "no-reuse-no-reorg"


LAYER_IDS = [f"{j['layer']}-{flags_name(j['flags'])}" for j in LAYER_JOBS]
FLAG_JOBS = [dict(case="skewed", layer="sage", chunks=3, checkpoint=ck, flags=flags)
             for ck in ("auto", "recompute")
             for flags in ({"reuse": False, "p2p": True, "reorg": False}, ON)]
# later layers' rows written in first-load order (each rank its own rows)
ORDERED_JOBS = [dict(case="skewed", layer="gcn", chunks=3, checkpoint="auto", flags=flags,
                     ordered_rows=True) for flags in (ON, OFF)]
# own rows taken from the sources (a self-loop on every vertex)
OWN_JOBS = [dict(case="self_loops", layer=layer, chunks=3, checkpoint=ck, flags=ON)
            for layer in ("gat", "sage") for ck in ("auto", "recompute")]
# the first layer's backward run on layer 1's flushes (as on GPUs)
FOLD_JOBS = [dict(case="skewed", layer="gcn", chunks=3, checkpoint="auto", flags=flags,
                  first_in_flushes=True) for flags in (ON, OFF)]
# three layers, layer 1's rows made from the first layer's aggregates, stored
# once in its load order (as on GPUs; forced here)
ONCE_JOBS = [dict(case="skewed", layer="gcn", chunks=3, checkpoint="auto", flags=flags,
                  ordered_rows=True, first_in_flushes=True, three=True, narrow_rows=True)
             for flags in (ON, OFF)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# On GPUs, over NCCL with pinned host buffers: the layers with and without
# dedup, and the paths training takes on GPUs: the first layer's inputs in
# load order, rows kept across batches, later rows written in load order, the
# first layer's backward on the flushes, own rows from the sources. (Several
# ranks never move a layer whole: rows of other parts travel by the exchange.)
GPU_PATHS = dict(case="skewed", layer="gcn", chunks=5, checkpoint="auto", flags=ON,
                 ordered=True, cache_rows=40, ordered_rows=True, first_in_flushes=True)
GPU_OWN = dict(case="self_loops", layer="sage", chunks=5, checkpoint="auto", flags=ON,
               ordered=True, cache_rows=40)
GPU_JOBS = (LAYER_JOBS + [GPU_PATHS, GPU_OWN, dict(GPU_OWN, layer="gat")]
            + OWN_JOBS + FOLD_JOBS + [dict(ONCE_JOBS[0], narrow_rows=None)])
GPU_IDS = (LAYER_IDS + ["gcn-gpu-paths", "sage-own-rows-kept-ordered", "gat-own-rows-kept-ordered"]
           + [f"own-rows-{j['layer']}-{j['checkpoint']}" for j in OWN_JOBS]
           + [f"fold-{flags_name(j['flags'])}" for j in FOLD_JOBS]
           + ["gcn3-aggregates-once"])


# Resident: each rank's buffers on its GPU, as training keeps them where
# they fit (rows of other parts still come by the exchange). Their own
# process groups, each rank failing after 120 s in a collective that does not
# complete: on 4 H200s, R-MAT 2^22 GCN 3x256 resident at 8 GiB made no
# progress after its setup (bench/HISTORY.md, 2026-11-28, eighth).
GPU_RESIDENT_JOBS = [dict(case="skewed", layer="gcn", chunks=5, checkpoint="auto", flags=ON,
                          first_in_flushes=True, resident=True),
                     dict(case="skewed", layer="gcn", chunks=5, checkpoint="auto", flags=ON,
                          first_in_flushes=True, resident=True, three=True),
                     dict(case="self_loops", layer="sage", chunks=5, checkpoint="auto",
                          flags=ON, resident=True)]
GPU_RESIDENT_IDS = ["gcn", "gcn3", "sage-own-rows"]


def run_world(tmp_path, world: int, jobs: list[dict],
              accelerator: str = "cpu") -> list[list[dict]]:
    mp.spawn(run_rank, args=(world, free_port(), str(tmp_path), jobs, accelerator),
             nprocs=world, join=True)
    return [[torch.load(tmp_path / f"job{k}-rank{r}.pt", weights_only=True)
             for r in range(world)] for k in range(len(jobs))]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_world(tmp_path_factory.mktemp("w2"), 2,
                     LAYER_JOBS + FLAG_JOBS + ORDERED_JOBS + OWN_JOBS + FOLD_JOBS + ONCE_JOBS)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_world(tmp_path_factory.mktemp("w4"), 4, LAYER_JOBS)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-gpus", "4-gpus"])
def nccl(request, tmp_path_factory):
    """Every GPU job on 2 and on 4 ranks, one GPU each (skipped without them)."""
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} present")
    return world, run_world(tmp_path_factory.mktemp(f"nccl{world}"), world, GPU_JOBS, "cuda")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-gpus", "4-gpus"])
def nccl_resident(request, tmp_path_factory):
    """The resident GPU jobs on 2 and on 4 ranks, one GPU each (skipped without them)."""
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} present")
    return world, run_world(tmp_path_factory.mktemp(f"resident{world}"), world,
                            GPU_RESIDENT_JOBS, "cuda")


def job_model(job: dict):
    """The model a job trains (as :func:`~tests.engine.dist_worker.run_job` makes it)."""
    return three_layers(job["layer"], True) if job.get("three") else make_model(job["layer"])


def check_job(ranks: list[dict], job: dict, world: int) -> None:
    """Each rank's loss and gradients are those of one process over all parts
    and of the in-memory reference, whichever paths the executor's rows took."""
    graph = CASES[job["case"]](seed=1)
    single = job_model(job)
    res, g, _ = chunked_step(single, graph, world, job["chunks"], job["checkpoint"],
                             assignment=np.arange(graph.num_nodes) % world, **job["flags"])
    ref_loss, ref_grads = reference_step(single, g)
    for r in ranks:  # every rank holds the all-reduced loss and gradients
        assert abs(r["loss"] - res.loss) <= 1e-5 * abs(res.loss)
        model = job_model(job)
        for name, p in model.named_parameters():
            p.grad = r["grads"][name]
        assert_matches(model, r["loss"], ref_loss, ref_grads)


@pytest.mark.parametrize("k", range(len(LAYER_JOBS)), ids=LAYER_IDS)
def test_two_ranks_match_one_process_and_the_reference(two, k):
    check_job(two[k], LAYER_JOBS[k], 2)


@pytest.mark.parametrize("k", range(len(LAYER_JOBS)), ids=LAYER_IDS)
def test_four_ranks_match_one_process_and_the_reference(four, k):
    check_job(four[k], LAYER_JOBS[k], 4)


@pytest.mark.parametrize("k", range(len(FLAG_JOBS)))
def test_dedup_switches_and_counted_rows(two, k):
    job = FLAG_JOBS[k]
    ranks = two[len(LAYER_JOBS) + k]
    check_job(ranks, job, 2)
    L = 2
    for r in ranks:
        ev = r["eval_traffic"]
        # evaluation: every layer loads the planned rows from host and its own
        # destination rows (SAGE reads them), and sends the planned rows to the peer
        assert ev["h2d_rows"] == L * (r["loads"] + r["own_rows"])
        assert ev["d2d_rows"] == L * r["sends"]
        assert ev["d2h_rows"] == (L - 1) * r["own_rows"] + r["own_rows"]
    if job["flags"]["reuse"]:  # (rows received at one step and read at the next stay,
        # some steps' rows entering the receive area past its first rows)
        assert all(r["received_kept"] > 0 for r in ranks)
        assert any(r["received_elsewhere"] > 0 for r in ranks)
    else:
        assert all(r["received_kept"] == 0 == r["received_elsewhere"] for r in ranks)
    assert ranks[0]["total"] == ranks[1]["total"]  # accuracy counts are reduced over ranks
    assert ranks[0]["total"]["train"] == int(CASES["skewed"](seed=1).train_mask.sum())


@pytest.mark.parametrize("k", range(len(ORDERED_JOBS)))
def test_ranks_write_later_rows_in_load_order(two, k):
    """Each rank writes its own part's later-layer rows in the order its plan
    first loads them; the step still matches one process and the reference."""
    job = ORDERED_JOBS[k]
    ranks = two[len(LAYER_JOBS) + len(FLAG_JOBS) + k]
    assert all(r["ordered_rows"] == [1] for r in ranks)
    check_job(ranks, job, 2)


@pytest.mark.parametrize("k", range(len(OWN_JOBS)))
def test_ranks_take_own_rows_from_their_sources(two, k):
    """Each rank's chunks take their own rows from their sources (received
    from the peer or loaded) and add their gradients at their slots; the step
    still matches one process and the reference."""
    job = OWN_JOBS[k]
    ranks = two[len(LAYER_JOBS) + len(FLAG_JOBS) + len(ORDERED_JOBS) + k]
    # (forward steps take them from the device in every layer: with several
    # ranks even a cached first layer gathers its sources; backward steps where
    # they gather their sources, GAT and recomputed layers)
    own = [0, 1]
    assert all(r["own_from_sources"] == own for r in ranks)
    check_job(ranks, job, 2)


def test_ranks_agree_whether_to_train_resident(tmp_path):
    """Each process weighs its own part's buffers and budget; they train
    resident only where all would, at the most chunks any needs, each with
    its own room, and otherwise all out of core with the budget (a process of
    several acting alone would exchange rows no peer expects)."""
    cases = [[(True, 10, 3), (True, 20, 5)],
             [(True, 10, 3), (False, 1000, None)],
             [(True, 10, None), (True, 20, None)],
             [(True, 10, None), (True, 20, 4)],  # (every rank takes part in each agreement)
             [(False, 1000, None), (False, 1000, None)]]
    mp.spawn(agree_rank, args=(2, free_port(), str(tmp_path), cases), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"agree-rank{r}.pt") for r in range(2)]
    assert got[0] == [(True, 10, 5), (False, 1000, None), (True, 10, None), (True, 10, 4),
                      (False, 1000, None)]
    assert got[1] == [(True, 20, 5), (False, 1000, None), (True, 20, None), (True, 20, 4),
                      (False, 1000, None)]


def test_ranks_stop_together_where_their_plans_differ(tmp_path):
    """Plans that differ in what the executor's collectives follow stop every
    process at setup with one line, instead of each waiting on exchanges no
    peer makes (the 4-GPU stop: chunk counts 6 and 8)."""
    a = (True, 8, 16, [True, True, True], 10, 7)   # rank 0 sends 10, receives 7
    b = (True, 8, 16, [True, True, True], 7, 10)
    cases = [[a, b],
             [a, (True, 6, 12, [True, True, True], 7, 10)],   # chunk counts (the stop)
             [a, (False, 8, 16, [True, True, True], 7, 10)],  # resident on one only
             [a, (True, 8, 16, [True, False, True], 7, 10)],  # one recomputes a layer
             [a, (True, 8, 16, [True, True, True], 7, 9)]]    # rows no peer sends
    mp.spawn(check_rank, args=(2, free_port(), str(tmp_path), cases), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"check-rank{r}.pt") for r in range(2)]
    assert got[0][0] == got[1][0] == "ok"
    for r in range(2):
        for line in got[r][1:]:
            assert line.startswith("the processes planned differently") and "bug" in line
    assert "8 chunks" in got[0][1] and "6 chunks" in got[1][1]
    assert "send 17 rows a pass and receive 17" in got[0][3]
    assert "send 17 rows a pass and receive 16" in got[1][4]


def test_comm_leaves_only_the_group_it_joined(monkeypatch):
    """close() tears down a group init_from_env created, never one the caller made."""
    import torch.distributed as dist

    from hongtu.engine.comm import init_from_env

    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                     WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    try:
        comm = init_from_env(cuda=False, timeout_s=30)
        assert comm.owned and dist.is_initialized()
        comm.close()
        assert not dist.is_initialized()
        comm.close()  # a second close is a no-op
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo")
        theirs = init_from_env(cuda=False, timeout_s=30)
        assert not theirs.owned
        theirs.close()
        assert dist.is_initialized()
    finally:  # no group outlives the test, whatever failed
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("k", range(len(FOLD_JOBS)))
def test_ranks_run_the_first_backward_on_their_flushes(two, k):
    """Each rank runs the first layer's backward on the gradient rows it
    flushes (its own rows' partial sums, those received from the peer among
    them); the all-reduced gradients still match one process and the
    reference."""
    job = FOLD_JOBS[k]
    ranks = two[len(LAYER_JOBS) + len(FLAG_JOBS) + len(ORDERED_JOBS) + len(OWN_JOBS) + k]
    assert all(r["first_in_flushes"] for r in ranks)
    check_job(ranks, job, 2)


@pytest.mark.parametrize("k", range(len(ONCE_JOBS)))
def test_ranks_store_the_first_aggregates_once(two, k):
    """Each rank stores its own part's first-layer aggregates once, in the
    order its layer 1 first loads them, and gathers them for the first
    layer's backward on its flushes through their positions (several ranks
    keep layer 1's backward in step order: it returns received rows'
    gradients as they leave); the all-reduced step still matches one process
    and the reference."""
    job = ONCE_JOBS[k]
    ranks = two[len(LAYER_JOBS) + len(FLAG_JOBS) + len(ORDERED_JOBS) + len(OWN_JOBS)
                + len(FOLD_JOBS) + k]
    assert all(r["aggregates_once"] and r["first_in_flushes"] and not r["reversed"]
               for r in ranks)
    check_job(ranks, job, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("k", range(len(GPU_JOBS)), ids=GPU_IDS)
def test_gpu_ranks_over_nccl_match_one_process_and_the_reference(nccl, k):
    """One rank per GPU, rows between GPUs over NCCL, host rows pinned: the
    step matches one process and the reference, and the jobs meant to take a
    GPU path take it."""
    world, results = nccl
    job, ranks = GPU_JOBS[k], results[k]
    check_job(ranks, job, world)
    for r in ranks:
        if job.get("ordered"):
            assert r["ordered_input_bytes"] > 0
        if job.get("cache_rows"):
            assert r["cached_rows"] > 0
        if job.get("ordered_rows"):
            assert 1 in r["ordered_rows"] if job.get("three") else r["ordered_rows"] == [1]
        if job.get("first_in_flushes"):
            assert r["first_in_flushes"]
        if job.get("three"):  # (narrow layer-1 rows by default on GPUs)
            assert r["aggregates_once"]
    assert sum(r["traffic"]["d2d_rows"] for r in ranks) > 0  # (rows crossed between GPUs)
    if job["flags"]["reuse"]:  # (rows received at one step and read at the next stay)
        assert all(r["received_kept"] > 0 for r in ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("k", range(len(GPU_RESIDENT_JOBS)), ids=GPU_RESIDENT_IDS)
def test_resident_gpu_ranks_match_one_process_and_the_reference(nccl_resident, k):
    """Each rank's buffers on its own GPU (not one process's direct mode: rows
    of other parts travel by the exchange): the step matches one process and
    the reference."""
    world, results = nccl_resident
    job, ranks = GPU_RESIDENT_JOBS[k], results[k]
    assert all(r["resident"] for r in ranks)
    if job.get("first_in_flushes"):
        assert all(r["first_in_flushes"] for r in ranks)
    check_job(ranks, job, world)
