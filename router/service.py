"""The router's request front half, shared by the gRPC and HTTP APIs: validate, tokenize, run
the lifecycle, detokenize, apply stop strings, and account usage, timing and trace."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

import grpc

from kvrelay.common import tracing
from kvrelay.common.limits import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_LOGPROB_TOKENS,
)
from kvrelay.engine.prefix_hash import MAX_CACHE_SALT
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured import GrammarCompiler, StructuredOutput
from kvrelay.engine.tokenizer import apply_chat_template
from kvrelay.router.admission import RETRY_AFTER_S, Admission
from kvrelay.router.errors import RouterError
from kvrelay.router.fairness import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    FairQueue,
    FairThreads,
)
from kvrelay.router.lifecycle import GenerateSpec, Lifecycle
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.outputs import ChoiceOutputs, Delta
from kvrelay.router.token_strings import TokenStrings
from kvrelay.router.trace import Step, Trace
from kvrelay.router.validation import (
    check_prompt_length,
    check_prompt_text,
    check_request_id,
    check_sampling_ids,
    check_stop_strings,
    deadline_of,
    first_bad_id,
    invalid,
)

logger = logging.getLogger(__name__)

DUPLICATE_ID_WAIT_S = 1.0  # how long a request waits for an earlier one of its id to leave
# Text longer than this (characters; token ids: a quarter of it) is tokenized, templated and
# checked off the event loop, which also serves heartbeats and lease renewals. Smaller inputs
# take well under a millisecond: they pay no thread hop.
OFFLOAD_CHARS = 16 * 1024
# A text prompt longer than this is counted in chunks of it before being encoded whole (a text
# too long for the context is refused after the first chunks, not encoded: _tokens_at_least).
COUNT_CHUNK_CHARS = 64 * 1024
OFFLOAD_IDS = OFFLOAD_CHARS // 4
OFFLOAD_MESSAGES = 256
TOKENIZER_THREADS = 2  # fast tokenizers release the GIL while they encode
# Jobs waiting for the tokenizer threads (encode, template, grammar, body parse): past this a
# request is refused (RESOURCE_EXHAUSTED, a 429) rather than queued behind seconds of work.
MAX_TOKENIZER_QUEUE = 64
# JSON values (numbers, strings, containers) one request body may hold beyond a maximal
# token-id prompt and two vocabularies (logit_bias, allowed_token_ids): a parsed value costs up
# to ~350 bytes, so this bounds a body's parse at a few hundred MB however it is shaped.
BODY_VALUES_SLACK = 1 << 16
# The tenant (``RouterService.tenant_of``) whose request the running task serves: its jobs on
# the tokenizer threads take that tenant's turns (``fairness.FairThreads``). Set where a
# request's tenant is first known (``serve_tenant``: the HTTP body's read, ``build_spec``).
_TENANT: ContextVar[str] = ContextVar("kvrelay_router_tenant", default="")


def serve_tenant(tenant: str) -> None:
    """Make ``tenant`` the running task's: its request's jobs on the tokenizer threads from
    here on take that tenant's turns."""
    _TENANT.set(tenant)

T = TypeVar("T")


