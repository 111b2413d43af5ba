"""The Prefill calls of a disaggregated pass: choose the prefill worker, send the Prefill (ahead
of the Reserve, or with its destination), replace a worker that refuses, and measure it.

The Prefill may leave beside the Reserve (``RouterConfig.prefill_ahead``) and learn its
destination by ``SetDestination``; the lease's KV is promised to that prefill worker (the
decode worker accepts its notification only). A prefill worker that refuses a prompt before
writing anything is replaced under the same lease (rebound to the new worker first); after any
other failure the pass takes a fresh lease (``WorkerLost``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import sampling_to_proto
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.calls import call_cancelled, cancel, dest_failed, draining, nothing_written
from kvrelay.router.cluster import Cluster
from kvrelay.router.errors import RouterError
from kvrelay.router.leases import Lease, Leases
from kvrelay.router.prefix_pull import PrefixPulls
from kvrelay.router.requests import GenerateSpec, Pass, WorkerLost
from kvrelay.router.trace import Step, Trace
from kvrelay.router.worker_state import Charge, HeldPrefix, WorkerState

logger = logging.getLogger(__name__)


class PrefillCalls:
    def __init__(self, cluster: Cluster, leases: Leases):
        self.cluster = cluster
        self.leases = leases
        self.pulls = PrefixPulls(cluster.registry, cluster.policy.cost, cluster.config.prefix_pull)

    def choose(self, ctx: Pass) -> None:
        """Pick the pass's prefill worker before the Reserve (the decode worker binds the
        lease's KV to it) and charge it, so that arrivals meanwhile spread over the pool; a
        pass that has one (pinned) keeps it."""
        if ctx.prefill is not None:  # pinned (the warm-up probe)
            return
        ranked = self.cluster.policy.rank_prefill(self.cluster.registry.alive("prefill"),
                                                  ctx.req)
        if ranked:
            ctx.prefill = ranked[0]
            ctx.claim = self._charge(ranked[0], ctx)

    def send_ahead(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                   trace: Trace, ctx: Pass) -> None:
        """Send the Prefill now, its destination to follow (the Reserve runs meanwhile)."""
        assert ctx.prefill is not None
        c = self.cluster
        ahead = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                   cache_salt=spec.cache_salt or "",
                                   sampling=sampling_to_proto(sampling), destination_follows=True)
        self._pull_hint(ctx.prefill, ctx, ahead)
        ctx.ahead_t0 = time.monotonic()
        trace.add(Step.PREFILL_START, ctx.prefill.worker_id, detail=ctx.reason or "ahead")
        span = tracing.start("router.prefill", trace.span, **{
            "kvrelay.worker": ctx.prefill.worker_id, "kvrelay.ahead": True})
        ctx.ahead = asyncio.ensure_future(ctx.prefill.identity.prefill.Prefill(
            ahead, metadata=tracing.with_parent(c.md, span),
            timeout=c.remaining(spec, c.config.prefill_timeout_s)))
        if span is not None:
            ctx.ahead.add_done_callback(lambda _: tracing.end(span))

    async def run(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                  lease: Lease, trace: Trace, ctx: Pass) -> wpb.PrefillResponse:
        """The prompt's KV written into ``lease``'s blocks and the first token(s) sampled: on
        the pass's prefill worker, or the next ones while each refuses before writing."""
        dest = lease.destination()
        req = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                 cache_salt=spec.cache_salt or "",
                                 sampling=sampling_to_proto(sampling), dest=dest)
        tried: set[str] = set()
        last = "no prefill worker"
        exhausted = False
        bound = ctx.prefill.worker_id if ctx.prefill is not None else ""  # the lease's sender
        for _ in range(self.cluster.config.max_prefill_attempts):
            p = self._next_worker(ctx, tried)
            if p is None:
                break
            tried.add(p.worker_id)
            if p.worker_id != bound:  # nothing was written under the lease: promise it to p
                await self.leases.rebind(spec, lease, p)
                bound = p.worker_id
            if ctx.ahead is not None:
                trace.add(Step.DESTINATION, p.worker_id, lease.worker.worker_id)
            else:
                trace.add(Step.PREFILL_START, p.worker_id,
                          ctx.reason if len(tried) == 1 else "retry")
            try:
                return await self._on(p, spec, req, lease, trace, ctx)
            except grpc.aio.AioRpcError as e:
                # raises unless p wrote nothing: then the lease's blocks are clean again
                last = self._refused(e, spec, p, lease.worker, trace)
                exhausted = exhausted or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            except grpc.aio.UsageError:  # p left the registry (its channel closed): never sent
                last = f"{p.worker_id}: left the registry"
                trace.add(Step.PREFILL_FAILED, p.worker_id, detail=last)
            ctx.writes_unsettled = False
        if exhausted:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "prefill workers are saturated", retry_after_s=1.0)
        raise WorkerLost(f"prefill failed on every worker tried ({last})")

    async def _on(self, p: WorkerState, spec: GenerateSpec, req: wpb.PrefillRequest,
                  lease: Lease, trace: Trace, ctx: Pass) -> wpb.PrefillResponse:
        """One Prefill on ``p``, charged to it while it runs; ``ctx.writes_unsettled`` from
        the call on, until it answers (or ``run`` learns that it wrote nothing)."""
        ctx.drop_claim()  # the dispatch charges p itself now
        clean = p.accounting.inflight == 0
        p.accounting.dispatches += 1
        dispatched = p.accounting.dispatches
        # before the expectation: it would count as cached
        est = self.cluster.policy.cost.prefill(p, ctx.req, time.monotonic())
        if ctx.ahead is None:  # (one sent ahead carries its hint already)
            self._pull_hint(p, ctx, req)
        with p.accounting.charge(prompt_tokens=est.new_tokens):
            p.expect(ctx.req.hashes(p.identity.block_size),
                     time.monotonic() + self.cluster.registry.expect_s)
            ctx.writes_unsettled = True
            try:
                resp, t_rpc = await self._call(spec, p, req, lease.destination(), trace, ctx)
            except asyncio.CancelledError:
                if not call_cancelled(self.cluster.registry, p):
                    raise  # the request left: its writes may still land (unsettled)
                last = f"{p.worker_id}: dropped from the registry during the call"
                trace.add(Step.PREFILL_FAILED, p.worker_id, detail=last)
                raise WorkerLost(f"prefill failed ({last}); its KV writes may still land: "
                                 f"a new lease") from None
        ctx.writes_unsettled = False  # answered: every write landed and was notified
        trace.add_prefill_end(p.worker_id, resp)
        self._observe(p, lease, ctx, resp, time.monotonic() - t_rpc,
                      clean and p.accounting.dispatches == dispatched, est.held)
        return resp

    def _pull_hint(self, p: WorkerState, ctx: Pass, req: wpb.PrefillRequest) -> None:
        """Start ``p``'s Prefill with a pull of the prompt's prefix from another worker that
        holds more of it, when the cost model (or ``--prefix-pull always``) says so."""
        plan = self.pulls.plan(p, ctx.req, count=ctx.count)
        if plan is None:
            req.ClearField("pull")
        else:
            req.pull.CopyFrom(plan.hint())

    def _charge(self, p: WorkerState, ctx: Pass) -> Charge:
        pending = self.cluster.policy.cost.prefill(p, ctx.req, time.monotonic()).new_tokens
        return p.accounting.charge(prompt_tokens=pending)

    async def _call(self, spec: GenerateSpec, p: WorkerState, req: wpb.PrefillRequest,
                    dest: wpb.KVDestination, trace: Trace,
                    ctx: Pass) -> tuple[wpb.PrefillResponse, float]:
        """The Prefill on ``p``: the one sent ahead, named its destination, or a call made now;
        its answer and when it left."""
        if ctx.ahead is not None:  # already computing: name its destination
            t_rpc = ctx.ahead_t0
            return await self._join_ahead(spec, p, dest, ctx), t_rpc
        c = self.cluster
        t_rpc = time.monotonic()
        span = tracing.start("router.prefill", trace.span, **{"kvrelay.worker": p.worker_id})
        try:
            resp = await p.identity.prefill.Prefill(
                req, metadata=tracing.with_parent(c.md, span),
                timeout=c.remaining(spec, c.config.prefill_timeout_s))
        except grpc.aio.AioRpcError as e:
            tracing.end(span, error=f"{e.code().name} {e.details()}")
            span = None
            raise
        finally:
            tracing.end(span)
        return resp, t_rpc

    def _next_worker(self, ctx: Pass, tried: set[str]) -> WorkerState | None:
        """The pass's chosen worker first, then the best one not tried yet."""
        if ctx.prefill is not None and not tried:
            return ctx.prefill
        c = self.cluster
        ranked = [p for p in c.policy.rank_prefill(c.registry.alive("prefill"), ctx.req)
                  if p.worker_id not in tried]
        return ranked[0] if ranked else None

    def _refused(self, e: grpc.aio.AioRpcError, spec: GenerateSpec, p: WorkerState,
                 d: WorkerState, trace: Trace) -> str:
        """A failed Prefill: raises unless it may be rerun under the same lease (p refused it
        before writing anything); then returns what happened, for the final error."""
        code = e.code()
        last = f"{p.worker_id}: {code.name} {e.details()}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise RouterError(code, e.details() or "invalid request") from e
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and spec.deadline is not None \
                and time.monotonic() >= spec.deadline:
            raise RouterError(code, "request deadline exceeded") from e
        trace.add(Step.PREFILL_FAILED, p.worker_id, detail=last)
        registry = self.cluster.registry
        if dest_failed(e):  # the decode worker holding the lease failed, not p
            registry.mark_suspect(d.worker_id, f"KV destination: {last}")
            raise WorkerLost(f"KV destination {d.worker_id} failed: {last}") from e
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED and not draining(e):
            registry.mark_suspect(p.worker_id, f"Prefill: {last}")  # (draining: planned)
        if not nothing_written(e):
            # p may still write into the lease's blocks (it stalled, or only its connection
            # broke): a rerun there could be overwritten by p's late writes. Take fresh blocks
            # instead; d holds these until p is known to be done.
            raise WorkerLost(f"prefill failed ({last}); its KV writes may still land: a new "
                             f"lease") from e
        logger.warning("prefill on %s failed (%s); retrying under the same lease", p.worker_id,
                       last)
        return last

    async def _join_ahead(self, spec: GenerateSpec, p: WorkerState, dest: wpb.KVDestination,
                          ctx: Pass) -> wpb.PrefillResponse:
        """Name the destination of the Prefill sent ahead, then await its answer. A refused
        SetDestination cancels it (nothing was written without one) unless it has ended: then
        its own outcome says more."""
        ahead, ctx.ahead = ctx.ahead, None
        assert ahead is not None
        c = self.cluster
        try:
            try:
                await p.identity.prefill.SetDestination(
                    wpb.SetDestinationRequest(request_id=spec.request_id, dest=dest),
                    metadata=c.md, timeout=c.remaining(spec, c.config.reserve_timeout_s))
            except grpc.aio.AioRpcError:
                if not ahead.done():
                    raise
            return await ahead
        except BaseException:
            cancel(ahead)  # a no-op once it has ended
            raise

    def _observe(self, p: WorkerState, lease: Lease, ctx: Pass, resp: wpb.PrefillResponse,
                 wall_s: float, clean: bool, held: HeldPrefix) -> None:
        """A prefill's measurements: transfer time against bytes, the RPC's own overhead (P's
        compute time is its engine's to measure: the step-time fit in its beats); ``held``:
        the prompt blocks p held when it was chosen, by tier (counted)."""
        registry, d = self.cluster.registry, lease.worker
        n = len(ctx.req)
        computed = n - resp.cached_prompt_tokens
        skip = lease.cached_prefix_tokens // d.identity.block_size
        sent = len(lease.resp.block_ids) - skip
        p.expect(ctx.req.hashes(p.identity.block_size), time.monotonic() + registry.expect_s)
        if resp.HasField("pull"):
            self.pulls.observe(p, resp.pull, record=ctx.record)
        if ctx.count:
            c = registry.counter(p)
            c.prompt_tokens += n
            c.computed_tokens += computed
            c.credit(held, p.identity.block_size)
            c = registry.counter(d)
            c.kv_blocks_sent += sent
            c.kv_blocks_skipped += skip
        if not ctx.record:
            return
        perf = registry.perf
        perf.observe_transfer(resp.kv_bytes, sent, resp.transfer_ms / 1e3)
        if clean:  # queue_ms of an idle worker is the hand-off to its engine: overhead
            perf.prefill_rpc_s.observe(wall_s - (resp.prefill_ms + resp.transfer_ms) / 1e3)
