"""Host-to-device copies that do not block the host.

A copy from pageable memory to a GPU (what ``torch.tensor(data, device="cuda")`` and
``cpu_tensor.to("cuda")`` do) makes the host wait for the GPU. The step loop makes several small
ones a step (row indices, per-request sampling parameters, grammar bitmasks): on an H200 a decode
step with temperature/top-p sampling waited five times, where only the token read-back has to.
Here the data is staged in pinned memory and copied asynchronously on the current stream; torch's
pinned-memory allocator keeps the staging buffer until that stream has passed the copy. On the
CPU the tensor is returned as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a flat or nested list of numbers) as a ``dtype`` tensor on ``device``."""
    return tensor_to_device(torch.tensor(data, dtype=dtype), device)


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``: asynchronously through pinned memory on CUDA."""
    if device.type != "cuda":
        return host
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
