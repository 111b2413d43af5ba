"""Pull instead of recompute: the reader's side of a prefix pull.

The router sends a Prefill with a ``PullHint`` when another worker (the decode worker that
generated the previous turn, another prefill worker) holds a longer prefix of the prompt than
this one, and its cost model predicts reading those blocks over NIXL to be faster than
computing them. Before the prefill runs, this worker:

1. asks the holder to export the prefix (``WorkerControl.ExportPrefix``): it pins its blocks
   and answers their ids, the tokens they cover and its NIXL endpoint;
2. opens an import for the blocks it lacks (``EngineCore.begin_import``: fresh blocks, not yet
   in its prefix cache; the leading ones it holds already are not read; where its pool has room
   for only some, the leading ones that fit: the prefill recomputes the rest);
3. READs every layer's K and V of those blocks into its own (``NixlConnector.read_blocks``, in
   a thread: the copy runs in the posting call);
4. ends the export (``EndExport``: were the blocks held throughout?);
5. publishes the import only if the read completed AND the export was held throughout
   (``end_import(complete=...)``); then the prefill finds the prefix in its cache.

Fail closed: whatever goes wrong (holder unreachable or dead mid-read, read timed out, export
lapsed, no room) the import is dropped unpublished, the outcome says why (``PullOutcome``,
counted here and by the router) and the prefill recomputes. The pull never holds the request
hostage: it gets the hint's time budget, at most half of what the call has left, and each step
is bounded by what remains of it. An export left open by a failure is ended in the background;
its TTL (the budget plus a margin) ends it on the holder otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from kvrelay.common.rpc import insecure_channel
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

if TYPE_CHECKING:
    from kvrelay.kv_transfer.connector import NixlConnector

logger = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 5.0  # a hint that names no budget
EXPORT_TTL_MARGIN_S = 5.0  # the holder's pin outlives the budget by this much
MAX_SOURCES = 64  # channels to holders kept open (the least recently used one closes)


class PullSource(NamedTuple):
    """Where the prefix lives (``PullHint``)."""

    address: str  # the holder's control address
    agent: str  # its NIXL agent
    prefix_tokens: int  # leading prompt tokens it holds, as the router saw
    timeout_s: float  # 0: the default budget


class PullReport(NamedTuple):
    outcome: int  # wpb.PullOutcome
    pulled_tokens: int = 0  # published into our prefix cache
    blocks_read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def to_proto(self) -> wpb.PullResult:
        return wpb.PullResult(outcome=self.outcome, pulled_tokens=self.pulled_tokens,
                              blocks_read=self.blocks_read, bytes_read=self.bytes_read,
                              pull_ms=self.seconds * 1e3)


class _Fallback(Exception):
    def __init__(self, outcome: int, why: str) -> None:
        super().__init__(why)
        self.outcome = outcome


class PrefixPull:
    def __init__(self, engine: AsyncEngine, kv: NixlConnector,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.engine = engine
        self.kv = kv
        self._md = metadata  # the cluster token's
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._ending: set[asyncio.Task[None]] = set()
        self._peer_locks: dict[str, asyncio.Lock] = {}
        # By outcome name (PullOutcome): how each pull ended; the worker's metrics read them.
        self.outcomes: dict[str, int] = {}
        self.pulled_tokens = 0
        self.bytes_read = 0
        self.read_seconds = 0.0

    async def pull(self, rid: str, prompt: list[int], cache_salt: str | None, src: PullSource,
                   time_left_s: float | None = None) -> PullReport:
        """Pull ``prompt``'s leading blocks from ``src`` into our prefix cache; never raises
        (a failure is a report whose outcome says why; the prefill then recomputes)."""
        t0 = time.monotonic()
        budget = src.timeout_s if src.timeout_s > 0 else DEFAULT_PULL_TIMEOUT_S
        if time_left_s is not None:
            budget = min(budget, time_left_s / 2)
        try:
            report = await self._pull(prompt, cache_salt, src, t0 + budget, budget)
        except _Fallback as e:
            report = PullReport(e.outcome, seconds=time.monotonic() - t0)
            logger.info("pull for %s from %s fell back to recompute (%s): %s", rid, src.agent,
                        wpb.PullOutcome.Name(e.outcome), e)
        except Exception as e:  # never the prefill's failure: it recomputes
            report = PullReport(wpb.PULL_READ_FAILED, seconds=time.monotonic() - t0)
            logger.warning("pull for %s from %s failed, recomputing: %r", rid, src.agent, e)
        name = wpb.PullOutcome.Name(report.outcome)
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        if report.outcome == wpb.PULL_DONE:
            self.pulled_tokens += report.pulled_tokens
            self.bytes_read += report.bytes_read
            self.read_seconds += report.seconds
            logger.debug("pulled %d tokens of %s from %s in %.1f ms", report.pulled_tokens, rid,
                         src.agent, report.seconds * 1e3)
        return report

    async def _pull(self, prompt: list[int], salt: str | None, src: PullSource,
                    deadline: float, budget: float) -> PullReport:
        t0 = time.monotonic()
        core = self.engine.core
        bs = core.config.cache.block_size
        # The engine computes the last prompt token itself (its logits are the first token).
        want = min(src.prefix_tokens, (len(prompt) - 1) // bs * bs) // bs * bs
        if want <= 0 or src.agent == self.kv.agent_name:
            raise _Fallback(wpb.PULL_NOT_NEEDED, "nothing to pull")
        share = f"pull-{secrets.token_hex(8)}"
        ttl = budget + EXPORT_TTL_MARGIN_S
        stub = worker_pb2_grpc.WorkerControlStub(self._channel(src.address))
        try:
            exp = await stub.ExportPrefix(
                wpb.ExportPrefixRequest(share_id=share, prompt_token_ids=prompt[:want],
                                        cache_salt=salt or "", ttl_ms=int(ttl * 1e3)),
                metadata=self._md, timeout=_left(deadline))
        except (grpc.aio.AioRpcError, _Fallback) as e:
            raise _Fallback(wpb.PULL_SOURCE_FAILED, f"ExportPrefix: {_why(e)}") from e
        exported = bool(exp.block_ids)
        imported = False
        ok = False
        try:
            if exp.agent_name != src.agent:
                raise _Fallback(wpb.PULL_SOURCE_FAILED, f"{src.address} is agent "
                                f"{exp.agent_name!r}, not {src.agent!r}")
            covered = min(exp.tokens_covered, len(exp.block_ids) * bs)
            src_ids = list(exp.block_ids)[:covered // bs]
            if not src_ids:
                raise _Fallback(wpb.PULL_SOURCE_SHORT, "the holder holds none of it")
            await self._connect(exp)
            try:
                dst, have = await self.engine.call(core.begin_import, share, prompt[:covered],
                                                   cache_salt=salt, ttl_s=ttl)
            except (MemoryError, OverflowError) as e:
                raise _Fallback(wpb.PULL_NO_ROOM, str(e)) from e
            imported = True
            if not dst:
                raise _Fallback(wpb.PULL_NOT_NEEDED if have * bs >= covered
                                else wpb.PULL_SOURCE_SHORT, "we hold as much already")
            # The hybrid KV layout: each side's pages per layer group of the blocks read (a
            # block's windowed pages only where a continuation reads them: ``prefix_shares``).
            pages = await self.engine.call(core.share_pages, share, have)
            per_block = len(pages) // len(dst)
            src_pages = list(exp.page_ids)[have * per_block:(have + len(dst)) * per_block]
            try:
                nbytes = await _unabandoned(asyncio.to_thread(
                    self.kv.read_blocks, exp.agent_name, src_ids[have:have + len(dst)], dst,
                    timeout_s=_left(deadline), incarnation=exp.incarnation,
                    remote_pages=src_pages, local_pages=pages))
            except KVTransferError as e:
                raise _Fallback(wpb.PULL_READ_FAILED, str(e)) from e
            held = await self._end_export(stub, share, deadline)
            exported = False
            if not held:
                raise _Fallback(wpb.PULL_NOT_HELD, "the export lapsed before the read ended")
            ok = True
            published = await self.engine.call(core.end_import, share, True)
            imported = False
            return PullReport(wpb.PULL_DONE, published - have * bs, len(dst), nbytes,
                              time.monotonic() - t0)
        finally:
            if imported:  # dropped unpublished: nothing of it is ever served
                await self.engine.call(core.end_import, share, False)
            if exported and not ok:
                self._end_in_background(stub, share)

    async def _connect(self, exp: wpb.ExportPrefixResponse) -> None:
        """Add the holder's NIXL agent as a peer (once per incarnation)."""
        lock = self._peer_locks.setdefault(exp.agent_name, asyncio.Lock())
        async with lock:
            if self.kv.has_peer(exp.agent_name, exp.incarnation):
                return
            try:
                await self.engine.call(self.kv.add_peer, exp.peer_info)
            except (KVTransferError, ValueError) as e:  # incompatible layout, NIXL failure
                raise _Fallback(wpb.PULL_SOURCE_FAILED, f"adding {exp.agent_name}: {e}") from e
            logger.info("connected to KV holder %s for prefix pulls", exp.agent_name)

    async def _end_export(self, stub: worker_pb2_grpc.WorkerControlStub, share: str,
                          deadline: float) -> bool:
        try:
            resp = await stub.EndExport(wpb.EndExportRequest(share_id=share), metadata=self._md,
                                        timeout=max(_left(deadline, 0.0), 1.0))
        except grpc.aio.AioRpcError as e:
            logger.info("EndExport %s: %s", share, _why(e))
            return False
        return resp.held

    def _end_in_background(self, stub: worker_pb2_grpc.WorkerControlStub, share: str) -> None:
        """Free the holder's blocks now rather than at the export's TTL; nothing waits."""
        async def end() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await stub.EndExport(wpb.EndExportRequest(share_id=share), metadata=self._md,
                                     timeout=2.0)

        task = asyncio.get_running_loop().create_task(end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.pop(address, None)
        if ch is None:
            if len(self._channels) >= MAX_SOURCES:  # close the least recently used
                old = self._channels.pop(next(iter(self._channels)))
                task = asyncio.get_running_loop().create_task(old.close(grace=1.0))
                self._ending.add(task)  # type: ignore[arg-type]
                task.add_done_callback(self._ending.discard)  # type: ignore[arg-type]
            ch = insecure_channel(address)
        self._channels[address] = ch  # most recently used last
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()


async def _unabandoned(read: Coroutine[Any, Any, int]) -> int:
    """Await the read; a cancelled call (the request left) still waits for it to end (its own
    deadline bounds it) before the import's blocks can be dropped and reused: a read still
    running would write into blocks another request then holds."""
    task = asyncio.ensure_future(read)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # its own failure: task.result() raises it below
            break
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def _left(deadline: float, floor: float = 1e-3) -> float:
    """Seconds until ``deadline``; out of time: a fallback (``floor`` 0: never raises)."""
    left = deadline - time.monotonic()
    if left < floor:
        if floor > 0:
            raise _Fallback(wpb.PULL_READ_FAILED, "the pull's time budget ran out")
        return 0.0
    return left


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)
