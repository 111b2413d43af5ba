"""The public gRPC API (kvrelay.v1.Generation) and the internal Registry servicer.

Servicers translate and nothing more: protobuf in -> ``RouterService`` -> protobuf out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import finish_to_proto, logprob_to_proto, sampling_from_proto
from kvrelay.common.limits import MAX_TIMEOUT_MS
from kvrelay.common.logs import request_context
from kvrelay.common.rpc import bearer_or_key
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc, worker_pb2_grpc
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.admission import RETRY_AFTER_S
from kvrelay.router.coalesce import Coalescer
from kvrelay.router.errors import RouterError
from kvrelay.router.outputs import Delta
from kvrelay.router.registry import RegistryFull, WorkerIdTaken, WorkerRegistry
from kvrelay.router.service import RouterService
from kvrelay.router.trace import client_parent

logger = logging.getLogger(__name__)


def delta_to_proto(d: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=d.request_id, text=d.text, token_ids=d.token_ids,
                              index=d.index)
    if any(lp is not None for lp in d.logprobs):
        msg.logprobs.extend(logprob_to_proto(lp) for lp in d.logprobs)
    if d.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in d.prompt_logprobs)
    if d.finished:
        msg.finish_reason = finish_to_proto(d.finish_reason)
        if d.stop_reason is not None:
            msg.stop_reason = str(d.stop_reason)
        if d.usage is not None:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=d.usage.prompt_tokens,
                                        completion_tokens=d.usage.completion_tokens,
                                        cached_prompt_tokens=d.usage.cached_prompt_tokens))
        if d.timing is not None:
            t = d.timing
            msg.timing.CopyFrom(pb.Timing(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms,
                                          e2e_ms=t.e2e_ms, prefill_ms=t.prefill_ms,
                                          transfer_ms=t.transfer_ms, mean_itl_ms=t.mean_itl_ms,
                                          reserve_ms=t.reserve_ms,
                                          decode_kv_wait_ms=t.decode_kv_wait_ms))
        if d.trace is not None:
            msg.trace.extend(pb.TraceEvent(name=e.name, t_ms=e.t_ms, worker=e.worker)
                             for e in d.trace.events)
    return msg


async def abort_with(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    if e.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    await context.abort(e.code, e.message)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, service: RouterService):
        self.service = service

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        kind = request.WhichOneof("prompt")
        api_key = bearer_or_key(dict(context.invocation_metadata() or ()))
        tenant = self.service.tenant_of(api_key)
        # Admission before work, as on HTTP: a slot or a place in the fair queue (this
        # request's priority known already), and room for requests being validated and
        # tokenized, are checked before the prompt is looked at (gRPC itself refused a message
        # over MAX_GRPC_REQUEST_BYTES before parsing it).
        if (full := self.service.arrival_refusal(tenant, request.priority)) is not None:
            await abort_with(context, full)
        admission = self.service.admission
        ticket = admission.enter(request.ByteSize(), tenant)
        if ticket is None:
            await abort_with(context, RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  admission.busy_message(tenant),
                                                  retry_after_s=RETRY_AFTER_S))
        assert ticket is not None
        try:
            sampling = sampling_from_proto(request.sampling)
            if request.timeout_ms > MAX_TIMEOUT_MS:
                raise ValueError(f"timeout_ms must be in (0, {MAX_TIMEOUT_MS}] (0: none)")
            timeout_ms = request.timeout_ms or None
            remaining = context.time_remaining()
            if remaining is not None:
                grpc_ms = max(1, int(remaining * 1000))
                timeout_ms = min(timeout_ms, grpc_ms) if timeout_ms else grpc_ms
            spec = await self.service.build_spec(
                request_id=request.request_id or None,
                text=request.text if kind == "text" else None,
                token_ids=request.token_ids.ids if kind == "token_ids" else None,
                sampling=sampling, timeout_ms=timeout_ms, model=request.model or None,
                cache_salt=request.cache_salt or None, api_key=api_key,
                priority=request.priority)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            await abort_with(context, e)
        finally:
            ticket.release()
        if tracing.enabled():
            spec.trace_parent = client_parent(v for k, v in context.invocation_metadata() or ()
                                              if k == tracing.TRACEPARENT)
        with request_context(spec.request_id):
            deltas = Coalescer(self.service.generate(spec))
            try:
                async for delta in deltas:
                    t = time.monotonic()
                    yield delta_to_proto(delta)
                    # A client reading slower than tokens come: several tokens a message.
                    deltas.sent(delta, time.monotonic() - t)
            except RouterError as e:
                logger.warning("request failed: %s %s", e.code.name, e.message)
                await abort_with(context, e)
            finally:
                await deltas.aclose()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        s = self.service
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=s.model_name, max_model_len=s.effective_max_model_len(), vocab_size=s.vocab_size)])


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    async def Heartbeat(self, request: wpb.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> wpb.HeartbeatResponse:
        try:
            return self.registry.heartbeat(request)
        except WorkerIdTaken as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except RegistryFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def ListWorkers(self, request: wpb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> wpb.ListWorkersResponse:
        workers = self.registry.status()
        if not self.registry.authenticated:
            # Anyone may call this port: an incarnation would let a caller forge a worker's
            # "leaving" beat (or a restart) and remove it. With a cluster token every caller
            # passed the token check, and operators see everything.
            for w in workers:
                w.info.ClearField("incarnation")
        return wpb.ListWorkersResponse(workers=workers)
