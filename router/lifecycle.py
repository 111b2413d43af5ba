"""One request's life in the cluster (decode-first, router-owned lease).

  reserve on D  ->  prefill on P (KV streams P -> D)  ->  first token  ->  decode stream on D

A prefill worker that refuses a prompt before writing any KV is replaced under the same lease;
after any other prefill failure the request takes a fresh lease (the failed worker may still be
writing into the old blocks, which the decode worker quarantines). A decode worker lost
mid-stream is replaced by re-prefilling prompt + tokens already produced onto a new pair,
continuing the same stream (greedy output is unchanged). Every wait is bounded; leaving the
iterator (client cancel, stop string, deadline) ends the lease on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc

from kvrelay.convert import finish_from_proto, logprob_from_proto, sampling_to_proto
from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.engine.prefix_hash import salt_root
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.logs import request_context
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.errors import RouterError
from kvrelay.router.policy import DEFAULT_POLICY, Policy, RouteRequest
from kvrelay.router.registry import WorkerRegistry, WorkerState
from kvrelay.router.trace import Trace
from kvrelay.rpc import KV_DESTINATION_FAILED, KV_NOTHING_WRITTEN, WORKER_DRAINING

logger = logging.getLogger(__name__)

RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class RouterConfig:
    policy: str = DEFAULT_POLICY
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
    # Policies that measure workers (`auto`) probe each joining worker before routing to it,
    # this long at most; a worker not measured by then serves on the cost model's priors.
    calibration_timeout_s: float = 30.0
    # Send the Prefill at once, beside the Reserve, and name its destination (SetDestination)
    # when the Reserve answers: the Reserve's round trip leaves the time to first token.
    prefill_ahead: bool = True

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
    cache_salt: str | None = None  # prefix-cache namespace (engine.prefix_hash.salt_root)


@dataclass
class TokenChunk:
    """Tokens as a worker produced them (before detokenization and stop strings)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: FinishReason | None = None
    cached_prompt_tokens: int = 0


class WorkerLost(Exception):
    """The worker serving a stream failed; the stream may be resumed elsewhere."""


@dataclass
class _Pass:
    """Routing context of one pass of a request: the prompt with its block hashes, why this
    path was taken, and what its measurements feed."""

    req: RouteRequest
    reason: str = ""  # detail of the trace's prefill_start / local_start (decision metrics)
    # The prefill worker the lease's KV is promised to (ranked before Reserve, or pinned by a
    # warm-up probe); a retry elsewhere rebinds the lease first.
    prefill: WorkerState | None = None
    record: bool = True  # feed the cost model's measurements
    fit: bool = True  # including the compute fits (the warm-up probe feeds those itself)
    # A Prefill call under the lease ended in a way that may leave its writes landing (or is
    # still running): the lease's blocks must wait for its sender, not be reused at Release.
    writes_unsettled: bool = False
    # Undoes the load ``prefill`` was charged when it was chosen before the Reserve (so that
    # arrivals meanwhile spread over the pool); the dispatch takes the charge over.
    unclaim: Callable[[], None] | None = None
    # The Prefill sent beside the Reserve (``RouterConfig.prefill_ahead``) and when it left.
    ahead: asyncio.Task[wpb.PrefillResponse] | None = None
    ahead_t0: float = 0.0

    def drop_claim(self) -> None:
        if self.unclaim is not None:
            self.unclaim()
            self.unclaim = None
    count: bool = True  # count in the routing metrics


def _new_pass(spec: GenerateSpec, prompt: list[int], max_tokens: int = 1) -> _Pass:
    return _Pass(RouteRequest(prompt, max_tokens, salt_root(spec.cache_salt)))


