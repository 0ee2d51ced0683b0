"""The device-memory estimate beside the measured peak, layer pass by layer pass.

Trains hongtu on a workload of the suite (``bench_suite.py``) at the budget the
suite recorded for it, for each model given, and in the last epoch measures,
for every layer pass (forward L0, L1, ..., then backward from the last
layer), what the device had allocated when the pass began and the most it
had allocated during it (``torch.cuda.max_memory_allocated``, reset at each
pass; the device is synchronised at pass bounds, so transfers of the next
pass no longer start early). Beside each layer it sets the estimate's largest
batch for that layer (:func:`hongtu.engine.budget.batch_bytes`, before the
estimate's slack): the measured batch is the larger of the layer's two
passes' rise above their start.

Run (GPU machine)::

    python bench/bench_memory.py rmat22 --models gcn2,gcn3,gat2

``--sites N`` records the allocator's history from the trainer's setup on
(``torch.cuda.memory._record_memory_history``) and lists, for every pass of
the measured epoch, what its peak held that the pass had allocated, by the
line of hongtu that allocated it (the N largest), what it had freed of what
the pass began with, and what the pass began with, by the same lines
(``start_sites``; the setup's buffers, rows kept across passes: what the
estimate counts outside the batch).

Prints a table per model and writes
``bench/results/memory_<workload>_<device>.json`` (``--tag`` prefixes the
name). On a CPU it runs and prints the estimates alone (no allocator to
read).
"""

from __future__ import annotations

import argparse
import json
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

