"""Zero-copy row copies beside compute: what the row kernel's grid costs (a benchmark, GPU).

hongtu's row kernel (:mod:`hongtu.engine._triton_rows`) gathers rows from
pinned host memory (loads) and scatters rows into it (stores) on a bounded
grid. For rows of 47, 100 and 256 float32 and each grid (``None``: half a
program per SM of 4 rows; ``P×R``: P programs of 16 warps moving R rows per
loop iteration), this measures

* the copy's rate alone (GB/s);
* how much longer a 100K×256×256 GEMM and a cuSPARSE product (150K rows,
  4M edges, 47 wide) take while copies run on another stream (× their time
  alone);
* the copy's rate and that of a DMA copy going the other way at the same time.

These are the figures behind ``hongtu.engine.transfer.ROW_LOADS`` /
``ROW_STORES``. Run (GPU machine)::

    python bench/bench_rows.py

Prints a table and writes ``bench/results/rows_<device>.json``.

``--layouts`` measures instead the copy's rate alone by the rows' layout in
pinned host memory (allocated as the engine allocates it,
:func:`~hongtu.engine.pinned.pinned_tensor`): rows of 100 float32 packed
(400-byte rows, one in eight on a 128-byte boundary) or padded to 128 (every
row on one), 128 and 256 wide, 47 packed or padded to 64; 100K of 2.45M rows,
their ids sorted or in random order, gathered from and scattered into host
memory on each grid. It writes ``bench/results/rows_layout_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from common import RESULTS, device_name, file_tag

from hongtu.engine.pinned import device_view

GRIDS = {"load": (None, (8, 64), (16, 64)), "store": (None, (2, 64), (4, 64), (2, 128))}
#: ``--layouts``: (row width, row stride) in float32
LAYOUTS = ((100, 100), (100, 128), (128, 128), (256, 256), (47, 47), (47, 64))


def _timed(fn, reps: int = 20, stream=None) -> float:
    """Milliseconds per call of ``fn`` on ``stream`` (CUDA events)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    return e0.elapsed_time(e1) / reps


def _measure(copy, other, nbytes: int, other_bytes: int, compute: dict, alone: dict,
             side) -> dict:
    """One grid's figures: ``copy`` alone, beside each ``compute``, beside ``other``."""
    copy()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        t_copy = _timed(copy, 5, side)
    slow = {}
    for name, fn in compute.items():
        torch.cuda.synchronize()
        with torch.cuda.stream(side):  # enough copies to outlast the compute
            for _ in range(int(3 * 20 * alone[name] / t_copy) + 2):
                copy()
        slow[name] = _timed(fn) / alone[name]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        t_other = _timed(other, 5, side)
    torch.cuda.synchronize()
    k = int(6 * t_other / t_copy) + 1
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.cuda.stream(side):
        ev[2].record(side)
        for _ in range(6):
            other()
        ev[3].record(side)
    ev[0].record()
    for _ in range(k):
        copy()
    ev[1].record()
    torch.cuda.synchronize()
    return {"gb_per_s": nbytes / t_copy / 1e6, "gemm_slowdown": slow["gemm"],
            "spmm_slowdown": slow["spmm"],
            "with_dma_copy_gb_per_s": nbytes * k / ev[0].elapsed_time(ev[1]) / 1e6,
            "with_dma_dma_gb_per_s": other_bytes * 6 / ev[2].elapsed_time(ev[3]) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--layouts", action="store_true",
                    help="the copy's rate by the rows' layout in host memory instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rows.py measures GPU kernels: run it on a GPU machine")
    if args.layouts:
        layouts(Path(args.out))
        return
    from hongtu.engine import _triton_rows as R

    dev = torch.device("cuda")
    torch.manual_seed(0)
    a, w, b = (torch.randn(100_000, 256, device=dev), torch.randn(256, 256, device=dev),
               torch.randn(256, device=dev))
    nr, nc, ne = 150_000, 1_200_000, 4_000_000
    rows = torch.randint(0, nr, (ne,), device=dev).sort().values
    crow = torch.zeros(nr + 1, dtype=torch.int64, device=dev)
    crow[1:] = torch.bincount(rows, minlength=nr).cumsum(0)
    adj = torch.sparse_csr_tensor(crow, torch.randint(0, nc, (ne,), device=dev),
                                  torch.rand(ne, device=dev), size=(nr, nc),
                                  check_invariants=False)
    x = torch.randn(nc, 47, device=dev)
    compute = {"gemm": lambda: torch.addmm(b, a, w),
               "spmm": lambda: torch.addmm(x.new_empty(nr, 47), adj, x, beta=0)}
    alone = {}
    for name, fn in compute.items():
        _timed(fn, 3)
        alone[name] = _timed(fn)
    side, dma_dev = torch.cuda.Stream(), torch.empty(400_000, 256, device=dev)
    dma_host = torch.empty(400_000, 256).pin_memory()
    records = []
    print(f"alone: GEMM {alone['gemm']:.3f} ms, cuSPARSE product {alone['spmm']:.3f} ms",
          flush=True)
    print(f"{'copy':<6}{'width':>6}{'grid':>8}{'GB/s':>8}{'GEMM x':>8}{'spmm x':>8}"
          f"{'+DMA: copy':>12}{'DMA':>7}")
    for width in (47, 100, 256):
        host = torch.randn(2_450_000, width).pin_memory()
        view = device_view(host, dev)
        n = 400_000 if width == 256 else 1_000_000
        ids = torch.randperm(2_450_000, device=dev)[:n].sort().values
        buf = torch.empty(n, width, device=dev)
        for kind, grids in GRIDS.items():
            for grid in grids:
                if kind == "load":
                    copy = partial(R.copy_rows_triton, view, buf, ids, None, grid)
                    other = partial(dma_host.copy_, dma_dev, non_blocking=True)  # the other way
                else:
                    copy = partial(R.copy_rows_triton, buf, view, None, ids, grid)
                    other = partial(dma_dev.copy_, dma_host, non_blocking=True)
                rec = {"copy": kind, "width": width, "rows": n,
                       "grid": "half a program per SM" if grid is None else list(grid),
                       **_measure(copy, other, n * width * 4, dma_dev.numel() * 4, compute,
                                  alone, side)}
                records.append(rec)
                g = "½/SM" if grid is None else f"{grid[0]}x{grid[1]}"
                print(f"{kind:<6}{width:>6}{g:>8}{rec['gb_per_s']:>8.1f}"
                      f"{rec['gemm_slowdown']:>8.2f}{rec['spmm_slowdown']:>8.2f}"
                      f"{rec['with_dma_copy_gb_per_s']:>12.1f}"
                      f"{rec['with_dma_dma_gb_per_s']:>7.1f}", flush=True)
        del view, host
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = device_name()
    path = out / f"rows_{file_tag(name)}.json"
    path.write_text(json.dumps({"device": name, "gemm_ms": alone["gemm"],
                                "spmm_ms": alone["spmm"], "runs": records}, indent=1))
    print(f"wrote {path}")


