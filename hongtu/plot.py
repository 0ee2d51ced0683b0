r"""``hongtu plot``: draw a run's metrics file (JSON lines, one record per epoch).

Panels, top to bottom: the training loss; train / val / test accuracy (epochs
without an evaluation are gaps); and, when the records carry the engine's
time split (``time_h2d_s``, ``time_d2h_s``, ``time_d2d_s``, ``time_compute_s``,
``time_cpu_s``, any that are present), a stacked bar per epoch with the
measured ``epoch_s`` as a line over it. Epochs are numbered from 1, as in the
lines ``hongtu train`` prints (records store them from 0).

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display), and
the image is written to a temporary file beside the target and renamed into
place, so an interrupted run leaves no partial image.

Example::

    >>> records = read_metrics("runs/gcn_example/metrics.jsonl")
    >>> plot_metrics(records, "runs/gcn_example/metrics.png")
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from hongtu.errors import UserError

__all__ = ["read_metrics", "plot_metrics", "TIME_KEYS", "FORMATS", "check_output",
           "probe_directory", "write_atomic"]

# Time split of an epoch, in the order the bars are stacked.
TIME_KEYS = ("time_h2d_s", "time_d2h_s", "time_d2d_s", "time_compute_s", "time_cpu_s")
_TIME_LABELS = {"time_h2d_s": "host → device", "time_d2h_s": "device → host",
                "time_d2d_s": "device → device", "time_compute_s": "compute",
                "time_cpu_s": "host CPU"}
_ACC_KEYS = (("train_acc", "train"), ("val_acc", "val"), ("test_acc", "test"))
FORMATS = (".png", ".pdf", ".svg")


def read_metrics(path: str | Path) -> list[dict]:
    """Read and check a metrics file; one dict per non-blank line.

    Raises:
        UserError: the file is missing, unreadable or empty, a line is not a
            JSON object, or a record lacks a numeric ``epoch`` or ``loss``.
    """
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "not found"
        raise UserError(f"metrics file '{p}': {what}; pass the file written by "
                        "'hongtu train CONFIG --metrics FILE'")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())
        raise UserError(f"metrics file '{p}': cannot be read ({reason}); check its "
                        "permissions and that it is a text file") from exc
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"metrics file '{p}': line {number} is not JSON ({exc.msg} at "
                            f"column {exc.colno}); every line must be one JSON record as "
                            "written by 'hongtu train --metrics'") from exc
        if not isinstance(rec, dict):
            raise UserError(f"metrics file '{p}': line {number} is a JSON "
                            f"{type(rec).__name__}, not a record {{\"epoch\": ..., "
                            "\"loss\": ...}")
        for key in ("epoch", "loss"):
            if key not in rec:
                raise UserError(f"metrics file '{p}': line {number} has no '{key}'; is this a "
                                "file written by 'hongtu train --metrics'?")
        _check_numbers(p, number, rec)
        records.append(rec)
    if not records:
        raise UserError(f"metrics file '{p}' is empty; it fills one line per epoch while "
                        "'hongtu train --metrics' runs")
    return records


def _check_numbers(p: Path, number: int, rec: dict) -> None:
    def is_number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not is_number(rec["epoch"]):
        raise UserError(f"metrics file '{p}': line {number}: 'epoch' is {rec['epoch']!r}, "
                        "expected a number")
    optional = ("epoch_s", *TIME_KEYS, *(k for k, _ in _ACC_KEYS))
    for key in ("loss", *optional):
        v = rec.get(key)
        if not (is_number(v) or (v is None and key != "loss")):
            expected = "a number" if key == "loss" else "a number or null"
            raise UserError(f"metrics file '{p}': line {number}: '{key}' is {v!r}, expected "
                            f"{expected}")


def plot_metrics(records: list[dict], out: str | Path, overwrite: bool = False,
                 title: str | None = None) -> Path:
    """Draw ``records`` (from :func:`read_metrics`) into the image file ``out``.

    Args:
        records: per-epoch metric records, each with ``epoch`` and ``loss``.
        out: the image; ``.png`` (default format), ``.pdf`` or ``.svg``.
        overwrite: replace an existing ``out``. Default ``False``.
        title: figure title (default: none).

    Returns:
        The path written.

    Raises:
        UserError: ``out`` exists (without ``overwrite``), is a directory, has
            an unsupported suffix, or cannot be written.
    """
    out = Path(out)
    check_output(out, overwrite, FORMATS, "plot")
    fig = _figure(records, title)
    fmt = out.suffix.lower().lstrip(".")
    write_atomic(out, lambda f: fig.savefig(f, format=fmt, dpi=100))
    return out


def check_output(out: Path, overwrite: bool, suffixes: tuple[str, ...] | None,
                 what: str) -> None:
    """Refuse an output path that exists (unless ``overwrite``) or has the wrong suffix."""
    if suffixes is not None and out.suffix.lower() not in suffixes:
        raise UserError(f"output '{out}': the {what} is written as "
                        f"{' / '.join(s.lstrip('.') for s in suffixes)}; end the file name "
                        f"with {' or '.join(suffixes)}")
    if out.is_dir():
        raise UserError(f"output '{out}' is a directory; give a file name")
    if out.exists() and not overwrite:
        raise UserError(f"output '{out}' already exists; pass --overwrite to replace it, or "
                        "choose another file")
    try:  # (before the work whose result it is, not after)
        probe_directory(out.parent)
    except OSError as exc:
        raise UserError(f"output '{out}': cannot be written ({' '.join(str(exc).split())}); "
                        "check the directory exists and is writable") from exc


def probe_directory(directory: Path) -> None:
    """Raise ``OSError`` where a file cannot be made in ``directory`` (created if
    missing); nothing is left behind: the probe's file and the directories it
    made are removed."""
    directory = Path(directory)
    made = []  # (innermost first)
    d = directory
    while not d.exists() and d.parent != d:
        made.append(d)
        d = d.parent
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(f"'{d}' is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".hongtu-probe.", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    finally:
        for m in made:
            if m.is_dir():
                m.rmdir()


def write_atomic(out: Path, write) -> None:
    """Call ``write(fileobj)`` on a temporary file beside ``out``, then rename it to ``out``.

    The parent directory is created if needed; on any failure the temporary
    file is removed and ``out`` is left as it was.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise UserError(f"output '{out}': cannot be written ({' '.join(str(exc).split())}); "
                        "check the directory exists and is writable") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise UserError(f"output '{out}': cannot be written "
                            f"({' '.join(str(exc).split())}); check the disk space and "
                            "permissions") from exc
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _series(records: list[dict], key: str) -> list[float]:
    return [math.nan if r.get(key) is None else float(r[key]) for r in records]