from hongtu.config import format_size, parse_size
from hongtu.engine.budget import _SLACK, batch_bytes
from hongtu.engine.executor import Executor
from hongtu.engine.trainer import Trainer


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame in hongtu (``file:line
    function``), else the innermost Python frame."""
    own = [f for f in frames if "/hongtu/" in f["filename"]] or frames
    if not own:
        return "(no Python frame)"
    f = own[0]
    return f"{f['filename'].rsplit('/hongtu/', 1)[-1]}:{f['line']} {f['name']}"


def _mark_pass(dev) -> None:
    """An allocation the history replay (:func:`pass_sites`) reads as a pass start."""
    torch.empty(1, dtype=torch.uint8, device=dev)


def _is_mark(ev: dict) -> bool:
    return any(f["name"] == _mark_pass.__name__ and f["filename"].endswith("bench_memory.py")
               for f in ev.get("frames", ()))


def _top(sites: dict[str, int], top: int) -> dict[str, int]:
    return dict(sorted(sites.items(), key=lambda kv: -kv[1])[:top])


def pass_sites(trace: list[dict], top: int) -> list[dict]:
    """Replay an allocator history (one device's ``device_traces`` of
    ``torch.cuda.memory._snapshot()``, passes started by :func:`_mark_pass`):
    per pass, its peak rise above its start (``rise``), and at that peak the
    bytes it had allocated and still held by site (the ``top`` largest) and
    the bytes it had freed of what it began with (``freed_earlier``); and
    what was held as it began, by site (``start_sites``, the ``top`` largest,
    of ``start_traced`` bytes: allocations made before the history began are
    not in it)."""
    out: list[dict] = []
    live: dict[int, tuple[int, str, int]] = {}
    k, cur, freed = -1, 0, 0
    for ev in trace:
        act, addr, size = ev["action"], ev.get("addr"), int(ev.get("size", 0))
        if act == "alloc":
            if _is_mark(ev):
                k, cur, freed = k + 1, 0, 0
                held: dict[str, int] = {}
                for sz, site, _ in live.values():
                    held[site] = held.get(site, 0) + sz
                out.append({"rise": 0, "sites": {}, "freed_earlier": 0, "mark": addr,
                            "start_sites": _top(held, top),
                            "start_traced": sum(held.values())})
                continue
            live[addr] = (size, _site(ev.get("frames", [])), k)
            cur += size
            if k >= 0 and cur > out[k]["rise"]:
                sites: dict[str, int] = {}
                for sz, site, j in live.values():
                    if j == k:
                        sites[site] = sites.get(site, 0) + sz
                out[k].update(rise=cur, sites=sites, freed_earlier=freed)
        elif act == "free_requested":  # (where the allocated count drops)
            if k >= 0 and addr == out[k]["mark"]:
                out[k]["mark"] = None  # (its address may serve again)
                continue
            entry = live.pop(addr, None)
            cur -= size
            if entry is None or entry[2] != k:
                freed += size
    for rec in out:
        rec.pop("mark")
        rec["sites"] = _top(rec["sites"], top)
    return out


def measure_passes(tr: Trainer, epoch: int) -> list[dict]:
    """One training epoch of ``tr`` with, per layer pass in the order they ran,
    ``start`` (bytes allocated as it began) and ``peak`` (the most during it)."""
    run_pass, out = Executor._run_pass, []
    dev = tr.device

    def measured(self, *args, **kwargs):
        torch.cuda.synchronize(dev)
        _mark_pass(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            return run_pass(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize(dev)
            out.append({"start": start, "peak": torch.cuda.max_memory_allocated(dev)})

    Executor._run_pass = measured
    try:
        tr.run_epoch(epoch, evaluate=False)
    finally:
        Executor._run_pass = run_pass
    return out


def run_model(args, name: str, budget) -> dict:
    cfg = suite_config(args.workload, model_cfg(name, WORKLOADS[args.workload]["hidden"]),
                       args.workdir, args.epochs + 1, chunks=args.chunks,
                       accelerator=args.accelerator, device_memory=budget,
                       **SYSTEMS[args.system])
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else None
    if args.sites and dev is not None:  # (from the setup on: what the passes begin with)
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, context="alloc",
                                                 stacks="python", device=dev)
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    cuda = tr.device.type == "cuda"
    for e in range(args.epochs):
        tr.run_epoch(e, evaluate=False)
    itemsize = 4
    est = batch_bytes(tr.model, tr.chunk_sizes, itemsize, training=True, device=tr.device.type,
                      cached=tr.model.cached_layers(tr.checkpoint_mode), exchange=tr.world > 1,
                      direct=tr.resident and tr.world == 1)
    L = tr.model.num_layers
    rec = {"chunks": tr.partition.num_chunks, "budget_bytes": budget, "estimate_bytes": tr.estimate,
           "slack": _SLACK, "batch_estimate_bytes": est, "layers": []}
    if cuda:
        torch.cuda.reset_peak_memory_stats(tr.device)
        passes = measure_passes(tr, args.epochs)
        if args.sites:
            snap = torch.cuda.memory._snapshot(tr.device)
            torch.cuda.memory._record_memory_history(None, device=tr.device)
            index = tr.device.index if tr.device.index is not None else 0
            for p, sites in zip(passes, pass_sites(snap["device_traces"][index], args.sites)):
                p.update(sites)
        rec["peak_device_bytes"] = max(p["peak"] for p in passes)
        names = pass_names(L)[:len(passes)]
        rec["passes"] = dict(zip(names, passes))
    elif args.sites and dev is not None:  # (a CPU run on a GPU machine)
        torch.cuda.memory._record_memory_history(None, device=dev)
    for l in range(L):
        row = {"layer": l, "batch_estimate_bytes": est[l]}
        if cuda:
            rises = {k: rec["passes"][f"{k} L{l}"]["peak"] - rec["passes"][f"{k} L{l}"]["start"]
                     for k in ("forward", "backward") if f"{k} L{l}" in rec["passes"]}
            row.update({f"{k}_rise_bytes": v for k, v in rises.items()})
            row["measured_bytes"] = max(rises.values())
            row["estimate_over_measured"] = est[l] / row["measured_bytes"]
        rec["layers"].append(row)
    del tr
    if cuda:
        torch.cuda.empty_cache()
    return rec


def _chunk_count(text: str) -> int | str:
    """``--chunks``: ``auto`` or a count (argparse says which value it refused)."""
    return text if text == "auto" else int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--models", default="gcn2,gcn3,gat2,sage2,gin2",
                    help="comma-separated, of " + ", ".join(sorted(MODELS)))
    ap.add_argument("--system", default="hongtu",
                    choices=sorted(k for k, v in SYSTEMS.items() if not v["resident"]))
    ap.add_argument("--scale", type=int, default=None, help="R-MAT scale of rmat22/largest")
    ap.add_argument("--budget", default=None,
                    help="device budget for every model (default: what bench_suite.py "
                         "recorded for each)")
    ap.add_argument("--chunks", default="auto", type=_chunk_count,
                    help="engine.chunks (default auto)")
    ap.add_argument("--accelerator", default="auto", help="engine.accelerator (default auto)")
    ap.add_argument("--epochs", type=int, default=2,
                    help="epochs before the measured one (default 2)")
    ap.add_argument("--sites", type=int, default=0, metavar="N",
                    help="per pass, the N largest allocation sites held at its peak and "
                         "as it began")
    ap.add_argument("--tag", default="", help="prefix of the result file's name")
    ap.add_argument("--workdir", default="/tmp/hongtu_memory")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"bench_memory.py: unknown model {unknown[0]!r}; choose from "
              + ", ".join(sorted(MODELS)), file=sys.stderr)
        return 2
    tag = file_tag(device_name())
    suite = Path(args.out) / f"suite_{args.workload}_{tag}.json"
    recorded = json.loads(suite.read_text())["models"] if suite.exists() else {}
    budgets = {}
    for m in models:
        if args.budget is not None:
            budgets[m] = parse_size(args.budget)
        elif m in recorded:
            budgets[m] = recorded[m]["budget_bytes"]
        else:
            print(f"bench_memory.py: no budget recorded for {args.workload} {m} in {suite}; "
                  "run bench_suite.py first or pass --budget", file=sys.stderr)
            return 2
    warm_up(args)
    graph = make_graph(args.workload, args.scale)
    serve(args.workload, graph)
    result = {"device": device_name(), "workload": args.workload, "system": args.system,
              "run_at": time.strftime("%Y-%m-%d %H:%M"), "models": {}}
    for m in models:
        rec = result["models"][m] = run_model(args, m, budgets[m])
        peak = rec.get("peak_device_bytes")
        print(f"--- {m}: {rec['chunks']} chunks, budget {format_size(rec['budget_bytes'])}, "
              f"estimate {format_size(rec['estimate_bytes'])}"
              + (f", measured peak {format_size(peak)}" if peak else ""), flush=True)
        for row in rec["layers"]:
            line = f"  L{row['layer']}: batch estimate {format_size(row['batch_estimate_bytes'])}"
            if "measured_bytes" in row:
                line += (f", measured rise forward {format_size(row.get('forward_rise_bytes', 0))}"
                         f" backward {format_size(row.get('backward_rise_bytes', 0))}"
                         f" (estimate {row['estimate_over_measured']:.2f}x)")
            print(line, flush=True)
        for name, p in rec.get("passes", {}).items():
            if "sites" not in p:
                continue
            print(f"  {name}: rise {format_size(p['rise'])} (measured "
                  f"{format_size(p['peak'] - p['start'])}), freed of its start "
                  f"{format_size(p['freed_earlier'])}", flush=True)
            for site, size in p["sites"].items():
                print(f"    {format_size(size):>11}  {site}", flush=True)
            print(f"    began with {format_size(p['start'])}, of which traced "
                  f"{format_size(p['start_traced'])}:", flush=True)
            for site, size in p["start_sites"].items():
                print(f"    {format_size(size):>11}  {site}", flush=True)
    out = Path(args.out) / f"{args.tag}memory_{args.workload}_{tag}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
