"""What a heartbeat changes in the router's view of a worker: the reported part takes the beat
(load, when, each tier's block-hash delta), the router's accounting snapshots its own counts
(what the beat's figures already include), and the identity stays as the incarnation's first
beat said."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from kvrelay.common.convert import step_cost_to_proto
from kvrelay.common.rpc import DRAIN_TIMEOUT_S
from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.policy import RouteRequest, make_policy
from kvrelay.router.registry import WorkerRegistry


def _beat(*, added: tuple[int, ...] = (), removed: tuple[int, ...] = (), full: bool = True,
          incarnation: str = "i1", address: str = "127.0.0.1:9", leaving: bool = False,
          drain_timeout_s: float = 0.0, **load: int) -> wpb.HeartbeatRequest:
    return wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id="p1", role=wpb.ROLE_PREFILL, address=address,
                              incarnation=incarnation, block_size=16, max_model_len=4096,
                              drain_timeout_s=drain_timeout_s),
        load=wpb.WorkerLoad(**{"num_blocks": 8, "free_blocks": 8, **load}),
        tiers=[wpb.TierBlocks(medium="device", added=added, removed=removed, full=full)],
        leaving=leaving)


def _with_registry(body: Callable[[WorkerRegistry], None]) -> None:
    async def run() -> None:
        reg = WorkerRegistry()
        try:
            body(reg)
        finally:
            await reg.stop()
    asyncio.run(run())


def test_a_beat_updates_the_reported_part_and_snapshots_the_accounting() -> None:
    def body(reg: WorkerRegistry) -> None:
        assert not reg.heartbeat(_beat(added=(1, 2, 3))).want_full_block_set
        w = reg.workers["p1"]
        ident, seen = w.identity, w.reported.last_seen
        assert (ident.role, ident.block_size, w.reported.hashes()) == ("prefill", 16,
                                                                           {1, 2, 3})
        # this router hands it work between two beats
        acct = w.accounting
        acct.pending_prompt_tokens, acct.inflight, acct.pending_blocks = 300, 2, 5
        assert w.queued_tokens_estimate == 300 and w.batch_estimate == 2
        resp = reg.heartbeat(_beat(added=(4,), removed=(1,), full=False, running=3,
                                   queued_prompt_tokens=500, free_blocks=6))
        assert not resp.want_full_block_set
        assert reg.workers["p1"] is w and w.identity is ident  # the same incarnation
        assert w.reported.load.queued_prompt_tokens == 500 and w.reported.last_seen >= seen
        assert w.reported.hashes() == {2, 3, 4}
        assert (acct.pending_at_beat, acct.inflight_at_beat, acct.pending_blocks) == (300, 2, 0)
        # the beat's figures include this router's own work: counted once
        assert w.queued_tokens_estimate == 500 and w.batch_estimate == 3
        assert w.free_blocks_estimate == 6
        acct.pending_prompt_tokens += 100  # handed out after the beat: on top
        assert w.queued_tokens_estimate == 600
        with pytest.raises(dataclasses.FrozenInstanceError):
            w.identity.block_size = 32  # type: ignore[misc]
    _with_registry(body)


def test_a_delta_out_of_step_asks_for_the_full_set() -> None:
    def body(reg: WorkerRegistry) -> None:
        # a first beat with a delta: relative to a set this registry never had
        assert reg.heartbeat(_beat(added=(1,), full=False)).want_full_block_set
        w = reg.workers["p1"]
        assert w.reported.hashes() == {1}
        # more hashes than the worker has blocks: start over
        assert reg.heartbeat(_beat(added=tuple(range(2, 10)), full=False)).want_full_block_set
        assert w.reported.hashes() == set()
        assert not reg.heartbeat(_beat(added=(5, 6))).want_full_block_set
        assert w.reported.hashes() == {5, 6}
    _with_registry(body)


def test_a_restarted_worker_starts_a_fresh_state() -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(_beat(added=(1,)))
        old = reg.workers["p1"]
        old.accounting.inflight = 4
        old.perf.reserve_rpc_s.observe(0.5)
        assert old.identity.drain_timeout_s == DRAIN_TIMEOUT_S  # not reported: the default
        reg.heartbeat(_beat(incarnation="i2", drain_timeout_s=90.0))
        new = reg.workers["p1"]
        assert new is not old and new.identity.incarnation == "i2"
        assert new.identity.drain_timeout_s == 90.0  # its --drain-timeout: its calls' grace
        assert new.accounting.inflight == 0 and new.perf.reserve_rpc_s.value != 0.5
        assert new.reported.hashes() == set()
    _with_registry(body)


def test_a_last_beat_removes_the_worker_now_but_only_its_own_incarnation() -> None:
    def body(reg: WorkerRegistry) -> None:
        assert not reg.heartbeat(_beat(leaving=True)).want_full_block_set
        assert "p1" not in reg.workers  # a last beat registers nothing
        reg.heartbeat(_beat(incarnation="i2"))
        # a late last beat of an earlier incarnation, or one from another address: ignored
        reg.heartbeat(_beat(incarnation="i1", leaving=True))
        reg.heartbeat(_beat(incarnation="i2", address="127.0.0.1:10", leaving=True))
        assert reg.workers["p1"].identity.incarnation == "i2"
        reg.heartbeat(_beat(incarnation="i2", leaving=True))  # its own: gone, well before
        assert "p1" not in reg.workers and reg.alive("prefill") == []  # any missed beat
    _with_registry(body)


def test_a_beat_carries_the_engines_step_time_fit_to_the_cost_model() -> None:
    """The one model of step time: the worker's engine fits it, its beats carry it, the router
    predicts from it (a beat without one keeps the last; a malformed one is ignored)."""
    fit = StepCostFit(base=0.004, prefill_token=0.0002, attended_pair=1e-8, decode=0.0003,
                      decode_ctx_token=1e-7, samples=40, prefill_chunk=0.001)

    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(_beat())
        w = reg.workers["p1"]
        assert w.perf.step_cost is None  # the engine is still warming up: priors
        beat = _beat()
        beat.load.step_cost.CopyFrom(step_cost_to_proto(fit, 512))
        reg.heartbeat(beat)
        assert w.perf.step_cost == fit and w.perf.step_tokens == 512
        reg.heartbeat(_beat())  # none this time: the last one stays
        assert w.perf.step_cost == fit
        bad = _beat()
        negative = dataclasses.replace(fit, base=-1.0, samples=41)
        bad.load.step_cost.CopyFrom(step_cost_to_proto(negative, 512))
        reg.heartbeat(bad)
        assert w.perf.step_cost == fit
        policy = make_policy("prefix_aware", reg)
        e = policy.cost.prefill(w, RouteRequest(list(range(1000))), 0.0)
        # two steps of 512 tokens: two bases, two chunks, the tokens, their attention
        pairs = 512 * 513 // 2 + 488 * 512 + 488 * 489 // 2
        want = 2 * 0.004 + 2 * 0.001 + 1000 * 0.0002 + pairs * 1e-8
        assert e.seconds == pytest.approx(want)

    _with_registry(body)
