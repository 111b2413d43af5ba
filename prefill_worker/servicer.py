"""PrefillWorker gRPC servicer: protobuf in, one call of ``PrefillService``, protobuf out.

What a call does (validation, peers, the engine, delivery, fencing) is
``service.PrefillService``'s; its refusals (``CallRefused``) become the call's status and typed
trailers here.
"""

from __future__ import annotations

import logging

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import logprob_to_proto, sampling_from_proto
from kvrelay.common.failures import CallRefused, FailureKind, refusals
from kvrelay.common.logs import request_context
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.prefill_worker.peers import DecodeTarget
from kvrelay.prefill_worker.pull import PullSource
from kvrelay.prefill_worker.service import Prefilled, PrefillService
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)


def target_of(dest: wpb.KVDestination) -> DecodeTarget:
    return DecodeTarget(dest.agent_name, dest.decode_address, dest.incarnation,
                        list(dest.block_ids), dest.skip_prefix_tokens, dest.lease_id,
                        tuple(dest.page_ids))


def pull_of(request: wpb.PrefillRequest) -> PullSource | None:
    if not request.HasField("pull"):
        return None
    h = request.pull
    return PullSource(h.source_address, h.source_agent, h.prefix_tokens, h.timeout_ms / 1e3)


def _request(request: wpb.PrefillRequest) -> tuple[SamplingParams, DecodeTarget | None]:
    """The request's sampling and destination (None: it follows), or a refusal."""
    try:
        if request.destination_follows == request.HasField("dest"):
            raise ValueError("give exactly one of dest and destination_follows")
        sampling = sampling_from_proto(request.sampling)
    except ValueError as e:
        raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                          FailureKind.FAILURE_INVALID_REQUEST, nothing_written=True) from e
    return sampling, None if request.destination_follows else target_of(request.dest)


def prefill_response(p: Prefilled, worker_id: str) -> wpb.PrefillResponse:
    out = p.out
    resp = wpb.PrefillResponse(
        first_token_id=out.new_token_ids[0], cached_prompt_tokens=out.num_cached_tokens,
        queue_ms=(p.scheduled - p.arrived) * 1000.0,
        prefill_ms=(p.computed - p.scheduled) * 1000.0,
        transfer_ms=(p.done - p.computed) * 1000.0, kv_bytes=p.kv_bytes, worker_id=worker_id)
    if out.logprobs and out.logprobs[0] is not None:  # set only when asked: HasField tells
        resp.logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
    for tok, lp in out.fork_firsts:  # n > 1: the other choices' first tokens
        resp.fork_token_ids.append(tok)
        if lp is not None:
            resp.fork_logprobs.append(logprob_to_proto(lp))
    if out.prompt_logprobs:
        resp.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    if p.pull is not None:
        resp.pull.CopyFrom(p.pull.to_proto())
    return resp


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, service: PrefillService, worker_id: str):
        self.service = service
        self.worker_id = worker_id

    async def Prefill(self, request: wpb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        rid = request.request_id
        parent = (tracing.from_metadata(context.invocation_metadata())
                  if tracing.enabled() else None)
        with tracing.span("prefill.request", parent, **{
                "kvrelay.request_id": rid, "kvrelay.worker": self.worker_id,
                "kvrelay.prompt_tokens": len(request.prompt_token_ids)}) as span, \
                request_context(rid):
            async with refusals(context):
                sampling, dest = _request(request)
                done = await self.service.prefill(rid, list(request.prompt_token_ids),
                                                  sampling, request.cache_salt, dest, span,
                                                  pull_of(request), context.time_remaining())
            return prefill_response(done, self.worker_id)

    async def SetDestination(self, request: wpb.SetDestinationRequest,
                             context: grpc.aio.ServicerContext) -> wpb.SetDestinationResponse:
        with request_context(request.request_id):
            async with refusals(context):
                await self.service.set_destination(request.request_id, target_of(request.dest))
        return wpb.SetDestinationResponse()

    async def Fence(self, request: wpb.FenceRequest,
                    context: grpc.aio.ServicerContext) -> wpb.FenceResponse:
        with request_context(request.request_id):
            async with refusals(context):
                done = await self.service.fence(request.request_id, request.lease_id)
        return wpb.FenceResponse(done=done)
