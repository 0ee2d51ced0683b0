"""One rank of a multi-process test run (spawned by tests/engine/test_distributed.py).

Trains one step of a test case with rank ``r`` owning part ``r`` (its host
rows only), exchanging rows over gloo on the CPU or NCCL on GPU ``r`` (pinned
host buffers), and writes loss, gradients and the rank's traffic to
``OUT/job{k}-rank{r}.pt``.
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


def run_rank(rank: int, world: int, port: int, out: str, jobs: list[dict],
             accelerator: str = "cpu") -> None:
    """Run every job (case, layer, chunks, checkpoint, flags) in one process group
    (``accelerator``: ``"cpu"``, gloo; ``"cuda"``, NCCL with this rank on GPU ``rank``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cuda = accelerator == "cuda"
    comm = init_from_env(cuda=cuda, timeout_s=120)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    for k, job in enumerate(jobs):
        torch.save(run_job(rank, world, comm, device=device, **job),
                   os.path.join(out, f"job{k}-rank{rank}.pt"))
    comm.close()


def agree_rank(rank: int, world: int, port: int, out: str, cases: list[list[tuple]]) -> None:
    """Each case's :func:`~hongtu.engine.trainer.agree_resident` of this rank's
    choice (``case[rank]``) and a budget of 1000, over gloo, into ``OUT/agree-rank{r}.pt``."""
    from hongtu.engine.trainer import agree_resident

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    comm = init_from_env(cuda=False, timeout_s=60)
    torch.save([agree_resident(comm, case[rank], 1000) for case in cases],
               os.path.join(out, f"agree-rank{rank}.pt"))
    comm.close()


def check_rank(rank: int, world: int, port: int, out: str, cases: list[list[tuple]]) -> None:
    """Each case's :func:`~hongtu.engine.trainer.check_plans_agree` of this rank's
    plan (``case[rank]``), over gloo: ``"ok"`` or the error's line per case, into
    ``OUT/check-rank{r}.pt``."""
    from hongtu.engine.trainer import check_plans_agree

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    comm = init_from_env(cuda=False, timeout_s=60)
    got = []
    for case in cases:
        try:
            check_plans_agree(comm, *case[rank])
            got.append("ok")
        except RuntimeError as err:
            got.append(str(err))
    torch.save(got, os.path.join(out, f"check-rank{rank}.pt"))
    comm.close()


def run_job(rank, world, comm, case: str, layer: str, chunks: int, checkpoint: str,
            flags: dict, ordered_rows: bool = False, first_in_flushes: bool = False,
            ordered: bool = False, cache_rows: int = 0, three: bool = False,
            narrow_rows: bool | None = None, device: torch.device | None = None,
            resident: bool = False) -> dict:
    """One step and one evaluation of a job on this rank (own rows taken from the
    sources where the case has a self-loop on every vertex, as training has it;
    ``ordered``: the first layer loads from a copy of its inputs in load order;
    ``cache_rows``: spare slots for rows kept across batches; ``three``: three
    layers, 6 -> 16 -> 16 -> 3; ``narrow_rows``: the Executor's; ``resident``:
    this rank's buffers on its device, as training keeps them where they fit)."""
    from tests.engine.test_oracle import make_model, three_layers

    device = device or torch.device("cpu")
    graph = CASES[case](seed=1)
    model = (three_layers(layer, True) if three else make_model(layer)).to(device)
    p = chunk_partition(graph, np.arange(graph.num_nodes) % world, chunks, num_parts=world)
    g = p.apply(graph)
    _, plan = plan_batches(g.indptr, g.indices, p.chunk_ptr, world, chunks, devices=world,
                           cache_rows=cache_rows, **flags)
    a, b = int(p.part_ptr[rank]), int(p.part_ptr[rank + 1])
    cs = ChunkSet.build(g, p.chunk_ptr, world, chunks, part=rank)
    cached = model.stored_aggregates(checkpoint)
    buf = HostBuffers(BufferPlan(b - a, model.row_widths(), cached), g.x[a:b],
                      pin=device.type == "cuda", device=device if resident else None)
    masks = {k: torch.from_numpy(getattr(g, f"{k}_mask")[a:b]) for k in ("train", "val", "test")}
    ex = Executor(model, cs, buf, torch.from_numpy(g.y[a:b]), masks, device,
                  plan.plans[rank], checkpoint=checkpoint, seed=0, comm=comm,
                  num_train=int(g.train_mask.sum()), ordered_inputs=ordered,
                  ordered_rows=ordered_rows,
                  first_in_flushes=first_in_flushes, narrow_rows=narrow_rows,
                  own_in_sources=flags.get("p2p", True) and has_self_loops(g)
                  and any(x.needs_dst for x in model.layers))
    res = ex.step(3)
    step_traffic = ex.mover.traffic.as_dict()
    ex.mover.traffic.reset()
    ev = ex.evaluate(0)
    return {"loss": res.loss, "grads": {n: q.grad.cpu() for n, q in model.named_parameters()},
            "traffic": step_traffic, "eval_traffic": ex.mover.traffic.as_dict(),
            "correct": ev.correct, "total": ev.total,
            "loads": int(plan.plans[rank].load_ids.shape[0]),
            "sends": int(plan.plans[rank].send_ids.shape[0]),
            # rows of other parts read at consecutive steps, received once
            "received_kept": int((plan.plans[rank].chunk_slots >= plan.plans[rank].num_slots).sum()
                                 - plan.plans[rank].recv_ids.shape[0]),
            "received_elsewhere": sum(not x for x in ex.plan.recv_in_place),
            "own_rows": b - a, "ordered_rows": ex.ordered_rows,
            "own_from_sources": ex.own_rows_from_sources,
            "ordered_input_bytes": ex.ordered_input_bytes,
            "cached_rows": int(plan.cached_rows),
            "first_in_flushes": ex.first_in_flushes,
            "aggregates_once": ex._agg_layout is not None,
            "reversed": ex.backward_reversed, "resident": ex.resident}
