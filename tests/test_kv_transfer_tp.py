"""KV transfer between engines whose KV heads are split over different tensor-parallel sizes.

Transport level (two real NIXL agents, real bytes): a sender of TP=A writes a receiver of TP=B
exactly the heads each receiving rank holds, gathered from the sending ranks that hold them, for
(A, B) in (1, 2), (2, 1), (2, 2) and GQA with fewer KV heads than ranks; splits that cannot be
mapped are refused at the handshake. Engine level (``test_engines_*``): a prefill engine of TP=A
streams its prompt KV to a decode engine of TP=B (each rank a process) and the greedy tokens
equal transformers'; every block comes back.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.tp_shard import kv_head_range
from kvrelay.kv_transfer.descriptors import split_descs
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout, head_runs
from kvrelay.kv_transfer.messages import PeerInfo, RankAgent
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.staging import needs_staging

MODEL_ID = "tp-model-0001"
LAYERS, HEAD_DIM, BLOCK, NB = 2, 8, 4, 12


def _arch(kv_heads: int) -> ModelArch:
    return ModelArch("LlamaForCausalLM", "llama", 10, 64, 128, 1, 4, kv_heads, HEAD_DIM, 1e-6,
                     64, False, False, False, False, False, (None,), "x")


def _ranges(kv_heads: int, tp: int) -> tuple[tuple[int, int], ...]:
    rs = [kv_head_range(_arch(kv_heads), r, tp) for r in range(tp)]
    return tuple((r.start, r.stop) for r in rs)


def _layout(kv_heads: int, tp: int, num_blocks: int = NB, heads_first: bool = False) -> KVLayout:
    per_rank = max(1, kv_heads // tp)
    spec = KVCacheSpec(LAYERS, per_rank, HEAD_DIM, BLOCK, num_blocks, heads_first=heads_first)
    return KVLayout.from_spec(spec, MODEL_ID, head_ranges=_ranges(kv_heads, tp),
                              model_kv_heads=kv_heads)


def _engine(name: str, layout: KVLayout, full: torch.Tensor | None, staging_bytes: int = 1 << 20
            ) -> tuple[NixlTransport, list[torch.Tensor]]:
    """A transport over one KV tensor per rank; ``full`` ([..., all heads, head_dim]) fills each
    rank with its heads (None: zeros)."""
    tensors = []
    for a, b in layout.head_ranges:
        t = torch.zeros(layout.spec.shape)
        if full is not None:
            t.copy_(full[..., a:b, :])
        tensors.append(t)
    return NixlTransport(name, tensors[0], layout, rank_kvs=tensors[1:],
                         staging_bytes=staging_bytes), tensors


def _write_and_wait(src: NixlTransport, dst: NixlTransport, local: list[int],
                    remote: list[int]) -> int:
    return _done(src, src.write(dst.name, None, local, remote), [dst])


def _done(agent: NixlTransport, h: Any, peers: list[NixlTransport]) -> int:
    """Poll ``agent``'s transfer ``h`` to done while ``peers`` (the other side's agents) answer
    the connection handshake; its bytes."""
    deadline = time.monotonic() + 20
    while not agent.poll(h):
        for p in peers:
            p.progress()
        assert time.monotonic() < deadline, f"{h.op} did not complete"
        time.sleep(0.001)
    return h.nbytes


# staging: the default buffer (blocks packed as the receiver lays them out, whole blocks on the
# wire), none that fits (token by token), many scattered blocks (an indexed pack), and a run of
# consecutive blocks on both sides (regions NIXL merges into one copy).
STAGING = {"staged": (1 << 20, 12), "no-room": (1, 12), "scattered": (1 << 20, 120),
           "consecutive": (1 << 20, 12)}


@pytest.mark.parametrize("staging", sorted(STAGING))
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"),
                         [(4, 1, 2), (4, 2, 1), (4, 2, 2), (1, 1, 2), (1, 2, 1), (2, 2, 1),
                          (1, 2, 2)])
def test_each_receiving_rank_gets_exactly_its_heads(kv_heads: int, p_tp: int, d_tp: int,
                                                    staging: str) -> None:
    staging_bytes, nb = STAGING[staging]
    g = torch.Generator().manual_seed(kv_heads * 10 + p_tp * 3 + d_tp)
    full = torch.rand(LAYERS, 2, nb, BLOCK, kv_heads, HEAD_DIM, generator=g)
    tag = uuid.uuid4().hex[:6]
    src_layout, dst_layout = _layout(kv_heads, p_tp, nb), _layout(kv_heads, d_tp, nb + 4)
    src, _ = _engine(f"tp-src-{tag}", src_layout, full, staging_bytes)
    dst, dst_kv = _engine(f"tp-dst-{tag}", dst_layout, None)
    try:
        info = PeerInfo.from_bytes(dst.peer_info().to_bytes())  # as it crosses the wire
        assert info.layout == dst_layout and len(info.rank_addresses) == d_tp
        src.add_peer(info)
        local, remote = [1, 2, 7], [9, 3, 4]
        if staging == "scattered":  # every other block: more runs than the pack slices
            local = list(range(0, nb, 2))
            remote = [nb + 3 - i for i in local]
        elif staging == "consecutive":
            local, remote = [2, 3, 4, 5], [6, 7, 8, 9]
        nbytes = _write_and_wait(src, dst, local, remote)
        # Every head of every receiving rank, each block once: per rank a whole block's bytes.
        assert nbytes == len(local) * LAYERS * 2 * d_tp * dst_layout.block_bytes
        for (a, b), t in zip(dst_layout.head_ranges, dst_kv, strict=True):
            assert torch.equal(t[:, :, remote], full[:, :, local, :, a:b, :])
            untouched = [i for i in range(nb + 4) if i not in remote]
            assert not t[:, :, untouched].any(), "a block nobody asked for was written"
        area = src._stager.area
        runs = head_runs(src_layout, dst_layout)
        if needs_staging(src_layout, dst_layout, runs) and staging != "no-room":
            assert area is not None and area.in_use == 0  # given back once the write landed
        else:
            assert area is None or area.in_use == 0
    finally:
        src.close()
        dst.close()


def test_staging_allocator_aligns_and_reuses() -> None:
    from kvrelay.kv_transfer.staging import StagingArea

    area = StagingArea(1000, torch.float32)
    a = area.alloc(100, align=64)
    b = area.alloc(300, align=64)
    assert (a, b) == (0, 128) and area.in_use == 400
    assert area.alloc(600, align=64) is None  # 448 + 600 > 1000
    area.free(a)
    assert area.alloc(64, align=64) == 0  # the freed gap first
    area.free(0)
    area.free(b)
    assert area.in_use == 0 and area.alloc(1000) == 0


def test_head_runs_gather_and_split() -> None:
    # P=2 -> D=1: the receiving rank's 4 heads come from both sending ranks.
    assert [tuple(r) for r in head_runs(_layout(4, 2), _layout(4, 1))] == [
        (0, 0, 0, 0, 2), (1, 0, 0, 2, 2)]
    # P=1 -> D=2: each receiving rank gets its half.
    assert [tuple(r) for r in head_runs(_layout(4, 1), _layout(4, 2))] == [
        (0, 0, 0, 0, 2), (0, 1, 2, 0, 2)]
    # One KV head replicated on both receiving ranks: each still gets it.
    assert [tuple(r) for r in head_runs(_layout(1, 1), _layout(1, 2))] == [
        (0, 0, 0, 0, 1), (0, 1, 0, 0, 1)]


def test_a_split_that_cannot_be_mapped_is_refused_at_the_handshake() -> None:
    tag = uuid.uuid4().hex[:6]
    src, _ = _engine(f"tp-src-{tag}", _layout(4, 2), None)
    # 4 KV heads over 3 ranks: one head each, and head 3 held by nobody.
    bad = KVLayout.from_spec(KVCacheSpec(LAYERS, 1, HEAD_DIM, BLOCK, NB), MODEL_ID,
                             head_ranges=((0, 1), (1, 2), (2, 3)), model_kv_heads=4)
    dst, _ = _engine(f"tp-dst-{tag}", bad, None)
    try:
        with pytest.raises(IncompatibleKVLayout, match="must divide one another"):
            src.add_peer(dst.peer_info())
        assert not src.has_peer(dst.name)
    finally:
        src.close()
        dst.close()


def _stored(logical: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[..., blocks, block_size, heads, head_dim]`` as ``layout`` stores it."""
    return logical.transpose(-3, -2) if layout.heads_first else logical


