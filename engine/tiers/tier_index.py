"""Which block each slot of one tier holds, and which slot goes next.

A tier has a fixed number of slots, each one block across every layer. A slot is *free*, or
holds one block identified like a prefix-cache block (its chained hash, its parent's hash and
its token ids, compared on lookup so a hash collision cannot serve wrong KV). A held slot is
*ready* once its bytes are complete (a store or a load into it has finished) and may be *pinned*
while something reads it (a spill to the tier below, a load into the pool): an eviction never
takes a pinned or not-ready slot. Ready, unpinned slots are evicted least recently used first.

Pure bookkeeping (no tensors, no threads): the engine thread alone calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class SlotEntry:
    hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    ready: bool = False
    pins: int = 0

    def matches(self, parent_hash: int, token_ids: tuple[int, ...]) -> bool:
        return self.ready and self.parent_hash == parent_hash and self.token_ids == token_ids


class TierIndex:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._entries: dict[int, SlotEntry] = {}  # slot -> entry
        self._by_hash: dict[int, int] = {}  # hash -> slot
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready slots, least recent first
        self.version = 0  # bumped when a hash becomes ready or leaves (routing snapshots)
        self._snapshot: tuple[int, frozenset[int]] = (0, frozenset())

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._entries)

    def slot_of(self, block_hash: int) -> int | None:
        """The slot holding ``block_hash`` (ready or not)."""
        return self._by_hash.get(block_hash)

    def entry(self, slot: int) -> SlotEntry:
        return self._entries[slot]

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The ready slot holding exactly this block, or None."""
        slot = self._by_hash.get(block_hash)
        if slot is None or not self._entries[slot].matches(parent_hash, token_ids):
            return None
        return slot

    def hash_set(self) -> frozenset[int]:
        """Hashes of the ready slots; the same object while unchanged."""
        version, snap = self._snapshot
        if version != self.version:
            snap = frozenset(h for h, s in self._by_hash.items() if self._entries[s].ready)
            self._snapshot = (self.version, snap)
        return snap

    # -- changes -------------------------------------------------------------------------------
    def can_take(self) -> bool:
        return bool(self._free) or self._victim() is not None

    def take(self, block_hash: int, parent_hash: int,
             token_ids: tuple[int, ...]) -> tuple[int, SlotEntry | None] | None:
        """A slot for a new block (not ready until ``mark_ready``): a free one, else the least
        recently used ready, unpinned one, whose entry is returned as the second item (evicted;
        its bytes stay in the slot until the caller overwrites them). None when every slot is
        busy."""
        assert block_hash not in self._by_hash, "block already held in this tier"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._victim()
            if slot is None:
                return None
            evicted = self._forget(slot)
        self._entries[slot] = SlotEntry(block_hash, parent_hash, token_ids)
        self._by_hash[block_hash] = slot
        return slot, evicted

    def adopt(self, slot: int, block_hash: int, parent_hash: int,
              token_ids: tuple[int, ...]) -> None:
        """Hold a block that is already complete in the free slot ``slot`` (a disk tier's file
        kept from an earlier process), ready."""
        assert block_hash not in self._by_hash, "block already held in this tier"
        self._free.remove(slot)
        self._entries[slot] = SlotEntry(block_hash, parent_hash, token_ids)
        self._by_hash[block_hash] = slot
        self.mark_ready(slot)

    def mark_ready(self, slot: int) -> None:
        e = self._entries[slot]
        e.ready = True
        self._lru[slot] = None
        self.version += 1

    def touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        self._entries[slot].pins += 1

    def unpin(self, slot: int) -> None:
        e = self._entries[slot]
        assert e.pins > 0, f"unpin of unpinned slot {slot}"
        e.pins -= 1

    def drop(self, slot: int) -> SlotEntry:
        """Free ``slot`` now (a failed store or load, or a block moved elsewhere)."""
        e = self._forget(slot)
        self._free.append(slot)
        return e

    # -- internals -----------------------------------------------------------------------------
    def _victim(self) -> int | None:
        for slot in self._lru:
            if self._entries[slot].pins == 0:
                return slot
        return None

    def _forget(self, slot: int) -> SlotEntry:
        e = self._entries.pop(slot)
        del self._by_hash[e.hash]
        if self._lru.pop(slot, 0) is None:  # was ready: a routable hash leaves
            self.version += 1
        return e
