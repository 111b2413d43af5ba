"""The KV cache's room on a GPU: its memory budget and the block size flash-attn's paged kernel
needs."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


# The device's share every process leaves free whatever its --gpu-memory-utilization: what
# another process on the GPU (or a transient allocation of ours) may still need.
FREE_FLOOR = 0.02


def cuda_kv_budget(requested: int | None, utilization: float, free: int, total: int,
                   own: int = 0, activations: int = 0) -> int:
    """Bytes for the KV cache on a GPU after the weights are loaded: at most ``requested``
    (None: no cap of its own), at most ``utilization`` of the device less what this process
    holds already (``own``: its allocator's reserved memory, the weights) and what its largest
    step takes (``activations``: measured by the warm-up step), and never more than leaves
    ``FREE_FLOOR`` of the device free, the step's memory beside it (given
    ``torch.cuda.mem_get_info``'s ``free`` and ``total``). ``--gpu-memory-utilization`` is
    this process's share, as vLLM's is: a prefill and a decode worker started together on one
    GPU with 0.45 each both see the same free memory, and sizing from that alone (as this did)
    each would take most of it and together over-commit. Alone, the share less ``own`` is the
    free memory less ``1 - utilization`` of the device, as before, but for the CUDA context
    (not in ``own``)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    usable = min(round(utilization * total) - own, free - round(FREE_FLOOR * total)) \
        - activations
    if usable <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: this process holds {own / 2**30:.1f} GiB of "
            f"its {utilization:.0%} share of {total / 2**30:.1f} GiB and its largest step takes "
            f"{activations / 2**30:.1f} GiB more, {free / 2**30:.1f} GiB free: raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens or serve a smaller model")
    if requested is None:
        logger.info("KV cache: %.2f GiB (%.0f%% of the GPU less %.2f GiB held and %.2f GiB for "
                    "the largest step)", usable / 2**30, utilization * 100, own / 2**30,
                    activations / 2**30)
        return usable
    if usable < requested:
        logger.warning("KV cache: %.2f GiB asked, %.2f GiB fits within %.0f%% of the GPU",
                       requested / 2**30, usable / 2**30, utilization * 100)
    return min(requested, usable)


def kv_budget_for(device: torch.device, requested: int | None, utilization: float,
                  activations: int = 0) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return cuda_kv_budget(requested, utilization, free, total,
                          own=torch.cuda.memory_reserved(device), activations=activations)


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
