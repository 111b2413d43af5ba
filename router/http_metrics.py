"""The router's scrape port: ``/metrics`` and ``/version`` on an HTTP listener of their own
(``--metrics-host``/``--metrics-port``), for Prometheus and the planner, off the public port.

The router's metrics describe every tenant's traffic and the whole cluster (workers, their
loads, the routing model), and ``/version`` tells an attacker which release to aim at: neither
is a client's business (issue 54). On the public HTTP port ``/metrics`` answers only a scrape
token's holder (``--metrics-token``), or anyone when the router checks no API keys (a
development router, nothing of which is authenticated); ``/version`` asks for an API key like
the API. Here, where only the cluster's network reaches, both answer whoever gets through,
or, with a scrape token, its holder.

Served on the router's event loop, like the public app: the metrics' collectors read the
registry's loop-confined state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import kvrelay
from kvrelay.common.rpc import SecretSet
from kvrelay.router.http_middleware import presented_key
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.uvicorn_server import start_server

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def metrics_body(metrics: RouterMetrics | None) -> Response:
    return Response(metrics.render() if metrics is not None else b"",
                    media_type=PROMETHEUS_TEXT)


def version_body() -> JSONResponse:
    return JSONResponse({"version": kvrelay.__version__})


def token_ok(token: SecretSet, request: Request) -> bool:
    """Whether the request presents the scrape token (``Authorization: Bearer``, as
    Prometheus' ``authorization``/``bearer_token_file`` sends it, or ``x-api-key``)."""
    return token.check(presented_key(request.scope.get("headers") or []))


class MetricsServer:
    def __init__(self, metrics: RouterMetrics | None, *, host: str, port: int,
                 token: SecretSet | None = None):
        self.metrics = metrics
        self.host, self.port = host, port
        self.token = token or SecretSet([])
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    def app(self) -> Starlette:
        def guarded(body: Any) -> Any:
            async def endpoint(request: Request) -> Response:
                if self.token and not token_ok(self.token, request):
                    return JSONResponse({"error": "missing or invalid metrics token"},
                                        status_code=401)
                return body()
            return endpoint

        return Starlette(routes=[
            Route("/metrics", guarded(lambda: metrics_body(self.metrics))),
            Route("/version", guarded(version_body)),
        ])

    async def start(self) -> None:
        config = uvicorn.Config(self.app(), host=self.host, port=self.port,
                                log_level="warning", lifespan="off", access_log=False,
                                limit_concurrency=64, timeout_graceful_shutdown=1)
        self._server, self._task, self.port = await start_server(config, "metrics server")

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait([self._task], timeout=5)
