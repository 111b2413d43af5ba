"""Token bitmasks of a step's grammar-constrained rows, filled beside the forward.

A row's mask depends only on the tokens its matcher has consumed, all known before the step's
forward starts, so the model runner starts filling the masks (llguidance, GIL dropped) on a
worker thread, runs the forward, and collects them just before sampling. Only rows under a
grammar get a mask; a batch without one pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvrelay.engine.sequence import Sequence

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class StepMasks:
    """The masks of one step: ``bitmask[j]`` (32 tokens per int32, lowest bit first) belongs
    to row ``rows[j]`` of the step's logits."""

    rows: list[int]
    bitmask: torch.Tensor
    future: Future[None] | None = None

    def wait(self) -> StepMasks:
        if self.future is not None:
            self.future.result()
            self.future = None
        return self


class MaskFiller:
    """Starts the mask computation of a step's constrained rows (``overlap``: on a thread)."""

    def __init__(self, vocab_size: int, overlap: bool = True):
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._executor: object | None = None

    def start(self, seqs: Seq[Sequence]) -> StepMasks | None:
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        import llguidance as llg

        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=1)
        width = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), width), dtype=torch.int32)
        matchers = [(seqs[i].grammar.handle, j) for j, i in enumerate(rows)]  # type: ignore[union-attr]
        executor, ptr = self._executor, bitmask.data_ptr()

        def fill() -> None:
            executor.unsafe_compute_mask_ptr(matchers, ptr, width * 4, len(rows))  # type: ignore[attr-defined]

        masks = StepMasks(rows, bitmask)
        if self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            masks.future = self._pool.submit(fill)
        else:
            fill()
        return masks


def apply_masks(logits: torch.Tensor, raw: torch.Tensor, masks: StepMasks) -> torch.Tensor:
    """``logits`` with every token a row's grammar forbids at -inf (a new tensor). A row the
    request's own logits processors had already wholly masked within the grammar's tokens
    (``allowed_token_ids`` or ``min_tokens`` against the only tokens the grammar allows) falls
    back to its ``raw`` logits: the grammar is the hard constraint."""
    masks.wait()
    idx = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
    vocab = logits.shape[-1]
    bits = masks.bitmask.to(logits.device)
    allowed = ((bits[:, :, None] >> _BITS.to(logits.device)) & 1).bool()
    allowed = allowed.view(len(masks.rows), -1)[:, :vocab]
    neg_inf = float("-inf")
    sub = logits.index_select(0, idx).masked_fill_(~allowed, neg_inf)
    dead = torch.isneginf(sub).all(dim=-1)
    if bool(dead.any()):
        fallback = raw.index_select(0, idx).masked_fill_(~allowed, neg_inf)
        sub = torch.where(dead[:, None], fallback, sub)
    return logits.index_copy(0, idx, sub)
