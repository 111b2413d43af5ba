"""What a request's stream gives back to the APIs: ``Delta``s, the last one with the usage and
timing; and ``ChoiceOutputs``, which turns the workers' token chunks into them (detokenized,
stop strings applied, each choice of an ``n > 1`` request on its own)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvrelay.common import tracing
from kvrelay.engine.detokenizer import OutputProcessor, OutputStep
from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.router.requests import GenerateSpec, TokenChunk
from kvrelay.router.trace import Step, Trace


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass
class Timing:
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    mean_itl_ms: float = 0.0
    reserve_ms: float = 0.0
    decode_kv_wait_ms: float = 0.0


@dataclass
class Delta:
    """New output of one request; the last one has ``finished`` and the accounting."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    trace: Trace | None = None
    index: int = 0  # the choice (n > 1): each one ends with a ``finished`` delta of its own
    done: bool = False  # the request's last delta: every choice has finished; has the usage
    # sampling.prompt_logprobs: on the request's first delta, prompt tokens 1.. (the first
    # prompt token has none); the same for every choice.
    prompt_logprobs: list[TokenLogprob] | None = None


class ChoiceOutputs:
    """One request's output as its chunks arrive: each choice detokenized and checked for stop
    strings by an ``OutputProcessor`` of its own, and the request's accounting (tokens out,
    cached prompt tokens, first-token time and the gaps between chunks)."""

    def __init__(self, spec: GenerateSpec, tokenizer: object, trace: Trace):
        self.spec = spec
        self.tokenizer = tokenizer
        self.trace = trace
        self._procs: dict[int, OutputProcessor] = {}
        # choices finished (a stop string may end one before its worker does)
        self.ended: set[int] = set()
        self._prompt_sent = False
        self.n_out = 0
        self.cached = 0
        self.first_at: float | None = None
        self.last_at = spec.arrival
        self.gaps: list[float] = []

    def add(self, chunk: TokenChunk) -> Delta | None:
        """The delta of ``chunk``; None when its choice has ended already. The request's last
        delta (every choice finished) is ``done`` and carries the usage and timing."""
        spec = self.spec
        i = chunk.index
        if i in self.ended:
            return None
        proc = self._procs.get(i)
        if proc is None:
            proc = self._procs[i] = OutputProcessor(self.tokenizer, spec.prompt_token_ids,
                                                    spec.sampling)
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            self.trace.add(Step.FIRST_TOKEN)
            tracing.event(self.trace.span, "first_token")
        else:
            self.gaps.append(now - self.last_at)
        self.last_at = now
        self.cached = max(self.cached, chunk.cached_prompt_tokens)
        step, kept = self._step(proc, chunk)
        token_ids, logprobs = chunk.token_ids[:kept], chunk.logprobs[:kept]
        self.n_out += kept
        finish = FinishReason.STOP if step.stop_string else chunk.finish_reason
        stop_reason: str | int | None = step.stop_string
        if stop_reason is None and finish == FinishReason.STOP and token_ids:
            stop_reason = token_ids[-1]
        delta = Delta(spec.request_id, step.text, token_ids, logprobs, index=i)
        if spec.sampling.prompt_logprobs is not None and not self._prompt_sent:
            self._prompt_sent = True
            delta.prompt_logprobs = chunk.prompt_logprobs or []
        if finish is not None:
            delta.finished, delta.finish_reason, delta.stop_reason = True, finish, stop_reason
            self.ended.add(i)
            if len(self.ended) >= spec.sampling.n:
                delta.done = True
                delta.usage = Usage(len(spec.prompt_token_ids), self.n_out, self.cached)
                delta.timing = self._timing(now)
        return delta

    def _step(self, proc: OutputProcessor, chunk: TokenChunk) -> tuple[OutputStep, int]:
        """``chunk``'s text and how many of its tokens the output keeps. A worker's chunk may
        carry several tokens (its engine merges the steps its stream has not sent yet): a stop
        string that completes on one of them ends the output there, the later tokens dropped
        (not streamed, not counted), as if each token had come in a chunk of its own."""
        ids, n = chunk.token_ids, len(chunk.token_ids)
        finished = chunk.finish_reason is not None
        on_token = chunk.finish_reason == FinishReason.STOP
        if n <= 1 or not self.spec.sampling.stop:
            return proc.add(ids, finished=finished, stopped_on_token=on_token), n
        texts: list[str] = []
        for k, t in enumerate(ids, 1):
            step = proc.add([t], finished=finished and k == n, stopped_on_token=on_token and k == n)
            texts.append(step.text)
            if step.stop_string is not None:
                break
        return OutputStep("".join(texts), step.stop_string), k

    def _timing(self, now: float) -> Timing:
        spec, trace, gaps = self.spec, self.trace, self.gaps
        t = Timing(e2e_ms=(now - spec.arrival) * 1000.0)
        if self.first_at is not None:
            t.ttft_ms = (self.first_at - spec.arrival) * 1000.0
        if gaps:
            t.mean_itl_ms = sum(gaps) / len(gaps) * 1000.0
        t.reserve_ms, t.decode_kv_wait_ms = trace.reserve_ms, trace.decode_kv_wait_ms
        p = trace.prefill
        if p is not None:
            t.prefill_ms, t.transfer_ms = p.prefill_ms, p.transfer_ms
            start = trace.first(Step.PREFILL_START)
            t.queue_ms = (start.t_ms if start else 0.0) + p.queue_ms
        return t
