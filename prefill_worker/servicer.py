"""PrefillWorker gRPC servicer: prefill a prompt, stream its KV into a decode worker's blocks,
return the first token once every byte has landed.

The prefill engine batches and chunks prompts across requests and keeps its own prefix cache.
It holds a request's blocks only until the transfer completes (then they stay only as prefix
cache). Returning after delivery, not before, lets a transfer failure surface as this call's
error, so the router can retry on another prefill worker under the same decode lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import (
    ID_REUSE_WAIT_S,
    cache_salt_of,
    logprob_to_proto,
    sampling_from_proto,
)
from kvrelay.common.failures import FailureKind, failure_md
from kvrelay.common.logs import request_context
from kvrelay.common.rpc import token_metadata
from kvrelay.common.timeline import mark
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestIdInUse, RequestOutput
from kvrelay.engine.outputs import ErrorKind
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.kv_transfer.messages import KVDestination, PendingDestination, destination_of
from kvrelay.prefill_worker.peers import DecodePeers, PeerTransport
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

# The Prefill call's span (common.tracing) while tracing is on: each call runs in a task of its own.
_SPAN: ContextVar[Any] = ContextVar("kvrelay_prefill_span", default=None)


class KVSender(PeerTransport, Protocol):
    """What the servicer needs of the KV transport on the sending side."""

    def destination(self, request_id: str, agent_name: str, block_ids: list[int],
                    skip_blocks: int, lease_id: str, incarnation: str) -> KVDestination: ...

    def block_bytes(self) -> int: ...

    def fence(self, request_id: str, lease_id: str) -> bytes: ...

    def is_fenced(self, request_id: str, lease_id: str) -> bool: ...

    def still_sending(self, request_id: str) -> bool: ...

    def is_fenced_notif(self, notif: bytes) -> bool: ...

    def destination_ready(self, request_id: str) -> None: ...

    def abandon(self, request_id: str) -> bool: ...


@dataclass
class _Pending:
    """A prefill sent ahead of its destination (``destination_follows``)."""

    holder: PendingDestination
    num_tokens: int
    peer: str | None = None  # the decode worker, once named


PREFILL_ARRIVAL_WAIT_S = 1.0  # a SetDestination waits this long for its Prefill to arrive


class PrefillServicer(DecodePeers, worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, kv: KVSender, worker_id: str, *,
                 cluster_token: str | None = None):
        super().__init__()
        self.engine = engine
        self.kv = kv
        self.worker_id = worker_id
        self.draining = False
        self._md = token_metadata(cluster_token)
        self._pending: dict[str, _Pending] = {}  # request id -> prefill awaiting SetDestination
        self._arrivals: dict[str, asyncio.Event] = {}  # SetDestinations that came first

    def _validate(self, request: wpb.PrefillRequest) -> None:
        if not request.request_id or len(request.request_id) > 256:
            raise ValueError("request_id must be 1..256 characters")
        self.engine.core.validate_prompt(list(request.prompt_token_ids))
        cache_salt_of(request.cache_salt)
        if request.destination_follows == request.HasField("dest"):
            raise ValueError("give exactly one of dest and destination_follows")

    def _skip_blocks(self, dest: wpb.KVDestination, num_tokens: int) -> int:
        """Validates ``dest`` for a prompt of ``num_tokens``; the leading blocks it holds."""
        if not dest.agent_name or not dest.decode_address:
            raise ValueError("dest.agent_name and dest.decode_address are required")
        bs = self.engine.core.config.cache.block_size
        need = -(-num_tokens // bs)
        if len(dest.block_ids) != need:
            raise ValueError(f"dest has {len(dest.block_ids)} blocks; {num_tokens} tokens need "
                             f"{need} blocks of {bs}")
        if dest.skip_prefix_tokens % bs or dest.skip_prefix_tokens > num_tokens:
            raise ValueError(f"skip_prefix_tokens {dest.skip_prefix_tokens} must be a multiple "
                             f"of the block size {bs} and at most the prompt length")
        return dest.skip_prefix_tokens // bs

    async def Prefill(self, request: wpb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        if not tracing.enabled():
            return await self._prefill_rpc(request, context)
        span = tracing.start("prefill.request",
                             tracing.from_metadata(context.invocation_metadata()),
                             **{"kvrelay.request_id": request.request_id,
                                "kvrelay.worker": self.worker_id,
                                "kvrelay.prompt_tokens": len(request.prompt_token_ids)})
        token = _SPAN.set(span)
        try:
            return await self._prefill_rpc(request, context)
        except BaseException as e:  # an abort raises too
            tracing.end(span, error=e if isinstance(e, Exception) else None)
            span = None
            raise
        finally:
            _SPAN.reset(token)
            tracing.end(span)

    async def _prefill_rpc(self, request: wpb.PrefillRequest,
                           context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        rid = request.request_id
        mark("prefill_rpc_in", rid)
        with request_context(rid):
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                                    failure_md(FailureKind.FAILURE_DRAINING,
                                               nothing_written=True))
            try:
                self._validate(request)
                skip = (0 if request.destination_follows
                        else self._skip_blocks(request.dest, len(request.prompt_token_ids)))
                # Only the first token is sampled here; stop strings are the router's business.
                # Stop tokens stay only to be masked under min_tokens (a first token cannot be
                # one then); min_tokens is cut to the one token this pass samples.
                full = sampling_from_proto(request.sampling)
                sampling = replace(full, max_tokens=1, stop=(), min_tokens=min(full.min_tokens, 1),
                                   stop_token_ids=full.stop_token_ids if full.min_tokens else ())
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                                    failure_md(FailureKind.FAILURE_INVALID_REQUEST,
                                               nothing_written=True))
            if request.destination_follows:
                return await self._prefill_then_destination(request, context, sampling)
            await self.evict_idle_peers()
            dest = request.dest
            if self.kv.is_fenced(rid, dest.lease_id):  # its receiver gave the blocks up
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the lease of {rid} was given up by its decode worker",
                                    failure_md(FailureKind.FAILURE_LEASE_GIVEN_UP,
                                               nothing_written=True))
            self._use_peer(dest.agent_name, +1)
            try:
                await self._connect(dest, context)
                params = self.kv.destination(rid, dest.agent_name, list(dest.block_ids), skip,
                                             dest.lease_id, dest.incarnation)
                return await self._prefill(request, context, sampling, params)
            finally:
                self._use_peer(dest.agent_name, -1)

    async def _prefill_then_destination(self, request: wpb.PrefillRequest,
                                        context: grpc.aio.ServicerContext,
                                        sampling: SamplingParams) -> wpb.PrefillResponse:
        """Compute while the router reserves the decode worker's blocks (SetDestination)."""
        rid = request.request_id
        if rid in self._pending:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"request id {rid!r} is already in use",
                                failure_md(FailureKind.FAILURE_REQUEST_ID_IN_USE,
                                           nothing_written=True))
        pending = self._pending[rid] = _Pending(PendingDestination(),
                                                len(request.prompt_token_ids))
        arrived = self._arrivals.pop(rid, None)
        if arrived is not None:  # its SetDestination overtook it
            arrived.set()
        try:
            await self.evict_idle_peers()
            return await self._prefill(request, context, sampling, pending.holder)
        finally:
            del self._pending[rid]
            if pending.holder.close():  # never named: whether it finished or not, let go
                self.kv.abandon(rid)
            if pending.peer is not None:
                self._use_peer(pending.peer, -1)

    async def SetDestination(self, request: wpb.SetDestinationRequest,
                             context: grpc.aio.ServicerContext) -> wpb.SetDestinationResponse:
        rid = request.request_id
        with request_context(rid):
            pending = self._pending.get(rid)
            if pending is None:
                # Sent after its Prefill, on another stream: it may be handled first.
                arrived = self._arrivals.setdefault(rid, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), PREFILL_ARRIVAL_WAIT_S)
                if self._arrivals.get(rid) is arrived:
                    del self._arrivals[rid]
                pending = self._pending.get(rid)
            if pending is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no prefill of {rid!r} waits for a destination here")
            dest = request.dest
            try:
                skip = self._skip_blocks(dest, pending.num_tokens)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if self.kv.is_fenced(rid, dest.lease_id):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the lease of {rid} was given up by its decode worker",
                                    failure_md(FailureKind.FAILURE_LEASE_GIVEN_UP,
                                               nothing_written=True))
            if pending.peer is None:
                pending.peer = dest.agent_name
                self._use_peer(dest.agent_name, +1)
            await self._connect(dest, context)
            params = self.kv.destination(rid, dest.agent_name, list(dest.block_ids), skip,
                                         dest.lease_id, dest.incarnation)
            if not pending.holder.resolve(params):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the prefill of {rid} has ended or has a destination",
                                    failure_md(FailureKind.FAILURE_UNSPECIFIED,
                                               nothing_written=True))
            self.kv.destination_ready(rid)
            mark("prefill_destination", rid)
            return wpb.SetDestinationResponse()

    async def Fence(self, request: wpb.FenceRequest,
                    context: grpc.aio.ServicerContext) -> wpb.FenceResponse:
        rid = request.request_id
        if not rid or len(rid) > 256 or not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id (1..256 characters) and lease_id are required")
        with request_context(rid):
            # On the engine thread, in order with admissions: a prefill admitted before is
            # aborted here (its sender sends the abort notice after its last write), one
            # admitted after finds the fence and writes nothing.
            done = await self.engine.call(self._fence, rid, request.lease_id)
            logger.debug("fenced lease %s: %s", request.lease_id,
                         "nothing in flight" if done else "aborting, notice to follow")
            return wpb.FenceResponse(done=done)

    def _fence(self, request_id: str, lease_id: str) -> bool:
        notif = self.kv.fence(request_id, lease_id)
        core = self.engine.core
        seq = core.seqs.get(request_id)
        if seq is not None and getattr(seq.kv_transfer_params, "notif", None) == notif:
            core.abort(request_id)
        return not self.kv.still_sending(request_id) and request_id not in core.seqs

    async def _prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext,
                       sampling: SamplingParams,
                       params: KVDestination | PendingDestination) -> wpb.PrefillResponse:
        """Prefill on the engine until the KV has been sent. A refusal or failure aborts the
        call, saying whether anything was written and whose failure it was."""
        rid = request.request_id
        salt = request.cache_salt or None  # checked in _validate
        t0 = time.monotonic()
        out: RequestOutput | None = None
        while True:
            try:
                async for o in self.engine.generate(rid, list(request.prompt_token_ids),
                                                    sampling, kv_transfer_params=params,
                                                    arrival_time=t0, cache_salt=salt):
                    out = o
                break
            except EngineOverloaded as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                    failure_md(FailureKind.FAILURE_OVERLOADED,
                                               nothing_written=True))
            except ValueError as e:
                # An earlier request of this id (given up by the router, or a client's retry)
                # may still be sending its KV out: wait a moment, it is transient.
                if isinstance(e, RequestIdInUse) and out is None \
                        and time.monotonic() < t0 + ID_REUSE_WAIT_S:
                    await asyncio.sleep(0.02)
                    continue
                in_use = isinstance(e, RequestIdInUse)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE if in_use else grpc.StatusCode.INVALID_ARGUMENT,
                    str(e), failure_md(FailureKind.FAILURE_REQUEST_ID_IN_USE if in_use
                                       else FailureKind.FAILURE_INVALID_REQUEST,
                                       nothing_written=True))
        if out is None or out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) \
                or not out.new_token_ids:
            reason = (out.error if out is not None else None) or "prefill aborted"
            logger.warning("prefill failed: %s", reason)
            # A failed KV transfer is the destination's failure (the decode worker died or
            # dropped the lease, or fenced it), not this worker's.
            dest = destination_of(params)
            theirs = (out is not None and out.error_kind is ErrorKind.KV_TRANSFER) \
                or (dest is not None and self.kv.is_fenced_notif(dest.notif))
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason, failure_md(
                FailureKind.FAILURE_KV_DESTINATION if theirs else FailureKind.FAILURE_ENGINE))
        return self._response(rid, out, params, t0)

    def _response(self, rid: str, out: RequestOutput,
                  params: KVDestination | PendingDestination,
                  t0: float) -> wpb.PrefillResponse:
        """The first token(s) and the engine's time points of a delivered prefill (as spans
        too, under the call's, when tracing is on)."""
        done = time.monotonic()
        scheduled = out.scheduled_at or t0
        computed = out.computed_at or done
        dest = destination_of(params)
        sent_blocks = len(dest.remote_block_ids) - dest.skip_blocks if dest is not None else 0
        first_lp = out.logprobs[0] if out.logprobs else None
        resp = wpb.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            cached_prompt_tokens=out.num_cached_tokens,
            queue_ms=(scheduled - t0) * 1000.0,
            prefill_ms=(computed - scheduled) * 1000.0,
            transfer_ms=(done - computed) * 1000.0,
            kv_bytes=sent_blocks * self.kv.block_bytes(),
            worker_id=self.worker_id,
        )
        if first_lp is not None:  # set only when asked for: HasField tells the router
            resp.logprob.CopyFrom(logprob_to_proto(first_lp))
        for tok, lp in out.fork_firsts:  # n > 1: the other choices' first tokens
            resp.fork_token_ids.append(tok)
            if lp is not None:
                resp.fork_logprobs.append(logprob_to_proto(lp))
        if out.prompt_logprobs:
            resp.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
        span = _SPAN.get()
        if span is not None:  # the engine's time points, as spans under the request's
            span.set_attribute("kvrelay.cached_prompt_tokens", out.num_cached_tokens)
            span.set_attribute("kvrelay.kv_bytes", resp.kv_bytes)
            tracing.record("prefill.queue", span, t0, scheduled)
            tracing.record("prefill.compute", span, scheduled, computed)
            tracing.record("prefill.kv_send", span, computed, done,
                           **{"kvrelay.kv_bytes": resp.kv_bytes, "kvrelay.blocks": sent_blocks})
        mark("prefill_rpc_out", rid)
        return resp
