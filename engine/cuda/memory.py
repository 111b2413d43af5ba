"""The KV cache's room on a GPU: its memory budget and the block size flash-attn's paged kernel
needs."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def cuda_kv_budget(requested: int, utilization: float, free: int, total: int) -> int:
    """Bytes for the KV cache on a GPU after the weights are loaded: at most ``requested`` and at
    most what keeps the process within ``utilization`` of the device's memory (vLLM's
    ``--gpu-memory-utilization``), given ``torch.cuda.mem_get_info``'s ``free`` and ``total``."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    usable = free - round((1.0 - utilization) * total)
    if usable <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB, {1 - utilization:.0%} held back")
    if usable < requested:
        logger.warning("KV cache: %.2f GiB asked, %.2f GiB fits within %.0f%% of the GPU",
                       requested / 2**30, usable / 2**30, utilization * 100)
    return min(requested, usable)


def kv_budget_for(device: torch.device, requested: int, utilization: float) -> int:
    if device.type != "cuda":
        return requested
    free, total = torch.cuda.mem_get_info(device)
    return cuda_kv_budget(requested, utilization, free, total)


PAGED_FLASH_BLOCK = 256  # flash-attn 2's paged KV needs blocks of a multiple of 256 tokens


def paged_flash_block_size(requested: int) -> int:
    """The KV block size when flash-attn reads the paged cache directly (``block_table``):
    ``requested`` if flash-attn accepts it, else 256 (a power of two, as the cache needs)."""
    if requested % PAGED_FLASH_BLOCK == 0:
        return requested
    logger.info("KV block size %d -> %d: flash-attn's paged KV needs multiples of %d tokens",
                requested, PAGED_FLASH_BLOCK, PAGED_FLASH_BLOCK)
    return PAGED_FLASH_BLOCK


def refuse_expandable_segments(alloc_conf: str | None) -> None:
    """Refuse a KV cache that a peer must reach over CUDA IPC when torch's allocator maps it in
    expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): such memory is
    not one exportable allocation, and NIXL's transfers to it fail at the first hand-off, far
    from the cause. Raises ValueError naming the setting."""
    for part in (alloc_conf or "").split(","):
        key, _, value = part.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
            raise ValueError("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: a KV cache "
                             "moved between processes must be one exportable CUDA allocation "
                             "(CUDA IPC cannot export expandable segments); unset it for "
                             "prefill and decode workers")
