"""The host and disk tiers of one engine: where blocks go when they leave the KV pool, and how
they come back.

**Stores are write-through**: a block is copied into the host tier once, when its KV is
complete (the block manager publishes it), in one batched copy per step after the step's model
run (``store``), so that when the pool later reuses the block nothing has to be saved on the
allocation (miss) path: eviction from the pool is only a change of tier. On a GPU the copy is
issued on a side stream into pinned memory and completes while the next step computes; on a
CPU worker (the pool is DRAM too) it is a memcpy on the engine thread, ~0.1 ms for a 150M
model's block, measured in bench/results/kv_tiers.txt.

**The host tier evicts least recently used**, and with a disk tier it *spills* instead: every
block it stores is written to disk behind it by the IO thread (from the pinned slot, in the
order stored), so evicting one costs nothing; a victim not on disk yet has its bytes copied to
a staging buffer at once (so the slot can be reused) and written from there. **Loads** from
disk run on the IO thread too, ahead of spills, started as soon as a request arrives
(``prefetch``), into a host slot that is ready only after the record verified; **promotion**
host → pool is a copy on the engine thread when the request is admitted.

Every entry carries its block's chain hash, parent hash and token ids; a lookup compares all
three, and a disk read verifies the record's layout fingerprint and CRCs, so only KV that is
exactly this request's prefix, complete, is ever served: anything else is a miss, counted, and
the request recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from kvrelay.engine.kv_events import KVEventSink
from kvrelay.engine.tiers.disk_files import DiskFiles, DiskReadError
from kvrelay.engine.tiers.media import DISK, HOST, TierStats
from kvrelay.engine.tiers.tier_index import SlotEntry, TierIndex
from kvrelay.engine.tiers.tier_io import TierIO

logger = logging.getLogger(__name__)

# With a disk tier, every block the host tier stores is also written to disk, in the order
# stored, by the IO thread from the pinned host slot (write-through again, in the background), so
# that evicting from the host tier is usually free: one prefill step can store hundreds of
# blocks, and each victim would otherwise have to be copied aside at once to be spilled. At most
# this many writes are in flight (each pins its host slot).
MAX_SPILLS_IN_FLIGHT = 256
# Victims not yet on disk are copied to a staging buffer and written from there, up to this many
# bytes in flight; beyond it a victim is dropped, so a slow disk cannot grow memory unbounded.
MAX_STAGED_BYTES = 64 * 2**20


class BlockRef(NamedTuple):
    """A block by its identity in the prefix cache."""

    hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierConfig:
    host_slots: int
    disk_dir: str | None = None
    disk_slots: int = 0
    keep_disk: bool = False  # the disk tier's file outlives the process (``DiskFiles``)


class KVTiers:
    def __init__(self, kv: torch.Tensor, block_size: int, config: TierConfig,
                 fingerprint: bytes, events: KVEventSink | None = None,
                 pages_of: Callable[[int], Sequence[int]] | None = None,
                 pages_per_block: int = 1):
        self.kv = kv
        self.block_size = block_size
        self.events = events
        # One slot: one block of every layer, K and V (every head group): the pool tensor's
        # block dimension is -4 ([..., num_blocks, block_size, kv_heads, head_dim]). Under the
        # hybrid KV layout (engine/hybrid_kv.py) a block is a page per layer group: ``pages_of``
        # names them, and a slot holds them in group order.
        self.pages_of = pages_of
        self.pages_per_block = pages_per_block
        slot_shape = kv.select(-4, 0).shape
        if pages_of is not None:
            slot_shape = (pages_per_block, *slot_shape)
        self.cuda = kv.device.type == "cuda"
        # Not zero-filled: a slot is read only once a store or a load has written it, so the
        # tier's memory is committed as it fills, not all at start.
        self.host = torch.empty((config.host_slots, *slot_shape), dtype=kv.dtype,
                                pin_memory=self.cuda)
        self.slot_bytes = self.host[0].numel() * self.host.element_size()
        self.host_index = TierIndex(config.host_slots)
        self.stats = {HOST: TierStats(HOST, config.host_slots)}
        self.disk: DiskFiles | None = None
        self.disk_index: TierIndex | None = None
        self.io: TierIO | None = None
        if config.disk_dir is not None:
            if config.disk_slots < 1:
                raise ValueError("a disk tier needs room for at least one block")
            self.disk = DiskFiles(config.disk_dir, fingerprint, slots=config.disk_slots,
                                  payload_bytes=self.slot_bytes, max_tokens=block_size,
                                  keep=config.keep_disk)
            self.disk_index = TierIndex(config.disk_slots)
            self.stats[DISK] = TierStats(DISK, config.disk_slots)
            self.io = TierIO()
            self._adopt_disk_files()
        self._staged_spills = 0
        self._max_staged = max(8, MAX_STAGED_BYTES // self.slot_bytes)
        self._spilling: set[int] = set()  # host slots being written ahead to disk (pinned)
        self._to_spill: deque[tuple[int, int]] = deque()  # (host slot, hash) not yet on disk
        self._loading: dict[int, int] = {}  # hash -> host slot being loaded from disk
        # CUDA: host slots whose store is still copying, with the event that ends it.
        self._cuda_stores: list[tuple[torch.cuda.Event, list[int]]] = []
        self._side = torch.cuda.Stream(kv.device) if self.cuda else None

    def _adopt_disk_files(self) -> None:
        """Index the blocks an earlier process left in the disk tier (``keep_disk``): each
        ready at its own slot, as if this process had spilled it (a second copy of a block is
        blanked). Their payloads are checked when loaded, as every disk read is."""
        assert self.disk is not None and self.disk_index is not None
        adopted = 0
        for slot, h, parent, tokens in self.disk.found:
            if slot < self.disk_index.num_slots and self.disk_index.slot_of(h) is None:
                self.disk_index.adopt(slot, h, parent, tokens)
                adopted += 1
            else:
                self.disk.remove(slot)
        if adopted:
            logger.info("disk tier: %d blocks kept from an earlier run", adopted)

    # -- queries -------------------------------------------------------------------------------
    def hash_sets(self) -> dict[str, frozenset[int]]:
        out = {HOST: self.host_index.hash_set()}
        if self.disk_index is not None:
            out[DISK] = self.disk_index.hash_set()
        return out

    def counters(self) -> dict[str, TierStats]:
        self.stats[HOST].used_blocks = self.host_index.num_used
        if self.disk_index is not None:
            self.stats[DISK].used_blocks = self.disk_index.num_used
        return {k: TierStats(**vars(v)) for k, v in self.stats.items()}

    def host_slot(self, ref: BlockRef) -> int | None:
        """The ready host slot holding ``ref``."""
        return self.host_index.lookup(ref.hash, ref.parent_hash, ref.token_ids)

    def is_loading(self, block_hash: int) -> bool:
        return block_hash in self._loading

    def on_disk(self, ref: BlockRef) -> bool:
        return self.disk_index is not None and self.disk_index.lookup(
            ref.hash, ref.parent_hash, ref.token_ids) is not None

    def _pages(self, bid: int) -> Sequence[int]:
        """The pool pages of block ``bid`` (itself, but under the hybrid KV layout)."""
        return (bid,) if self.pages_of is None else self.pages_of(bid)

    def _slot_parts(self, slot: int) -> Sequence[torch.Tensor]:
        """Host slot ``slot`` as one view per page of a block."""
        return (self.host[slot],) if self.pages_of is None else self.host[slot].unbind(0)

    # -- pool -> host ----------------------------------------------------------------------------
    def store(self, blocks: Sequence[tuple[int, BlockRef]]) -> None:
        """Copy newly published pool blocks ``(block id, ref)`` into the host tier (a block it
        holds already is only marked recently used)."""
        bids: list[int] = []
        slots: list[int] = []
        refs: list[BlockRef] = []
        for bid, ref in blocks:
            held = self.host_index.slot_of(ref.hash)
            if held is not None:
                self.host_index.touch(held)
                continue
            slot = self._take_host(ref)
            if slot is None:
                continue  # every host slot busy (loads in flight): this block is not kept
            bids.append(bid)
            slots.append(slot)
            refs.append(ref)
        if not bids:
            return
        if self.cuda:
            assert self._side is not None
            src = torch.tensor([p for b in bids for p in self._pages(b)], device=self.kv.device)
            dst = torch.tensor(slots)
            self._side.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(self._side):
                staged = self.kv.index_select(-4, src).movedim(-4, 0)
                staged = staged.reshape(len(slots), *self.host.shape[1:])
                self.host.index_copy_(0, dst, staged.to("cpu", non_blocking=True))
                ev = torch.cuda.Event()
                ev.record(self._side)
            self._cuda_stores.append((ev, slots))
        else:  # one strided copy per block, no staging, on this thread alone
            with _one_thread():
                for bid, slot in zip(bids, slots, strict=True):
                    for part, page in zip(self._slot_parts(slot), self._pages(bid),
                                          strict=True):
                        part.copy_(self.kv.select(-4, page))
            for slot in slots:
                self._host_ready(slot)
        st = self.stats[HOST]
        st.stored_blocks += len(slots)
        st.stored_bytes += len(slots) * self.slot_bytes
        self._spill_ahead()

    # -- host -> pool ----------------------------------------------------------------------------
    def load(self, slots: Sequence[int], bids: Sequence[int]) -> None:
        """Copy ready host slots into pool blocks (promotion for a prefix hit)."""
        t0 = time.perf_counter()
        with contextlib.nullcontext() if self.cuda else _one_thread():
            for slot, bid in zip(slots, bids, strict=True):
                # On a GPU: from pinned memory, ordered before the step that reads it.
                for part, page in zip(self._slot_parts(slot), self._pages(bid), strict=True):
                    self.kv.select(-4, page).copy_(part, non_blocking=self.cuda)
        for slot in slots:
            self.host_index.touch(slot)
        st = self.stats[HOST]
        st.hit_blocks += len(slots)
        st.loaded_bytes += len(slots) * self.slot_bytes
        st.load_seconds += time.perf_counter() - t0

    # -- disk -> host ----------------------------------------------------------------------------
    def prefetch(self, refs: Sequence[BlockRef]) -> int:
        """Start loading those of ``refs`` that are on disk (and neither in the host tier nor
        loading) into host slots; returns how many loads it started."""
        if self.disk_index is None or self.io is None or self.disk is None:
            return 0
        started = 0
        for ref in refs:
            if ref.hash in self._loading or self.host_index.slot_of(ref.hash) is not None:
                continue
            dslot = self.disk_index.lookup(ref.hash, ref.parent_hash, ref.token_ids)
            if dslot is None:
                continue
            hslot = self._take_host(ref)
            if hslot is None:
                break
            self.disk_index.pin(dslot)
            self._loading[ref.hash] = hslot
            self.io.submit(("load", ref, hslot, dslot),
                           partial(_timed, self.disk.read, dslot, ref, self.host[hslot]),
                           urgent=True)
            started += 1
        return started

    # -- completions -----------------------------------------------------------------------------
    def poll(self) -> None:
        """Apply finished IO and CUDA copies (the engine thread, at each step's start)."""
        while self._cuda_stores and self._cuda_stores[0][0].query():
            _, slots = self._cuda_stores.pop(0)
            for slot in slots:
                self._host_ready(slot)
        if self.io is not None:
            for r in self.io.poll():
                self._apply(r.tag, r.value, r.error)
            self._spill_ahead()

    def drain(self) -> None:
        """Wait for every copy and IO job in flight, then apply them (tests, shutdown)."""
        if self.cuda:
            torch.cuda.synchronize(self.kv.device)
        self.poll()
        if self.io is not None:
            for r in self.io.drain():
                self._apply(r.tag, r.value, r.error)

    def close(self) -> None:
        if self.io is not None:
            self.drain()
            self.io.close()
            self.io = None
        if self.disk is not None:
            self.disk.close()

    # -- internals -------------------------------------------------------------------------------
    def _take_host(self, ref: BlockRef) -> int | None:
        taken = self.host_index.take(ref.hash, ref.parent_hash, ref.token_ids)
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None:
            self._evicted_from_host(slot, evicted)
        return slot

    def _host_ready(self, slot: int) -> None:
        self.host_index.mark_ready(slot)
        if self.disk_index is not None:
            self._to_spill.append((slot, self.host_index.entry(slot).hash))
        if self.events is not None:
            e = self.host_index.entry(slot)
            self.events.stored(HOST, [e.hash], e.parent_hash, e.token_ids, self.block_size)

    def _spill_ahead(self) -> None:
        """Start writing the blocks the host tier stored, in the order stored, to disk from
        their slots (pinned until written), up to ``MAX_SPILLS_IN_FLIGHT`` at a time; O(1) a
        block."""
        if self.disk_index is None or self.disk is None or self.io is None:
            return
        index, disk = self.host_index, self.disk_index
        while self._to_spill and len(self._spilling) < MAX_SPILLS_IN_FLIGHT:
            slot, h = self._to_spill.popleft()
            if index.slot_of(h) != slot or slot in self._spilling or disk.slot_of(h) is not None:
                continue  # evicted since (staged, or dropped), or on disk already
            e = index.entry(slot)
            dslot = self._take_disk(e)
            if dslot is None:
                return
            index.pin(slot)
            self._spilling.add(slot)
            ref = BlockRef(e.hash, e.parent_hash, e.token_ids)
            self.io.submit(("spill", ref, dslot, slot),
                           partial(_timed, self.disk.write, dslot, ref, self.host[slot]))

    def _take_disk(self, e: SlotEntry) -> int | None:
        assert self.disk_index is not None
        taken = self.disk_index.take(e.hash, e.parent_hash, e.token_ids)
        if taken is None:
            return None
        dslot, dropped = taken
        if dropped is not None:
            self.stats[DISK].evicted_blocks += 1
            if self.events is not None:
                self.events.removed(DISK, [dropped.hash])
        return dslot

    def _evicted_from_host(self, slot: int, e: SlotEntry) -> None:
        """``slot``'s block leaves the host tier: spilled to disk when there is one (its bytes
        staged now, written by the IO thread), else dropped."""
        self.stats[HOST].evicted_blocks += 1
        if self.events is not None:
            self.events.removed(HOST, [e.hash])
        if self.disk_index is None or self.disk is None or self.io is None:
            return
        held = self.disk_index.slot_of(e.hash)
        if held is not None:  # the disk tier has it already (it was loaded from there)
            self.disk_index.touch(held)
            return
        if self._staged_spills >= self._max_staged:
            return  # the disk is behind: drop this one rather than stage without bound
        dslot = self._take_disk(e)
        if dslot is None:
            return
        self._staged_spills += 1
        ref = BlockRef(e.hash, e.parent_hash, e.token_ids)
        self.io.submit(("spill", ref, dslot, None),
                       partial(_timed, self.disk.write, dslot, ref, self.host[slot].clone()))

    def _apply(self, tag: tuple, value: tuple[int, float] | None,
               error: BaseException | None) -> None:
        kind = tag[0]
        assert self.disk_index is not None
        st = self.stats[DISK]
        if kind == "spill":
            _, ref, dslot, hslot = tag
            if hslot is None:  # written from a staging copy
                self._staged_spills -= 1
            else:  # written ahead from its host slot
                self._spilling.discard(hslot)
                self.host_index.unpin(hslot)
            if error is not None or value is None:
                self.disk_index.drop(dslot)
                return
            self.disk_index.mark_ready(dslot)
            st.stored_blocks += 1
            st.stored_bytes += value[0]
            if self.events is not None:
                self.events.stored(DISK, [ref.hash], ref.parent_hash, ref.token_ids,
                                   self.block_size)
        elif kind == "load":
            _, ref, hslot, dslot = tag
            del self._loading[ref.hash]
            self.disk_index.unpin(dslot)
            if error is not None or value is None:
                st.load_failures += 1
                if isinstance(error, DiskReadError):
                    logger.warning("disk tier block %016x unusable (%s): recomputing it",
                                   ref.hash, error)
                self.host_index.drop(hslot)
                self.disk_index.drop(dslot)
                if self.events is not None:
                    self.events.removed(DISK, [ref.hash])
                return
            st.hit_blocks += 1
            st.loaded_bytes += value[0]
            st.load_seconds += value[1]
            self._host_ready(hslot)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block copies inside on the calling thread alone. A block is a few hundred KiB:
    split over the intra-op threads, each copy opens a parallel region, and on a host whose cores
    are busy one late thread stalls every region (measured on the ~150M model on a shared 2-core
    host: 2.5 ms a block instead of 0.05 ms)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _timed(io: Callable[[int, int, int, tuple[int, ...], torch.Tensor], int], slot: int,
           ref: BlockRef, buf: torch.Tensor) -> tuple[int, float]:
    """Run one disk read or write of ``ref``'s block; returns (bytes, seconds)."""
    t0 = time.perf_counter()
    n = io(slot, ref.hash, ref.parent_hash, ref.token_ids, buf)
    return n, time.perf_counter() - t0
