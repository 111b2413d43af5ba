"""What a decode worker does for its calls: reserve blocks under a lease, wait for the KV,
decode, and tear every call down whichever way it ends.

``DecodeService`` holds the engine, the lease table and the KV endpoint; its methods take and
return domain types and refuse with ``CallRefused`` (status code, typed failure). The gRPC
servicer (``servicer.py``) only translates. Refusals: bad input -> INVALID_ARGUMENT, no room ->
RESOURCE_EXHAUSTED, unknown lease -> NOT_FOUND, KV that never arrives or a draining worker ->
UNAVAILABLE (retriable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import ID_REUSE_WAIT_S, cache_salt_of, check_request_id
from kvrelay.common.failures import CallRefused, FailureKind
from kvrelay.common.timeline import mark
from kvrelay.decode_worker.leases import LeaseError, LeaseTable
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestIdInUse, RequestOutput
from kvrelay.engine.sampling_params import SamplingParams, check_fork_count

if TYPE_CHECKING:
    from kvrelay.kv_transfer.connector import NixlConnector

logger = logging.getLogger(__name__)

DEFAULT_KV_TIMEOUT_S = 30.0
FLUSH_WAIT_S = 5.0  # for the engine to pass on a request's last output (a step or two)


class Reserved(NamedTuple):
    lease_id: str
    block_ids: list[int]
    cached_prefix_tokens: int
    agent_name: str
    incarnation: str
    ttl_s: float
    page_ids: tuple[int, ...] = ()  # the hybrid KV layout's pages (``Reservation.page_ids``)


class DecodeItem(NamedTuple):
    """One engine output of a Decode call, with what its message says besides the output."""

    out: RequestOutput
    index: int  # the choice (0 for the request itself, k for fork k of an n > 1 request)
    kv_wait_ms: float


def fork_id(request_id: str, index: int) -> str:
    """The engine's id of choice ``index`` (from 1) of an ``n > 1`` request."""
    return f"{request_id}#{index}"


def draining_refusal() -> CallRefused:
    return CallRefused(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                       FailureKind.FAILURE_DRAINING)


class _DecodeCall:
    """One Decode call's state: its engine stream, the choices it carries, its spans, and how
    far it got (its teardown and its spans need to know)."""

    def __init__(self, rid: str, trace_parent: Any):
        self.rid = rid
        self.span: Any = None  # decode.request: the whole call
        if trace_parent is not None:
            self.span = tracing.start("decode.request", trace_parent,
                                      **{"kvrelay.request_id": rid})
        self.decoding: Any = None  # decode.decode: from the KV's arrival on
        self.stream: AsyncIterator[RequestOutput] | None = None
        self.index = {rid: 0}  # engine request id -> choice index
        self.running: set[str] = set()  # engine request ids not finished yet
        self.finished = False  # every choice finished
        self.kv_wait_ms = 0.0
        self.n_out = 0
        self._marked = False

    def item(self, out: RequestOutput) -> DecodeItem | None:
        """What the call says of one engine output; None for the KV's arrival itself."""
        if out.kv_arrived:
            return None
        if not self._marked:
            mark("decode_first_out", self.rid)
            self._marked = True
        self.n_out += len(out.new_token_ids)
        return DecodeItem(out, self.index.get(out.request_id, 0), self.kv_wait_ms)

    def ended(self, out: RequestOutput) -> bool:
        """Whether ``out`` finished the last choice still running: the call is done."""
        if out.finished:
            self.running.discard(out.request_id)
            if not self.running:
                self.finished = True
                return True
        return False

    def refuse(self, error: object, refusal: CallRefused) -> CallRefused:
        tracing.end(self.span, error=error)
        self.span = None
        return refusal

    def end_spans(self) -> None:
        if self.decoding is not None:
            self.decoding.set_attribute("kvrelay.tokens", self.n_out)
            self.decoding.set_attribute("kvrelay.finished", self.finished)
        tracing.end(self.decoding)
        tracing.end(self.span)


