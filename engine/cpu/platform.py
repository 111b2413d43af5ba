"""The CPU platform: threads and oneDNN's caches before the first op, the native attention
backend, the linear kernels' packing (and the choice between them) at load, the fused decode
layers, weights on huge pages and the engine's threads pinned one per CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvrelay.engine.attention import AttentionBackend, select_backend
from kvrelay.engine.config import DEFAULT_KV_BYTES, ModelConfig
from kvrelay.engine.cpu import kernel_choice
from kvrelay.engine.cpu.fused_decode import FusedDecode
from kvrelay.engine.cpu.packed_linear import (
    PACKED_DTYPES,
    onednn_packing_available,
    packed,
    panels_available,
)
from kvrelay.engine.cpu.thread_pinning import pin_engine_threads
from kvrelay.engine.heap import bound_onednn_caches

if TYPE_CHECKING:
    from kvrelay.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


# Many rows (a long prefill chunk) go through the MLP in row chunks sized so one chunk's gate/up
# activations (fp32) fit in ~16 MiB: they are then still in the last-level cache for silu x up
# and the down projection, instead of making a round trip through memory (measured +10-15% on
# the MLP of a 2048-token prefill, ~150M model, fp32).
MLP_CHUNK_BYTES = 16 * 2**20


def mlp_chunk_rows(intermediate_size: int) -> int:
    """Rows per MLP chunk: a power of two, at least 64."""
    rows = MLP_CHUNK_BYTES // (2 * intermediate_size * 4)
    return max(64, 1 << max(0, rows.bit_length() - 1))


class CpuPlatform:
    """See :class:`kvrelay.engine.platform.Platform` for what each method promises."""

    name = "cpu"

    def __init__(self, device: torch.device | None = None, *, num_threads: int | None = None,
                 linear_kernel: str = "auto",
                 prefill_rows: int = kernel_choice.PREFILL_ROWS):
        self.device = torch.device("cpu") if device is None else device
        self.num_threads = num_threads
        self.linear_kernel = linear_kernel
        self.prefill_rows = prefill_rows

    def weight_dtype(self, checkpoint: torch.dtype | None) -> torch.dtype:
        # bf16 as written: the kernels widen it to fp32 in registers, so a weight streams at
        # half the bytes. fp16 has no such kernel here and widens exactly into fp32.
        return torch.bfloat16 if checkpoint == torch.bfloat16 else torch.float32

    def compute_dtype(self, weights: torch.dtype) -> torch.dtype:
        # Activations stay fp32 on CPU whatever the weights: there is no bf16 arithmetic to gain
        # on AVX2/AVX-512 without avx512_bf16/AMX (a bf16 op widens to fp32 anyway), the
        # residual stream keeps fp32's precision, and norms, softmax, rope and the sampler
        # read it as they do in fp32.
        return torch.float32

    def configure(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        bound_onednn_caches()  # before the first oneDNN op (the weight prepacking)

    def attention(self, name: str, dtype: torch.dtype) -> AttentionBackend:
        return select_backend(name, self.device, dtype)

    def prepare_model(self, model: LlamaForCausalLM, dtype: torch.dtype) -> str:
        """Pack the linears for the configured kernel (``auto``: timed, or as kept before) and
        build the fused decode layers over them, for fp32 or bf16 weights (``dtype``: the
        copies keep it; the activations are fp32 either way) where either kernel takes them;
        returns the linears' kernel (``dense``: left unpacked)."""
        for layer in model.layers:
            layer.mlp.chunk_rows = mlp_chunk_rows(model.arch.intermediate_size)
        if dtype not in PACKED_DTYPES \
                or not (onednn_packing_available(dtype) or panels_available(dtype)):
            model.fused_decode = None
            return "dense"
        kernel = kernel_choice.choose_linear_kernel(model, self.linear_kernel,
                                                    self.prefill_rows)
        model.fused_decode = FusedDecode.for_model(model)
        return kernel

    def pad_rows_above(self, model: LlamaForCausalLM) -> int | None:
        """Steps of more rows are padded to a bucketed count (oneDNN compiles a primitive per
        row count; the panel GEMM does not): from the panels' rows where oneDNN holds a copy,
        never (None) without one."""
        lm = packed(model.lm_head)
        return lm.panel_rows if lm is not None and lm.onednn is not None else None

    def kv_block_size(self, requested: int, backend: AttentionBackend) -> int:
        return requested

    def kv_budget(self, requested: int | None, utilization: float, *,
                  activations: int = 0) -> int:
        """``--kv-cache-memory``, or 512 MiB: host memory is the operator's to divide (the
        cache does not size itself to what a host has free)."""
        return DEFAULT_KV_BYTES if requested is None else requested

    def warms_up_before_kv(self, requested: int | None) -> bool:
        return False

    def step_memory(self, step: Callable[[], None]) -> int:
        step()
        return 0

    def release_cached_memory(self) -> None:
        pass

    def graphs_off_reason(self, **_: object) -> str | None:
        return "not a CUDA device"

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def overlaps_forward(self) -> bool:
        """Whether host work (grammar masks) can run beside a forward: only where the forward
        leaves a core free."""
        return torch.get_num_threads() < len(os.sched_getaffinity(0))

    def bind_thread(self, model: ModelConfig) -> dict[int, int]:
        """The calling thread (the one that steps the engine) and its OpenMP workers pinned per
        ``model.thread_binding``, except in a tensor-parallel replica, whose other ranks are not
        pinned (so neither is rank 0). Returns ``{thread id: cpu}`` of the threads pinned."""
        if model.tensor_parallel_size > 1:
            return {}
        return pin_engine_threads(model.thread_binding, self.device)
