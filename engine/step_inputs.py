"""How a step's tokens are laid out as rows: their order, the padding of their count, and the
block tables and cache slots the attention reads, as tensors.

``ModelRunner.prepare`` builds a step's inputs from these (the attention's view of the step:
:mod:`kvrelay.engine.attention.step`); whatever reads the step's hidden states by row (prompt
logprobs) follows the same ``row_order``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple, overload

import torch

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.kv_connector import ScheduledSeq


def padded_rows(n: int) -> int:
    """The row count a CPU step of ``n`` tokens (or ``n`` sampled rows) is padded to: ``n`` up to
    32, then the next multiple of an eighth of ``n``'s octave (36, 40, ... 64, 72, ... 128,
    144, ...), so padding adds less than 1/8 and the distinct sizes stay few (80 up to 2048).

    oneDNN compiles a primitive per GEMM shape, rows included: 0.4-2.4 ms for each of a model's
    ~5 linear shapes (measured, 768-wide layers), every time a step has a row count it has not
    seen. Prompts of varied lengths, chunks and batch sizes make almost every step new, and on a
    small model that costs more than the step's matmuls. Bucketed, the shapes repeat, stay in
    the (capped, see :mod:`kvrelay.engine.heap`) primitive caches and compile once."""
    if n <= 32:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


class TokenWindow:
    """The tokens ``[start, start + len)`` of a sequence, by absolute position: sliced (the
    eager step's inputs) or one (a decode row of the static path)."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    @overload
    def __getitem__(self, s: int) -> int: ...
    @overload
    def __getitem__(self, s: slice) -> list[int]: ...
    def __getitem__(self, s: int | slice) -> int | list[int]:
        if isinstance(s, int):
            if not 0 <= s - self.start < len(self.tokens):
                raise IndexError(f"token {s} is outside the window [{self.start}, "
                                 f"{self.start + len(self.tokens)})")
            return self.tokens[s - self.start]
        return self.tokens[s.start - self.start:s.stop - self.start]


@dataclass
class StepSeq:
    """What :meth:`ModelRunner.prepare` reads of a sequence, where no scheduler holds one: a
    tensor-parallel rank's copy of rank 0's, or the warm-up step that sizes the KV cache."""

    num_computed_tokens: int
    num_tokens: int
    token_ids: TokenWindow
    block_table: list[int]
    page_tables: list[list[int]] | None = None  # the hybrid KV layout's, per layer group


class StepInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the flat batch that sample; None: all, in order
    sampled_order: list[int]  # scheduled index of each sampling row


def sampled_rows(rows: list[int], ids: list[int]) -> torch.Tensor | None:
    """The step's rows that sample (of its input ``ids``) as an index, or None where that is
    every row in order (a decode step: the model's output is then read as is, not copied)."""
    n = len(ids)
    return None if len(rows) == n and rows == list(range(n)) else torch.tensor(rows,
                                                                             dtype=torch.long)


def row_order(scheduled: Seq[ScheduledSeq]) -> tuple[list[int], list[int]]:
    """The scheduled indices in the order of the step's rows: prefill chunks (as scheduled),
    then decodes by context length (consecutive ones form the attention's padded groups)."""
    prefill = [i for i, s in enumerate(scheduled) if s.num_new_tokens > 1]
    decode = sorted((i for i, s in enumerate(scheduled) if s.num_new_tokens == 1),
                    key=lambda i: scheduled[i].seq.num_computed_tokens)
    return prefill, decode