class _PerRank:
    """An engine of one agent per tensor-parallel rank (each over its own KV, in this process
    here, as each rank's process has one): rank 0's endpoint lists the others."""

    def __init__(self, tag: str, layout: KVLayout, full: torch.Tensor | None):
        self.tensors = []
        for a, b in layout.head_ranges:
            t = torch.zeros(layout.spec.shape)
            if full is not None:
                t.copy_(_stored(full[..., a:b, :], layout))
            self.tensors.append(t)
        self.agents = [NixlTransport(f"{tag}-r{r}" if r else tag, t, layout, slots=(r,))
                       for r, t in enumerate(self.tensors)]

    def info(self) -> PeerInfo:
        ranks = [(RankAgent(a.name, a.metadata, 0, a.slots), a.slot_addresses)
                 for a in self.agents[1:]]
        return PeerInfo.from_bytes(self.agents[0].peer_info(ranks).to_bytes())

    def close(self) -> None:
        for a in self.agents:
            a.close()


@pytest.mark.parametrize("order", ["tokens", "heads"])
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"),
                         [(4, 1, 2), (4, 2, 1), (4, 2, 2), (1, 2, 1), (1, 1, 2), (2, 2, 1)])
def test_every_rank_writes_its_own_heads_from_its_own_agent(kv_heads: int, p_tp: int,
                                                           d_tp: int, order: str) -> None:
    """P ranks each write, from their own agent, the heads they hold to the agents of the D
    ranks that hold them: together every head of every receiving rank, nothing else, and each
    rank only its own bytes (a replicated head is written once, by the first rank that holds
    it). Both block orders: tokens first (whole blocks or token by token) and heads first (a
    run of heads per block)."""
    g = torch.Generator().manual_seed(kv_heads * 10 + p_tp * 3 + d_tp)
    full = torch.rand(LAYERS, 2, NB, BLOCK, kv_heads, HEAD_DIM, generator=g)
    tag = uuid.uuid4().hex[:6]
    hf = order == "heads"
    src_layout = _layout(kv_heads, p_tp, heads_first=hf)
    dst_layout = _layout(kv_heads, d_tp, NB + 4, heads_first=hf)
    src, dst = _PerRank(f"pr-src-{tag}", src_layout, full), _PerRank(f"pr-dst-{tag}", dst_layout,
                                                                   None)
    try:
        info = dst.info()
        assert [a.slots for a in info.rank_agents] == [(r,) for r in range(1, d_tp)]
        assert info.agent_of(d_tp - 1)[0] == dst.agents[-1].name
        local, remote = [1, 2, 7], [9, 3, 4]
        sent = []
        for agent in src.agents:
            agent.add_peer(info)
            sent.append(_done(agent, agent.write(info.agent_name, None, local, remote),
                              dst.agents))
        runs = head_runs(src_layout, dst_layout)
        itemsize = 4 * BLOCK * HEAD_DIM * len(local) * LAYERS * 2
        assert sent == [sum(r.count for r in runs if r.src == s) * itemsize
                        for s in range(p_tp)]
        for (a, b), t in zip(dst_layout.head_ranges, dst.tensors, strict=True):
            assert torch.equal(t[:, :, remote], _stored(full[:, :, local, :, a:b, :], dst_layout))
            untouched = [i for i in range(NB + 4) if i not in remote]
            assert not t[:, :, untouched].any(), "a block nobody asked for was written"
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("order", ["tokens", "heads"])
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"),
                         [(4, 1, 2), (4, 2, 1), (4, 2, 2), (1, 2, 1), (1, 1, 2)])
