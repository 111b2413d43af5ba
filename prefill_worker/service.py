"""What a prefill worker does for its calls: prefill a prompt, stream its KV into a decode
worker's blocks, and answer with the first token once every byte has landed.

The prefill engine batches and chunks prompts across requests and keeps its own prefix cache.
It holds a request's blocks only until the transfer completes (then they stay only as prefix
cache). Answering after delivery, not before, lets a transfer failure surface as this call's
refusal, so the router can retry on another prefill worker under the same decode lease.

``PrefillService`` takes and returns domain types and refuses with ``CallRefused``; the gRPC
servicer (``servicer.py``) only translates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import ID_REUSE_WAIT_S, cache_salt_of, check_request_id
from kvrelay.common.failures import CallRefused, FailureKind
from kvrelay.common.timeline import mark
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_core import EngineOverloaded, RequestIdInUse, RequestOutput
from kvrelay.engine.outputs import ErrorKind
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.kv_transfer.messages import KVDestination, PendingDestination, destination_of
from kvrelay.prefill_worker.peers import DecodePeers, DecodeTarget
from kvrelay.prefill_worker.pull import PrefixPull, PullReport, PullSource

if TYPE_CHECKING:
    from kvrelay.kv_transfer.connector import NixlConnector

logger = logging.getLogger(__name__)

PREFILL_ARRIVAL_WAIT_S = 1.0  # a SetDestination waits this long for its Prefill to arrive


class Prefilled(NamedTuple):
    """A delivered prefill: the engine's output with its first token(s), where its time went
    (monotonic seconds), and its prefix pull (None: none was asked)."""

    out: RequestOutput
    kv_bytes: int
    arrived: float
    scheduled: float
    computed: float
    done: float
    pull: PullReport | None = None


@dataclass
class _Pending:
    """A prefill sent ahead of its destination (``destination_follows``)."""

    holder: PendingDestination
    num_tokens: int
    peer: str | None = None  # the decode worker, once named


def _invalid(e: ValueError) -> CallRefused:
    return CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                       FailureKind.FAILURE_INVALID_REQUEST, nothing_written=True)


def _lease_given_up(rid: str) -> CallRefused:
    return CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                       f"the lease of {rid} was given up by its decode worker",
                       FailureKind.FAILURE_LEASE_GIVEN_UP, nothing_written=True)


def first_token_only(full: SamplingParams) -> SamplingParams:
    """Only the first token is sampled here; stop strings are the router's business. Stop
    tokens stay only to be masked under min_tokens (a first token cannot be one then);
    min_tokens is cut to the one token this pass samples."""
    return replace(full, max_tokens=1, stop=(), min_tokens=min(full.min_tokens, 1),
                   stop_token_ids=full.stop_token_ids if full.min_tokens else ())


class PrefillService:
    def __init__(self, engine: AsyncEngine, kv: NixlConnector, peers: DecodePeers,
                 pull: PrefixPull | None = None):
        self.engine = engine
        self.kv = kv
        self.peers = peers
        self.pull = pull if pull is not None else PrefixPull(engine, kv)
        self.draining = False
        self._pending: dict[str, _Pending] = {}  # request id -> prefill awaiting its destination
        self._arrivals: dict[str, asyncio.Event] = {}  # SetDestinations that came first

    # -- checks --------------------------------------------------------------------------------
    def _validate(self, rid: str, prompt: list[int], cache_salt: str,
                  dest: DecodeTarget | None) -> int:
        """Refuses a bad request; the leading blocks ``dest`` already holds."""
        if self.draining:
            raise CallRefused(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                              FailureKind.FAILURE_DRAINING, nothing_written=True)
        try:
            check_request_id(rid)
            self.engine.core.validate_prompt(prompt)
            cache_salt_of(cache_salt)
            return 0 if dest is None else self._skip_blocks(dest, len(prompt))
        except ValueError as e:
            raise _invalid(e) from e

    def _skip_blocks(self, dest: DecodeTarget, num_tokens: int) -> int:
        """Validates ``dest`` for a prompt of ``num_tokens``; the leading blocks it holds."""
        if not dest.agent_name or not dest.decode_address:
            raise ValueError("dest.agent_name and dest.decode_address are required")
        bs = self.engine.core.config.cache.block_size
        need = -(-num_tokens // bs)
        if len(dest.block_ids) != need:
            raise ValueError(f"dest has {len(dest.block_ids)} blocks; {num_tokens} tokens need "
                             f"{need} blocks of {bs}")
        if dest.skip_prefix_tokens % bs or dest.skip_prefix_tokens > num_tokens:
            raise ValueError(f"skip_prefix_tokens {dest.skip_prefix_tokens} must be a multiple "
                             f"of the block size {bs} and at most the prompt length")
        return dest.skip_prefix_tokens // bs

    async def _bind(self, rid: str, dest: DecodeTarget, skip: int,
                    num_tokens: int) -> KVDestination:
        """Connect to ``dest``'s decode worker; the engine's destination of the request (a
        prompt of ``num_tokens``)."""
        if self.kv.is_fenced(rid, dest.lease_id):  # its receiver gave the blocks up
            raise _lease_given_up(rid)
        await self.peers.connect(dest)  # the handshake: both lay KV out alike from here on
        try:
            pages = self.kv.destination_pages(dest.page_ids, len(dest.block_ids), skip,
                                              num_tokens)
        except ValueError as e:
            raise _invalid(e) from e
        return self.kv.destination(rid, dest.agent_name, list(dest.block_ids), skip,
                                   dest.lease_id, dest.incarnation, pages)

    # -- calls ---------------------------------------------------------------------------------
    async def prefill(self, rid: str, prompt: list[int], sampling: SamplingParams,
                      cache_salt: str, dest: DecodeTarget | None, span: Any = None,
                      pull: PullSource | None = None,
                      time_left_s: float | None = None) -> Prefilled:
        """Prefill ``prompt`` into ``dest``'s blocks (None: a ``set_destination`` names them
        while it computes) and wait for delivery. ``pull``: first read the prompt's prefix
        from the worker that holds it (``pull.py``; any failure recomputes), within half of
        ``time_left_s`` at most."""
        mark("prefill_rpc_in", rid)
        skip = self._validate(rid, prompt, cache_salt, dest)
        if not self.kv.admit_send(rid):  # cut off from the routers: it may be gone for them
            raise CallRefused(grpc.StatusCode.UNAVAILABLE,
                              "this prefill worker cannot prove a router lists it (heartbeats "
                              "unanswered, or just restored): refusing to write KV",
                              FailureKind.FAILURE_DRAINING, nothing_written=True)
        sampling = first_token_only(sampling)
        pulled = None
        if pull is not None:
            pulled = await self.pull.pull(rid, prompt, cache_salt or None, pull, time_left_s)
        if dest is None:
            done = await self._prefill_then_destination(rid, prompt, sampling, cache_salt, span)
            return done._replace(pull=pulled)
        await self.peers.evict_idle()
        with self.peers.using(dest.agent_name):
            params = await self._bind(rid, dest, skip, len(prompt))
            done = await self._run(rid, prompt, sampling, cache_salt, params, span)
            return done._replace(pull=pulled)

    async def _prefill_then_destination(self, rid: str, prompt: list[int],
                                        sampling: SamplingParams, cache_salt: str,
                                        span: Any) -> Prefilled:
        """Compute while the router reserves the decode worker's blocks (SetDestination)."""
        if rid in self._pending:
            raise CallRefused(grpc.StatusCode.UNAVAILABLE, f"request id {rid!r} is already in use",
                              FailureKind.FAILURE_REQUEST_ID_IN_USE, nothing_written=True)
        pending = self._pending[rid] = _Pending(PendingDestination(), len(prompt))
        arrived = self._arrivals.pop(rid, None)
        if arrived is not None:  # its SetDestination overtook it
            arrived.set()
        try:
            await self.peers.evict_idle()
            return await self._run(rid, prompt, sampling, cache_salt, pending.holder, span)
        finally:
            del self._pending[rid]
            if pending.holder.close():  # never named: whether it finished or not, let go
                self.kv.abandon(rid)
            if pending.peer is not None:
                self.peers.use(pending.peer, -1)

    async def set_destination(self, rid: str, dest: DecodeTarget) -> None:
        """Name the destination of a prefill sent ahead of it."""
        pending = self._pending.get(rid)
        if pending is None:
            # Sent after its Prefill, on another stream: it may be handled first.
            arrived = self._arrivals.setdefault(rid, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), PREFILL_ARRIVAL_WAIT_S)
            if self._arrivals.get(rid) is arrived:
                del self._arrivals[rid]
            pending = self._pending.get(rid)
        if pending is None:
            raise CallRefused(grpc.StatusCode.NOT_FOUND,
                              f"no prefill of {rid!r} waits for a destination here")
        try:
            skip = self._skip_blocks(dest, pending.num_tokens)
        except ValueError as e:
            raise _invalid(e) from e
        if pending.peer is None:  # its -1 comes when the prefill ends
            pending.peer = dest.agent_name
            self.peers.use(dest.agent_name, +1)
        params = await self._bind(rid, dest, skip, pending.num_tokens)
        if not pending.holder.resolve(params):
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the prefill of {rid} has ended or has a destination",
                              nothing_written=True)
        self.kv.destination_ready(rid)
        mark("prefill_destination", rid)

    async def fence(self, rid: str, lease_id: str) -> bool:
        """Write nothing more under ``lease_id``: whether nothing of it can still land."""
        try:
            check_request_id(rid)
            if not lease_id:
                raise ValueError("lease_id is required")
        except ValueError as e:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        # On the engine thread, in order with admissions: a prefill admitted before is aborted
        # here (its sender sends the abort notice after its last write), one admitted after
        # finds the fence and writes nothing.
        done = await self.engine.call(self._fence, rid, lease_id)
        logger.debug("fenced lease %s: %s", lease_id,
                     "nothing in flight" if done else "aborting, notice to follow")
        return done

    def _fence(self, request_id: str, lease_id: str) -> bool:
        notif = self.kv.fence(request_id, lease_id)
        core = self.engine.core
        seq = core.seqs.get(request_id)
        if seq is not None and getattr(seq.kv_transfer_params, "notif", None) == notif:
            core.abort(request_id)
        return not self.kv.still_sending(request_id) and request_id not in core.seqs

    # -- the engine ----------------------------------------------------------------------------
    async def _run(self, rid: str, prompt: list[int], sampling: SamplingParams, cache_salt: str,
                   params: KVDestination | PendingDestination, span: Any) -> Prefilled:
        """Prefill on the engine until the KV has been sent. A refusal or failure refuses the
        call, saying whether anything was written and whose failure it was."""
        t0 = time.monotonic()
        out = await self._generate(rid, prompt, sampling, cache_salt or None, params, t0)
        if out is None or out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) \
                or not out.new_token_ids:
            reason = (out.error if out is not None else None) or "prefill aborted"
            logger.warning("prefill failed: %s", reason)
            # A failed KV transfer is the destination's failure (the decode worker died or
            # dropped the lease, or fenced it), not this worker's.
            dest = destination_of(params)
            theirs = (out is not None and out.error_kind is ErrorKind.KV_TRANSFER) \
                or (dest is not None and self.kv.is_fenced_notice(dest.notif))
            raise CallRefused(grpc.StatusCode.UNAVAILABLE, reason,
                              FailureKind.FAILURE_KV_DESTINATION if theirs
                              else FailureKind.FAILURE_ENGINE)
        return self._delivered(rid, out, params, t0, span)

    async def _generate(self, rid: str, prompt: list[int], sampling: SamplingParams,
                        salt: str | None, params: KVDestination | PendingDestination,
                        t0: float) -> RequestOutput | None:
        out: RequestOutput | None = None
        while True:
            try:
                async for o in self.engine.generate(rid, prompt, sampling,
                                                    kv_transfer_params=params, arrival_time=t0,
                                                    cache_salt=salt):
                    out = o
                return out
            except EngineOverloaded as e:
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                  FailureKind.FAILURE_OVERLOADED, nothing_written=True) from e
            except ValueError as e:
                # An earlier request of this id (given up by the router, or a client's retry)
                # may still be sending its KV out: wait a moment, it is transient.
                in_use = isinstance(e, RequestIdInUse)
                if in_use and out is None and time.monotonic() < t0 + ID_REUSE_WAIT_S:
                    await asyncio.sleep(0.02)
                    continue
                if not in_use:
                    raise _invalid(e) from e
                raise CallRefused(grpc.StatusCode.UNAVAILABLE, str(e),
                                  FailureKind.FAILURE_REQUEST_ID_IN_USE,
                                  nothing_written=True) from e

    def _delivered(self, rid: str, out: RequestOutput,
                   params: KVDestination | PendingDestination, t0: float,
                   span: Any) -> Prefilled:
        """The delivered prefill and its time points (as spans under the call's, when
        tracing is on)."""
        done = time.monotonic()
        scheduled = out.scheduled_at or t0
        computed = out.computed_at or done
        dest = destination_of(params)
        sent_blocks = len(dest.remote_block_ids) - dest.skip_blocks if dest is not None else 0
        # what the writes carried: a sliding-window layer is sent only the blocks it still reads
        kv_bytes = self.kv.handoff_bytes(dest, out.num_prompt_tokens) if dest is not None else 0
        if span is not None:  # the engine's time points, as spans under the request's
            span.set_attribute("kvrelay.cached_prompt_tokens", out.num_cached_tokens)
            span.set_attribute("kvrelay.kv_bytes", kv_bytes)
            tracing.record("prefill.queue", span, t0, scheduled)
            tracing.record("prefill.compute", span, scheduled, computed)
            tracing.record("prefill.kv_send", span, computed, done,
                           **{"kvrelay.kv_bytes": kv_bytes, "kvrelay.blocks": sent_blocks})
        mark("prefill_rpc_out", rid)
        return Prefilled(out, kv_bytes, t0, scheduled, computed, done)
