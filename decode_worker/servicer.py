"""DecodeWorker gRPC servicer: protobuf in, one call of ``DecodeService``, protobuf out.

Everything a call does (leases, the KV wait, decoding, teardown) is ``service.DecodeService``'s;
its refusals (``CallRefused``) become the call's status and typed trailers here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import finish_to_proto, logprob_to_proto, sampling_from_proto
from kvrelay.common.failures import CallRefused, FailureKind, refusals
from kvrelay.common.logs import request_context
from kvrelay.decode_worker.service import DecodeItem, DecodeService
from kvrelay.decode_worker.sessions import SessionServer
from kvrelay.engine.engine_core import RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)


def decode_response(out: RequestOutput) -> wpb.DecodeResponse:
    msg = wpb.DecodeResponse(
        token_ids=out.new_token_ids,
        logprobs=[logprob_to_proto(lp) for lp in out.logprobs] if any(out.logprobs) else [],
        finish_reason=finish_to_proto(out.finish_reason if out.finished else None),
        error=out.error or "",
        cached_prompt_tokens=out.num_cached_tokens,
    )
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    return msg


def _item_response(item: DecodeItem) -> wpb.DecodeResponse:
    msg = decode_response(item.out)
    msg.kv_wait_ms = item.kv_wait_ms
    msg.index = item.index
    return msg


def _trace_parent(context: grpc.aio.ServicerContext) -> Any:
    return tracing.from_metadata(context.invocation_metadata()) if tracing.enabled() else None


def _sampling(proto: wpb.SamplingParams) -> SamplingParams:
    try:
        return sampling_from_proto(proto)
    except ValueError as e:
        raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                          FailureKind.FAILURE_INVALID_REQUEST) from e


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, service: DecodeService):
        self.service = service
        # The router's Sessions: its Decode and GenerateLocal calls, many over one stream.
        self.sessions = SessionServer({"decode": self.Decode,
                                       "generate_local": self.GenerateLocal})

    async def GetTransferInfo(self, request: wpb.TransferInfoRequest,
                              context: grpc.aio.ServicerContext) -> wpb.TransferInfo:
        async with refusals(context):
            info, incarnation = self.service.transfer_info()
        return wpb.TransferInfo(peer_info=info, incarnation=incarnation)

    async def Reserve(self, request: wpb.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> wpb.ReserveResponse:
        rid = request.request_id
        with tracing.span("decode.reserve", _trace_parent(context),
                          **{"kvrelay.request_id": rid}) as span, request_context(rid):
            async with refusals(context):
                res = await self.service.reserve(
                    rid, list(request.prompt_token_ids), request.cache_salt, request.ttl_ms,
                    request.sender_agent, request.sender_address,
                    on_lease=lambda lid: context.add_done_callback(
                        lambda c: c.cancelled() and self.service.abandon(rid, lid)))
            if span is not None:
                span.set_attribute("kvrelay.blocks", len(res.block_ids))
                span.set_attribute("kvrelay.cached_prefix_tokens", res.cached_prefix_tokens)
        return wpb.ReserveResponse(
            lease_id=res.lease_id, block_ids=res.block_ids,
            cached_prefix_tokens=res.cached_prefix_tokens, agent_name=res.agent_name,
            incarnation=res.incarnation, ttl_ms=int(res.ttl_s * 1000), page_ids=res.page_ids)

    async def RenewLease(self, request: wpb.LeaseRequest,
                         context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        async with refusals(context):
            self.service.renew(request.request_id, request.lease_id, request.sender_agent,
                               request.sender_address)
        return wpb.LeaseResponse(ok=True)

    async def Release(self, request: wpb.LeaseRequest,
                      context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        with request_context(request.request_id):
            ok = await self.service.release(request.request_id, request.lease_id,
                                            request.writes_settled)
        return wpb.LeaseResponse(ok=ok)

    async def Decode(self, request: wpb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        with request_context(rid):
            async with refusals(context):
                items = self.service.decode(
                    rid, request.lease_id, request.first_token_id,
                    functools.partial(_sampling, request.sampling), request.fork_token_ids,
                    request.kv_timeout_ms / 1000.0 if request.kv_timeout_ms else None,
                    _trace_parent(context))
                async for item in items:
                    yield _item_response(item)

    async def GenerateLocal(self, request: wpb.LocalGenerateRequest,
                            context: grpc.aio.ServicerContext) \
            -> AsyncIterator[wpb.DecodeResponse]:
        rid = request.request_id
        with request_context(rid):
            async with refusals(context):
                outs = self.service.generate_local(
                    rid, list(request.prompt_token_ids), _sampling(request.sampling),
                    request.cache_salt, _trace_parent(context))
                async for out in outs:
                    yield decode_response(out)

    async def Session(self, request_iterator: AsyncIterator[wpb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.SessionResponse]:
        async for resp in self.sessions.serve(request_iterator, context):
            yield resp
