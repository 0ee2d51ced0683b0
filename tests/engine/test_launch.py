"""Multi-process training through the real command: elastic launch, torchrun nodes, failures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from hongtu.config import load_config
from hongtu.report import build_report
from tests.conftest import REPO

CFG = str(REPO / "configs" / "gcn_example.yaml")
BASE = ["engine.accelerator=cpu", "model.hidden=16", "train.epochs=3", "engine.chunks=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hongtu(tmp, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hongtu", "train", CFG, *BASE,
                           f"engine.cache_dir={tmp}/cache", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def communicate_all(procs, timeout):
    """Every process's (stdout, stderr); past ``timeout`` seconds all are killed first.

    A node whose rank died leaves the other node's torchrun agent in its exit
    barrier for 300 s: the deadline stays below that, so the failing node's
    own output is what the test shows.
    """
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:  # the agent and its workers: each node is its own session
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            return [q.communicate() for q in procs]
    return outs


def records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process training the same two METIS parts."""
    tmp = tmp_path_factory.mktemp("one")
    out = hongtu(tmp, f"output.dir={tmp}/run", "engine.parts=2", "--metrics", f"{tmp}/m.jsonl")
    assert out.returncode == 0, out.stderr
    return records(tmp / "m.jsonl")


def assert_same_losses(recs, ref):
    assert len(recs) == len(ref)
    for a, b in zip(recs, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])


def test_two_ranks_match_one_process(tmp_path, one_process):
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2",
                 "--metrics", f"{tmp_path}/m.jsonl")
    assert out.returncode == 0, out.stderr
    recs = records(tmp_path / "m.jsonl")
    assert_same_losses(recs, one_process)
    assert out.stdout.count("epoch    1/3") == 1, "rank 0 alone reports"
    assert "waiting for the other processes" in out.stdout  # (the planning step's agreements)
    ranks = recs[-1]["ranks"]
    assert len(ranks) == 2 and all(r["d2d_rows"] > 0 and r["h2d_rows"] > 0 for r in ranks)
    assert recs[-1]["h2d_rows"] == sum(r["h2d_rows"] for r in ranks)
    assert (tmp_path / "run" / "model.pt").is_file()
    # hongtu report predicts the bytes between devices of every epoch (with its evaluation)
    cfg = load_config(CFG, [*BASE, f"engine.cache_dir={tmp_path}/cache", "engine.devices=2"])
    epoch = build_report(cfg, parts_list=[], chunks_list=[]).data["transfers"]["epoch"]
    assert epoch["d2d_bytes"] > 0
    for r in recs:
        assert r["d2d_bytes"] == epoch["d2d_bytes"] + epoch["evaluation_d2d_bytes"]


