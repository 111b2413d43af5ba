"""One request's life in the cluster (decode-first, router-owned lease).

  reserve on D  ->  prefill on P (KV streams P -> D)  ->  first token  ->  decode stream on D

A prefill worker that fails is replaced under the same lease; a decode worker lost mid-stream
is replaced by re-prefilling prompt + tokens already produced onto a new pair, continuing the
same stream (greedy output is unchanged). Every wait is bounded; leaving the iterator (client
cancel, stop string, deadline) ends the lease on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from kvrelay.convert import finish_from_proto, logprob_from_proto, sampling_to_proto
from kvrelay.engine.sampler import TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.logs import request_context
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.errors import RouterError
from kvrelay.router.policy import Policy
from kvrelay.router.registry import WorkerRegistry, WorkerState
from kvrelay.router.trace import Trace

logger = logging.getLogger(__name__)

RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "least_loaded"
    lease_ttl_s: float = 10.0
    kv_timeout_s: float = 30.0
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0
    max_prefill_attempts: int = 3
    max_migrations: int = 2
    max_inflight: int = 512
    worker_wait_s: float = 5.0  # how long a request waits for a worker to appear
    # How long a request waits for KV room on the decode pool before RESOURCE_EXHAUSTED: blocks
    # come back as requests finish, so a burst queues briefly instead of failing at once.
    kv_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_prefill_attempts < 1 or self.max_migrations < 0 or self.max_inflight < 1:
            raise ValueError("max_prefill_attempts >= 1, max_migrations >= 0, max_inflight >= 1")


@dataclass
class GenerateSpec:
    """A validated request (frontends build it; the lifecycle trusts it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline: float | None = None  # time.monotonic() by which the request must end
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class TokenChunk:
    """Tokens as a worker produced them (before detokenization and stop strings)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: FinishReason | None = None
    cached_prompt_tokens: int = 0


class WorkerLost(Exception):
    """The worker serving a stream failed; the stream may be resumed elsewhere."""


class Lifecycle:
    """Produces a request's tokens from the cluster, resuming on worker failure."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, config: RouterConfig,
                 cluster_metadata: tuple[tuple[str, str], ...] = ()):
        self.registry = registry
        self.policy = policy
        self.config = config
        self.md = cluster_metadata

    # -- entry ---------------------------------------------------------------------------------
    async def tokens(self, spec: GenerateSpec, trace: Trace) -> AsyncIterator[TokenChunk]:
        """Yield the request's tokens in order until a worker reports it finished."""
        produced: list[int] = []
        migrations = 0
        while True:
            prompt = spec.prompt_token_ids + produced
            remaining = spec.sampling.max_tokens - len(produced)
            sampling = replace(spec.sampling, max_tokens=remaining)
            try:
                async for chunk in self._one_pass(spec, prompt, sampling, trace):
                    produced.extend(chunk.token_ids)
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
                raise WorkerLost("stream ended without a finish reason")
            except WorkerLost as e:
                migrations += 1
                if migrations > self.config.max_migrations:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"request failed after {migrations - 1} migrations: {e}",
                                      retry_after_s=1.0) from e
                trace.add("migrate", detail=str(e))
                logger.warning("resuming after %d tokens (migration %d): %s", len(produced),
                               migrations, e)

    async def _one_pass(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                        trace: Trace) -> AsyncIterator[TokenChunk]:
        if await self._disaggregate():
            async for c in self._disaggregated(spec, prompt, sampling, trace):
                yield c
        else:
            async for c in self._local(spec, prompt, sampling, trace):
                yield c

    async def _disaggregate(self) -> bool:
        """True when a prefill/decode pair is up, False when only role=both workers are; waits
        (bounded) for workers to appear."""
        deadline = time.monotonic() + self.config.worker_wait_s
        while True:
            if self.registry.alive("decode") and self.registry.alive("prefill"):
                return True
            if self.registry.alive("both"):
                return False
            if time.monotonic() >= deadline:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no workers available",
                                  retry_after_s=1.0)
            await asyncio.sleep(0.05)

    def _remaining(self, spec: GenerateSpec, cap: float) -> float:
        if spec.deadline is None:
            return cap
        left = spec.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded")
        return min(cap, left)

    # -- aggregated workers (role=both) ----------------------------------------------------------
    async def _local(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                     trace: Trace) -> AsyncIterator[TokenChunk]:
        blocks = 0
        ranked = self.policy.rank_decode(self.registry.alive("both"), blocks, prompt)
        if not ranked:
            raise WorkerLost("no role=both worker")
        w = ranked[0]
        trace.add("local_start", w.worker_id)
        req = wpb.LocalGenerateRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                       sampling=sampling_to_proto(sampling))
        w.inflight += 1
        call = w.decode.GenerateLocal(req, metadata=self.md)
        try:
            async for chunk in self._read_stream(spec, call, w, trace):
                yield chunk
        finally:
            w.inflight -= 1
            call.cancel()

    # -- disaggregated ----------------------------------------------------------------------------
    async def _disaggregated(self, spec: GenerateSpec, prompt: list[int],
                             sampling: SamplingParams, trace: Trace) -> AsyncIterator[TokenChunk]:
        d, lease = await self._reserve(spec, prompt, trace)
        decode_started = False
        renew = asyncio.get_running_loop().create_task(self._renew(d, spec.request_id, lease))
        try:
            first, cached_p = await self._prefill(spec, prompt, sampling, d, lease, trace)
            renew.cancel()
            tok = first.first_token_id
            chunk = TokenChunk([tok], [logprob_from_proto(first.logprob)
                                       if first.HasField("logprob") else None],
                               cached_prompt_tokens=max(cached_p, lease.cached_prefix_tokens))
            chunk.finish_reason = self._first_token_stop(sampling, tok, len(prompt), d)
            yield chunk
            if chunk.finish_reason is not None:
                return
            decode_started = True
            req = wpb.DecodeRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                                    first_token_id=tok, sampling=sampling_to_proto(sampling),
                                    kv_timeout_ms=int(self.config.kv_timeout_s * 1000))
            call = d.decode.Decode(req, metadata=self.md)
            trace.add("decode_start", d.worker_id)
            try:
                async for c in self._read_stream(spec, call, d, trace):
                    yield c
            finally:
                call.cancel()
        finally:
            d.inflight -= 1
            renew.cancel()
            if not decode_started:
                self._release_soon(d, spec.request_id, lease.lease_id)

    def _first_token_stop(self, sampling: SamplingParams, token: int, prompt_len: int,
                          d: WorkerState) -> FinishReason | None:
        if not sampling.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in sampling.stop_token_ids:
            return FinishReason.STOP
        if sampling.max_tokens <= 1 or prompt_len + 1 >= d.max_model_len:
            return FinishReason.LENGTH
        return None

    eos_token_ids: frozenset[int] = frozenset()

    async def _reserve(self, spec: GenerateSpec, prompt: list[int],
                       trace: Trace) -> tuple[WorkerState, wpb.ReserveResponse]:
        give_up = time.monotonic() + self.config.kv_wait_s
        if spec.deadline is not None:
            give_up = min(give_up, spec.deadline)
        pause = 0.02
        while True:
            got = await self._reserve_once(spec, prompt, trace)
            if got is not None:
                return got
            if time.monotonic() + pause > give_up:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "no decode worker has KV room for this request now",
                                  retry_after_s=1.0)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)

    async def _reserve_once(self, spec: GenerateSpec, prompt: list[int],
                            trace: Trace) -> tuple[WorkerState, wpb.ReserveResponse] | None:
        """Reserve on the best decode worker that has room; None when all are full."""
        decoders = self.registry.alive("decode")
        if not decoders:
            raise WorkerLost("no decode worker")
        bs = decoders[0].block_size
        need = -(-(len(prompt) + 1) // bs)
        exhausted = 0
        for d in self.policy.rank_decode(decoders, need, prompt):
            req = wpb.ReserveRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                     ttl_ms=int(self.config.lease_ttl_s * 1000))
            # Counted from the reservation on (the caller drops it when the request leaves this
            # worker), so concurrent arrivals between two heartbeats spread over the pool.
            d.inflight += 1
            try:
                resp = await d.decode.Reserve(
                    req, metadata=self.md,
                    timeout=self._remaining(spec, self.config.reserve_timeout_s))
            except BaseException as e:
                d.inflight -= 1
                if not isinstance(e, grpc.aio.AioRpcError):
                    raise
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RouterError(code, e.details() or "invalid request") from e
                self.registry.mark_suspect(d.worker_id, f"Reserve: {code.name} {e.details()}")
                continue
            d.pending_blocks += len(resp.block_ids)
            trace.add("reserved", d.worker_id, detail=f"cached={resp.cached_prefix_tokens}")
            return d, resp
        if exhausted:
            return None
        raise WorkerLost("every decode worker failed Reserve")

    async def _renew(self, d: WorkerState, request_id: str, lease: wpb.ReserveResponse) -> None:
        period = max(0.05, lease.ttl_ms / 3000.0)
        req = wpb.LeaseRequest(request_id=request_id, lease_id=lease.lease_id)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await d.decode.RenewLease(req, metadata=self.md, timeout=period)

    async def _prefill(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                       d: WorkerState, lease: wpb.ReserveResponse,
                       trace: Trace) -> tuple[wpb.PrefillResponse, int]:
        dest = wpb.KVDestination(
            decode_address=d.address, agent_name=lease.agent_name,
            incarnation=lease.incarnation, block_ids=lease.block_ids,
            skip_prefix_tokens=lease.cached_prefix_tokens, lease_id=lease.lease_id)
        req = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                 sampling=sampling_to_proto(sampling), dest=dest)
        tried: set[str] = set()
        last = "no prefill worker"
        exhausted = False
        for _ in range(self.config.max_prefill_attempts):
            ranked = [p for p in self.policy.rank_prefill(self.registry.alive("prefill"), prompt)
                      if p.worker_id not in tried]
            if not ranked:
                break
            p = ranked[0]
            tried.add(p.worker_id)
            p.pending_prompt_tokens += len(prompt) - lease.cached_prefix_tokens
            p.inflight += 1
            trace.add("prefill_start", p.worker_id)
            try:
                resp = await p.prefill.Prefill(
                    req, metadata=self.md,
                    timeout=self._remaining(spec, self.config.prefill_timeout_s))
            except grpc.aio.AioRpcError as e:
                code = e.code()
                last = f"{p.worker_id}: {code.name} {e.details()}"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RouterError(code, e.details() or "invalid request") from e
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and spec.deadline is not None \
                        and time.monotonic() >= spec.deadline:
                    raise RouterError(code, "request deadline exceeded") from e
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted = True
                else:
                    self.registry.mark_suspect(p.worker_id, f"Prefill: {last}")
                trace.add("prefill_failed", p.worker_id, detail=last)
                logger.warning("prefill on %s failed (%s); retrying under the same lease",
                               p.worker_id, last)
                continue
            finally:
                p.inflight -= 1
            trace.add("prefill_end", p.worker_id,
                      detail=f"queue={resp.queue_ms:.1f}ms prefill={resp.prefill_ms:.1f}ms "
                             f"transfer={resp.transfer_ms:.1f}ms bytes={resp.kv_bytes}")
            trace.prefill = resp
            return resp, resp.cached_prompt_tokens
        if exhausted:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "prefill workers are saturated", retry_after_s=1.0)
        raise WorkerLost(f"prefill failed on every worker tried ({last})")

    async def _read_stream(self, spec: GenerateSpec, call: grpc.aio.UnaryStreamCall,
                           w: WorkerState, trace: Trace) -> AsyncIterator[TokenChunk]:
        """Relay a DecodeResponse stream; a broken stream becomes WorkerLost."""
        while True:
            try:
                resp = await asyncio.wait_for(call.read(), self._remaining(spec, 3600.0))
            except TimeoutError:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "request deadline exceeded") from None
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RouterError(code, e.details() or "invalid request") from e
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise RouterError(code, e.details() or "overloaded", retry_after_s=1.0) \
                        from e
                self.registry.mark_suspect(w.worker_id, f"stream: {code.name} {e.details()}")
                raise WorkerLost(f"{w.worker_id}: {code.name} {e.details()}") from e
            if resp is grpc.aio.EOF:
                return
            reason = finish_from_proto(resp.finish_reason)
            if reason == FinishReason.ERROR:
                raise WorkerLost(f"{w.worker_id}: {resp.error}")
            if reason == FinishReason.ABORT:
                raise WorkerLost(f"{w.worker_id} aborted the request: {resp.error}")
            yield TokenChunk(list(resp.token_ids),
                             [logprob_from_proto(lp) for lp in resp.logprobs]
                             or [None] * len(resp.token_ids),
                             reason, resp.cached_prompt_tokens)

    def _release_soon(self, d: WorkerState, request_id: str, lease_id: str) -> None:
        """End a lease without making the caller wait (the TTL is the backstop)."""

        async def release() -> None:
            with request_context(request_id), contextlib.suppress(grpc.aio.AioRpcError):
                await d.decode.Release(wpb.LeaseRequest(request_id=request_id,
                                                        lease_id=lease_id),
                                       metadata=self.md, timeout=2.0)

        asyncio.get_running_loop().create_task(release())
