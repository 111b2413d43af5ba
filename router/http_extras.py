"""``/tokenize``, ``/detokenize`` and ``/version``, shaped as vLLM's server answers them.

Clients count tokens against the context (``/tokenize`` of a prompt or of chat messages, with
the same template the chat endpoint uses), turn ids back into text, and check what they talk
to, without generating anything. Bounded like generation requests: prompt size, message size
and id count.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import kvrelay
from kvrelay.common.limits import MAX_PROMPT_CHARS
from kvrelay.router.errors import RouterError
from kvrelay.router.http_body import admitted, read_body
from kvrelay.router.http_responses import router_error
from kvrelay.router.openai_models import ChatMessage
from kvrelay.router.service import RouterService
from kvrelay.router.validation import first_bad_id

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def extras(service: RouterService, error: Any) -> APIRouter:
    """The endpoints; ``error(status, message)`` builds the API's error response."""
    api = APIRouter()

    def wrong_model(model: str | None) -> Response | None:
        if model and model != service.model_name:
            return error(404, f"model {model!r} is not served here; this router serves "
                              f"{service.model_name!r}")
        return None

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            req = await read_body(service, request, TokenizeRequest)
            if (bad := wrong_model(req.model)) is not None:
                return bad
            if (req.prompt is None) == (req.messages is None):
                return error(400, "give exactly one of prompt and messages")
            if req.messages is not None:
                ids = await service.encode_chat(
                    [{"role": m.role, "content": m.text()} for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt)
            else:
                assert req.prompt is not None
                ids = await service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except ValueError as e:
            return error(400, str(e))
        except RouterError as e:
            return router_error(e)  # 429 and 503 with Retry-After
        finally:
            admitted(request)
        return JSONResponse({"count": len(ids), "max_model_len":
                             service.effective_max_model_len(), "tokens": ids})

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            req = await read_body(service, request, DetokenizeRequest)
            if (bad := wrong_model(req.model)) is not None:
                return bad
            bad_id = first_bad_id(req.tokens, service.vocab_size)
            if bad_id is not None:
                return error(400, f"token id {bad_id} is outside the vocabulary "
                                  f"[0, {service.vocab_size})")
            text = await service.decode(req.tokens)
        except ValueError as e:
            return error(400, str(e))
        except RouterError as e:
            return router_error(e)  # 429 and 503 with Retry-After
        finally:
            admitted(request)
        return JSONResponse({"prompt": text})

    @api.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": kvrelay.__version__})

    return api
