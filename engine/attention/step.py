"""One step as every attention backend sees it, before any backend's layout: the sequences of
the flat batch in row order (prefill chunks first, as scheduled, then decodes by context
length), with their new tokens, the keys they see and their block tables. The runner builds it;
each backend turns it into its own metadata (:meth:`AttentionBackend.metadata`), so a new
backend, or a new model family, touches one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    block_size: int
    slot_mapping: torch.Tensor  # [T] long: the cache slot of each row's new K/V
    q_lens: list[int]  # each sequence's new tokens (its rows), in row order
    ctx_lens: list[int]  # the keys each sequence's last row sees: cached prefix + new tokens
    block_tables: list[list[int]]
    num_prefills: int  # the first sequences are prefill chunks (several rows), the rest decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.q_lens[:self.num_prefills])

    def q_starts(self) -> list[int]:
        """Each sequence's first row."""
        out, row = [], 0
        for n in self.q_lens:
            out.append(row)
            row += n
        return out


@dataclass
class DecodeRows:
    """A decode-only step of ``rows`` rows as device tensors (the static buffers a CUDA graph
    replays: views whose contents change between replays, not their shapes)."""

    block_size: int
    slot_mapping: torch.Tensor  # [B] long
    seq_lens: torch.Tensor  # [B] int32: keys each row sees, its new token included
    block_tables: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_k: int  # a bound, not this step's longest: a captured kernel suits every step


def padded_tables(block_tables: list[list[int]], width: int,
                  dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[N, width]`` block tables cut or padded to ``width`` (padding is block 0, which the
    masks hide)."""
    return torch.tensor([bt[:width] + [0] * (width - len(bt[:width])) for bt in block_tables],
                        dtype=dtype)


def cache_slots(block_tables: list[list[int]], lengths: list[int],
                block_size: int) -> torch.Tensor:
    """``[N, max(lengths)]`` cache slots of positions ``0..len-1`` of each block table
    (padding points at slot 0, which the masks hide)."""
    bs = block_size
    width = -(-max(lengths) // bs)
    table = padded_tables(block_tables, width)
    slots = (table[:, :, None] * bs + torch.arange(bs)).view(len(block_tables), width * bs)
    return slots[:, :max(lengths)]
