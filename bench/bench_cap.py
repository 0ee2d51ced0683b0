"""hongtu with PyTorch's allocator held to the budget and not, in one process (a
benchmark, not a test).

Builds one suite workload (:mod:`bench_suite`'s graphs, models and
configuration, hongtu out of core at ``--budget``) and trains it once per entry
of ``--runs``, in that order: ``cap`` with the allocator limited to the budget
(``torch.cuda.set_per_process_memory_fraction``: a GPU the size of
``engine.device_memory``), ``free`` without. ``SYSTEM:cap`` runs another
suite system (``hongtu@24:cap``: 24 chunks); ``/N`` holds what a batch
stores ``N`` batches (``free/3``; the release holds them
:data:`~hongtu.engine.transfer.HOLD_BATCHES`, and its estimate counts them
so); ``free/lag`` lets them lag behind compute with the estimate as it is.
Interleaving them in one process compares them on one machine at one
moment: these machines are shared, and their epochs differ from call to call
by more than some of the differences measured here.

Per run: the median epoch and its ratio to the transfer lower bound (the
epoch's bytes at the pinned-copy rate measured once, before the first run, as
:mod:`bench_suite` measures it), the allocator's retries (each a synchronisation of
the device, after which it freed its cached memory to allocate again), the
peak of what was allocated and of what it reserved, the estimate, the bytes
each way and the losses. With ``--trace`` the first run records the
allocator's history over its second epoch (``torch.cuda.memory``'s
recording, without stack frames but Python's), and writes per CUDA stream
(named as the executor's mover names them) what was allocated, mapped and
unmapped, the largest allocations by where they were made, and the
allocation after each unmapping: which tensors made it give memory back.

Run on a GPU machine::

    python bench/bench_cap.py largest --scale 24 --budget 15124681728 --runs cap,free,cap,free
    python bench/bench_cap.py products-like --model gcn3 --budget 4803769344 --trace

Prints one line per run and writes
``bench/results/[<tag>_]cap_<workload>[-<scale>]_<model>_<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import sys
import time

import bench_suite
import torch
from bench_suite import WORKLOADS, hongtu_run, make_graph, model_cfg, serve, workload_arguments
from common import RESULTS, device_name, pinned_copy_peak, workload_json, write_json

from hongtu.config import parse_size
from hongtu.engine import budget, transfer

MIB = 1 << 20
#: allocations at least this large are listed by where they were made
BIG = 16 * MIB


#: ``/lag``: stores' tensors held this many batches, the estimate not told
LAG_BATCHES = 64


def parse_runs(text: str) -> list[tuple[str, bool, int | str | None]]:
    """``"cap,free/3,hongtu@24:cap,free/lag"`` -> ``[("hongtu", True, None),
    ("hongtu", False, 3), ("hongtu@24", True, None), ("hongtu", False, "lag")]``:
    system, capped, and how long a store's tensor is held (``/N``: ``N``
    batches; ``None``: the release's :data:`~hongtu.engine.transfer.HOLD_BATCHES`;
    ``/lag``: :data:`LAG_BATCHES`, uncapped only, see :func:`holding`)."""
    out = []
    for item in text.split(","):
        run, _, hold = item.strip().partition("/")
        system, _, how = run.rpartition(":")
        if how not in ("cap", "free") or (hold and not (
                (hold.isdigit() and int(hold) >= 2) or (hold == "lag" and how == "free"))):
            raise ValueError(f"--runs: {item!r} is not cap, free, SYSTEM:cap or SYSTEM:free, "
                             "with /N (N >= 2 batches held), free/lag or neither")
        out.append((system or "hongtu", how == "cap",
                    int(hold) if hold.isdigit() else hold or None))
    return out


@contextlib.contextmanager
def holding(batches: int | str | None):
    """Stores' tensors held ``batches`` batches (as :data:`HOLD_BATCHES`, which the
    estimate counts too) while in the block; ``None``: as the release holds them.
    ``"lag"``: :data:`LAG_BATCHES`, and the estimate still counts the release's:
    the same chunks and buffers, and the stores free to lag behind compute in
    memory beyond the budget, as the release before let them (what compute
    waiting for them costs)."""
    if batches is None:
        yield
        return
    saved = transfer.HOLD_BATCHES, budget.HOLD_BATCHES
    if batches == "lag":
        transfer.HOLD_BATCHES = LAG_BATCHES
    else:
        transfer.HOLD_BATCHES = budget.HOLD_BATCHES = batches
    try:
        yield
    finally:
        transfer.HOLD_BATCHES, budget.HOLD_BATCHES = saved


def _where(entry: dict) -> str:
    """The innermost hongtu frames of a trace entry, ``file:line:function < ...``."""
    frames = [f for f in entry.get("frames", []) if "hongtu/" in f["filename"]]
    return " < ".join(f"{f['filename'].split('hongtu/')[-1]}:{f['line']}:{f['name']}"
                      for f in frames[:3])


def summarise_trace(trace: list[dict], names: dict[int, str], top: int = 25) -> dict:
    """What an allocator history (one device's ``device_traces`` of
    ``torch.cuda.memory._snapshot()``) did per stream (``names``: CUDA stream
    handle -> name): per ``action@stream`` the count and GiB; the largest
    allocations (``BIG`` and up) by stream, size in MiB and where; and for
    each run of unmappings, the MiB unmapped and the allocation that followed
    it."""
    def stream(e):
        return names.get(e["stream"], str(e["stream"]))

    actions = collections.defaultdict(lambda: [0, 0.0])
    big = collections.Counter()
    after_unmaps = []
    unmapped = 0
    for e in trace:
        key = f"{e['action']}@{stream(e)}"
        actions[key][0] += 1
        actions[key][1] += e["size"] / (1 << 30)
        if e["action"] == "alloc" and e["size"] >= BIG:
            big[(stream(e), round(e["size"] / MIB), _where(e))] += 1
        if e["action"] == "segment_unmap":
            unmapped += e["size"]
        elif e["action"] == "alloc" and unmapped:
            after_unmaps.append({"unmapped_mib": round(unmapped / MIB), "stream": stream(e),
                                 "alloc_mib": round(e["size"] / MIB), "where": _where(e)})
            unmapped = 0
    largest = sorted(big.items(), key=lambda kv: -kv[0][1] * kv[1])[:top]
    return {"actions": {k: {"count": n, "gib": round(g, 3)} for k, (n, g) in actions.items()},
            "largest_allocations": [{"stream": s, "mib": m, "count": n, "where": w}
                                    for (s, m, w), n in largest],
            "after_unmaps": after_unmaps[:top]}


def segments_by_stream(segments: list[dict], names: dict[int, str]) -> dict:
    """Reserved and allocated GiB of the allocator's segments per stream."""
    out = collections.defaultdict(lambda: {"reserved_gib": 0.0, "allocated_gib": 0.0,
                                           "segments": 0})
    for s in segments:
        d = out[names.get(s["stream"], str(s["stream"]))]
        d["reserved_gib"] += s["total_size"] / (1 << 30)
        d["allocated_gib"] += s["allocated_size"] / (1 << 30)
        d["segments"] += 1
    return dict(out)


