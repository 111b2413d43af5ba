"""The decode workers a prefill worker sends KV to.

Each one's transfer info is fetched once per incarnation (a restarted decode worker is a new
peer); the Prefill calls under way to each are counted, so that one idle for ``PEER_IDLE_S``
can be forgotten. ``PrefillServicer`` builds on this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import grpc

from kvrelay.common.failures import FailureKind, failure_md
from kvrelay.common.rpc import insecure_channel
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

# A decode worker no request has gone to for this long is forgotten (its NIXL remote agent,
# prepared descriptors and connection lock): decode pods come and go, and each one held here
# forever would grow this worker's memory. One that comes back is reconnected on first use.
PEER_IDLE_S = 300.0


class PeerTransport(Protocol):
    """What the peer bookkeeping needs of the KV transport on the sending side."""

    def has_peer(self, agent_name: str, incarnation: str) -> bool: ...

    def add_peer(self, peer_info: bytes) -> None: ...

    def evict_peer(self, agent_name: str) -> bool: ...


class DecodePeers:
    """Connects to decode workers on first use and forgets idle ones."""

    engine: AsyncEngine
    kv: PeerTransport
    _md: tuple[tuple[str, str], ...]  # the cluster token's metadata

    def __init__(self) -> None:
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._peer_used: dict[str, float] = {}  # agent name -> last request's start
        self._peer_inflight: dict[str, int] = {}  # agent name -> Prefill calls under way

    async def _ensure_peer(self, dest: wpb.KVDestination) -> None:
        """Fetch a decode worker's transfer info once per incarnation."""
        lock = self._peer_locks.setdefault(dest.agent_name, asyncio.Lock())
        async with lock:
            if self.kv.has_peer(dest.agent_name, dest.incarnation):
                return
            async with insecure_channel(dest.decode_address) as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                info = await stub.GetTransferInfo(wpb.TransferInfoRequest(), metadata=self._md,
                                                  timeout=10.0)
            if info.incarnation != dest.incarnation:
                raise ConnectionError(f"decode worker {dest.agent_name} restarted "
                                      f"(incarnation {info.incarnation}, lease from "
                                      f"{dest.incarnation})")
            await self.engine.call(self.kv.add_peer, info.peer_info)
            logger.info("connected to decode worker %s at %s", dest.agent_name,
                        dest.decode_address)

    async def evict_idle_peers(self, now: float | None = None) -> list[str]:
        """Forget decode workers unused for ``PEER_IDLE_S`` with nothing under way to them."""
        now = time.monotonic() if now is None else now
        idle = [name for name, t in self._peer_used.items()
                if now - t > PEER_IDLE_S and not self._peer_inflight.get(name)
                and not (name in self._peer_locks and self._peer_locks[name].locked())]
        for name in idle:
            del self._peer_used[name]
            self._peer_locks.pop(name, None)
            self._peer_inflight.pop(name, None)
            await self.engine.call(self.kv.evict_peer, name)
        if idle:
            logger.info("forgot %d idle decode worker(s): %s", len(idle), ", ".join(idle))
        return idle

    def _use_peer(self, name: str, delta: int) -> None:
        """Count Prefill calls under way to a decode worker (an idle one may be evicted)."""
        self._peer_used[name] = time.monotonic()
        n = self._peer_inflight.get(name, 0) + delta
        if n > 0:
            self._peer_inflight[name] = n
        else:
            self._peer_inflight.pop(name, None)

    async def _connect(self, dest: wpb.KVDestination, context: grpc.aio.ServicerContext) -> None:
        """Reach ``dest``'s decode worker, or abort the call: an unreachable one is the
        destination's failure, an incompatible one a deployment error (nothing written)."""
        try:
            await self._ensure_peer(dest)
        except (grpc.aio.AioRpcError, ConnectionError, OSError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach decode worker {dest.agent_name}: {detail}",
                                failure_md(FailureKind.FAILURE_KV_DESTINATION))
        except ValueError as e:  # incompatible KV layouts: a deployment error
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e),
                                failure_md(FailureKind.FAILURE_INVALID_REQUEST,
                                           nothing_written=True))
