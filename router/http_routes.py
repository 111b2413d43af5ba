"""The OpenAI generation endpoints, ``/v1/completions`` and ``/v1/chat/completions``: a request
body becomes sampling parameters and a validated spec (the prompt tokenized, or the messages
templated), then ``http_responses.respond`` runs and answers it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import bad_words_token_ids
from kvrelay.router.errors import RouterError
from kvrelay.router.http_body import admitted, read_body
from kvrelay.router.http_middleware import presented_key
from kvrelay.router.http_responses import error_response, respond, router_error
from kvrelay.router.openai_models import ChatCompletionRequest, CompletionRequest, _Common
from kvrelay.router.requests import GenerateSpec
from kvrelay.router.service import RouterService

T = TypeVar("T")


def openai_routes(service: RouterService) -> APIRouter:
    """The two endpoints, on ``service``. Their bodies are parsed by ``http_body`` (bounded,
    large ones off the loop), not by FastAPI; the request's admission ticket goes back once its
    spec is built."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def build() -> tuple[GenerateSpec, CompletionRequest, str | None]:
            req = await read_body(service, request, CompletionRequest)
            prompt = req.single_prompt()
            sp = _sampling(req, req.max_tokens, req.logprobs, service.tokenizer)
            if req.echo and req.logprobs is not None:  # the prompt's logprobs too
                sp = replace(sp, prompt_logprobs=req.logprobs)
            spec = await service.build_spec(
                request_id=req.request_id, text=prompt if isinstance(prompt, str) else None,
                token_ids=prompt if isinstance(prompt, list) else None, sampling=sp,
                timeout_ms=req.timeout_ms, model=req.model, cache_salt=req.cache_salt,
                api_key=_api_key(request), priority=req.priority)
            echo = None
            if req.echo:
                echo = prompt if isinstance(prompt, str) else await service.decode(prompt)
            return spec, req, echo

        built = await _admitted_spec(request, build)
        if isinstance(built, Response):
            return built
        spec, req, echo = built
        return await respond(service, spec, req, request, chat=False, echo=echo)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        async def build() -> tuple[GenerateSpec, ChatCompletionRequest]:
            req = await read_body(service, request, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = await service.encode_chat(messages)
            n_top = (req.top_logprobs or 0) if req.logprobs else None
            sp = _sampling(req, req.max_completion_tokens or req.max_tokens, n_top,
                           service.tokenizer)
            spec = await service.build_spec(request_id=req.request_id, text=None,
                                            token_ids=ids, sampling=sp,
                                            timeout_ms=req.timeout_ms, model=req.model,
                                            cache_salt=req.cache_salt,
                                            api_key=_api_key(request),
                                            priority=req.priority)
            return spec, req

        built = await _admitted_spec(request, build)
        if isinstance(built, Response):
            return built
        spec, req = built
        return await respond(service, spec, req, request, chat=True)

    return api


async def _admitted_spec(request: Request,
                         build: Callable[[], Awaitable[T]]) -> T | Response:
    """Run ``build`` (parse the body, build the spec): what it returns, or the error response a
    bad request (400) or the router's refusal makes. Either way the request's admission ticket
    goes back here, before any generation starts."""
    try:
        return await build()
    except ValueError as e:
        return error_response(400, str(e), param=getattr(e, "param", None))
    except RouterError as e:
        return router_error(e)
    finally:
        admitted(request)


def _api_key(request: Request) -> str | None:
    return presented_key(request.scope.get("headers") or [])


def _sampling(req: _Common, max_tokens: int | None, logprobs: int | None,
              tokenizer: Any) -> SamplingParams:
    """The request's sampling parameters (ValueError, a 400, when SamplingParams refuses
    them); fields left out keep SamplingParams' defaults."""
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
