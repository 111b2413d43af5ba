"""A bound on the public gRPC server's concurrent calls, as uvicorn's ``limit_concurrency`` bounds
the HTTP API's connections.

Without it every call a client opens holds a handler task, its request message and (once
admitted) a place in the router's queues, however many a client opens at once. A call past the
limit is answered ``RESOURCE_EXHAUSTED`` at once, with the trailer ``retry-after-ms``, before
its handler runs (grpc's own ``maximum_concurrent_rpcs`` answers the same code but with no
retry hint). Health checks are exempt: a probe must see a busy router as alive.

Loop-confined (the router's event loop): no locks.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvrelay.common.rpc import HEALTH_PREFIX
from kvrelay.router.admission import RETRY_AFTER_S


class ConcurrentCallLimit(grpc.aio.ServerInterceptor):
    """At most ``limit`` calls (health checks aside) run at once; ``active`` of them do now and
    ``refused`` were answered RESOURCE_EXHAUSTED."""

    def __init__(self, limit: int, retry_after_s: float = RETRY_AFTER_S):
        if limit < 1:
            raise ValueError("the concurrent-call limit must be positive")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0
        self.refused = 0

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX) \
                or handler.request_streaming:
            return handler
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream), **kw)
        if inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), **kw)
        return handler

    async def _refuse(self, context: grpc.aio.ServicerContext) -> None:
        self.refused += 1
        context.set_trailing_metadata(
            (("retry-after-ms", str(int(self.retry_after_s * 1000))),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"router busy: {self.active} calls in progress (at most "
                            f"{self.limit}); retry shortly")

    def _stream(self, inner: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if self.active >= self.limit:
                await self._refuse(context)
            self.active += 1
            try:
                gen = inner(request, context)
                try:
                    async for msg in gen:
                        yield msg
                finally:  # now, not when collected: the handler's cleanup ends its request
                    await gen.aclose()
            finally:
                self.active -= 1

        return call

    def _unary(self, inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.active >= self.limit:
                await self._refuse(context)
            self.active += 1
            try:
                return await inner(request, context)
            finally:
                self.active -= 1

        return call
