"""What each process of a several-GPU run chooses alone, and what they agree on
(a benchmark-side check, not a test; CPU is enough).

Every process of ``hongtu train`` with ``engine.devices > 1`` weighs its own
part's buffers against the budget (``choose_resident``: resident or not, and
the chunk count when resident); ``trainer.agree_resident`` then makes one
choice for all. This prints, per rank, its part's rows, its resident buffers,
its own choice and the agreed one, as a GPU run would make them (the budget
must be a size, not ``auto``), so a disagreement is seen without GPUs.

Run::

    python bench/bench_rank_choices.py configs/rmat22_gcn.yaml data.path=builtin:rmat-22 \\
        model.layers=3 model.hidden=256 engine.devices=4 engine.device_memory=8GiB \\
        engine.partitioner=range

Prints a table and writes ``bench/results/rank_choices_<tag>.json`` (``--tag``,
default ``cpu``).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import RESULTS, write_json

from hongtu.config import load_config, parse_size
from hongtu.engine.budget import Chunkings, choose_resident
from hongtu.engine.buffers import BufferPlan
from hongtu.engine.trainer import agree_resident, load_data
from hongtu.errors import UserError
from hongtu.nn.model import build_model
from hongtu.partition import assign_parts


class _Ranks:
    """Every rank's choice where ``agree_resident`` reduces over processes."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def min_int(self, value: int) -> int:  # (whether every rank is resident)
        return min(int(r["resident"]) for r in self.rows)

    def max_int(self, value: int) -> int:  # (the most chunks any rank needs)
        return max(-1 if r["chunks"] is None else r["chunks"] for r in self.rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--tag", default="cpu", help="results file name part")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    e = cfg.engine
    if e.devices < 2 or e.device_memory == "auto":
        raise SystemExit("give engine.devices=N (N > 1) and engine.device_memory as a size")
    budget, parts, itemsize = parse_size(e.device_memory), e.devices, 4
    t = time.perf_counter()
    graph = load_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, graph.num_features, graph.num_classes,
                        transform_first=e.transform_first, keep_dropped=True)
    assignment = assign_parts(graph, parts, method=e.partitioner, seed=cfg.train.seed,
                              cache_dir=e.cache_dir)
    chunkings = Chunkings(graph, assignment, parts)
    rows: list[dict] = []
    for rank in range(parts):  # (as Trainer._resident, on a GPU, several processes)
        own = int(chunkings.chunker.part_sizes[rank])
        plan = BufferPlan(own, model.row_widths(), model.stored_aggregates(e.checkpoint),
                          itemsize)
        try:
            resident, room, chunks = choose_resident(
                e.resident, budget, plan.resident_bytes(), e.chunks, graph, assignment, parts,
                model, itemsize, chunkings=chunkings, overlap=e.overlap, device="cuda",
                direct=False, exchange=True, cached=model.cached_layers(e.checkpoint))
        except UserError as err:  # (engine.resident=true where this part does not fit)
            raise SystemExit(f"rank {rank}: {err}") from None
        rows.append(dict(rank=rank, rows=own, resident_bytes=plan.resident_bytes(),
                         resident=resident, room=room, chunks=chunks))
    every, _, most = agree_resident(_Ranks(rows), (rows[0]["resident"], rows[0]["room"],
                                                   rows[0]["chunks"]), budget)
    agreed = dict(resident=every, chunks=most)
    print(f"{'rank':>4} {'rows':>9} {'resident GiB':>12} {'alone':>14}")
    for r in rows:
        alone = f"resident, {r['chunks']}" if r["resident"] else "out of core"
        print(f"{r['rank']:>4} {r['rows']:>9} {r['resident_bytes'] / 2**30:>12.2f} {alone:>14}")
    print("agreed:", f"resident, {agreed['chunks']} chunks" if every else "out of core",
          f"({time.perf_counter() - t:.1f} s)")
    path = write_json(RESULTS / f"rank_choices_{args.tag}.json",
                      dict(config=args.config, overrides=args.overrides, budget=budget,
                           ranks=rows, agreed=agreed))
    print("wrote", path)


if __name__ == "__main__":
    main()
