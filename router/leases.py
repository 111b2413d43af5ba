"""KV leases on decode workers: reserve blocks for a pass, keep the lease alive while its KV is
computed, promise it to another prefill worker, and end it when the pass leaves.

A lease is the decode worker's promise to hold blocks for one pass until its KV arrives and
its Decode stream ends. The worker ends it itself when that stream ran to the end; a pass left
earlier (a client cancel, a stop string, a failure) releases it here, even while a Decode is
open: the call may not have reached the worker yet, and a lease nobody releases holds its
blocks until the TTL. The router counts the pass on the decode worker from the Reserve to the
pass's end (``Lease.charge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvrelay.common import tracing
from kvrelay.common.logs import request_context
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.calls import call_cancelled, draining
from kvrelay.router.cluster import Cluster
from kvrelay.router.errors import RouterError
from kvrelay.router.requests import GenerateSpec, Pass, WorkerLost
from kvrelay.router.trace import Step, Trace
from kvrelay.router.worker_state import Charge, WorkerState


@dataclass
class Lease:
    """Blocks reserved for one pass on decode worker ``worker``."""

    worker: WorkerState
    resp: wpb.ReserveResponse
    charge: Charge  # the pass, counted on ``worker`` until it leaves
    ended_by_worker: bool = False  # its Decode stream ran to the end: the worker ended it

    @property
    def lease_id(self) -> str:
        return self.resp.lease_id

    @property
    def cached_prefix_tokens(self) -> int:
        return self.resp.cached_prefix_tokens

    def destination(self) -> wpb.KVDestination:
        """Where a prefill worker writes this lease's KV."""
        d, r = self.worker, self.resp
        return wpb.KVDestination(decode_address=d.identity.address, agent_name=r.agent_name,
                                 incarnation=r.incarnation, block_ids=r.block_ids,
                                 skip_prefix_tokens=r.cached_prefix_tokens,
                                 lease_id=r.lease_id, page_ids=r.page_ids)


