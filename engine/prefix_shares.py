"""Prefix blocks shared with a peer engine by pull: lent (an *export*) or borrowed (an *import*).

A prefill engine that would recompute a prefix another engine holds (the history a decode
worker generated, a prompt another prefill worker computed) may instead read that engine's
blocks over KV transfer. The holder *exports*: the blocks it holds of the prefix (the pool's,
and the host tier's, promoted) stay referenced, so the pool cannot reuse them, until the reader
ends the export. The reader *imports*: fresh blocks to read into, which join its prefix cache
only when the read is complete and verified (``end_import(complete=True)``); otherwise they go
back unpublished, so a failed or partial pull can never be served (the request recomputes).

Both hold their blocks under a placeholder sequence in the block manager, so every block comes
back through the one ``free`` path, whatever happens (the engine's ``abort_shares`` on
shutdown, the caller's end call, or its timeout).

Under the hybrid KV layout (``hybrid_blocks.py``) a block is a page per layer group, and a
windowed group's pages before the window of the prefix's end are not needed by whoever
continues it (nor, often, still held: a decode gave them back). Both sides then hold, of each
windowed group, only the pages from that window on, and name them (``pages``): the exporter
offers the longest prefix a continuation may take (``match_prefix`` without ``complete``: every
page its windows read is there), and the importer's blocks are partial where it holds no page,
as they were at the exporter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.hybrid_blocks import HybridBlockManager
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

MAX_SHARES = 1024  # exports and imports held at once (each from a peer's call)


class PrefixShares:
    def __init__(self, bm: BlockManager, max_shares: int = MAX_SHARES):
        self.bm = bm
        self._hybrid = bm if isinstance(bm, HybridBlockManager) else None
        self.max_shares = max_shares
        self._exports: dict[str, tuple[Sequence, float]] = {}  # id -> (holder, deadline)
        self._imports: dict[str, tuple[Sequence, int, float]] = {}  # + blocks to publish
        self.num_exported_blocks = 0
        self.num_imported_blocks = 0
        self.num_failed_imports = 0

    def _holder(self, share_id: str, token_ids: Seq[int], cache_salt: str | None) -> Sequence:
        if share_id in self._exports or share_id in self._imports:
            raise ValueError(f"share {share_id!r} is already open")
        if len(self._exports) + len(self._imports) >= self.max_shares:
            raise OverflowError(f"{self.max_shares} prefix shares are open already")
        return Sequence(share_id, list(token_ids), SamplingParams(max_tokens=1),
                        cache_salt=cache_salt)

    # -- lending -----------------------------------------------------------------------------------
    def export(self, share_id: str, token_ids: Seq[int], cache_salt: str | None,
               ttl_s: float) -> tuple[list[int], int]:
        """Hold the blocks of ``token_ids``' longest cached prefix (pool, then host tier);
        returns their ids (in order) and the tokens they cover. None held: ``([], 0)`` and no
        export is opened."""
        seq = self._holder(share_id, token_ids, cache_salt)
        n = len(token_ids) // self.bm.block_size * self.bm.block_size
        # One table: whole blocks only (the reader takes every block it reads as whole). Hybrid:
        # the pages a continuation reads (the reader holds only those).
        self.bm.allocate_prefix(seq, self.bm.match_prefix(seq.token_ids, n, seq.hash_root,
                                                          complete=self._hybrid is None))
        self.bm.promote(seq, n)
        if not seq.block_table:
            return [], 0
        if self._hybrid is not None:
            self._hybrid.release_out_of_window(seq, upto=seq.num_computed_tokens)
        self._exports[share_id] = (seq, time.monotonic() + ttl_s)
        self.num_exported_blocks += len(seq.block_table)
        return list(seq.block_table), seq.num_computed_tokens

    def end_export(self, share_id: str) -> bool:
        """Let the export's blocks go; True if it was still open (its blocks were held from
        ``export`` until now: a reader may trust what it read)."""
        held = self._exports.pop(share_id, None)
        if held is None:
            return False
        self.bm.free(held[0])
        return True

    # -- borrowing ---------------------------------------------------------------------------------
    def begin_import(self, share_id: str, token_ids: Seq[int], cache_salt: str | None,
                     ttl_s: float, reserve: int = 0) -> tuple[list[int], int]:
        """Blocks to read ``token_ids``' full blocks into: returns the ids of those not already
        cached here (in order) and how many leading blocks are cached (they need no read).

        Where the pool cannot take them all, the import is *partial*: the leading blocks that
        fit in the free blocks beyond ``reserve`` (those the engine's admitted requests still
        need), so a pull still saves what it can (a prefix is useful from its first block on)
        and never takes room an admitted prompt waits for. Raises MemoryError when not one
        block fits."""
        seq = self._holder(share_id, token_ids, cache_salt)
        bs = self.bm.block_size
        n = len(token_ids) // bs * bs
        self.bm.allocate_prefix(seq, self.bm.match_prefix(seq.token_ids, n, seq.hash_root))
        have = len(seq.block_table)
        room = max(0, self.bm.num_free_blocks - reserve)
        n = min(n, (have + room) * bs)
        if n <= have * bs or not self.bm.allocate(seq, n):
            self.bm.free(seq)
            raise MemoryError(f"no KV room to import {len(token_ids) // bs - have} blocks "
                              f"({self.bm.num_free_blocks} free, {reserve} promised)")
        if self._hybrid is not None:  # the pages a continuation from ``n`` reads, no others
            self._hybrid.release_out_of_window(seq, upto=n, valid_blocks=have)
        self._imports[share_id] = (seq, n, time.monotonic() + ttl_s)
        return list(seq.block_table[have:]), have

    def pages(self, share_id: str, first: int = 0) -> tuple[int, ...]:
        """Under the hybrid KV layout, an open share's page of each layer group for its blocks
        from ``first`` on, block after block (-1: none held; ``HybridBlockManager.page_ids``);
        ``()`` under one table or for no such share."""
        held = self._exports.get(share_id) or self._imports.get(share_id)
        if self._hybrid is None or held is None:
            return ()
        return self._hybrid.page_ids(held[0])[first * self._hybrid.num_groups:]

    def end_import(self, share_id: str, complete: bool) -> int:
        """Publish the imported blocks into the prefix cache when ``complete`` (every byte read
        and the export still held when the read ended), else drop them unpublished; returns the
        tokens published."""
        held = self._imports.pop(share_id, None)
        if held is None:
            return 0
        seq, n, _ = held
        published = 0
        if complete:
            seq.num_computed_tokens = n
            self.bm.publish(seq)
            published = n
            self.num_imported_blocks += n // self.bm.block_size
        else:
            self.num_failed_imports += 1
        self.bm.free(seq)
        return published

    # -- housekeeping ------------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        """End every share past its deadline (a peer that never ended it); returns how many."""
        now = time.monotonic() if now is None else now
        late = [k for k, (_, d) in self._exports.items() if d <= now]
        for k in late:
            self.end_export(k)
        late_in = [k for k, (_, _, d) in self._imports.items() if d <= now]
        for k in late_in:
            self.end_import(k, complete=False)
        return len(late) + len(late_in)

    def abort_all(self) -> None:
        for k in list(self._exports):
            self.end_export(k)
        for k in list(self._imports):
            self.end_import(k, complete=False)

    @property
    def num_open(self) -> int:
        return len(self._exports) + len(self._imports)
