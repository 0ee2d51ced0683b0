"""Multi-GPU scaling and the inter-GPU dedup ablation (issue 5's benchmark).

The same workload (default: R-MAT scale 22, 3-layer GCN hidden 256, a fixed
device budget per GPU) on 1, 2 and 4 GPUs, with +P2P (rows shared inside a
batch loaded once, by their owner, and sent GPU-to-GPU) and +P2P+RU (also
reused in place across batches). The paper's Baseline (every GPU loads its
whole neighbour set from host) needs every part's rows in every process's
host memory, which hongtu's part-owned host buffers rule out by design: it is
reported as not applicable for more than one GPU and measured on one.

Each configuration runs through the real command (``python -m hongtu train``,
which launches one process per GPU), and epoch times and per-rank bytes come
from its metrics file. Run (on a machine with 4 GPUs)::

    python bench/bench_multigpu.py --scale 22 --devices 1 2 4

Prints a table and writes ``bench/results/multigpu_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEMS = {
    "baseline": ["engine.dedup.reuse=false", "engine.dedup.p2p=false", "engine.reorg=false"],
    "+p2p": ["engine.dedup.reuse=false", "engine.dedup.p2p=true", "engine.reorg=false"],
    "+p2p+ru": ["engine.dedup.reuse=true", "engine.dedup.p2p=true", "engine.reorg=true"],
}


def run(args, devices: int, system: str, work: Path) -> dict:
    out = work / f"{system}-{devices}"
    cmd = [sys.executable, "-m", "hongtu", "train", "configs/rmat22_gcn.yaml",
           f"data.path=builtin:rmat-{args.scale}", f"model.layers={args.layers}",
           f"model.hidden={args.hidden}", f"train.epochs={args.epochs}",
           "train.eval_every=1000", f"engine.devices={devices}",
           f"engine.device_memory={args.budget}", "engine.partitioner=range",
           f"engine.accelerator={args.accelerator}",
           f"engine.cache_dir={work}/cache", f"output.dir={out}", "--overwrite",
           "--metrics", str(out / "m.jsonl"), *SYSTEMS[system], *args.set]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"status": "failed", "stderr": p.stderr[-1500:]}
    recs = [json.loads(line) for line in open(out / "m.jsonl")]
    shape = re.search(r"(\d+) part\(s\) x (\d+) chunk\(s\)", p.stdout)
    # (rank 0's planning step and its wait for the other ranks' agreements)
    planned = re.search(r"planned in ([0-9.]+) s(?:, of which (?:neighbour sets [0-9.]+ s, )?"
                        r"waiting for the other processes ([0-9.]+) s)?", p.stdout)
    # (rank 0's device estimate: what the chunk count and kept rows were chosen by)
    estimate = re.search(r"estimated peak ([0-9.]+ [KMGT]?i?B) per batch", p.stdout)
    steady = recs[1:-1] or recs[1:] or recs  # drop warm-up and the evaluating last epoch
    last = steady[-1]
    return {"status": "ok", "chunks": int(shape[2]) if shape else None,
            "resident": "device buffers (resident" in p.stdout,
            "blocks_copied": "chunk blocks: copied" in p.stdout,
            "estimate": estimate[1] if estimate else None,
            "plan_s": float(planned[1]) if planned else None,
            "plan_waits_s": float(planned[2]) if planned and planned[2] else None,
            "epoch_s": [r["epoch_s"] for r in recs],
            "median_epoch_s": statistics.median(r["epoch_s"] for r in steady),
            "h2d_bytes": last["h2d_bytes"], "d2d_bytes": last["d2d_bytes"],
            "d2h_bytes": last["d2h_bytes"], "peak_device_bytes": last["peak_device_bytes"],
            "ranks": last.get("ranks"), "loss": [r["loss"] for r in recs],
            "time_split_s": {k: last[k] for k in last if k.startswith("time_")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=22)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--budget", default="8GiB", help="device memory per GPU")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="prefix of the JSON's name (TAG_multigpu_...)")
    ap.add_argument("--accelerator", default="cuda")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (e.g. engine.chunks=12)")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after which the remaining configurations are skipped")
    args = ap.parse_args()
    have = torch.cuda.device_count()
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout \
        if have else ""
    print(topo)
    results = {}
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for d in [d for d in args.devices if d <= have or args.accelerator == "cpu"]:
            for system in args.systems.split(","):
                if system == "baseline" and d > 1:
                    results[f"{system}/{d}"] = {"status": "n/a: part-owned host memory"}
                    continue
                if time.time() - start > args.deadline:
                    results[f"{system}/{d}"] = {"status": "skipped: deadline"}
                    continue
                r = run(args, d, system, Path(tmp))
                results[f"{system}/{d}"] = r
                shown = (f"{r['median_epoch_s']:.3f} s, peak "
                         f"{r['peak_device_bytes'] / 2**30:.2f} GiB, rank 0's estimate "
                         f"{r['estimate']}") if r["status"] == "ok" else r["status"]
                print(f"{system:<10} {d} GPU(s): {shown} "
                      f"({time.time() - start:.0f} s elapsed)", flush=True)
                if r["status"] != "ok":
                    print(r["stderr"], flush=True)
    base = results.get("+p2p+ru/1", {}).get("median_epoch_s")
    print(f"\n{'system':<10}{'GPUs':>6}{'chunks':>8}{'epoch s':>10}{'speedup':>9}"
          f"{'h2d GiB':>10}{'d2d GiB':>10}{'d2h GiB':>10}  resident")
    for key, r in results.items():
        system, d = key.split("/")
        if r.get("status") != "ok":
            print(f"{system:<10}{d:>6}  {r.get('status')}")
            continue
        sp = base / r["median_epoch_s"] if base else float("nan")
        print(f"{system:<10}{d:>6}{r['chunks'] or '?':>8}{r['median_epoch_s']:>10.3f}{sp:>9.2f}"
              f"{r['h2d_bytes'] / 2**30:>10.2f}{r['d2d_bytes'] / 2**30:>10.2f}"
              f"{r['d2h_bytes'] / 2**30:>10.2f}  {'yes' if r['resident'] else 'no'}")
    name = torch.cuda.get_device_name(0) if have else "cpu"
    doc = {"device": name, "gpus": have, "topology": topo, "scale": args.scale,
           "layers": args.layers, "hidden": args.hidden, "budget_per_gpu": args.budget,
           "overrides": args.set,
           "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
    path = out / f"{args.tag + '_' if args.tag else ''}multigpu_{tag}-x{have}.json"
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
    os.sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
