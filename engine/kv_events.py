"""Changes to the set of KV blocks an engine holds, per tier, as events.

The block manager and the tiers below it report every block a tier starts or stops holding to
one ``KVEventSink`` (none by default: no cost). A worker that publishes them (vLLM's KV-event
format over ZMQ, so that external routers can index this worker) attaches a sink; the engine
thread calls it, so a sink only appends to a buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KVEventSink(Protocol):
    def stored(self, medium: str, block_hashes: Sequence[int], parent_hash: int | None,
               token_ids: Sequence[int], block_size: int) -> None:
        """``block_hashes`` (a chain, parent first) now held in ``medium``; ``parent_hash``: the
        hash before the first of them (at a chain's root: the root, ``ROOT_HASH`` or the cache
        salt's ``salt_root``); ``token_ids``: every token of those blocks, in order."""

    def removed(self, medium: str, block_hashes: Sequence[int]) -> None:
        """``block_hashes`` are no longer held in ``medium``."""

    def cleared(self) -> None:
        """Every block of every tier is gone (the engine restarted its cache)."""
