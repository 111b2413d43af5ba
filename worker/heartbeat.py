"""Workers announce themselves and their load to every router, once a beat.

A router that misses a worker's beats takes it out of its registry; a restarted router learns
the cluster again within one interval. Beats also carry the prefix-cache block hashes the
worker holds (deltas; the full set when the router asks), for prefix-aware routing. The
``block_hashes`` callback should return the very same set object while nothing changed, so an
idle cache costs no diff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import grpc

from kvrelay.common.rpc import HEARTBEAT_INTERVAL_S, insecure_channel, token_metadata
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)


class Heartbeater:
    def __init__(self, routers: list[str], info: wpb.WorkerInfo,
                 load: Callable[[], wpb.WorkerLoad],
                 block_hashes: Callable[[], AbstractSet[int]] | None = None, *,
                 interval_s: float = HEARTBEAT_INTERVAL_S, cluster_token: str | None = None,
                 on_answer: Callable[[str, wpb.HeartbeatResponse], None] | None = None,
                 on_proof: Callable[[float], None] | None = None):
        self.routers = routers
        self.on_answer = on_answer  # called with each router's answer to a beat
        # Called with the monotonic time an answered beat was sent: a router listed us then.
        self.on_proof = on_proof
        self.info = info
        self.load = load
        self.block_hashes = block_hashes
        self.interval_s = interval_s
        self._md = token_metadata(cluster_token)
        self._tasks: list[asyncio.Task[None]] = []
        self.beats_sent = 0

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

    async def _beat(self, router: str) -> None:
        sent: AbstractSet[int] | None = None  # block hashes this router knows of
        failures = 0
        ch = insecure_channel(router)
        stub = worker_pb2_grpc.RegistryStub(ch)
        try:
            while True:
                req = wpb.HeartbeatRequest(worker=self.info, load=self.load())
                current = self.block_hashes() if self.block_hashes is not None else None
                if current is not None:
                    if sent is None:
                        req.full_block_set = True
                        req.added_block_hashes.extend(current)
                    elif current is not sent:  # the callback returns the same set if unchanged
                        req.added_block_hashes.extend(current - sent)
                        req.removed_block_hashes.extend(sent - current)
                sent_at = time.monotonic()
                try:
                    resp = await stub.Heartbeat(req, metadata=self._md, timeout=2.0)
                except grpc.aio.AioRpcError as e:
                    failures += 1
                    sent = None  # the router may have restarted: resend everything
                    log = logger.warning if failures in (1, 10) else logger.debug
                    log("heartbeat to %s failed (%s): %s", router, e.code().name, e.details())
                    await asyncio.sleep(self.interval_s)
                    continue
                if failures:
                    logger.info("heartbeats to %s restored", router)
                failures = 0
                self.beats_sent += 1
                sent = None if resp.want_full_block_set else current
                if self.on_proof is not None:
                    self.on_proof(sent_at)
                if self.on_answer is not None:
                    self.on_answer(router, resp)
                await asyncio.sleep(resp.interval_s or self.interval_s)
        finally:
            await ch.close()
