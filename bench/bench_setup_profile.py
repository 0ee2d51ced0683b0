"""Where the trainer's setup and a process's first epochs go (a benchmark, not a test).

Builds one suite workload (:mod:`bench_suite`'s graphs, models and
configuration: hongtu out of core at ``--budget``, or at ``--fraction`` of the
in-memory need) and constructs the trainer once per numba thread count in
``--threads``, timing:

* the setup phases as the trainer reports them (``partition_s``, ``plan_s``,
  ``other_s`` and its split);
* every parallel planner kernel (:class:`hongtu.graph._kernels.parallel_kernel`:
  calls and seconds, summed per kernel);
* the hongtu functions with the most time of their own (``cProfile``; on some
  Python versions the numba kernels' time shows in their callers').

With ``--first-epochs N`` the first ``N`` epochs of the first trainer run under
``cProfile`` too, and the functions with the most time of their own and
overall are written out: a process's first epoch loads or compiles its Triton
kernels, starts cuBLAS and grows the allocator. Run that without the warm-up
(``--no-warmup``), which trains small graphs on the device first; the numba
kernels then load from numba's cache in the first setup (compile, where no
earlier run cached them), which a second thread count's setup does not repeat.

Run on a GPU machine::

    python bench/bench_setup_profile.py largest --scale 24 --budget 15124681728 --threads 16,8
    python bench/bench_setup_profile.py rmat22 --no-warmup --first-epochs 3

Prints the figures and writes
``bench/results/[<tag>_]setup_profile_<workload>[-<scale>]_<model>_<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import re
import sys
import time

import numba
import torch
from bench_suite import (
    SYSTEMS,
    WORKLOADS,
    in_memory_need,
    make_graph,
    model_cfg,
    serve,
    suite_config,
    warm_up,
    workload_arguments,
)
from common import RESULTS, device_name, workload_json, write_json

from hongtu.config import parse_size
from hongtu.engine.trainer import Trainer
from hongtu.graph import _kernels

#: the package's own functions, where a setup profile is read
OWN = r"hongtu/(dedup|reorg|partition|engine|graph)/"


class KernelClock:
    """Seconds and calls per parallel planner kernel while installed."""

    def __init__(self) -> None:
        self.times: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        self._call = _kernels.parallel_kernel.__call__

    def __enter__(self) -> KernelClock:
        call, times = self._call, self.times

        def timed(kernel, *args):
            t = time.perf_counter()
            try:
                return call(kernel, *args)
            finally:
                rec = times[kernel.__name__]
                rec[0] += 1
                rec[1] += time.perf_counter() - t

        _kernels.parallel_kernel.__call__ = timed
        return self

    def __exit__(self, *exc) -> None:
        _kernels.parallel_kernel.__call__ = self._call

    def table(self) -> dict:
        return {k: {"calls": n, "s": s} for k, (n, s) in
                sorted(self.times.items(), key=lambda kv: -kv[1][1])}


def top(profile: cProfile.Profile, key: str, n: int, pattern: str | None = None) -> list[dict]:
    """The ``n`` functions first by ``key`` (``tottime`` or ``cumulative``), those whose
    file matches ``pattern`` only where given."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list:  # (sorted by the key)
        file, line, name = func
        if pattern is not None and not re.search(pattern, file):
            continue
        calls, _, tottime, cumtime, _ = stats.stats[func]
        rows.append({"function": f"{file}:{line}({name})", "calls": calls,
                     "own_s": tottime, "total_s": cumtime})
        if len(rows) == n:
            break
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(title)
    for r in rows:
        print(f"  {r['own_s']:8.3f} {r['total_s']:8.3f} {r['calls']:6d}  {r['function']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(ap)
    ap.add_argument("--budget", default=None, help="device budget (default: --fraction "
                                                   "of hongtu's in-memory estimate)")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--threads", default=None,
                    help="numba thread counts, one setup each (default: all threads)")
    ap.add_argument("--first-epochs", type=int, default=0,
                    help="profile this many first epochs of the first trainer")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the warm-up (small graphs trained first, loading the numba "
                         "kernels and starting the GPU): a fresh process's first setup and "
                         "first epochs")
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--tag", default="", help="prefix of the result file's name")
    ap.add_argument("--workdir", default="/tmp/hongtu_setup_profile")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    if not args.no_warmup:
        warm_up(args)
    t0 = time.perf_counter()
    graph = make_graph(args.workload, args.scale)
    print(f"{args.workload}: {graph.num_nodes:,} vertices, {graph.num_edges:,} edges "
          f"(generated in {time.perf_counter() - t0:.1f} s)", flush=True)
    serve(args.workload, graph)
    mcfg = model_cfg(args.model, args.hidden or WORKLOADS[args.workload]["hidden"])
    budget = parse_size(args.budget) if args.budget is not None \
        else int(in_memory_need(graph, mcfg) * args.fraction)
    threads = [int(t) for t in args.threads.split(",")] if args.threads \
        else [numba.config.NUMBA_NUM_THREADS]
    result = {"device": device_name(), "workload": args.workload, "scale": args.scale,
              "model": mcfg,
              "num_nodes": graph.num_nodes, "num_edges": graph.num_edges,
              "budget_bytes": budget, "warm_up": not args.no_warmup, "setups": [],
              "first_epochs": None}
    for i, n in enumerate(threads):
        numba.set_num_threads(n)
        cfg = suite_config(args.workload, mcfg, args.workdir, max(args.first_epochs, 1),
                           device_memory=budget, **SYSTEMS["hongtu"])
        profile = cProfile.Profile()
        with KernelClock() as clock:
            profile.enable()
            tr = Trainer(cfg, overwrite=True, out=lambda s: None)
            profile.disable()
        try:
            layer = numba.threading_layer()
        except ValueError:  # (no kernel ran in parallel: small inputs run serially)
            layer = None
        rec = {"threads": n, "threading_layer": layer,
               "chunks": tr.partition.num_chunks, **tr.setup_times,
               "other_split_s": tr.other_split, "kernels": clock.table(),
               "own_time": top(profile, "tottime", args.top, OWN)}
        result["setups"].append(rec)
        print(f"=== {n} threads ({rec['threading_layer']}): {rec['chunks']} chunks, "
              f"partition {rec['partition_s']:.3f} s, plan {rec['plan_s']:.3f} s, "
              f"other {rec['other_s']:.2f} s", flush=True)
        print("kernels: " + ", ".join(f"{k} {v['s']:.3f} s/{v['calls']}"
                                      for k, v in rec["kernels"].items()))
        show("own time (s own, s total, calls):", rec["own_time"])
        if i == 0 and args.first_epochs:
            epochs = []
            for e in range(args.first_epochs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profile = cProfile.Profile()
                t = time.perf_counter()
                profile.enable()
                r = tr.run_epoch(e, evaluate=False)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profile.disable()
                wall = time.perf_counter() - t
                ep = {"epoch": e, "wall_s": wall, "epoch_s": r["epoch_s"]}
                if e == 0:
                    ep["own_time"] = top(profile, "tottime", args.top)
                    ep["total_time"] = top(profile, "cumulative", args.top)
                epochs.append(ep)
                print(f"=== epoch {e}: {wall:.3f} s", flush=True)
                if e == 0:
                    show("own time:", ep["own_time"])
                    show("total time:", ep["total_time"])
            result["first_epochs"] = epochs
        del tr
    path = write_json(workload_json(args.out, "setup_profile", args, result["device"]), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
