"""Where an out-of-core epoch's time goes, layer pass by layer pass (one GPU).

Trains hongtu on a workload of the suite (``bench_suite.py``) and records one
epoch's per-stream timeline (:attr:`hongtu.engine.transfer.Mover.timeline`):
for every layer pass (forward L0, L1, ..., then backward from the last layer)
the time the host→device stream, the device→host stream and compute were
busy, how long both link directions were busy at once, how long nothing ran,
how long the pass went on after its last compute (its ``tail``: transfers it
waited for), the bytes each way, and the pass's transfer bound (its bytes at the pinned
copy rates measured in the same run: each direction alone, and both at once).

Run (GPU machine)::

    python bench/bench_passes.py rmat22 --model gcn2 [--system recompute]

The budget is the one ``bench_suite.py`` recorded for this workload and model
(``--budget`` overrides it). Prints a table and writes
``bench/results/passes_<workload>_<model>[_<system>]_<device>.json``.

``--timeline`` adds the raw intervals and the plan's batches to the JSON.

``--kernels N`` then profiles one more epoch (``torch.profiler``; its times
are the profiler's, a little longer) and adds, per pass, the device time of
the kernels it launched: transfers (DMA copies, memsets and the row kernel,
which also adds gradient rows within the device) and compute, and the ``N``
compute kernels that took longest.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
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
from common import RESULTS, device_name, file_tag, pass_names, pinned_copy_peak, write_json

from hongtu.config import parse_size
from hongtu.engine.trainer import Trainer


def _merged(iv: list) -> list:
    out: list = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _busy(iv: list) -> float:
    return sum(b - a for a, b in _merged(iv))


def _both(x: list, y: list) -> float:
    """Time two interval sets overlap."""
    x, y, i, j, t = _merged(x), _merged(y), 0, 0, 0.0
    while i < len(x) and j < len(y):
        t += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return t


def passes(timeline: list, pass_bytes: list, end_bytes: tuple, peak: dict) -> list[dict]:
    """Per layer pass: busy times (ms) per stream, both directions at once, idle,
    the tail (from its last compute to its end), bytes each way and the pass's
    transfer bound (ms)."""
    starts = [a for f, a, _ in timeline if f == "pass"]
    end = max(b for _, _, b in timeline)
    bounds, marks = starts + [end], list(pass_bytes) + [end_bytes]
    rows = []
    for k in range(len(starts)):
        lo, hi = bounds[k], bounds[k + 1]

        def of(field, lo=lo, hi=hi):
            return [(max(a, lo), min(b, hi)) for f, a, b in timeline
                    if f == field and b > lo and a < hi]

        h2d, d2h, gpu = of("time_h2d_s"), of("time_d2h_s"), of("time_compute_s")
        nh = marks[k + 1][0] - marks[k][0]
        nd = marks[k + 1][1] - marks[k][1]
        bound = max(nh / peak["h2d"], nd / peak["d2h"], (nh + nd) / peak["both"]) * 1e3
        rows.append({"pass_ms": hi - lo, "h2d_busy_ms": _busy(h2d), "d2h_busy_ms": _busy(d2h),
                     "gpu_busy_ms": _busy(gpu), "both_ways_ms": _both(h2d, d2h),
                     "idle_ms": (hi - lo) - _busy(h2d + d2h + gpu),
                     # (the pass's end after its last compute: transfers it waits for)
                     "tail_ms": hi - max((b for _, b in gpu), default=lo),
                     "h2d_bytes": nh, "d2h_bytes": nd, "bound_ms": bound,
                     "over_bound": (hi - lo) / bound if bound else None,
                     "link_gbps": (nh + nd) / (hi - lo) / 1e6 if hi > lo else None})
    return rows


#: kernels counted as transfers: DMA copies, memsets and the row kernel (zero-copy
#: loads and stores of host rows, and the gradient rows it adds within the device)
_TRANSFER = re.compile(r"^(Memcpy|Memset|_copy_rows)")


def _transfer_kind(kernel: str) -> str:
    """What a transfer kernel is: a DMA copy by direction, a memset, or the row kernel."""
    m = re.match(r"^Memcpy (\w+)", kernel)
    return f"DMA {m.group(1)}" if m else "memset" if kernel.startswith("Memset") else "row kernel"


def kernels_per_pass(trace: dict, top: int) -> dict:
    """Device time of the kernels each pass launched, from a profiler trace whose
    passes are ``PASS <name>`` annotations: ``transfer_ms`` (:data:`_TRANSFER`),
    ``compute_ms`` and the ``top`` longest compute kernels as
    ``[name, ms, launches]``, and ``transfers``, the transfer time by kind
    (:func:`_transfer_kind`) as ``[kind, ms, launches]``, longest first.
    Kernels launched outside any pass (the optimizer's, or work issued
    between passes) go under ``between``."""
    ev = trace["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"][5:]) for e in ev
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("PASS ")]
    # when each kernel was launched (runtime or driver API: Triton's go through the driver)
    launched = {e["args"]["correlation"]: e["ts"] for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    names = [n for _, _, n in ranges] + ["between"]
    out = {n: {"transfer_ms": 0.0, "compute_ms": 0.0, "kernels": collections.Counter(),
               "launches": collections.Counter(), "kinds": collections.Counter(),
               "copies": collections.Counter()} for n in names}
    for e in ev:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        t = launched.get(e.get("args", {}).get("correlation"))
        name = next((n for a, b, n in ranges if t is not None and a <= t <= b), "between")
        kernel = re.sub(r"[(<].*", "", e["name"]).strip()[:80]
        rec, ms = out[name], e["dur"] / 1e3
        if _TRANSFER.match(kernel):
            rec["transfer_ms"] += ms
            rec["kinds"][_transfer_kind(kernel)] += ms
            rec["copies"][_transfer_kind(kernel)] += 1
        else:
            rec["compute_ms"] += ms
            rec["kernels"][kernel] += ms
            rec["launches"][kernel] += 1
    for rec in out.values():
        rec["top"] = [[k, v, rec["launches"][k]] for k, v in rec["kernels"].most_common(top)]
        rec["transfers"] = [[k, v, rec["copies"][k]] for k, v in rec["kinds"].most_common()]
        del rec["kernels"], rec["launches"], rec["kinds"], rec["copies"]
    return out


def profile_passes(tr: Trainer, epoch: int, names: list[str], top: int,
                   trace: str | None = None) -> dict:
    """:func:`kernels_per_pass` of one more (profiled) training epoch of ``tr``
    (its Chrome trace also written to ``trace`` when given)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from hongtu.engine.executor import Executor

    run_pass, count = Executor._run_pass, [0]

    def annotated(self, fetch, run, *args, **kwargs):
        with record_function(f"PASS {names[count[0] % len(names)]}"):
            count[0] += 1
            return run_pass(self, fetch, run, *args, **kwargs)

    Executor._run_pass = annotated
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tr.run_epoch(epoch, evaluate=False)
    finally:
        Executor._run_pass = run_pass
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(trace) if trace else Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernels_per_pass(json.loads(path.read_text()), top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default="gcn2", choices=sorted(MODELS))
    ap.add_argument("--system", default="hongtu",
                    choices=sorted(k for k, v in SYSTEMS.items()
                                   if not v["resident"] and k != "serial"),
                    help="the suite's out-of-core system to time (default hongtu)")
    ap.add_argument("--scale", type=int, default=None, help="R-MAT scale of rmat22/largest")
    ap.add_argument("--budget", default=None,
                    help="device budget (default: the one bench_suite.py recorded)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs; the last is recorded")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="profile one more epoch: per pass, kernel time and the N longest")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="with --kernels: also write the profiled epoch's Chrome trace to PATH")
    ap.add_argument("--timeline", action="store_true",
                    help="also write the recorded epoch's raw intervals (stream, start ms, end ms)"
                         " and the plan's batches (step, part, chunk, first, last)")
    ap.add_argument("--workdir", default="/tmp/hongtu_passes")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_passes.py: needs a GPU (the timeline is made of CUDA events)",
              file=sys.stderr)
        return 2
    tag = file_tag(device_name())
    budget = args.budget
    if budget is None:
        suite = Path(args.out) / f"suite_{args.workload}_{tag}.json"
        rec = json.loads(suite.read_text())["models"].get(args.model) if suite.exists() else None
        if rec is None:
            print(f"bench_passes.py: no budget recorded for {args.workload} {args.model} in "
                  f"{suite}; run bench_suite.py first or pass --budget", file=sys.stderr)
            return 2
        budget = rec["budget_bytes"]
    warm_up(args)
    graph = make_graph(args.workload, args.scale)
    serve(args.workload, graph)
    peak = pinned_copy_peak(torch.device("cuda"))
    cfg = suite_config(args.workload, model_cfg(args.model, WORKLOADS[args.workload]["hidden"]),
                       args.workdir, args.epochs, device_memory=parse_size(budget),
                       **SYSTEMS[args.system])
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    mv = tr.executor.mover
    epochs = []
    for e in range(args.epochs):
        if e == args.epochs - 1:
            mv.timeline, mv.pass_bytes = [], []
        epochs.append(tr.run_epoch(e, evaluate=False))
    last = epochs[-1]
    rows = passes(mv.timeline, mv.pass_bytes, (last["h2d_bytes"], last["d2h_bytes"]), peak)
    names = pass_names(tr.model.num_layers)
    result = {"device": device_name(), "workload": args.workload, "model": args.model,
              "system": args.system,
              "run_at": time.strftime("%Y-%m-%d %H:%M"), "budget_bytes": parse_size(budget),
              "chunks": tr.partition.num_chunks, "pinned_peak_bytes_per_s": peak,
              "epoch_s": [r["epoch_s"] for r in epochs],
              "median_epoch_s": statistics.median(r["epoch_s"] for r in epochs[1:]),
              "passes": dict(zip(names, rows))}
    if args.timeline:
        result["timeline"] = [[f, round(a, 4), round(b, 4)] for f, a, b in mv.timeline]
        result["batches"] = [[int(x) for x in item] for item in tr.executor.plan.items]
    head = ("pass", "ms", "bound", "x", "GB/s", "h2d busy", "d2h busy", "both", "gpu busy",
            "idle", "tail", "h2d GB", "d2h GB")
    print("".join(f"{h:>10}" if i else f"{h:<14}" for i, h in enumerate(head)))
    for name, r in result["passes"].items():
        vals = (r["pass_ms"], r["bound_ms"], r["over_bound"], r["link_gbps"], r["h2d_busy_ms"],
                r["d2h_busy_ms"], r["both_ways_ms"], r["gpu_busy_ms"], r["idle_ms"],
                r["tail_ms"], r["h2d_bytes"] / 1e9, r["d2h_bytes"] / 1e9)
        print(f"{name:<14}" + "".join(f"{v:>10.2f}" for v in vals))
    if args.kernels:
        result["kernels"] = profile_passes(tr, args.epochs, names, args.kernels, args.trace)
        print("kernels (profiled epoch, ms): pass, transfers, compute, longest compute kernels")
        for name, rec in result["kernels"].items():
            print(f"{name:<14}{rec['transfer_ms']:>9.2f}{rec['compute_ms']:>9.2f}  " + "; ".join(
                f"{k} {ms:.2f}/{n}" for k, ms, n in rec["top"]))
            if rec["transfers"]:
                print(" " * 16 + "transfers: " + "; ".join(
                    f"{k} {ms:.2f}/{n}" for k, ms, n in rec["transfers"]))
    system = "" if args.system == "hongtu" else f"_{args.system}"
    out = Path(args.out) / f"passes_{args.workload}_{args.model}{system}_{tag}.json"
    write_json(out, result)
    print(f"epoch {result['median_epoch_s']:.3f} s ({tr.partition.num_chunks} chunks); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
