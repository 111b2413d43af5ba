"""Per-step attention metadata, entered through a context manager that always resets.

A step's new tokens are flattened into one ``[T]`` batch: prefill segments first (each a run of
query tokens of one sequence), then decodes (one token per sequence). The metadata says where
each new token's K/V goes (``slot_mapping``) and which cached slots each query attends to.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence's query tokens ``[q_start, q_start + q_len)`` of the flat batch.

    ``ctx_len`` keys are visible (cached prefix plus the new tokens); ``ctx_slots`` lists their
    cache slots and is None when there is no cached prefix (then keys come straight from this
    step's K/V).
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean ``[q_len, ctx_len]`` mask (True = attend), or None for plain causal."""
        if window not in self.masks:
            offset = self.ctx_len - self.q_len
            if offset == 0 and (window is None or window >= self.ctx_len):
                self.masks[window] = None
            else:
                qpos = torch.arange(offset, self.ctx_len, device=device)[:, None]
                kpos = torch.arange(self.ctx_len, device=device)[None, :]
                m = kpos <= qpos
                if window is not None:
                    m &= kpos > qpos - window
                self.masks[window] = m
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_prefill_tokens: int
    prefills: list[PrefillSpan]
    decode_ctx_lens: torch.Tensor | None = None  # [B] keys visible to each decode
    decode_slots: torch.Tensor | None = None  # [B, max_ctx] cache slots (padded)
    decode_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    # CUDA (flash-attn) view of the same batch
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    gather_slots: torch.Tensor | None = None  # all visible slots, sequence after sequence
    # Called with the layer index right after that layer's K/V are written to the cache.
    on_kv_written: Callable[[int], None] | None = None

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_ctx_lens is None else int(self.decode_ctx_lens.numel())

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean ``[B, 1, 1, max_ctx]`` mask (True = attend) or None when nothing is masked."""
        if window not in self.decode_masks:
            assert self.decode_slots is not None and self.decode_ctx_lens is not None
            max_ctx = self.decode_slots.shape[1]
            kpos = torch.arange(max_ctx, device=self.decode_slots.device)[None, :]
            lens = self.decode_ctx_lens[:, None]
            m = kpos < lens
            if window is not None:
                m &= kpos >= lens - window
            self.decode_masks[window] = None if bool(m.all()) else m[:, None, None, :]
        return self.decode_masks[window]


_CURRENT: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "kvrelay_attention_metadata", default=None)


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def current_metadata() -> AttentionMetadata:
    meta = _CURRENT.get()
    if meta is None:
        raise RuntimeError("attention called outside forward_context()")
    return meta
