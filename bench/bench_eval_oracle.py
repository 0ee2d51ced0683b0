"""Evaluation between training steps, at scale: a suite workload trained out of
core with an evaluation pass after every step, without one, and resident with
one, in one process.

Evaluation reads the rows a training step fetched ahead for the next forward
(on a GPU, the next forward's first rows travel during the last backward
pass) and writes ``h^l`` in vertex order, where training writes them in load
order; on graphs this size those copies may still be in flight when a step
ends (reddit-like GCN 2x256: ``bench/HISTORY.md``, 2026-11-28 tenth). The
training losses must not depend on whether evaluation ran (dropout streams
are hashed from (seed, epoch, layer), so they do not), and the out-of-core
evaluation must count what the resident one counts. The unit tests check
the same on small graphs, where those copies are short.

Run (GPU machine)::

    python bench/bench_eval_oracle.py reddit-like --model gcn2 --budget 2648875264

Prints the losses and accuracies per epoch and the largest relative loss
difference, and writes ``bench/results/eval_oracle_<workload>_<model>_<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_suite import MODELS, SYSTEMS, WORKLOADS, make_graph, model_cfg, serve, suite_config
from common import RESULTS, device_name, file_tag, write_json

from hongtu.config import parse_size
from hongtu.engine.trainer import Trainer


def run(args, system: str, evaluate: bool) -> list[dict]:
    mcfg = model_cfg(args.model, WORKLOADS[args.workload]["hidden"])
    budget = "auto" if SYSTEMS[system]["resident"] else parse_size(args.budget)
    cfg = suite_config(args.workload, mcfg, args.workdir, args.epochs,
                       device_memory=budget, **SYSTEMS[system])
    tr = Trainer(cfg, overwrite=True, out=lambda s: None)
    recs = []
    for e in range(args.epochs):
        r = tr.run_epoch(e, evaluate=evaluate)
        recs.append({k: r[k] for k in ("loss", "train_acc", "val_acc", "test_acc", "epoch_s")})
        print(f"{system:<9} evaluate={evaluate!s:<5} epoch {e}: loss {r['loss']:.7f}, "
              f"accuracy train/val/test {r['train_acc']}/{r['val_acc']}/{r['test_acc']}, "
              f"{r['epoch_s']:.3f} s", flush=True)
    chunks = tr.partition.num_chunks
    del tr
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [dict(r, chunks=chunks) for r in recs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default="gcn2", choices=sorted(MODELS))
    ap.add_argument("--budget", required=True, help="out-of-core budget (bytes or e.g. 2.5GiB)")
    ap.add_argument("--scale", type=int, default=None, help="R-MAT scale of rmat22/largest")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/hongtu_eval_oracle")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    graph = make_graph(args.workload, args.scale)
    serve(args.workload, graph)
    runs = {"hongtu": run(args, "hongtu", False), "hongtu+eval": run(args, "hongtu", True)}
    if torch.cuda.is_available():
        runs["resident+eval"] = run(args, "resident", True)
    a, b = runs["hongtu"], runs["hongtu+eval"]
    loss_rel = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    out = {"device": device_name(), "workload": args.workload, "model": args.model,
           "budget": args.budget, "runs": runs, "loss_max_rel_diff_eval_on_off": loss_rel}
    print(f"largest relative loss difference, evaluation on against off: {loss_rel:.2e}")
    if "resident+eval" in runs:
        acc = max(abs(x[k] - y[k]) for x, y in zip(b, runs["resident+eval"])
                  for k in ("train_acc", "val_acc", "test_acc"))
        out["acc_max_abs_diff_ooc_resident"] = acc
        print(f"largest accuracy difference, out of core against resident: {acc:.2e}")
    path = write_json(Path(args.out) / (f"eval_oracle_{args.workload}_{args.model}_"
                                        f"{file_tag(out['device'])}.json"), out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
