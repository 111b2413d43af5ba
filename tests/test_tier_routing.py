"""Routing by KV tier: heartbeats carry each tier's block hashes (device, host, disk) as
deltas, a block demoted from the pool to host memory stays routable, and the prefix-aware
policy credits each leading prompt block by the best tier holding it, at that tier's weight
(the defaults until the worker measures its loads, then 1 - load / compute per block).

Real protobufs, a real registry and policy, the worker's real Heartbeater over real gRPC."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvrelay.common.convert import step_cost_to_proto
from kvrelay.engine.prefix_hash import block_hashes
from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.engine.tiers.media import DEFAULT_TIER_WEIGHTS, DEVICE, DISK, HOST, TierStats
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.estimators import tier_weights
from kvrelay.router.policy import RouteRequest, make_policy
from kvrelay.router.registry import WorkerRegistry, validate_beat
from kvrelay.router.worker_state import MAX_TIER_BLOCKS
from kvrelay.worker.heartbeat import Heartbeater, tier_deltas, tier_loads

BS = 16
FIT = StepCostFit(base=0.005, prefill_token=0.00025, attended_pair=0.0, decode=0.0004,
                  decode_ctx_token=0.0, samples=64, prefill_chunk=0.001)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


def tier_load(medium: str, capacity: int = 4096, **kw: float) -> wpb.TierLoad:
    return wpb.TierLoad(medium=medium, capacity_blocks=capacity, **kw)


def beat(wid: str, tiers: list[wpb.TierBlocks], *, role: int = wpb.ROLE_PREFILL,
         lower: tuple[wpb.TierLoad, ...] = (tier_load(HOST), tier_load(DISK)),
         fit: StepCostFit | None = None, num_blocks: int = 2048) -> wpb.HeartbeatRequest:
    req = wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=wid, role=role, address=f"{wid}.local:9",
                              incarnation="i1", block_size=BS, max_model_len=4096),
        load=wpb.WorkerLoad(num_blocks=num_blocks, free_blocks=num_blocks, tiers=lower),
        tiers=tiers)
    if fit is not None:
        req.load.step_cost.CopyFrom(step_cost_to_proto(fit, 512))
    return req


def full(**sets: object) -> list[wpb.TierBlocks]:
    return [wpb.TierBlocks(medium=m, added=s, full=True) for m, s in sets.items()]  # type: ignore


def run(body) -> None:
    async def go() -> None:
        reg = WorkerRegistry()
        try:
            body(reg)
        finally:
            await reg.stop()
    asyncio.run(go())


# -- the worker's side: per-tier deltas -----------------------------------------------------------
def test_tier_deltas_send_full_sets_first_then_only_changed_tiers() -> None:
    dev, host = frozenset({1, 2, 3}), frozenset({7})
    first = tier_deltas({DEVICE: dev, HOST: host}, None)
    assert [(t.medium, set(t.added), t.full) for t in first] == [(DEVICE, {1, 2, 3}, True),
                                                                 (HOST, {7}, True)]
    sent = {DEVICE: dev, HOST: host}
    assert tier_deltas({DEVICE: dev, HOST: host}, sent) == []  # the same objects: unchanged
    # block 3 demoted from the pool to host memory: one beat, both tiers
    dev2, host2 = frozenset({1, 2}), frozenset({3, 7})
    moved = {t.medium: t for t in tier_deltas({DEVICE: dev2, HOST: host2}, sent)}
    assert (set(moved[DEVICE].removed), set(moved[DEVICE].added)) == ({3}, set())
    assert (set(moved[HOST].added), set(moved[HOST].removed)) == ({3}, set())
    assert not moved[DEVICE].full and not moved[HOST].full
    # a tier the router has not heard of yet (a disk tier appeared): in full
    (disk,) = tier_deltas({DEVICE: dev, HOST: host, DISK: frozenset({9})}, sent)
    assert (disk.medium, set(disk.added), disk.full) == (DISK, {9}, True)
    # a new set object is diffed, not trusted: an equal copy changes nothing
    assert tier_deltas({DEVICE: frozenset(set(dev)), HOST: host}, sent) == []
    (grown,) = tier_deltas({DEVICE: dev | {4}, HOST: host}, sent)
    assert (grown.medium, set(grown.added), set(grown.removed)) == (DEVICE, {4}, set())


def test_tier_loads_carry_the_engines_tier_counters() -> None:
    host = TierStats(HOST, capacity_blocks=100, used_blocks=40, stored_blocks=50,
                     stored_bytes=5000, hit_blocks=8, loaded_bytes=800, load_seconds=0.004,
                     load_failures=1, evicted_blocks=10)
    (t,) = tier_loads({HOST: host})
    assert (t.medium, t.capacity_blocks, t.used_blocks, t.hit_blocks, t.load_failures,
            t.stored_blocks, t.loaded_bytes, t.evicted_blocks) == (HOST, 100, 40, 8, 1, 50,
                                                                   800, 10)
    assert t.load_seconds_per_block == pytest.approx(0.0005)
    assert tier_loads({}) == []


# -- the router's side: per-tier sets -------------------------------------------------------------
def test_a_block_demoted_from_the_pool_stays_routable_at_the_host_weight() -> None:
    def body(reg: WorkerRegistry) -> None:
        prompt = ids(130, 1)
        hs = block_hashes(prompt, BS)  # 8 blocks
        reg.heartbeat(beat("p1", full(device=hs, host=[], disk=[])))
        w = reg.workers["p1"]
        now = time.monotonic()
        held = w.cached_prefix(hs, now)
        assert (held.blocks, held.credit, held.per_tier) == (8, 8.0, {DEVICE: 8})
        # the pool evicts its last 3 blocks, which the host tier kept: a tier change
        resp = reg.heartbeat(beat("p1", [
            wpb.TierBlocks(medium=DEVICE, removed=hs[5:]),
            wpb.TierBlocks(medium=HOST, added=hs[5:])]))
        assert not resp.want_full_block_set
        assert w.reported.hashes(DEVICE) == set(hs[:5])
        assert w.reported.hashes(HOST) == set(hs[5:])
        held = w.cached_prefix(hs, now)
        assert held.blocks == 8 and held.per_tier == {DEVICE: 5, HOST: 3}
        assert held.credit == pytest.approx(5 + 3 * DEFAULT_TIER_WEIGHTS[HOST])
        # then down to disk: still routable, at the disk weight
        reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, removed=hs[7:]),
                                  wpb.TierBlocks(medium=DISK, added=hs[7:])]))
        held = w.cached_prefix(hs, now)
        assert held.per_tier == {DEVICE: 5, HOST: 2, DISK: 1}
        assert held.credit == pytest.approx(5 + 2 * 0.75 + 0.25)
        # a block held in two tiers (host keeps a copy of a pool block) counts once, as device
        reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, added=hs[:2])]))
        assert w.cached_prefix(hs, now).per_tier == {DEVICE: 5, HOST: 2, DISK: 1}
        # the chain ends at the first block no tier holds
        reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, removed=[hs[5]])]))
        held = w.cached_prefix(hs, now)
        assert (held.blocks, held.per_tier) == (5, {DEVICE: 5})
    run(body)


def test_a_joining_workers_delta_or_an_overfull_tier_asks_for_the_full_sets() -> None:
    def body(reg: WorkerRegistry) -> None:
        # a first beat with deltas: relative to sets this registry never had
        assert reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, added=[1])],
                                  )).want_full_block_set
        assert not reg.heartbeat(beat("p1", full(device=[1], host=[2]))).want_full_block_set
        w = reg.workers["p1"]
        # more hashes in the host tier than its capacity: that tier starts over
        lower = (tier_load(HOST, capacity=3),)
        assert reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, added=[3, 4, 5])],
                                  lower=lower)).want_full_block_set
        assert w.reported.hashes(HOST) == set() and w.reported.hashes(DEVICE) == {1}
    run(body)


@pytest.mark.parametrize("tiers, lower, why", [
    (full(host=range(9)), (tier_load(HOST, capacity=8),), "9 block hashes added to tier host"),
    (full(disk=[1]), (tier_load(HOST),), "added to tier disk; it has 0 blocks"),
    (full(device=range(65)), (), "65 block hashes added to tier device"),
    ([wpb.TierBlocks(medium="nvme", added=[1])], (), "unknown or repeated tier 'nvme'"),
    (full(host=[1]) + full(host=[2]), (tier_load(HOST),), "unknown or repeated tier 'host'"),
    ([], (tier_load(DEVICE),), "load.tiers: unknown or repeated tier 'device'"),
    ([], (tier_load(HOST, capacity=MAX_TIER_BLOCKS + 1),), "capacity_blocks must be at most"),
    ([], (tier_load(HOST, capacity=4, used_blocks=5),), "used_blocks at most capacity"),
])
def test_out_of_bounds_tiers_are_refused(tiers, lower, why) -> None:
    with pytest.raises(ValueError, match=why):
        validate_beat(beat("p1", tiers, lower=lower, num_blocks=64))


# -- the weight fit -------------------------------------------------------------------------------
def test_tier_weights_start_from_the_defaults_and_fit_to_measured_loads() -> None:
    assert tier_weights({}, FIT, BS) == DEFAULT_TIER_WEIGHTS
    compute = FIT.prefill_token * BS  # 4 ms a block
    w = tier_weights({HOST: 0.001, DISK: 0.003}, FIT, BS)
    assert w[HOST] == pytest.approx(1 - 0.001 / compute) == pytest.approx(0.75)
    assert w[DISK] == pytest.approx(0.25) and w[DEVICE] == 1.0
    # measured but no step-time fit yet: the defaults
    assert tier_weights({HOST: 0.003}, None, BS) == DEFAULT_TIER_WEIGHTS
    # slower to load than to recompute: worth nothing; free: worth a pool block (clamped)
    assert tier_weights({DISK: 0.02}, FIT, BS)[DISK] == 0.0
    assert tier_weights({HOST: 1e-12}, FIT, BS)[HOST] == pytest.approx(1.0)
    assert tier_weights({HOST: float("nan")}, FIT, BS)[HOST] == DEFAULT_TIER_WEIGHTS[HOST]


def test_beats_refit_a_workers_tier_weights() -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("p1", full(device=[], host=[])))
        w = reg.workers["p1"]
        assert w.reported.tier_weights == DEFAULT_TIER_WEIGHTS  # nothing measured
        # a measured host load cost (3 ms a block) but no step-time fit yet: defaults
        measured = (tier_load(HOST, hit_blocks=10, load_seconds_per_block=0.003),)
        reg.heartbeat(beat("p1", [], lower=measured))
        assert w.reported.tier_weights == DEFAULT_TIER_WEIGHTS
        # both: 1 - 3 ms / (16 x 0.25 ms)
        reg.heartbeat(beat("p1", [], lower=measured, fit=FIT))
        assert w.reported.tier_weights[HOST] == pytest.approx(0.25)
        assert w.reported.tier_weights[DISK] == DEFAULT_TIER_WEIGHTS[DISK]
        # a tier with no hit yet keeps its default, whatever the per-block figure says
        reg.heartbeat(beat("p1", [], lower=(tier_load(HOST, load_seconds_per_block=0.5),)))
        assert w.reported.tier_weights[HOST] == DEFAULT_TIER_WEIGHTS[HOST]
    run(body)


# -- the policy -----------------------------------------------------------------------------------
def _fitted(reg: WorkerRegistry, *wids: str) -> None:
    for wid in wids:
        reg.heartbeat(beat(wid, full(device=[], host=[], disk=[]), fit=FIT))


def test_policy_prefers_a_host_held_prefix_to_none_and_device_to_host() -> None:
    def body(reg: WorkerRegistry) -> None:
        policy = make_policy("prefix_aware", reg)
        _fitted(reg, "none", "host", "device")
        prompt = ids(1000, 2)
        hs = block_hashes(prompt, BS)[:60]  # 960 tokens of 1000
        reg.heartbeat(beat("host", [wpb.TierBlocks(medium=HOST, added=hs)]))
        reg.heartbeat(beat("device", [wpb.TierBlocks(medium=DEVICE, added=hs)]))
        ws = {wid: reg.workers[wid] for wid in ("none", "host", "device")}
        req = RouteRequest(prompt)
        ranked = policy.rank_prefill(list(ws.values()), req)
        assert [w.worker_id for w in ranked] == ["device", "host", "none"]
        now = time.monotonic()
        e = {wid: policy.cost.prefill(w, req, now) for wid, w in ws.items()}
        assert e["device"].cached_tokens == 960 and e["none"].cached_tokens == 0
        assert e["host"].cached_tokens == 720  # 960 at the host weight, 0.75
        assert e["host"].held.per_tier == {HOST: 60}
        assert e["device"].seconds < e["host"].seconds < e["none"].seconds
        # without the device worker, the host-held prefix wins over nothing
        assert policy.rank_prefill([ws["none"], ws["host"]], req)[0] is ws["host"]
        # once host loads measure as slow as recomputing, the host copy is worth nothing
        slow = (tier_load(HOST, hit_blocks=5, load_seconds_per_block=1.0), tier_load(DISK))
        reg.heartbeat(beat("host", [], lower=slow, fit=FIT))
        assert policy.cost.prefill(ws["host"], req, now).cached_tokens == 0
    run(body)


def test_decode_ranking_credits_a_host_held_prefix_but_needs_room_to_promote_it() -> None:
    def body(reg: WorkerRegistry) -> None:
        policy = make_policy("prefix_aware", reg)
        for wid in ("d-none", "d-host"):
            reg.heartbeat(beat(wid, full(device=[], host=[]), role=wpb.ROLE_DECODE, fit=FIT))
        prompt = ids(640, 3)
        hs = block_hashes(prompt, BS)
        reg.heartbeat(beat("d-host", [wpb.TierBlocks(medium=HOST, added=hs)],
                           role=wpb.ROLE_DECODE))
        reg.perf.observe_transfer(40 * 98304, 40, 0.05)  # slow enough that holding KV matters
        dn, dh = reg.workers["d-none"], reg.workers["d-host"]
        req = RouteRequest(prompt, max_tokens=4)
        need = -(-(len(prompt) + 1) // BS)
        assert policy.rank_decode([dn, dh], need, req) == [dh, dn]
        e = policy.cost.decode(dh, req, need, time.monotonic())
        assert e.cached_blocks == pytest.approx(40 * 0.75) and e.fits
        # the host copy needs free pool blocks to be promoted into: with fewer, it does not fit
        dh.accounting.pending_blocks = dh.reported.load.free_blocks - need + 1
        assert not policy.cost.decode(dh, req, need, time.monotonic()).fits
        assert policy.rank_decode([dn, dh], need, req) == [dn, dh]
    run(body)


def test_expected_blocks_count_as_device() -> None:
    def body(reg: WorkerRegistry) -> None:
        _fitted(reg, "p1")
        w = reg.workers["p1"]
        hs = block_hashes(ids(64, 4), BS)
        reg.heartbeat(beat("p1", [wpb.TierBlocks(medium=HOST, added=hs)]))
        now = time.monotonic()
        assert w.cached_prefix(hs, now).per_tier == {HOST: 4}
        w.expect(hs, now + reg.expect_s)  # the router just had it compute them
        assert w.cached_prefix(hs, now).per_tier == {DEVICE: 4}
        assert w.cached_prefix(hs, now + reg.expect_s + 0.01).per_tier == {HOST: 4}
    run(body)


# -- over gRPC: the worker's Heartbeater into the registry ----------------------------------------
def test_heartbeats_over_grpc_keep_a_demoted_prefix_routable() -> None:
    from kvrelay.common.rpc import bind, make_server
    from kvrelay.router.grpc_api import RegistryServicer

    async def go() -> None:
        reg = WorkerRegistry(heartbeat_interval_s=0.05)
        server = make_server()
        worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(reg), server)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        hs = block_hashes(ids(96, 5), BS)  # 6 blocks
        sets = {DEVICE: frozenset(hs), HOST: frozenset()}
        info = wpb.WorkerInfo(worker_id="p1", role=wpb.ROLE_PREFILL, address="127.0.0.1:1",
                              incarnation="i1", block_size=BS, max_model_len=4096)

        def load() -> wpb.WorkerLoad:
            return wpb.WorkerLoad(num_blocks=64, free_blocks=64, tiers=[tier_load(HOST)])

        hb = Heartbeater([f"127.0.0.1:{port}"], info, load, lambda: sets, interval_s=0.05)
        hb.start()

        async def until(cond) -> None:
            for _ in range(300):
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("registry did not catch up")

        def tiers() -> dict[str, set[int]]:
            w = reg.workers.get("p1")
            return {m: set(w.reported.hashes(m)) for m in (DEVICE, HOST)} if w else {}

        try:
            await until(lambda: tiers() == {DEVICE: set(hs), HOST: set()})
            sets = {DEVICE: frozenset(hs[:2]), HOST: frozenset(hs[2:])}  # demoted
            seen: list[dict[str, set[int]]] = []
            await until(lambda: seen.append(tiers()) or seen[-1] == {DEVICE: set(hs[:2]),
                                                                      HOST: set(hs[2:])})
            # at no beat in between was a block held by no tier
            assert all(set(hs) <= s[DEVICE] | s[HOST] for s in seen)
            held = reg.workers["p1"].cached_prefix(hs, time.monotonic())
            assert held.blocks == 6 and held.per_tier == {DEVICE: 2, HOST: 4}
        finally:
            await hb.stop()
            await server.stop(None)
            await reg.stop()

    asyncio.run(go())