class DecodeService:
    def __init__(self, engine: AsyncEngine, leases: LeaseTable, kv: NixlConnector | None):
        self.engine = engine
        self.leases = leases
        self.kv = kv
        self.draining = False
        self._busy: dict[str, asyncio.Future[None]] = {}  # Decode streams being torn down
        leases.after_free = self._forget_stream

    def _receiver(self, what: str) -> NixlConnector:
        if self.kv is None:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"this worker {what} (role=both)")
        return self.kv

    def transfer_info(self) -> tuple[bytes, str]:
        kv = self._receiver("has no KV transport")
        return kv.peer_info_bytes(), kv.incarnation

    # -- leases --------------------------------------------------------------------------------
    async def reserve(self, rid: str, prompt: list[int], cache_salt: str, ttl_ms: int,
                      sender_agent: str, sender_address: str,
                      on_lease: Callable[[str], None]) -> Reserved:
        """Reserve blocks for ``prompt`` under a new lease (``on_lease`` hears its id at once,
        before the engine is asked: a caller that gives up can abandon it)."""
        kv = self._receiver("does not take remote KV")
        if self.draining:
            raise draining_refusal()
        try:
            check_request_id(rid)
            self.engine.core.validate_prompt(prompt)
            salt = cache_salt_of(cache_salt)
        except ValueError as e:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                              FailureKind.FAILURE_INVALID_REQUEST) from e
        await self._clear_id(rid)
        ttl = self.leases.ttl(ttl_ms)
        lease = self.leases.create(rid, ttl)
        on_lease(lease.lease_id)
        in_use_until = time.monotonic() + ID_REUSE_WAIT_S
        while True:
            try:
                res = await self.engine.reserve(
                    rid, prompt, kv_transfer_params=kv.expectation(
                        rid, lease.lease_id, sender_agent, sender_address), cache_salt=salt)
                break
            except EngineOverloaded as e:
                self.leases.drop(rid)
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                  FailureKind.FAILURE_OVERLOADED) from e
            except ValueError as e:
                # An earlier request of this id aborted here may hold it a moment longer (its
                # blocks quarantined until the sender's last write): transient.
                if isinstance(e, RequestIdInUse) and time.monotonic() < in_use_until:
                    await asyncio.sleep(0.02)
                    continue
                self.leases.drop(rid)
                raise _refusal_of(e) from e
        logger.debug("reserved %d blocks (%d tokens cached) lease %s", len(res.block_ids),
                     res.num_cached_tokens, lease.lease_id)
        return Reserved(lease.lease_id, res.block_ids, res.num_cached_tokens, kv.agent_name,
                        kv.incarnation, ttl, res.page_ids)

    def abandon(self, rid: str, lease_id: str) -> None:
        """A Reserve its caller gave up on (the client left) answered into the void: free the
        lease at once instead of holding its blocks until the TTL."""
        self.leases.abandon(rid, lease_id)

    async def _clear_id(self, rid: str) -> None:
        """The router holds one attempt of a request id at a time: whatever this worker still
        has under the id belongs to an attempt given up (a cancelled stream being torn down, a
        lease whose Release was lost with a dropped channel)."""
        busy = self._busy.get(rid)
        if busy is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(busy), ID_REUSE_WAIT_S)
        stale = self.leases.lease_of(rid)
        if stale is not None and not stale.decoding:
            logger.info("replacing stale lease %s", stale.lease_id)
            await self.leases.release(rid, stale.lease_id)
        elif stale is None and self.engine.has_stream(rid):
            await self._forget_stream(rid)  # its release may be under way

    def renew(self, rid: str, lease_id: str, sender_agent: str, sender_address: str) -> None:
        try:
            self.leases.renew(rid, lease_id)
        except LeaseError as e:
            raise CallRefused(grpc.StatusCode.NOT_FOUND, str(e)) from e
        if sender_agent and self.kv is not None \
                and not self.kv.bind_sender(rid, sender_agent, sender_address):
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{rid} waits for no KV here: nothing to bind")

    async def release(self, rid: str, lease_id: str, writes_settled: bool) -> bool:
        ok = await self.leases.release(rid, lease_id)
        # The release has reached the engine (``after_free`` waited for its step), so an
        # aborted transfer's hold exists by now; the router says no write can still land.
        if ok and writes_settled and self.kv is not None:
            self.kv.settle(rid)
        return ok

    # -- decoding ------------------------------------------------------------------------------
    async def decode(self, rid: str, lease_id: str, first_token: int,
                     sampling: Callable[[], SamplingParams], fork_tokens: Sequence[int],
                     kv_timeout_s: float | None,
                     trace_parent: Any = None) -> AsyncIterator[DecodeItem]:
        """The request's outputs once its KV has landed, every choice of it, to its end.
        ``sampling`` is parsed once the lease has started decoding: a bad one is refused then,
        and the lease ends with the call."""
        mark("decode_rpc_in", rid)
        call = _DecodeCall(rid, trace_parent)
        try:
            lease = self.leases.start_decoding(rid, lease_id)
        except LeaseError as e:
            raise call.refuse(e, CallRefused(grpc.StatusCode.NOT_FOUND, str(e))) from e
        # Until this stream is wholly torn down, a new Reserve of the same id waits.
        done = self._busy[rid] = asyncio.get_running_loop().create_future()
        try:
            out: RequestOutput | None = await self._await_kv(call, first_token, sampling,
                                                             fork_tokens, kv_timeout_s)
            while out is not None:
                item = call.item(out)
                if item is not None:
                    yield item
                if call.ended(out):
                    break
                out = await anext(call.stream, None)  # type: ignore[arg-type]
        finally:
            call.end_spans()
            # Every way out (finished, failed, or cancelled by the router at any await, the
            # KV wait included) frees the request, its lease and its engine stream; shielded,
            # so that a second cancel cannot cut it short.
            end = asyncio.ensure_future(self._end_decode(rid, call.stream, call.finished,
                                                      lease, done, list(call.index)[1:]))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(end)

    async def _await_kv(self, call: _DecodeCall, first_token: int,
                        parse_sampling: Callable[[], SamplingParams], fork_tokens: Sequence[int],
                        kv_timeout_s: float | None) -> RequestOutput:
        """Open the engine's stream of the request (and its forks) and wait, bounded, for its
        first output: the KV has landed then. Refuses the call when it does not."""
        rid = call.rid
        kv_timeout = kv_timeout_s or DEFAULT_KV_TIMEOUT_S
        try:
            sampling = parse_sampling()
            check_fork_count(len(fork_tokens), sampling.n)  # before a child is built
            forks = [(fork_id(rid, k), t) for k, t in enumerate(fork_tokens, start=1)]
            call.index = {rid: 0} | {cid: k for k, (cid, _) in enumerate(forks, start=1)}
            call.stream = (self.engine.decode_forks(rid, first_token, sampling, forks) if forks
                           else self.engine.decode(rid, first_token, sampling))
            t0 = time.monotonic()
            first = await asyncio.wait_for(anext(call.stream), kv_timeout)
        except (ValueError, KeyError) as e:
            raise call.refuse(e, CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                                             FailureKind.FAILURE_INVALID_REQUEST)) from e
        except TimeoutError as e:
            logger.warning("KV did not arrive within %.1fs", kv_timeout)
            raise call.refuse("KV did not arrive", CallRefused(
                grpc.StatusCode.UNAVAILABLE,
                f"KV for {rid} did not arrive within {kv_timeout:.1f}s")) from e
        t_kv = time.monotonic()
        call.kv_wait_ms = (t_kv - t0) * 1000.0
        if call.span is not None:
            tracing.record("decode.kv_wait", call.span, t0, t_kv)
            call.decoding = tracing.start("decode.decode", call.span, start_s=t_kv)
        call.running = set(call.index)
        return first

    async def generate_local(self, rid: str, prompt: list[int], sampling: SamplingParams,
                             cache_salt: str, trace_parent: Any = None) \
            -> AsyncIterator[RequestOutput]:
        """Prefill and decode here (role=both, and the fast lane of decode workers)."""
        span = None
        if trace_parent is not None:  # the whole request here: prefill and decode alike
            span = tracing.start("worker.generate_local", trace_parent,
                                 **{"kvrelay.request_id": rid})
        if self.draining:
            tracing.end(span, error="draining")
            raise draining_refusal()
        try:
            check_request_id(rid)
            stream = self.engine.generate(rid, prompt, sampling,
                                          cache_salt=cache_salt_of(cache_salt))
            first = await anext(stream)
        except EngineOverloaded as e:
            tracing.end(span, error=e)
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                              FailureKind.FAILURE_OVERLOADED) from e
        except ValueError as e:
            tracing.end(span, error=e)
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                              FailureKind.FAILURE_INVALID_REQUEST) from e
        out: RequestOutput | None = first
        try:
            while out is not None:
                yield out
                if out.finished:
                    break
                out = await anext(stream, None)
        finally:
            tracing.end(span)
            await stream.aclose()

    async def _end_decode(self, rid: str, stream: AsyncIterator[RequestOutput] | None,
                          finished: bool, lease: object, done: asyncio.Future[None],
                          forks: list[str]) -> None:
        try:
            if not finished:
                for cid in forks:  # choices of an n > 1 request, before the reservation's
                    await self.engine.abort(cid)
                await self.engine.abort(rid)  # its last output (ABORT) ends the stream
            if stream is not None:
                # Read the engine's stream to its end rather than only closing it: closing leaves
                # the engine's inner generator to the garbage collector, whose late cleanup
                # would drop the queue (and abort the request) of a later request of this id.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_exhaust(stream), 5.0)
                await stream.aclose()  # type: ignore[attr-defined]
            if not finished:
                await self._forget_stream(rid)
        finally:
            if self.leases.lease_of(rid) is lease:
                self.leases.drop(rid)
            if self._busy.get(rid) is done:
                del self._busy[rid]
            done.set_result(None)

    async def _forget_stream(self, request_id: str) -> None:
        """Drop the engine's output queue of a request that is not decoding here (any more).

        ``AsyncEngine.reserve`` opens it and only ``decode()`` removes it: a lease released or
        expired before Decode (a client cancel mid-prefill, a first token that ends the request,
        a failed prefill) would leave it forever, and the request id could never be reserved
        here again. Bounded, like every wait here.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.engine.forget(request_id), FLUSH_WAIT_S)


def _refusal_of(e: ValueError) -> CallRefused:
    if isinstance(e, RequestIdInUse):
        return CallRefused(grpc.StatusCode.UNAVAILABLE, str(e),
                           FailureKind.FAILURE_REQUEST_ID_IN_USE)
    return CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                       FailureKind.FAILURE_INVALID_REQUEST)


async def _exhaust(stream: AsyncIterator[RequestOutput]) -> None:
    async for _ in stream:
        pass
