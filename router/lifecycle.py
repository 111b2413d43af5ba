"""One request's life in the cluster (router-owned lease on the decode worker).

  prefill on P beside reserve on D  ->  KV streams P -> D  ->  first token  ->  decode on D

This module reads in call order: ``tokens`` resumes the request on worker failure, ``_one_pass``
routes a pass (the fast lane, or disaggregated), ``disaggregated_pass`` runs
route -> reserve -> prefill -> decode -> relay. Each step is an object of its own, wired in
``Lifecycle.__init__``: ``Leases`` (router/leases.py), ``PrefillCalls``
(router/prefill_calls.py), ``Relay`` (router/relay.py), ``FastLane`` (router/fast_lane.py);
what they share is the ``Cluster`` (router/cluster.py). A decode worker lost
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
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.calls import cancel
from kvrelay.router.cluster import Cluster
from kvrelay.router.errors import RouterError
from kvrelay.router.fast_lane import FastLane
from kvrelay.router.leases import Leases
from kvrelay.router.policy import Policy, Route
from kvrelay.router.prefill_calls import PrefillCalls
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
from kvrelay.router.trace import Step, Trace
from kvrelay.router.worker_state import WorkerState

__all__ = ["GenerateSpec", "Lifecycle", "RouterConfig", "TokenChunk", "WorkerLost"]

logger = logging.getLogger(__name__)

class Lifecycle:
    """Produces a request's tokens from the cluster, resuming on worker failure."""

    def __init__(self, registry: WorkerRegistry, policy: Policy, config: RouterConfig,
                 cluster_metadata: tuple[tuple[str, str], ...] = ()):
        policy.attach(registry)
        self.cluster = Cluster(registry, policy, config, cluster_metadata)
        self.leases = Leases(self.cluster)
        self.prefill = PrefillCalls(self.cluster, self.leases)
        self.relay = Relay(self.cluster)  # its EOS ids: RouterService sets eos_token_ids
        self.fast_lane = FastLane(self.cluster, self.relay)

    @property
    def registry(self) -> WorkerRegistry:
        return self.cluster.registry

    @property
    def config(self) -> RouterConfig:
        return self.cluster.config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.relay.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.relay.eos_token_ids = ids

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
        if migrations > self.cluster.config.max_migrations:
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
                if migrations > self.cluster.config.max_migrations:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"request failed after {migrations - 1} migrations: {e}",
                                      retry_after_s=1.0) from e
                trace.add(Step.MIGRATE, detail=str(e))
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
                trace.add(Step.MIGRATE, detail=str(e))
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
        route = self._route(ctx, trace)
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
                trace.add(Step.LOCAL_FAILED, route.local.worker_id, detail=str(e))
                ctx.reason = "local_refused"  # no token yet: disaggregate instead
        async with contextlib.aclosing(self.disaggregated_pass(spec, prompt, sampling, trace,
                                                               ctx)) as cs:
            async for c in cs:
                yield c

    def _route(self, ctx: Pass, trace: Trace) -> Route:
        """The policy's choice for the pass: the fast lane, or disaggregated (and why)."""
        t_route = time.monotonic()
        registry = self.cluster.registry
        route = self.cluster.policy.route(ctx.req, registry.alive("decode"),
                                          registry.alive("prefill"))
        ctx.reason = route.reason
        if trace.span is not None:
            tracing.record("router.route", trace.span, t_route, time.monotonic(),
                           **{"kvrelay.route": route.reason,
                              "kvrelay.local": route.local is not None})
        logger.debug("route: %s", route.describe())
        return route

    async def _disaggregate(self) -> bool:
        """True when a prefill/decode pair is up, False when only role=both workers are; waits
        (bounded) for workers to appear."""
        registry = self.cluster.registry
        deadline = time.monotonic() + self.cluster.config.worker_wait_s
        while True:
            if registry.alive("decode") and registry.alive("prefill"):
                return True
            if registry.alive("both"):
                return False
            if time.monotonic() >= deadline:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no workers available",
                                  retry_after_s=1.0)
            await asyncio.sleep(0.05)

    def local_pass(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                   trace: Trace, worker: WorkerState | None = None,
                   ctx: Pass | None = None) -> AsyncIterator[TokenChunk]:
        """Run the request wholly on one worker: a role=both worker, or ``worker``, a decode
        worker (the fast lane)."""
        return self.fast_lane.run(spec, prompt, sampling, trace, worker, ctx)

    async def disaggregated_pass(self, spec: GenerateSpec, prompt: list[int],
                                 sampling: SamplingParams, trace: Trace,
                                 ctx: Pass | None = None) -> AsyncIterator[TokenChunk]:
        """route -> reserve -> prefill -> decode -> relay: the pass's KV computed on a prefill
        worker straight into blocks reserved on a decode worker, which then decodes."""
        ctx = ctx or new_pass(spec, prompt, sampling.max_tokens)
        self.prefill.choose(ctx)
        if self.cluster.config.prefill_ahead and ctx.prefill is not None:
            self.prefill.send_ahead(spec, prompt, sampling, trace, ctx)
        try:
            try:
                lease = await self.leases.reserve(spec, prompt, trace, ctx)
            except BaseException:
                cancel(ctx.ahead)  # it had no destination: nothing was written
                raise
            async with self.leases.held(lease, spec, ctx):
                async with self.leases.renewed(lease, spec):
                    first = await self.prefill.run(spec, prompt, sampling, lease, trace, ctx)
                cached = max(first.cached_prompt_tokens, lease.cached_prefix_tokens)
                chunks = self.relay.first_chunks(first, cached, sampling, len(prompt),
                                                 lease.worker)
                ended = {c.index for c in chunks if c.finish_reason is not None}
                if len(ended) == len(chunks):
                    self.relay.expect_sequence(lease.worker, ctx, [])
                for chunk in chunks:
                    yield chunk
                if len(ended) == len(chunks):
                    return
                async with contextlib.aclosing(self.relay.decode(spec, sampling, lease, first,
                                                                 trace, ctx)) as stream:
                    async for c in stream:
                        if c.finish_reason is not None:
                            ended.add(c.index)
                            lease.ended_by_worker = len(ended) >= sampling.n
                        yield c
                lease.ended_by_worker = True
        finally:
            ctx.drop_claim()
            cancel(ctx.ahead)


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
