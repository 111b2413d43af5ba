"""Which blocks of a sequence to send in a step: pure arithmetic, no I/O, no NIXL.

A sequence's i-th block is ``seq.block_table[i]`` here and ``remote_block_ids[i]`` at the peer
(under the hybrid KV layout, each side's pages per layer group of that block: the plan only
slices the two tables in step).
The sender keeps, per request, ``covered``: blocks ``[0, covered)`` are full and already sent
(or were in the peer's prefix cache: ``covered`` starts at ``skip_blocks``). A step computing
tokens ``[start, start + n)`` sends blocks ``[first, end)`` where ``first`` reaches back to
``covered`` (so blocks that were in *our* prefix cache on the first step, or cached again after
a preemption, go too) and never below ``skip_blocks`` (the peer's own blocks, possibly read by its
other requests, are never written). The last block may be partial; a later chunk re-sends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlockRange(NamedTuple):
    """Send the sequence's blocks ``[start, end)``; afterwards ``[0, covered)`` are complete."""

    start: int
    end: int
    covered: int


class BlockMap(NamedTuple):
    """Parallel lists: local block ``local[i]`` goes to the peer's block ``remote[i]``."""

    local: list
    remote: list


class PlanError(ValueError):
    """The destination cannot hold what the sequence computes (a control-plane bug)."""


def blocks_to_send(start_token: int, num_new_tokens: int, num_prompt_tokens: int,
                   block_size: int, covered: int, skip_blocks: int) -> BlockRange:
    """The block range a step touches. Only prompt tokens travel: tokens at or past
    ``num_prompt_tokens`` (decode steps) are the receiver's own to compute."""
    assert start_token >= 0 and num_new_tokens >= 0 and block_size > 0
    end_token = min(start_token + num_new_tokens, num_prompt_tokens)
    if end_token <= start_token:
        return BlockRange(covered, covered, covered)
    first = max(skip_blocks, min(covered, start_token // block_size))
    end = max(first, -(-end_token // block_size))
    return BlockRange(first, end, max(covered, end_token // block_size, skip_blocks))


def map_blocks(block_table: Sequence, remote_block_ids: Sequence,
               rng: BlockRange) -> BlockMap:
    if rng.start >= rng.end:
        # Nothing to send: a chunk wholly inside what the peer holds already (its prefix cache
        # reaches past this chunk's end), whatever the sequence has allocated beyond it yet.
        return BlockMap([], [])
    if rng.end > len(remote_block_ids):
        raise PlanError(f"the destination reserved {len(remote_block_ids)} blocks but the prompt "
                        f"needs at least {rng.end}: reserve ceil(prompt_tokens / block_size) "
                        "blocks")
    if rng.end > len(block_table):
        raise PlanError(f"sequence has {len(block_table)} blocks, step needs {rng.end}")
    return BlockMap(list(block_table[rng.start:rng.end]), list(remote_block_ids[rng.start:rng.end]))
