"""DecodeWorker gRPC servicer: reserve blocks, wait for KV, stream decoded tokens.

Servicers only translate: protobuf in, engine calls, protobuf out. Engine errors map to status
codes: bad input -> INVALID_ARGUMENT, no room -> RESOURCE_EXHAUSTED, unknown lease ->
NOT_FOUND, KV that never arrives or a draining worker -> UNAVAILABLE (retriable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import (
    ID_REUSE_WAIT_S,
    cache_salt_of,
    check_request_id,
    finish_to_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from kvrelay.common.failures import FailureKind, failure_md
from kvrelay.common.logs import request_context
from kvrelay.common.timeline import mark
from kvrelay.decode_worker.leases import LeaseError, LeaseTable
from kvrelay.decode_worker.sessions import SessionServer, SessionServicer
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestIdInUse, RequestOutput
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_KV_TIMEOUT_S = 30.0


class KVReceiver(Protocol):
    """What the servicer needs of the KV transport on the receiving side."""

    agent_name: str
    incarnation: str

    def peer_info_bytes(self) -> bytes: ...

    def expectation(self, request_id: str, lease_id: str, sender: str = "",
                    sender_address: str = "") -> object: ...

    def bind_sender(self, request_id: str, sender: str, sender_address: str = "") -> bool: ...

    def settle(self, request_id: str) -> bool: ...


FLUSH_WAIT_S = 5.0  # for the engine to pass on a request's last output (a step or two)


def fork_id(request_id: str, index: int) -> str:
    """The engine's id of choice ``index`` (from 1) of an ``n > 1`` request."""
    return f"{request_id}#{index}"


def decode_response(out: RequestOutput) -> wpb.DecodeResponse:
    msg = _decode_response(out)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    return msg


def _decode_response(out: RequestOutput) -> wpb.DecodeResponse:
    return wpb.DecodeResponse(
        token_ids=out.new_token_ids,
        logprobs=[logprob_to_proto(lp) for lp in out.logprobs] if any(out.logprobs) else [],
        finish_reason=finish_to_proto(out.finish_reason if out.finished else None),
        error=out.error or "",
        cached_prompt_tokens=out.num_cached_tokens,
    )


class _DecodeCall:
    """One Decode call's state: its engine stream, the choices it carries, its spans, and how
    far it got (its teardown and its spans need to know)."""

    def __init__(self, rid: str):
        self.rid = rid
        self.span: Any = None  # decode.request: the whole call
        self.decoding: Any = None  # decode.decode: from the KV's arrival on
        self.stream: AsyncIterator[RequestOutput] | None = None
        self.index = {rid: 0}  # engine request id -> choice index
        self.running: set[str] = set()  # engine request ids not finished yet
        self.finished = False  # every choice finished
        self.kv_wait_ms = 0.0
        self.n_out = 0
        self._marked = False

    def message(self, out: RequestOutput) -> wpb.DecodeResponse | None:
        """The stream message of one engine output; None for the KV's arrival itself."""
        if out.kv_arrived:
            return None
        if not self._marked:
            mark("decode_first_out", self.rid)
            self._marked = True
        msg = decode_response(out)
        msg.kv_wait_ms = self.kv_wait_ms
        msg.index = self.index.get(out.request_id, 0)
        self.n_out += len(out.new_token_ids)
        return msg

    def ended(self, out: RequestOutput) -> bool:
        """Whether ``out`` finished the last choice still running: the call is done."""
        if out.finished:
            self.running.discard(out.request_id)
            if not self.running:
                self.finished = True
                return True
        return False

    def end_spans(self) -> None:
        if self.decoding is not None:
            self.decoding.set_attribute("kvrelay.tokens", self.n_out)
            self.decoding.set_attribute("kvrelay.finished", self.finished)
        tracing.end(self.decoding)
        tracing.end(self.span)


