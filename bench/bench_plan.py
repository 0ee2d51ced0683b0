"""Planner cost and transfer volumes: neighbour sets, dedup plan, reorg (a benchmark, not a test).

For an R-MAT graph renumbered by ``partition_graph(..., method='range')``
(METIS at this scale is slow; pass ``--method metis`` to use it) and each
chunk count, times :func:`hongtu.dedup.neighbour_sets`,
:func:`hongtu.dedup.plan_transfers` (identity order, ``devices = parts``,
p2p + reuse) and :func:`hongtu.reorg.reorganize_report`, then prints the
volumes in the style of HongTu's Table 8, normalised by ``|V|``:
``V_ori``, ``V_ori − V_+p2p`` (saved by p2p), ``V_+p2p − V_+ru`` (saved by
reuse), and the host traffic ``V_+ru`` against ``V_ori``, with and without
reorg. numba kernels are compiled (or loaded from their cache) by a warm-up
before any timing.

Run (CPU only)::

    python bench/bench_plan.py                      # scale 22, m=4, n in {8, 32}
    python bench/bench_plan.py --scale 18 --chunks 4 16

Prints a table and writes ``bench/results/plan_<hostname>.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numba
import numpy as np
from common import RESULTS, timed, write_json

from hongtu.dedup import neighbour_sets, plan_transfers
from hongtu.graph import Graph
from hongtu.graph.generators import rmat_edges
from hongtu.partition import partition_graph
from hongtu.reorg import cost, reorganize_report


def warm_up() -> float:
    """Compile (or load) every planner kernel on a small graph, parallel and serial paths."""
    t0 = time.perf_counter()
    for scale in (8, 17):
        src, dst = rmat_edges(scale, 8)
        g = Graph.from_edge_index(np.stack([src, dst]), 1 << scale)
        p = partition_graph(g, 2, 4, method="range")
        g = p.apply(g)
        nb = neighbour_sets(g.indptr, g.indices, p.chunk_ptr)
        plan_transfers(g.indptr, g.indices, p.chunk_ptr, 2, 4, devices=2, neighbours=nb)
        reorganize_report(g.indptr, g.indices, p.chunk_ptr, 2, 4, neighbours=nb)
    return time.perf_counter() - t0


def bench_chunks(args, graph: Graph, n: int) -> dict:
    m = args.parts
    rec: dict = {"chunks": n, "parts": m, "devices": m, "method": args.method}
    part, rec["partition_s"] = timed(partition_graph, graph, parts=m, chunks=n,
                                     method=args.method)
    g, rec["apply_s"] = timed(part.apply, graph)
    nb, rec["neighbour_sets_s"] = timed(neighbour_sets, g.indptr, g.indices, part.chunk_ptr)
    plan, rec["plan_s"] = timed(plan_transfers, g.indptr, g.indices, part.chunk_ptr, m, n,
                                devices=m, row_bytes=args.row_bytes, neighbours=nb)
    rec["plan_total_s"] = rec["neighbour_sets_s"] + rec["plan_s"]
    rec["num_slots"] = [p.num_slots for p in plan.plans]
    rec["num_recv_slots"] = [p.num_recv_slots for p in plan.plans]
    rec["plan_bytes"] = int(sum(a.nbytes for a in plan.to_npz_dict().values()))
    del plan
    res, rec["reorg_s"] = timed(reorganize_report, g.indptr, g.indices, part.chunk_ptr, m, n,
                                neighbours=nb, row_bytes=args.row_bytes)
    plan2, rec["plan_reorg_s"] = timed(plan_transfers, g.indptr, g.indices, part.chunk_ptr, m,
                                       n, order=res.order, devices=m, row_bytes=args.row_bytes,
                                       neighbours=nb)
    rec["reorg_chosen"] = res.chosen
    rec["volumes"] = {}
    for name, vol in (("identity", res.volumes["identity"]), ("reorg", res.volumes[res.chosen])):
        rec["volumes"][name] = {"v_ori": vol.v_ori, "v_p2p": vol.v_p2p, "v_ru": vol.v_ru,
                                **{f"{k}_per_v": v for k, v in vol.normalised().items()},
                                "host_reduction": vol.v_ori / max(1, vol.v_ru),
                                "cost_s": cost(vol, row_bytes=args.row_bytes)}
    rec["reorg_candidates_cost_s"] = res.costs
    assert plan2.h2d_rows == res.volumes[res.chosen].v_ru
    rec["num_nodes"] = g.num_nodes
    print(f"  n={n}: neighbour sets {rec['neighbour_sets_s']:.2f}s, plan {rec['plan_s']:.2f}s, "
          f"reorg {rec['reorg_s']:.2f}s (chose {res.chosen}), plan after reorg "
          f"{rec['plan_reorg_s']:.2f}s", flush=True)
    return rec


def table(records: list[dict]) -> str:
    head = (f"{'m':>2} {'n':>3} {'order':>8} {'V_ori':>7} {'-p2p':>7} {'-ru':>7} {'V_+ru':>7} "
            f"{'host x':>7} {'C (ms)':>8} {'nsets s':>8} {'plan s':>7} {'reorg s':>8}")
    lines = ["Transfer volumes per pass over |V| (Table 8 style: V_ori, V_ori - V_+p2p, "
             "V_+p2p - V_+ru), host reduction V_ori / V_+ru, cost C of one pass", head]
    for r in records:
        for name in ("identity", "reorg"):
            v = r["volumes"][name]
            timing = (f"{r['neighbour_sets_s']:>8.2f} {r['plan_s']:>7.2f} {r['reorg_s']:>8.2f}"
                      if name == "identity" else "")
            lines.append(f"{r['parts']:>2} {r['chunks']:>3} {name:>8} {v['v_ori_per_v']:>7.3f} "
                         f"{v['p2p_saved_per_v']:>7.3f} {v['ru_saved_per_v']:>7.3f} "
                         f"{v['v_ru_per_v']:>7.3f} {v['host_reduction']:>7.2f} "
                         f"{1e3 * v['cost_s']:>8.3f} {timing}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=22)
    ap.add_argument("--edge-factor", type=int, default=16)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--method", default="range", help="level-1 partitioner (default range)")
    ap.add_argument("--row-bytes", type=int, default=512, help="bytes per row (128 fp32)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file (default bench/results/plan_<hostname>.json)")
    args = ap.parse_args(argv)

    host = platform.node() or "host"
    out = args.out or RESULTS / f"plan_{host}.json"
    print(f"host {host}: {os.cpu_count()} cpus, numba {numba.get_num_threads()} threads",
          flush=True)
    warm_s = warm_up()
    print(f"numba warm-up {warm_s:.2f}s", flush=True)
    (src, dst), gen_s = timed(rmat_edges, args.scale, args.edge_factor)
    graph, csc_s = timed(Graph.from_edge_index, np.stack([src, dst]), 1 << args.scale)
    del src, dst
    print(f"R-MAT scale {args.scale}: {graph.num_nodes:,} vertices, {graph.num_edges:,} edges "
          f"(edges {gen_s:.2f}s, CSC {csc_s:.2f}s)", flush=True)
    records = [bench_chunks(args, graph, n) for n in args.chunks]
    print(table(records))
    doc = {"host": host, "cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(),
           "python": sys.version.split()[0], "warmup_s": warm_s, "scale": args.scale,
           "edge_factor": args.edge_factor, "num_edges": graph.num_edges,
           "row_bytes": args.row_bytes,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "records": records}
    write_json(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
