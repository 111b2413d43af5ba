"""Request bodies of the HTTP API, parsed under bounds and off the event loop when large.

FastAPI's own body handling parses every body with ``json.loads`` on the event loop, then
validates the objects: a 25 MiB body of numbers took 3 s and 1.8 GB there, and every other
request waited. Here a body's JSON values are counted first (in C, bounded by
``RouterService.max_body_values``), and it is parsed and validated in one pass by pydantic
(``model_validate_json``: fields the API ignores are skipped, not built), on the tokenizer
threads when it is larger than ``OFFLOAD_BODY_BYTES``. Every refusal is a ``BadBody``: a 400
with a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvrelay.router.service import RouterService, serve_tenant
from kvrelay.router.validation import json_values

M = TypeVar("M", bound=BaseModel)

# Bodies larger than this are parsed on the tokenizer threads (a 64 KiB body parses in ~1 ms).
OFFLOAD_BODY_BYTES = 64 * 1024


class BadBody(ValueError):
    """A body that is no valid request: its message, and the field it names (or None)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The client's message for pydantic ``errors`` (the first one) and the field it names."""
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = first.get("msg", "invalid request")
    return (f"{loc}: {msg}" if loc else msg), (loc or None)


def parse_body(model: type[M], body: bytes, max_values: int) -> M:
    """``body`` as a ``model``; BadBody when it holds more than ``max_values`` JSON values,
    is no JSON (too deep included), or does not validate."""
    n = json_values(body, max_values)
    if n > max_values:
        raise BadBody(f"the request body holds more than {max_values} JSON values")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise BadBody(*validation_message(e.errors(include_url=False,
                                                   include_input=False))) from None


async def read_body(service: RouterService, request: Request, model: type[M]) -> M:
    """The request's body as a ``model`` (BadBody, or RouterError when the tokenizer threads
    are too busy to take a large one). The tenant admission counted it under (its API key's)
    becomes the task's: its jobs on the tokenizer threads take that tenant's turns."""
    ticket = request.scope.get("kvrelay.admission")
    if ticket is not None:
        serve_tenant(ticket.tenant)
    body = await request.body()
    return await service.offload(len(body) > OFFLOAD_BODY_BYTES, parse_body, model, body,
                                 service.max_body_values)


def admitted(request: Request) -> None:
    """The request's work before routing is done: its admission ticket goes back."""
    ticket = request.scope.get("kvrelay.admission")
    if ticket is not None:
        ticket.release()
