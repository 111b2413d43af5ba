"""One request's life in the cluster (router-owned lease on the decode worker).

  prefill on P beside reserve on D  ->  KV streams P -> D  ->  first token  ->  decode on D

The hand-off itself (reserve, prefill, rebind, release) is ``router.handoff``, the first tokens
and the decode stream ``router.relay``; this module routes a pass (the fast lane, or
disaggregated) and resumes the request on worker failure. A decode worker lost
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
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import sampling_to_proto
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.calls import cancel
from kvrelay.router.errors import RouterError
from kvrelay.router.policy import Policy
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.relay import Relay
from kvrelay.router.requests import (
    GenerateSpec,
    Pass,
    RouterConfig,
    TokenChunk,
    WorkerLost,
    new_pass,
)
from kvrelay.router.trace import Trace
from kvrelay.router.worker_state import WorkerState

__all__ = ["GenerateSpec", "Lifecycle", "RouterConfig", "TokenChunk", "WorkerLost"]

logger = logging.getLogger(__name__)

class Lifecycle(Relay):
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
        self._background: set[asyncio.Task[None]] = set()  # releases in flight (strong refs)

    # -- entry ---------------------------------------------------------------------------------
    async def tokens(self, spec: GenerateSpec, trace: Trace, *,
                     produced: list[int] | None = None,
                     migrations: int = 0) -> AsyncIterator[TokenChunk]:
        """Yield the request's tokens in order until a worker reports it finished; an ``n > 1``
        request's chunks carry their choice's ``index``, each choice ends with a chunk of its
        own that has a finish reason. ``produced``, ``migrations``: resume a request that
        already produced these tokens (and moved that many times)."""
        if spec.sampling.n > 1:
            async with contextlib.aclosing(self._tokens_n(spec, trace)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        produced = list(produced or [])
        if migrations > self.config.max_migrations:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"request failed after {migrations - 1} migrations",
                              retry_after_s=1.0)
        while True:
            prompt = spec.prompt_token_ids + produced
            remaining = spec.sampling.max_tokens - len(produced)
            # Output so far rides at the prompt's end: the penalties still count it as output,
            # and min_tokens counts down by it.
            sampling = replace(spec.sampling, max_tokens=remaining,
                               # delivered with the first token: never again
                               prompt_logprobs=None if produced
                               else spec.sampling.prompt_logprobs,
                               min_tokens=max(0, spec.sampling.min_tokens - len(produced)),
                               resumed_output_tokens=spec.sampling.resumed_output_tokens
                               + len(produced))
            # Every pass runs under an id of its own on the workers (the client's id plus a
            # nonce, so logs still match by prefix): an earlier request of the same client id,
            # or the given-up attempt of this one, may still hold its id there (a lease whose
            # Release is in flight or lost, a prefill still sending, a stream being torn down).
            # Worker-side state is then never shared between two passes, whatever the timing.
            attempt = replace(spec, request_id=f"{spec.request_id}.{migrations}"
                                               f"{secrets.token_hex(3)}")
            try:
                async with contextlib.aclosing(self._one_pass(attempt, prompt, sampling,
                                                              trace)) as chunks:
                    async for chunk in chunks:
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
                tracing.event(trace.span, "migrate", reason=str(e)[:200], after=len(produced))
                logger.warning("resuming after %d tokens (migration %d): %s", len(produced),
                               migrations, e)

    async def _tokens_n(self, spec: GenerateSpec, trace: Trace) -> AsyncIterator[TokenChunk]:
        """``n > 1``: one prefill, the decode worker forks the choices. A pass that fails (or a
        cluster without a prefill/decode pair) continues each unfinished choice as a request
        of its own (``SamplingParams.choice``: seed + index), resumed after its tokens so far."""
        n = spec.sampling.n
        produced: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        migrations = 0
        if await self._disaggregate():
            attempt = replace(spec, request_id=f"{spec.request_id}.0{secrets.token_hex(3)}")
            try:
                async with contextlib.aclosing(self.disaggregated_pass(
                        attempt, spec.prompt_token_ids, spec.sampling, trace)) as chunks:
                    async for chunk in chunks:
                        i = chunk.index
                        if done[i]:
                            continue  # a choice whose first token ended it: the router knew
                        produced[i].extend(chunk.token_ids)
                        done[i] = chunk.finish_reason is not None
                        yield chunk
                        if all(done):
                            return
                raise WorkerLost("stream ended before every choice finished")
            except WorkerLost as e:
                migrations = 1
                trace.add("migrate", detail=str(e))
                logger.warning("resuming %d of %d choices on their own: %s",
                               n - sum(done), n, e)
        streams = {i: self.tokens(replace(spec, sampling=spec.sampling.choice(i)), trace,
                                  produced=produced[i], migrations=migrations)
                   for i in range(n) if not done[i]}
        async with contextlib.aclosing(_merge_choices(streams)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _one_pass(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                        trace: Trace) -> AsyncIterator[TokenChunk]:
        if not await self._disaggregate():
            async with contextlib.aclosing(self.local_pass(spec, prompt, sampling, trace)) as cs:
                async for c in cs:
                    yield c
            return
        ctx = new_pass(spec, prompt, sampling.max_tokens)
        ctx.count = spec.request_id not in self.probes
        t_route = time.monotonic()
        route = self.policy.route(ctx.req, self.registry.alive("decode"),
                                  self.registry.alive("prefill"))
        ctx.reason = route.reason
        if trace.span is not None:
            tracing.record("router.route", trace.span, t_route, time.monotonic(),
                           **{"kvrelay.route": route.reason,
                              "kvrelay.local": route.local is not None})
        logger.debug("route: %s", route.describe())
        if route.local is not None and sampling.n == 1:  # the fast lane: on a decode worker
            started = False
            try:
                async with contextlib.aclosing(self.local_pass(spec, prompt, sampling, trace,
                                                               route.local, ctx)) as cs:
                    async for c in cs:
                        started = True
                        yield c
                return
            except (WorkerLost, RouterError) as e:
                if started or (isinstance(e, RouterError)
                               and e.code != grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                trace.add("local_failed", route.local.worker_id, detail=str(e))
                ctx.reason = "local_refused"  # no token yet: disaggregate instead
        async with contextlib.aclosing(self.disaggregated_pass(spec, prompt, sampling, trace,
                                                               ctx)) as cs:
            async for c in cs:
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


    # -- aggregated workers (role=both) ----------------------------------------------------------
    async def local_pass(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                     trace: Trace, worker: WorkerState | None = None,
                     ctx: Pass | None = None) -> AsyncIterator[TokenChunk]:
        """Run the request wholly on one worker (GenerateLocal, with that worker's prefix
        cache): a role=both worker, or ``worker``, a decode worker (the fast lane)."""
        ctx = ctx or new_pass(spec, prompt, sampling.max_tokens)
        if worker is None:
            ranked = self.policy.rank_decode(self.registry.alive("both"), 0, ctx.req)
            if not ranked:
                raise WorkerLost("no role=both worker")
            worker = ranked[0]
        w, acct = worker, worker.accounting
        trace.add("local_start", w.worker_id, detail=ctx.reason)
        req = wpb.LocalGenerateRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                       cache_salt=spec.cache_salt or "",
                                       sampling=sampling_to_proto(sampling))
        now = time.monotonic()
        pending = self.policy.cost.local(w, ctx.req, now).new_tokens
        acct.pending_prompt_tokens += pending
        w.expect(ctx.req.hashes(w.identity.block_size), now + self.registry.expect_s)
        clean, batch = acct.local_inflight == 0, w.batch_estimate
        acct.dispatches += 1
        dispatched = acct.dispatches
        acct.inflight += 1
        acct.local_inflight += 1
        if ctx.count:
            w.perf.arrivals.tick(now)
        prefilling = True
        produced: list[int] = []
        call = None
        span = tracing.start("router.stream", trace.span,
                             **{"kvrelay.worker": w.worker_id, "kvrelay.local": True})
        try:
            t0 = time.monotonic()
            try:
                call = self._streams(w).GenerateLocal(
                    req, metadata=tracing.with_parent(self.md, span))
            except grpc.aio.UsageError as e:  # the registry dropped w (and closed its channel)
                raise WorkerLost(f"{w.worker_id} left the registry: {e}") from e
            async for chunk in self._read_stream(spec, call, w, trace):
                if prefilling:
                    prefilling = False
                    acct.local_inflight -= 1
                    acct.pending_prompt_tokens = max(0, acct.pending_prompt_tokens - pending)
                    self._observe_local(w, ctx, len(prompt), chunk.cached_prompt_tokens,
                                        time.monotonic() - t0, batch,
                                        clean and acct.dispatches == dispatched)
                produced.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    self._expect_sequence(w, ctx, produced)
                yield chunk
        finally:
            if prefilling:
                acct.local_inflight -= 1
                acct.pending_prompt_tokens = max(0, acct.pending_prompt_tokens - pending)
            acct.inflight -= 1
            if call is not None:
                call.cancel()
            tracing.end(span)

    # -- disaggregated ----------------------------------------------------------------------------
    async def disaggregated_pass(self, spec: GenerateSpec, prompt: list[int],
                             sampling: SamplingParams, trace: Trace,
                             ctx: Pass | None = None) -> AsyncIterator[TokenChunk]:
        ctx = ctx or new_pass(spec, prompt, sampling.max_tokens)
        if ctx.prefill is None:  # the decode worker binds the lease's KV to its sender
            ranked = self.policy.rank_prefill(self.registry.alive("prefill"), ctx.req)
            if ranked:
                ctx.prefill = ranked[0]
                ctx.unclaim = self._claim(ranked[0], ctx)
        if self.config.prefill_ahead and ctx.prefill is not None:
            self._send_ahead(spec, prompt, sampling, trace, ctx)
        try:
            d, lease = await self._reserve(spec, prompt, trace, ctx)
        except BaseException:
            ctx.drop_claim()
            cancel(ctx.ahead)  # it had no destination: nothing was written
            raise
        # The decode worker ends the lease itself only when its Decode stream ran to the end; a
        # pass left earlier (a client cancel, a stop string, a failure) releases it, even while
        # a Decode is open: its call may not have reached the worker yet, and a lease nobody
        # releases holds its blocks until the TTL.
        worker_ended_lease = False
        renew = asyncio.get_running_loop().create_task(self._renew(d, spec.request_id, lease))
        try:
            first, cached_p = await self._prefill(spec, prompt, sampling, d, lease, trace, ctx)
            renew.cancel()
            chunks = self._first_chunks(first, max(cached_p, lease.cached_prefix_tokens),
                                        sampling, len(prompt), d)
            if all(c.finish_reason is not None for c in chunks):
                self._expect_sequence(d, ctx, [])
            for chunk in chunks:
                yield chunk
            if all(c.finish_reason is not None for c in chunks):
                return
            ended = {c.index for c in chunks if c.finish_reason is not None}
            async with contextlib.aclosing(self._decode(spec, sampling, d, lease, first, trace,
                                                        ctx)) as stream:
                async for c in stream:
                    if c.finish_reason is not None:
                        ended.add(c.index)
                        worker_ended_lease = len(ended) >= sampling.n
                    yield c
            worker_ended_lease = True
        finally:
            d.accounting.inflight -= 1
            renew.cancel()
            ctx.drop_claim()
            cancel(ctx.ahead)
            if not worker_ended_lease:
                self._release_soon(d, spec.request_id, lease.lease_id,
                                   settled=not ctx.writes_unsettled)

    # -- measurements (the cost model's fits) ----------------------------------------------------
    def _observe_local(self, w: WorkerState, ctx: Pass, n: int, cached: int, ttft_s: float,
                       batch: int, clean: bool) -> None:
        """A local generation's first token: the tokens w computed and how long it took, less
        the wait for the decode batch it joined (when no other local prefill ran there)."""
        computed = n - cached
        if ctx.count:
            c = self.registry.counter(w)
            c.prompt_tokens += n
            c.computed_tokens += computed
        if ctx.record and clean and ctx.fit:
            wait = w.perf.step_fit.predict(batch) if batch > 0 else 0.0
            w.perf.local_fit.observe(computed, ttft_s - wait)


async def _merge_choices(streams: dict[int, AsyncIterator[TokenChunk]]
                         ) -> AsyncIterator[TokenChunk]:
    """The chunks of several single-choice streams as they come, each marked with its choice
    index; ends when every stream has finished. Leaving early closes them all."""
    pending: dict[asyncio.Future[TokenChunk], int] = {}

    def arm(i: int) -> None:
        pending[asyncio.ensure_future(anext(streams[i]))] = i

    for i in streams:
        arm(i)
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                chunk.index = i
                yield chunk
                if chunk.finish_reason is None:
                    arm(i)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams.values():
            await stream.aclose()  # type: ignore[attr-defined]
