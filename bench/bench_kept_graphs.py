"""Kept update graphs: what a resident forward pass holds against the memory planner's count.

Resident on one device, layers whose update is more than one linear map
(SAGE, GIN) keep its autograd graph from forward to backward
(``Executor(keep_graphs=True)``), and :func:`hongtu.engine.budget.kept_graph_bytes`
counts what those graphs hold, to decide whether they fit the budget. For
GIN and SAGE, 2 and 3 layers (128 features, hidden 256, 16 classes,
dropout 0.5) on R-MAT 2^15 in 4 chunks, every kept layer together and each
alone, this measures per vertex:

* ``allocated``: on a GPU, what the training forward pass leaves allocated
  (``torch.cuda.memory_allocated`` after it minus before; the buffers are
  resident and allocated before), and what each layer's kept updates
  allocated while they ran;
* ``held``: the unique storages reachable from the kept tensors and their
  graphs' saved tensors (not parameters); it misses what custom autograd
  functions keep out of sight, so on a GPU it is a floor;
* ``estimate``: ``kept_graph_bytes`` of the same layers.

On a CPU the executor is made resident as the tests make it
(``tests/engine/test_oracle.py``'s ``_as_resident``). Run::

    python bench/bench_kept_graphs.py [--device cuda] [--sites] [--models gin2,sage3]

Prints one line per case and writes ``bench/results/kept_graphs_<device>.json``
(``kept_graphs_sites_<device>.json`` with ``--sites``).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, device_name, file_tag, write_json

from hongtu.engine.budget import ChunkSizes, kept_graph_bytes
from hongtu.engine.buffers import BufferPlan, HostBuffers
from hongtu.engine.chunks import ChunkSet
from hongtu.engine.executor import Executor
from hongtu.graph.generators import rmat_graph
from hongtu.graph.transforms import add_self_loops
from hongtu.nn import GNN, resolve_layer
from hongtu.partition import chunk_partition
from hongtu.reorg import plan_batches

CHUNKS = 4


def _storage_bytes(t, seen: set) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    s = t.untyped_storage()
    if s.data_ptr() in seen:
        return 0
    seen.add(s.data_ptr())
    return s.nbytes()


def held_bytes(roots, params) -> int:
    """Unique storages of ``roots`` and of what their graphs save (not ``params``)."""
    seen = {p.untyped_storage().data_ptr() for p in params}
    total = sum(_storage_bytes(t, seen) for t in roots)
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor)]
    done = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in done:
            continue
        done.add(id(fn))
        for name in dir(fn):
            if name.startswith("_saved_") or name == "saved_tensors":
                try:
                    value = getattr(fn, name)
                except RuntimeError:  # (freed, or not a tensor attribute)
                    continue
                for x in value if isinstance(value, (tuple, list)) else [value]:
                    total += _storage_bytes(x, seen)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return total


def _site(frames: list[dict]) -> str:
    """An allocation's site: the innermost hongtu frame of its Python stack
    (``file:line function``), after the innermost Python frame where that is
    elsewhere (torch's)."""
    def where(f):
        name = f.get("filename", "")
        return f"{name.split('/site-packages/')[-1].split('/hongtu/')[-1]}:{f.get('line')} " \
            f"{f.get('name')}"
    frames = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in frames:
        if "/hongtu/" in f.get("filename", ""):
            inner = "" if f is frames[0] else f"{where(frames[0])} < "
            return inner + where(f)
    return "(outside hongtu)"


def live_sites(n: int, top: int = 12) -> list[tuple[str, float]]:
    """Bytes per vertex of the live allocations recorded since the memory
    history was switched on, by allocation site, the largest first."""
    snap = torch.cuda.memory._snapshot()
    by: dict[str, int] = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b.get("state") == "active_allocated" and b.get("frames"):
                key = _site(b["frames"])
                by[key] = by.get(key, 0) + b["size"]
    return [(k, v / n) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]]


