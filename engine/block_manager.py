"""KV block allocation with reference counts and a prefix cache.

A block is *free* when no sequence references it. A free block may still hold a published
prefix (its hash stays in the index) until it is handed out again: free blocks are reused
least-recently-freed first, so hot prefixes survive longest. A block's hash is published only
after its KV has been written (``publish``), and reuse compares the block's stored token ids and
the hash of the prefix before it (its parent), so a hash collision can never serve wrong KV: not
another prefix's block with the same tokens, nor another cache salt's. A block may be
*partial*: a windowed handoff skipped some sliding-window layers' KV in it (``mark_holes``); it
ends a matched prefix only where no windowed layer reads it, and is never copied to a tier or
read out to a peer.

Sequences may share blocks beyond the prefix cache: ``fork`` gives a child sequence (one more
choice of an ``n > 1`` request) its parent's blocks, one more reference each. Before a sequence
writes KV into a block someone else also references (the prompt's last, partial block, once two
forks append to it), ``prepare_write`` gives it a private copy: a fresh block, and a
``(src, dst)`` pair in ``pending_copies`` that the engine applies to the KV tensor before the
step that writes runs (copy-on-write).

Below the pool, optional tiers (``engine/tiers``) keep blocks the pool lets go: every block is
copied into the host tier once its KV is complete (``flush_stores``, once a step), so evicting
it here drops only this copy, and ``promote`` extends a prefix match with blocks the tiers
still hold, copying them back into fresh pool blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvrelay.engine.kv_events import KVEventSink
from kvrelay.engine.prefix_hash import ROOT_HASH, block_hashes, hash_block
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.tiers.kv_tiers import BlockRef, KVTiers
from kvrelay.engine.tiers.media import DEVICE


class Block:
    __slots__ = ("block_id", "hash", "parent_hash", "partial", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent_hash: int | None = None  # the chain's hash before this block (when published)
        # Some sliding-window layer's KV never arrived (a windowed handoff: ``mark_holes``).
        self.partial = False


class PrefixMatch(NamedTuple):
    block_ids: list[int]
    hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: KVTiers | None = None):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        # Per-sequence chained hashes of its full blocks, kept across preemption.
        self._seq_hashes: dict[str, list[int]] = {}
        # The widest sliding window (None: no layer windowed). A prefix may end only where every
        # block a windowed layer reads from there on is whole (``match_prefix``): blocks of a
        # windowed handoff lack some layers' KV before the window (``mark_holes``).
        self.hole_window: int | None = None
        # Every layer windowed (Mistral's sliding_window): a decoding sequence's blocks wholly
        # before the widest window are returned to the pool as it goes
        # (``release_out_of_window``); per sequence, how many leading blocks it gave back.
        self.release_window: int | None = None
        self._released: dict[str, int] = {}
        self.num_released_blocks = 0
        self.num_cache_queries = 0  # prompt tokens looked up
        self.num_cache_hits = 0  # prompt tokens found
        # Bumped whenever a hash enters or leaves the index, so ``cached_hash_set`` copies the
        # index only when it changed (heartbeats export it once a beat).
        self.cache_version = 0
        self._hash_snapshot: tuple[int, frozenset[int]] = (0, frozenset())
        # Copy-on-write block copies (src, dst) the engine applies before the next model run.
        self.pending_copies: list[tuple[int, int]] = []
        self.tiers = tiers if enable_prefix_caching else None
        # Published, not yet copied to a tier: block id -> its ref, oldest first.
        self._to_store: OrderedDict[int, BlockRef] = OrderedDict()
        self.events: KVEventSink | None = None

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold KV for its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def shared_in_range(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indices into ``seq.block_table`` of the blocks ``seq`` writes to compute up to
        ``num_tokens`` tokens that another sequence also references."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        last = min(-(-num_tokens // bs), len(seq.block_table))
        return [i for i in range(first, last) if self.blocks[seq.block_table[i]].ref_count > 1]

    def write_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks ``prepare_write(seq, num_tokens)`` takes: new ones plus private copies."""
        return self.blocks_needed(seq, num_tokens) + len(self.shared_in_range(seq, num_tokens))

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block whose KV is held (used or free-but-cached)."""
        return list(self._cached)

    def cached_hash_set(self) -> frozenset[int]:
        """``cached_block_hashes`` as a set, for prefix-aware routing; the same object while the
        index is unchanged (O(1)), else one copy of the index.

        May be called from a thread other than the engine's: the copy of the index is one C-level
        pass under the GIL, and the version is read before it, so a change racing with the copy
        only makes the next call copy again."""
        version, snap = self._hash_snapshot
        if version == self.cache_version:
            return snap
        version = self.cache_version
        for _ in range(3):
            try:
                snap = frozenset(self._cached)
                break
            except RuntimeError:  # resized mid-copy (only without a GIL): try again
                continue
        else:
            return self._hash_snapshot[1]
        self._hash_snapshot = (version, snap)
        return snap

    def match_prefix(self, token_ids: Seq[int], max_tokens: int, root: int = ROOT_HASH,
                     complete: bool = False) -> PrefixMatch:
        """Longest run of cached full blocks at the start of ``token_ids[:max_tokens]``, in the
        namespace ``root`` (``Sequence.hash_root``: the request's cache salt), that a prompt may
        continue from: where the run holds partial blocks (``mark_holes``), it ends before one
        that a windowed layer would read past its end (every layer read by the continuation
        is then whole: the full-attention layers' KV is in every block). With ``complete``,
        the run stops at the first partial block (a copy read out to a peer, which will take
        every block as whole)."""
        ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return PrefixMatch(ids, hashes)
        parent = root
        bs = self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            before, parent = parent, hash_block(parent, chunk)
            bid = self._cached.get(parent)
            if bid is None or self.blocks[bid].token_ids != chunk \
                    or self.blocks[bid].parent_hash != before:
                break
            if complete and self.blocks[bid].partial:
                break
            ids.append(bid)
            hashes.append(parent)
        if not complete:
            n = self._continuable(ids)
            ids, hashes = ids[:n], hashes[:n]
        return PrefixMatch(ids, hashes)

    def _continuable(self, ids: list[int]) -> int:
        """The longest leading run of ``ids`` whose last ``hole_window`` tokens' blocks are whole
        (a continuation's windowed layers read back that far)."""
        last, latest = [], -1  # last[i]: the last partial block at or before i (-1: none)
        for i, bid in enumerate(ids):
            if self.blocks[bid].partial:
                latest = i
            last.append(latest)
        if latest < 0:
            return len(ids)
        if self.hole_window is None:  # no window known: stop before the first partial block
            return next(i for i, p in enumerate(last) if p >= 0)
        bs, w = self.block_size, self.hole_window
        for m in range(len(ids), 0, -1):
            if last[m - 1] < max(0, m * bs - w + 1) // bs:
                return m
        return 0

    # -- allocation ----------------------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Give a block-less ``seq`` the matched cached blocks; their tokens count as computed."""
        assert not seq.block_table
        for bid in match.block_ids:
            self._ref(bid)
        seq.block_table = list(match.block_ids)
        seq.num_computed_tokens = match.num_blocks * self.block_size
        self._seq_hashes[seq.request_id] = list(match.hashes)
        self.num_cache_queries += seq.num_prompt_tokens
        self.num_cache_hits += seq.num_computed_tokens

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens; False (and no change) when
        there are not enough free blocks."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def prepare_write(self, seq: Sequence, num_tokens: int) -> bool:
        """``allocate`` plus copy-on-write: every block ``seq`` will write to compute up to
        ``num_tokens`` tokens is its own afterwards. False (and no change) without the room."""
        shared = self.shared_in_range(seq, num_tokens)
        if self.blocks_needed(seq, num_tokens) + len(shared) > self.num_free_blocks:
            return False
        for i in shared:
            src = seq.block_table[i]
            dst = self._take_free()
            self.blocks[src].ref_count -= 1  # > 0: another sequence still holds it
            seq.block_table[i] = dst
            self.pending_copies.append((src, dst))
        assert self.allocate(seq, num_tokens)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give a block-less ``child`` every block of ``parent`` (shared: one more reference
        each) and its prefix hashes; the blocks' KV counts as computed for it too."""
        assert not child.block_table
        released = self._released.get(parent.request_id, 0)
        for bid in parent.block_table[released:]:
            self._ref(bid)
        child.block_table = list(parent.block_table)
        if released:
            self._released[child.request_id] = released
        hashes = self._seq_hashes.get(parent.request_id)
        if hashes is not None:
            self._seq_hashes[child.request_id] = list(hashes)

    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if bid in self._to_store:  # its store was deferred: it goes now, before the reuse
            self._store([(bid, self._to_store.pop(bid))])
        self._forget(block)
        block.partial = False
        block.ref_count = 1
        return bid

    def _forget(self, block: Block) -> None:
        """Evict the cached prefix ``block`` held (it is about to hold other KV)."""
        if block.hash is not None:
            if self._cached.get(block.hash) == block.block_id:
                del self._cached[block.hash]
                self.cache_version += 1
                if self.events is not None and not block.partial:
                    self.events.removed(DEVICE, [block.hash])
            block.hash = None
            block.token_ids = ()
            block.parent_hash = None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks are freed first so they are evicted first."""
        released = self._released.pop(seq.request_id, 0)
        for bid in reversed(seq.block_table[released:]):
            self._unref(bid)
        seq.block_table = []
        self._seq_hashes.pop(seq.request_id, None)

    def publish(self, seq: Sequence) -> None:
        """Publish the hashes of ``seq``'s full blocks whose KV is now in the cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        n_full = min(seq.num_computed_tokens, len(seq.block_table) * bs) // bs
        parent = hashes[-1] if hashes else seq.hash_root
        for i in range(len(hashes), n_full):
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            before, parent = parent, hash_block(parent, chunk)
            hashes.append(parent)
            block = self.blocks[seq.block_table[i]]
            held = self._cached.get(parent)
            # a whole copy takes the index from a partial one (which keeps its KV, unindexed)
            if block.hash is None and (held is None or (self.blocks[held].partial
                                                        and not block.partial)):
                self._adopt(block, BlockRef(parent, before, chunk))
                if self.tiers is not None and not block.partial:  # a tier copy is taken whole
                    self._to_store[block.block_id] = BlockRef(parent, before, chunk)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back ``seq``'s blocks that no layer reads any more, where every layer is windowed
        (``release_window``): once it decodes, its next token at position ``p`` sees keys from
        ``p - w + 1`` on, so the blocks wholly before are dead. Returns how many went.

        The block table keeps their ids (the pool may hand them to others): they lie outside
        every window, which each attention backend masks (the native decode kernel does not
        load them), and ``free`` skips them. A released block keeps its published prefix, as
        any freed block does, until the pool reuses it: its KV still matches (whole, or partial
        as it was: ``mark_holes``).
        Only a sequence past its prompt gives blocks back: a prefill's blocks are still read by
        its KV transfer when it finishes."""
        w = self.release_window
        if w is None or seq.num_computed_tokens <= seq.num_prompt_tokens:
            return 0
        first = min(max(0, seq.num_computed_tokens - w + 1) // self.block_size,
                    len(seq.block_table))
        done = self._released.get(seq.request_id, 0)
        if first <= done:
            return 0
        for bid in seq.block_table[done:first]:
            self._unref(bid)
        self._released[seq.request_id] = first
        self.num_released_blocks += first - done
        return first - done

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds a reference to (its table less what it gave back)."""
        return len(seq.block_table) - self._released.get(seq.request_id, 0)

    def _unref(self, bid: int) -> None:
        block = self.blocks[bid]
        assert block.ref_count > 0, f"double free of block {bid}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[bid] = None

    def mark_holes(self, seq: Sequence, first: int, end: int) -> None:
        """``seq``'s blocks ``first .. end - 1`` lack some sliding-window layer's KV (a windowed
        handoff skipped them: ``engine/kv_window.py``). Attention over ``seq`` never reads the
        missing part; published, they serve only prefixes that end where no windowed layer
        reads them (``match_prefix``), never a copy to a peer or a tier, and no KV event names
        them."""
        for bid in seq.block_table[first:end]:
            self.blocks[bid].partial = True

    def _adopt(self, block: Block, ref: BlockRef) -> None:
        """Index ``block`` as holding ``ref``'s KV."""
        block.hash, block.parent_hash, block.token_ids = ref
        self._cached[ref.hash] = block.block_id
        self.cache_version += 1
        if self.events is not None and not block.partial:
            self.events.stored(DEVICE, [ref.hash], ref.parent_hash, ref.token_ids,
                               self.block_size)

    # -- the tiers below ---------------------------------------------------------------------------
    def flush_stores(self, limit: int | None = None) -> None:
        """Copy the blocks published since the last call into the tiers below, oldest first, at
        most ``limit`` of them (None: all). The engine calls it after each step's run with a
        limit while the step carried decodes (a prompt's KV arriving on a decode worker is
        hundreds of blocks: copied at once, they stalled every running stream's next token),
        and without one otherwise. A block still waiting when the pool reuses it is copied
        then (``_take_free``), so none is lost."""
        if not self._to_store:
            return
        n = len(self._to_store) if limit is None else min(limit, len(self._to_store))
        self._store([self._to_store.popitem(last=False) for _ in range(n)])

    def _store(self, blocks: list[tuple[int, BlockRef]]) -> None:
        assert self.tiers is not None
        self.tiers.store([(bid, ref) for bid, ref in blocks if self.blocks[bid].hash == ref.hash])

    def promote(self, seq: Sequence, max_tokens: int, reserve: int = 0) -> int | None:
        """Extend ``seq``'s cached prefix (after ``allocate_prefix``) with the blocks the host
        tier holds next, copied into fresh pool blocks, keeping ``reserve`` blocks free. When
        the next block is on disk, its load (and the rest of the run's) is started; returns the
        hash of the last of those loads while the next block's is in flight (the caller may
        wait for it, see ``KVTiers.is_loading``, rather than recompute), else None."""
        tiers = self.tiers
        if tiers is None:
            return None
        bs = self.block_size
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        first = len(seq.block_table)
        assert seq.num_computed_tokens == first * bs and len(hashes) == first
        root = hashes[-1] if hashes else seq.hash_root
        chain = self._chain(seq.token_ids, first, max_tokens // bs, root)
        room = max(0, self.num_free_blocks - reserve)
        slots: list[int] = []
        for ref in chain[:room]:
            slot = tiers.host_slot(ref)
            if slot is None:
                break
            slots.append(slot)
        k = len(slots)
        if k:
            for slot in slots:  # taking pool blocks may store deferred ones into the host tier:
                tiers.host_index.pin(slot)  # never over these
            bids = []
            for ref in chain[:k]:
                bid = self._take_free()  # referenced by seq from now on
                self._adopt(self.blocks[bid], ref)
                bids.append(bid)
            tiers.load(slots, bids)
            for slot in slots:
                tiers.host_index.unpin(slot)
            seq.block_table.extend(bids)
            hashes.extend(ref.hash for ref in chain[:k])
            seq.num_computed_tokens += k * bs
            self.num_cache_hits += k * bs
        rest = chain[k:]
        if not rest or k == room:
            return None
        tiers.prefetch(rest)
        if not tiers.is_loading(rest[0].hash):
            return None
        # The last of the run's loads in flight, not the first: the loads finish in order, and
        # a request admitted again as each one lands re-matched its whole prompt and freed its
        # blocks every step in between (an 8192-token prefix on disk: ~17 such steps, ~3x the
        # wait for eight requests sharing it as for one; bench/engine/tier_load.py's convoy).
        return next(r.hash for r in reversed(rest) if tiers.is_loading(r.hash))

    def prefetch(self, seq: Sequence) -> None:
        """Start loading from disk the prompt blocks of ``seq`` (block-less, just arrived) that
        neither the pool nor the host tier holds, ahead of its admission."""
        tiers = self.tiers
        if tiers is None or tiers.disk_index is None:
            return
        chain = self._chain(seq.token_ids, 0, (seq.num_prompt_tokens - 1) // self.block_size,
                            seq.hash_root)
        refs = [r for r in chain if r.hash not in self._cached]
        if refs:
            tiers.prefetch(refs)

    def _chain(self, token_ids: Seq[int], first: int, last: int, root: int) -> list[BlockRef]:
        """Refs of full blocks ``first`` to ``last - 1`` of ``token_ids``, chained on ``root``
        (the hash of block ``first - 1``)."""
        bs = self.block_size
        if last <= first:
            return []
        ids = token_ids[first * bs:last * bs]
        hashes = block_hashes(ids, bs, root)
        parents = [root, *hashes[:-1]]
        return [BlockRef(h, p, tuple(ids[i * bs:(i + 1) * bs]))
                for i, (h, p) in enumerate(zip(hashes, parents, strict=True))]

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1
