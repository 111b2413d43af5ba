"""The holder's side of a prefix pull: lend the blocks of a prefix held here to a peer's NIXL
READ (``WorkerControl.ExportPrefix`` / ``EndExport``).

A prefill worker about to recompute a prefix that this worker holds (the history a decode
worker generated, a prompt another prefill worker computed) asks for it instead. The engine
pins the blocks (``EngineCore.export_prefix``: the pool's, or promoted from a tier below) until
``end`` or the TTL, so the pool cannot hand them to another request while the peer reads; the
reader trusts what it read only if ``end`` says they were held throughout. While any export is
open the connector progresses UCX (``NixlConnector.lend``): the reader's first read on a fresh
connection waits for this side's handshake answer. Every export ends, by ``end`` or its TTL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NamedTuple

import grpc

from kvrelay.common.convert import cache_salt_of, check_request_id
from kvrelay.common.failures import CallRefused, FailureKind
from kvrelay.engine.async_engine import AsyncEngine

if TYPE_CHECKING:
    from kvrelay.kv_transfer.connector import NixlConnector

logger = logging.getLogger(__name__)

DEFAULT_EXPORT_TTL_S = 10.0  # a request that names none
MAX_EXPORT_TTL_S = 60.0  # the longest a peer may pin our blocks without ending the export


class Export(NamedTuple):
    block_ids: list[int]  # ours, in prefix order; empty: none held, no export opened
    tokens: int
    peer_info: bytes  # our NIXL endpoint (``PeerInfo.to_bytes``)
    agent_name: str
    incarnation: str
    page_ids: tuple[int, ...] = ()  # the hybrid KV layout's (``EngineCore.share_pages``)


class PrefixExports:
    def __init__(self, engine: AsyncEngine, kv: NixlConnector | None) -> None:
        self.engine = engine
        self.kv = kv
        self._open: dict[str, asyncio.TimerHandle] = {}  # share id -> its TTL's timer
        self._peer_info: bytes | None = None
        self._lapsing: set[asyncio.Task[bool]] = set()
        self.num_exports = 0  # exports opened (blocks lent)
        self.num_lapsed = 0  # ended by their TTL, not by the reader

    async def export(self, share_id: str, token_ids: list[int], cache_salt: str,
                     ttl_s: float) -> Export:
        if self.kv is None:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              "this worker has no KV transfer agent (role both): it lends no "
                              "blocks", FailureKind.FAILURE_INVALID_REQUEST)
        ttl = DEFAULT_EXPORT_TTL_S if ttl_s <= 0 else min(ttl_s, MAX_EXPORT_TTL_S)
        try:
            check_request_id(share_id)
            salt = cache_salt_of(cache_salt)
            if share_id in self._open:
                raise ValueError(f"share {share_id!r} is already open")
            block_ids, tokens = await self.engine.call(
                self.engine.core.export_prefix, share_id, token_ids, cache_salt=salt, ttl_s=ttl)
            pages = await self.engine.call(self.engine.core.share_pages, share_id) \
                if block_ids else ()
        except OverflowError as e:  # too many exports open at once
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                              FailureKind.FAILURE_OVERLOADED) from e
        except ValueError as e:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                              FailureKind.FAILURE_INVALID_REQUEST) from e
        if block_ids:
            self.kv.lend(+1)
            self._open[share_id] = asyncio.get_running_loop().call_later(
                ttl, self._lapse, share_id)
            self.num_exports += 1
        info = self._peer_info
        if info is None:
            info = self._peer_info = self.kv.peer_info_bytes()
        return Export(block_ids, tokens, info, self.kv.agent_name,
                      self.kv.transport.incarnation, pages)

    async def end(self, share_id: str) -> bool:
        """Release an export; True if its blocks were held until now (the read is valid)."""
        timer = self._open.pop(share_id, None)
        if timer is not None:
            timer.cancel()
            self._stop_lending()
        return bool(await self.engine.call(self.engine.core.end_export, share_id))

    def _lapse(self, share_id: str) -> None:
        """The TTL passed without an ``end``: let the blocks go now (an idle engine would
        expire the pin only at its next step), so a late ``end`` says it was not held."""
        if self._open.pop(share_id, None) is not None:
            self.num_lapsed += 1
            self._stop_lending()
            logger.info("prefix export %s lapsed (its reader never ended it)", share_id)
            task = asyncio.get_running_loop().create_task(
                self.engine.call(self.engine.core.end_export, share_id))
            self._lapsing.add(task)
            task.add_done_callback(self._lapsing.discard)

    def _stop_lending(self) -> None:
        if self.kv is not None:
            self.kv.lend(-1)

    def close(self) -> None:
        for timer in self._open.values():
            timer.cancel()
        self._open.clear()
