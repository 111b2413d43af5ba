"""Ending the holds on blocks a decode worker gave up before their KV arrived.

When a reservation ends early (a client cancel, an expired lease, a released one) its prefill
may still be writing, or may not have started: the connector holds the blocks
(``kv_transfer.recv_tracker.Quarantine``) until the sender is known to be done. The fast way to know
is to ask it: ``PrefillWorker.Fence`` makes the sender refuse every later write under the lease
and abort a prefill of it under way, and answers whether anything of it can still land. When it
can, the sender's abort notice follows its last write and ends the hold; when the sender cannot
be reached, the hold ends once no router lists it any more (``Quarantine.observe_alive``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvrelay.common.rpc import insecure_channel, token_metadata
from kvrelay.kv_transfer.notice import lease_of
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 2.0
FENCE_RETRIES = (0.2, 0.5, 1.0, 2.0, 4.0)  # pauses between attempts while the sender is silent


class Fencer:
    """Asks each held transfer's sender to fence it, and settles the hold when it is done."""

    def __init__(self, settle: Callable[[str], bool], *, cluster_token: str | None = None):
        self._settle = settle  # NixlConnector.settle: end a hold (thread-safe)
        self._md = token_metadata(cluster_token)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_fenced = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def on_hold(self, request_id: str, notif: bytes, sender: str | None,
                address: str | None) -> None:
        """The connector's hook (engine thread): a new hold on ``request_id``'s blocks."""
        if self._loop is None or not address:
            return  # an unbound transfer: its notice, the sender's departure or the backstop
        self._loop.call_soon_threadsafe(self._spawn, request_id, lease_of(notif), sender, address)

    def _spawn(self, request_id: str, lease_id: str, sender: str | None, address: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._fence(request_id, lease_id, sender, address))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fence(self, request_id: str, lease_id: str, sender: str | None,
                     address: str) -> None:
        req = wpb.FenceRequest(request_id=request_id, lease_id=lease_id)
        for pause in (*FENCE_RETRIES, None):
            try:
                async with insecure_channel(address) as ch:
                    resp = await worker_pb2_grpc.PrefillWorkerStub(ch).Fence(
                        req, metadata=self._md, timeout=FENCE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.UNIMPLEMENTED,
                                grpc.StatusCode.UNAUTHENTICATED):
                    logger.warning("sender %s refused to fence %s: %s", sender, request_id,
                                   e.details())
                    return
                if pause is None:
                    logger.info("sender %s of %s unreachable (%s): its blocks wait for it to "
                                "leave the cluster", sender, request_id, e.code().name)
                    return
                await asyncio.sleep(pause)
                continue
            self.num_fenced += 1
            if resp.done:
                self._settle(request_id)
            return

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