def test_two_ranks_plan_one_chunk_count_more_alike(tmp_path):
    """engine.chunks=auto under a budget where the fewest chunks that fit load
    rows again: both ranks plan the next count too (collectively) and take it,
    with the losses of one process at that count."""
    args = ["model.hidden=256", "model.layers=3", "engine.device_memory=72MiB"]
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2", *args,
                 "engine.chunks=auto", "--metrics", f"{tmp_path}/m.jsonl")
    assert out.returncode == 0, out.stderr
    said = [x for x in out.stdout.splitlines() if x.startswith("engine.chunks=auto: ")]
    assert len(said) == 1 and said[0].startswith("engine.chunks=auto: 12 chunks per part, "
                                                 "the fewest that fit") \
        and said[0].endswith(": 16 taken"), out.stdout
    assert "2 part(s) x 16 chunk(s)" in out.stdout
    ref = hongtu(tmp_path, f"output.dir={tmp_path}/ref", "engine.parts=2", *args,
                 "engine.chunks=16", "--metrics", f"{tmp_path}/ref.jsonl")
    assert ref.returncode == 0, ref.stderr
    assert_same_losses(records(tmp_path / "m.jsonl"), records(tmp_path / "ref.jsonl"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layer", ["gcn", "sage"])
def test_two_gpus_match_one_process_on_one_gpu(tmp_path, layer):
    """The command on two GPUs (NCCL, pinned host buffers), out of core under a
    budget where auto plans several chunks, gives the losses of one process
    training the same two parts on one GPU, and rows cross between the GPUs."""
    args = ["engine.accelerator=cuda", f"model.layer={layer}", "model.hidden=256",
            "model.layers=3", "engine.device_memory=72MiB", "engine.chunks=auto"]
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2", *args,
                 "--metrics", f"{tmp_path}/m.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    shape = re.search(r"device cuda:0: (\d+) part\(s\) x (\d+) chunk\(s\)", out.stdout)
    assert shape and shape[1] == "2" and int(shape[2]) > 1, out.stdout
    assert "\nhost buffers:\n" in out.stdout, out.stdout  # (out of core, not resident)
    recs = records(tmp_path / "m.jsonl")
    ranks = recs[-1]["ranks"]
    assert len(ranks) == 2 and all(r["d2d_rows"] > 0 for r in ranks)
    # (one GPU holds both parts' chunks of a batch: a larger budget, the same step)
    ref = hongtu(tmp_path, f"output.dir={tmp_path}/ref", "engine.parts=2", *args,
                 f"engine.chunks={shape[2]}", "engine.device_memory=4GiB",
                 "--metrics", f"{tmp_path}/ref.jsonl")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_same_losses(recs, records(tmp_path / "ref.jsonl"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_resident_gpus_match_one_process_on_one_gpu(tmp_path):
    """The command on two GPUs with every buffer on its device (engine.resident)
    and several chunks per part gives the losses of one process training the
    same two parts on one GPU; a rank stuck in an exchange fails the run
    after engine.timeout (on 4 H200s a resident R-MAT 2^22 run made no
    progress after its setup: bench/HISTORY.md, 2026-11-28, eighth)."""
    args = ["engine.accelerator=cuda", "model.layer=gcn", "model.hidden=256", "model.layers=3",
            "engine.device_memory=4GiB", "engine.chunks=4", "engine.timeout=90"]
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2",
                 "engine.resident=true", *args, "--metrics", f"{tmp_path}/m.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device buffers (resident" in out.stdout, out.stdout
    assert "2 part(s) x 4 chunk(s)" in out.stdout, out.stdout
    recs = records(tmp_path / "m.jsonl")
    assert all(r["d2d_rows"] > 0 for r in recs[-1]["ranks"])
    ref = hongtu(tmp_path, f"output.dir={tmp_path}/ref", "engine.parts=2", *args,
                 "--metrics", f"{tmp_path}/ref.jsonl")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_same_losses(recs, records(tmp_path / "ref.jsonl"))


def test_two_torchrun_nodes_on_loopback(tmp_path, one_process):
    """Two launchers, --nnodes 2, one process each, rendezvous on 127.0.0.1."""
    p = port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
           "1", "--master_addr", "127.0.0.1", "--master_port", str(p), "-m", "hongtu", "train",
           CFG, *BASE, f"engine.cache_dir={tmp_path}/cache", f"output.dir={tmp_path}/run",
           "--metrics", f"{tmp_path}/m.jsonl"]
    nodes = [subprocess.Popen(cmd[:3] + ["--node_rank", str(r)] + cmd[3:], cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for r in (0, 1)]
    outs = communicate_all(nodes, timeout=240)
    tails = "".join(f"\n--- node {r} (exit {n.returncode}):\n{o[0][-1500:]}{o[1][-3000:]}"
                    for r, (n, o) in enumerate(zip(nodes, outs)))
    assert [n.returncode for n in nodes] == [0, 0], tails
    assert_same_losses(records(tmp_path / "m.jsonl"), one_process)


def test_failure_in_one_rank_ends_all_ranks(tmp_path):
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2",
                 "model.layer=tests.engine.failing_layer:FailOnRank1", timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    # the launcher prints the rank's line once; torch's launcher records are not shown
    assert out.stderr.count("hongtu: error: rank 1: injected failure for the test") == 1
    assert "Traceback" not in out.stderr and "elastic" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "model.pt").exists()


def test_an_error_of_every_rank_is_one_line(tmp_path):
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2",
                 "engine.chunks=100000", timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("hongtu: error: ranks 0 and 1: part "), lines
    assert "use fewer parts" in lines[0]


def test_existing_results_are_refused_before_any_rank_starts(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.pt").write_bytes(b"earlier")
    out = hongtu(tmp_path, f"output.dir={tmp_path}/run", "engine.devices=2", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"hongtu: error: output.dir '{tmp_path}/run' already holds a run's results "
        "(model.pt); pass --overwrite to replace them, or set output.dir to a new directory"]
    assert (tmp_path / "run" / "model.pt").read_bytes() == b"earlier"


def test_ctrl_c_stops_every_rank_in_one_line(tmp_path):
    """Ctrl-C in a terminal signals the launcher and its ranks (one process group)."""
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "hongtu", "train", CFG, *BASE,
                          f"engine.cache_dir={tmp_path}/cache", f"output.dir={run}",
                          "engine.devices=2", "train.epochs=100000",
                          "output.checkpoint_every=1"],
                         cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoint.pt").exists() and p.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if not line.startswith("INFO ")]
    assert lines == [f"hongtu: stopped by SIGINT; every rank was stopped; the last checkpoint "
                     f"is {run}/checkpoint.pt: continue from it with hongtu train CONFIG "
                     "--resume"], err[-3000:]


def test_a_checkpoint_of_an_earlier_run_is_not_named(tmp_path):
    from hongtu.engine.launch import _stopped_line

    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"earlier")
    os.utime(ckpt, (1_000, 1_000))
    assert _stopped_line("SIGTERM", str(ckpt), 2_000) == (
        "hongtu: stopped by SIGTERM; every rank was stopped")
    assert str(ckpt) in _stopped_line("SIGTERM", str(ckpt), 0.0)  # (resumed from it)


def test_the_rank_that_failed_by_itself_is_named(tmp_path):
    """Ranks that end by their own error note it; the launcher names the first
    of them, whatever process it saw die first, and prints each line once."""
    from hongtu.engine.launch import _failure_lines, _own_failures

    assert _own_failures(str(tmp_path)) == []
    for rank, note, t in ((3, "2\nbad input", 1_000), (1, "1\n", 2_000),
                          (0, "2\nbad input", 3_000), (2, "2\nother", 4_000)):
        (tmp_path / str(rank)).write_text(note)
        os.utime(tmp_path / str(rank), ns=(t, t))
    own = _own_failures(str(tmp_path))
    assert own == [(3, 2, "bad input"), (1, 1, ""), (0, 2, "bad input"), (2, 2, "other")]
    assert _failure_lines(own) == ["hongtu: error: ranks 0 and 3: bad input",
                                   "hongtu: error: rank 2: other"]
    assert _failure_lines(own[1:2]) == [
        "hongtu: error: rank 1 failed (exit code 1); the other ranks were stopped; "
        "its message is above"]
