"""What an attention backend is: the attention function the model's layers call, and the
builder of its own per-step metadata from the backend-neutral :class:`StepLayout`."""

from __future__ import annotations

import torch

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.attention.step import DecodeRows, StepLayout


class AttentionBackend:
    """A backend; called as the attention function ``(q, k, v, k_cache, v_cache, meta, scale,
    window) -> out`` with the metadata it built."""

    name = ""
    # Whether the model's last layer may run only the rows that are read (last_layer_rows).
    prunes_last_layer = False
    # Whether it reads the paged cache through block tables itself (what CUDA graphs need).
    paged = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None) -> torch.Tensor:
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
