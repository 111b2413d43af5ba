"""The P->D hand-off of one pass: reserve blocks on a decode worker, prefill on a prefill worker
that streams the KV into them, and release what a pass leaves behind.

The Prefill leaves beside the Reserve (``RouterConfig.prefill_ahead``) and learns its
destination by ``SetDestination``; the lease's KV is promised to that prefill worker (the
decode worker accepts its notification only). A prefill worker that refuses a prompt before
writing anything is replaced under the same lease (rebound to the new worker first); after any
other failure the pass takes a fresh lease. ``Lifecycle`` builds on this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import sampling_to_proto
from kvrelay.common.logs import request_context
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.calls import (
    call_cancelled,
    cancel,
    dest_failed,
    draining,
    nothing_written,
)
from kvrelay.router.errors import RouterError
from kvrelay.router.policy import Policy
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.requests import GenerateSpec, Pass, RouterConfig, WorkerLost, new_pass
from kvrelay.router.trace import Trace
from kvrelay.router.worker_state import WorkerState

logger = logging.getLogger(__name__)


class Handoff:
    registry: WorkerRegistry
    policy: Policy
    config: RouterConfig
    md: tuple[tuple[str, str], ...]  # the cluster token's metadata
    _background: set[asyncio.Task[None]]  # fire-and-forget calls: the loop holds tasks weakly

    def _remaining(self, spec: GenerateSpec, cap: float) -> float:
        if spec.deadline is None:
            return cap
        left = spec.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded")
        return min(cap, left)

    def _send_ahead(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                    trace: Trace, ctx: Pass) -> None:
        """Send the Prefill now, its destination to follow (the Reserve runs meanwhile)."""
        assert ctx.prefill is not None
        ahead = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                   cache_salt=spec.cache_salt or "",
                                   sampling=sampling_to_proto(sampling), destination_follows=True)
        ctx.ahead_t0 = time.monotonic()
        trace.add("prefill_start", ctx.prefill.worker_id, detail=ctx.reason or "ahead")
        span = tracing.start("router.prefill", trace.span, **{
            "kvrelay.worker": ctx.prefill.worker_id, "kvrelay.ahead": True})
        ctx.ahead = asyncio.ensure_future(ctx.prefill.identity.prefill.Prefill(
            ahead, metadata=tracing.with_parent(self.md, span),
            timeout=self._remaining(spec, self.config.prefill_timeout_s)))
        if span is not None:
            ctx.ahead.add_done_callback(lambda _: tracing.end(span))

    async def _reserve(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                       ctx: Pass | None = None) -> tuple[WorkerState, wpb.ReserveResponse]:
        give_up = time.monotonic() + self.config.kv_wait_s
        if spec.deadline is not None:
            give_up = min(give_up, spec.deadline)
        pause = 0.02
        with tracing.span("router.reserve", trace.span) as span:
            md = tracing.with_parent(self.md, span)
            while True:
                got = await self._reserve_once(spec, prompt, trace, ctx, md)
                if got is not None:
                    if span is not None:
                        span.set_attribute("kvrelay.worker", got[0].worker_id)
                    return got
                if time.monotonic() + pause > give_up:
                    raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      "no decode worker has KV room for this request now",
                                      retry_after_s=1.0)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.25)

    async def _reserve_once(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                            ctx: Pass | None = None,
                            md: tuple[tuple[str, str], ...] | None = None
                            ) -> tuple[WorkerState, wpb.ReserveResponse] | None:
        """Reserve on the best decode worker that has room; None when all are full. ``md``:
        the calls' metadata (default the cluster token's)."""
        md = self.md if md is None else md
        decoders = self.registry.alive("decode")
        if not decoders:
            raise WorkerLost("no decode worker")
        bs = decoders[0].identity.block_size
        need = -(-(len(prompt) + 1) // bs)
        exhausted = 0
        ctx = ctx or new_pass(spec, prompt)
        for d in self.policy.rank_decode(decoders, need, ctx.req):
            sender = ctx.prefill.identity if ctx.prefill else None
            req = wpb.ReserveRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                     cache_salt=spec.cache_salt or "",
                                     ttl_ms=int(self.config.lease_ttl_s * 1000),
                                     sender_agent=sender.worker_id if sender else "",
                                     sender_address=sender.address if sender else "")
            # Counted from the reservation on (the caller drops it when the request leaves this
            # worker), so concurrent arrivals between two heartbeats spread over the pool.
            d.accounting.inflight += 1
            t_rpc = time.monotonic()
            try:
                resp = await d.identity.decode.Reserve(
                    req, metadata=md,
                    timeout=self._remaining(spec, self.config.reserve_timeout_s))
            except BaseException as e:
                d.accounting.inflight -= 1
                exhausted += self._reserve_failed(e, spec, d)
                continue
            d.accounting.pending_blocks += len(resp.block_ids)
            trace.reserve_ms = (time.monotonic() - t_rpc) * 1000.0
            if ctx.record:
                d.perf.reserve_rpc_s.observe(time.monotonic() - t_rpc)
            if ctx.count:
                d.perf.arrivals.tick(time.monotonic())
            trace.add("reserved", d.worker_id, detail=f"cached={resp.cached_prefix_tokens}")
            return d, resp
        if exhausted:
            return None
        raise WorkerLost("every decode worker failed Reserve")

    def _reserve_failed(self, e: BaseException, spec: GenerateSpec, d: WorkerState) -> bool:
        """A failed Reserve on ``d``: raises when the request cannot go on, else returns
        whether ``d`` was only full (the next worker is tried either way)."""
        if isinstance(e, grpc.aio.UsageError):  # d left the registry meanwhile
            return False
        if isinstance(e, asyncio.CancelledError):
            if call_cancelled(self.registry, d):
                return False
            # The request left. d may have reserved all the same (its answer in flight, the
            # lease id never read here): end whatever lease this attempt's id holds there.
            # No KV can have been sent into it: no Prefill knew its blocks.
            self._release_soon(d, spec.request_id, "", settled=True)
            raise e
        if not isinstance(e, grpc.aio.AioRpcError):
            raise e
        code = e.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return True
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise RouterError(code, e.details() or "invalid request") from e
        if not draining(e):  # draining: leaving as planned (heartbeat too)
            self.registry.mark_suspect(d.worker_id, f"Reserve: {code.name} {e.details()}")
        return False

    async def _renew(self, d: WorkerState, request_id: str, lease: wpb.ReserveResponse) -> None:
        period = max(0.05, lease.ttl_ms / 3000.0)
        req = wpb.LeaseRequest(request_id=request_id, lease_id=lease.lease_id)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await d.identity.decode.RenewLease(req, metadata=self.md, timeout=period)

    async def _prefill(self, spec: GenerateSpec, prompt: list[int], sampling: SamplingParams,
                       d: WorkerState, lease: wpb.ReserveResponse,
                       trace: Trace, ctx: Pass | None = None
                       ) -> tuple[wpb.PrefillResponse, int]:
        ctx = ctx or new_pass(spec, prompt, sampling.max_tokens)
        dest = _destination(d, lease)
        req = wpb.PrefillRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                 cache_salt=spec.cache_salt or "",
                                 sampling=sampling_to_proto(sampling), dest=dest)
        tried: set[str] = set()
        last = "no prefill worker"
        exhausted = False
        bound = ctx.prefill.worker_id if ctx.prefill is not None else ""  # the lease's sender
        for _ in range(self.config.max_prefill_attempts):
            p = self._next_prefill_worker(ctx, tried)
            if p is None:
                break
            tried.add(p.worker_id)
            if p.worker_id != bound:  # nothing was written under the lease: promise it to p
                await self._rebind(spec, d, lease, p)
                bound = p.worker_id
            clean, dispatched, uncharge = self._dispatch(p, ctx)
            trace.add(*(("destination", p.worker_id, d.worker_id) if ctx.ahead is not None
                        else ("prefill_start", p.worker_id,
                              ctx.reason if len(tried) == 1 else "retry")))
            ctx.writes_unsettled = True
            try:
                resp, t_rpc = await self._call_prefill(spec, p, req, dest, trace, ctx)
            except grpc.aio.AioRpcError as e:
                last = self._prefill_refused(e, spec, p, d, trace)
                exhausted = exhausted or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ctx.writes_unsettled = False
                continue
            except grpc.aio.UsageError:  # p left the registry (its channel closed): never sent
                last = f"{p.worker_id}: left the registry"
                trace.add("prefill_failed", p.worker_id, detail=last)
                ctx.writes_unsettled = False
                continue
            except asyncio.CancelledError:
                if not call_cancelled(self.registry, p):
                    raise
                last = f"{p.worker_id}: dropped from the registry during the call"
                trace.add("prefill_failed", p.worker_id, detail=last)
                raise WorkerLost(f"prefill failed ({last}); its KV writes may still land: "
                                 f"a new lease") from None
            finally:
                uncharge()
            ctx.writes_unsettled = False  # answered: every write landed and was notified
            trace.add_prefill_end(p.worker_id, resp)
            self._observe_prefill(p, d, lease, ctx, resp, time.monotonic() - t_rpc,
                                  clean and p.accounting.dispatches == dispatched)
            return resp, resp.cached_prompt_tokens
        if exhausted:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "prefill workers are saturated", retry_after_s=1.0)
        raise WorkerLost(f"prefill failed on every worker tried ({last})")

    def _dispatch(self, p: WorkerState, ctx: Pass) -> tuple[bool, int, Callable[[], None]]:
        """Charge ``p`` with the pass's prompt: whether it had nothing of this router's in
        flight, its dispatch count now, and the undo of the charge."""
        ctx.drop_claim()  # the dispatch charges p itself now
        clean = p.accounting.inflight == 0
        p.accounting.dispatches += 1
        uncharge = self._claim(p, ctx)  # before the expectation: it would count as cached
        p.expect(ctx.req.hashes(p.identity.block_size),
                 time.monotonic() + self.registry.expect_s)
        return clean, p.accounting.dispatches, uncharge

    async def _call_prefill(self, spec: GenerateSpec, p: WorkerState, req: wpb.PrefillRequest,
                            dest: wpb.KVDestination, trace: Trace,
                            ctx: Pass) -> tuple[wpb.PrefillResponse, float]:
        """The Prefill on ``p``: the one sent ahead, named its destination, or a call made now;
        its answer and when it left."""
        if ctx.ahead is not None:  # already computing: name its destination
            t_rpc = ctx.ahead_t0
            return await self._join_ahead(spec, p, dest, ctx), t_rpc
        t_rpc = time.monotonic()
        span = tracing.start("router.prefill", trace.span, **{"kvrelay.worker": p.worker_id})
        try:
            resp = await p.identity.prefill.Prefill(
                req, metadata=tracing.with_parent(self.md, span),
                timeout=self._remaining(spec, self.config.prefill_timeout_s))
        except grpc.aio.AioRpcError as e:
            tracing.end(span, error=f"{e.code().name} {e.details()}")
            span = None
            raise
        finally:
            tracing.end(span)
        return resp, t_rpc

    def _next_prefill_worker(self, ctx: Pass, tried: set[str]) -> WorkerState | None:
        """The pass's chosen worker first, then the best one not tried yet."""
        if ctx.prefill is not None and not tried:
            return ctx.prefill
        ranked = [p for p in self.policy.rank_prefill(self.registry.alive("prefill"), ctx.req)
                  if p.worker_id not in tried]
        return ranked[0] if ranked else None

    def _prefill_refused(self, e: grpc.aio.AioRpcError, spec: GenerateSpec, p: WorkerState,
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
        trace.add("prefill_failed", p.worker_id, detail=last)
        if dest_failed(e):  # the decode worker holding the lease failed, not p
            self.registry.mark_suspect(d.worker_id, f"KV destination: {last}")
            raise WorkerLost(f"KV destination {d.worker_id} failed: {last}") from e
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED and not draining(e):
            self.registry.mark_suspect(p.worker_id, f"Prefill: {last}")  # (draining: planned)
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
        try:
            try:
                await p.identity.prefill.SetDestination(
                    wpb.SetDestinationRequest(request_id=spec.request_id, dest=dest),
                    metadata=self.md,
                    timeout=self._remaining(spec, self.config.reserve_timeout_s))
            except grpc.aio.AioRpcError:
                if not ahead.done():
                    raise
            return await ahead
        except BaseException:
            cancel(ahead)  # a no-op once it has ended
            raise

    def _claim(self, p: WorkerState, ctx: Pass) -> Callable[[], None]:
        pending = self.policy.cost.prefill(p, ctx.req, time.monotonic()).new_tokens
        acct = p.accounting
        acct.pending_prompt_tokens += pending
        acct.inflight += 1

        def unclaim() -> None:
            acct.inflight -= 1
            acct.pending_prompt_tokens = max(0, acct.pending_prompt_tokens - pending)

        return unclaim

    async def _rebind(self, spec: GenerateSpec, d: WorkerState, lease: wpb.ReserveResponse,
                      p: WorkerState) -> None:
        req = wpb.LeaseRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                               sender_agent=p.worker_id, sender_address=p.identity.address)
        try:
            await d.identity.decode.RenewLease(req, metadata=self.md,
                                      timeout=self._remaining(spec, self.config.reserve_timeout_s))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise WorkerLost(f"could not promise {d.worker_id}'s lease to {p.worker_id}: "
                             f"{e}") from e

    def _release_soon(self, d: WorkerState, request_id: str, lease_id: str, *,
                      settled: bool = False) -> None:
        """End a lease without making the caller wait (the TTL is the backstop). ``settled``:
        no prefill can still write into its blocks, so d may reuse them at once. An empty
        ``lease_id``: whatever lease the (attempt-unique) request id holds there."""

        async def release() -> None:
            # d may have left the registry and come back (missed heartbeats): its old channel is
            # closed, the process and the lease live on; reach it by its current entry.
            cur = self.registry.workers.get(d.worker_id)
            same = cur is not None and cur.identity.incarnation == d.identity.incarnation
            w = cur if same else d
            with request_context(request_id), \
                    contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await w.identity.decode.Release(wpb.LeaseRequest(request_id=request_id,
                                                        lease_id=lease_id,
                                                        writes_settled=settled),
                                       metadata=self.md, timeout=2.0)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _observe_prefill(self, p: WorkerState, d: WorkerState, lease: wpb.ReserveResponse,
                         ctx: Pass, resp: wpb.PrefillResponse, wall_s: float,
                         clean: bool) -> None:
        """A prefill's measurements: P's compute time for the tokens it computed (when it ran
        alone there), transfer time against bytes, the RPC's own overhead."""
        n = len(ctx.req)
        computed = n - resp.cached_prompt_tokens
        skip = lease.cached_prefix_tokens // d.identity.block_size
        sent = len(lease.block_ids) - skip
        p.expect(ctx.req.hashes(p.identity.block_size), time.monotonic() + self.registry.expect_s)
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
            p.perf.prefill_fit.observe(computed, resp.prefill_ms / 1e3)
        perf = self.registry.perf
        perf.observe_transfer(resp.kv_bytes, sent, resp.transfer_ms / 1e3)
        if clean:  # queue_ms of an idle worker is the hand-off to its engine: overhead
            perf.prefill_rpc_s.observe(wall_s - (resp.prefill_ms + resp.transfer_ms) / 1e3)


def _destination(d: WorkerState, lease: wpb.ReserveResponse) -> wpb.KVDestination:
    return wpb.KVDestination(decode_address=d.identity.address, agent_name=lease.agent_name,
                             incarnation=lease.incarnation, block_ids=lease.block_ids,
                             skip_prefix_tokens=lease.cached_prefix_tokens,
                             lease_id=lease.lease_id)
