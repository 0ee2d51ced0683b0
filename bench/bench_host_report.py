"""``hongtu report``'s host memory for a suite workload, next to what a suite run held
(a benchmark, not a test; CPU only).

The report reads only the structure and the features' shape, so the graph is
generated with one feature column and its features are a 128-wide view
without memory: R-MAT 2^24 plans on a laptop. The configuration is the
suite's hongtu run (``bench_suite.py``): range partitioner, ``chunks: auto``,
planned for a GPU (``engine.accelerator: cuda``) at ``--budget``. With
``--suite FILE`` the suite's JSON entry (its ``host_rss_*`` fields) is set
beside the report's figure.

Run::

    python bench/bench_host_report.py largest --scale 24 --model gcn2 --budget 15124681728 \\
        --suite bench/results/hostmem_regenerate_suite_largest_nvidia-h200.json

Prints the report's host lines and writes ``bench/results/host_report_<workload>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from bench_suite import MODELS, WORKLOADS, model_cfg, serve
from common import RESULTS, host_peak_rss_bytes, write_json

from hongtu.config import config_from_dict, format_size
from hongtu.graph.generators import rmat_graph
from hongtu.graph.transforms import add_self_loops
from hongtu.report import build_report, format_report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=[k for k, w in WORKLOADS.items() if "scale" in w])
    ap.add_argument("--scale", type=int, default=None)
    ap.add_argument("--model", default="gcn2", choices=sorted(MODELS))
    ap.add_argument("--budget", required=True, help="the suite run's budget in bytes")
    ap.add_argument("--suite", default=None, help="a suite JSON of the same run to compare")
    ap.add_argument("--workdir", default="/tmp/hongtu_host_report")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    w = WORKLOADS[args.workload]
    scale = args.scale or w["scale"]
    g = add_self_loops(rmat_graph(scale, 16, 1, w["classes"], seed=0))
    g.x = np.broadcast_to(np.zeros((1, 1), np.float32), (g.num_nodes, w["features"]))
    serve(args.workload, g)
    cfg = config_from_dict({
        "data": {"path": f"builtin:{args.workload}", "undirected": False, "self_loops": False},
        "model": model_cfg(args.model, w["hidden"]), "train": {"seed": 0},
        "engine": {"chunks": "auto", "partitioner": "range", "device_memory": int(args.budget),
                   "accelerator": "cuda", "cache_dir": str(Path(args.workdir) / "cache")},
        "output": {"dir": str(Path(args.workdir) / "run")}})
    rep = build_report(cfg, parts_list=[], chunks_list=[])
    print("\n".join(x for x in format_report(rep.data).splitlines()
                    if x.startswith(("engine:", "host memory", "  and on a GPU"))))
    host = rep.data["host"]
    rec = {"workload": args.workload, "scale": scale, "model": args.model,
           "budget_bytes": int(args.budget), "chunks": rep.data["engine"]["chunks"],
           "host": host, "listed_bytes": host["total_bytes"] + sum(host["ordered_bytes"]),
           "report_peak_rss_bytes": host_peak_rss_bytes()}
    if args.suite:
        run = json.loads(Path(args.suite).read_text())["models"][args.model]["runs"]["hongtu"]
        held = run["host_rss_bytes"] - run["host_rss_before_bytes"]
        rec.update(suite=args.suite, suite_chunks=run["chunks"], suite_held_bytes=held,
                   listed_over_held=rec["listed_bytes"] / held)
        print(f"listed {format_size(rec['listed_bytes'])} (with the copies in load order); the "
              f"suite's run held {format_size(held)} more than before it "
              f"({rec['listed_over_held']:.3f}x)")
    out = Path(args.out) / f"host_report_{args.workload}{scale}_{args.model}.json"
    write_json(out, rec)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
