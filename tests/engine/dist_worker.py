"""One rank of a multi-process test run (spawned by tests/engine/test_distributed.py).

Trains one step of a test case with rank ``r`` owning part ``r`` (its host
rows only), exchanging rows over gloo, and writes loss, gradients and the
rank's traffic to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hongtu.engine import BufferPlan, ChunkSet, Executor, HostBuffers
from hongtu.engine.comm import init_from_env
from hongtu.graph.transforms import has_self_loops
from hongtu.partition import chunk_partition
from hongtu.reorg import plan_batches
from tests.cases import CASES


def run_rank(rank: int, world: int, port: int, out: str, jobs: list[dict]) -> None:
    """Run every job (case, layer, chunks, checkpoint, flags) in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    comm = init_from_env(cuda=False, timeout_s=60)
    torch.set_num_threads(1)
    for k, job in enumerate(jobs):
        torch.save(run_job(rank, world, comm, **job), os.path.join(out, f"job{k}-rank{rank}.pt"))
    comm.close()


def run_job(rank, world, comm, case: str, layer: str, chunks: int, checkpoint: str,
            flags: dict, ordered_rows: bool = False, first_in_flushes: bool = False) -> dict:
    """One step and one evaluation of a job on this rank (own rows taken from the
    sources where the case has a self-loop on every vertex, as training has it)."""
    from tests.engine.test_oracle import make_model

    graph = CASES[case](seed=1)
    model = make_model(layer)
    p = chunk_partition(graph, np.arange(graph.num_nodes) % world, chunks, num_parts=world)
    g = p.apply(graph)
    _, plan = plan_batches(g.indptr, g.indices, p.chunk_ptr, world, chunks, devices=world,
                           **flags)
    a, b = int(p.part_ptr[rank]), int(p.part_ptr[rank + 1])
    cs = ChunkSet.build(g, p.chunk_ptr, world, chunks, part=rank)
    cached = model.stored_aggregates(checkpoint)
    buf = HostBuffers(BufferPlan(b - a, model.row_widths(), cached), g.x[a:b], pin=False)
    masks = {k: torch.from_numpy(getattr(g, f"{k}_mask")[a:b]) for k in ("train", "val", "test")}
    ex = Executor(model, cs, buf, torch.from_numpy(g.y[a:b]), masks, torch.device("cpu"),
                  plan.plans[rank], checkpoint=checkpoint, seed=0, comm=comm,
                  num_train=int(g.train_mask.sum()), ordered_rows=ordered_rows,
                  first_in_flushes=first_in_flushes,
                  own_in_sources=flags.get("p2p", True) and has_self_loops(g)
                  and any(x.needs_dst for x in model.layers))
    res = ex.step(3)
    step_traffic = ex.mover.traffic.as_dict()
    ex.mover.traffic.reset()
    ev = ex.evaluate(0)
    return {"loss": res.loss, "grads": {n: q.grad for n, q in model.named_parameters()},
            "traffic": step_traffic, "eval_traffic": ex.mover.traffic.as_dict(),
            "correct": ev.correct, "total": ev.total,
            "loads": int(plan.plans[rank].load_ids.shape[0]),
            "sends": int(plan.plans[rank].send_ids.shape[0]),
            "own_rows": b - a, "ordered_rows": ex.ordered_rows,
            "own_from_sources": ex.own_rows_from_sources,
            "first_in_flushes": ex.first_in_flushes}
