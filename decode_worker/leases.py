"""Leases on reserved KV blocks: every reservation has an owner (the router) and a deadline.

A lease starts at Reserve with a TTL the router renews while the prompt is prefilled elsewhere.
Once the Decode stream opens, the stream holds the request (a dropped stream aborts it) and the
lease no longer expires. Release, expiry, or the end of the stream frees the blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvrelay.common.rpc import LEASE_TTL_S

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    lease_id: str
    request_id: str
    expires_at: float
    decoding: bool = False
    abandoned: bool = False  # its Reserve was cancelled: nobody holds the lease id


class LeaseError(KeyError):
    pass


class LeaseTable:
    def __init__(self, free: Callable[[str], Awaitable[object]], *,
                 default_ttl_s: float = LEASE_TTL_S, max_ttl_s: float = 120.0,
                 reap_interval_s: float = 0.2):
        self._free = free  # frees a request's blocks (engine abort)
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.reap_interval_s = reap_interval_s
        self._by_request: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None
        self.num_expired = 0
        # Awaited after the blocks of a lease that never started decoding were freed (release,
        # expiry): the decode servicer forgets the request's engine stream there.
        self.after_free: Callable[[str], Awaitable[object]] | None = None

    def __len__(self) -> int:
        return len(self._by_request)

    def ttl(self, requested_ms: int) -> float:
        if requested_ms <= 0:
            return self.default_ttl_s
        return min(requested_ms / 1000.0, self.max_ttl_s)

    def create(self, request_id: str, ttl_s: float) -> Lease:
        lease = Lease(secrets.token_hex(8), request_id, time.monotonic() + ttl_s)
        self._by_request[request_id] = lease
        return lease

    def lease_of(self, request_id: str) -> Lease | None:
        """The request's lease, whatever its id (None when it has none)."""
        return self._by_request.get(request_id)

    def get(self, request_id: str, lease_id: str) -> Lease:
        lease = self._by_request.get(request_id)
        if lease is None or lease.lease_id != lease_id:
            raise LeaseError(f"no lease {lease_id!r} for request {request_id!r} (expired or "
                             f"released)")
        return lease

    def abandon(self, request_id: str, lease_id: str) -> None:
        """The caller gave up on the Reserve that made this lease (it may never have learnt
        the lease id): the reaper frees it at its next round instead of at the TTL."""
        lease = self._by_request.get(request_id)
        if lease is not None and lease.lease_id == lease_id and not lease.decoding:
            lease.abandoned = True
            lease.expires_at = float("-inf")

    def renew(self, request_id: str, lease_id: str, ttl_s: float | None = None) -> None:
        lease = self.get(request_id, lease_id)
        lease.expires_at = time.monotonic() + (ttl_s or self.default_ttl_s)

    def start_decoding(self, request_id: str, lease_id: str) -> Lease:
        lease = self.get(request_id, lease_id)
        if lease.decoding:
            raise LeaseError(f"request {request_id!r} is already decoding")
        lease.decoding = True
        return lease

    def drop(self, request_id: str) -> Lease | None:
        """Forget the lease (the caller frees or has freed the blocks)."""
        return self._by_request.pop(request_id, None)

    async def release(self, request_id: str, lease_id: str) -> bool:
        """End a lease; an empty ``lease_id`` ends the request's lease unless it is decoding
        (the caller gave up on its Reserve before reading the id)."""
        lease = self._by_request.get(request_id)
        if lease is None or (lease.lease_id != lease_id if lease_id else lease.decoding):
            return False
        del self._by_request[request_id]
        await self._free(request_id)
        if not lease.decoding and self.after_free is not None:
            await self.after_free(request_id)
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._reap())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            now = time.monotonic()
            expired = [lease for lease in self._by_request.values()
                       if not lease.decoding and lease.expires_at < now]
            for lease in expired:
                del self._by_request[lease.request_id]
                if lease.abandoned:
                    logger.info("lease %s of %s abandoned (its Reserve was cancelled): freeing "
                                "its blocks", lease.lease_id, lease.request_id,
                                extra={"request_id": lease.request_id})
                else:
                    self.num_expired += 1
                    logger.warning("lease %s of %s expired: freeing its blocks",
                                   lease.lease_id, lease.request_id,
                                   extra={"request_id": lease.request_id})
                try:
                    await self._free(lease.request_id)
                    if self.after_free is not None:
                        await self.after_free(lease.request_id)
                except Exception:
                    logger.exception("freeing %s failed", lease.request_id)