class _Recording:
    """Wraps the suite's :class:`~hongtu.engine.trainer.Trainer` so that one run
    records the allocator's history over its epoch ``1``."""

    def __init__(self) -> None:
        self.result: dict | None = None
        self.on = False

    def trainer_class(self, base):
        rec = self

        class Recorded(base):
            def run_epoch(self, epoch, **kw):
                if not (rec.on and epoch == 1):
                    return super().run_epoch(epoch, **kw)
                mv = self.executor.mover
                names = {0: "compute"}
                for n in ("compute", "s_in", "s_out", "s_widen", "s_gather"):
                    s = getattr(mv, n)
                    if s is not None:
                        names.setdefault(s.cuda_stream, n)
                torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                                         max_entries=1_000_000)
                try:
                    out = super().run_epoch(epoch, **kw)
                    snap = torch.cuda.memory._snapshot()
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)
                rec.result = {"streams": segments_by_stream(snap["segments"], names),
                              **summarise_trace(snap["device_traces"][0], names)}
                return out

        return Recorded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(ap)
    ap.add_argument("--budget", required=True, help="device budget (engine.device_memory)")
    ap.add_argument("--runs", default="cap,free,cap,free",
                    help="cap, free, SYSTEM:cap or SYSTEM:free, in order")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace", action="store_true",
                    help="record the allocator's history in the first run's second epoch")
    ap.add_argument("--tag", default="", help="prefix of the result file's name")
    ap.add_argument("--workdir", default="/tmp/hongtu_cap")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
    except ValueError as exc:
        ap.error(str(exc))  # (exit code 2)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cap.py measures a GPU's allocator: no GPU here")

    graph = make_graph(args.workload, args.scale)
    serve(args.workload, graph)
    mcfg = model_cfg(args.model, args.hidden or WORKLOADS[args.workload]["hidden"])
    budget_bytes = parse_size(args.budget)
    peak = pinned_copy_peak(torch.device("cuda"))  # the bound's rate, once for all runs
    recording = _Recording()
    base = bench_suite.Trainer
    bench_suite.Trainer = recording.trainer_class(base)
    result = {"device": device_name(), "workload": args.workload, "scale": args.scale,
              "model": mcfg, "num_nodes": graph.num_nodes, "num_edges": graph.num_edges,
              "budget_bytes": budget_bytes, "pinned_peak_bytes_per_s": peak, "runs": []}
    try:
        for k, (system, cap, hold) in enumerate(runs):
            recording.on = args.trace and k == 0
            run_args = argparse.Namespace(workdir=args.workdir, epochs=args.epochs,
                                          warmup=args.warmup, cap=cap, resident_budget=None)
            gc.collect()
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            with holding(hold):
                r = hongtu_run(args.workload, mcfg, system, budget_bytes, run_args, peak)
            rec = {"system": system, "cap": cap,
                   "hold_batches": LAG_BATCHES if hold == "lag"
                   else hold or transfer.HOLD_BATCHES,
                   "estimate_counts_hold": hold != "lag",
                   "wall_s": time.perf_counter() - t0,
                   **{key: r.get(key) for key in (
                       "status", "chunks", "median_epoch_s", "epoch_s", "alloc_retries",
                       "peak_device_bytes", "reserved_peak_bytes", "estimate_bytes",
                       "h2d_bytes", "d2h_bytes", "lower_bound_s", "over_lower_bound",
                       "over_lower_bound_passes", "loss")}}
            if recording.on:
                rec["allocator"] = recording.result
            result["runs"].append(rec)
            gib = 1 << 30
            print(f"=== {system} {'cap' if cap else 'free'}/{hold or rec['hold_batches']}: "
                  f"{rec['status']}, "
                  f"{rec['chunks']} chunks, epoch {rec['median_epoch_s'] or 0:.4f} s "
                  f"({rec['over_lower_bound'] or 0:.2f}x the bound), "
                  f"retries {rec['alloc_retries']}, "
                  f"peak {(rec['peak_device_bytes'] or 0) / gib:.2f} GiB, "
                  f"reserved {(rec['reserved_peak_bytes'] or 0) / gib:.2f} GiB", flush=True)
    finally:
        bench_suite.Trainer = base
    path = write_json(workload_json(args.out, "cap", args, result["device"]), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