def layouts(out: Path, num_rows: int = 2_450_000, n: int = 100_000) -> None:
    """``--layouts``: GB/s of the rows' own bytes, per layout, grid and id order."""
    from hongtu.engine import _triton_rows as R
    from hongtu.engine.pinned import pinned_tensor

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    records = []
    print(f"{'width':>6}{'stride':>7}{'grid':>8}{'gather sorted':>15}{'random':>8}"
          f"{'scatter sorted':>16}{'random':>8}   (GB/s of the rows' bytes)")
    for width, stride in LAYOUTS:
        host = pinned_tensor((num_rows, stride), torch.float32)
        host.fill_(1.0)
        view = device_view(host, dev)[:, :width]
        buf = torch.randn(n, width, device=dev)
        perm = torch.randperm(num_rows, generator=gen)[:n]
        ids = {"sorted": perm.sort().values.to(dev), "random": perm.to(dev)}
        for grid in (None, (2, 64), (8, 64), (16, 64)):
            rec = {"width": width, "stride": stride,
                   "grid": "half a program per SM" if grid is None else list(grid)}
            for order, i in ids.items():
                copies = (("gather", partial(R.copy_rows_triton, view, buf, i, None, grid)),
                          ("scatter", partial(R.copy_rows_triton, buf, view, None, i, grid)))
                for kind, copy in copies:
                    copy()
                    torch.cuda.synchronize()
                    rec[f"{kind}_{order}_gb_per_s"] = n * width * 4 / _timed(copy) / 1e6
            records.append(rec)
            g = "½/SM" if grid is None else f"{grid[0]}x{grid[1]}"
            print(f"{width:>6}{stride:>7}{g:>8}{rec['gather_sorted_gb_per_s']:>15.1f}"
                  f"{rec['gather_random_gb_per_s']:>8.1f}{rec['scatter_sorted_gb_per_s']:>16.1f}"
                  f"{rec['scatter_random_gb_per_s']:>8.1f}", flush=True)
        del view, host
    out.mkdir(parents=True, exist_ok=True)
    name = device_name()
    path = out / f"rows_layout_{file_tag(name)}.json"
    path.write_text(json.dumps({"device": name, "host_rows": num_rows, "rows": n,
                                "runs": records}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
