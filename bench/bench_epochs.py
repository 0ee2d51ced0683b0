"""Why one epoch of a run takes longer than another (one GPU).

Trains hongtu on a workload of the suite (``bench_suite.py``) for many epochs in
one process and records, per epoch: its time, the host time of each layer pass
(how long this thread took to issue it, waits included), the garbage
collector's runs and time, the caching allocator's device allocations, frees
and retries, and the memory it holds. ``--no-gc`` runs with the collector off
(after one collection, and freezing what is left). ``--profile N`` runs the
last ``N`` epochs under ``cProfile`` and keeps the functions that took this
thread longest (own time, and time with their callees): where the host's time
to issue a pass goes, waits on the device included (they show as the waiting
call's own time); the profiler's own cost inflates those epochs.

Run (GPU machine)::

    python bench/bench_epochs.py reddit-like --model gin2 --budget 2758415232 \
        --epochs 14 --tag gc1
    python bench/bench_epochs.py reddit-like --model gin2 --budget 2758415232 \
        --epochs 14 --no-gc --tag nogc1

Each run is one process; run several to compare processes. Prints one line per
epoch and writes ``bench/results/epochs_<workload>_<model>[_<tag>]_<device>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from bench_suite import (
    MODELS,
    SYSTEMS,
    WORKLOADS,
    make_graph,
    model_cfg,
    serve,
    suite_config,
    warm_up,
)
from common import RESULTS, device_name, file_tag, pass_names, write_json

from hongtu.config import parse_size
from hongtu.engine.executor import Executor
from hongtu.engine.trainer import Trainer


class _Collector:
    """The garbage collector's runs and time, from its callbacks."""

    def __init__(self) -> None:
        self.runs, self.seconds, self._start = 0, 0.0, None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.runs += 1


def _top_functions(profiler: cProfile.Profile, epochs: int, top: int = 60) -> dict:
    """The profiled functions that took longest, per profiled epoch: by own time
    and by time with their callees."""
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.items():
        where = name if path == "~" else f"{Path(path).name}:{line}({name})"
        rows.append({"function": where, "calls_per_epoch": calls / epochs,
                     "own_ms_per_epoch": own * 1e3 / epochs,
                     "cum_ms_per_epoch": cum * 1e3 / epochs})
    return {"epochs": epochs,
            "by_own_time": sorted(rows, key=lambda r: -r["own_ms_per_epoch"])[:top],
            "by_cum_time": sorted(rows, key=lambda r: -r["cum_ms_per_epoch"])[:top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default="gcn2", choices=sorted(MODELS))
    ap.add_argument("--budget", required=True, help="device budget (bytes or e.g. 2.5GiB)")
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--no-gc", action="store_true", help="train with the garbage collector off")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run the last N epochs under cProfile and keep its top functions")
    ap.add_argument("--tag", default="", help="added to the file name (runs side by side)")
    ap.add_argument("--workdir", default="/tmp/hongtu_epochs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_epochs.py: needs a GPU (it records the CUDA allocator)", file=sys.stderr)
        return 2
    warm_up(args)
    graph = make_graph(args.workload, None)
    serve(args.workload, graph)
    cfg = suite_config(args.workload, model_cfg(args.model, WORKLOADS[args.workload]["hidden"]),
                       args.workdir, args.epochs, device_memory=parse_size(args.budget),
                       **SYSTEMS["hongtu"])
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    collector = _Collector()
    if args.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    host_ms: list[float] = []
    run_pass = Executor._run_pass

    def timed_pass(self, *a, **k):
        t = time.perf_counter()
        try:
            return run_pass(self, *a, **k)
        finally:
            host_ms.append((time.perf_counter() - t) * 1e3)

    Executor._run_pass = timed_pass
    epochs = []
    profiler = cProfile.Profile() if args.profile > 0 else None
    try:
        for e in range(args.epochs):
            s0, runs, secs = torch.cuda.memory_stats(), collector.runs, collector.seconds
            host_ms.clear()
            profiled = profiler is not None and e >= args.epochs - args.profile
            started = time.time()
            if profiled:
                profiler.enable()
            rec = tr.run_epoch(e, evaluate=False)
            if profiled:
                profiler.disable()
            s1 = torch.cuda.memory_stats()

            def delta(key, s0=s0, s1=s1):
                return s1.get(key, 0) - s0.get(key, 0)

            epochs.append({
                "started": started, "epoch_s": rec["epoch_s"],
                "host_pass_ms": [round(x, 2) for x in host_ms],
                "gc_runs": collector.runs - runs, "gc_ms": (collector.seconds - secs) * 1e3,
                "device_allocs": delta("num_device_alloc"),
                "device_frees": delta("num_device_free"),
                "alloc_retries": delta("num_alloc_retries"),
                "reserved_bytes": torch.cuda.memory_reserved(), "profiled": profiled,
                "load_average": os.getloadavg()[0]})
            r = epochs[-1]
            print(f"epoch {e:>3}  {r['epoch_s']:.4f} s  host passes "
                  + " ".join(f"{x:6.1f}" for x in r["host_pass_ms"])
                  + f" ms  gc {r['gc_runs']} ({r['gc_ms']:.2f} ms)  allocs {r['device_allocs']}"
                  f"  retries {r['alloc_retries']}")
    finally:
        Executor._run_pass = run_pass
    # (as many as ran: a GCN whose first layer's backward runs on layer 1's flushes
    # has no pass of its own for it)
    names = pass_names(tr.model.num_layers)[:len(epochs[-1]["host_pass_ms"]) if epochs else 0]
    result = {"device": device_name(), "workload": args.workload, "model": args.model,
              "run_at": time.strftime("%Y-%m-%d %H:%M"), "budget_bytes": parse_size(args.budget),
              "chunks": tr.partition.num_chunks, "gc": not args.no_gc,
              "passes": names, "epochs": epochs}
    if profiler is not None:
        result["profile"] = _top_functions(profiler, min(args.profile, args.epochs))
        for row in result["profile"]["by_own_time"][:25]:
            print(f"{row['own_ms_per_epoch']:8.2f} own {row['cum_ms_per_epoch']:8.2f} cum "
                  f"ms/epoch {row['calls_per_epoch']:8.1f} calls  {row['function']}")
    tag = f"_{args.tag}" if args.tag else ""
    name = f"epochs_{args.workload}_{args.model}{tag}_{file_tag(device_name())}.json"
    out = Path(args.out) / name
    write_json(out, result, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
