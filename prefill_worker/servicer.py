"""PrefillWorker gRPC servicer: prefill a prompt, stream its KV into a decode worker's blocks,
return the first token once every byte has landed.

The prefill engine batches and chunks prompts across requests and keeps its own prefix cache.
It holds a request's blocks only until the transfer completes (then they stay only as prefix
cache). Returning after delivery, not before, lets a transfer failure surface as this call's
error, so the router can retry on another prefill worker under the same decode lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Protocol

import grpc

from kvrelay.convert import logprob_to_proto, sampling_from_proto
from kvrelay.decode_worker.servicer import ID_REUSE_WAIT_S, cache_salt_of, is_id_in_use
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.logs import request_context
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.rpc import (
    KV_DESTINATION_FAILED,
    KV_NOTHING_WRITTEN,
    insecure_channel,
    token_metadata,
)
from kvrelay.timeline import mark

logger = logging.getLogger(__name__)

KV_TRANSFER_FAILED = "KV transfer failed"  # EngineCore's error prefix for a failed send


class KVSender(Protocol):
    """What the servicer needs of the KV transport on the sending side."""

    def has_peer(self, agent_name: str, incarnation: str) -> bool: ...

    def add_peer(self, peer_info: bytes) -> None: ...

    def destination(self, request_id: str, agent_name: str, block_ids: list[int],
                    skip_blocks: int, lease_id: str, incarnation: str) -> object: ...

    def block_bytes(self) -> int: ...

    def evict_peer(self, agent_name: str) -> bool: ...

    def fence(self, request_id: str, lease_id: str) -> bytes: ...

    def is_fenced(self, request_id: str, lease_id: str) -> bool: ...

    def still_sending(self, request_id: str) -> bool: ...


# A decode worker no request has gone to for this long is forgotten (its NIXL remote agent,
# prepared descriptors and connection lock): decode pods come and go, and each one held here
# forever would grow this worker's memory. One that comes back is reconnected on first use.
PEER_IDLE_S = 300.0


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, kv: KVSender, worker_id: str, *,
                 cluster_token: str | None = None):
        self.engine = engine
        self.kv = kv
        self.worker_id = worker_id
        self.draining = False
        self._md = token_metadata(cluster_token)
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._peer_used: dict[str, float] = {}  # agent name -> last request's start
        self._peer_inflight: dict[str, int] = {}  # agent name -> Prefill calls under way

    async def _ensure_peer(self, dest: wpb.KVDestination) -> None:
        """Fetch a decode worker's transfer info once per incarnation."""
        lock = self._peer_locks.setdefault(dest.agent_name, asyncio.Lock())
        async with lock:
            if self.kv.has_peer(dest.agent_name, dest.incarnation):
                return
            async with insecure_channel(dest.decode_address) as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                info = await stub.GetTransferInfo(wpb.TransferInfoRequest(), metadata=self._md,
                                                  timeout=10.0)
            if info.incarnation != dest.incarnation:
                raise ConnectionError(f"decode worker {dest.agent_name} restarted "
                                      f"(incarnation {info.incarnation}, lease from "
                                      f"{dest.incarnation})")
            await self.engine.call(self.kv.add_peer, info.peer_info)
            logger.info("connected to decode worker %s at %s", dest.agent_name,
                        dest.decode_address)

    async def evict_idle_peers(self, now: float | None = None) -> list[str]:
        """Forget decode workers unused for ``PEER_IDLE_S`` with nothing under way to them."""
        now = time.monotonic() if now is None else now
        idle = [name for name, t in self._peer_used.items()
                if now - t > PEER_IDLE_S and not self._peer_inflight.get(name)
                and not (name in self._peer_locks and self._peer_locks[name].locked())]
        for name in idle:
            del self._peer_used[name]
            self._peer_locks.pop(name, None)
            self._peer_inflight.pop(name, None)
            await self.engine.call(self.kv.evict_peer, name)
        if idle:
            logger.info("forgot %d idle decode worker(s): %s", len(idle), ", ".join(idle))
        return idle

    def _validate(self, request: wpb.PrefillRequest) -> int:
        """Returns the number of leading blocks the receiver already has."""
        if not request.request_id or len(request.request_id) > 256:
            raise ValueError("request_id must be 1..256 characters")
        ids = list(request.prompt_token_ids)
        self.engine.core.validate_prompt(ids)
        cache_salt_of(request.cache_salt)
        dest = request.dest
        if not dest.agent_name or not dest.decode_address:
            raise ValueError("dest.agent_name and dest.decode_address are required")
        bs = self.engine.core.config.cache.block_size
        need = -(-len(ids) // bs)
        if len(dest.block_ids) != need:
            raise ValueError(f"dest has {len(dest.block_ids)} blocks; {len(ids)} tokens need "
                             f"{need} blocks of {bs}")
        if dest.skip_prefix_tokens % bs or dest.skip_prefix_tokens > len(ids):
            raise ValueError(f"skip_prefix_tokens {dest.skip_prefix_tokens} must be a multiple "
                             f"of the block size {bs} and at most the prompt length")
        return dest.skip_prefix_tokens // bs

    async def Prefill(self, request: wpb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        rid = request.request_id
        mark("prefill_rpc_in", rid)
        with request_context(rid):
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                                    KV_NOTHING_WRITTEN)
            try:
                skip_blocks = self._validate(request)
                # Only the first token is sampled here; stop strings are the router's business.
                sampling = replace(sampling_from_proto(request.sampling), max_tokens=1, stop=(),
                                   stop_token_ids=())
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            dest = request.dest
            if self.kv.is_fenced(rid, dest.lease_id):  # its receiver gave the blocks up
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the lease of {rid} was given up by its decode worker",
                                    KV_NOTHING_WRITTEN)
            await self.evict_idle_peers()
            self._peer_used[dest.agent_name] = time.monotonic()
            self._peer_inflight[dest.agent_name] = self._peer_inflight.get(dest.agent_name, 0) + 1
            try:
                return await self._prefill(request, context, skip_blocks, sampling)
            finally:
                n = self._peer_inflight.get(dest.agent_name, 0) - 1
                if n > 0:
                    self._peer_inflight[dest.agent_name] = n
                else:
                    self._peer_inflight.pop(dest.agent_name, None)

    async def Fence(self, request: wpb.FenceRequest,
                    context: grpc.aio.ServicerContext) -> wpb.FenceResponse:
        rid = request.request_id
        if not rid or len(rid) > 256 or not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id (1..256 characters) and lease_id are required")
        with request_context(rid):
            # On the engine thread, in order with admissions: a prefill admitted before is
            # aborted here (its sender sends the abort notice after its last write), one
            # admitted after finds the fence and writes nothing.
            done = await self.engine.call(self._fence, rid, request.lease_id)
            logger.debug("fenced lease %s: %s", request.lease_id,
                         "nothing in flight" if done else "aborting, notice to follow")
            return wpb.FenceResponse(done=done)

    def _fence(self, request_id: str, lease_id: str) -> bool:
        notif = self.kv.fence(request_id, lease_id)
        core = self.engine.core
        seq = core.seqs.get(request_id)
        if seq is not None and getattr(seq.kv_transfer_params, "notif", None) == notif:
            core.abort(request_id)
        return not self.kv.still_sending(request_id) and request_id not in core.seqs

    async def _prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext,
                       skip_blocks: int, sampling: SamplingParams) -> wpb.PrefillResponse:
        rid = request.request_id
        dest = request.dest
        try:
            await self._ensure_peer(dest)
        except (grpc.aio.AioRpcError, ConnectionError, OSError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach decode worker {dest.agent_name}: {detail}",
                                KV_DESTINATION_FAILED)
        except ValueError as e:  # incompatible KV layouts: a deployment error
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e),
                                KV_NOTHING_WRITTEN)
        params = self.kv.destination(rid, dest.agent_name, list(dest.block_ids), skip_blocks,
                                     dest.lease_id, dest.incarnation)
        salt = request.cache_salt or None  # checked in _validate
        t0 = time.monotonic()
        out: RequestOutput | None = None
        while True:
            try:
                async for o in self.engine.generate(rid, list(request.prompt_token_ids),
                                                    sampling, kv_transfer_params=params,
                                                    arrival_time=t0, cache_salt=salt):
                    out = o
                break
            except EngineOverloaded as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                    KV_NOTHING_WRITTEN)
            except ValueError as e:
                # An earlier request of this id (given up by the router, or a client's retry)
                # may still be sending its KV out: wait a moment, it is transient.
                if is_id_in_use(e) and out is None \
                        and time.monotonic() < t0 + ID_REUSE_WAIT_S:
                    await asyncio.sleep(0.02)
                    continue
                await context.abort(grpc.StatusCode.UNAVAILABLE if is_id_in_use(e)
                                    else grpc.StatusCode.INVALID_ARGUMENT, str(e),
                                    KV_NOTHING_WRITTEN)
        if out is None or out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) \
                or not out.new_token_ids:
            reason = (out.error if out is not None else None) or "prefill aborted"
            logger.warning("prefill failed: %s", reason)
            # A failed KV transfer is the destination's failure (the decode worker died or
            # dropped the lease, or fenced it), not this worker's.
            side = (KV_DESTINATION_FAILED if reason.startswith(KV_TRANSFER_FAILED)
                    or self.kv.is_fenced(rid, dest.lease_id) else ())
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason, side)
        done = time.monotonic()
        scheduled = out.scheduled_at or t0
        computed = out.computed_at or done
        sent_blocks = len(dest.block_ids) - skip_blocks
        first_lp = out.logprobs[0] if out.logprobs else None
        resp = wpb.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            cached_prompt_tokens=out.num_cached_tokens,
            queue_ms=(scheduled - t0) * 1000.0,
            prefill_ms=(computed - scheduled) * 1000.0,
            transfer_ms=(done - computed) * 1000.0,
            kv_bytes=sent_blocks * self.kv.block_bytes(),
            worker_id=self.worker_id,
        )
        if first_lp is not None:  # set only when asked for: HasField tells the router
            resp.logprob.CopyFrom(logprob_to_proto(first_lp))
        mark("prefill_rpc_out", rid)
        return resp