class Lifecycle:
    """Produces a request's tokens from the cluster, resuming on worker failure."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, config: RouterConfig,
                 cluster_metadata: tuple[tuple[str, str], ...] = ()):
        self.registry = registry
        self.policy = policy
        self.config = config
        self.md = cluster_metadata
        policy.attach(registry)
        # Warm-up probes in flight (router/calibration.py): request id -> measurements recorded.
        self.probes: dict[str, bool] = {}

    # -- entry ---------------------------------------------------------------------------------
    async def tokens(self, spec: GenerateSpec, trace: Trace) -> AsyncIterator[TokenChunk]:
        """Yield the request's tokens in order until a worker reports it finished."""
        produced: list[int] = []
        migrations = 0
        while True:
            prompt = spec.prompt_token_ids + produced
            remaining = spec.sampling.max_tokens - len(produced)
            sampling = replace(spec.sampling, max_tokens=remaining)
            # Every pass runs under an id of its own on the workers (the client's id plus a
            # nonce, so logs still match by prefix): an earlier request of the same client id,
            # or the given-up attempt of this one, may still hold its id there (a lease whose
            # Release is in flight or lost, a prefill still sending, a stream being torn down).
            # Worker-side state is then never shared between two passes, whatever the timing.
            attempt = replace(spec, request_id=f"{spec.request_id}.{migrations}"
                                               f"{secrets.token_hex(3)}")
            try:
                async for chunk in self._one_pass(attempt, prompt, sampling, trace):
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
        if not await self._disaggregate():
            async for c in self.local_pass(spec, prompt, sampling, trace):
                yield c
            return
        ctx = _new_pass(spec, prompt, sampling.max_tokens)
        ctx.count = spec.request_id not in self.probes
        route = self.policy.route(ctx.req, self.registry.alive("decode"),
                                  self.registry.alive("prefill"))
        ctx.reason = route.reason
        logger.debug("route: %s", route.describe())
        if route.local is not None:  # the fast lane: wholly on a decode worker
            started = False
            try:
                async for c in self.local_pass(spec, prompt, sampling, trace, route.local, ctx):
                    started = True
                    yield c
                return
            except (WorkerLost, RouterError) as e:
                if started or (isinstance(e, RouterError)
                               and e.code != grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                trace.add("local_failed", route.local.worker_id, detail=str(e))
                ctx.reason = "local_refused"  # no token yet: disaggregate instead
        async for c in self.disaggregated_pass(spec, prompt, sampling, trace, ctx):
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
    async def local_pass(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                     trace: Trace, worker: WorkerState | None = None,
                     ctx: _Pass | None = None) -> AsyncIterator[TokenChunk]:
        """Run the request wholly on one worker (GenerateLocal, with that worker's prefix
        cache): a role=both worker, or ``worker``, a decode worker (the fast lane)."""
        ctx = ctx or _new_pass(spec, prompt, sampling.max_tokens)
        if worker is None:
            ranked = self.policy.rank_decode(self.registry.alive("both"), 0, ctx.req)
            if not ranked:
                raise WorkerLost("no role=both worker")
            worker = ranked[0]
        w = worker
        trace.add("local_start", w.worker_id, detail=ctx.reason)
        req = wpb.LocalGenerateRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                       cache_salt=spec.cache_salt or "",
                                       sampling=sampling_to_proto(sampling))
        now = time.monotonic()
        pending = self.policy.cost.local(w, ctx.req, now).new_tokens
        w.pending_prompt_tokens += pending
        w.expect(ctx.req.hashes(w.block_size), now + self.registry.expect_s)
        clean, batch = w.local_inflight == 0, w.batch_estimate
        w.dispatches += 1
        dispatched = w.dispatches
        w.inflight += 1
        w.local_inflight += 1
        if ctx.count:
            w.arrivals.tick(now)
        prefilling = True
        produced: list[int] = []
        call = None
        try:
            t0 = time.monotonic()
            try:
                call = w.decode.GenerateLocal(req, metadata=self.md)
            except grpc.aio.UsageError as e:  # the registry dropped w (and closed its channel)
                raise WorkerLost(f"{w.worker_id} left the registry: {e}") from e
            async for chunk in self._read_stream(spec, call, w, trace):
                if prefilling:
                    prefilling = False
                    w.local_inflight -= 1
                    w.pending_prompt_tokens = max(0, w.pending_prompt_tokens - pending)
                    self._observe_local(w, ctx, len(prompt), chunk.cached_prompt_tokens,
                                        time.monotonic() - t0, batch,
                                        clean and w.dispatches == dispatched)
                produced.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    self._expect_sequence(w, ctx, produced)
                yield chunk
        finally:
            if prefilling:
                w.local_inflight -= 1
                w.pending_prompt_tokens = max(0, w.pending_prompt_tokens - pending)
            w.inflight -= 1
            if call is not None:
                call.cancel()

    # -- disaggregated ----------------------------------------------------------------------------
    async def disaggregated_pass(self, spec: GenerateSpec, prompt: list[int],
                             sampling: SamplingParams, trace: Trace,
                             ctx: _Pass | None = None) -> AsyncIterator[TokenChunk]:
        ctx = ctx or _new_pass(spec, prompt, sampling.max_tokens)
        if ctx.prefill is None:  # the decode worker binds the lease's KV to its sender
            ranked = self.policy.rank_prefill(self.registry.alive("prefill"), ctx.req)
            if ranked:
                ctx.prefill = ranked[0]
                ctx.unclaim = self._claim(ranked[0], ctx)
        if self.config.prefill_ahead and ctx.prefill is not None:
            ahead = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                       cache_salt=spec.cache_salt or "",
                                       sampling=sampling_to_proto(sampling),
                                       destination_follows=True)
            ctx.ahead_t0 = time.monotonic()
            trace.add("prefill_start", ctx.prefill.worker_id, detail=ctx.reason or "ahead")
            ctx.ahead = asyncio.ensure_future(ctx.prefill.prefill.Prefill(
                ahead, metadata=self.md,
                timeout=self._remaining(spec, self.config.prefill_timeout_s)))
        try:
            d, lease = await self._reserve(spec, prompt, trace, ctx)
        except BaseException:
            ctx.drop_claim()
            await _cancel(ctx.ahead)  # it had no destination: nothing was written
            raise
        decode_started = False
        renew = asyncio.get_running_loop().create_task(self._renew(d, spec.request_id, lease))
        try:
            first, cached_p = await self._prefill(spec, prompt, sampling, d, lease, trace, ctx)
            renew.cancel()
            tok = first.first_token_id
            chunk = TokenChunk([tok], [logprob_from_proto(first.logprob)
                                       if first.HasField("logprob") else None],
                               cached_prompt_tokens=max(cached_p, lease.cached_prefix_tokens))
            chunk.finish_reason = self._first_token_stop(sampling, tok, len(prompt), d)
            if chunk.finish_reason is not None:
                self._expect_sequence(d, ctx, [])
            yield chunk
            if chunk.finish_reason is not None:
                return
            decode_started = True
            req = wpb.DecodeRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                                    first_token_id=tok, sampling=sampling_to_proto(sampling),
                                    kv_timeout_ms=int(self.config.kv_timeout_s * 1000))
            try:
                call = d.decode.Decode(req, metadata=self.md)
            except grpc.aio.UsageError as e:  # the registry dropped d (and closed its channel)
                raise WorkerLost(f"{d.worker_id} left the registry: {e}") from e
            trace.add("decode_start", d.worker_id)
            try:
                produced = [tok]
                async for c in self._read_stream(spec, call, d, trace):
                    if len(produced) == 1:
                        trace.add("decode_first", d.worker_id)
                    produced.extend(c.token_ids)
                    if c.finish_reason is not None:
                        self._expect_sequence(d, ctx, produced)
                    yield c
            finally:
                call.cancel()
        finally:
            d.inflight -= 1
            renew.cancel()
            ctx.drop_claim()
            await _cancel(ctx.ahead)
            if not decode_started:
                self._release_soon(d, spec.request_id, lease.lease_id,
                                   settled=not ctx.writes_unsettled)

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

    async def _reserve(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                       ctx: _Pass | None = None) -> tuple[WorkerState, wpb.ReserveResponse]:
        give_up = time.monotonic() + self.config.kv_wait_s
        if spec.deadline is not None:
            give_up = min(give_up, spec.deadline)
        pause = 0.02
        while True:
            got = await self._reserve_once(spec, prompt, trace, ctx)
            if got is not None:
                return got
            if time.monotonic() + pause > give_up:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "no decode worker has KV room for this request now",
                                  retry_after_s=1.0)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)

    async def _reserve_once(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                            ctx: _Pass | None = None
                            ) -> tuple[WorkerState, wpb.ReserveResponse] | None:
        """Reserve on the best decode worker that has room; None when all are full."""
        decoders = self.registry.alive("decode")
        if not decoders:
            raise WorkerLost("no decode worker")
        bs = decoders[0].block_size
        need = -(-(len(prompt) + 1) // bs)
        exhausted = 0
        ctx = ctx or _new_pass(spec, prompt)
        for d in self.policy.rank_decode(decoders, need, ctx.req):
            req = wpb.ReserveRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                     cache_salt=spec.cache_salt or "",
                                     ttl_ms=int(self.config.lease_ttl_s * 1000),
                                     sender_agent=ctx.prefill.worker_id if ctx.prefill else "",
                                     sender_address=ctx.prefill.address if ctx.prefill else "")
            # Counted from the reservation on (the caller drops it when the request leaves this
            # worker), so concurrent arrivals between two heartbeats spread over the pool.
            d.inflight += 1
            t_rpc = time.monotonic()
            try:
                resp = await d.decode.Reserve(
                    req, metadata=self.md,
                    timeout=self._remaining(spec, self.config.reserve_timeout_s))
            except BaseException as e:
                d.inflight -= 1
                if isinstance(e, grpc.aio.UsageError):  # d left the registry meanwhile
                    continue
                if isinstance(e, asyncio.CancelledError) and _call_cancelled(self, d):
                    continue
                if not isinstance(e, grpc.aio.AioRpcError):
                    raise
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RouterError(code, e.details() or "invalid request") from e
                if _trailer_says(e, WORKER_DRAINING):
                    continue  # leaving as planned; its heartbeat says so too
                self.registry.mark_suspect(d.worker_id, f"Reserve: {code.name} {e.details()}")
                continue
            d.pending_blocks += len(resp.block_ids)
            trace.reserve_ms = (time.monotonic() - t_rpc) * 1000.0
            if ctx.record:
                d.reserve_rpc_s.observe(time.monotonic() - t_rpc)
            if ctx.count:
                d.arrivals.tick(time.monotonic())
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
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await d.decode.RenewLease(req, metadata=self.md, timeout=period)

    async def _prefill(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                       d: WorkerState, lease: wpb.ReserveResponse,
                       trace: Trace, ctx: _Pass | None = None
                       ) -> tuple[wpb.PrefillResponse, int]:
        ctx = ctx or _new_pass(spec, prompt, sampling.max_tokens)
        dest = wpb.KVDestination(
            decode_address=d.address, agent_name=lease.agent_name,
            incarnation=lease.incarnation, block_ids=lease.block_ids,
            skip_prefix_tokens=lease.cached_prefix_tokens, lease_id=lease.lease_id)
        req = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                 cache_salt=spec.cache_salt or "",
                                 sampling=sampling_to_proto(sampling), dest=dest)
        tried: set[str] = set()
        last = "no prefill worker"
        exhausted = False
        bound = ctx.prefill.worker_id if ctx.prefill is not None else ""  # the lease's sender
        for _ in range(self.config.max_prefill_attempts):
            if ctx.prefill is not None and not tried:
                ranked = [ctx.prefill]
            else:
                ranked = [p for p in self.policy.rank_prefill(self.registry.alive("prefill"),
                                                              ctx.req)
                          if p.worker_id not in tried]
            if not ranked:
                break
            p = ranked[0]
            tried.add(p.worker_id)
            if p.worker_id != bound:  # nothing was written under the lease: promise it to p
                await self._rebind(spec, d, lease, p)
                bound = p.worker_id
            ctx.drop_claim()  # the dispatch charges p itself now
            now = time.monotonic()
            pending = self.policy.cost.prefill(p, ctx.req, now).new_tokens
            p.pending_prompt_tokens += pending
            p.expect(ctx.req.hashes(p.block_size), now + self.registry.expect_s)
            clean = p.inflight == 0
            p.dispatches += 1
            dispatched = p.dispatches
            p.inflight += 1
            if ctx.ahead is not None:  # sent already (its prefill_start is in the trace)
                trace.add("destination", p.worker_id, detail=d.worker_id)
            else:
                trace.add("prefill_start", p.worker_id, detail=ctx.reason if len(tried) == 1
                          else "retry")
            t_rpc = time.monotonic()
            ctx.writes_unsettled = True
            try:
                if ctx.ahead is not None:  # already computing: name its destination
                    t_rpc = ctx.ahead_t0
                    resp = await self._join_ahead(spec, p, dest, ctx)
                else:
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
                trace.add("prefill_failed", p.worker_id, detail=last)
                if _dest_failed(e):  # the decode worker holding the lease failed, not p
                    self.registry.mark_suspect(d.worker_id, f"KV destination: {last}")
                    raise WorkerLost(f"KV destination {d.worker_id} failed: {last}") from e
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted = True
                elif not _trailer_says(e, WORKER_DRAINING):  # draining: leaving as planned
                    self.registry.mark_suspect(p.worker_id, f"Prefill: {last}")
                if not _nothing_written(e):
                    # p may still write into the lease's blocks (it stalled, or only its
                    # connection broke): a rerun there could be overwritten by p's late writes.
                    # Take fresh blocks instead; d quarantines these until p's writes end.
                    raise WorkerLost(f"prefill failed ({last}); its KV writes may still "
                                     f"land: a new lease") from e
                ctx.writes_unsettled = False
                logger.warning("prefill on %s failed (%s); retrying under the same lease",
                               p.worker_id, last)
                continue
            except asyncio.CancelledError:
                if not _call_cancelled(self, p):
                    raise
                last = f"{p.worker_id}: dropped from the registry during the call"
                trace.add("prefill_failed", p.worker_id, detail=last)
                raise WorkerLost(f"prefill failed ({last}); its KV writes may still land: "
                                 f"a new lease") from None
            finally:
                p.inflight -= 1
                p.pending_prompt_tokens = max(0, p.pending_prompt_tokens - pending)
            ctx.writes_unsettled = False  # answered: every write landed and was notified
            trace.add("prefill_end", p.worker_id,
                      detail=f"queue={resp.queue_ms:.1f}ms prefill={resp.prefill_ms:.1f}ms "
                             f"transfer={resp.transfer_ms:.1f}ms bytes={resp.kv_bytes}")
            trace.prefill = resp
            self._observe_prefill(p, d, lease, ctx, resp, time.monotonic() - t_rpc,
                                  clean and p.dispatches == dispatched)
            return resp, resp.cached_prompt_tokens
        if exhausted:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "prefill workers are saturated", retry_after_s=1.0)
        raise WorkerLost(f"prefill failed on every worker tried ({last})")

    async def _read_stream(self, spec: GenerateSpec, call: grpc.aio.UnaryStreamCall,
                           w: WorkerState, trace: Trace) -> AsyncIterator[TokenChunk]:
        """Relay a DecodeResponse stream; a broken stream becomes WorkerLost."""
        last: float | None = None  # gaps between streamed tokens measure w's decode steps
        record = self.probes.get(spec.request_id, True)
        while True:
            try:
                resp = await asyncio.wait_for(call.read(), self._remaining(spec, 3600.0))
            except TimeoutError:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "request deadline exceeded") from None
            except asyncio.CancelledError:
                if not _call_cancelled(self, w):
                    raise
                raise WorkerLost(f"{w.worker_id}: dropped from the registry mid-stream") \
                    from None
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
            now = time.monotonic()
            if resp.kv_wait_ms:
                trace.decode_kv_wait_ms = resp.kv_wait_ms
            if last is not None and record and resp.token_ids:
                w.step_fit.observe(w.batch_estimate, now - last)
            last = now
            reason = finish_from_proto(resp.finish_reason)
            if reason == FinishReason.ERROR:
                raise WorkerLost(f"{w.worker_id}: {resp.error}")
            if reason == FinishReason.ABORT:
                raise WorkerLost(f"{w.worker_id} aborted the request: {resp.error}")
            yield TokenChunk(list(resp.token_ids),
                             [logprob_from_proto(lp) for lp in resp.logprobs]
                             or [None] * len(resp.token_ids),
                             reason, resp.cached_prompt_tokens)

    # -- measurements (the cost model's fits) and cache expectations ------------------------------
    def _observe_prefill(self, p: WorkerState, d: WorkerState, lease: wpb.ReserveResponse,
                         ctx: _Pass, resp: wpb.PrefillResponse, wall_s: float,
                         clean: bool) -> None:
        """A prefill's measurements: P's compute time for the tokens it computed (when it ran
        alone there), transfer time against bytes, the RPC's own overhead."""
        n = len(ctx.req)
        computed = n - resp.cached_prompt_tokens
        skip = lease.cached_prefix_tokens // d.block_size
        sent = len(lease.block_ids) - skip
        p.expect(ctx.req.hashes(p.block_size), time.monotonic() + self.registry.expect_s)
        if ctx.count:
            c = self.registry.counter(p)
            c.prompt_tokens += n
            c.computed_tokens += computed
            c = self.registry.counter(d)
            c.kv_blocks_sent += sent
            c.kv_blocks_skipped += skip
        if not ctx.record:
            return
        if clean and computed > 0 and ctx.fit:
            p.prefill_fit.observe(computed, resp.prefill_ms / 1e3)
        perf = self.registry.perf
        perf.observe_transfer(resp.kv_bytes, sent, resp.transfer_ms / 1e3)
        if clean:  # queue_ms of an idle worker is the hand-off to its engine: overhead
            perf.prefill_rpc_s.observe(wall_s - (resp.prefill_ms + resp.transfer_ms) / 1e3)

    def _observe_local(self, w: WorkerState, ctx: _Pass, n: int, cached: int, ttft_s: float,
                       batch: int, clean: bool) -> None:
        """A local generation's first token: the tokens w computed and how long it took, less
        the wait for the decode batch it joined (when no other local prefill ran there)."""
        computed = n - cached
        if ctx.count:
            c = self.registry.counter(w)
            c.prompt_tokens += n
            c.computed_tokens += computed
        if ctx.record and clean and ctx.fit:
            wait = w.step_fit.predict(batch) if batch > 0 else 0.0
            w.local_fit.observe(computed, ttft_s - wait)

    def _expect_sequence(self, w: WorkerState, ctx: _Pass, produced: list[int]) -> None:
        """w now holds the KV of the prompt and the tokens produced (the last has none yet):
        count on it for prefix routing until its beats can report it."""
        toks = produced[:-1]
        hashes = (ctx.req.extended_hashes(toks, w.block_size) if toks
                  else ctx.req.hashes(w.block_size))
        w.expect(hashes, time.monotonic() + self.registry.expect_s)

    async def _join_ahead(self, spec: GenerateSpec, p: WorkerState, dest: wpb.KVDestination,
                          ctx: _Pass) -> wpb.PrefillResponse:
        """Name the destination of the Prefill sent ahead, then await its answer. A refused
        SetDestination cancels it (nothing was written without one) unless it has ended: then
        its own outcome says more."""
        ahead, ctx.ahead = ctx.ahead, None
        assert ahead is not None
        try:
            try:
                await p.prefill.SetDestination(
                    wpb.SetDestinationRequest(request_id=spec.request_id, dest=dest),
                    metadata=self.md,
                    timeout=self._remaining(spec, self.config.reserve_timeout_s))
            except grpc.aio.AioRpcError:
                if not ahead.done():
                    raise
            return await ahead
        except BaseException:
            await _cancel(ahead)  # a no-op once it has ended
            raise

    def _claim(self, p: WorkerState, ctx: _Pass) -> Callable[[], None]:
        pending = self.policy.cost.prefill(p, ctx.req, time.monotonic()).new_tokens
        p.pending_prompt_tokens += pending
        p.inflight += 1

        def unclaim() -> None:
            p.inflight -= 1
            p.pending_prompt_tokens = max(0, p.pending_prompt_tokens - pending)

        return unclaim

    async def _rebind(self, spec: GenerateSpec, d: WorkerState, lease: wpb.ReserveResponse,
                      p: WorkerState) -> None:
        req = wpb.LeaseRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                               sender_agent=p.worker_id, sender_address=p.address)
        try:
            await d.decode.RenewLease(req, metadata=self.md,
                                      timeout=self._remaining(spec, self.config.reserve_timeout_s))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise WorkerLost(f"could not promise {d.worker_id}'s lease to {p.worker_id}: "
                             f"{e}") from e

    def _release_soon(self, d: WorkerState, request_id: str, lease_id: str, *,
                      settled: bool = False) -> None:
        """End a lease without making the caller wait (the TTL is the backstop). ``settled``:
        no prefill can still write into its blocks, so d may reuse them at once."""

        async def release() -> None:
            # d may have left the registry and come back (missed heartbeats): its old channel is
            # closed, the process and the lease live on; reach it by its current entry.
            cur = self.registry.workers.get(d.worker_id)
            w = cur if cur is not None and cur.incarnation == d.incarnation else d
            with request_context(request_id), \
                    contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await w.decode.Release(wpb.LeaseRequest(request_id=request_id,
                                                        lease_id=lease_id,
                                                        writes_settled=settled),
                                       metadata=self.md, timeout=2.0)

        asyncio.get_running_loop().create_task(release())


