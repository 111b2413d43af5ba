"""What an attention backend is: the attention function the model's layers call, and the
builder of its own per-step metadata from the backend-neutral :class:`StepLayout`."""

from __future__ import annotations

import torch

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.attention.step import DecodeRows, StepLayout


class AttentionBackend:
    """A backend; called as the attention function ``(q, k, v, k_cache, v_cache, meta, scale,
    window, sinks=None) -> out`` with the metadata it built (``sinks``: a logit per query head
    in each softmax's denominator, gpt-oss's; only a backend that ``supports_sinks`` takes
    them, and the runner serves a model with sinks on one that does: the CPU's native kernels
    and torch SDPA do, flash-attn does not)."""

    name = ""
    supports_sinks = False
    # Whether the model's last layer may run only the rows that are read (last_layer_rows).
    prunes_last_layer = False
    # Whether it reads the paged cache through block tables itself (what CUDA graphs need).
    paged = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def bind_cache(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        """The cache it will read (what it sizes per-step scratch by)."""

    def metadata(self, step: StepLayout) -> AttentionMetadata:
        """This backend's metadata of ``step`` (host tensors: the runner moves them)."""
        raise NotImplementedError

    def decode_metadata(self, rows: DecodeRows) -> AttentionMetadata:
        """This backend's metadata of a decode-only step over ``rows``' tensors, as views."""
        raise NotImplementedError(f"{self.name}: no static decode steps")

    def last_layer_rows(self, meta: AttentionMetadata, sampling: list[int]) \
            -> dict[int, int] | None:
        """Set ``meta.last_layer`` where only some rows need the last layer (see
        :class:`LastLayerRows`); returns each such row's index among them, or None."""
        return None
