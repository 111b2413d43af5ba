"""Attention backends over the paged KV cache: native paged kernels (CPU, fp32:
``engine/cpu/attention.py``), torch SDPA (any device: ``sdpa.py``) and flash-attn (CUDA:
``engine/cuda/flash.py``). Each is an :class:`AttentionBackend` that builds its own metadata from
the runner's backend-neutral :class:`StepLayout`; :func:`select_backend` picks one by name."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from kvrelay.engine.attention.backend import AttentionBackend
from kvrelay.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    LastLayerRows,
    PrefillSpan,
    SdpaMetadata,
    current_metadata,
    forward_context,
    group_by_length,
)
from kvrelay.engine.attention.sdpa import SdpaBackend, sdpa_attention, write_kv
from kvrelay.engine.attention.step import DecodeRows, StepLayout

__all__ = ["AttentionBackend", "AttentionFn", "AttentionMetadata", "DecodeGroup", "DecodeRows",
           "LastLayerRows", "PrefillSpan", "SdpaBackend", "SdpaMetadata", "StepLayout",
           "current_metadata", "forward_context", "group_by_length", "sdpa_attention",
           "select_backend", "write_kv"]

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _import_flash() -> AttentionBackend | None:
    """The flash-attn backend, or None with a warning when the module is installed but does not
    load (a wheel built against another torch: undefined symbols in its CUDA extension)."""
    try:
        from kvrelay.engine.cuda.flash import FlashBackend

        return FlashBackend.load()
    except (ImportError, OSError) as e:
        logger.warning("flash-attn is installed but does not load (%s: %s); using torch SDPA. "
                       "Rebuild it against this torch: make install-gpu", type(e).__name__, e)
        return None


def select_backend(name: str, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """Pick the attention backend for ``device``: 'auto' takes flash-attn only on CUDA, in
    fp16/bf16 (flash-attn has no fp32 kernels), with the ``gpu`` extra installed and loadable
    (the CUDA module is never imported otherwise), and on the CPU in fp32 the native paged
    kernels when they build here (else torch SDPA)."""
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend=flash needs a CUDA device; use sdpa on CPU")
        if dtype not in FLASH_DTYPES:
            raise ValueError(f"attention_backend=flash needs float16 or bfloat16, got {dtype}")
        if not flash_available():
            raise ImportError(
                "attention_backend=flash needs flash-attn: make install-gpu")
        backend = _import_flash()
        if backend is None:
            raise ImportError("attention_backend=flash: flash-attn does not load (see the log)")
        return backend
    if name == "auto" and device.type == "cuda":
        if dtype not in FLASH_DTYPES:
            logger.info("attention: torch SDPA, flash-attn has no %s kernels", dtype)
        else:
            backend = _import_flash() if flash_available() else None
            if backend is not None:
                return backend
            # A GPU worker without flash-attn still serves, through torch SDPA, but gathers
            # every sequence's K/V per layer and runs no CUDA graphs: say so loudly (the
            # workers also export kvrelay:attention_backend_info{backend="sdpa"}).
            logger.warning("attention: flash-attn is %s: torch SDPA on %s, slower (no paged "
                           "reads); install it with `make install-gpu`",
                           "not loadable" if flash_available() else "not installed", device)
    if name not in ("auto", "sdpa", "native"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name in ("auto", "native") and device.type == "cpu" and dtype == torch.float32:
        from kvrelay.engine.cpu import attention as native

        if native.available():
            return native.NativeBackend()
        if name == "native":
            raise RuntimeError("attention_backend=native: the CPU kernels could not be built "
                               "(see the log; a C compiler with OpenMP is needed)")
    elif name == "native":
        raise ValueError("attention_backend=native needs fp32 on the CPU")
    return SdpaBackend()