def test_every_rank_reads_its_own_heads_from_the_peers_ranks(kv_heads: int, p_tp: int,
                                                            d_tp: int, order: str) -> None:
    """A prefix pull under tensor parallelism: each P rank reads, from its own agent, the heads
    it holds out of the D ranks holding them (a replicated head from the first that does), and
    gets exactly them; nothing else of its cache changes."""
    g = torch.Generator().manual_seed(kv_heads * 7 + p_tp * 5 + d_tp)
    full = torch.rand(LAYERS, 2, NB + 4, BLOCK, kv_heads, HEAD_DIM, generator=g)
    tag = uuid.uuid4().hex[:6]
    hf = order == "heads"
    reader_layout = _layout(kv_heads, p_tp, heads_first=hf)
    holder_layout = _layout(kv_heads, d_tp, NB + 4, heads_first=hf)
    holder = _PerRank(f"rd-hold-{tag}", holder_layout, full)
    reader = _PerRank(f"rd-read-{tag}", reader_layout, None)
    try:
        info = holder.info()
        local, remote = [0, 4, 5], [11, 2, 3]
        for agent in reader.agents:
            agent.add_peer(info)
            nbytes = _done(agent, agent.read(info.agent_name, remote, local), holder.agents)
            assert nbytes == len(local) * LAYERS * 2 * reader_layout.block_bytes
        for (a, b), t in zip(reader_layout.head_ranges, reader.tensors, strict=True):
            assert torch.equal(t[:, :, local], _stored(full[:, :, remote, :, a:b, :],
                                                       reader_layout))
            rest = [i for i in range(NB) if i not in local]
            assert not t[:, :, rest].any(), "a block nobody asked for was read into"
    finally:
        reader.close()
        holder.close()


