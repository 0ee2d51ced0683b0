r"""``hongtu predict``: run a trained model over the whole graph and save the result.

The checkpoint is the ``model.pt`` that ``hongtu train`` writes
(``{"state_dict", "config", "perm"}``). It is read with
``torch.load(weights_only=True)``: tensors, dicts, lists and strings only,
never arbitrary pickles. Its stored config must agree with ``CONFIG`` on
every ``model.*`` and ``data.*`` key (the layers must match the parameters,
and the graph must be the one trained on); ``engine.*`` may differ, e.g. a
smaller ``engine.device_memory`` for inference.

The graph is rebuilt exactly as training built it (:class:`~hongtu.engine.
trainer.Trainer`), one evaluation pass (no dropout) runs out of core, and
the rows are mapped back from the engine's renumbering to the user's vertex
ids. The output is an ``.npy`` array with one row per vertex, in the user's
original order:

* default: ``argmax`` class ids, int64 ``(N,)``;
* ``embeddings=True``: the last hidden layer ``h^{L-1}`` (after the
  activation), float32, one row of that layer's width per vertex.

Example::

    >>> cfg = load_config("configs/gcn_example.yaml")
    >>> pred = predict(cfg, "runs/gcn_example/model.pt")
    >>> pred.shape
    (3000,)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hongtu.config import Config
from hongtu.errors import UserError

__all__ = ["load_checkpoint", "check_checkpoint_config", "predict", "save_array"]

log = logging.getLogger("hongtu")
_CHECKED_SECTIONS = ("model", "data")


def load_checkpoint(path: str | Path) -> dict:
    """Read a ``model.pt`` safely and check its structure.

    Raises:
        UserError: the file is missing, corrupt, holds anything but tensors
            and plain containers, or is not a hongtu model file.
    """
    import pickle

    import torch

    p = Path(path)
    hint = "pass the model.pt that 'hongtu train' wrote to output.dir"
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "not found"
        raise UserError(f"checkpoint '{p}': {what}; {hint} (train first with "
                        "'hongtu train CONFIG')")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError, OSError,
            TypeError, AttributeError, ImportError, MemoryError) as exc:
        # The first sentence: torch appends paragraphs of advice to these errors.
        text = str(exc).split("WeightsUnpickler error:", 1)[-1].split("\n\n", 1)[0]
        why = " ".join(text.split()).split(". ", 1)[0][:160] or type(exc).__name__
        if isinstance(exc, (KeyError, EOFError)):
            why = "not a torch.save file, or truncated"
        raise UserError(f"checkpoint '{p}': cannot be loaded ({why}); {hint}") from exc
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict)
            and isinstance(ckpt.get("config"), dict)):
        raise UserError(f"checkpoint '{p}': not a hongtu model file (expected a dict with "
                        f"'state_dict' and 'config'); {hint}")
    return ckpt


def check_checkpoint_config(stored: dict, cfg: Config, where: str) -> None:
    """Refuse a checkpoint whose ``model.*`` / ``data.*`` differ from ``cfg``.

    Keys absent from the stored config (written by an older version) are not compared.
    """
    ours = cfg.to_dict()
    diffs = []
    for section in _CHECKED_SECTIONS:
        theirs = stored.get(section)
        if not isinstance(theirs, dict):
            continue
        for key, value in ours[section].items():
            if key in theirs and theirs[key] != value:
                diffs.append((f"{section}.{key}", theirs[key], value))
    if diffs:
        shown = diffs[:3]
        trained = ", ".join(f"{k}={a!r}" for k, a, _ in shown)
        given = ", ".join(f"{k}={b!r}" for k, _, b in shown)
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise UserError(f"checkpoint '{where}' was trained with {trained} but the config "
                        f"gives {given}{more}; predict with the config and overrides the "
                        "model was trained with")


def one_process(cfg: Config) -> Config:
    """``cfg`` for one process on one device: a model trained on several devices
    predicts on one (``engine.devices=1``, its parts and chunks chosen for that
    device: ``auto``; the predictions do not depend on them)."""
    from hongtu.engine.comm import in_distributed_launch

    e = cfg.engine
    if e.devices == 1 or in_distributed_launch():
        return cfg
    log.info("engine.devices=%d: predicting in one process on one device", e.devices)
    return dataclasses.replace(cfg, engine=dataclasses.replace(
        e, devices=1, parts="auto", chunks="auto"))


def predict(cfg: Config, checkpoint: str | Path, embeddings: bool = False,
            out: Callable[[str], None] | None = None) -> tuple[np.ndarray, dict]:
    """Predictions (or last-hidden-layer embeddings) of a trained model, in original ids.

    Args:
        cfg: the run's configuration (``model.*`` / ``data.*`` as at training).
        checkpoint: path of the ``model.pt`` written by training.
        embeddings: return ``h^{L-1}`` (float32, ``N`` rows) instead of the
            argmax class ids (int64 ``(N,)``). Default ``False``.
        out: where the memory plan goes (``log.debug`` by default).

    Returns:
        ``(array, accuracy)``: the array in the user's vertex order, and the
        accuracy of each split that has vertices (``{"train": ..., ...}``).

    Raises:
        UserError: bad checkpoint, a config that does not match it, or any
            input problem training itself would report.
    """
    from hongtu.engine.trainer import Trainer

    ckpt = load_checkpoint(checkpoint)
    check_checkpoint_config(ckpt["config"], cfg, str(checkpoint))
    if embeddings and cfg.model.layers < 2:
        raise UserError("--embeddings returns the last hidden layer, but model.layers=1 has "
                        "none; use the class predictions (no --embeddings) instead")
    if embeddings and cfg.engine.transform_first:
        # h^{L-1} itself must be kept, not the last layer's weight applied to it.
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine,
                                                                  transform_first=False))
    cfg = one_process(cfg)
    # overwrite=True: output.dir holds the checkpoint itself, and nothing is written there.
    trainer = Trainer(cfg, overwrite=True, out=out or log.debug)
    perm = ckpt.get("perm")
    stored_n = int(perm.shape[0]) if hasattr(perm, "shape") else None
    if stored_n is not None and stored_n != trainer.graph.num_nodes:
        raise UserError(f"checkpoint '{checkpoint}' was trained on a graph of {stored_n} "
                        f"vertices but {cfg.data.path} now has {trainer.graph.num_nodes}; "
                        "the data changed since training")
    try:
        trainer.model.load_state_dict(ckpt["state_dict"])
    except (RuntimeError, KeyError, TypeError) as exc:
        first = " ".join(str(exc).split())[:200]
        raise UserError(f"checkpoint '{checkpoint}': its parameters do not fit the model "
                        f"built from the config ({first}); was it trained on other data?"
                        ) from exc
    ex = trainer.executor
    with trainer.matmul_precision():  # (as the run trained, engine.tf32)
        res = ex.evaluate(0)
    acc = {s: res.accuracy(s) for s in ("train", "val", "test") if res.total.get(s)}
    if embeddings:
        rows = ex.buf.h[-2].detach().cpu().numpy().astype(np.float32, copy=False)
    else:
        rows = ex.buf.h[-1].detach().cpu().argmax(dim=1).numpy().astype(np.int64, copy=False)
    return trainer.partition.to_original(rows), acc


def save_array(array: np.ndarray, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``array`` as ``.npy`` atomically; refuse an existing ``out`` unless ``overwrite``."""
    from hongtu.plot import check_output, write_atomic

    out = Path(out)
    check_output(out, overwrite, (".npy",), "result")
    write_atomic(out, lambda f: np.save(f, array, allow_pickle=False))
    return out
