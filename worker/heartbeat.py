"""Workers announce themselves and their load to every router, once a beat.

A router that misses a worker's beats takes it out of its registry; a restarted router learns
the cluster again within one interval. Beats also carry the prefix-cache block hashes each KV
tier of the worker holds (``TierBlocks``, per medium: the pool, host memory, disk; deltas, the
full sets when the router asks), for prefix-aware routing. The ``tier_hashes`` callback
(``EngineCore.cached_hash_sets``) returns a set per medium, the very same set object while that
tier is unchanged, so an idle tier costs no diff. A block demoted from the pool to host memory
leaves one tier's set and enters another's: both changes ride in the same beat, and the router
never loses it.

A router refuses the beats of a worker whose KV layout differs from its cluster's
(``common/kv_layout.py``; FAILED_PRECONDITION): the worker logs why at ERROR (once, then again
whenever the reason changes or every ``REFUSAL_LOG_EVERY`` refusals) and keeps beating, so it
joins once the mismatch is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

import grpc

from kvrelay.common.rpc import HEARTBEAT_INTERVAL_S, insecure_channel, token_metadata
from kvrelay.engine.tiers.media import TierStats
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

REFUSAL_LOG_EVERY = 60  # beats a router refused in a row between two ERROR lines of one reason
TierSets = Mapping[str, AbstractSet[int]]


def tier_loads(tiers: Mapping[str, TierStats]) -> list[wpb.TierLoad]:
    """The beat's account of the tiers below the KV pool (``EngineStats.kv_tiers``)."""
    return [wpb.TierLoad(medium=medium, capacity_blocks=t.capacity_blocks,
                         used_blocks=t.used_blocks, hit_blocks=t.hit_blocks,
                         load_seconds_per_block=t.load_seconds_per_block,
                         load_failures=t.load_failures, stored_blocks=t.stored_blocks,
                         loaded_bytes=t.loaded_bytes, evicted_blocks=t.evicted_blocks)
            for medium, t in sorted(tiers.items())]


def tier_deltas(current: TierSets, sent: TierSets | None) -> list[wpb.TierBlocks]:
    """What a beat says of the block hashes of each tier: each tier in full when the router
    knows nothing (``sent`` is None) or nothing of that tier, else the changes of each tier
    whose set is not the very object sent last (none when an equal copy); a tier gone since
    (none is, today) in full, empty."""
    out = []
    for medium, held in current.items():
        prev = sent.get(medium) if sent is not None else None
        if prev is None:
            out.append(wpb.TierBlocks(medium=medium, added=held, full=True))
        elif held is not prev:
            added, removed = held - prev, prev - held
            if added or removed:
                out.append(wpb.TierBlocks(medium=medium, added=added, removed=removed))
    if sent is not None:
        out += [wpb.TierBlocks(medium=m, full=True) for m in sent if m not in current]
    return out


class Heartbeater:
    def __init__(self, routers: list[str], info: wpb.WorkerInfo,
                 load: Callable[[], wpb.WorkerLoad],
                 tier_hashes: Callable[[], TierSets] | None = None, *,
                 interval_s: float = HEARTBEAT_INTERVAL_S, cluster_token: str | None = None,
                 on_answer: Callable[[str, wpb.HeartbeatResponse], None] | None = None,
                 on_proof: Callable[[float], None] | None = None):
        self.routers = routers
        self.on_answer = on_answer  # called with each router's answer to a beat
        # Called with the monotonic time an answered beat was sent: a router listed us then.
        self.on_proof = on_proof
        self.info = info
        self.load = load
        self.tier_hashes = tier_hashes
        self.interval_s = interval_s
        self._md = token_metadata(cluster_token)
        self._tasks: list[asyncio.Task[None]] = []
        self.beats_sent = 0
        self.refused: dict[str, str] = {}  # router -> why it refuses this worker's beats now

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._beat(r), name=f"heartbeat-{r}")
                       for r in self.routers]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def beat_now(self, *, leaving: bool = False, timeout_s: float = 2.0) -> None:
        """One immediate beat to every router: to announce draining, or (``leaving``) the
        last one, so that routers forget this worker now rather than after missed beats."""
        await asyncio.gather(*(self._send_once(r, leaving, timeout_s) for r in self.routers),
                             return_exceptions=True)

    async def _send_once(self, router: str, leaving: bool, timeout_s: float) -> None:
        async with insecure_channel(router) as ch:
            stub = worker_pb2_grpc.RegistryStub(ch)
            req = wpb.HeartbeatRequest(worker=self.info, load=self.load(), leaving=leaving)
            await stub.Heartbeat(req, metadata=self._md, timeout=timeout_s)

    def _refused(self, router: str, e: grpc.aio.AioRpcError, refusals: int,
                 last: str | None) -> None:
        """A router refused a beat as out of bounds or of another KV layout: at ERROR, since
        the worker serves nothing through it until that changes."""
        why = e.details() or ""
        self.refused[router] = why
        if why != last or refusals % REFUSAL_LOG_EVERY == 1:
            logger.error("router %s refuses this worker (%s): %s", router, e.code().name, why)

    async def _beat(self, router: str) -> None:
        sent: TierSets | None = None  # the block hashes per tier this router knows of
        failures = refusals = 0
        last_refusal: str | None = None
        ch = insecure_channel(router)
        stub = worker_pb2_grpc.RegistryStub(ch)
        try:
            while True:
                req = wpb.HeartbeatRequest(worker=self.info, load=self.load())
                # the same set objects if unchanged (the engine's snapshot of each tier)
                current = dict(self.tier_hashes()) if self.tier_hashes is not None else None
                if current is not None:
                    req.tiers.extend(tier_deltas(current, sent))
                sent_at = time.monotonic()
                try:
                    resp = await stub.Heartbeat(req, metadata=self._md, timeout=2.0)
                except grpc.aio.AioRpcError as e:
                    failures += 1
                    sent = None  # the router may have restarted: resend everything
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        refusals += 1
                        self._refused(router, e, refusals, last_refusal)
                        last_refusal = e.details()
                    else:
                        log = logger.warning if failures in (1, 10) else logger.debug
                        log("heartbeat to %s failed (%s): %s", router, e.code().name,
                            e.details())
                    await asyncio.sleep(self.interval_s)
                    continue
                if failures:
                    logger.info("heartbeats to %s restored", router)
                failures = refusals = 0
                last_refusal = None
                self.refused.pop(router, None)
                self.beats_sent += 1
                sent = None if resp.want_full_block_set else current
                if self.on_proof is not None:
                    self.on_proof(sent_at)
                if self.on_answer is not None:
                    self.on_answer(router, resp)
                await asyncio.sleep(resp.interval_s or self.interval_s)
        finally:
            await ch.close()
