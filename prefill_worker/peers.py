"""The decode workers a prefill worker sends KV to.

Each one's transfer info is fetched once per incarnation (a restarted decode worker is a new
peer); the Prefill calls under way to each are counted (``using``: the +1 and its -1 together),
so that one idle for ``PEER_IDLE_S`` can be forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import grpc

from kvrelay.common.failures import CallRefused, FailureKind
from kvrelay.common.rpc import insecure_channel
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

if TYPE_CHECKING:
    from kvrelay.kv_transfer.connector import NixlConnector

logger = logging.getLogger(__name__)

# A decode worker no request has gone to for this long is forgotten (its NIXL remote agent,
# prepared descriptors and connection lock): decode pods come and go, and each one held here
# forever would grow this worker's memory. One that comes back is reconnected on first use.
PEER_IDLE_S = 300.0


class DecodeTarget(NamedTuple):
    """Where a prefill's KV goes: the decode worker and the blocks its lease reserved."""

    agent_name: str
    decode_address: str
    incarnation: str
    block_ids: list[int]
    skip_prefix_tokens: int
    lease_id: str
    # Under the hybrid KV layout, each block's page per layer group (-1: none), block-major.
    page_ids: tuple[int, ...] = ()


class DecodePeers:
    """Connects to decode workers on first use and forgets idle ones."""

    def __init__(self, engine: AsyncEngine, kv: NixlConnector,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.engine = engine
        self.kv = kv
        self._md = metadata  # the cluster token's
        self._locks: dict[str, asyncio.Lock] = {}
        self._used: dict[str, float] = {}  # agent name -> last request's start
        self._inflight: dict[str, int] = {}  # agent name -> Prefill calls under way

    async def connect(self, dest: DecodeTarget) -> None:
        """Reach ``dest``'s decode worker, or refuse the call: an unreachable one is the
        destination's failure, an incompatible one a deployment error (nothing written)."""
        try:
            await self._ensure(dest)
        except (grpc.aio.AioRpcError, ConnectionError, OSError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            raise CallRefused(grpc.StatusCode.UNAVAILABLE,
                              f"cannot reach decode worker {dest.agent_name}: {detail}",
                              FailureKind.FAILURE_KV_DESTINATION) from e
        except ValueError as e:  # incompatible KV layouts: a deployment error
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, str(e),
                              FailureKind.FAILURE_INVALID_REQUEST, nothing_written=True) from e

    async def _ensure(self, dest: DecodeTarget) -> None:
        """Fetch a decode worker's transfer info once per incarnation."""
        lock = self._locks.setdefault(dest.agent_name, asyncio.Lock())
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

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """A Prefill call under way to decode worker ``name`` (an idle one may be evicted)."""
        self.use(name, +1)
        try:
            yield
        finally:
            self.use(name, -1)

    def use(self, name: str, delta: int) -> None:
        """Count a call to ``name`` in (+1) or out (-1), for a call whose destination comes
        later than it starts (``SetDestination``): pair each +1 with its -1."""
        self._used[name] = time.monotonic()
        n = self._inflight.get(name, 0) + delta
        if n > 0:
            self._inflight[name] = n
        else:
            self._inflight.pop(name, None)

    async def evict_idle(self, now: float | None = None) -> list[str]:
        """Forget decode workers unused for ``PEER_IDLE_S`` with nothing under way to them."""
        now = time.monotonic() if now is None else now
        idle = [name for name, t in self._used.items()
                if now - t > PEER_IDLE_S and not self._inflight.get(name)
                and not (name in self._locks and self._locks[name].locked())]
        for name in idle:
            del self._used[name]
            self._locks.pop(name, None)
            self._inflight.pop(name, None)
            await self.engine.call(self.kv.evict_peer, name)
        if idle:
            logger.info("forgot %d idle decode worker(s): %s", len(idle), ", ".join(idle))
        return idle