async def _cancel(task: asyncio.Future[object] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task


def _trailer_says(e: grpc.aio.AioRpcError, pairs: tuple[tuple[str, str], ...]) -> bool:
    try:
        md = tuple(e.trailing_metadata() or ())
    except Exception:
        return False
    return any((k, v) in pairs for k, v in md)


def _nothing_written(e: grpc.aio.AioRpcError) -> bool:
    """True when a Prefill was refused before it wrote any KV (see ``KV_NOTHING_WRITTEN``)."""
    return _trailer_says(e, KV_NOTHING_WRITTEN)


def _dest_failed(e: grpc.aio.AioRpcError) -> bool:
    """True when a Prefill failed because of its KV destination (see ``KV_DESTINATION_FAILED``)."""
    return _trailer_says(e, KV_DESTINATION_FAILED)


def _call_cancelled(lc: Lifecycle, w: WorkerState) -> bool:
    """Whether a CancelledError out of a call to ``w`` is the call's, not this request's.

    The registry closes the channel of a worker it drops (missed heartbeats), which cancels the
    calls in flight on it: they raise CancelledError although nobody cancelled the request.
    Left alone, that ends the request's handler without a status, and the client waits until
    its deadline (forever without one). Such a call counts as a lost worker instead.
    """
    task = asyncio.current_task()
    if task is not None and hasattr(task, "cancelling"):  # Python >= 3.11
        return task.cancelling() == 0
    return lc.registry.workers.get(w.worker_id) is not w
