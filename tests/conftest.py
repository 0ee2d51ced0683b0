"""Shared test configuration: slow/gpu markers and the location of real data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("HONGTU_SLOW") == "1"
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or HONGTU_SLOW=1")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    import torch

    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def shared_dataset(name: str) -> Path:
    """Path of ``../shared/data/NAME.npz``; skips the test when it is absent."""
    path = SHARED_DATA / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"{path} not found: the Planetoid test data sits in ../shared/data "
                    "beside the repository")
    return path
