r"""``hongtu calibrate``: measure this machine's link throughputs for the cost model.

The transfer cost model (HongTu Eq. 4, :func:`hongtu.reorg.cost`) needs three
throughputs: host -> device row loads, device <-> device peer copies and
in-place reuse on the device. With CUDA this measures, on the engine's own
paths:

* a contiguous copy from pinned host memory to the device (contiguous ranges);
* the GPU gathering random 512-byte rows, sorted ids, straight from pinned host
  memory through a zero-copy device view (``engine.throughput.host_to_device``);
* a peer copy from GPU 0 to GPU 1, when there are two or more
  (``engine.throughput.device_to_device``);
* the GPU gathering the same rows from its own memory (``engine.throughput.reuse``).

Without CUDA it measures the CPU equivalents, memcpy (``reuse``: the "device"
is host memory) and a ``torch.index_select`` gather of random rows
(``host_to_device``), and says so. Figures are GB/s (10^9 bytes per second),
the median of a few repetitions, written as JSON that ``engine.throughput.*:
auto`` reads from ``<engine.cache_dir>/calibration.json``.

Example::

    >>> result = calibrate(size_mib=64)
    >>> result["throughput"]["host_to_device"]
    48.7
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from hongtu.config import THROUGHPUT_DEFAULTS, EngineConfig
from hongtu.errors import UserError

__all__ = ["CALIBRATION_FILE", "CONTIGUOUS_DEFAULT", "calibrate", "default_output",
           "format_calibration", "resolve_throughput", "write_calibration"]

CALIBRATION_FILE = "calibration.json"
#: Contiguous pinned host -> device copy (GB/s) on an H200 (DESIGN.md §3).
CONTIGUOUS_DEFAULT = 55.0
_ROW_BYTES = 512
_KEYS = ("host_to_device", "device_to_device", "reuse")


def default_output() -> Path:
    """``<engine.cache_dir default>/calibration.json``, i.e. ``.hongtu_cache/calibration.json``."""
    return Path(EngineConfig().cache_dir) / CALIBRATION_FILE


def _median_s(fn: Callable[[], None], sync: Callable[[], None], budget_s: float = 0.4,
              min_reps: int = 3, max_reps: int = 20) -> float:
    """Median seconds of ``fn`` after one warm-up, repeated until ``budget_s`` is spent."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps
                                    and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows(size_mib: int) -> int:
    return max(1024, (int(size_mib) << 20) // _ROW_BYTES)


def _measure_cuda(size_mib: int) -> tuple[dict, dict, str]:
    import torch

    from hongtu.engine.pinned import device_view, pinned_empty

    dev = torch.device("cuda", 0)
    width = _ROW_BYTES // 4
    rows = _rows(size_mib)
    nbytes = rows * _ROW_BYTES

    def sync() -> None:
        torch.cuda.synchronize(dev)

    host, pinned = pinned_empty((rows, width), torch.float32)
    if not pinned:  # cudaHostRegister refused: fall back to the caching host allocator
        host = torch.empty((rows, width), dtype=torch.float32, pin_memory=True)
    host.fill_(1.0)
    dev_buf = torch.empty((rows, width), dtype=torch.float32, device=dev)
    ids = torch.randperm(rows, device=dev)[: rows // 2].sort().values
    gathered = int(ids.numel()) * _ROW_BYTES
    out: dict[str, float | None] = {}
    t = _median_s(lambda: dev_buf.copy_(host, non_blocking=True), sync)
    out["h2d_contiguous"] = nbytes / t / 1e9
    view = device_view(host, dev)
    t = _median_s(lambda: view.index_select(0, ids), sync)
    out["h2d_gather_sorted"] = gathered / t / 1e9
    t = _median_s(lambda: dev_buf.index_select(0, ids), sync)
    out["device_gather"] = gathered / t / 1e9
    out["d2d_peer"] = None
    if torch.cuda.device_count() >= 2:
        peer = torch.device("cuda", 1)
        other = torch.empty((rows, width), dtype=torch.float32, device=peer)

        def sync_both() -> None:
            torch.cuda.synchronize(dev)
            torch.cuda.synchronize(peer)

        t = _median_s(lambda: other.copy_(dev_buf, non_blocking=True), sync_both)
        out["d2d_peer"] = nbytes / t / 1e9
    mapping = {"host_to_device": out["h2d_gather_sorted"], "reuse": out["device_gather"],
               "contiguous": out["h2d_contiguous"]}
    if out["d2d_peer"] is not None:
        mapping["device_to_device"] = out["d2d_peer"]
    name = f"cuda:0 ({torch.cuda.get_device_name(dev)}, {torch.cuda.device_count()} GPU(s))"
    return out, mapping, name


def _measure_cpu(size_mib: int) -> tuple[dict, dict, str]:
    import torch

    width = _ROW_BYTES // 4
    rows = _rows(size_mib)
    src = torch.ones((rows, width), dtype=torch.float32)
    dst = torch.empty_like(src)
    ids = torch.randperm(rows)[: rows // 2].sort().values
    gathered = torch.empty((int(ids.numel()), width), dtype=torch.float32)
    out: dict[str, float | None] = {}
    t = _median_s(lambda: dst.copy_(src), lambda: None)
    out["memcpy"] = rows * _ROW_BYTES / t / 1e9
    t = _median_s(lambda: torch.index_select(src, 0, ids, out=gathered), lambda: None)
    out["gather_sorted"] = int(ids.numel()) * _ROW_BYTES / t / 1e9
    mapping = {"host_to_device": out["gather_sorted"], "reuse": out["memcpy"],
               "contiguous": out["memcpy"]}
    return out, mapping, f"cpu ({platform.processor() or platform.machine()}, " \
                         f"{torch.get_num_threads()} threads)"


def calibrate(size_mib: int = 256, force_cpu: bool = False) -> dict:
    """Measure this machine; returns the JSON-serialisable calibration record.

    Args:
        size_mib: bytes moved per measurement, in MiB (default 256).
        force_cpu: measure the CPU paths even when CUDA is available.

    Returns:
        ``{"version", "created", "host", "device", "device_name", "size_mib",
        "seconds", "measurements": {name: GB/s}, "throughput": {key: GB/s}}``;
        ``throughput`` holds the ``engine.throughput`` keys measured here (and
        ``contiguous``), ``measurements`` every figure taken.
    """
    import torch

    if size_mib < 1:
        raise UserError(f"--size {size_mib}: give at least 1 MiB")
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not force_cpu
    if cuda:
        measured, mapping, name = _measure_cuda(size_mib)
    else:
        measured, mapping, name = _measure_cpu(size_mib)
    return {
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": "cuda" if cuda else "cpu",
        "device_name": name,
        "torch": torch.__version__,
        "size_mib": int(size_mib),
        "row_bytes": _ROW_BYTES,
        "seconds": time.perf_counter() - t0,
        "measurements": {k: (None if v is None else round(v, 3)) for k, v in measured.items()},
        "throughput": {k: round(v, 3) for k, v in mapping.items()},
    }


_LABELS = {
    "h2d_contiguous": ("host -> device, contiguous copy from pinned memory", "contiguous ranges"),
    "h2d_gather_sorted": ("host -> device, GPU gather of 512-byte rows (zero-copy, sorted)",
                          "engine.throughput.host_to_device"),
    "d2d_peer": ("device -> device, peer copy GPU 0 -> GPU 1",
                 "engine.throughput.device_to_device"),
    "device_gather": ("device-local gather of 512-byte rows (reuse path)",
                      "engine.throughput.reuse"),
    "memcpy": ("memcpy (CPU copy of a contiguous buffer)", "engine.throughput.reuse, contiguous"),
    "gather_sorted": ("CPU gather of random 512-byte rows (torch.index_select, sorted)",
                      "engine.throughput.host_to_device"),
}


def format_calibration(result: dict) -> str:
    """The calibration record as a table in GB/s."""
    lines = [f"calibration on {result['device_name']}: {result['size_mib']} MiB per "
             f"measurement, {result['seconds']:.1f} s"]
    if result["device"] == "cpu":
        lines.append("no CUDA device: measured the CPU equivalents (memcpy, torch.index_select "
                     "gather); device_to_device is not measured and keeps its default "
                     f"{THROUGHPUT_DEFAULTS['device_to_device']:g} GB/s")
    rows = [("measurement", "GB/s", "used for")]
    for key, value in result["measurements"].items():
        what, used = _LABELS.get(key, (key, ""))
        if value is None:
            rows.append((what, "-", "needs 2 GPUs; device_to_device keeps its default"))
        else:
            rows.append((what, f"{value:,.1f}", used))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for k, r in enumerate(rows):
        lines.append(f"  {r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}".rstrip())
        if k == 0:
            lines.append(f"  {'-' * w0}  {'-' * w1}  {'-' * len(r[2])}")
    return "\n".join(lines)


def write_calibration(result: dict, out: Path, overwrite: bool = False) -> Path:
    """Write ``result`` as JSON to ``out`` atomically; an existing ``out`` needs ``overwrite``."""
    from hongtu.plot import check_output, write_atomic

    check_output(out, overwrite, None, "calibration")
    data = (json.dumps(result, indent=2) + "\n").encode()
    write_atomic(out, lambda f: f.write(data))
    return out


def resolve_throughput(engine: EngineConfig) -> dict:
    """``engine.throughput`` in bytes/s, with ``auto`` resolved.

    ``auto`` takes the figure in ``<engine.cache_dir>/calibration.json`` when
    the file exists and measured it, else :data:`hongtu.config.THROUGHPUT_DEFAULTS`.

    Returns:
        ``{"host_to_device", "device_to_device", "reuse", "contiguous"}`` in
        bytes/s, and ``"source"``: where each came from (``config``, the
        calibration file's path, or ``default``).

    Raises:
        UserError: the calibration file exists but is not a calibration record.
    """
    path = Path(engine.cache_dir) / CALIBRATION_FILE
    measured: dict = {}
    if path.is_file():
        try:
            measured = json.loads(path.read_text())["throughput"]
            if not isinstance(measured, dict):
                raise TypeError("'throughput' is not a mapping")
            for v in measured.values():
                if not isinstance(v, (int, float)) or v <= 0:
                    raise ValueError(f"throughput {v!r} is not a positive number")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"calibration file '{path}' is not a calibration record ({e}); "
                            "run 'hongtu calibrate --overwrite' to measure again, or delete "
                            "it") from None
    out: dict = {"source": {}}
    for key in (*_KEYS, "contiguous"):
        value = getattr(engine.throughput, key, "auto")
        if value != "auto":
            out[key], out["source"][key] = float(value) * 1e9, "config"
        elif key in measured:
            out[key], out["source"][key] = float(measured[key]) * 1e9, str(path)
        else:
            default = CONTIGUOUS_DEFAULT if key == "contiguous" else THROUGHPUT_DEFAULTS[key]
            out[key], out["source"][key] = default * 1e9, "default"
    return out