def test_heads_first_descriptors_are_one_run_per_block() -> None:
    """Heads first, P=1 (4 heads) -> D=2 (2 each): receiving rank d's half of a block is one
    region, on both sides, of 2 heads x BLOCK tokens x HEAD_DIM floats; tokens first the same
    split is one region per token."""
    src, dst = _layout(4, 1, heads_first=True), _layout(4, 2, heads_first=True)
    runs = head_runs(src, dst)
    planes, local, remote = [0, 3], [5], [2]
    s_rows, d_rows = split_descs(src, {0: 1000}, dst, (50000, 90000), runs, planes, local,
                                 remote)
    half = 2 * BLOCK * HEAD_DIM * 4  # bytes of 2 heads of one block
    assert s_rows[:, 1].tolist() == [half] * 4 and d_rows[:, 1].tolist() == [half] * 4
    # Rows: run (receiving rank) major, then plane, then block.
    assert s_rows[:, 0].tolist() == [
        1000 + (p * NB + 5) * src.block_bytes + h * BLOCK * HEAD_DIM * 4
        for h in (0, 2) for p in planes]
    assert d_rows[:, 0].tolist() == [
        base + (p * NB + 2) * dst.block_bytes for base in (50000, 90000) for p in planes]
    tokens = split_descs(_layout(4, 1), {0: 1000}, _layout(4, 2), (50000, 90000),
                         head_runs(_layout(4, 1), _layout(4, 2)), planes, local, remote)[0]
    assert len(tokens) == 2 * len(planes) * BLOCK


def test_a_rank_endpoint_must_be_whole() -> None:
    """A rank's agent alone is not an engine's endpoint; rank agents claiming a transport rank
    twice are refused on the wire."""
    tag = uuid.uuid4().hex[:6]
    eng = _PerRank(f"pr-whole-{tag}", _layout(4, 2), None)
    try:
        with pytest.raises(KVTransferError, match="lacks transport ranks"):
            eng.agents[0].peer_info()
        info = eng.info()
        twice = (*info.rank_agents, RankAgent("x", b"md", 0, (1,)))
        with pytest.raises(ValueError, match="each at most once"):
            PeerInfo(info.agent_name, info.agent_metadata, info.layout, info.base_address, 0,
                     info.incarnation, info.rank_addresses, twice)
    finally:
        eng.close()
