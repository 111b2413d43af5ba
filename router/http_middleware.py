"""Pure ASGI middlewares of the HTTP API: refusals before the app sees a request.

Plain ``__call__(scope, receive, send)`` classes rather than Starlette's ``BaseHTTPMiddleware``
(``@app.middleware("http")``), which wraps each request in a task group and re-streams every
response chunk through a memory object stream: for SSE that is paid once per token.
``refuse(status, message)`` builds the error response, so all answer in the API's format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvrelay.router.admission import Admission, Ticket

Refuse = Callable[[int, str], Any]  # (HTTP status, message) -> an ASGI response


class Admit:
    """Admission before work, for requests with a body (``POST`` to ``paths``), decided before
    the body is read: over ``limit`` bytes is a 413 (by its Content-Length, or counted as it
    arrives when chunked); ``busy(path, tenant)`` (no in-flight slot or place in the fair queue
    for the request's tenant, ``tenant_of(key)`` of the API key it presents) or a full
    ``admission`` (requests and body bytes being parsed and tokenized, the tenant's share of
    them) is a 429 with Retry-After. An admitted request holds its ticket
    (``scope["kvrelay.admission"]``) until its route has built its spec
    (``http_body.admitted``), its answer starts, or it ends."""

    def __init__(self, app: Any, limit: int, admission: Admission,
                 busy: Callable[[str, str], str | None], paths: tuple[str, ...], refuse: Refuse,
                 tenant_of: Callable[[str | None], str] = lambda key: ""):
        self.app = app
        self.limit = limit
        self.admission = admission
        self.busy = busy
        self.paths = paths
        self.refuse = refuse
        self.tenant_of = tenant_of

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS") \
                or not scope["path"].startswith(self.paths):
            await self.app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or []
        headers = dict(raw_headers)
        length = headers.get(b"content-length")
        chunked = length is None and headers.get(b"transfer-encoding") is not None
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(413, f"the request body is larger than {self.limit} bytes",
                               scope, receive, send)
            return
        tenant = self.tenant_of(presented_key(raw_headers))
        if (why := self.busy(scope["path"], tenant)) is not None:
            await self._refuse(429, why, scope, receive, send)
            return
        ticket = self.admission.enter(int(length) if length is not None else 0, tenant)
        if ticket is None:
            await self._refuse(429, self.admission.busy_message(tenant), scope, receive, send)
            return
        try:
            if chunked:
                replay = await self._read_chunked(ticket, scope, receive, send)
                if replay is None:
                    return
                receive = replay
            scope["kvrelay.admission"] = ticket

            async def send_then_release(message: Any) -> None:
                if message["type"] == "http.response.start":
                    ticket.release()
                await send(message)

            await self.app(scope, receive, send_then_release)
        finally:
            ticket.release()

    async def _refuse(self, status: int, message: str, scope: Any, receive: Any,
                      send: Any) -> None:
        await self.refuse(status, message)(scope, receive, send)

    async def _read_chunked(self, ticket: Ticket, scope: Any, receive: Any,
                            send: Any) -> Callable[[], Any] | None:
        """A body of unknown length, read up to the limit, its bytes taken from the admission
        budget as they arrive; a receive that replays it, or None when it was refused (or the
        client left)."""
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return None  # the client left
            chunk = msg.get("body", b"")
            body += chunk
            if len(body) > self.limit:
                await self._refuse(413, f"the request body is larger than {self.limit} bytes",
                                   scope, receive, send)
                return None
            if not ticket.grow(len(chunk)):
                await self._refuse(429, self.admission.busy_message(), scope, receive, send)
                return None
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay


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
