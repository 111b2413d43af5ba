"""The GPU smoke suite: everything skips without CUDA (see README.md here)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to torch")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu() -> str:
    """The device the engine tests run on: the last GPU, so that with 2+ GPUs everything must
    honour ``cuda:1`` rather than land on the current device 0."""
    n = torch.cuda.device_count()
    return f"cuda:{n - 1}" if n > 1 else "cuda:0"


@pytest.fixture(scope="session")
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
