"""OpenAI-compatible HTTP API on FastAPI + uvicorn, in the router's event loop.

/v1/completions, /v1/chat/completions (SSE streaming with ``data: [DONE]``), /v1/models,
/health, /metrics. Errors are OpenAI error objects; 429 and 503 carry ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.common import tracing
from kvrelay.common.limits import MAX_HTTP_BODY_BYTES
from kvrelay.common.logs import request_context
from kvrelay.common.rpc import SecretSet, TLSFiles
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import bad_words_token_ids
from kvrelay.router.errors import RouterError
from kvrelay.router.http_extras import extras
from kvrelay.router.http_middleware import ApiKeyAuth, BodyLimit, presented_key
from kvrelay.router.lifecycle import GenerateSpec
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.openai_models import ChatCompletionRequest, CompletionRequest, _Common
from kvrelay.router.service import Delta, RouterService

logger = logging.getLogger(__name__)

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


async def _client_left(request: Request) -> None:
    """Returns once the client has disconnected (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _refuse(status: int, message: str) -> Response:
    return error_response(status, message)


def _api_key(request: Request) -> str | None:
    return presented_key(request.scope.get("headers") or [])


def _router_error(e: RouterError) -> JSONResponse:
    return error_response(e.http_status, e.message, retry_after_s=e.retry_after_s)


def _sampling(req: _Common, max_tokens: int | None, logprobs: int | None,
              tokenizer: Any) -> SamplingParams:
    kw: dict[str, Any] = {
        "max_tokens": max_tokens or 16,
        "stop": tuple(req.stop_list()),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos, "seed": req.seed, "logprobs": logprobs,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output, "n": req.n,
    }
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.top_k is not None:
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    kw["logit_bias"] = req.logit_bias_ids()
    kw["min_tokens"] = req.min_tokens
    if req.allowed_token_ids is not None:
        kw["allowed_token_ids"] = req.allowed_token_ids
    kw["structured"] = req.structured_output()
    if req.bad_words:  # a few short words: tokenized here, not worth a thread hop
        kw["bad_words_token_ids"] = bad_words_token_ids(tokenizer, req.bad_words)
    return SamplingParams(**kw)


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
    """Accumulates OpenAI-style logprobs (completions: token strings + top dicts)."""

    def __init__(self, tokenizer: Any, chat: bool):
        self.tok = tokenizer
        self.chat = chat

    def _s(self, tid: int) -> str:
        return self.tok.decode([tid])

    def block(self, d: Delta, prompt: _Echo | None = None) -> dict[str, Any] | None:
        """``prompt``: an echoed prompt's tokens come first (completions; the first prompt
        token's logprob and alternatives are None, as OpenAI and vLLM give them)."""
        lps = [lp for lp in d.logprobs if lp is not None]
        if prompt is not None and prompt.logprobs is not None and not self.chat:
            head = self.block(Delta(d.request_id, "", [], prompt.logprobs)) or {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            tail = self.block(d) or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
            return {"tokens": [self._s(prompt.token_ids[0])] + head["tokens"] + tail["tokens"],
                    "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
                    "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
                    "text_offset": []}
        if not lps:
            return None
        if self.chat:
            return {"content": [{"token": self._s(lp.token_id), "logprob": lp.logprob,
                                 "top_logprobs": [{"token": self._s(t), "logprob": v}
                                                  for t, v in lp.top]} for lp in lps]}
        return {"tokens": [self._s(lp.token_id) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._s(t): v for t, v in lp.top} for lp in lps],
                "text_offset": []}


class HttpServer:
    def __init__(self, service: RouterService, metrics: RouterMetrics | None, *, host: str,
                 port: int, api_keys: SecretSet | None = None, tls: TLSFiles | None = None):
        self.service = service
        self.metrics = metrics
        self.host, self.port = host, port
        self.api_keys = api_keys or SecretSet([])
        self.tls = tls
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        kw: dict[str, Any] = {}
        if self.tls is not None:
            kw = {"ssl_certfile": self.tls.cert_file, "ssl_keyfile": self.tls.key_file}
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                lifespan="off", access_log=False, timeout_graceful_shutdown=2,
                                **kw)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        deadline = time.monotonic() + 10
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise OSError(f"HTTP server on {self.host}:{self.port} did not start")
            if time.monotonic() > deadline:
                raise TimeoutError("HTTP server did not start within 10s")
            await asyncio.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait([self._task], timeout=5)

    # -- app -----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)
        # Pure ASGI middlewares: Starlette's @app.middleware("http") (BaseHTTPMiddleware) runs
        # every request in a task group and re-streams each SSE chunk through a memory
        # stream, which cost ~40% of the HTTP layer's CPU per streamed request.
        app.add_middleware(BodyLimit, limit=MAX_HTTP_BODY_BYTES, refuse=_refuse)
        if self.api_keys:
            app.add_middleware(ApiKeyAuth, check=self.api_keys.check,
                               prefixes=("/v1/", "/tokenize", "/detokenize"), refuse=_refuse)
        app.include_router(extras(self.service, _refuse))
        service = self.service

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            errs = exc.errors()
            first = errs[0] if errs else {}
            loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
            msg = first.get("msg", "invalid request")
            return error_response(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
            # A body that is not JSON text (bad UTF-8, ...), an unknown path, a wrong method:
            # an OpenAI error object like every other error.
            return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

        @app.get("/health")
        async def health() -> Response:
            if not service.lifecycle.registry.can_serve():
                return error_response(503, "no workers available", retry_after_s=1)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            body = self.metrics.render() if self.metrics is not None else b""
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{
                "id": service.model_name, "object": "model", "created": 0,
                "owned_by": "kvrelay", "max_model_len": service.effective_max_model_len()}]})

        @app.post("/v1/completions")
        async def completions(req: CompletionRequest, request: Request) -> Response:
            try:
                prompt = req.single_prompt()
                sp = _sampling(req, req.max_tokens, req.logprobs, service.tokenizer)
                if req.echo and req.logprobs is not None:  # the prompt's logprobs too
                    sp = replace(sp, prompt_logprobs=req.logprobs)
                spec = await service.build_spec(
                    request_id=req.request_id, text=prompt if isinstance(prompt, str) else None,
                    token_ids=prompt if isinstance(prompt, list) else None, sampling=sp,
                    timeout_ms=req.timeout_ms, model=req.model, cache_salt=req.cache_salt,
                    api_key=_api_key(request))
            except ValueError as e:
                return error_response(400, str(e))
            except RouterError as e:
                return _router_error(e)
            echo = None
            if req.echo:
                echo = prompt if isinstance(prompt, str) else await service.decode(prompt)
            return await self._respond(spec, req, request, chat=False, echo=echo)

        @app.post("/v1/chat/completions")
        async def chat(req: ChatCompletionRequest, request: Request) -> Response:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                ids = await service.encode_chat(messages)
                n_top = (req.top_logprobs or 0) if req.logprobs else None
                sp = _sampling(req, req.max_completion_tokens or req.max_tokens, n_top,
                               service.tokenizer)
                spec = await service.build_spec(request_id=req.request_id, text=None,
                                                token_ids=ids, sampling=sp,
                                                timeout_ms=req.timeout_ms, model=req.model,
                                                cache_salt=req.cache_salt,
                                                api_key=_api_key(request))
            except ValueError as e:
                return error_response(400, str(e))
            except RouterError as e:
                return _router_error(e)
            return await self._respond(spec, req, request, chat=True)

        return app

    # -- responses -----------------------------------------------------------------------------
    async def _respond(self, spec: GenerateSpec, req: _Common, request: Request, *,
                       chat: bool, echo: str | None = None) -> Response:
        """``echo``: the prompt's text, put before each choice's (completions)."""
        if tracing.enabled():
            spec.trace_parent = tracing.from_traceparent(request.headers.get("traceparent"))
        rid = ("chatcmpl-" if chat else "cmpl-") + spec.request_id
        created = int(time.time())
        model = self.service.model_name
        lp = _Logprobs(self.service.tokenizer, chat)
        stream = self.service.generate(spec)
        with request_context(spec.request_id):
            try:
                first = await anext(stream)
            except RouterError as e:
                await stream.aclose()
                return _router_error(e)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._sse(spec, first, stream, rid, created, model, chat, lp, include_usage,
                          req.return_trace, echo),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": spec.request_id})
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
                return _router_error(e)
            finally:
                left.cancel()
                await stream.aclose()
        prompt = _echoed(spec, first, echo)
        choices = [self._choice(spec, [d for d in deltas if d.index == i], lp, chat, prompt)
                   for i in range(spec.sampling.n)]
        body: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else
                                "text_completion", "created": created, "model": model,
                                "choices": choices, "usage": _usage(last)}
        if req.return_trace:
            body["kvrelay_trace"] = _trace(last)
        return JSONResponse(body, headers={"X-Request-Id": spec.request_id})

    @staticmethod
    def _choice(spec: GenerateSpec, deltas: list[Delta], lp: _Logprobs, chat: bool,
                prompt: _Echo | None = None) -> dict[str, Any]:
        """One choice of a non-streamed answer from its deltas (the last one finished)."""
        end = deltas[-1]
        text = "".join(d.text for d in deltas)
        merged = Delta(spec.request_id, text, [t for d in deltas for t in d.token_ids],
                       [x for d in deltas for x in d.logprobs])
        reason = end.finish_reason.value if end.finish_reason else None
        choice: dict[str, Any] = {"index": end.index, "finish_reason": reason,
                                  "logprobs": lp.block(merged, prompt)}
        if prompt is not None:
            text = prompt.text + text
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if end.stop_reason is not None:
            choice["stop_reason"] = end.stop_reason
        return choice

    async def _sse(self, spec: GenerateSpec, first: Delta, stream: AsyncIterator[Delta],
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
                                                  "logprobs": lp.block(d, head),
                                                  "finish_reason": reason}
                        if chat:
                            choice["delta"] = {"content": d.text} if d.text else {}
                        else:
                            choice["text"] = (head.text if head else "") + d.text
                        extra: dict[str, Any] = {}
                        if d.done and return_trace:
                            extra["kvrelay_trace"] = _trace(d)
                        yield event([choice], **extra)
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



