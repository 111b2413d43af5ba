"""Writes between engines with several ranks on a side; staging where the head splits differ.

Every rank writes from its own agent (``PeerInfo.rank_agents``): the head runs its transport
ranks hold, to the agents of the peer's ranks that receive them, one transfer per such agent.

Equal splits (P=N -> D=N, or KV head groups that make them so) go rank to rank as whole blocks
(``Stager.per_agent``, which reads of a prefix pull take too).

Across TP sizes a receiving rank's block holds heads that sit, on the sender, in another layout
(P=1 -> D=2: half of each token's heads; P=2 -> D=1: each token's heads from two ranks). Written
in place, that is one descriptor per token of every head run, and UCX's per-descriptor cost
(~2.7 us each over CMA here) made such writes 6-7x slower than rank to rank. The sender instead
packs, with one local copy per run, the bytes of every receiving rank's blocks exactly as that
rank lays them out into a registered staging buffer, and writes whole blocks from there: one
descriptor per (receiving rank, layer, K|V, block), as between equal splits. The receiver is
unchanged. Staging needs every head of the receiving blocks on the writing process, so it is
for a sender of one process (P=1 -> D=N); a sender of several ranks writing a split that is not
theirs (P=2 -> D=1 without head groups) goes token by token, as does a write whose staging does
not fit in the free space, so nothing waits for staging. Heads first (``--kv-layout heads``, the
CUDA default) there is nothing to stage: a run of heads is one region per block on both sides,
one descriptor each (``descriptors.split_descs``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvrelay.kv_transfer.descriptors import (
    plane_block_indices,
    rank_region_descs,
    split_descs,
    uniform_descs,
)
from kvrelay.kv_transfer.layout import HeadRun, KVLayout
from kvrelay.kv_transfer.transport_types import PeerAgent, PreparedPeer, mem_type

logger = logging.getLogger(__name__)


class StagingArea:
    """A byte range allocator over one tensor (first fit; writes finish roughly in order)."""

    def __init__(self, nbytes: int, dtype: torch.dtype):
        esz = torch.empty((), dtype=dtype).element_size()
        self.esz = esz
        self.buf = torch.empty(max(1, nbytes // esz), dtype=dtype)
        self.nbytes = self.buf.numel() * esz
        self._used: dict[int, int] = {}  # offset -> bytes

    def alloc(self, nbytes: int, align: int = 1) -> int | None:
        """A byte offset (a multiple of ``align``, itself a multiple of the element size) of
        ``nbytes`` free bytes, or None if none fit."""
        nbytes = -(-nbytes // self.esz) * self.esz
        at = 0
        for off in sorted(self._used):
            at = -(-at // align) * align
            if off - at >= nbytes:
                break
            at = max(at, off + self._used[off])
        at = -(-at // align) * align
        if at + nbytes > self.nbytes:
            return None
        self._used[at] = nbytes
        return at

    def free(self, offset: int) -> None:
        self._used.pop(offset, None)

    @property
    def in_use(self) -> int:
        return sum(self._used.values())


def needs_staging(local: KVLayout, remote: KVLayout, runs: Sequence[HeadRun]) -> bool:
    """True unless every run moves whole blocks (equal splits: rank to rank)."""
    return not all(r.count == local.num_kv_heads == remote.num_kv_heads for r in runs)


def repack_note(local: KVLayout, remote: KVLayout, runs: Sequence[HeadRun] | None) -> str:
    """Empty where writes to ``remote`` move whole blocks; else a note for the log saying they
    repack and, where one side's split is a multiple of the other's, the KV head groups on the
    other side that would spare it."""
    if runs is None or not needs_staging(local, remote, runs) or local.heads_first:
        return ""
    note = (f"; our KV heads are split {local.tp_size} way(s), its {remote.tp_size}: every "
            f"write repacks each token's heads first")
    lo, hi = sorted((local.tp_size, remote.tp_size))
    if hi % lo == 0:
        note += (f" (--kv-head-groups {hi // lo} on the side split {lo} way(s) makes them "
                 f"whole-block writes)")
    return note


def staged_bytes(remote: KVLayout, planes: int, blocks: int) -> int:
    return remote.tp_size * planes * blocks * remote.block_bytes


def stage(area: StagingArea, offset: int, rank_kvs: Mapping[int, torch.Tensor], local: KVLayout,
          remote: KVLayout, runs: Sequence[HeadRun], planes: Sequence[int],
          local_block_ids: Sequence[int]) -> None:
    """Copy the blocks of every receiving rank, as it lays them out, to ``offset``: receiving
    rank ``d``'s (plane, block) ``i`` at row ``d * len(planes) * len(blocks) + i``. Runs of
    consecutive (plane, block) rows are copied as slices (a sequence's blocks mostly are);
    scattered ones through an index."""
    bs, hd, n = local.block_size, local.head_dim, len(planes) * len(local_block_ids)
    heads_r = remote.num_kv_heads
    start = offset // area.esz
    view = area.buf[start:start + remote.tp_size * n * bs * heads_r * hd].view(
        remote.tp_size, n, bs, heads_r, hd)
    idx = np.asarray(plane_block_indices(planes, local_block_ids, local.num_blocks),
                     dtype=np.int64)
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    segments = list(zip(np.concatenate(([0], cuts)).tolist(),
                        np.concatenate((cuts, [idx.size])).tolist(), strict=True))
    index = torch.from_numpy(idx) if len(segments) > _MAX_SEGMENTS else None
    for run in runs:
        src = rank_kvs[run.src].view(-1, bs, local.num_kv_heads, hd)
        src = src[:, :, run.src_head:run.src_head + run.count]
        dst = view[run.dst, :, :, run.dst_head:run.dst_head + run.count]
        if index is None:
            for a, b in segments:
                first = int(idx[a])
                dst[a:b].copy_(src[first:first + b - a])
        elif run.count == heads_r:  # all of the receiving rank's heads: straight in
            torch.index_select(src, 0, index, out=view[run.dst])
        else:
            dst.copy_(torch.index_select(src, 0, index))


_MAX_SEGMENTS = 64  # more scattered than this: one indexed copy beats a loop of slices


def staged_rows(offset: int, remote: KVLayout, agent: PeerAgent, planes: Sequence[int],
                remote_block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of a staged write's blocks for one of the peer's agents, paired in
    :func:`stage`'s order: into the staging buffer's descriptor list (rows of one receiving
    block, from 0) and into ``agent``'s list of its ranks' (layer, K|V, block) regions."""
    per_rank = remote.num_layers * remote.planes * remote.num_blocks
    ridx = np.asarray(plane_block_indices(planes, remote_block_ids, remote.num_blocks),
                      dtype=np.int64)
    n = ridx.size
    slots = np.asarray(agent.slots, dtype=np.int64)[:, None]
    dst = (np.arange(len(agent.slots), dtype=np.int64)[:, None] * per_rank
           + ridx[None, :]).ravel()
    src = (offset // remote.block_bytes + slots * n + np.arange(n)[None, :]).ravel()
    return src.astype(np.int32), dst.astype(np.int32)


class Stager:
    """The staging buffer of one NIXL agent: allocated and registered on the first staged
    write, one descriptor list per receiving block size (peers of different TP sizes have
    different blocks), a slice per write in flight. Called under the transport's lock."""

    def __init__(self, agent: Any, nbytes: int, dtype: torch.dtype, device_id: int, mem: str):
        self._agent, self._nbytes, self._dtype = agent, nbytes, dtype
        self._device_id, self._mem = device_id, mem
        self.area: StagingArea | None = None
        self._reg: object | None = None
        self._dlists: dict[int, object] = {}
        self._local_ranks: object | None = None  # every local rank's regions (rank to rank)

    def prep_agent(self, info: Any, name: str, slots: Sequence[int],
                   device_id: int) -> object:
        """Agent ``name``'s transport ranks' (layer, K|V, block) regions, rank after rank, as
        one prepared list (what rank-to-rank and staged writes to it address)."""
        rows = rank_region_descs([info.rank_addresses[s] for s in slots], info.layout, device_id)
        return self._agent.prep_xfer_dlist(name, rows, mem_type(info.layout.device_kind))

    def write(self, p: PreparedPeer, slot_kvs: Mapping[int, torch.Tensor], local: KVLayout,
              planes: Sequence[int], local_block_ids: Sequence[int],
              remote_block_ids: Sequence[int]) -> tuple[list[object], int, int | None]:
        """A write to a peer with several ranks on a side, of the head runs our transport ranks
        (``slot_kvs``) hold: rank to rank where the splits are equal; else staged and sent as
        whole blocks when we hold every head and the buffer has room, else one descriptor per
        run per block (heads first) or per token. Returns the transfers (one per peer agent),
        their bytes and the staging offset (None: not staged) to free once they are done."""
        assert p.runs is not None and p.agents is not None
        info = p.info
        offset = None
        if needs_staging(local, info.layout, p.runs) and len(slot_kvs) == local.tp_size \
                and not local.heads_first:  # every head is ours: stage
            offset = self.pack(slot_kvs, local, info.layout, p.runs, planes, local_block_ids)
        if offset is None:
            xfers, nbytes = self.per_agent("WRITE", p, p.runs, slot_kvs, local, planes,
                                           local_block_ids, remote_block_ids)
            return xfers, nbytes, None
        xfers: list[object] = []
        try:
            for agent in p.agents.values():
                xfers.append(self.xfer(offset, info.layout, agent, planes, remote_block_ids))
        except BaseException:
            self.free(offset)
            for x in xfers:
                self._agent.release_xfer_handle(x)
            raise
        return xfers, staged_bytes(info.layout, len(planes), len(remote_block_ids)), offset

    def read(self, p: PreparedPeer, slot_kvs: Mapping[int, torch.Tensor], local: KVLayout,
             planes: Sequence[int], local_block_ids: Sequence[int],
             remote_block_ids: Sequence[int]) -> tuple[list[object], int]:
        """A read (prefix pull) into our transport ranks (``slot_kvs``) of the heads they hold,
        from the peer's ranks holding them, one transfer per peer agent (``per_agent``).
        Nothing is staged (the reader would have to unpack)."""
        assert p.read_runs is not None
        return self.per_agent("READ", p, p.read_runs, slot_kvs, local, planes, local_block_ids,
                              remote_block_ids)

    def per_agent(self, op: str, p: PreparedPeer, runs: Sequence[HeadRun],
                  slot_kvs: Mapping[int, torch.Tensor], local: KVLayout, planes: Sequence[int],
                  local_block_ids: Sequence[int],
                  remote_block_ids: Sequence[int]) -> tuple[list[object], int]:
        """``op`` ("WRITE": ``runs`` from our transport ranks to the peer's; "READ": from the
        peer's to ours) as one transfer per peer agent holding the peer's end of a run. Where
        every run is a whole block on both sides (equal splits) they go through prepared lists
        of our ranks' and the agent's ranks' regions: regions adjacent on both sides (a
        sequence's consecutive blocks) go as one copy, NIXL merging them, where per-transfer
        descriptors (``initialize_xfer``) cost ~3-4 us of CMA set-up each (P=2 -> D=2 ran at
        half the rate of P=1 -> D=1 that way, measured on a 2-vCPU Zen 4). Otherwise one
        descriptor per run per block (heads first) or per token (``split_descs``). Returns the
        transfers and their bytes."""
        assert p.agents is not None
        info, remote = p.info, p.info.layout
        read = op == "READ"

        def ours(r: HeadRun) -> int:
            return r.dst if read else r.src

        def theirs(r: HeadRun) -> int:
            return r.src if read else r.dst

        whole = all(r.count == local.num_kv_heads == remote.num_kv_heads for r in runs)
        own = tuple(slot_kvs)
        if whole and self._local_ranks is None:
            rows = rank_region_descs([t.data_ptr() for t in slot_kvs.values()], local,
                                     self._device_id)
            self._local_ranks = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem)
        per_l, per_r = (x.num_layers * x.planes * x.num_blocks for x in (local, remote))
        li = np.asarray(plane_block_indices(planes, local_block_ids, local.num_blocks))
        ri = np.asarray(plane_block_indices(planes, remote_block_ids, remote.num_blocks))
        addrs = {slot: t.data_ptr() for slot, t in slot_kvs.items()}
        xfers, nbytes = [], 0
        for agent in p.agents.values():
            mine = [r for r in runs if theirs(r) in agent.slots]
            if not mine:  # an agent we only read from, or only write to
                continue
            if whole:
                lrows = np.concatenate([own.index(ours(r)) * per_l + li for r in mine])
                rrows = np.concatenate([agent.row(theirs(r), per_r) + ri for r in mine])
                xfers.append(self._agent.make_prepped_xfer(
                    op, self._local_ranks, lrows.astype(np.int32), agent.dlist,
                    rrows.astype(np.int32)))
                nbytes += len(lrows) * local.block_bytes
                continue
            if read:  # the peer is the source: its rows from its layout, ours from ours
                their_rows, our_rows = split_descs(
                    remote, info.rank_addresses, local, addrs, mine, planes, remote_block_ids,
                    local_block_ids, agent.device_id, self._device_id)
            else:
                our_rows, their_rows = split_descs(
                    local, addrs, remote, info.rank_addresses, mine, planes, local_block_ids,
                    remote_block_ids, self._device_id, agent.device_id)
            xfers.append(self._agent.initialize_xfer(
                op, self._agent.get_xfer_descs(our_rows, self._mem),
                self._agent.get_xfer_descs(their_rows, mem_type(remote.device_kind)),
                agent.name))
            nbytes += int(our_rows[:, 1].sum())
        return xfers, nbytes

    def pack(self, slot_kvs: Mapping[int, torch.Tensor], local: KVLayout, remote: KVLayout,
             runs: Sequence[HeadRun], planes: Sequence[int],
             local_block_ids: Sequence[int]) -> int | None:
        """Stage a write's blocks; the offset, or None when the buffer has no room (the write
        then goes token by token)."""
        if self.area is None:
            self.area = StagingArea(self._nbytes, self._dtype)
            self._reg = self._agent.register_memory(self.area.buf)
        offset = self.area.alloc(staged_bytes(remote, len(planes), len(local_block_ids)),
                                 align=remote.block_bytes)
        if offset is None:
            logger.debug("KV staging full (%d of %d B in use): a write goes token by token",
                         self.area.in_use, self.area.nbytes)
            return None
        stage(self.area, offset, slot_kvs, local, remote, runs, planes, local_block_ids)
        return offset

    def xfer(self, offset: int, remote: KVLayout, agent: PeerAgent, planes: Sequence[int],
             remote_block_ids: Sequence[int]) -> object:
        """The prepared WRITE of a staged write's whole blocks to one peer agent."""
        src, dst = staged_rows(offset, remote, agent, planes, remote_block_ids)
        dl = self._dlists.get(remote.block_bytes)
        if dl is None:
            assert self.area is not None
            dl = self._dlists[remote.block_bytes] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", uniform_descs(self.area.buf.data_ptr(),
                                                 self.area.nbytes // remote.block_bytes,
                                                 remote.block_bytes, self._device_id),
                self._mem)
        return self._agent.make_prepped_xfer("WRITE", dl, src, agent.dlist, dst)

    def free(self, offset: int) -> None:
        if self.area is not None:
            self.area.free(offset)

    def close(self) -> None:
        for dl in [*self._dlists.values(), self._local_ranks]:
            if dl is not None:
                dl.release()  # type: ignore[attr-defined]
        self._dlists.clear()
        self._local_ranks = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
