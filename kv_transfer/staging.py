"""Writes between engines with several ranks on a side; staging where the head splits differ.

Equal splits (P=N -> D=N) go rank to rank as whole blocks (``Stager.rank_to_rank``).

Across TP sizes a receiving rank's block holds heads that sit, on the sender, in another layout
(P=1 -> D=2: half of each token's heads; P=2 -> D=1: each token's heads from two ranks). Written
in place, that is one descriptor per token of every head run, and UCX's per-descriptor cost
(~2.7 us each over CMA here) made such writes 6-7x slower than rank to rank. The sender instead
packs, with one local copy per run, the bytes of every receiving rank's blocks exactly as that
rank lays them out into a registered staging buffer, and writes whole blocks from there: one
descriptor per (receiving rank, layer, K|V, block), as between equal splits. The receiver is
unchanged. A write whose staging does not fit in the free space falls back to per-token
descriptors, so nothing waits for staging.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
from kvrelay.kv_transfer.transport_types import PreparedPeer, mem_type

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
    if runs is None or not needs_staging(local, remote, runs):
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


def stage(area: StagingArea, offset: int, rank_kvs: Sequence[torch.Tensor], local: KVLayout,
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


def staged_rows(offset: int, remote: KVLayout, planes: Sequence[int],
                remote_block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of a staged write, paired in :func:`stage`'s order: into the staging
    buffer's descriptor list (rows of one receiving block, from 0) and into the peer's list of
    every rank's (layer, K|V, block) regions (rank ``d``'s rows after ranks ``0..d-1``'s)."""
    per_rank = remote.num_layers * remote.planes * remote.num_blocks
    ridx = np.asarray(plane_block_indices(planes, remote_block_ids, remote.num_blocks),
                      dtype=np.int64)
    d = remote.tp_size
    dst = (np.arange(d, dtype=np.int64)[:, None] * per_rank + ridx[None, :]).ravel()
    src = offset // remote.block_bytes + np.arange(dst.size, dtype=np.int64)
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

    def prep_ranks(self, info: Any) -> object:
        """The peer's every rank's (layer, K|V, block) regions, rank after rank, as one
        prepared list (what rank-to-rank and staged writes address)."""
        rows = rank_region_descs(info.rank_addresses, info.layout, info.device_id)
        return self._agent.prep_xfer_dlist(info.agent_name, rows,
                                           mem_type(info.layout.device_kind))

    def write(self, p: PreparedPeer, rank_kvs: Sequence[torch.Tensor], local: KVLayout,
              local_addrs: Sequence[int], planes: Sequence[int], local_block_ids: Sequence[int],
              remote_block_ids: Sequence[int]) -> tuple[object, int, int | None]:
        """A write to a peer with several ranks on a side: rank to rank where the head splits
        are equal; else staged and sent as whole blocks when the buffer has room, else one
        descriptor per token of each head run. Returns the transfer, its bytes and the staging
        offset (None: not staged) to free once it is done."""
        assert p.runs is not None
        info = p.info
        if p.ranks_dlist is not None and not needs_staging(local, info.layout, p.runs):
            return (*self.rank_to_rank(p, local, local_addrs, planes, local_block_ids,
                                       remote_block_ids), None)
        offset = None
        if p.ranks_dlist is not None:
            offset = self.pack(rank_kvs, local, info.layout, p.runs, planes, local_block_ids)
        if offset is not None:
            try:
                xfer, nbytes = self.xfer(offset, info.layout, p.ranks_dlist, planes,
                                         remote_block_ids)
            except BaseException:
                self.free(offset)
                raise
            return xfer, nbytes, offset
        src, dst = split_descs(local, local_addrs, info.layout, info.rank_addresses, p.runs,
                               planes, local_block_ids, remote_block_ids, self._device_id,
                               info.device_id)
        xfer = self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(src, self._mem),
            self._agent.get_xfer_descs(dst, mem_type(info.layout.device_kind)),
            info.agent_name)
        return xfer, int(src[:, 1].sum()), None

    def rank_to_rank(self, p: PreparedPeer, local: KVLayout, local_addrs: Sequence[int],
                     planes: Sequence[int], local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int]) -> tuple[object, int]:
        """Equal head splits: each of our ranks' whole blocks to its peer rank, through
        prepared lists of every rank's regions on both sides. Prepared, regions adjacent on
        both sides (a sequence's consecutive blocks) go as one copy: NIXL merges them, where
        per-write descriptors (``initialize_xfer``) cost ~3-4 us of CMA set-up each (P=2 -> D=2
        ran at half the rate of P=1 -> D=1 that way, measured on a 2-vCPU Zen 4)."""
        if self._local_ranks is None:
            rows = rank_region_descs(local_addrs, local, self._device_id)
            self._local_ranks = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem)
        remote = p.info.layout
        per_l, per_r = (x.num_layers * x.planes * x.num_blocks for x in (local, remote))
        li = np.asarray(plane_block_indices(planes, local_block_ids, local.num_blocks))
        ri = np.asarray(plane_block_indices(planes, remote_block_ids, remote.num_blocks))
        src = np.concatenate([run.src * per_l + li for run in p.runs]).astype(np.int32)
        dst = np.concatenate([run.dst * per_r + ri for run in p.runs]).astype(np.int32)
        xfer = self._agent.make_prepped_xfer("WRITE", self._local_ranks, src, p.ranks_dlist,
                                             dst)
        return xfer, len(src) * local.block_bytes

    def pack(self, rank_kvs: Sequence[torch.Tensor], local: KVLayout, remote: KVLayout,
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
        stage(self.area, offset, rank_kvs, local, remote, runs, planes, local_block_ids)
        return offset

    def xfer(self, offset: int, remote: KVLayout, ranks_dlist: object, planes: Sequence[int],
             remote_block_ids: Sequence[int]) -> tuple[object, int]:
        """The prepared WRITE of a staged write's whole blocks, and its bytes."""
        src, dst = staged_rows(offset, remote, planes, remote_block_ids)
        dl = self._dlists.get(remote.block_bytes)
        if dl is None:
            assert self.area is not None
            dl = self._dlists[remote.block_bytes] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", uniform_descs(self.area.buf.data_ptr(),
                                                 self.area.nbytes // remote.block_bytes,
                                                 remote.block_bytes, self._device_id),
                self._mem)
        xfer = self._agent.make_prepped_xfer("WRITE", dl, src, ranks_dlist, dst)
        return xfer, len(src) * remote.block_bytes

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
