"""The real router, in this process, with no workers: what tests of its request validation use
instead of a cluster.

``RouterInProcess`` starts ``kvrelay.router.server.Router`` (the public gRPC server on a
loopback port, its control port, the registry, the lifecycle and ``RouterService`` with the
checkpoint's tokenizer) on an event loop of its own thread, and builds the OpenAI HTTP app
(``HttpServer.app``) without a listening socket: HTTP requests reach it in-process through
httpx's ASGI transport, on the router's loop. A request that passes validation finds no worker
and is answered 503 / UNAVAILABLE, so a validation gap still fails a test that expects a
refusal. An exception the app raises reaches the caller, and ``errors`` holds every record of
ERROR or above the process logged while the router ran.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any

import httpx

from kvrelay.router.http_api import HttpServer
from kvrelay.router.server import Router, RouterSettings


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RouterInProcess:
    def __init__(self, model_dir: str, *, served_model_name: str = "demo",
                 **settings: Any) -> None:
        self.settings = RouterSettings(model=model_dir, port=0, control_port=0,
                                       served_model_name=served_model_name, **settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router",
                                        daemon=True)
        self._errors = _Errors()
        self.router: Router | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def address(self) -> str:
        """The public gRPC port (loopback)."""
        assert self.router is not None
        return f"127.0.0.1:{self.router.port}"

    @property
    def errors(self) -> list[logging.LogRecord]:
        return self._errors.records

    @property
    def control_address(self) -> str:
        assert self.router is not None
        return f"127.0.0.1:{self.router.control_port}"

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run ``coro`` on the router's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> RouterInProcess:
        logging.getLogger().addHandler(self._errors)
        self._thread.start()

        async def start() -> None:
            self.router = Router(self.settings)
            await self.router.start()
            app = HttpServer(self.router.service, self.router.metrics, host="127.0.0.1",
                             port=0).app
            self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                             base_url="http://router", timeout=30)

        self.call(start(), timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._client is not None:
                await self._client.aclose()
            if self.router is not None:
                await self.router.stop()

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            logging.getLogger().removeHandler(self._errors)

    def post(self, path: str, *, content: bytes | None = None, json: Any = None,
             headers: Mapping[str, str] | None = None) -> httpx.Response:
        """An HTTP POST to the app, whole (a streamed answer is read to its end)."""
        assert self._client is not None
        return self.call(self._client.post(path, content=content, json=json,
                                            headers=headers))
