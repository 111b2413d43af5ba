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


def rank_device(name: str, rank: int, size: int, cuda_available: bool | None = None,
                device_count: int | None = None) -> torch.device:
    """The device of tensor-parallel rank ``rank`` of ``size`` whose rank 0 runs on ``name``
    (``resolve_device``): on CUDA the ranks take consecutive devices from rank 0's index among
    those this process sees (on Ray or Kubernetes, the replica's own: ``cuda`` is its first),
    and a replica that would run past the last is an error at start, naming the devices."""
    base = resolve_device(name, cuda_available, device_count)
    if base.type != "cuda" or size == 1:
        return base
    count = torch.cuda.device_count() if device_count is None else device_count
    first = base.index or 0
    if first + size > count:
        raise RuntimeError(f"tensor parallelism of {size} from {base} needs CUDA devices "
                           f"{first}..{first + size - 1}, but this process sees {count}")
    return torch.device("cuda", first + rank)
