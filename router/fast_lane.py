"""A request run wholly on one worker (``GenerateLocal``, with that worker's prefix cache): a
role=both worker, or a decode worker that the policy judged quicker than a prefill/decode pair
(the fast lane). The worker prefills and decodes; its tokens come back on one stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import sampling_to_proto
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.cluster import Cluster
from kvrelay.router.relay import Relay
from kvrelay.router.requests import GenerateSpec, Pass, TokenChunk, WorkerLost, new_pass
from kvrelay.router.trace import Step, Trace
from kvrelay.router.worker_state import HeldPrefix, WorkerState


class FastLane:
    def __init__(self, cluster: Cluster, relay: Relay):
        self.cluster = cluster
        self.relay = relay

    async def run(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                  trace: Trace, worker: WorkerState | None = None,
                  ctx: Pass | None = None) -> AsyncIterator[TokenChunk]:
        """The request's tokens from ``worker`` (default: the best role=both worker). Leaving
        the iterator cancels the call."""
        ctx = ctx or new_pass(spec, prompt, sampling.max_tokens)
        w = worker or self._best_local(ctx)
        trace.add(Step.LOCAL_START, w.worker_id, detail=ctx.reason)
        req = wpb.LocalGenerateRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                       cache_salt=spec.cache_salt or "",
                                       sampling=sampling_to_proto(sampling))
        now = time.monotonic()
        est = self.cluster.policy.cost.local(w, ctx.req, now)
        charge = w.accounting.charge(prompt_tokens=est.new_tokens, local=True)
        # after the charge: an expected block would count as cached
        w.expect(ctx.req.hashes(w.identity.block_size), now + self.cluster.registry.expect_s)
        if ctx.count:
            w.perf.arrivals.tick(now)
        span = tracing.start("router.stream", trace.span,
                             **{"kvrelay.worker": w.worker_id, "kvrelay.local": True})
        call = None
        with charge:
            try:
                call = self._open(w, req, span)
                produced: list[int] = []
                async for chunk in self.relay.read_stream(spec, call, w, trace):
                    if charge.prefilling:  # the first token: the prompt is computed
                        charge.prefilled()
                        self._count(w, ctx, len(prompt), chunk.cached_prompt_tokens,
                                    est.held)
                    produced.extend(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        self.relay.expect_sequence(w, ctx, produced)
                    yield chunk
            finally:
                if call is not None:
                    call.cancel()
                tracing.end(span)

    def _best_local(self, ctx: Pass) -> WorkerState:
        ranked = self.cluster.policy.rank_decode(self.cluster.registry.alive("both"), 0,
                                                 ctx.req)
        if not ranked:
            raise WorkerLost("no role=both worker")
        return ranked[0]

    def _open(self, w: WorkerState, req: wpb.LocalGenerateRequest,
              span: object) -> grpc.aio.UnaryStreamCall:
        try:
            return self.relay.streams(w).GenerateLocal(
                req, metadata=tracing.with_parent(self.cluster.md, span))
        except grpc.aio.UsageError as e:  # the registry dropped w (and closed its channel)
            raise WorkerLost(f"{w.worker_id} left the registry: {e}") from e

    def _count(self, w: WorkerState, ctx: Pass, n: int, cached: int,
               held: HeldPrefix) -> None:
        """A local generation's first token: the prompt tokens w was given and computed (its
        compute time is its engine's to measure: the step-time fit in its beats), and those it
        held when chosen, by tier."""
        if ctx.count:
            c = self.cluster.registry.counter(w)
            c.prompt_tokens += n
            c.computed_tokens += n - cached
            c.credit(held, w.identity.block_size)
