"""Device choice: the check that turns a misconfigured GPU worker into an error at start instead
of a silently slow fp32 CPU worker. (The GPU's memory budget: ``engine/cuda/memory.py``.)"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def resolve_device(name: str, cuda_available: bool | None = None,
                   device_count: int | None = None) -> torch.device:
    """``auto`` is CUDA when this process sees a GPU, else the CPU. An explicit ``cuda``/``cuda:N``
    that this process cannot see (``CUDA_VISIBLE_DEVICES=""``, as Ray sets for a replica that
    asked for no GPU) is an error, never a fallback."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda" if cuda_available else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not cuda_available:
            raise RuntimeError(
                f"--device {name} but this process sees no CUDA device (CUDA_VISIBLE_DEVICES="
                "'' or a CPU build of torch); on Ray, request GPUs with --gpus-per-replica")
        count = torch.cuda.device_count() if device_count is None else device_count
        if device.index is not None and device.index >= count:
            raise RuntimeError(f"--device {name} but this process sees {count} CUDA device(s)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if device_count is None
                                  else 0)
    return device
