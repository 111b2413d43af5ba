"""Pure ASGI middlewares of the HTTP API: refusals before the app sees a request.

Plain ``__call__(scope, receive, send)`` classes rather than Starlette's ``BaseHTTPMiddleware``
(``@app.middleware("http")``), which wraps each request in a task group and re-streams every
response chunk through a memory object stream: for SSE that is paid once per token.
``refuse(status, message)`` builds the error response, so both answer in the API's format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Refuse = Callable[[int, str], Any]  # (HTTP status, message) -> an ASGI response


class BodyLimit:
    """A request body over ``limit`` bytes is answered 413 before it is read into memory (by
    its Content-Length, or counted as it arrives when chunked)."""

    def __init__(self, app: Any, limit: int, refuse: Refuse):
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        resp = self.refuse(413, f"the request body is larger than {self.limit} bytes")
        await resp(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding") is None:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:  # chunked: buffer up to the limit, then replay to the app
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left
            body += msg.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The API key in raw ASGI headers: ``Authorization: Bearer K`` or ``x-api-key: K``."""
    bearer = key = None
    for name, value in headers:
        if name == b"authorization":
            v = value.decode("latin-1")
            if v[:7].lower() == "bearer ":
                bearer = v[7:].strip()
        elif name == b"x-api-key":
            key = value.decode("latin-1")
    return bearer if bearer is not None else key


class ApiKeyAuth:
    """Paths under ``prefixes`` need a key that ``check`` accepts; others (health, metrics,
    version) do not."""

    def __init__(self, app: Any, check: Callable[[str | None], bool],
                 prefixes: tuple[str, ...], refuse: Refuse):
        self.app = app
        self.check = check
        self.prefixes = prefixes
        self.refuse = refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes) \
                and not self.check(presented_key(scope.get("headers") or [])):
            await self.refuse(401, "missing or invalid API key")(scope, receive, send)
            return
        await self.app(scope, receive, send)
