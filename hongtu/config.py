r"""YAML configuration: typed, strict, one documented field each.

A config file has five sections, each a dataclass below: ``data``, ``model``,
``train``, ``engine``, ``output``. Loading is strict: an unknown key, a value
of the wrong type or one out of range fails with one line naming the key, the
file and the valid choices. Command-line overrides use dotted keys
(``train.epochs=3``) and their values are parsed as YAML scalars.

Example::

    >>> cfg = load_config("configs/gcn_example.yaml", ["train.epochs=3"])
    >>> cfg.train.epochs
    3
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hongtu.errors import UserError

__all__ = [
    "Config", "DataConfig", "ModelConfig", "TrainConfig", "EngineConfig", "DedupConfig",
    "ThroughputConfig", "OutputConfig", "THROUGHPUT_DEFAULTS", "load_config", "config_from_dict",
    "parse_size", "format_size",
]

Auto = Literal["auto"]


def _f(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
       check: typing.Callable[[Any], str | None] | None = None) -> Any:
    """A dataclass field with its documentation and bounds in the metadata."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "check": check}
    if isinstance(default, (dict, list)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``8GiB``, ``512MB`` or ``1073741824``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"'{text}' is not a size; write e.g. 8GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def format_size(n: float) -> str:
    """Human-readable binary size: ``format_size(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _check_size(v: Any) -> str | None:
    if v == "auto":
        return None
    try:
        if parse_size(v) <= 0:
            return "must be positive"
    except ValueError as e:
        return str(e)
    return None


def _check_throughput(v: Any) -> str | None:
    if v == "auto" or (math.isfinite(v) and v > 0):
        return None
    return "give a positive number of GB/s such as 21.5, or auto"


def _check_layer(v: str) -> str | None:
    if v in ("gcn", "sage", "gin", "gat") or re.fullmatch(r"[\w.]+:[\w.]+", v):
        return None
    return "choose gcn, sage, gin, gat, or a dotted path 'package.module:ClassName'"


@dataclass
class DataConfig:
    """Where the graph comes from and how it is prepared."""

    path: str = _f("builtin:sbm-small", "builtin:NAME, a .npz file, a directory of .npy files, "
                   "or an edge-list text file")
    undirected: bool = _f(True, "add the reverse of every edge")
    self_loops: bool = _f(True, "give every vertex exactly one self-loop")
    normalize_features: bool = _f(False, "row-normalise features to sum 1 (Planetoid practice)")
    num_features: int = _f(64, "features generated for an edge-list file (it has none)", lo=1)


@dataclass
class ModelConfig:
    """The GNN: one layer type stacked ``layers`` times."""

    layer: str = _f("gcn", "gcn | sage | gin | gat | package.module:ClassName", check=_check_layer)
    hidden: int = _f(256, "hidden width (per head for gat)", lo=1)
    layers: int = _f(2, "number of GNN layers", lo=1, hi=64)
    dropout: float = _f(0.5, "dropout on every layer's input", lo=0.0, hi=0.99)
    heads: int = _f(8, "attention heads of hidden gat layers", lo=1)
    out_heads: int = _f(1, "attention heads of the last gat layer (averaged)", lo=1)
    activation: Literal["relu", "elu"] = _f("relu", "activation between layers")


@dataclass
class TrainConfig:
    """Optimisation: one full-graph step per epoch."""

    epochs: int = _f(200, "training epochs", lo=0)
    lr: float = _f(0.01, "Adam learning rate", lo=0.0)
    weight_decay: float = _f(5.0e-4, "L2 weight decay", lo=0.0)
    weight_decay_layers: Literal["all", "first"] = _f(
        "all", "layers the weight decay applies to (Kipf & Welling: first)")
    seed: int = _f(0, "seed for parameters, dropout and the partitioner", lo=0)
    eval_every: int = _f(1, "evaluate accuracy every N epochs", lo=1)


@dataclass
class DedupConfig:
    """Deduplication of neighbour rows between chunks (HongTu §5)."""

    reuse: bool = _f(True, "keep rows shared by consecutive batches on the device")
    p2p: bool = _f(True, "share rows between GPUs over the device link")
    cache: bool = _f(True, "GPU, out of core: spend spare device memory keeping the most "
                           "reused rows on the device across batches")


#: Throughputs (GB/s) that ``auto`` falls back to without a calibration file
#: (DESIGN.md §3): GPU gather of random rows from pinned host memory, NVLink
#: peer copy, in-place reuse on the device.
THROUGHPUT_DEFAULTS = {"host_to_device": 21.0, "device_to_device": 393.0, "reuse": 2000.0}


@dataclass
class ThroughputConfig:
    """Link throughputs of the transfer cost model (HongTu Eq. 4), in GB/s (10^9 B/s).

    ``auto`` takes the figure measured by ``hongtu calibrate``
    (``<engine.cache_dir>/calibration.json``) when that file exists, else
    :data:`THROUGHPUT_DEFAULTS`.
    """

    host_to_device: Auto | float = _f(
        "auto", "GB/s of host -> device row loads (GPU gather from pinned host); auto = "
        "calibration file, else 21", check=_check_throughput)
    device_to_device: Auto | float = _f(
        "auto", "GB/s of device <-> device peer copies; auto = calibration file, else 393",
        check=_check_throughput)
    reuse: Auto | float = _f(
        "auto", "GB/s of in-place reuse on the device; auto = calibration file, else 2000",
        check=_check_throughput)


@dataclass
class EngineConfig:
    """How and where training runs."""

    accelerator: Literal["auto", "cpu", "cuda"] = _f("auto", "auto | cpu | cuda")
    devices: int = _f(1, "processes / GPUs", lo=1, hi=4096)
    parts: Auto | int = _f("auto", "METIS parts; auto = devices", lo=1)
    chunks: Auto | int = _f("auto", "chunks per part; auto = fewest that fit device_memory "
                                  "(one count more where those load rows again)", lo=1)
    device_memory: Auto | str | int = _f(
        "auto", "device memory budget, e.g. 8GiB; auto = what the device has", check=_check_size)
    partitioner: Literal["metis", "range", "random"] = _f("metis", "metis | range | random")
    checkpoint: Literal["auto", "recompute"] = _f(
        "auto", "auto = recompute-caching hybrid | recompute everything in backward")
    transform_first: bool = _f(
        True, "apply a narrowing GCN layer's weight before aggregating (narrower rows to move)")
    dedup: DedupConfig = _f(DedupConfig(), "deduplicated transfers")
    reorg: bool = _f(True, "reorganise chunks into batches to share neighbours (HongTu Alg. 4)")
    overlap: bool = _f(True, "GPU: move the next batch's rows while the current one computes")
    whole_layers: bool = _f(
        True, "a layer whose rows fit the device row memory moves all of them in one copy per "
        "pass (one process)")
    ordered_inputs: bool = _f(
        True, "GPU: keep a pinned copy of the input features in the order the first layer "
        "loads them (contiguous copies instead of a gather; costs host memory)")
    ordered_rows: bool = _f(
        True, "GPU: the training forward pass writes the rows of later layers that read them "
        "only through their loads in the order those layers load them (contiguous copies "
        "instead of a gather; costs host memory)")
    resident: Auto | bool = _f(
        "auto", "keep every buffer on the GPU (HongTu-IM); auto = when it fits device_memory")
    tf32: bool = _f(
        False, "GPU: dense matrix products in TF32 (inputs rounded to 10 mantissa bits; "
        "faster, but no longer exactly FP32 training)")
    throughput: ThroughputConfig = _f(ThroughputConfig(), "link throughputs for the cost model")
    cache_dir: str = _f(".hongtu_cache", "where partitions and plans are cached")
    timeout: float = _f(600.0, "seconds a rank waits for the others before the run fails",
                        lo=1.0)


@dataclass
class OutputConfig:
    """Where results go."""

    dir: str = _f("runs/default", "output directory for the model, metrics and checkpoints")
    checkpoint_every: int = _f(10, "write a resumable checkpoint every N epochs (0 = never)", lo=0)


@dataclass
class Config:
    """A whole run: ``data``, ``model``, ``train``, ``engine``, ``output``."""

    data: DataConfig = _f(DataConfig(), "the graph")
    model: ModelConfig = _f(ModelConfig(), "the GNN")
    train: TrainConfig = _f(TrainConfig(), "optimisation")
    engine: EngineConfig = _f(EngineConfig(), "execution")
    output: OutputConfig = _f(OutputConfig(), "results")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- validation
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)``: is ``value`` an instance of annotation ``tp``?"""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return (value in typing.get_args(tp) and isinstance(value, str)), value
    if origin is Union:
        for arg in typing.get_args(tp):
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        # YAML 1.1 reads 1e-3 (no dot) as a string; accept what is plainly a number.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _build(cls: type, raw: Any, prefix: str, where: str) -> Any:
    if raw is None:
        raw = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict):
        example = f"{prefix}.{next(iter(fields))}=..." if prefix else "engine.chunks=8"
        raise UserError(f"{where}: '{prefix or 'the file'}' must be a mapping of keys, "
                        f"got {type(raw).__name__} {raw!r}"[:300] + f"; set its keys "
                        f"({', '.join(fields)}) one by one, e.g. {example}")
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = f"{prefix}.{key}" if prefix else str(key)
            raise UserError(f"{where}: unknown key '{name}'; valid keys"
                            f"{' in ' + prefix if prefix else ''}: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, raw.get(name), key, where)
            continue
        if name not in raw:
            continue
        ok, value = _coerce(raw[name], tp)
        if not ok:
            raise UserError(f"{where}: '{key}' is {raw[name]!r}; expected {_type_name(tp)} "
                            f"({f.metadata['doc']})")
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            rng = f"≥ {lo}" if hi is None else f"between {lo} and {hi}"
            raise UserError(f"{where}: '{key}' is {value}; it must be {rng} "
                            f"({f.metadata['doc']})")
        check = f.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise UserError(f"{where}: '{key}' is {value!r}; {problem}")
        kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(raw: dict, where: str = "<config>") -> Config:
    """Validate a plain dict (as read from YAML) into a :class:`Config`."""
    return _build(Config, raw, "", where)


def _apply_override(raw: dict, item: str, where: str) -> None:
    if "=" not in item:
        raise UserError(f"override '{item}' needs the form section.key=value, "
                        "e.g. train.epochs=3")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise UserError(f"override '{item}': '{key}' is not a dotted key like train.epochs")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node, cls = raw, Config
    for p in parts[:-1]:
        hints = typing.get_type_hints(cls)
        if p not in hints:
            raise UserError(f"override '{item}': unknown key '{p}'; valid keys: "
                            f"{', '.join(hints)}")
        if not dataclasses.is_dataclass(hints[p]):
            raise UserError(f"override '{item}': '{p}' is a value, not a section")
        cls = hints[p]
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise UserError(f"override '{item}': '{p}' is not a section in {where}")
        node = nxt
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file and apply dotted ``key=value`` overrides.

    Args:
        path: the YAML file; ``None`` starts from the defaults.
        overrides: strings such as ``"train.epochs=3"``.

    Raises:
        UserError: the file is missing, malformed, or a key/value is invalid.
    """
    raw: Any = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file '{path}' not found; pass the path of a YAML file "
                            "such as configs/gcn_example.yaml")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            loc = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise UserError(f"{where}: malformed YAML{loc}: {problem}; fix the syntax "
                            "(indentation, colons, quotes)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"config file '{path}' cannot be read: {e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{where}: the file must hold a mapping with sections "
                            "data, model, train, engine, output")
    for item in overrides:
        _apply_override(raw, item, where)
    return config_from_dict(raw, where)
