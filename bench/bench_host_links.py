"""Pinned host<->GPU copy rates with 1..N GPUs copying at once (a benchmark, not a test).

Out of core on several GPUs, every GPU moves its part's rows over its host
link at the same time; whether those links add up (one PCIe link each, host
memory to spare) or share one limit (a PCIe switch's uplink, host memory
bandwidth) decides how out-of-core epochs scale with GPUs. For ``k = 1 .. N``
this copies ``--size`` bytes per GPU on GPUs ``0 .. k-1`` at once (each from
its own pinned host buffer, each GPU on its own streams, issued from one
thread), host→device, device→host, and both directions together, and prints
the median over ``--repeats`` of the rate per GPU and in all.

Run (on a machine with several GPUs)::

    python bench/bench_host_links.py --size 1GiB --repeats 5

Prints a table and writes ``bench/results/host_links_<device>-x<N>.json``
(``--tag`` prefixes the name).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import RESULTS, device_name, file_tag, write_json

from hongtu.config import parse_size


def rates(k: int, host: list, dev: list, host2: list, dev2: list, repeats: int) -> dict:
    """Bytes/s in all for each direction with GPUs ``0 .. k-1`` copying at once."""
    nbytes = host[0].numel()
    streams = [(torch.cuda.Stream(d), torch.cuda.Stream(d)) for d in range(k)]
    out = {}
    for name in ("h2d", "d2h", "both"):
        times = []
        for _ in range(repeats + 1):  # (the first: warm-up)
            for d in range(k):
                torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            for d in range(k):
                s1, s2 = streams[d]
                if name in ("h2d", "both"):
                    with torch.cuda.stream(s1):
                        dev[d].copy_(host[d], non_blocking=True)
                if name in ("d2h", "both"):
                    with torch.cuda.stream(s2):
                        host2[d].copy_(dev2[d], non_blocking=True)
            for d in range(k):
                torch.cuda.synchronize(d)
            times.append(time.perf_counter() - t0)
        moved = k * nbytes * (2 if name == "both" else 1)
        out[name] = moved / statistics.median(times[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB", help="bytes per GPU and direction")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=0, help="at most this many (0: all)")
    ap.add_argument("--tag", default="", help="prefix of the JSON's name")
    args = ap.parse_args()
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("no CUDA device: this benchmark measures host<->GPU links")
    n = min(n, args.gpus) if args.gpus else n
    nbytes = parse_size(args.size)
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    host2 = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in range(n)]
    dev2 = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in range(n)]
    rows = []
    print(f"{'GPUs':>4} {'h2d GB/s (per GPU)':>20} {'d2h GB/s (per GPU)':>20} "
          f"{'both GB/s (per GPU)':>21}")
    for k in range(1, n + 1):
        r = rates(k, host, dev, host2, dev2, args.repeats)
        rows.append(dict(gpus=k, **{f"{d}_bytes_per_s": v for d, v in r.items()}))
        print(f"{k:>4} " + " ".join(f"{r[d] / 1e9:>9.1f} ({r[d] / k / 1e9:>5.1f})".rjust(w)
                                    for d, w in (("h2d", 20), ("d2h", 20), ("both", 21))))
    name = f"{args.tag + '_' if args.tag else ''}host_links_{file_tag(device_name())}-x{n}.json"
    path = write_json(RESULTS / name, dict(device=device_name(), gpus=n, bytes_per_gpu=nbytes,
                                           repeats=args.repeats, rows=rows))
    print("wrote", path)


if __name__ == "__main__":
    main()