def _figure(records: list[dict], title: str | None):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    epochs = [int(r["epoch"]) + 1 for r in records]
    times = [k for k in TIME_KEYS if any(r.get(k) is not None for r in records)]
    panels = 3 if times else 2
    fig = Figure(figsize=(9, 2.8 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True)
    marker = "o" if len(records) <= 30 else None

    ax = axes[0]
    ax.plot(epochs, _series(records, "loss"), marker=marker, color="C0")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)

    ax = axes[1]
    drawn = False
    for key, label in _ACC_KEYS:
        ys = _series(records, key)
        if any(not math.isnan(y) for y in ys):
            # Evaluated epochs only, so sparse evaluation (train.eval_every) draws a line.
            pts = [(e, y) for e, y in zip(epochs, ys) if not math.isnan(y)]
            ax.plot([e for e, _ in pts], [y for _, y in pts],
                    marker="o" if len(pts) <= 30 else None, label=label)
            drawn = True
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.text(0.5, 0.5, "no accuracy recorded", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)

    if times:
        ax = axes[2]
        bottom = [0.0] * len(records)
        for key in times:
            ys = [0.0 if math.isnan(y) else y for y in _series(records, key)]
            ax.bar(epochs, ys, bottom=bottom, width=0.8, label=_TIME_LABELS[key])
            bottom = [b + y for b, y in zip(bottom, ys)]
        if any(r.get("epoch_s") is not None for r in records):
            ax.plot(epochs, _series(records, "epoch_s"), color="black", marker=marker,
                    linewidth=1, label="epoch (measured)")
        ax.set_ylabel("seconds per epoch")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.grid(alpha=0.3, axis="y")
    axes[-1].set_xlabel("epoch")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    return fig
