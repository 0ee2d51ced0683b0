"""Preprocessing cost: R-MAT generation and 2-level partitioning (a benchmark, not a test).

For each scale, times :func:`hongtu.graph.generators.rmat_edges` (raw edges)
and :func:`~hongtu.graph.generators.rmat_graph` (edges, de-duplicated CSC,
128 features, labels, split), then ``partition_graph(graph, parts, chunks)``
with ``method="range"`` and ``method="metis"`` plus the renumbering
``Partition.apply``, uncached. numba kernels are compiled (or loaded from
their cache) by a warm-up before any timing.

Run (CPU is enough)::

    python bench/bench_preprocess.py --scales 20 22 --parts 4
    python bench/bench_preprocess.py --scales 22 --skip-metis

Prints a table and writes ``bench/results/preprocess_<hostname>.json``;
records of scales measured earlier on the same host are kept unless measured
again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
from pathlib import Path

import numba
from common import RESULTS, timed, write_json

from hongtu.graph.generators import rmat_edges, rmat_graph

try:
    from hongtu.partition import partition_graph
except ImportError as exc:  # the partitioner may not exist yet in a partial checkout
    partition_graph = None
    _PARTITION_ERROR = f"hongtu.partition.partition_graph not importable ({exc}); " \
                       "partitioning not timed"
try:
    from hongtu.partition import partition_stats
except ImportError:
    partition_stats = None



def peak_rss_gib() -> float:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_scale(args, scale: int) -> dict:
    rec: dict = {"scale": scale, "edge_factor": args.edge_factor, "features": args.features,
                 "parts": args.parts, "chunks": args.chunks}
    edges, rec["edges_s"] = timed(rmat_edges, scale, args.edge_factor)
    rec["raw_edges"] = int(edges[0].shape[0])
    del edges
    graph, rec["graph_s"] = timed(rmat_graph, scale, args.edge_factor,
                                  num_features=args.features)
    rec.update(num_nodes=graph.num_nodes, num_edges=graph.num_edges,
               max_in_degree=int(graph.in_degree().max()))
    print(f"scale {scale}: {graph}; rmat_edges {rec['edges_s']:.2f}s, "
          f"rmat_graph {rec['graph_s']:.2f}s", flush=True)
    rec["partition"] = {}
    if partition_graph is None:
        rec["partition_note"] = _PARTITION_ERROR
        methods = []
    else:
        methods = ["range"] + ([] if args.skip_metis else ["metis"])
    for method in methods:
        part, secs = timed(partition_graph, graph, parts=args.parts, chunks=args.chunks,
                           method=method, cache_dir=None)
        renumbered, apply_s = timed(part.apply, graph)
        del renumbered  # a second copy of the features: free it before METIS runs
        entry = {"partition_s": secs, "apply_s": apply_s}
        if partition_stats is not None:
            stats = partition_stats(graph, part)
            entry.update(cut_fraction=stats["cut_fraction"], edge_balance=stats["edge_balance"])
        del part
        rec["partition"][method] = entry
        print(f"  {method}: partition {secs:.2f}s, apply {apply_s:.2f}s", flush=True)
    rec["peak_rss_gib"] = peak_rss_gib()
    return rec


def _cell(part: dict, method: str, key: str, width: int = 7, fmt: str = ".2f") -> str:
    value = part.get(method, {}).get(key)
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def table(records: list[dict]) -> str:
    head = (f"{'scale':>5} {'vertices':>10} {'edges':>11} {'rmat_edges':>10} {'rmat_graph':>10} "
            f"{'parts':>5} {'chunks':>6} {'range':>7} {'metis':>7} {'apply':>7} {'cut(metis)':>10}")
    lines = ["R-MAT generation and uncached partition, seconds "
             "(apply: renumbering after METIS, else after range)", head]
    for r in records:
        p = r.get("partition", {})
        apply = _cell(p, "metis" if "metis" in p else "range", "apply_s")
        lines.append(f"{r['scale']:>5} {r['num_nodes']:>10,} {r['num_edges']:>11,} "
                     f"{r['edges_s']:>10.2f} {r['graph_s']:>10.2f} {r['parts']:>5} "
                     f"{r['chunks']:>6} {_cell(p, 'range', 'partition_s')} "
                     f"{_cell(p, 'metis', 'partition_s')} {apply} "
                     f"{_cell(p, 'metis', 'cut_fraction', 10, '.3f')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[20, 22])
    ap.add_argument("--edge-factor", type=int, default=16)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--skip-metis", action="store_true", help="time only method='range'")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file (default bench/results/preprocess_<hostname>.json)")
    args = ap.parse_args(argv)

    host = platform.node() or "host"
    out = args.out or RESULTS / f"preprocess_{host}.json"
    print(f"host {host}: {os.cpu_count()} cpus, numba {numba.get_num_threads()} threads",
          flush=True)
    if partition_graph is None:
        print(f"note: {_PARTITION_ERROR}", flush=True)
    _, warm_s = timed(rmat_graph, 8, 4, num_features=4)  # compile or load the numba cache
    print(f"numba warm-up {warm_s:.2f}s", flush=True)

    records = [bench_scale(args, s) for s in args.scales]
    print(table(records))

    old = json.loads(out.read_text()) if out.is_file() else {}
    measured = {r["scale"] for r in records}
    kept = [r for r in old.get("records", []) if r.get("scale") not in measured]
    doc = {
        "host": host, "cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(),
        "python": sys.version.split()[0], "warmup_s": warm_s,
        "records": sorted(kept + records, key=lambda r: r["scale"]),
    }
    write_json(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
