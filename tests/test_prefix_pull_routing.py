"""Pull instead of recompute, the router's decision (``router/prefix_pull.py``): which worker a
prefill worker should pull a prompt's prefix from, whether the cost model says the pull beats
recomputing it, the budget it gets, the crossover and its fit from measured pulls, and what is
counted. Real protobufs, a real registry fed by heartbeats, the real cost model."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from kvrelay.common.convert import step_cost_to_proto
from kvrelay.engine.prefix_hash import block_hashes, salt_root
from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.policy import RouteRequest, make_policy
from kvrelay.router.prefix_pull import (
    MAX_PULL_TIMEOUT_S,
    MIN_PULL_TIMEOUT_S,
    PrefixPulls,
    crossover_tokens,
)
from kvrelay.router.pull_sources import pull_seconds
from kvrelay.router.registry import WorkerRegistry

BS = 16
BLOCK_BYTES = 96 * 1024  # the demo model's fp32 block
# 40 us per prompt token: a block costs 0.64 ms to compute
FIT = StepCostFit(base=0.002, prefill_token=4e-5, attended_pair=0.0, decode=0.0004,
                  decode_ctx_token=0.0, samples=64, prefill_chunk=0.0)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


def beat(wid: str, role: int, hashes: list[int],
         fit: StepCostFit = FIT) -> wpb.HeartbeatRequest:
    req = wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=wid, role=role, address=f"{wid}.local:9",
                              incarnation="i1", block_size=BS, max_model_len=1 << 16),
        load=wpb.WorkerLoad(num_blocks=4096, free_blocks=4096),
        tiers=[wpb.TierBlocks(medium="device", added=hashes, full=True)])
    req.load.step_cost.CopyFrom(step_cost_to_proto(fit, 2048))
    return req


def run(body) -> None:
    async def go() -> None:
        reg = WorkerRegistry()
        try:
            body(reg)
        finally:
            await reg.stop()
    asyncio.run(go())


def pulls(reg: WorkerRegistry, mode: str = "auto") -> PrefixPulls:
    policy = make_policy("prefix_aware", reg)
    return PrefixPulls(reg, policy.cost, mode)


def test_the_longest_holder_is_the_source_and_a_prefill_worker_wins_a_tie() -> None:
    prompt = ids(40 * BS + 5, 1)
    hs = block_hashes(prompt, BS)

    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("p1", wpb.ROLE_PREFILL, hs[:4]))  # the chosen one holds 4 blocks
        reg.heartbeat(beat("p2", wpb.ROLE_PREFILL, hs[:30]))
        reg.heartbeat(beat("d1", wpb.ROLE_DECODE, hs[:30]))
        reg.perf.block_bytes = BLOCK_BYTES
        pp = pulls(reg, "always")
        p1 = reg.workers["p1"]
        plan = pp.plan(p1, RouteRequest(prompt))
        assert plan is not None and plan.source.worker_id == "p2", "tie: the prefill worker"
        assert (plan.source_blocks, plan.own_blocks, plan.tokens) == (30, 4, 26 * BS)
        hint = plan.hint()
        assert (hint.source_agent, hint.source_address, hint.prefix_tokens) == \
            ("p2", "p2.local:9", 30 * BS)
        reg.heartbeat(beat("d1", wpb.ROLE_DECODE, hs[:40]))  # the decode worker holds more
        plan = pp.plan(p1, RouteRequest(prompt))
        assert plan is not None and plan.source.worker_id == "d1" and plan.source_blocks == 40
        # Nobody holds more than the chosen worker: nothing to decide, nothing counted.
        assert pp.plan(p1, RouteRequest(ids(40 * BS, 2))) is None
        assert pp.counters.decisions == {("pull", "prefill"): 1, ("pull", "decode"): 1}
    run(body)


def test_auto_pulls_only_what_is_cheaper_to_read_than_to_compute() -> None:
    def body(reg: WorkerRegistry) -> None:
        pp = pulls(reg)
        long_prompt, short_prompt = ids(200 * BS + 1, 3), ids(4 * BS + 1, 4)
        held = block_hashes(long_prompt, BS) + block_hashes(short_prompt, BS)
        reg.heartbeat(beat("p1", wpb.ROLE_PREFILL, []))
        reg.heartbeat(beat("d1", wpb.ROLE_DECODE, held))
        p1 = reg.workers["p1"]
        # No block's bytes measured yet: a pull cannot be priced, so none.
        assert pp.plan(p1, RouteRequest(long_prompt)) is None
        assert pp.counters.decisions == {("recompute", "decode"): 1}
        reg.perf.block_bytes = BLOCK_BYTES
        # The prior: 10 ms + 2 ms/MiB. 200 blocks: ~47 ms against 128 ms of compute.
        plan = pp.plan(p1, RouteRequest(long_prompt))
        assert plan is not None and plan.pull_s < plan.recompute_s
        assert 0.04 < plan.pull_s < 0.06 and 0.12 < plan.recompute_s < 0.14
        # its budget: what recomputing would take (at least twice the pull, and the floor)
        assert plan.hint().timeout_ms == int(max(MIN_PULL_TIMEOUT_S, plan.recompute_s) * 1e3)
        # 4 blocks: ~11 ms to pull, 2.6 ms to compute: recompute.
        assert pp.plan(p1, RouteRequest(short_prompt)) is None
        assert pp.counters.decisions == {("recompute", "decode"): 2, ("pull", "decode"): 1}
        assert pulls(reg, "off").plan(p1, RouteRequest(long_prompt)) is None
    run(body)


def test_the_crossover_moves_with_measured_pulls_and_is_exported() -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("p1", wpb.ROLE_PREFILL, []))
        pp = pulls(reg)
        perf = reg.perf
        assert crossover_tokens(perf, FIT, 2048, BS) is None, "no block size in bytes yet"
        perf.block_bytes = BLOCK_BYTES
        prior = crossover_tokens(perf, FIT, 2048, BS)
        # 10 ms fixed, 0.19 ms of transfer and 0.64 ms of compute a block: ~22 blocks.
        assert prior is not None and 20 * BS <= prior <= 24 * BS
        n = prior // BS
        assert pull_seconds(perf, n) < FIT.prompt_compute_seconds(n * BS, 2048)
        assert pull_seconds(perf, n - 1) >= FIT.prompt_compute_seconds((n - 1) * BS, 2048)
        # Pulls measured at 1 ms + 0.1 ms/MiB: pulling wins from a couple of blocks.
        for blocks in (4, 16, 64, 4, 16, 64, 8, 32):
            mib = blocks * BLOCK_BYTES / 2**20
            pp.observe(_worker(reg), wpb.PullResult(
                outcome=wpb.PULL_DONE, pulled_tokens=blocks * BS, blocks_read=blocks,
                bytes_read=blocks * BLOCK_BYTES, pull_ms=1.0 + 0.1 * mib))
        fitted = crossover_tokens(perf, FIT, 2048, BS)
        assert fitted is not None and fitted <= 3 * BS < prior
        assert pp.counters.pulled_tokens == sum((4, 16, 64, 4, 16, 64, 8, 32)) * BS
        # A fallback is counted and fits nothing.
        samples = perf.pull.n
        pp.observe(_worker(reg), wpb.PullResult(outcome=wpb.PULL_READ_FAILED, pull_ms=900.0))
        assert perf.pull.n == samples and pp.counters.fallbacks == 1
        assert pp.counters.outcomes == {"PULL_DONE": 8, "PULL_READ_FAILED": 1}
    run(body)


def test_a_budget_is_bounded_and_another_salt_holds_nothing() -> None:
    def body(reg: WorkerRegistry) -> None:
        prompt = ids(3000 * BS + 1, 5)
        slow = replace(FIT, prefill_token=4e-4)  # ~20 s to recompute it
        reg.heartbeat(beat("p1", wpb.ROLE_PREFILL, [], slow))
        reg.heartbeat(beat("p2", wpb.ROLE_PREFILL, block_hashes(prompt, BS), slow))
        reg.perf.block_bytes = BLOCK_BYTES
        pp = pulls(reg, "always")
        plan = pp.plan(reg.workers["p1"], RouteRequest(prompt))
        assert plan is not None and plan.hint().timeout_ms == int(MAX_PULL_TIMEOUT_S * 1e3)
        salted = RouteRequest(prompt, root=salt_root("someone-else"))
        assert pp.plan(reg.workers["p1"], salted) is None
    run(body)


def _worker(reg: WorkerRegistry):
    return next(iter(reg.workers.values()))


def test_choosing_the_prefill_worker_counts_the_prefix_it_could_pull() -> None:
    """The holder of a long prefix, with a queue, against an idle worker that holds nothing:
    without pulls the holder wins (its queue costs less than computing the prefix); with them
    the idle worker is priced as reading the prefix from the holder, and wins."""
    prompt = ids(200 * BS + 1, 9)

    def body(reg: WorkerRegistry) -> None:
        busy = beat("p1", wpb.ROLE_PREFILL, block_hashes(prompt, BS))
        busy.load.queued_prompt_tokens = 2 * 1024  # ~82 ms of compute ahead of it
        reg.heartbeat(busy)
        reg.heartbeat(beat("p2", wpb.ROLE_PREFILL, []))
        reg.perf.block_bytes = BLOCK_BYTES
        policy = make_policy("prefix_aware", reg)
        req = RouteRequest(prompt)
        workers = [reg.workers["p1"], reg.workers["p2"]]
        # Off: p2 would compute 200 blocks (~128 ms), p1 its queue and one token.
        assert [w.worker_id for w in policy.rank_prefill(workers, req)] == ["p1", "p2"]
        est = policy.cost.prefill(reg.workers["p2"], req, 0.0)
        assert est.new_tokens == len(prompt), "no pull priced while pulls are off"

        PrefixPulls(reg, policy.cost, "auto")  # --prefix-pull auto
        est = policy.cost.prefill(reg.workers["p2"], req, 0.0)
        assert est.cached_tokens == 200 * BS and est.new_tokens == 1, "priced as pulling"
        # ~47 ms to pull (the prior) + one token against p1's ~82 ms queue
        assert [w.worker_id for w in policy.rank_prefill(workers, req)] == ["p2", "p1"]
        # The chosen worker then pulls from the holder, as priced.
        plan = PrefixPulls(reg, policy.cost, "auto").plan(reg.workers["p2"], req)
        assert plan is not None and plan.source.worker_id == "p1"
    run(body)
