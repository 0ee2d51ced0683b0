"""Out-of-core executor vs PyG in memory on one device (issue 3's benchmark).

An R-MAT graph (default scale 22: 4.2M vertices, ~64M edges, 128 features),
a 3-layer GCN (hidden 256). hongtu runs with ``engine.device_memory`` set to a
quarter of what the same model needs in one chunk (its own estimate), so it
must go out of core; PyG 2.x runs the same model in memory with a normalised
torch CSR adjacency (``GCNConv(normalize=False)`` on ``adj_t``) as the
reference time. Both in one run, as a ratio.

Run (GPU machine)::

    python bench/bench_executor.py --scale 22 --epochs 3

Prints a table and writes ``bench/results/executor_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import device_name, file_tag, pyg_run

from hongtu.config import config_from_dict, format_size
from hongtu.engine.budget import chunk_sizes, estimate_device_bytes
from hongtu.engine.trainer import Trainer
from hongtu.graph.datasets import load_builtin
from hongtu.graph.transforms import add_self_loops
from hongtu.nn.model import build_model

#: hongtu configurations compared in one run (the paper's single-GPU ablation)
SYSTEMS = {
    "hongtu": {"dedup": {"reuse": True, "p2p": True}, "reorg": True},
    # no deduplication of any kind (as bench_suite's baseline)
    "baseline": {"dedup": {"reuse": False, "p2p": False, "cache": False}, "reorg": False,
                 "whole_layers": False, "ordered_inputs": False},
    "serial": {"dedup": {"reuse": True, "p2p": True}, "reorg": True, "overlap": False},
}


def hongtu_run(args, budget: int | None, chunks, system: str = "hongtu") -> dict:
    cfg = config_from_dict({
        "data": {"path": f"builtin:rmat-{args.scale}", "undirected": False, "self_loops": True},
        "model": {"layer": "gcn", "hidden": args.hidden, "layers": args.layers,
                  "dropout": 0.5},
        "train": {"epochs": args.epochs, "seed": 0},
        "engine": {"accelerator": args.accelerator, "chunks": chunks,
                   "device_memory": budget if budget else "auto", "partitioner": "range",
                   **SYSTEMS[system]},
        "output": {"dir": str(Path(args.workdir) / "run")},
    })
    print(f"--- {system}", flush=True)
    tr = Trainer(cfg, overwrite=True, out=lambda s: print(s, flush=True))
    recs = []
    for e in range(args.epochs):
        recs.append(tr.run_epoch(e, evaluate=False))  # time the training step, as PyG
        print(json.dumps({k: v for k, v in recs[-1].items() if "time" in k or "epoch" in k}),
              flush=True)
    steady = recs[1:] or recs
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                         if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            tr.run_epoch(args.epochs, evaluate=False)
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25)
        table += "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(table)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "executor_profile.txt").write_text(table)
    return {
        "chunks": tr.partition.num_chunks,
        "budget_bytes": budget,
        "estimate_bytes": tr.estimate,
        "preprocess_s": tr.preprocess_s,
        "epoch_s": [r["epoch_s"] for r in recs],
        "median_epoch_s": statistics.median(r["epoch_s"] for r in steady),
        "h2d_bytes": steady[-1]["h2d_bytes"],
        "d2h_bytes": steady[-1]["d2h_bytes"],
        "peak_device_bytes": max(r["peak_device_bytes"] for r in steady),
        "peak_measured": steady[-1]["peak_measured"],
        "loss": [r["loss"] for r in recs],
        "h2d_rows": steady[-1]["h2d_rows"],
        "plan_rows": {"v_ori": tr.transfer_plan.v_ori, "v_ru": tr.transfer_plan.v_ru,
                      "h2d_rows": tr.transfer_plan.h2d_rows},
        "time_split_s": {k: steady[-1][k] for k in steady[-1] if k.startswith("time_")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="device budget as a fraction of the in-memory need")
    ap.add_argument("--workdir", default="/tmp/hongtu_bench")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip-pyg", action="store_true")
    ap.add_argument("--systems", default="hongtu,baseline",
                    help=f"comma-separated hongtu configurations: {', '.join(SYSTEMS)}")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more epoch with torch.profiler")
    args = ap.parse_args()

    t0 = time.perf_counter()
    graph = add_self_loops(load_builtin(f"rmat-{args.scale}"))
    gen_s = time.perf_counter() - t0
    device = torch.device("cuda" if torch.cuda.is_available() and args.accelerator != "cpu"
                          else "cpu")
    print(f"graph rmat-{args.scale}: {graph.num_nodes} vertices, {graph.num_edges} edges "
          f"(generated in {gen_s:.1f} s)", flush=True)
    # The in-memory need: PyG's measured peak running the same model; where PyG
    # cannot run, the engine's own estimate with the whole graph as one chunk.
    pyg = ({"status": "skipped"} if args.skip_pyg else
           pyg_run(graph, "gcn", args.layers, args.hidden, args.epochs, device))
    if pyg.get("status") == "ok" and pyg.get("peak_device_bytes"):
        need, need_from = pyg["peak_device_bytes"], "PyG measured peak"
    else:
        model = build_model(config_from_dict({"model": {"hidden": args.hidden,
                                                        "layers": args.layers}}).model,
                            graph.num_features, graph.num_classes)
        ptr = np.array([0, graph.num_nodes], dtype=np.int64)
        need = estimate_device_bytes(model, chunk_sizes(graph, np.arange(graph.num_nodes), ptr),
                                     num_nodes=graph.num_nodes)
        need_from = "hongtu estimate, one chunk"
    num_nodes, num_edges = graph.num_nodes, graph.num_edges
    del graph
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget = int(need * args.fraction)
    print(f"in-memory need {format_size(need)} ({need_from}); budget {format_size(budget)}",
          flush=True)
    runs = {s: hongtu_run(args, budget, "auto", s) for s in args.systems.split(",")}
    ht = runs.get("hongtu") or next(iter(runs.values()))
    result = {"device": device_name(), "scale": args.scale, "num_nodes": num_nodes,
              "num_edges": num_edges, "hidden": args.hidden, "layers": args.layers,
              "in_memory_need_bytes": need, "in_memory_need_from": need_from,
              "budget_fraction": args.fraction, **runs, "pyg": pyg}
    if pyg.get("status") == "ok":
        result["hongtu_over_pyg"] = ht["median_epoch_s"] / pyg["median_epoch_s"]
    if "baseline" in runs and "hongtu" in runs:
        result["baseline_over_hongtu"] = (runs["baseline"]["median_epoch_s"]
                                          / runs["hongtu"]["median_epoch_s"])
    rows = [("system", "epoch s", "peak device", "h2d", "d2h")]
    for s, r in runs.items():
        rows.append((f"{s} ({r['chunks']} chunks)", f"{r['median_epoch_s']:.3f}",
                     format_size(r["peak_device_bytes"]), format_size(r["h2d_bytes"]),
                     format_size(r["d2h_bytes"])))
    if pyg.get("status") == "ok":
        rows.append(("PyG in memory", f"{pyg['median_epoch_s']:.3f}",
                     format_size(pyg["peak_device_bytes"] or 0), "-", "-"))
    else:
        rows.append(("PyG in memory", pyg.get("status"), "-", "-", "-"))
    for r in rows:
        print(f"{r[0]:<22}{r[1]:>10}{r[2]:>14}{r[3]:>14}{r[4]:>14}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"executor_{file_tag(result['device'])}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
