"""Does ``hongtu report`` predict what GPU training moved? (runs on any machine)

For every out-of-core hongtu run recorded by ``bench_suite.py`` (a suite JSON,
measured on a GPU), plans the same configuration with ``hongtu report`` here,
as a GPU run (``engine.accelerator=cuda``, even without CUDA on this machine),
and compares the chunk count and the bytes of one training epoch each way with
what the run measured. Where hongtu ran at two chunk counts or more (``hongtu@k``
systems, ``chunks_suite_*``), it also says which of them the report predicts
fastest (``predicted fastest`` in its text) against the measured epochs.

Run::

    python bench/bench_report.py products-like rmat22 [--models gcn2,gcn3]

Reads ``bench/results/suite_<workload>_<device>.json`` (``--suite-device``,
default ``nvidia-h200``; ``--suite FILE`` for another file, one workload) and
``chunks_suite_*`` beside it when present; prints a table and writes
``bench/results/report_vs_suite_<device>.json``. Only runs measured with the
release being checked say something: pass ``--since`` (a ``run_at`` prefix
such as ``2026-11-25``) to leave older runs out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_suite import SYSTEMS, WORKLOADS, make_graph, serve, suite_config
from common import RESULTS

from hongtu.report import build_report


def report_of(workload: str, mcfg: dict, system: str, budget: int, workdir: str,
              chunks_list: list[int] | None = None) -> dict:
    """The report's chunk count and epoch bytes for a suite run's configuration
    (as ``bench_suite.hongtu_run`` builds it), planned for a GPU."""
    name, _, chunks = system.partition("@")
    cfg = suite_config(workload, mcfg, workdir, 1, chunks=int(chunks) if chunks else "auto",
                       device_memory=budget, accelerator="cuda", **SYSTEMS[name])
    d = build_report(cfg, parts_list=[], chunks_list=chunks_list or []).data
    epoch = d["transfers"]["epoch"]
    return {"chunks": d["engine"]["chunks"], "h2d_bytes": epoch["h2d_bytes"],
            "d2h_bytes": epoch["d2h_bytes"], "block_h2d_bytes": epoch["block_h2d_bytes"],
            "fastest_chunks": d["memory"]["fastest_chunks"],
            "lower_bound_s": {r["chunks"]: r["lower_bound_s"] for r in d["memory"]["rows"]}}


def fastest_row(workload: str, model: str, infos: list[dict], workdir: str) -> dict | None:
    """The report's predicted fastest chunk count among the counts hongtu ran at
    (``hongtu`` and ``hongtu@k`` in ``infos``, one model's suite entries) against
    the measured epochs; ``None`` with fewer than two counts measured."""
    epochs, budget, mcfg = {}, None, None
    for info in infos:
        for system, run in info["runs"].items():
            if system.partition("@")[0] == "hongtu" and run.get("status") == "ok" \
                    and not run.get("resident"):
                epochs[run["chunks"]] = run["median_epoch_s"]
                budget, mcfg = run["budget_bytes"], info["model"]
    if len(epochs) < 2:
        return None
    rep = report_of(workload, mcfg, "hongtu", budget, workdir, chunks_list=sorted(epochs))
    fast, auto = rep["fastest_chunks"], rep["chunks"]
    best = min(epochs, key=epochs.get)
    print(f"{workload:14s} {model:5s} predicted fastest {fast} chunks ({epochs.get(fast)} s), "
          f"auto {auto} ({epochs.get(auto)} s), measured fastest {best} ({epochs[best]} s)",
          flush=True)
    return {"workload": workload, "model": model, "measured_epoch_s": epochs,
            "report_lower_bound_s": rep["lower_bound_s"], "predicted_fastest": fast,
            "auto": auto, "measured_fastest": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    ap.add_argument("--models", default="gcn2,gcn3")
    ap.add_argument("--suite-device", default="nvidia-h200")
    ap.add_argument("--suite", default=None, help="one suite JSON instead (one workload)")
    ap.add_argument("--since", default="", help="only runs whose run_at starts at or after this")
    ap.add_argument("--scale", type=int, default=None)
    ap.add_argument("--workdir", default="/tmp/hongtu_bench_report")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.suite and len(args.workloads) != 1:
        print("bench_report.py: --suite takes one workload", file=sys.stderr)
        return 2
    models, rows, fastest = args.models.split(","), [], []
    for workload in args.workloads:
        files = [Path(args.suite)] if args.suite else [
            RESULTS / f"{p}suite_{workload}_{args.suite_device}.json" for p in ("", "chunks_")]
        files = [f for f in files if f.exists()]
        if not files:
            print(f"bench_report.py: no suite results for {workload} in {RESULTS}",
                  file=sys.stderr)
            return 2
        graph = make_graph(workload, args.scale)
        serve(workload, graph)
        chosen: dict[str, list[dict]] = {}  # (per model, its entries in the files)
        for f in files:
            suite = json.loads(f.read_text())
            for model in models:
                info = suite["models"].get(model)
                if info is None or info["run_at"] < args.since:
                    continue
                chosen.setdefault(model, []).append(info)
                for system, run in info["runs"].items():
                    if (system.partition("@")[0] not in SYSTEMS or run.get("resident")
                            or run.get("status") != "ok"):
                        continue
                    t0 = time.perf_counter()
                    rep = report_of(workload, info["model"], system, run["budget_bytes"],
                                    args.workdir)
                    row = {"workload": workload, "model": model, "system": system,
                           "file": f.name, "run_at": info["run_at"],
                           "measured": {k: run[k] for k in ("chunks", "h2d_bytes", "d2h_bytes")},
                           "report": rep, "report_s": time.perf_counter() - t0}
                    row["equal"] = all(row["measured"][k] == rep[k] for k in row["measured"])
                    rows.append(row)
                    print(f"{workload:14s} {model:5s} {system:12s} chunks {rep['chunks']:3d} "
                          f"/ {run['chunks']:3d}  h2d {rep['h2d_bytes']:>13,} / "
                          f"{run['h2d_bytes']:>13,}  d2h {rep['d2h_bytes']:>13,} / "
                          f"{run['d2h_bytes']:>13,}  {'equal' if row['equal'] else 'DIFFERENT'}",
                          flush=True)
        for model, infos in chosen.items():
            row = fastest_row(workload, model, infos, args.workdir)
            if row is not None:
                fastest.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"report_vs_suite_{args.suite_device}.json"
    path.write_text(json.dumps({"suite_device": args.suite_device, "runs": rows,
                                "fastest": fastest}, indent=2))
    same = sum(r["equal"] for r in rows)
    print(f"{same} of {len(rows)} runs equal; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
