"""The decode side of a disaggregated pass, and the worker streams every pass reads.

A pass's first tokens (one per choice) come in the prefill worker's answer; the decode worker's
Decode stream carries the rest. ``read_stream`` relays that stream (or a GenerateLocal one) as
TokenChunks: a broken stream becomes WorkerLost, so that the lifecycle resumes the request on
another worker, a refusal a RouterError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import finish_from_proto, logprob_from_proto, sampling_to_proto
from kvrelay.engine.outputs import FinishReason
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.calls import call_cancelled
from kvrelay.router.cluster import Cluster
from kvrelay.router.errors import RouterError
from kvrelay.router.leases import Lease
from kvrelay.router.requests import GenerateSpec, Pass, TokenChunk, WorkerLost
from kvrelay.router.sessions import SessionCall
from kvrelay.router.trace import Step, Trace
from kvrelay.router.worker_state import WorkerState


class Relay:
    """First tokens and decode streams of a pass, as TokenChunks."""

    def __init__(self, cluster: Cluster, eos_token_ids: frozenset[int] = frozenset()):
        self.cluster = cluster
        self.eos_token_ids = eos_token_ids

    def streams(self, w: WorkerState) -> Any:
        """Where ``w``'s Decode and GenerateLocal calls go: its Session, or its stub."""
        if self.cluster.config.stream_sessions and w.identity.streams is not None:
            return w.identity.streams
        return w.identity.decode

    def first_chunks(self, first: wpb.PrefillResponse, cached: int, sampling: SamplingParams,
                      prompt_len: int, d: WorkerState) -> list[TokenChunk]:
        """Each choice's first token, from the prefill's answer (the prompt's logprobs ride on
        choice 0's); a choice whose first token ends it has its finish reason already."""
        tok = first.first_token_id
        firsts = [(tok, logprob_from_proto(first.logprob)
                   if first.HasField("logprob") else None)]
        forks = list(first.fork_token_ids)
        if len(forks) != sampling.n - 1:
            raise WorkerLost(f"prefill sampled {len(forks) + 1} first tokens, not "
                             f"{sampling.n}")
        fork_lps = [logprob_from_proto(lp) for lp in first.fork_logprobs]
        firsts += zip(forks, fork_lps or [None] * len(forks), strict=True)
        chunks = [TokenChunk([t], [lp], self._first_token_stop(sampling, t, prompt_len, d),
                             cached, i) for i, (t, lp) in enumerate(firsts)]
        if sampling.prompt_logprobs is not None:
            chunks[0].prompt_logprobs = [logprob_from_proto(x) for x in first.prompt_logprobs]
        return chunks

    def _first_token_stop(self, sampling: SamplingParams, token: int, prompt_len: int,
                          d: WorkerState) -> FinishReason | None:
        if not sampling.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in sampling.stop_token_ids:
            return FinishReason.STOP
        if sampling.max_tokens <= 1 or prompt_len + 1 >= d.identity.max_model_len:
            return FinishReason.LENGTH
        return None

    async def decode(self, spec: GenerateSpec, sampling: SamplingParams, lease: Lease,
                     first: wpb.PrefillResponse, trace: Trace,
                     ctx: Pass) -> AsyncIterator[TokenChunk]:
        """The tokens after the first ones: a Decode call on the lease's worker, relayed.
        Leaving the iterator cancels the call."""
        c, d = self.cluster, lease.worker
        tok = first.first_token_id
        req = wpb.DecodeRequest(request_id=spec.request_id, lease_id=lease.lease_id,
                                first_token_id=tok, sampling=sampling_to_proto(sampling),
                                kv_timeout_ms=int(c.config.kv_timeout_s * 1000),
                                fork_token_ids=list(first.fork_token_ids))
        span = tracing.start("router.stream", trace.span, **{"kvrelay.worker": d.worker_id})
        try:
            # The request's deadline rides on the call (one timer for the stream, not a
            # wait_for task a token) and reaches the worker, which stops on it too.
            timeout = None if spec.deadline is None else c.remaining(spec, 3600.0)
            call = self.streams(d).Decode(req, metadata=tracing.with_parent(c.md, span),
                                           timeout=timeout)
        except grpc.aio.UsageError as e:  # the registry dropped d (and closed its channel)
            tracing.end(span, error=e)
            raise WorkerLost(f"{d.worker_id} left the registry: {e}") from e
        trace.add(Step.DECODE_START, d.worker_id)
        try:
            produced = [tok]
            first_seen = False
            async for chunk in self.read_stream(spec, call, d, trace):
                if not first_seen:
                    first_seen = True
                    trace.add(Step.DECODE_FIRST, d.worker_id)
                if chunk.index == 0:
                    produced.extend(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        self.expect_sequence(d, ctx, produced)
                yield chunk
        except Exception as e:  # the worker lost, a deadline: the span says so
            tracing.end(span, error=e)
            span = None
            raise
        finally:
            call.cancel()
            tracing.end(span)

    async def read_stream(self, spec: GenerateSpec, call: grpc.aio.UnaryStreamCall | SessionCall,
                          w: WorkerState, trace: Trace) -> AsyncIterator[TokenChunk]:
        """Relay a DecodeResponse stream; a broken stream becomes WorkerLost."""
        while True:
            try:
                resp = await call.read()
            except asyncio.CancelledError:
                if not call_cancelled(self.cluster.registry, w):
                    raise
                raise WorkerLost(f"{w.worker_id}: dropped from the registry mid-stream") \
                    from None
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RouterError(code, e.details() or "invalid request") from e
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and spec.deadline is not None \
                        and time.monotonic() >= spec.deadline - 0.05:
                    raise RouterError(code, "request deadline exceeded") from e
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise RouterError(code, e.details() or "overloaded", retry_after_s=1.0) \
                        from e
                self.cluster.registry.mark_suspect(w.worker_id,
                                                   f"stream: {code.name} {e.details()}")
                raise WorkerLost(f"{w.worker_id}: {code.name} {e.details()}") from e
            if resp is grpc.aio.EOF:
                return
            if resp.kv_wait_ms:
                trace.decode_kv_wait_ms = resp.kv_wait_ms
            reason = finish_from_proto(resp.finish_reason)
            if reason == FinishReason.ERROR:
                raise WorkerLost(f"{w.worker_id}: {resp.error}")
            if reason == FinishReason.ABORT:
                raise WorkerLost(f"{w.worker_id} aborted the request: {resp.error}")
            chunk = TokenChunk(list(resp.token_ids),
                               [logprob_from_proto(lp) for lp in resp.logprobs]
                               or [None] * len(resp.token_ids),
                               reason, resp.cached_prompt_tokens, resp.index)
            if resp.prompt_logprobs:
                chunk.prompt_logprobs = [logprob_from_proto(x) for x in resp.prompt_logprobs]
            yield chunk

    def expect_sequence(self, w: WorkerState, ctx: Pass, produced: list[int]) -> None:
        """w now holds the KV of the prompt and the tokens produced (the last has none yet):
        count on it for prefix routing until its beats can report it."""
        toks = produced[:-1]
        bs = w.identity.block_size
        hashes = ctx.req.extended_hashes(toks, bs) if toks else ctx.req.hashes(bs)
        w.expect(hashes, time.monotonic() + self.cluster.registry.expect_s)
