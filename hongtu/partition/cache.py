r"""On-disk cache of level-1 part assignments.

METIS is the expensive step of preprocessing (tens of seconds per million
vertices), so its result is kept in ``<cache_dir>/parts-<key>.npz`` where
``key`` hashes the graph's content fingerprint, the method, the part count,
the seed and :data:`FORMAT_VERSION`. A file is written atomically (temporary
file in the same directory, ``fsync``, ``os.replace``) so a crash never leaves
a half-written file under the final name. On load the stored key, the shape,
the value range and a checksum of the assignment are verified; a file that
fails any check is logged as a warning on logger ``hongtu.partition`` and
treated as a miss, so the caller rebuilds and overwrites it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["FORMAT_VERSION", "cache_key", "cache_path", "load_assignment", "save_assignment"]

logger = logging.getLogger("hongtu.partition")

#: Bump when the meaning of a cached assignment changes (e.g. METIS weights),
#: so stale files stop matching instead of being reused.
FORMAT_VERSION = 1


def cache_key(fingerprint: str, method: str, num_parts: int, seed: int) -> str:
    """Hex key naming the cache file of one part assignment.

    Args:
        fingerprint: :meth:`Graph.fingerprint` of the graph.
        method: level-1 method (``metis``, ``range``, ``random``).
        num_parts: number of parts ``m``.
        seed: seed passed to the method.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"hongtu.partition|v{FORMAT_VERSION}|{fingerprint}|{method}|{num_parts}|{seed}".encode())
    return h.hexdigest()


def cache_path(cache_dir: str | os.PathLike, key: str) -> Path:
    """Path of the cache file for ``key``."""
    return Path(cache_dir) / f"parts-{key}.npz"


def _checksum(assignment: np.ndarray) -> str:
    a = np.ascontiguousarray(assignment)
    h = hashlib.blake2b(digest_size=16)
    h.update(str((a.dtype.str, a.shape)).encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def load_assignment(cache_dir: str | os.PathLike, key: str, num_nodes: int,
                    num_parts: int) -> np.ndarray | None:
    """Load and verify a cached assignment.

    Args:
        cache_dir: cache directory.
        key: :func:`cache_key` of the wanted assignment.
        num_nodes: expected length of the assignment.
        num_parts: every value must lie in ``[0, num_parts)``.

    Returns:
        The int32 assignment, or ``None`` when there is no file or the file
        is corrupt, truncated or stale (then a warning is logged).
    """
    path = cache_path(cache_dir, key)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            stored_key = str(f["key"])
            version = int(f["version"])
            checksum = str(f["checksum"])
            assignment = np.array(f["assignment"])
    # A damaged zip raises almost anything (BadZipFile, EOFError, ValueError,
    # even NotImplementedError for a flipped flag bit); every case means "rebuild".
    except Exception as exc:
        logger.warning("partition cache %s is unreadable (%s: %s); rebuilding it",
                       path, type(exc).__name__, exc)
        return None
    problem = None
    if stored_key != key or version != FORMAT_VERSION:
        problem = f"it was written for key {stored_key} (format v{version})"
    elif assignment.shape != (num_nodes,) or assignment.dtype != np.int32:
        problem = (f"it holds {assignment.dtype} {assignment.shape}, "
                   f"expected int32 ({num_nodes},)")
    elif checksum != _checksum(assignment):
        problem = "its checksum does not match its contents"
    elif num_nodes and (assignment.min() < 0 or assignment.max() >= num_parts):
        problem = f"it has part ids outside 0..{num_parts - 1}"
    if problem is not None:
        logger.warning("partition cache %s is stale or corrupt (%s); rebuilding it", path, problem)
        return None
    return assignment


def save_assignment(cache_dir: str | os.PathLike, key: str, assignment: np.ndarray) -> Path | None:
    """Write an assignment atomically; a failure to write is logged, not raised.

    Args:
        cache_dir: cache directory (created when missing).
        key: :func:`cache_key` of the assignment.
        assignment: vertex -> part, int32.

    Returns:
        The path written, or ``None`` when writing failed.
    """
    assignment = np.ascontiguousarray(assignment, dtype=np.int32)
    path = cache_path(cache_dir, key)
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".parts-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, assignment=assignment, key=np.array(key), version=np.array(FORMAT_VERSION),
                     checksum=np.array(_checksum(assignment)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        _fsync_dir(path.parent)
    except OSError as exc:
        logger.warning("could not write partition cache %s (%s); continuing without it", path, exc)
        return None
    finally:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; not every platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
