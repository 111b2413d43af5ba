"""The block manager of the hybrid KV layout (``hybrid_kv.py``): logical blocks over one pool of
pages, a page per layer group, windowed groups' pages given back as the window moves past them.

A *logical block* is what :class:`~kvrelay.engine.block_manager.BlockManager` manages: its
reference counts, its prefix hash, its place in the LRU of cached free blocks and in
``seq.block_table`` are unchanged. Here it also holds one page per layer group
(``pages[bid][g]``; -1: none). The real resource is the pages: a new logical block takes one
free page per group, and evicting a cached free block gives its pages back. So:

- ``num_free_blocks`` counts *logical blocks a fresh allocation can still take*: (free pages + idle
  pages + the pages of cached free blocks, which eviction frees) // groups. Admission, the
  watermark, ``can_allocate`` and preemption all keep counting blocks as before; a block of a
  windowed group's tail is counted whole (a chunk's new blocks need a page in every group before its
  step runs) and its out-of-window pages come back after the step.
- ``num_pages`` / ``num_free_pages`` / ``held_pages(seq)`` count pages (what memory is held).

Windowed pages: for each window ``w``, a sequence holds the ``w``-groups' pages of its blocks
from ``held[w]`` on; ``wrefs[bid][w]`` counts the sequences that do. Once a sequence's next
query is at position ``c`` (after each step of its prefill chunks and decodes) it reads no key
before ``c - w + 1``, so it lets go of the blocks wholly before (``release_out_of_window``); a
block no holder reads in group ``w`` any more has its ``w``-pages *idle*: their KV stays (the
block is whole: a later prompt sharing it, such as a common system prompt, may still continue
from it) while the pool counts them free, and a fresh block takes idle pages first, least
recently idle first, before it evicts a cached free block. An idle page taken back leaves its
block *partial* (the same state as a windowed handoff's holes: ``match_prefix`` only ends a
prefix where the continuation's windowed layers read no partial block). So a hybrid holds only
its windows under memory pressure and loses no prefix hit without it. A cached free block
keeps its pages until evicted; a block taken again by a prefix hit reads (and un-idles) only
the windowed pages the new holder reads. The sequence's page tables name page 0 where it
holds no page (``NULL_PAGE``): attention masks every key before the window (torch SDPA's masks;
the native decode kernel does not load them) and page 0 is always a real page, so a gather never
indexes out of range.

The tiers below the pool (``engine/tiers``) keep whole blocks: a tier slot is a block's page
of every group (``KVTiers.pages_of``). A published block is copied down before it loses a page
(``_evict_idle`` stores it first), a partial one never; a promoted block comes back into fresh
pages of every group.

A P/D handoff addresses pages: a decode worker's reservation holds, of each windowed group, only the
pages of blocks its first decode reads (``release_out_of_window(seq, upto=prompt length)``: a fresh
block's other pages, never written, go back at once) and names them to the prefill worker
(``page_ids``), whose sender writes each layer group's pages of the blocks that group reads
(``kv_window.PageWrites``). While it waits, the reservation keeps its cached prefix's last window
from eviction (``keep_prefix_window``): the prefill worker continues from there and may pull it from
here. A prefix pull reads pages too (``prefix_shares.py``): both sides hold, of each windowed group,
the pages from the window of the prefix's end on. A decoding sequence keeps the window of its last
full block's start (``release_out_of_window``), at most a block per windowed group more than its
next query reads: the prefix a follow-up turn continues from, here or pulled by a peer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvrelay.engine.block_manager import Block, BlockManager, PrefixMatch
from kvrelay.engine.hybrid_kv import KVGroups
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.tiers.kv_tiers import BlockRef, KVTiers
from kvrelay.engine.tiers.media import DEVICE

logger = logging.getLogger(__name__)

NULL_PAGE = 0  # what a page table names where the sequence holds no page


class PagePool:
    """The free pages, each at home in one layer group's region (pages ``[g * r, (g + 1) * r)``,
    ``r`` = pages / groups): a group takes a page of its own region while it has one, else one
    of the fullest other region's, and a page goes back to its home region. One pool still (no
    region is reserved to its group), but a sequence's pages of one group tend to lie together
    in the order it took them: the CPU's paged kernels stream a table's pages, and pages of a
    few KiB taken round-robin by every group (a stride of the group count) ran a tiny model's
    full-attention decode 1.5x slower than one table's contiguous blocks."""

    def __init__(self, num_pages: int, groups: int):
        self.region = -(-num_pages // groups)
        self.free = [list(range(min(num_pages, (g + 1) * self.region) - 1, g * self.region - 1,
                                -1)) for g in range(groups)]  # stacks: lowest page on top
        self.count = num_pages

    def __len__(self) -> int:
        return self.count

    def take(self, group: int) -> int:
        own = self.free[group]
        stack = own if own else max(self.free, key=len)
        self.count -= 1
        return stack.pop()

    def give(self, page: int) -> None:
        self.free[page // self.region].append(page)
        self.count += 1

    def pages(self) -> list[int]:
        return [p for stack in self.free for p in stack]


class HybridBlockManager(BlockManager):
    def __init__(self, num_pages: int, block_size: int, groups: KVGroups,
                 enable_prefix_caching: bool = True, tiers: KVTiers | None = None):
        # At most one logical block per page: each holds at least its full groups' pages.
        super().__init__(num_pages, block_size, enable_prefix_caching, tiers)
        assert None in groups.windows and num_pages >= groups.num_groups
        self.groups = groups
        self.num_groups = groups.num_groups
        self._windows = groups.window_values
        self._wgroups = {w: groups.groups_of_window(w) for w in self._windows}
        self._free.clear()  # the base's free list: cached free blocks (holding pages) only
        self._unused = list(range(num_pages - 1, -1, -1))  # ids holding no page (a stack)
        self._free_pages = PagePool(num_pages, groups.num_groups)
        self._cached_pages = 0  # pages held by the blocks in ``_free``
        # Idle pages: a held block's windowed pages no holder reads any more, their KV kept
        # (the block stays whole: a later prompt may continue from it) until the pool needs the
        # page, least recently idle first (``_take_free``). (block, group) -> None.
        self._idle: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.pages: list[list[int]] = [[] for _ in range(num_pages)]
        self.wrefs: list[dict[int, int]] = [{} for _ in range(num_pages)]
        self._held: dict[str, dict[int, int]] = {}
        # Reservations' cached prefixes' last windows, kept whole until their KV arrives
        # (``keep_prefix_window``): request id -> (block, window) references.
        self._kept: dict[str, list[tuple[int, int]]] = {}
        self.num_released_pages = 0  # let go of by their holders (idle, or back at once)
        self.num_evicted_pages = 0  # idle pages the pool took back

    # -- counts --------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.blocks)  # one logical block id per page: ids never run out

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds (free; or kept, until evicted, by a cached free block or
        idle in a held block)."""
        return len(self._free_pages) + self._cached_pages + len(self._idle)

    @property
    def num_idle_pages(self) -> int:
        return len(self._idle)

    @property
    def num_blocks(self) -> int:
        """The pool in blocks' worth (pages // groups): what usage and the watermark count."""
        return self.num_pages // self.num_groups

    @property
    def num_free_blocks(self) -> int:
        return self.num_free_pages // self.num_groups

    def held_pages(self, seq: Sequence) -> int:
        return self.groups.pages_held(len(seq.block_table), self._held.get(seq.request_id, {}))

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks' worth of pages ``seq`` holds (``held_pages / groups``, rounded up)."""
        return -(-self.held_pages(seq) // self.num_groups)

    # -- the pool ------------------------------------------------------------------------------
    def _present(self, bid: int) -> int:
        return sum(p >= 0 for p in self.pages[bid])

    def _take_free(self) -> int:
        """A fresh logical block with a page in every group, one reference and each window's
        pages held by its taker."""
        n = self.num_groups
        while len(self._free_pages) < n:
            if self._idle:  # a page only a continuation from its block would read: first
                self._evict_idle()
                continue
            assert self._free, "no page to take: callers check num_free_blocks first"
            bid, _ = self._free.popitem(last=False)  # least recently freed first
            if bid in self._to_store:  # its store was deferred: it goes now, before the reuse
                self._store([(bid, self._to_store.pop(bid))])
            self._cached_pages -= self._present(bid)
            self._forget(self.blocks[bid])
            self._release_all(bid)
        bid = self._unused.pop()
        block = self.blocks[bid]
        block.partial = False
        block.ref_count = 1
        self.pages[bid] = [self._free_pages.take(g) for g in range(n)]
        self.wrefs[bid] = dict.fromkeys(self._windows, 1)
        return bid

    def _evict_idle(self) -> None:
        """Give the least recently idle page back: its block becomes partial."""
        (bid, g), _ = self._idle.popitem(last=False)
        block = self.blocks[bid]
        if bid in self._to_store:  # whole until now: a tier copy is taken first
            self._store([(bid, self._to_store.pop(bid))])
        self._free_pages.give(self.pages[bid][g])
        self.pages[bid][g] = -1
        self.num_evicted_pages += 1
        self._mark_partial(block)

    def _mark_partial(self, block: Block) -> None:
        if not block.partial and block.hash is not None and self.events is not None:
            self.events.removed(DEVICE, [block.hash])  # no peer may take it whole
        block.partial = True

    def _unidle(self, bid: int) -> None:
        """Block ``bid``'s idle pages are idle no more (it is freed, or cached free)."""
        for w in self._windows:
            for g in self._wgroups[w]:
                self._idle.pop((bid, g), None)

    def _wref(self, bid: int, w: int) -> None:
        """One more holder reads block ``bid``'s pages of window ``w``: none of them is idle."""
        self.wrefs[bid][w] = self.wrefs[bid].get(w, 0) + 1
        for g in self._wgroups[w]:
            self._idle.pop((bid, g), None)

    def _release_all(self, bid: int) -> None:
        self._unidle(bid)
        for p in self.pages[bid]:
            if p >= 0:
                self._free_pages.give(p)
        self.pages[bid] = []
        self.wrefs[bid] = {}
        self._unused.append(bid)

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
            self._cached_pages -= self._present(bid)
        block.ref_count += 1

    def _unref(self, bid: int) -> None:
        block = self.blocks[bid]
        assert block.ref_count > 0, f"double free of block {bid}"
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is None:  # nothing to serve later: its pages go at once
            self._release_all(bid)
        else:
            self._unidle(bid)  # counted with the cached free block's pages from now on
            self._free[bid] = None
            self._cached_pages += self._present(bid)

    def _wunref(self, bid: int, w: int, valid: bool = True) -> None:
        self.wrefs[bid][w] -= 1
        self._settle(bid, valid)

    def _settle(self, bid: int, valid: bool = True) -> None:
        """Let go of the windowed pages of a held block that none of its holders reads: idle
        (kept until the pool needs them), or, where they hold no KV (``valid`` False: a
        reservation's or an import's block never written there), back at once."""
        block = self.blocks[bid]
        if block.ref_count == 0:
            return
        pages = self.pages[bid]
        for w in self._windows:
            if self.wrefs[bid].get(w, 0) > 0:
                continue
            for g in self._wgroups[w]:
                if pages[g] < 0 or (bid, g) in self._idle:
                    continue
                self.num_released_pages += 1
                if valid:
                    self._idle[(bid, g)] = None
                else:
                    self._free_pages.give(pages[g])
                    pages[g] = -1
                    self._mark_partial(block)

    # -- sequences -----------------------------------------------------------------------------
    def _table_entry(self, bid: int, g: int, index: int, held: dict[int, int]) -> int:
        w = self.groups.windows[g]
        if w is not None and index < held[w]:
            return NULL_PAGE
        page = self.pages[bid][g]
        assert page >= 0, (bid, g, index)
        return page

    def _build_tables(self, seq: Sequence) -> None:
        held = self._held[seq.request_id]
        seq.page_tables = [[self._table_entry(bid, g, i, held)
                            for i, bid in enumerate(seq.block_table)]
                           for g in range(self.num_groups)]

    def allocate_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        super().allocate_prefix(seq, match)
        c, bt = seq.num_computed_tokens, seq.block_table
        held = {}
        for w in self._windows:
            first = min(max(0, c - w + 1) // self.block_size, len(bt))
            for bid in bt[first:]:
                self._wref(bid, w)
            held[w] = first
        self._held[seq.request_id] = held
        for bid in bt:
            self._settle(bid)
        self._build_tables(seq)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        have = len(seq.block_table)
        if not super().allocate(seq, num_tokens):
            return False
        held = self._held.setdefault(seq.request_id, dict.fromkeys(self._windows, 0))
        if seq.page_tables is None:
            seq.page_tables = [[] for _ in range(self.num_groups)]
        for i in range(have, len(seq.block_table)):
            bid = seq.block_table[i]
            for g, table in enumerate(seq.page_tables):
                table.append(self._table_entry(bid, g, i, held))
        return True

    def prepare_write(self, seq: Sequence, num_tokens: int) -> bool:
        shared = self.shared_in_range(seq, num_tokens)
        if self.blocks_needed(seq, num_tokens) + len(shared) > self.num_free_blocks:
            return False
        held = self._held.setdefault(seq.request_id, dict.fromkeys(self._windows, 0))
        for i in shared:
            src = seq.block_table[i]
            dst = self._take_free()
            for g, w in enumerate(self.groups.windows):
                assert w is None or i >= held[w], "a written block lies in every window"
                self.pending_copies.append((self.pages[src][g], self.pages[dst][g]))
            self.blocks[src].ref_count -= 1  # > 0: another sequence still holds it
            for w in self._windows:
                self._wunref(src, w)
            seq.block_table[i] = dst
            assert seq.page_tables is not None
            for g, table in enumerate(seq.page_tables):
                table[i] = self.pages[dst][g]
        assert self.allocate(seq, num_tokens)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        assert not child.block_table
        held = dict(self._held.get(parent.request_id, dict.fromkeys(self._windows, 0)))
        for i, bid in enumerate(parent.block_table):
            self._ref(bid)
            for w in self._windows:
                if i >= held[w]:
                    self._wref(bid, w)
        child.block_table = list(parent.block_table)
        self._held[child.request_id] = held
        child.page_tables = None if parent.page_tables is None else \
            [list(t) for t in parent.page_tables]
        hashes = self._seq_hashes.get(parent.request_id)
        if hashes is not None:
            self._seq_hashes[child.request_id] = list(hashes)

    def keep_prefix_window(self, seq: Sequence) -> None:
        """Keep the windowed pages of the last window of ``seq``'s cached prefix (its
        ``num_computed_tokens``) whole until ``let_go_prefix_window``, though ``seq`` itself will
        not read them. For a reservation: its prefill worker continues the prompt from that
        prefix and may pull those very pages from here (P<-D) while the reservation waits, and
        a block whose pages went back is no prefix a continuation may take."""
        held = self._held.get(seq.request_id)
        if held is None:
            return
        c, bt, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        kept = []
        for w in self._windows:
            for i in range(min(max(0, c - w + 1) // bs, len(bt)), min(c // bs, len(bt))):
                if i >= held[w]:
                    self._wref(bt[i], w)
                    kept.append((bt[i], w))
        if kept:
            self._kept[seq.request_id] = kept

    def let_go_prefix_window(self, seq: Sequence) -> None:
        """End ``keep_prefix_window`` (the KV arrived, or the request ended)."""
        for bid, w in self._kept.pop(seq.request_id, ()):
            self._wunref(bid, w)

    def free(self, seq: Sequence) -> None:
        self.let_go_prefix_window(seq)
        held = self._held.pop(seq.request_id, dict.fromkeys(self._windows, 0))
        for i in range(len(seq.block_table) - 1, -1, -1):  # the tail first: evicted first
            bid = seq.block_table[i]
            for w in self._windows:
                if i >= held[w]:
                    self.wrefs[bid][w] -= 1
            self._unref(bid)
            self._settle(bid)
        seq.block_table = []
        seq.page_tables = None
        self._seq_hashes.pop(seq.request_id, None)

    def release_out_of_window(self, seq: Sequence, upto: int | None = None,
                              valid_blocks: int | None = None) -> int:
        """Give back ``seq``'s windowed pages that no query from the start of its last full
        block on reads (prefill chunks and decodes alike: every step starts at
        ``num_computed_tokens``). That keeps, past what its next query reads, at most one
        block's pages per windowed group: what a later prompt continuing from that block
        boundary reads (a follow-up turn, here or pulled by a peer: ``match_prefix`` takes a
        prefix only where its windows read whole pages), without which a conversation's next
        turn would find no prefix to continue from. ``upto``: exactly what a query at that
        position reads instead (a reservation's first decode, whose earlier pages a peer never
        writes). The pages let go of stay idle, their KV kept until the pool needs them, except
        those of blocks from ``valid_blocks`` on (fresh blocks nobody wrote there: back at
        once). Returns how many pages it let go of (fewer go idle where another sequence still
        reads them)."""
        held = self._held.get(seq.request_id)
        if held is None or seq.page_tables is None:
            return 0
        bt, bs = seq.block_table, self.block_size
        c = seq.num_computed_tokens // bs * bs if upto is None else upto
        out = 0
        for w in self._windows:
            first = min(max(0, c - w + 1) // bs, len(bt))
            done = held[w]
            if first <= done:
                continue
            for i in range(done, first):
                self._wunref(bt[i], w, valid_blocks is None or i < valid_blocks)
                for g in self._wgroups[w]:
                    seq.page_tables[g][i] = NULL_PAGE
            held[w] = first
            out += (first - done) * len(self._wgroups[w])
        return out

    def page_ids(self, seq: Sequence) -> tuple[int, ...]:
        """``seq``'s page of each layer group per block, block after block, -1 where it holds
        none (a windowed group's blocks before its window): where a peer writes its KV
        (``Reservation.page_ids``)."""
        held = self._held.get(seq.request_id, {})
        return tuple(-1 if w is not None and i < held.get(w, 0) else self.pages[bid][g]
                     for i, bid in enumerate(seq.block_table)
                     for g, w in enumerate(self.groups.windows))

    def pages_of(self, bid: int) -> list[int]:
        """Block ``bid``'s page in every group (a whole block's: what a tier copies)."""
        pages = self.pages[bid]
        assert len(pages) == self.num_groups and min(pages) >= 0, (bid, pages)
        return pages

    def _store(self, blocks: list[tuple[int, BlockRef]]) -> None:
        super()._store([(bid, ref) for bid, ref in blocks if not self.blocks[bid].partial])

    def promote(self, seq: Sequence, max_tokens: int, reserve: int = 0) -> int | None:
        have = len(seq.block_table)
        out = super().promote(seq, max_tokens, reserve)
        if len(seq.block_table) > have:  # fresh whole blocks, each window's pages held
            held = self._held.setdefault(seq.request_id, dict.fromkeys(self._windows, 0))
            if seq.page_tables is None:
                seq.page_tables = [[] for _ in range(self.num_groups)]
            for i in range(have, len(seq.block_table)):
                for g, table in enumerate(seq.page_tables):
                    table.append(self._table_entry(seq.block_table[i], g, i, held))
        return out

    def mark_holes(self, seq: Sequence, first: int, end: int) -> None:
        """Nothing to mark: a reservation's fresh blocks before a windowed group's window never
        had that group's page (``release_out_of_window(valid_blocks=...)`` gave it back at
        once, the block partial), and its cached blocks hold every page they had."""