def held_blocks(resp: wpb.ReserveResponse) -> int:
    """Blocks' worth of KV a reservation holds: its blocks, or under the hybrid KV layout its
    pages (a windowed layer group holds none of a long prompt's blocks before its window) over
    the layer groups, as the worker counts its free blocks."""
    n = len(resp.block_ids)
    if not resp.page_ids or not n:
        return n
    groups = len(resp.page_ids) // n
    return -(-sum(p >= 0 for p in resp.page_ids) // groups)


class Leases:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    async def reserve(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                      ctx: Pass) -> Lease:
        """A lease on the best decode worker with room for ``prompt``; waits (bounded by
        ``kv_wait_s`` and the deadline) while every one is full, then RESOURCE_EXHAUSTED."""
        give_up = time.monotonic() + self.cluster.config.kv_wait_s
        if spec.deadline is not None:
            give_up = min(give_up, spec.deadline)
        pause = 0.02
        with tracing.span("router.reserve", trace.span) as span:
            md = tracing.with_parent(self.cluster.md, span)
            while True:
                lease = await self._reserve_once(spec, prompt, trace, ctx, md)
                if lease is not None:
                    if span is not None:
                        span.set_attribute("kvrelay.worker", lease.worker.worker_id)
                    return lease
                if time.monotonic() + pause > give_up:
                    raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      "no decode worker has KV room for this request now",
                                      retry_after_s=1.0)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.25)

    async def _reserve_once(self, spec: GenerateSpec, prompt: list[int], trace: Trace,
                            ctx: Pass, md: tuple[tuple[str, str], ...]) -> Lease | None:
        """Reserve on the best decode worker that has room; None when all are full."""
        c = self.cluster
        decoders = c.registry.alive("decode")
        if not decoders:
            raise WorkerLost("no decode worker")
        need = -(-(len(prompt) + 1) // decoders[0].identity.block_size)
        sender = ctx.prefill.identity if ctx.prefill else None
        req = wpb.ReserveRequest(request_id=spec.request_id, prompt_token_ids=prompt,
                                 cache_salt=spec.cache_salt or "",
                                 ttl_ms=int(c.config.lease_ttl_s * 1000),
                                 sender_agent=sender.worker_id if sender else "",
                                 sender_address=sender.address if sender else "")
        exhausted = 0
        for d in c.policy.rank_decode(decoders, need, ctx.req):
            # Counted from the reservation on, so concurrent arrivals between two heartbeats
            # spread over the pool.
            charge = d.accounting.charge()
            t_rpc = time.monotonic()
            try:
                resp = await d.identity.decode.Reserve(
                    req, metadata=md, timeout=c.remaining(spec, c.config.reserve_timeout_s))
            except BaseException as e:
                charge.undo()
                exhausted += self._reserve_failed(e, spec, d)
                continue
            d.accounting.pending_blocks += held_blocks(resp)
            trace.reserve_ms = (time.monotonic() - t_rpc) * 1000.0
            if ctx.record:
                d.perf.reserve_rpc_s.observe(time.monotonic() - t_rpc)
            if ctx.count:
                d.perf.arrivals.tick(time.monotonic())
            trace.add(Step.RESERVED, d.worker_id, detail=f"cached={resp.cached_prefix_tokens}")
            return Lease(d, resp, charge)
        if exhausted:
            return None
        raise WorkerLost("every decode worker failed Reserve")

    def _reserve_failed(self, e: BaseException, spec: GenerateSpec, d: WorkerState) -> bool:
        """A failed Reserve on ``d``: raises when the request cannot go on, else returns
        whether ``d`` was only full (the next worker is tried either way)."""
        if isinstance(e, grpc.aio.UsageError):  # d left the registry meanwhile
            return False
        if isinstance(e, asyncio.CancelledError):
            if call_cancelled(self.cluster.registry, d):
                return False
            # The request left. d may have reserved all the same (its answer in flight, the
            # lease id never read here): end whatever lease this attempt's id holds there.
            # No KV can have been sent into it: no Prefill knew its blocks.
            self.release_soon(d, spec.request_id, "", settled=True)
            raise e
        if not isinstance(e, grpc.aio.AioRpcError):
            raise e
        code = e.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return True
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise RouterError(code, e.details() or "invalid request") from e
        if not draining(e):  # draining: leaving as planned (heartbeat too)
            self.cluster.registry.mark_suspect(d.worker_id,
                                               f"Reserve: {code.name} {e.details()}")
        return False

    @contextlib.asynccontextmanager
    async def held(self, lease: Lease, spec: GenerateSpec, ctx: Pass) -> AsyncIterator[None]:
        """The pass's time on the lease: on leaving, the decode worker stops counting it, and
        the lease is released unless the worker ended it (settled when no Prefill may still
        write into its blocks: the worker may reuse them at once)."""
        try:
            yield
        finally:
            lease.charge.undo()
            if not lease.ended_by_worker:
                self.release_soon(lease.worker, spec.request_id, lease.lease_id,
                                  settled=not ctx.writes_unsettled)

    @contextlib.asynccontextmanager
    async def renewed(self, lease: Lease, spec: GenerateSpec) -> AsyncIterator[None]:
        """Keep the lease alive while its KV is being computed (a third of its TTL apart)."""
        task = asyncio.get_running_loop().create_task(self._renew(lease, spec.request_id))
        try:
            yield
        finally:
            task.cancel()

    async def _renew(self, lease: Lease, request_id: str) -> None:
        period = max(0.05, lease.resp.ttl_ms / 3000.0)
        req = wpb.LeaseRequest(request_id=request_id, lease_id=lease.lease_id)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await lease.worker.identity.decode.RenewLease(req, metadata=self.cluster.md,
                                                              timeout=period)

    async def rebind(self, spec: GenerateSpec, lease: Lease, p: WorkerState) -> None:
        """Promise the lease's KV to prefill worker ``p`` (nothing was written under it yet)."""
        d, c = lease.worker, self.cluster
        req = wpb.LeaseRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                               sender_agent=p.worker_id, sender_address=p.identity.address)
        try:
            await d.identity.decode.RenewLease(
                req, metadata=c.md, timeout=c.remaining(spec, c.config.reserve_timeout_s))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise WorkerLost(f"could not promise {d.worker_id}'s lease to {p.worker_id}: "
                             f"{e}") from e

    def release_soon(self, d: WorkerState, request_id: str, lease_id: str, *,
                     settled: bool = False) -> None:
        """End a lease without making the caller wait (the TTL is the backstop). ``settled``:
        no prefill can still write into its blocks, so d may reuse them at once. An empty
        ``lease_id``: whatever lease the (attempt-unique) request id holds there."""
        registry, md = self.cluster.registry, self.cluster.md

        async def release() -> None:
            # d may have left the registry and come back (missed heartbeats): its old channel is
            # closed, the process and the lease live on; reach it by its current entry.
            cur = registry.workers.get(d.worker_id)
            same = cur is not None and cur.identity.incarnation == d.identity.incarnation
            w = cur if same else d
            with request_context(request_id), \
                    contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await w.identity.decode.Release(
                    wpb.LeaseRequest(request_id=request_id, lease_id=lease_id,
                                     writes_settled=settled),
                    metadata=md, timeout=2.0)

        self.cluster.spawn(release())