def measure(graph, layer: str, layers: int, dev: torch.device, only: int | None,
            sites: bool = False) -> dict:
    torch.manual_seed(0)
    cls = resolve_layer(layer)
    widths = [graph.num_features] + [256] * (layers - 1) + [graph.num_classes]
    model = GNN([cls(widths[i], widths[i + 1]) for i in range(layers)], dropout=0.5,
                activation="relu", transform_first=True, keep_dropped=True)
    p = chunk_partition(graph, np.zeros(graph.num_nodes, dtype=np.int64), CHUNKS, num_parts=1)
    g = p.apply(graph)
    buf = HostBuffers(BufferPlan(g.num_nodes, model.row_widths(),
                                 model.stored_aggregates("auto")), g.x,
                      pin=dev.type == "cuda", device=dev)
    model.to(dev)
    _, plan = plan_batches(g.indptr, g.indices, p.chunk_ptr, 1, CHUNKS)
    masks = {k: torch.from_numpy(getattr(g, f"{k}_mask")) for k in ("train", "val", "test")}
    ex = Executor(model, ChunkSet.build(g, p.chunk_ptr, 1, CHUNKS), buf, torch.from_numpy(g.y),
                  masks, dev, plan.plans[0], checkpoint="auto", seed=0, keep_graphs=True,
                  own_in_sources=True)
    if dev.type == "cpu":  # (resident, as the tests make a CPU executor)
        ex._direct = ex.resident = True
        ex._whole = [False] * len(ex._whole)
        ex._in_flushes = False
        ex._in_place = ex._in_slots = [False] * len(ex._whole)
    if only is not None:
        ex._graph_layers = [l == only for l in range(layers)]
    per_update: dict[int, int] = {}
    cuda = dev.type == "cuda"
    if cuda:
        keep = ex._keep_update

        def counted(l, *args, **kwargs):
            m0 = torch.cuda.memory_allocated()
            out = keep(l, *args, **kwargs)
            per_update[l] = per_update.get(l, 0) + torch.cuda.memory_allocated() - m0
            return out

        ex._keep_update = counted
        gc.collect()  # (nothing of an earlier case may be freed inside this one)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if sites:  # (only what the forward pass allocates carries a stack)
            torch.cuda.memory._record_memory_history(stacks="python")
    ex.forward(3, train=True)
    kept = ex.kept_graphs
    n = g.num_nodes
    sizes = ChunkSizes(np.zeros(CHUNKS, np.int64), np.diff(p.chunk_ptr).astype(np.int64),
                       np.zeros(CHUNKS, np.int64))
    rec = {"layer": layer, "layers": layers, "kept": kept, "held_per_vertex": {
        l: sum(held_bytes(list(ex._graphs[(l, c)]), list(model.parameters()))
               for c in range(CHUNKS)) / n for l in kept},
        "estimate_per_vertex": {l: kept_graph_bytes(model, sizes, 4, [i == l for i in
                                                                      range(layers)],
                                                    dev.type) / n for l in kept}}
    rec["estimate_all_per_vertex"] = kept_graph_bytes(
        model, sizes, 4, [l in kept for l in range(layers)], dev.type) / n
    if cuda:
        torch.cuda.synchronize()
        rec["allocated_per_vertex"] = (torch.cuda.memory_allocated() - before) / n
        rec["updates_allocated_per_vertex"] = {l: v / n for l, v in sorted(per_update.items())}
        if sites:
            rec["live_sites_per_vertex"] = live_sites(n)
            torch.cuda.memory._record_memory_history(enabled=None)
    ex.__dict__.pop("_keep_update", None)  # (counted -> ex -> counted: a cycle)
    del ex, buf
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sites", action="store_true",
                    help="on a GPU, list what the forward pass leaves allocated by "
                         "allocation site (its innermost hongtu line)")
    ap.add_argument("--models", default="gin2,gin3,sage2,sage3",
                    help="layer and layer count of each model, comma-separated")
    args = ap.parse_args()
    dev = torch.device(args.device)
    graph = add_self_loops(rmat_graph(15, 8, num_features=128, num_classes=16, seed=1))
    records = []
    for layer, layers in [(m[:-1], int(m[-1])) for m in args.models.split(",")]:
        for only in [None, *range(layers)]:
            rec = measure(graph, layer, layers, dev, only, args.sites)
            records.append(rec)
            line = f"{layer} {layers} layers, kept {rec['kept']}: estimate " \
                f"{rec['estimate_all_per_vertex']:.0f} B/vertex"
            if "allocated_per_vertex" in rec:
                line += f", allocated {rec['allocated_per_vertex']:.0f} (updates " + ", ".join(
                    f"L{l} {v:.0f}" for l, v in rec["updates_allocated_per_vertex"].items()) + ")"
            line += "; held, estimate by layer " + ", ".join(
                f"L{l} {rec['held_per_vertex'][l]:.0f}/{rec['estimate_per_vertex'][l]:.0f}"
                for l in rec["kept"])
            print(line, flush=True)
            for site, b in rec.get("live_sites_per_vertex", []):
                print(f"    {b:8.0f} B/vertex  {site}")
    name = device_name() if dev.type == "cuda" else "cpu"
    out = Path(RESULTS) / f"kept_graphs_{'sites_' if args.sites else ''}{file_tag(name)}.json"
    write_json(out, {"device": name, "torch": torch.__version__,
                     "graph": "R-MAT 2^15 + self-loops, 128 features, 16 classes",
                     "chunks": CHUNKS, "records": records}, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
