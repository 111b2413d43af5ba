"""A router whose own loop stalls (blocked, or its process starved of CPU) must not blame its
workers: beats that sat unread in its sockets meanwhile were sent on time. A worker's silence
counts only the time the router was listening; a worker silent past the stall still goes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.registry import Stalls, WorkerRegistry

BEAT_S = 0.05  # the timeout: three beats, 0.15 s


def _beat(worker_id: str) -> wpb.HeartbeatRequest:
    return wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=worker_id, role=wpb.ROLE_DECODE, address="127.0.0.1:9",
                              incarnation="i1", block_size=16, max_model_len=4096),
        load=wpb.WorkerLoad(num_blocks=8, free_blocks=8),
        tiers=[wpb.TierBlocks(medium="device", full=True)])


def test_silence_leaves_out_the_spans_the_router_was_away() -> None:
    s = Stalls()
    s.note(10.0, 12.0)
    s.note(13.0, 13.5)
    s.note(14.0, 14.0)  # empty: not a stall
    assert s.silence(9.0, 15.0) == 6.0 - 2.5
    assert s.silence(11.0, 15.0) == 4.0 - 1.5  # a beat read mid-span: only the rest counts
    assert s.silence(13.6, 15.0) == pytest.approx(1.4)


def test_a_stalled_router_keeps_workers_that_beat_and_drops_one_that_does_not() -> None:
    async def run() -> tuple[set[str], set[str]]:
        reg = WorkerRegistry(heartbeat_interval_s=BEAT_S)
        reg.heartbeat(_beat("alive"))
        reg.heartbeat(_beat("dead"))
        reg.start()
        try:
            await asyncio.sleep(BEAT_S)
            reg.heartbeat(_beat("alive"))
            reg.heartbeat(_beat("dead"))  # its last beat
            time.sleep(5 * BEAT_S)  # the loop is blocked for longer than the timeout
            for _ in range(3):
                await asyncio.sleep(0)  # the reaper's late round runs
            after_stall = set(reg.workers)
            # The beat the live worker sent during the stall is read now.
            reg.heartbeat(_beat("alive"))
            deadline = time.monotonic() + 100 * BEAT_S  # (bounded; ~4 beats here)
            while "dead" in reg.workers and time.monotonic() < deadline:
                await asyncio.sleep(BEAT_S / 2)
                reg.heartbeat(_beat("alive"))
            return after_stall, set(reg.workers)
        finally:
            await reg.stop()

    after_stall, later = asyncio.run(run())
    assert after_stall == {"alive", "dead"}, "a stall of the router's own loop dropped workers"
    assert later == {"alive"}, "a worker silent after the stall was kept"