class RouterService:
    def __init__(self, lifecycle: Lifecycle, tokenizer: object, *, model_name: str,
                 vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 max_inflight: int = 512, metrics: RouterMetrics | None = None,
                 cache_salt_by_api_key: bool = False, chat_template: str | None = None,
                 tenant_keys: int = 0, max_queued: int | None = None,
                 queue_wait_s: float = 5.0):
        self.lifecycle = lifecycle
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.cache_salt_by_api_key = cache_salt_by_api_key
        # Requests are told apart by API key when the router checks keys (``tenant_keys`` of
        # them): request ids are scoped by key, and with several keys the in-flight slots are
        # shared fairly between them. Without keys every request is one tenant's.
        self.keyed_tenants = tenant_keys > 0
        self.fair = FairQueue(max_inflight, max_waiting=max_queued, wait_s=queue_wait_s,
                              shared=tenant_keys > 1)
        self.chat_template = chat_template  # None: the tokenizer's own
        if chat_template:  # a broken template fails at start, not on every request
            try:
                apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}],
                                    chat_template=chat_template)
            except ValueError as e:
                raise ValueError(f"--chat-template does not render a conversation: {e}") from e
        # requests not yet in flight: being read, parsed, validated and tokenized
        self.admission = Admission(shared=tenant_keys > 1)
        self.max_body_values = max_model_len + 2 * vocab_size + BODY_VALUES_SLACK
        self._queued = 0  # jobs submitted to the tokenizer threads and not yet done
        # (tenant, request id) in flight -> set when that request has left (a client may
        # reuse an id; another tenant's use of it is none of its business)
        self._active: dict[tuple[str, str], asyncio.Event] = {}
        self.metrics = metrics
        lifecycle.eos_token_ids = eos_token_ids
        # (time, ttft_ms) and (time, mean itl ms) of recently finished requests (autoscaling)
        self._recent: deque[tuple[float, float, float | None]] = deque(maxlen=4096)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        # each API key's jobs take their turns on the threads, each key its share of the queue
        self.tokenizer_threads = FairThreads(self._pool, TOKENIZER_THREADS,
                                             max_jobs=MAX_TOKENIZER_QUEUE,
                                             shared=tenant_keys > 1)
        # Structured-output grammars are compiled here too, so one the workers could not compile
        # is refused with a 400 before anything is routed (built on first use, on the pool).
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        # token ids -> their text in the HTTP API's logprobs: cached, batched, off the loop
        self.token_strings = TokenStrings(tokenizer, self.background, vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.from_hf(self.tokenizer, self.vocab_size,
                                                        self.eos_token_ids)
            return self._grammar

    async def check_structured(self, so: StructuredOutput) -> None:
        """ValueError with the reason when the workers could not compile ``so`` (compiled on
        the tokenizer threads unless cached)."""
        cached = self._grammar is not None and self._grammar.is_cached(so)
        await self._run(not cached, lambda: self._grammar_compiler().check(so))

    # -- the in-flight slots -------------------------------------------------------------------
    @property
    def max_inflight(self) -> int:
        return self.fair.slots

    @property
    def inflight(self) -> int:
        return self.fair.inflight

    def arrival_refusal(self, tenant: str, priority: int | None = None) -> RouterError | None:
        """The refusal of a new request of ``tenant`` (``tenant_of``) that could neither take
        an in-flight slot nor wait for one (``fairness.FairQueue``): checked on arrival,
        before its body is parsed (``priority`` None: not known yet)."""
        return self.fair.refusal(tenant, priority)

    # -- text <-> ids, off the loop when large -------------------------------------------------

    async def offload(self, large: bool, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)``: on the tokenizer threads when ``large``, else here; raises
        RouterError(RESOURCE_EXHAUSTED) when ``MAX_TOKENIZER_QUEUE`` jobs wait for them."""
        return await self._run(large, fn, *args, **kw)

    async def _run(self, large: bool, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        if not large:
            return fn(*args, **kw)
        tenant = _TENANT.get()
        why = (f"router busy: {self._queued} prompts wait for the tokenizer"
               if self._queued >= MAX_TOKENIZER_QUEUE
               else self.tokenizer_threads.refusal(tenant))
        if why is not None:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, why,
                              retry_after_s=RETRY_AFTER_S)
        self._queued += 1
        try:
            return await self.tokenizer_threads.run(tenant, functools.partial(fn, *args, **kw))
        finally:
            self._queued -= 1

    async def background(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer threads, for a request already admitted (its answer's
        detokenization): never refused, its size bounded by the request's own."""
        return await self.tokenizer_threads.run(_TENANT.get(), functools.partial(fn, *args),
                                                bounded=False)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a long text is tokenized on the tokenizer threads."""
        return await self._run(len(text) > OFFLOAD_CHARS, self.tokenizer.encode, text,
                               add_special_tokens=add_special_tokens)

    def _tokens_at_least(self, text: str, max_len: int) -> int:
        """A lower bound on ``text``'s token count, counted a chunk at a time until it reaches
        ``max_len`` (then the prompt cannot fit, whatever the rest holds). Encoding a text of
        millions of characters whole costs ~300 bytes of tokenizer state a character (two such
        prompts at once took the router past 2 GiB); a chunk costs ~20 MB, and a prompt too long
        for the context stops after the first few. Chunks end at whitespace where they can; a
        cut can split what the whole text encodes as one token, so each cut discounts two."""
        total = 0
        start = 0
        while start < len(text):
            end = min(len(text), start + COUNT_CHUNK_CHARS)
            if end < len(text):
                cut = text.rfind(" ", start + COUNT_CHUNK_CHARS // 2, end)
                end = cut if cut > start else end
            total += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            total -= 2 if start else 0
            if total >= max_len:
                return total
            start = end
        return max(total, 0)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; many ids are decoded on the tokenizer threads."""
        return await self._run(len(token_ids) > OFFLOAD_IDS, self.tokenizer.decode,
                               list(token_ids))

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True) -> list[int]:
        """Token ids of chat ``messages`` rendered with the model's template (ValueError when
        the template rejects them, or they hold more than ``MAX_PROMPT_CHARS`` characters in
        all); long conversations are rendered off the loop."""
        if len(messages) > MAX_CHAT_MESSAGES:
            raise ValueError(f"the request has {len(messages)} messages; at most "
                             f"{MAX_CHAT_MESSAGES}")
        size = sum(len(c) for m in messages if isinstance(c := m.get("content"), str))
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages have {size} characters in all; at most "
                             f"{MAX_PROMPT_CHARS}")
        # the template renders every message, even an empty one: many go off the loop too
        large = size > OFFLOAD_CHARS or len(messages) > OFFLOAD_MESSAGES
        return await self._run(large, self._encode_chat, messages, add_generation_prompt,
                               self.effective_max_model_len())

    def _encode_chat(self, messages: Sequence[Mapping[str, Any]],
                     add_generation_prompt: bool = True, max_len: int | None = None
                     ) -> list[int]:
        text = apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                   chat_template=self.chat_template)
        if len(text) > MAX_PROMPT_CHARS:  # the template's own text counts too
            raise ValueError(f"the rendered conversation has {len(text)} characters; at most "
                             f"{MAX_PROMPT_CHARS}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the messages are not valid Unicode (lone surrogate)") from None
        if max_len is not None and len(text) > COUNT_CHUNK_CHARS:
            n = self._tokens_at_least(text, max_len)
            if n >= max_len:
                raise ValueError(f"the prompt has more than {n - 1} tokens; this model takes "
                                 f"at most {max_len - 1} (context {max_len})")
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- validation ----------------------------------------------------------------------------
    def effective_max_model_len(self) -> int:
        lens = [w.identity.max_model_len for w in self.lifecycle.registry.workers.values()
                if w.identity.max_model_len]
        return min([self.max_model_len, *lens])

    def new_request_id(self) -> str:
        return "req-" + secrets.token_hex(8)

    async def build_spec(self, *, request_id: str | None, text: str | None,
                         token_ids: Sequence[int] | None, sampling: SamplingParams,
                         timeout_ms: int | None = None, model: str | None = None,
                         cache_salt: str | None = None, api_key: str | None = None,
                         priority: int = DEFAULT_PRIORITY) -> GenerateSpec:
        """Validate one request; raises RouterError(INVALID_ARGUMENT) with a message.

        The cheap checks come first: sizes are checked before anything is scanned or tokenized.
        """
        t0 = time.monotonic()
        tenant = self.tenant_of(api_key)
        serve_tenant(tenant)
        rid = request_id or self.new_request_id()
        check_request_id(rid)
        if model and model != self.model_name:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {model!r} is not served here; this router serves "
                              f"{self.model_name!r}")
        if (text is None) == (token_ids is None):
            raise invalid("give exactly one of a text prompt or prompt token ids")
        deadline = deadline_of(timeout_ms, t0)
        if not (isinstance(priority, int) and MIN_PRIORITY <= priority <= MAX_PRIORITY):
            raise invalid(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        check_stop_strings(sampling)
        salt = self.cache_salt(cache_salt, api_key)
        check_sampling_ids(sampling, self.vocab_size)
        if sampling.structured is not None:
            try:
                await self.check_structured(sampling.structured)
            except ValueError as e:
                raise invalid(str(e)) from None
        max_len = self.effective_max_model_len()
        if sampling.max_tokens >= max_len:  # more than any prompt leaves room for
            raise invalid(f"max_tokens is {sampling.max_tokens}; this model's context holds "
                          f"{max_len} tokens, prompt included")
        if text is not None:
            check_prompt_text(text)
            if len(text) > COUNT_CHUNK_CHARS:  # count before encoding a text that may not fit
                n = await self._run(True, self._tokens_at_least, text, max_len)
                if n >= max_len:
                    raise invalid(f"the prompt has more than {n - 1} tokens; this model takes "
                                  f"at most {max_len - 1} (context {max_len})")
            token_ids = await self.encode(text)
        assert token_ids is not None
        if sampling.prompt_logprobs is not None and len(token_ids) > MAX_PROMPT_LOGPROB_TOKENS:
            raise invalid(f"prompt logprobs (echo with logprobs) are for prompts of at most "
                          f"{MAX_PROMPT_LOGPROB_TOKENS} tokens; this one has {len(token_ids)}")
        check_prompt_length(token_ids, max_len)
        bad_id = await self._run(len(token_ids) > OFFLOAD_IDS, first_bad_id, token_ids,
                                 self.vocab_size)
        if bad_id is not None:
            raise invalid(f"token id {bad_id} is outside the vocabulary [0, {self.vocab_size})")
        return GenerateSpec(rid, list(token_ids), sampling, deadline, arrival=t0,
                            cache_salt=salt, tenant=tenant, priority=priority)

    def tenant_of(self, api_key: str | None) -> str:
        """The tenant a request presenting ``api_key`` belongs to: a digest of the key when the
        router checks keys (the key itself is kept out of state and logs), else ""."""
        if not (self.keyed_tenants and api_key):
            return ""
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]

    def cache_salt(self, given: str | None, api_key: str | None) -> str | None:
        """The request's prefix-cache namespace: its own ``cache_salt``, within its API key's
        when the router isolates keys (a one-way digest: the key never leaves the router)."""
        if given is not None and not isinstance(given, str):
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "cache_salt must be a string")
        if given and len(given) > MAX_CACHE_SALT:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"cache_salt has {len(given)} characters; at most {MAX_CACHE_SALT}")
        if not (self.cache_salt_by_api_key and api_key):
            return given or None
        def digest(s: str) -> str:
            return hashlib.sha256(s.encode()).hexdigest()[:32]

        return f"key:{digest(api_key)}|{digest(given) if given else ''}"

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Delta]:
        """The request's deltas, once it has an in-flight slot (at once, or after its wait in
        the fair queue, which counts in its time to first token)."""
        key = (spec.tenant, spec.request_id)
        prev = self._active.get(key)
        if prev is not None:  # a retry right after a cancel may overtake the cancel a little
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prev.wait(), DUPLICATE_ID_WAIT_S)
            if key in self._active:
                raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                                  f"request id {spec.request_id!r} is in use by a request in "
                                  f"flight")
        left = self._active[key] = asyncio.Event()
        m = self.metrics
        slot = None
        try:
            slot = await self.fair.take(spec.tenant, spec.priority, spec.deadline)
            if m is not None:
                m.in_flight.labels(m.model).inc()
            async for d in self._generate(spec):
                yield d
        except RouterError as e:
            if m is not None:
                m.failed.labels(m.model, e.code.name).inc()
            raise
        finally:
            if slot is not None:
                slot.release()
                if m is not None:
                    m.in_flight.labels(m.model).dec()
            if self._active.get(key) is left:
                del self._active[key]
            left.set()

    async def _generate(self, spec: GenerateSpec) -> AsyncIterator[Delta]:
        trace = Trace(spec.arrival)
        trace.add(Step.RECEIVED)
        if tracing.enabled():  # "receive": the request from arrival to its last token
            trace.span = tracing.start("router.request", spec.trace_parent, start_s=spec.arrival,
                                       **{"kvrelay.request_id": spec.request_id,
                                          "kvrelay.prompt_tokens": len(spec.prompt_token_ids)})
        outputs = ChoiceOutputs(spec, self.tokenizer, trace)
        tokens = self.lifecycle.tokens(spec, trace)
        try:
            async for chunk in tokens:
                delta = outputs.add(chunk)
                if delta is None:
                    continue
                if delta.done:
                    self._finished(spec, trace, outputs, delta)
                    yield delta
                    return
                yield delta
        except BaseException as e:
            if trace.span is not None:
                # A client that left (GeneratorExit, cancelled) is no failure of the request.
                tracing.end(trace.span, error=e if isinstance(e, Exception) else None)
                trace.span = None
            raise
        finally:
            await tokens.aclose()
            tracing.end(trace.span)

    def _finished(self, spec: GenerateSpec, trace: Trace, outputs: ChoiceOutputs,
                  delta: Delta) -> None:
        """Account a request's last delta: its trace, metrics, recent latencies, log line."""
        finish, timing = delta.finish_reason, delta.timing
        assert finish is not None and timing is not None
        trace.add(Step.FINISHED, detail=finish.value)
        delta.trace = trace
        self._observe(delta, outputs.gaps)
        self._recent.append((outputs.last_at, timing.ttft_ms,
                             timing.mean_itl_ms if outputs.gaps else None))
        logger.info("finished %s: %d+%d tokens ttft=%.1fms e2e=%.1fms | %s",
                    finish.value, len(spec.prompt_token_ids), outputs.n_out,
                    timing.ttft_ms, timing.e2e_ms, trace.summary())
        if trace.span is not None:
            trace.span.set_attribute("kvrelay.completion_tokens", outputs.n_out)
            trace.span.set_attribute("kvrelay.finish_reason", finish.value)

    def recent_latency(self, window_s: float) -> tuple[float | None, float | None]:
        """p90 TTFT and p90 mean inter-token latency (ms) of requests finished lately."""
        cutoff = time.monotonic() - window_s
        ttft = sorted(t for at, t, _ in self._recent if at >= cutoff)
        itl = sorted(i for at, _, i in self._recent if at >= cutoff and i is not None)

        def p90(xs: list[float]) -> float | None:
            return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None
        return p90(ttft), p90(itl)

    def _observe(self, d: Delta, gaps: list[float]) -> None:
        m = self.metrics
        if m is None or d.timing is None or d.usage is None or d.trace is None:
            return
        t, u, model = d.timing, d.usage, m.model
        m.ttft.labels(model).observe(t.ttft_ms / 1000.0)
        m.e2e.labels(model).observe(t.e2e_ms / 1000.0)
        for g in gaps:
            m.itl.labels(model).observe(g)
        if u.completion_tokens > 1:
            m.tpot.labels(model).observe((t.e2e_ms - t.ttft_ms) / 1000.0
                                         / (u.completion_tokens - 1))
        m.finished.labels(model, d.finish_reason.value if d.finish_reason else "").inc()
        m.prompt_tokens.labels(model).inc(u.prompt_tokens)
        m.generation_tokens.labels(model).inc(u.completion_tokens)
        m.cached_tokens.labels(model).inc(u.cached_prompt_tokens)
        for ev in d.trace.events:
            if ev.step is Step.PREFILL_FAILED:
                m.transfer_failures.labels(model).inc()
            elif ev.step is Step.MIGRATE:
                m.migrations.labels(model).inc()
            elif ev.step is Step.PREFILL_START:
                m.decisions.labels(model, "disaggregated", ev.detail or "pool").inc()
            elif ev.step is Step.LOCAL_START:
                m.decisions.labels(model, "local", ev.detail or "pool").inc()
        p = d.trace.prefill
        if p is not None:
            m.queue.labels(model).observe(t.queue_ms / 1000.0)
            m.prefill.labels(model).observe(p.prefill_ms / 1000.0)
            m.transfer.labels(model).observe(p.transfer_ms / 1000.0)
            m.transfer_bytes.labels(model).inc(p.kv_bytes)
