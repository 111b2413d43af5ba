"""The CUDA platform: the device set per thread, bf16 by default, flash-attn (reading the paged
cache where it can, which sets the KV block size), the KV budget within the GPU's memory, CUDA
graphs for decode steps and step inputs copied through pinned memory."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvrelay.engine.attention import AttentionBackend, select_backend
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.cuda.graphs import graphs_off_reason
from kvrelay.engine.cuda.memory import kv_budget_for, paged_flash_block_size
from kvrelay.engine.models.moe import enable_grouped_mm

if TYPE_CHECKING:
    from kvrelay.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class CudaPlatform:
    """See :class:`kvrelay.engine.platform.Platform` for what each method promises."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.moe = False  # the model has mixture-of-experts layers (set at load)

    def weight_dtype(self, checkpoint: torch.dtype | None) -> torch.dtype:
        # A half-precision checkpoint runs as written; an fp32 one (or one that does not say)
        # in bf16, as vLLM and SGLang run it: flash-attn and the tensor cores take no fp32.
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16

    def compute_dtype(self, weights: torch.dtype) -> torch.dtype:
        return weights

    def configure(self) -> None:
        torch.cuda.set_device(self.device)  # this thread's kernels and events on its GPU

    def attention(self, name: str, dtype: torch.dtype) -> AttentionBackend:
        return select_backend(name, self.device, dtype)

    def prepare_model(self, model: LlamaForCausalLM, dtype: torch.dtype) -> str:
        model.fused_decode = None
        self.moe = model.arch.is_moe
        if self.moe:
            n = enable_grouped_mm(model, self.device, dtype)
            logger.info("mixture of experts: %d sparse layers run their experts as grouped "
                        "GEMMs (torch._grouped_mm), the others one expert at a time", n)
        return "dense"

    def pad_rows_above(self, model: LlamaForCausalLM) -> int | None:
        return None

    def kv_block_size(self, requested: int, backend: AttentionBackend) -> int:
        """flash-attn reads the paged cache itself where it can (no per-layer gather of every
        sequence's K/V), in blocks of a multiple of 256 tokens."""
        return paged_flash_block_size(requested) if backend.paged else requested

    def kv_budget(self, requested: int | None, utilization: float, *,
                  activations: int = 0) -> int:
        return kv_budget_for(self.device, requested, utilization, activations)

    def warms_up_before_kv(self, requested: int | None) -> bool:
        """Without ``--kv-cache-memory`` the cache takes what ``--gpu-memory-utilization``
        leaves once the largest step has run (as vLLM's does)."""
        return requested is None

    def step_memory(self, step: Callable[[], None]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def graphs_off_reason(self, **kw: object) -> str | None:
        off = graphs_off_reason(self.device, **kw)  # type: ignore[arg-type]
        if off is None and self.moe:
            # The loop over experts sizes each group on the host; the grouped GEMMs do not, but
            # their capture has not been tried on a GPU yet (models/moe.py).
            off = "mixture-of-experts layers run their experts eagerly"
        if off is not None:
            logger.info("CUDA graphs off: %s", off)
        return off

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A step input onto the GPU through pinned memory, so the copy is truly asynchronous
        (from pageable memory ``non_blocking`` copies synchronously). torch's caching host
        allocator reuses the pinned buffers and keeps each alive until its copy is done."""
        return t.pin_memory().to(self.device, non_blocking=True)

    def overlaps_forward(self) -> bool:
        return True

    def bind_thread(self, model: ModelConfig) -> dict[int, int]:
        torch.cuda.set_device(self.device)  # a new thread starts on GPU 0
        return {}
