"""Helpers shared by the benchmark scripts (run as ``python bench/NAME.py``)."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

#: where every benchmark writes its JSON
RESULTS = Path(__file__).resolve().parent / "results"


def write_json(path: Path, doc, indent: int = 2) -> Path:
    """Write ``doc`` as JSON to ``path``, making its folder first; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path


def workload_json(out: str | Path, kind: str, args, device: str) -> Path:
    """``out/[<tag>_]<kind>_<workload>[-<scale>]_<model>_<device>.json`` of a
    script's ``args`` (``workload``, ``scale``, ``model``, ``tag``)."""
    name = f"{kind}_{args.workload}{f'-{args.scale}' if args.scale else ''}_{args.model}_" \
        f"{file_tag(device)}.json"
    return Path(out) / (f"{args.tag}_{name}" if args.tag else name)


def timed(fn, *args, **kwargs):
    """``(result, seconds)`` of one call."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def steady_median(times: list[float], warmup: int) -> float:
    """Median of the epochs after the first ``warmup`` (all of them if none are left)."""
    return statistics.median(times[warmup:] or times)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu-{platform.node()}"


def file_tag(name: str) -> str:
    """``name`` as a file-name fragment (``NVIDIA H200`` -> ``nvidia-h200``)."""
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def pass_names(num_layers: int) -> list[str]:
    """Names of an epoch's layer passes in the order they run (forward L0, L1, ...,
    then backward from the last layer; a run without the first layer's backward
    pass has one name fewer, the last)."""
    return ([f"forward L{l}" for l in range(num_layers)]
            + [f"backward L{l}" for l in reversed(range(num_layers))])


def host_rss_bytes() -> int | None:
    """This process's resident host memory now (pinned buffers included), or ``None``
    where ``/proc`` is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_peak_rss_bytes() -> int:
    """The most resident host memory this process has held so far (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)


def pinned_copy_peak(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Measured pinned host<->device copy rates (bytes/s), median of ``repeats``:
    each direction alone (``h2d``, ``d2h``), and both at once on two streams
    (``both``: the bytes of the two copies over the time until both are done)."""
    if device.type != "cuda":
        return {"h2d": None, "d2h": None, "both": None}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        times = []
        for _ in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000.0)
        rates[name] = nbytes / statistics.median(times[1:])
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    rates["both"] = 2 * nbytes / statistics.median(times[1:])
    del host, dev, host2, dev2
    torch.cuda.empty_cache()
    return rates


def pyg_run(graph, layer: str, layers: int, hidden: int, epochs: int, device: torch.device,
            heads: int = 4, dropout: float = 0.5, warmup: int = 1) -> dict:
    """The same model in memory with PyG: GCNConv on a normalised torch CSR adjacency
    (``normalize=False``, as hongtu's GCN normalises by degrees), SAGEConv (mean) and
    GINConv (sum; its MLP as hongtu's GIN: Linear, ReLU, Linear, as wide as the
    layer's output) on the torch CSR adjacency, GATConv on edge_index.
    The median epoch leaves out the first ``warmup`` epochs."""
    try:
        from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv
    except ImportError:
        return {"status": "torch_geometric not installed"}
    n = graph.num_nodes
    state: dict = {}
    try:
        deg_np = graph.in_degree()
        col = torch.from_numpy(graph.indices.astype(np.int64))
        row = torch.repeat_interleave(torch.arange(n), torch.from_numpy(deg_np))
        if layer == "gcn":
            deg = torch.from_numpy(deg_np).double().clamp(min=1)
            w = (deg[col].rsqrt() * deg[row].rsqrt()).float()
            # adj_t[dst, src] = w: rows are destinations, the CSR we already have.
            # (checks off, as hongtu's own blocks: the CSR is built right here)
            adj = torch.sparse_csr_tensor(torch.from_numpy(graph.indptr), col, w,
                                          size=(n, n), check_invariants=False).to(device)
            del w
        elif layer in ("sage", "gin"):
            adj = torch.sparse_csr_tensor(torch.from_numpy(graph.indptr), col,
                                          torch.ones(col.shape[0]), size=(n, n),
                                          check_invariants=False).to(device)
        else:
            adj = torch.stack([col, row]).to(device)  # edge_index: source -> destination
        del col, row
        state["adj"] = adj
        x = torch.from_numpy(np.asarray(graph.x)).to(device)
        y = torch.from_numpy(np.asarray(graph.y)).to(device)
        mask = torch.from_numpy(graph.train_mask).to(device)
        classes = int(graph.y.max()) + 1
        if layer == "gcn":
            dims = [graph.num_features] + [hidden] * (layers - 1) + [classes]
            convs = [GCNConv(a, b, normalize=False) for a, b in zip(dims[:-1], dims[1:])]
        elif layer == "sage":
            dims = [graph.num_features] + [hidden] * (layers - 1) + [classes]
            convs = [SAGEConv(a, b, aggr="mean") for a, b in zip(dims[:-1], dims[1:])]
        elif layer == "gin":
            dims = [graph.num_features] + [hidden] * (layers - 1) + [classes]
            convs = [GINConv(torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(),
                                                 torch.nn.Linear(b, b)))
                     for a, b in zip(dims[:-1], dims[1:])]
        else:
            convs, width = [], graph.num_features
            for i in range(layers):
                last = i == layers - 1
                convs.append(GATConv(width, classes if last else hidden // heads,
                                     heads=1 if last else heads, concat=not last,
                                     add_self_loops=False))
                width = hidden
        convs = torch.nn.ModuleList(convs).to(device)
        opt = torch.optim.Adam(convs.parameters(), lr=0.01)
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(epochs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            h = x
            for i, conv in enumerate(convs):
                h = torch.nn.functional.dropout(h, dropout, training=True)
                h = conv(h, adj)
                if i < len(convs) - 1:
                    h = h.relu()
            loss = torch.nn.functional.cross_entropy(h[mask], y[mask])
            loss.backward()
            opt.step()
            del h, loss
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {"status": "ok", "epoch_s": times,
                "median_epoch_s": steady_median(times, warmup),
                "peak_device_bytes": peak}
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    finally:
        state.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
