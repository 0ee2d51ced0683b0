r"""Resumable training checkpoints: written atomically, checked on load.

A checkpoint (``output.dir/checkpoint.pt``) holds the model, the optimizer,
the RNG states, the number of completed epochs and the configuration. It is
written to a temporary file in the same directory, synced, and renamed over
the previous one, so a crash or Ctrl-C at any moment leaves either the old or
the new checkpoint, never a torn one. Dropout masks depend only on (seed,
epoch, layer, vertex), so a resumed run draws exactly the masks the
uninterrupted run would have.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hongtu.errors import UserError

__all__ = ["CHECKPOINT", "save_checkpoint", "load_checkpoint", "require_checkpoint",
           "atomic_torch_save"]

CHECKPOINT = "checkpoint.pt"
# Keys that may differ between the run that wrote a checkpoint and the run
# that resumes it: they change neither the model nor the optimisation.
_MAY_CHANGE = {"train.epochs", "train.eval_every"}


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to ``path`` through a synced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(outdir: Path, epoch: int, model, optimizer, config: dict) -> Path:
    """Write the state after ``epoch`` completed epochs."""
    state = {
        "epoch": int(epoch),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config,
        # hongtu draws from no other generator while training (dropout is
        # counter-based), so torch's states are the whole random state.
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }
    path = Path(outdir) / CHECKPOINT
    atomic_torch_save(state, path)
    return path


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def require_checkpoint(outdir: Path) -> Path:
    """The checkpoint ``--resume`` continues from; a :class:`UserError` where there is none."""
    path = Path(outdir) / CHECKPOINT
    if not path.is_file():
        raise UserError(f"--resume: no checkpoint at '{path}'; train without --resume, or "
                        "point output.dir at the run to continue")
    return path


def load_checkpoint(outdir: Path, model, optimizer, config: dict) -> int:
    """Restore model, optimizer and RNG from ``outdir``; returns the completed epochs.

    Raises:
        UserError: no checkpoint, an unreadable one, or one written by a run
            whose model, data or optimisation settings differ.
    """
    path = require_checkpoint(outdir)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"--resume: checkpoint '{path}' cannot be read ({type(e).__name__}); "
                        "it is corrupt or from another program") from None
    old, new = _flatten(state.get("config", {})), _flatten(config)
    for key in sorted(set(old) | set(new)):
        section = key.split(".")[0]
        if section in ("model", "data", "train") and key not in _MAY_CHANGE \
                and old.get(key) != new.get(key):
            raise UserError(f"--resume: the checkpoint was trained with {key}="
                            f"{old.get(key)!r} but the config gives {new.get(key)!r}; resume "
                            "with the settings the run started with (only train.epochs and "
                            "engine.* may change)")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["epoch"])
