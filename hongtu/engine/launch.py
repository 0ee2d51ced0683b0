r"""Starting one process per device: torch's elastic launcher, or torchrun's ranks.

``hongtu train CONFIG engine.devices=4`` runs :func:`launch`, which starts four
workers on this machine with ``torch.distributed.launcher`` (the machinery of
``torchrun``), each running the same command as a rank. Started under
``torchrun`` (any ``--nnodes``), the command finds ``RANK``/``WORLD_SIZE`` in
its environment and simply is a rank. Either way, an error in one rank ends
that rank with its one-line message (naming the rank); the launcher then stops
the others, and the command exits with that rank's code.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid

import torch

from hongtu.errors import UserError

__all__ = ["launch", "check_devices"]


def check_devices(accelerator: str, devices: int) -> None:
    """Fail before starting anything when the machine lacks the devices asked for."""
    cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    if not cuda:
        return
    if not torch.cuda.is_available():
        raise UserError("engine.accelerator=cuda but no CUDA device is available "
                        "(torch.cuda.is_available() is False); use engine.accelerator=cpu")
    have = torch.cuda.device_count()
    if devices > have:
        raise UserError(f"engine.devices={devices} but this machine has {have} GPU(s); set "
                        f"engine.devices ≤ {have}, or use torchrun across machines")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(argv: list[str]) -> None:
    from hongtu.cli import main

    code = main(argv)
    if code:
        # A non-zero exit makes the launcher stop the other ranks. First note
        # that this rank ended by its own error (its message is written): the
        # peers it leaves may abort on the closed connections, and the launcher
        # may see one of them fail before this rank.
        sys.stdout.flush()
        sys.stderr.flush()
        report = os.environ.get(RANK_FAILURES)
        if report:
            with open(os.path.join(report, os.environ.get("RANK", "0")), "w") as f:
                f.write(str(code))
        sys.exit(code)


#: environment variable naming the folder where ranks note their own failures
RANK_FAILURES = "HONGTU_RANK_FAILURES"


def _own_failure(folder: str) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the first rank that noted its own failure in
    ``folder``, or ``None``."""
    notes = [(os.stat(os.path.join(folder, n)).st_mtime_ns, int(n), n)
             for n in os.listdir(folder) if n.isdigit()]
    if not notes:
        return None
    _, rank, name = min(notes)
    with open(os.path.join(folder, name)) as f:
        return rank, int(f.read() or 1)


def launch(argv: list[str], devices: int) -> int:
    """Run ``hongtu <argv>`` as ``devices`` local ranks; the exit code of the run."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=devices,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    # The ranks share this machine's cores: give each its share (torch and numba).
    share = str(max(1, (os.cpu_count() or 1) // devices))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    os.environ.setdefault("NUMBA_NUM_THREADS", share)
    with tempfile.TemporaryDirectory(prefix="hongtu-ranks-") as folder:
        os.environ[RANK_FAILURES] = folder  # (the spawned ranks inherit it)
        try:
            elastic_launch(config, _worker)(argv)
        except ChildFailedError as e:
            # Name the rank that failed by its own error, not one of its casualties
            # (the launcher reports whichever process it saw die first).
            own = _own_failure(folder)
            if own is None:
                rank, failure = e.get_first_failure()
                shown = failure.exitcode
                code = shown if shown and shown > 0 else 1
            else:
                rank, code = own
                shown = code
            print(f"hongtu: error: rank {rank} failed (exit code {shown}); the other "
                  "ranks were stopped; its message is above", file=sys.stderr)
            return code
        finally:
            os.environ.pop(RANK_FAILURES, None)
    return 0
