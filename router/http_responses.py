"""The OpenAI API's answers: one JSON body or an SSE stream of chunks (``data: [DONE]`` last)
built from a request's deltas, choices of ``n > 1`` apart, echo and logprobs included; and the
API's error objects.

A non-streamed request whose client leaves is aborted: nothing would read its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.common import tracing
from kvrelay.common.logs import request_context
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.router.coalesce import Coalescer
from kvrelay.router.errors import RouterError
from kvrelay.router.lifecycle import GenerateSpec
from kvrelay.router.openai_models import _Common
from kvrelay.router.service import Delta, RouterService
from kvrelay.router.token_strings import TokenStrings
from kvrelay.router.trace import client_parent

logger = logging.getLogger(__name__)

# Logprob entries (tokens and alternatives) past which a non-streamed answer is built off the
# event loop.
OFFLOAD_LOGPROBS = 1 << 14

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout_error"}


def error_response(status: int, message: str, *, param: str | None = None,
                   retry_after_s: float | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after_s:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500
                            else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def router_error(e: RouterError) -> JSONResponse:
    """A RouterError as the API's error object (429 and 503 with ``Retry-After``)."""
    return error_response(e.http_status, e.message, retry_after_s=e.retry_after_s)


async def _client_left(request: Request) -> None:
    """Returns once the client has disconnected (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_delta(stream: AsyncIterator[Delta], request: Request) -> Delta | None:
    """The request's first delta; None (its stream closed, which stops the request) when the
    client leaves before it. Waiting for the first token is the wait that can run long: behind a
    queue of prompts under overload. A request whose client has gone would still take its turn
    at prefill and hold its blocks, and a backlog of them stalls every request after."""
    first = asyncio.ensure_future(anext(stream))
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait([first, left], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (the server stopping)
        first.cancel()
        raise
    finally:
        left.cancel()
    if first.done():
        return first.result()
    logger.info("client disconnected before the first token: request aborted")
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError, RouterError, StopAsyncIteration):
        await first
    await stream.aclose()
    return None


async def respond(service: RouterService, spec: GenerateSpec, req: _Common,
                  request: Request, *, chat: bool, echo: str | None = None) -> Response:
    """Run ``spec`` and answer it as ``req`` asks (streamed or not). ``echo``: the prompt's
    text, put before each choice's (completions)."""
    if tracing.enabled():
        spec.trace_parent = client_parent(request.headers.getlist("traceparent"))
    rid = ("chatcmpl-" if chat else "cmpl-") + spec.request_id
    created = int(time.time())
    model = service.model_name
    lp = _Logprobs(service.token_strings, chat)
    stream = service.generate(spec)
    with request_context(spec.request_id):
        try:
            first = await _first_delta(stream, request)
        except RouterError as e:
            await stream.aclose()
            return router_error(e)
        if first is None:
            return Response(status_code=499)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _sse(spec, first, Coalescer(stream), rid, created, model, chat, lp, include_usage,
                 req.return_trace, echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": spec.request_id})
    deltas = await _collect(spec, first, stream, request)
    if isinstance(deltas, Response):
        return deltas
    prompt = _echoed(spec, first, echo)
    entries = await lp.prefetch(deltas, prompt)
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model}
    render = functools.partial(_render, spec, deltas, lp, chat, prompt, head,
                               req.return_trace)
    # Many logprobs (n x tokens x alternatives): the body is built and serialized on the
    # tokenizer threads, where the loop keeps its turns (a million entries: ~1 s of Python).
    return await service.background(render) if entries > OFFLOAD_LOGPROBS else render()


def _render(spec: GenerateSpec, deltas: list[Delta], lp: _Logprobs, chat: bool,
            prompt: _Echo | None, head: dict[str, Any], return_trace: bool) -> JSONResponse:
    """A non-streamed answer from its deltas (their logprobs' strings prefetched)."""
    last = deltas[-1]
    choices = [_choice(spec, [d for d in deltas if d.index == i], lp, chat, prompt)
               for i in range(spec.sampling.n)]
    body: dict[str, Any] = {**head, "choices": choices, "usage": _usage(last)}
    if return_trace:
        body["kvrelay_trace"] = _trace(last)
    return JSONResponse(body, headers={"X-Request-Id": spec.request_id})