class DecodeServicer(SessionServicer, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: AsyncEngine, leases: LeaseTable, kv: KVReceiver | None):
        self.engine = engine
        self.leases = leases
        self.kv = kv
        self.draining = False
        self._busy: dict[str, asyncio.Future[None]] = {}  # Decode streams being torn down
        leases.after_free = self._forget_stream
        # The router's Sessions: its Decode and GenerateLocal calls, many over one stream.
        self.sessions = SessionServer({"decode": self.Decode,
                                       "generate_local": self.GenerateLocal})

    async def GetTransferInfo(self, request: wpb.TransferInfoRequest,
                              context: grpc.aio.ServicerContext) -> wpb.TransferInfo:
        if self.kv is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker has no KV transport (role=both)")
        return wpb.TransferInfo(peer_info=self.kv.peer_info_bytes(),
                                incarnation=self.kv.incarnation)

    async def Reserve(self, request: wpb.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> wpb.ReserveResponse:
        if not tracing.enabled():
            return await self._reserve(request, context)
        with tracing.span("decode.reserve", tracing.from_metadata(context.invocation_metadata()),
                          **{"kvrelay.request_id": request.request_id}) as span:
            resp = await self._reserve(request, context)
            span.set_attribute("kvrelay.blocks", len(resp.block_ids))
            span.set_attribute("kvrelay.cached_prefix_tokens", resp.cached_prefix_tokens)
            return resp

    async def _reserve(self, request: wpb.ReserveRequest,
                       context: grpc.aio.ServicerContext) -> wpb.ReserveResponse:
        rid = request.request_id
        with request_context(rid):
            if self.kv is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this worker does not take remote KV (role=both)")
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                                    failure_md(FailureKind.FAILURE_DRAINING))
            ids = list(request.prompt_token_ids)
            try:
                check_request_id(rid)
                self.engine.core.validate_prompt(ids)
                salt = cache_salt_of(request.cache_salt)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            await self._clear_id(rid)
            ttl = self.leases.ttl(request.ttl_ms)
            lease = self.leases.create(rid, ttl)
            # A Reserve its caller gave up on (the client left) may answer into the void: the
            # lease is freed at once instead of holding its blocks until the TTL.
            context.add_done_callback(lambda c, lid=lease.lease_id: c.cancelled() and
                                      self.leases.abandon(rid, lid))
            in_use_until = time.monotonic() + ID_REUSE_WAIT_S
            while True:
                try:
                    res = await self.engine.reserve(
                        rid, ids, kv_transfer_params=self.kv.expectation(
                            rid, lease.lease_id, request.sender_agent, request.sender_address),
                        cache_salt=salt)
                    break
                except EngineOverloaded as e:
                    self.leases.drop(rid)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                except ValueError as e:
                    # An earlier request of this id aborted here may hold it a moment longer
                    # (its blocks quarantined until the sender's last write): transient.
                    if isinstance(e, RequestIdInUse) and time.monotonic() < in_use_until:
                        await asyncio.sleep(0.02)
                        continue
                    self.leases.drop(rid)
                    await context.abort(grpc.StatusCode.UNAVAILABLE if isinstance(e, RequestIdInUse)
                                        else grpc.StatusCode.INVALID_ARGUMENT, str(e))
            logger.debug("reserved %d blocks (%d tokens cached) lease %s", len(res.block_ids),
                         res.num_cached_tokens, lease.lease_id)
            return wpb.ReserveResponse(
                lease_id=lease.lease_id, block_ids=res.block_ids,
                cached_prefix_tokens=res.num_cached_tokens, agent_name=self.kv.agent_name,
                incarnation=self.kv.incarnation, ttl_ms=int(ttl * 1000))

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

    async def RenewLease(self, request: wpb.LeaseRequest,
                         context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        try:
            self.leases.renew(request.request_id, request.lease_id)
        except LeaseError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        if request.sender_agent and self.kv is not None \
                and not self.kv.bind_sender(request.request_id, request.sender_agent,
                                            request.sender_address):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.request_id} waits for no KV here: nothing to bind")
        return wpb.LeaseResponse(ok=True)

    async def Release(self, request: wpb.LeaseRequest,
                      context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        with request_context(request.request_id):
            ok = await self.leases.release(request.request_id, request.lease_id)
            # The release has reached the engine (``after_free`` waited for its step), so an
            # aborted transfer's hold exists by now; the router says no write can still land.
            if ok and request.writes_settled and self.kv is not None:
                self.kv.settle(request.request_id)
            return wpb.LeaseResponse(ok=ok)

    async def Decode(self, request: wpb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        mark("decode_rpc_in", rid)
        call = _DecodeCall(rid)
        if tracing.enabled():
            call.span = tracing.start("decode.request",
                                      tracing.from_metadata(context.invocation_metadata()),
                                      **{"kvrelay.request_id": rid})
        with request_context(rid):
            try:
                lease = self.leases.start_decoding(rid, request.lease_id)
            except LeaseError as e:
                tracing.end(call.span, error=e)
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            # Until this stream is wholly torn down, a new Reserve of the same id waits.
            done = self._busy[rid] = asyncio.get_running_loop().create_future()
            try:
                out: RequestOutput | None = await self._await_kv(request, context, call)
                while out is not None:
                    msg = call.message(out)
                    if msg is not None:
                        yield msg
                    if call.ended(out):
                        break
                    out = await anext(call.stream, None)  # type: ignore[arg-type]
            finally:
                call.end_spans()
                # Every way out (finished, failed, or cancelled by the router at any await,
                # the KV wait included) frees the request, its lease and its engine stream;
                # shielded, so that a second cancel cannot cut it short.
                end = asyncio.ensure_future(self._end_decode(rid, call.stream, call.finished,
                                                          lease, done, list(call.index)[1:]))
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(end)

    async def _await_kv(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext,
                        call: _DecodeCall) -> RequestOutput:
        """Open the engine's stream of the request (and its forks) and wait, bounded, for its
        first output: the KV has landed then. Aborts the call when it does not."""
        rid = call.rid
        try:
            sampling = sampling_from_proto(request.sampling)
            forks = [(fork_id(rid, k), t)
                     for k, t in enumerate(request.fork_token_ids, start=1)]
            call.index = {rid: 0} | {cid: k for k, (cid, _) in enumerate(forks, start=1)}
            call.stream = (self.engine.decode_forks(rid, request.first_token_id, sampling,
                                                    forks) if forks else
                           self.engine.decode(rid, request.first_token_id, sampling))
            kv_timeout = (request.kv_timeout_ms / 1000.0 if request.kv_timeout_ms
                          else DEFAULT_KV_TIMEOUT_S)
            t0 = time.monotonic()
            first = await asyncio.wait_for(anext(call.stream), kv_timeout)
        except (ValueError, KeyError) as e:
            tracing.end(call.span, error=e)
            call.span = None
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            logger.warning("KV did not arrive within %.1fs", kv_timeout)
            tracing.end(call.span, error="KV did not arrive")
            call.span = None
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"KV for {rid} did not arrive within {kv_timeout:.1f}s")
        t_kv = time.monotonic()
        call.kv_wait_ms = (t_kv - t0) * 1000.0
        if call.span is not None:
            tracing.record("decode.kv_wait", call.span, t0, t_kv)
            call.decoding = tracing.start("decode.decode", call.span, start_s=t_kv)
        call.running = set(call.index)
        return first

    async def GenerateLocal(self, request: wpb.LocalGenerateRequest,
                            context: grpc.aio.ServicerContext) \
            -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        span = None
        if tracing.enabled():  # the whole request here: prefill and decode alike
            span = tracing.start("worker.generate_local",
                                 tracing.from_metadata(context.invocation_metadata()),
                                 **{"kvrelay.request_id": rid})
        with request_context(rid):
            if self.draining:
                tracing.end(span, error="draining")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                                    failure_md(FailureKind.FAILURE_DRAINING))
            try:
                check_request_id(rid)
                sampling = sampling_from_proto(request.sampling)
                stream = self.engine.generate(rid, list(request.prompt_token_ids), sampling,
                                              cache_salt=cache_salt_of(request.cache_salt))
                first = await anext(stream)
            except EngineOverloaded as e:
                tracing.end(span, error=e)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except ValueError as e:
                tracing.end(span, error=e)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out: RequestOutput | None = first
            try:
                while out is not None:
                    yield decode_response(out)
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


async def _exhaust(stream: AsyncIterator[RequestOutput]) -> None:
    async for _ in stream:
        pass
