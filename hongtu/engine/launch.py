r"""Starting one process per device: torch's elastic launcher, or torchrun's ranks.

``hongtu train CONFIG engine.devices=4`` runs :func:`launch`, which starts four
workers on this machine with ``torch.distributed.launcher`` (the machinery of
``torchrun``), each running the same command as a rank. Started under
``torchrun`` (any ``--nnodes``), the command finds ``RANK``/``WORLD_SIZE`` in
its environment and simply is a rank. Either way, an error in one rank ends
that rank; the launcher then stops the others, and the command exits with that
rank's code. Under torchrun each rank prints its own one-line message (naming
the rank); under hongtu's launcher the ranks leave it to the launcher, which
prints each distinct message once, naming the ranks that ended by it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid

import torch

from hongtu.errors import RANK_FAILURES, UserError, note_rank_failure

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


def _interrupt_once(signum, frame) -> None:
    # Ctrl-C reaches the ranks from the terminal, then again from the launcher
    # stopping them: the first ends the rank, the second must not break its exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker(argv: list[str]) -> None:
    from hongtu.cli import main

    signal.signal(signal.SIGINT, _interrupt_once)
    code = main(argv)
    if code:
        # A non-zero exit makes the launcher stop the other ranks. First note
        # that this rank ended by its own error: the peers it leaves may abort
        # on the closed connections, and the launcher may see one of them fail
        # before this rank. (A one-line error or Ctrl-C was noted, with its
        # line, where main caught it, and the rank ended there.)
        sys.stdout.flush()
        sys.stderr.flush()
        note_rank_failure(code)
        sys.exit(code)


def _own_failures(folder: str) -> list[tuple[int, int, str]]:
    """``(rank, exit code, line)`` of each rank that noted its own failure in
    ``folder``, the first noted first (``line`` empty where the rank printed
    its own message)."""
    notes = []
    for name in os.listdir(folder):
        if name.isdigit():
            path = os.path.join(folder, name)
            with open(path) as f:
                code, _, line = f.read().partition("\n")
            notes.append((os.stat(path).st_mtime_ns, int(name), int(code or 1), line))
    return [note[1:] for note in sorted(notes)]


def _failure_lines(failures: list[tuple[int, int, str]]) -> list[str]:
    """What the launcher prints for the ranks' own failures: each distinct line
    once, naming every rank that ended by it."""
    rank, code, line = failures[0]
    if not line:
        return [f"hongtu: error: rank {rank} failed (exit code {code}); the other ranks "
                "were stopped; its message is above"]
    lines = []
    for text in dict.fromkeys(m for _, _, m in failures if m):
        ranks = sorted(r for r, _, m in failures if m == text)
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}")
        lines.append(f"hongtu: error: {who}: {text}")
    return lines


class _LauncherRecords(logging.Filter):
    """Drops torch's launcher records about a failed or stopped rank: hongtu
    reports that itself, in one line, and the rank's own traceback (if any) is
    already on stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(("torch.distributed.elastic",
                                           "torch.multiprocessing"))


@contextlib.contextmanager
def _launcher_quiet():
    # torch's loggers write through the handlers of 'torch' and
    # 'torch.distributed' (neither propagates to the root logger).
    handlers = {h for name in ("torch", "torch.distributed")
                for h in logging.getLogger(name).handlers}
    quiet = _LauncherRecords()
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def _stopped_line(signal_name: str, checkpoint: str | None, since: float) -> str:
    """What the launcher prints when a signal stopped it and every rank
    (naming ``checkpoint`` if written at ``since`` or later)."""
    line = f"hongtu: stopped by {signal_name}; every rank was stopped"
    if checkpoint and os.path.isfile(checkpoint) and os.stat(checkpoint).st_mtime >= since:
        line += (f"; the last checkpoint is {checkpoint}: continue from it with "
                 "hongtu train CONFIG --resume")
    return line


def launch(argv: list[str], devices: int, checkpoint: str | None = None,
           resumed: bool = False) -> int:
    """Run ``hongtu <argv>`` as ``devices`` local ranks; the exit code of the run.

    ``checkpoint`` is the run's checkpoint file, named when a signal (Ctrl-C,
    SIGTERM) stops the launcher and its ranks, if this run wrote it (or
    ``resumed`` from it).
    """
    since = 0.0 if resumed else time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
            with _launcher_quiet():
                elastic_launch(config, _worker)(argv)
        except ChildFailedError as e:
            # Name the rank that failed by its own error, not one of its casualties
            # (the launcher reports whichever process it saw die first).
            own = _own_failures(folder)
            if own:
                code = own[0][1]
                lines = _failure_lines(own)
            else:
                rank, failure = e.get_first_failure()
                shown = failure.exitcode
                code = shown if shown and shown > 0 else 1
                lines = _failure_lines([(rank, shown, "")])
            print("\n".join(lines), file=sys.stderr)
            return code
        except SignalException as e:
            # (torch's launcher has stopped the ranks; in a terminal they had
            # the signal too, and left without a word)
            print(_stopped_line(e.sigval.name, checkpoint, since), file=sys.stderr)
            return 128 + int(e.sigval)
        finally:
            os.environ.pop(RANK_FAILURES, None)
    return 0
