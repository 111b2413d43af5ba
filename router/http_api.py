"""OpenAI-compatible HTTP API on FastAPI + uvicorn, in the router's event loop.

/v1/completions, /v1/chat/completions (SSE streaming with ``data: [DONE]``), /v1/models,
/health; /metrics only to a scrape token's holder, or when no API keys are checked
(``http_metrics``: the scrape port is where it belongs). Errors are OpenAI error objects; 429
and 503 carry ``Retry-After``. This
module serves the app and sets up its middlewares and error handlers; the generation endpoints
are ``http_routes``, their answers ``http_responses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvrelay.common.limits import MAX_HTTP_BODY_BYTES
from kvrelay.common.rpc import SecretSet, TLSFiles
from kvrelay.router.admission import RETRY_AFTER_S, concurrency_limit
from kvrelay.router.http_body import validation_message
from kvrelay.router.http_extras import extras
from kvrelay.router.http_metrics import metrics_body, token_ok
from kvrelay.router.http_middleware import Admit, ApiKeyAuth
from kvrelay.router.http_responses import error_response
from kvrelay.router.http_routes import openai_routes
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.service import RouterService
from kvrelay.router.uvicorn_server import start_server


def _refuse(status: int, message: str) -> Response:
    """An error answer; an overload (429, 503) says when to retry."""
    return error_response(status, message,
                          retry_after_s=RETRY_AFTER_S if status in (429, 503) else None)


# Paths whose requests carry a body to parse (and are admitted first), and the generation ones
# among them (refused on arrival while the router is at its in-flight cap).
BODY_PATHS = ("/v1/", "/tokenize", "/detokenize")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def connection_limit(max_inflight: int) -> int:
    """uvicorn's ``limit_concurrency``: connections (idle keep-alive ones too) and requests
    beyond it are answered 503 before anything is read. A backstop past what admission lets in:
    every request in flight, as many being parsed, and as many idle connections again."""
    return concurrency_limit(max_inflight)


# Bytes of a response the kernel may hold not yet sent (TCP_NOTSENT_LOWAT). Unbounded, a slow
# SSE reader's backlog (megabytes on loopback) sits in the socket, one event per token, and the
# router never sees the client fall behind; bounded, a send waits once the client's window is
# full, and the next event carries every token ready by then (router.coalesce). Bytes in flight
# are not counted: throughput is unchanged.
NOTSENT_LOWAT = 16 * 1024


def hold_back_unsent(transport: asyncio.BaseTransport) -> None:
    """Make ``transport`` push back as soon as its socket holds ``NOTSENT_LOWAT`` unsent bytes:
    the kernel keeps no more, and the transport buffers none (an ASGI send then waits)."""
    sock = transport.get_extra_info("socket")
    lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)  # Linux, macOS
    if sock is not None and lowat is not None and sock.family in (socket.AF_INET,
                                                                  socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, lowat, NOTSENT_LOWAT)
    # TLS: the TCP transport under asyncio's TLS layer buffers on its own (not public API,
    # hence looked up with care).
    tcp = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    for t in (transport, tcp):
        if isinstance(t, asyncio.WriteTransport):
            # Paused once a byte waits in the transport, resumed once none does. (Not high=0:
            # the TLS layer pauses at size >= high, at 0 with nothing to drain.)
            t.set_write_buffer_limits(high=1, low=0)


class _HttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP/1.1 protocol, its connections made to push back early
    (``hold_back_unsent``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        hold_back_unsent(transport)


class HttpServer:
    def __init__(self, service: RouterService, metrics: RouterMetrics | None, *, host: str,
                 port: int, api_keys: SecretSet | None = None, tls: TLSFiles | None = None,
                 metrics_token: SecretSet | None = None):
        self.service = service
        self.metrics = metrics
        self.host, self.port = host, port
        self.api_keys = api_keys or SecretSet([])
        self.metrics_token = metrics_token or SecretSet([])
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
                                http=_HttpProtocol,
                                limit_concurrency=connection_limit(self.service.max_inflight),
                                **kw)
        self._server, self._task, self.port = await start_server(config, "HTTP server")

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
        service = self.service

        def busy(path: str, tenant: str) -> str | None:
            if not path.startswith(GENERATION_PATHS):
                return None
            full = service.arrival_refusal(tenant)
            return full.message if full is not None else None

        # Admission first (innermost but for the key check): nothing is read or parsed for a
        # request the router cannot take now.
        app.add_middleware(Admit, limit=MAX_HTTP_BODY_BYTES, admission=service.admission,
                           busy=busy, paths=BODY_PATHS, refuse=_refuse,
                           tenant_of=service.tenant_of)
        if self.api_keys:
            app.add_middleware(ApiKeyAuth, check=self.api_keys.check,
                               prefixes=("/v1/", "/tokenize", "/detokenize", "/version"),
                               refuse=_refuse)
        app.include_router(extras(self.service, _refuse))

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            message, param = validation_message(exc.errors())
            return error_response(400, message, param=param)

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
        async def metrics(request: Request) -> Response:
            if self.metrics_token:
                if not token_ok(self.metrics_token, request):
                    return error_response(401, "missing or invalid metrics token")
            elif self.api_keys:  # clients with keys must not read every tenant's traffic
                return error_response(404, "/metrics is not served on the public port: "
                                           "scrape the router's metrics port (--metrics-port)")
            return metrics_body(self.metrics)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{
                "id": service.model_name, "object": "model", "created": 0,
                "owned_by": "kvrelay", "max_model_len": service.effective_max_model_len()}]})

        app.include_router(openai_routes(self.service))
        return app