async def _collect(spec: GenerateSpec, first: Delta, stream: AsyncIterator[Delta],
                   request: Request) -> list[Delta] | Response:
    """Every delta of a non-streamed request, up to its last (``done``) one; or the response
    to give instead: the request's error, or 499 when the client left first."""
    deltas, last = [first], first

    async def collect() -> Delta:
        nonlocal last
        while not last.done:
            last = await anext(stream)
            deltas.append(last)
        return last

    with request_context(spec.request_id):
        # A client that leaves stops its request: nothing would read the answer, and the
        # generation would hold its KV blocks and batch slot to the end.
        collecting = asyncio.ensure_future(collect())
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait([collecting, left], return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                logger.info("client disconnected: request aborted")
                collecting.cancel()
                with contextlib.suppress(asyncio.CancelledError, RouterError):
                    await collecting
                return Response(status_code=499)
            collecting.result()
        except RouterError as e:
            return router_error(e)
        finally:
            left.cancel()
            await stream.aclose()
    return deltas


def _choice(spec: GenerateSpec, deltas: list[Delta], lp: _Logprobs, chat: bool,
            prompt: _Echo | None = None) -> dict[str, Any]:
    """One choice of a non-streamed answer from its deltas (the last one finished)."""
    end = deltas[-1]
    text = "".join(d.text for d in deltas)
    merged = Delta(spec.request_id, text, [t for d in deltas for t in d.token_ids],
                   [x for d in deltas for x in d.logprobs])
    reason = end.finish_reason.value if end.finish_reason else None
    choice: dict[str, Any] = {"index": end.index, "finish_reason": reason,
                              "logprobs": lp.render(merged, prompt)}
    if prompt is not None:
        text = prompt.text + text
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if end.stop_reason is not None:
        choice["stop_reason"] = end.stop_reason
    return choice


async def _sse(spec: GenerateSpec, first: Delta, stream: Coalescer,
               rid: str, created: int, model: str, chat: bool, lp: _Logprobs,
               include_usage: bool, return_trace: bool,
               echo: str | None = None) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        doc = {"id": rid, "object": obj, "created": created, "model": model,
               "choices": choices, **extra}
        if include_usage and "usage" not in extra:
            doc["usage"] = None
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    with request_context(spec.request_id):
        try:
            if chat:
                for i in range(spec.sampling.n):
                    yield event([{"index": i,
                                  "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            prompt = _echoed(spec, first, echo)
            echoed: set[int] = set()  # choices whose first chunk carried the prompt
            d: Delta | None = first
            while d is not None:
                reason = d.finish_reason.value if d.finished and d.finish_reason else None
                if d.text or d.finished or d.token_ids:
                    head = None
                    if prompt is not None and d.index not in echoed:
                        echoed.add(d.index)
                        head = prompt
                    choice: dict[str, Any] = {"index": d.index,
                                              "logprobs": await lp.block(d, head),
                                              "finish_reason": reason}
                    if chat:
                        choice["delta"] = {"content": d.text} if d.text else {}
                    else:
                        choice["text"] = (head.text if head else "") + d.text
                    extra: dict[str, Any] = {}
                    if d.done and return_trace:
                        extra["kvrelay_trace"] = _trace(d)
                    t = time.monotonic()
                    yield event([choice], **extra)
                    stream.sent(d, time.monotonic() - t)  # a slow client: tokens coalesce
                if d.done:
                    if include_usage:
                        yield event([], usage=_usage(d))
                    break
                d = await anext(stream, None)
        except RouterError as e:
            err = {"error": {"message": e.message, "type": _ERROR_TYPES.get(
                e.http_status, "server_error"), "code": e.http_status}}
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"


def _usage(d: Delta) -> dict[str, Any]:
    assert d.usage is not None
    u = d.usage
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens,
                           "completion_tokens": u.completion_tokens,
                           "total_tokens": u.prompt_tokens + u.completion_tokens}
    if u.cached_prompt_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


def _trace(d: Delta) -> list[dict[str, Any]]:
    assert d.trace is not None
    return [{"name": e.name, "t_ms": round(e.t_ms, 3), "worker": e.worker}
            for e in d.trace.events]


@dataclass
class _Echo:
    """An echoed prompt: its text, token ids and (when asked for) tokens 1..'s logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None


def _echoed(spec: GenerateSpec, first: Delta, echo: str | None) -> _Echo | None:
    if echo is None:
        return None
    plps = first.prompt_logprobs
    return _Echo(echo, spec.prompt_token_ids, list(plps) if plps is not None else None)


class _Logprobs:
    """OpenAI-style logprobs of a delta (completions: token strings + top dicts; chat: content
    entries). The strings of a block's ids, alternatives included, are fetched together first
    (``TokenStrings.prefetch``: cached, batched, off the event loop when many), then looked up."""

    def __init__(self, strings: TokenStrings, chat: bool):
        self.strings = strings
        self.chat = chat

    def _echoes(self, prompt: _Echo | None) -> bool:
        return prompt is not None and prompt.logprobs is not None and not self.chat

    def _ids(self, lps: list[TokenLogprob], prompt: _Echo | None) -> set[int]:
        """The ids a block names: each token's and its alternatives', the echoed prompt's."""
        if self._echoes(prompt):
            assert prompt is not None and prompt.logprobs is not None
            lps = [*(lp for lp in prompt.logprobs if lp is not None), *lps]
        ids = {lp.token_id for lp in lps}
        for lp in lps:
            ids.update(t for t, _ in lp.top)
        if self._echoes(prompt):
            assert prompt is not None
            ids.add(prompt.token_ids[0])
        return ids

    async def prefetch(self, deltas: list[Delta], prompt: _Echo | None = None) -> int:
        """Fetch the strings of every id ``deltas`` (and an echoed prompt) name; how many
        entries their blocks will have."""
        lps = [lp for d in deltas for lp in d.logprobs if lp is not None]
        ids = self._ids(lps, prompt)
        if ids:
            await self.strings.prefetch(ids)
        return sum(1 + len(lp.top) for lp in lps)

    async def block(self, d: Delta, prompt: _Echo | None = None) -> dict[str, Any] | None:
        """``prompt``: an echoed prompt's tokens come first (completions; the first prompt
        token's logprob and alternatives are None, as OpenAI and vLLM give them)."""
        lps = [lp for lp in d.logprobs if lp is not None]
        if not lps and not self._echoes(prompt):
            return None
        await self.strings.prefetch(self._ids(lps, prompt))
        return self.render(d, prompt)

    def render(self, d: Delta, prompt: _Echo | None = None) -> dict[str, Any] | None:
        """``block`` once its ids' strings were fetched."""
        return self._block(d, prompt if self._echoes(prompt) else None)

    def _block(self, d: Delta, prompt: _Echo | None) -> dict[str, Any] | None:
        lps = [lp for lp in d.logprobs if lp is not None]
        if not lps and prompt is None:
            return None
        s = self.strings.cache  # every id here was prefetched
        if prompt is not None:
            assert prompt.logprobs is not None
            head = self._block(Delta(d.request_id, "", [], prompt.logprobs), None) or {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            tail = self._block(d, None) or {"tokens": [], "token_logprobs": [],
                                            "top_logprobs": []}
            return {"tokens": [s[prompt.token_ids[0]]] + head["tokens"] + tail["tokens"],
                    "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
                    "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
                    "text_offset": []}
        if self.chat:
            return {"content": [{"token": s[lp.token_id], "logprob": lp.logprob,
                                 "top_logprobs": [{"token": s[t], "logprob": v}
                                                  for t, v in lp.top]} for lp in lps]}
        return {"tokens": [s[lp.token_id] for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{s[t]: v for t, v in lp.top} for lp in lps],
                "text_offset": []}
