"""Prefix-aware routing and the fast lane, in process.

The router hashes prompts exactly as the engine's prefix cache does; heartbeats carry the hash
deltas into the registry; the measured fits; prefix-aware ranking (cached prefix against queued
work, in seconds); the fast-lane decision under a fitted model. The multi-process half is
tests/test_routing_cluster.py.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.prefix_hash import block_hashes
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.estimators import LinearFit, RateMeter
from kvrelay.router.policy import (
    POLICIES,
    CostModel,
    LeastLoaded,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.worker_state import ReportedLoad, WorkerIdentity, WorkerState
from kvrelay.worker.heartbeat import Heartbeater

BS = 16


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


# -- hashes: router == engine ---------------------------------------------------------------------
def test_router_hashes_equal_the_engines_prefix_cache() -> None:
    bm = BlockManager(64, BS)
    tokens = ids(200, 1)
    seq = Sequence("a", tokens, SamplingParams())
    assert bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.publish(seq)
    req = RouteRequest(tokens)
    assert set(req.hashes(BS)) == set(bm.cached_block_hashes()) == bm.cached_hash_set()
    assert len(req.hashes(BS)) == 200 // BS  # full blocks only
    # a prompt extended by generated tokens: the prompt's chain is reused
    more = ids(40, 2)
    assert req.extended_hashes(more, BS) == block_hashes(tokens + more, BS)
    assert RouteRequest(tokens[:5]).extended_hashes([], BS) == []


def test_cached_hash_set_is_the_same_object_until_the_cache_changes() -> None:
    bm = BlockManager(4, 2)
    s0 = bm.cached_hash_set()
    assert bm.cached_hash_set() is s0 and not s0
    a = Sequence("a", [1, 2, 3, 4], SamplingParams())
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.publish(a)
    s1 = bm.cached_hash_set()
    assert s1 is not s0 and len(s1) == 2 and bm.cached_hash_set() is s1
    bm.free(a)
    assert bm.cached_hash_set() is s1  # freed but still cached
    filler = Sequence("f", list(range(8)), SamplingParams())
    assert bm.allocate(filler, 8)  # evicts a's blocks
    assert bm.cached_hash_set() == frozenset()


def test_heartbeats_carry_block_hash_deltas_into_the_registry() -> None:
    from kvrelay.common.rpc import bind, make_server
    from kvrelay.router.grpc_api import RegistryServicer

    async def run() -> None:
        reg = WorkerRegistry(heartbeat_interval_s=0.05)
        server = make_server()
        worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(reg), server)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        held = frozenset({1, 2, 3})

        def current() -> dict[str, frozenset[int]]:
            return {"device": held}

        info = wpb.WorkerInfo(worker_id="p1", role=wpb.ROLE_PREFILL, address="127.0.0.1:1",
                              incarnation="i1", block_size=BS, max_model_len=4096)
        hb = Heartbeater([f"127.0.0.1:{port}"], info, wpb.WorkerLoad, current, interval_s=0.05)
        hb.start()

        async def until(cond) -> None:
            for _ in range(200):
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("registry did not catch up")

        try:
            await until(lambda: "p1" in reg.workers
                        and reg.workers["p1"].reported.hashes() == held)
            held = frozenset({2, 3, 4, 5})  # 1 evicted, 4 and 5 published
            await until(lambda: reg.workers["p1"].reported.hashes() == held)
            w = reg.workers["p1"]
            assert w.cached_blocks([2, 3, 4, 9], time.monotonic()) == 3
            assert w.cached_blocks([1, 2], time.monotonic()) == 0  # chained: stops at 1
        finally:
            await hb.stop()
            await server.stop(None)
            await reg.stop()

    asyncio.run(run())


# -- measurements ---------------------------------------------------------------------------------
def test_linear_fit_uses_the_prior_only_until_measured() -> None:
    f = LinearFit(0.005, 0.001, 100.0)
    assert f.predict(100) == pytest.approx(0.105)
    for x in (16, 512, 64, 256, 16, 512):
        f.observe(x, 0.002 + 0.0002 * x)
    a, b = f.coef()
    assert a == pytest.approx(0.002, rel=0.05) and b == pytest.approx(0.0002, rel=0.05)
    f.observe(-1, 5.0)  # ignored
    f.observe(10, float("nan"))
    assert f.n == 6
    g = LinearFit(0.0, 0.001, 10.0)
    g.observe(10, 0.0)  # times never shrink with size: slope and intercept stay >= 0
    assert min(g.coef()) >= 0.0


def test_rate_meter_decays_when_events_stop() -> None:
    r = RateMeter()
    assert r.rate(0.0) == 0.0
    for t in range(11):
        r.tick(t * 0.1)
    assert r.rate(1.0) == pytest.approx(10.0)
    assert r.rate(11.0) == pytest.approx(0.1)  # 10 s of silence


# -- ranking and the fast lane under a fitted model ---------------------------------------------
def worker(reg: WorkerRegistry, wid: str, role: str, *, free: int = 2000, running: int = 0,
           queued: int = 0) -> WorkerState:
    w = WorkerState(
        WorkerIdentity(worker_id=wid, role=role, address=wid, incarnation="i",
                       model_identity="m", block_size=BS, max_model_len=4096,
                       channel=None),  # type: ignore[arg-type]
        ReportedLoad(load=wpb.WorkerLoad(num_blocks=free, free_blocks=free, running=running,
                                         queued_prompt_tokens=queued),
                     last_seen=time.monotonic()))
    # as its engine fitted and reported it: a step 5 ms + 1 ms a prefill chunk + 0.25 ms a
    # prompt token + 0.4 ms a decode; 512 prompt tokens a step; Reserve 1.5 ms
    perf = w.perf
    perf.step_cost = StepCostFit(base=0.005, prefill_token=0.00025, attended_pair=0.0,
                                 decode=0.0004, decode_ctx_token=0.0, samples=64,
                                 prefill_chunk=0.001)
    perf.step_tokens = 512
    perf.reserve_rpc_s.observe(0.0015)
    reg.workers[wid] = w
    return w


@pytest.fixture
def fitted() -> tuple[WorkerRegistry, CostModel]:
    reg = WorkerRegistry()
    perf = reg.perf
    for blocks in (1, 32, 8):  # 2 ms + 1 GiB/s, 96 KiB blocks
        perf.observe_transfer(blocks * 98304, blocks, 0.002 + blocks * 98304 / 2**30)
    perf.prefill_rpc_s.observe(0.0015)
    return reg, CostModel(reg)


def held(w: WorkerState, tokens: list[int], n: int) -> None:
    """``w`` holds the KV of ``tokens[:n]`` (reported by its beats)."""
    w.reported.hashes().update(block_hashes(tokens[:n], BS))


def test_prefix_aware_prefill_ranks_cached_prefix_against_queued_work(fitted) -> None:
    reg, _ = fitted
    policy = make_policy("prefix_aware", reg)
    p1, p2 = worker(reg, "p1", "prefill"), worker(reg, "p2", "prefill")
    prompt = ids(1000, 3)
    held(p1, prompt, 800)
    req = RouteRequest(prompt)
    assert policy.rank_prefill([p2, p1], req)[0] is p1  # 200 new tokens vs 1000
    p1.reported.load = wpb.WorkerLoad(queued_prompt_tokens=300)  # still cheaper: 500 vs 1000
    assert policy.rank_prefill([p2, p1], req)[0] is p1
    p1.reported.load = wpb.WorkerLoad(queued_prompt_tokens=5000)  # its queue costs more
    assert policy.rank_prefill([p2, p1], req)[0] is p2
    # the router's own accounting counts before the next beat does
    p1.reported.load = wpb.WorkerLoad()
    p1.accounting.pending_prompt_tokens = 5000
    assert policy.rank_prefill([p1, p2], req)[0] is p2


def test_prefix_aware_decode_prefers_the_cached_prefix_among_those_with_room(fitted) -> None:
    reg, cost = fitted
    policy = make_policy("prefix_aware", reg)
    d1, d2 = worker(reg, "d1", "decode"), worker(reg, "d2", "decode")
    prompt = ids(1000, 4)
    held(d2, prompt, 992)
    req = RouteRequest(prompt, max_tokens=16)
    need = -(-(len(prompt) + 1) // BS)
    assert policy.rank_decode([d1, d2], need, req) == [d2, d1]
    e = cost.decode(d2, req, need, time.monotonic())
    assert (e.cached_blocks, e.uncached_blocks) == (62, 1)
    d2.reported.load = wpb.WorkerLoad(free_blocks=0)  # no room even for the block it lacks
    assert policy.rank_decode([d1, d2], need, req) == [d1, d2]


def test_a_ranking_chooses_each_step_time_fit_once_not_once_per_worker(fitted) -> None:
    """Ranking N workers scans the pool for the fit to price them with once per kind of work
    (it was once per worker: N x N for a pool of N)."""
    reg, _ = fitted
    policy = make_policy("auto", reg)
    ds = [worker(reg, f"d{i}", "decode") for i in range(12)]
    ps = [worker(reg, f"p{i}", "prefill") for i in range(12)]
    scans: list[str] = []
    alive = reg.alive
    reg.alive = lambda role: scans.append(role) or alive(role)  # type: ignore[method-assign]
    req = RouteRequest(ids(300, 9), max_tokens=16)
    policy.rank_decode(ds, -(-301 // BS), req)
    policy.rank_prefill(ps, req)
    policy.route(req, ds, ps)
    # decode and prompt fits per ranking: at most a scan of each role per kind of work each
    assert len(scans) <= 3 * 2 * 3, scans


def test_expected_blocks_count_until_the_beats_can_report_them() -> None:
    reg = WorkerRegistry(heartbeat_interval_s=0.1)
    w = worker(reg, "p", "prefill")
    hs = block_hashes(ids(64, 5), BS)
    now = time.monotonic()
    w.expect(hs, now + reg.expect_s)
    assert w.cached_blocks(hs, now) == 4
    assert w.cached_blocks(hs, now + reg.expect_s + 0.01) == 0


def test_fast_lane_under_the_fitted_model(fitted) -> None:
    reg, cost = fitted
    p1, p2 = worker(reg, "p1", "prefill"), worker(reg, "p2", "prefill")
    d = worker(reg, "d", "decode")
    now = time.monotonic()

    def route(prompt: list[int]):
        return cost.route(RouteRequest(prompt, max_tokens=16), [d], [p1, p2], now)

    # idle pools: a short prompt saves the second hop and the transfer
    r = route(ids(20, 6))
    assert r.local is d and r.reason == "short_prompt"
    # a long one would hold up the requests reaching the decode worker meanwhile
    for k in range(20):
        d.perf.arrivals.tick(now - 2.0 + k * 0.1)  # 10 requests/s
    r = route(ids(2000, 7))
    assert r.local is None and r.reason == "decode_interference"
    # ... and with a prefill worker holding its prefix, it is cheaper disaggregated anyway
    long_prompt = ids(2000, 8)
    held(p1, long_prompt, 1984)
    r = route(long_prompt)
    assert r.local is None and r.reason == "long_prompt"
    # mostly cached on the decode worker alone: local
    conv = ids(1500, 9)
    held(d, conv, 1488)
    r = route(conv + ids(30, 10))
    assert r.local is d and r.reason == "cached_prefix"
    # a busy decode batch: 200 new tokens would stall 32 sequences; the prefill pool is idle
    d.accounting.inflight = 32
    r = route(ids(200, 11))
    assert r.local is None
    # a busy prefill pool: a short prompt goes local even then
    p1.accounting.pending_prompt_tokens = p2.accounting.pending_prompt_tokens = 3000
    d.accounting.inflight = 4
    r = route(ids(24, 12))
    assert r.local is d
    assert r.disaggregated_s is not None and r.local_s is not None
    assert r.local_s < r.disaggregated_s
    # no room on the decode worker for a local run either
    d.reported.load = wpb.WorkerLoad(free_blocks=0)
    assert cost.route(RouteRequest(ids(24, 12)), [d], [p1], now).reason == "no_kv_room"


def test_policies_by_name() -> None:
    assert set(POLICIES) == {"round_robin", "least_loaded", "prefix_aware", "auto"}
    assert make_policy("auto").fast_lane and make_policy("auto").calibrate
    assert not make_policy("prefix_aware").fast_lane
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    reg = WorkerRegistry()
    a, b = worker(reg, "a", "prefill"), worker(reg, "b", "prefill")
    req = RouteRequest(ids(10, 1))
    rr = RoundRobin()
    assert [rr.rank_prefill([a, b], req)[0].worker_id for _ in range(3)] == ["a", "b", "a"]
    a.reported.load = wpb.WorkerLoad(queued_prompt_tokens=100)
    assert LeastLoaded().rank_prefill([a, b], req)[0] is b


def test_routing_policy_flag() -> None:
    from kvrelay.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["router", "--model", "m", "--routing-policy", "auto"]).policy == "auto"
    assert parse(["router", "--model", "m", "--policy", "round_robin"]).policy == "round_robin"
    with pytest.raises(SystemExit):
        parse(["router", "--model", "m", "--routing-policy", "nope"])
