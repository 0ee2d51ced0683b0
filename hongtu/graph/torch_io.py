"""Reading a PyG ``Data`` (or a dict of tensors) saved with ``torch.save``.

User files are never unpickled freely: ``torch.load(weights_only=True)`` with
an explicit allow-list of the few PyG classes a ``Data`` needs, and only when
the file asks for them. The arrays then go through the same validation as an
``.npz`` (:mod:`hongtu.graph.io`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hongtu.errors import UserError
from hongtu.graph.io import _KEYS, _READ_ERRORS, _require_edge_index, _short

__all__ = ["read_torch"]


_PYG_CLASSES = ("torch_geometric.data.data:Data", "torch_geometric.data.data:DataEdgeAttr",
                "torch_geometric.data.data:DataTensorAttr",
                "torch_geometric.data.storage:GlobalStorage")
_TORCH_HINT = ("save a torch_geometric Data object or a dict of tensors with torch.save, or "
               "convert the graph to .npz with np.savez(path, edge_index=..., x=..., ...)")


def read_torch(p: Path, where: str) -> dict:
    """A PyG ``Data`` (or a dict of tensors) saved with ``torch.save``, as numpy arrays."""
    obj, refused = _torch_load(p, where, [])
    data_cls = None
    if refused is not None and refused.startswith("torch_geometric."):
        classes = _pyg_classes()
        if classes is None:
            raise UserError(f"graph file {where}: holds a torch_geometric object ({refused}) "
                            "but torch_geometric is not installed; pip install torch_geometric, "
                            "or convert the graph to .npz with np.savez(path, edge_index=..., "
                            "x=..., ...)")
        data_cls = classes[0]
        obj, refused = _torch_load(p, where, classes)
    if refused is not None and refused.startswith("numpy."):
        raise UserError(f"graph file {where}: holds numpy arrays ({refused}), which hongtu does "
                        "not unpickle; torch.save tensors (torch.from_numpy(a)) instead, or "
                        "save the arrays with np.savez(path, edge_index=..., x=..., ...)")
    if refused is not None:
        raise UserError(f"graph file {where}: needs the Python global '{refused}' to unpickle, "
                        "which is not on hongtu's allow-list (only a torch_geometric Data or a "
                        f"dict of tensors is read); {_TORCH_HINT}")
    if data_cls is not None and isinstance(obj, data_cls):
        mapping = obj.to_dict()
    elif isinstance(obj, dict):
        mapping = obj
    else:
        raise UserError(f"graph file {where}: holds a {type(obj).__name__}, not a graph; "
                        f"{_TORCH_HINT}")
    present = [str(k) for k in mapping]
    _require_edge_index(where, present, "'edge_index'", "keys")
    arrays: dict = {key: _tensor_array(where, key, mapping[key])
                    for key in _KEYS if key in mapping}
    num_nodes = mapping.get("num_nodes")
    if isinstance(num_nodes, int) and not isinstance(num_nodes, bool):
        arrays["num_nodes"] = num_nodes
    return arrays


def _torch_load(p: Path, where: str, classes: list) -> tuple[object, str | None]:
    """``torch.load(weights_only=True)`` allowing ``classes``; ``(obj, None)`` or
    ``(None, refused_global)`` when the file holds a class that is not allowed."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(p, map_location="cpu", weights_only=True), None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if m:
            return None, m.group(1)
        detail = text.split("WeightsUnpickler error:", 1)[-1].split("\n\n", 1)[0]
        raise UserError(f"graph file {where}: not a torch file hongtu can load safely "
                        f"({_short(ValueError(detail))}); {_TORCH_HINT}") from exc
    except (*_READ_ERRORS, AttributeError, ImportError) as exc:
        # torch reports a foreign or empty file as a bare KeyError / EOFError.
        why = ("unrecognised format" if isinstance(exc, KeyError)
               else "file ends early" if isinstance(exc, EOFError)
               else _short(ValueError(str(exc).split(". ", 1)[0])))  # miniz adds a paragraph
        raise UserError(f"graph file {where}: not a valid torch.save file, or corrupt or "
                        f"truncated ({why}); {_TORCH_HINT}") from exc


def _pyg_classes() -> list | None:
    """The allow-listed PyG classes (``Data`` first), or ``None`` without torch_geometric."""
    import importlib

    classes = []
    for name in _PYG_CLASSES:
        module, attr = name.split(":")
        try:
            cls = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return None
        if cls is not None:
            classes.append(cls)
        elif attr == "Data":  # not a torch_geometric this code understands
            return None
    return classes


def _tensor_array(where: str, key: str, value: object) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise UserError(f"graph file {where}: '{key}' is a {type(value).__name__}, expected a "
                        "tensor; store it as a torch.Tensor")
    if value.layout != torch.strided:
        raise UserError(f"graph file {where}: '{key}' is a sparse tensor ({value.layout}); "
                        "store it dense (edge_index as a 2 x E integer tensor)")
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    try:
        return value.numpy()
    except (TypeError, RuntimeError) as exc:
        raise UserError(f"graph file {where}: '{key}' has dtype {value.dtype}, which numpy "
                        f"cannot hold ({_short(exc)}); convert it to float32 or int64") from exc
