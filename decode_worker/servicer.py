"""DecodeWorker gRPC servicer: reserve blocks, wait for KV, stream decoded tokens.

Servicers only translate: protobuf in, engine calls, protobuf out. Engine errors map to status
codes: bad input -> INVALID_ARGUMENT, no room -> RESOURCE_EXHAUSTED, unknown lease ->
NOT_FOUND, KV that never arrives or a draining worker -> UNAVAILABLE (retriable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from kvrelay.convert import finish_to_proto, logprob_to_proto, sampling_from_proto
from kvrelay.decode_worker.leases import LeaseError, LeaseTable
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestOutput
from kvrelay.logs import request_context
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

MAX_REQUEST_ID = 256
DEFAULT_KV_TIMEOUT_S = 30.0


class KVReceiver(Protocol):
    """What the servicer needs of the KV transport on the receiving side."""

    agent_name: str
    incarnation: str

    def peer_info_bytes(self) -> bytes: ...

    def expectation(self, request_id: str, lease_id: str) -> object: ...


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID} characters")


def decode_response(out: RequestOutput) -> wpb.DecodeResponse:
    return wpb.DecodeResponse(
        token_ids=out.new_token_ids,
        logprobs=[logprob_to_proto(lp) for lp in out.logprobs] if any(out.logprobs) else [],
        finish_reason=finish_to_proto(out.finish_reason if out.finished else None),
        error=out.error or "",
        cached_prompt_tokens=out.num_cached_tokens,
    )


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: AsyncEngine, leases: LeaseTable, kv: KVReceiver | None):
        self.engine = engine
        self.leases = leases
        self.kv = kv
        self.draining = False

    async def GetTransferInfo(self, request: wpb.TransferInfoRequest,
                              context: grpc.aio.ServicerContext) -> wpb.TransferInfo:
        if self.kv is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker has no KV transport (role=both)")
        return wpb.TransferInfo(peer_info=self.kv.peer_info_bytes(),
                                incarnation=self.kv.incarnation)

    async def Reserve(self, request: wpb.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> wpb.ReserveResponse:
        rid = request.request_id
        with request_context(rid):
            if self.kv is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this worker does not take remote KV (role=both)")
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
            ids = list(request.prompt_token_ids)
            try:
                check_request_id(rid)
                self.engine.core.validate_prompt(ids)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            ttl = self.leases.ttl(request.ttl_ms)
            lease = self.leases.create(rid, ttl)
            try:
                res = await self.engine.reserve(
                    rid, ids, kv_transfer_params=self.kv.expectation(rid, lease.lease_id))
            except EngineOverloaded as e:
                self.leases.drop(rid)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except ValueError as e:
                self.leases.drop(rid)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            logger.debug("reserved %d blocks (%d tokens cached) lease %s", len(res.block_ids),
                         res.num_cached_tokens, lease.lease_id)
            return wpb.ReserveResponse(
                lease_id=lease.lease_id, block_ids=res.block_ids,
                cached_prefix_tokens=res.num_cached_tokens, agent_name=self.kv.agent_name,
                incarnation=self.kv.incarnation, ttl_ms=int(ttl * 1000))

    async def RenewLease(self, request: wpb.LeaseRequest,
                         context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        try:
            self.leases.renew(request.request_id, request.lease_id)
        except LeaseError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return wpb.LeaseResponse(ok=True)

    async def Release(self, request: wpb.LeaseRequest,
                      context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        with request_context(request.request_id):
            ok = await self.leases.release(request.request_id, request.lease_id)
            return wpb.LeaseResponse(ok=ok)

    async def Decode(self, request: wpb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        with request_context(rid):
            try:
                self.leases.start_decoding(rid, request.lease_id)
            except LeaseError as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            try:
                sampling = sampling_from_proto(request.sampling)
                stream = self.engine.decode(rid, request.first_token_id, sampling)
                kv_timeout = (request.kv_timeout_ms / 1000.0 if request.kv_timeout_ms
                              else DEFAULT_KV_TIMEOUT_S)
                t0 = time.monotonic()
                first = await asyncio.wait_for(anext(stream), kv_timeout)
            except (ValueError, KeyError) as e:
                await self._drop(rid)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except TimeoutError:
                await self._drop(rid)
                logger.warning("KV did not arrive within %.1fs", kv_timeout)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"KV for {rid} did not arrive within {kv_timeout:.1f}s")
            try:
                out: RequestOutput | None = first
                kv_wait_ms = (time.monotonic() - t0) * 1000.0
                while out is not None:
                    if not out.kv_arrived:
                        msg = decode_response(out)
                        msg.kv_wait_ms = kv_wait_ms
                        yield msg
                    if out.finished:
                        break
                    out = await anext(stream, None)
            finally:
                await stream.aclose()
                self.leases.drop(rid)

    async def GenerateLocal(self, request: wpb.LocalGenerateRequest,
                            context: grpc.aio.ServicerContext) \
            -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        with request_context(rid):
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
            try:
                check_request_id(rid)
                sampling = sampling_from_proto(request.sampling)
                stream = self.engine.generate(rid, list(request.prompt_token_ids), sampling)
                first = await anext(stream)
            except EngineOverloaded as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out: RequestOutput | None = first
            try:
                while out is not None:
                    yield decode_response(out)
                    if out.finished:
                        break
                    out = await anext(stream, None)
            finally:
                await stream.aclose()

    async def _drop(self, request_id: str) -> None:
        self.leases.drop(request_id)
        await self.engine.abort(request_id)
