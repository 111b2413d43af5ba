"""The platform hook: what an engine does differently on a CPU and on a GPU, behind one object.

The shared engine code (``ModelRunner``, the loader, the model) asks its platform and never tests
a device type. One platform object per runner (per tensor-parallel rank), built by
:func:`platform_for`:

- :class:`kvrelay.engine.cpu.platform.CpuPlatform` (``engine/cpu/``): torch's threads and
  oneDNN's caches, the native attention kernels, the linear kernels' packing and the choice
  between them at load, the fused decode layers, weights on huge pages, threads pinned per CPU;
- :class:`kvrelay.engine.cuda.platform.CudaPlatform` (``engine/cuda/``): the device per thread,
  flash-attn (and the KV block size its paged kernel needs), the KV budget within the GPU's
  memory, CUDA graphs for decode steps, step inputs through pinned memory.

A new platform implements :class:`Platform` in its own package and is picked here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvrelay.engine.attention import AttentionBackend
    from kvrelay.engine.config import EngineConfig, ModelConfig
    from kvrelay.engine.models.llama import LlamaForCausalLM


class Platform(Protocol):
    name: str
    device: torch.device

    def weight_dtype(self, checkpoint: torch.dtype | None) -> torch.dtype:
        """What ``--dtype auto`` stores the weights as, for a checkpoint written in
        ``checkpoint`` (None: its config does not say)."""

    def compute_dtype(self, weights: torch.dtype) -> torch.dtype:
        """The activations' dtype (residual stream, attention, logits) over weights stored as
        ``weights``."""

    def configure(self) -> None:
        """Set up the calling thread and the process before the model is built (threads,
        caches, the current device)."""

    def attention(self, name: str, dtype: torch.dtype) -> AttentionBackend:
        """The attention backend for ``--attention-backend name`` (``auto``: the best here)."""

    def prepare_model(self, model: LlamaForCausalLM, dtype: torch.dtype) -> str:
        """Once the weights are loaded (and sharded): pack them for this platform's linear
        kernel and set the model's fused path, if any; return the linears' kernel."""

    def pad_rows_above(self, model: LlamaForCausalLM) -> int | None:
        """The row count above which a step's rows are padded to a bucketed count (None:
        never)."""

    def kv_block_size(self, requested: int, backend: AttentionBackend) -> int:
        """The KV block size ``backend`` needs, given the configured one."""

    def kv_budget(self, requested: int | None, utilization: float, *,
                  activations: int = 0) -> int:
        """Bytes for the KV cache, after the weights are loaded: ``requested``
        (``--kv-cache-memory``; None: what the platform gives by default), leaving room for
        ``activations`` (what the warm-up step took)."""

    def warms_up_before_kv(self, requested: int | None) -> bool:
        """Whether the largest step runs before the KV cache is sized (``step_memory``)."""

    def step_memory(self, step: Callable[[], None]) -> int:
        """Run ``step``; the device memory it took beyond what was held before (its peak)."""

    def release_cached_memory(self) -> None:
        """Give memory freed to the allocator back to the device (before sizing the cache)."""

    def graphs_off_reason(self, *, enforce_eager: bool, max_batch: int, paged_flash: bool,
                          num_blocks: int, kv_head_groups: int = 1) -> str | None:
        """Why decode steps run eagerly, or None when they replay captured graphs."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor of step inputs on the device (asynchronously where that matters)."""

    def overlaps_forward(self) -> bool:
        """Whether host work (grammar masks) can run on a thread beside a forward."""

    def bind_thread(self, model: ModelConfig) -> dict[int, int]:
        """Place the calling thread, the one that steps the engine; ``{thread id: cpu}`` of the
        threads pinned."""


def platform_for(device: torch.device, config: EngineConfig | None = None) -> Platform:
    """The platform of ``device``, configured from ``config`` (defaults without)."""
    if device.type == "cuda":
        from kvrelay.engine.cuda.platform import CudaPlatform

        return CudaPlatform(device)
    from kvrelay.engine.cpu.platform import CpuPlatform

    if config is None:
        return CpuPlatform(device)
    return CpuPlatform(device, num_threads=config.model.num_threads,
                       linear_kernel=config.model.linear_kernel,
                       prefill_rows=config.scheduler.max_num_batched_tokens)
