"""gRPC plumbing shared by the router and the workers: servers, channels, auth, status mapping."""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

CLUSTER_TOKEN_KEY = "x-kvrelay-cluster-token"
API_KEY_KEY = "x-api-key"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Why a call failed travels typed in its trailers: common/failures.py.
MAX_MESSAGE_BYTES = 64 * 2**20
# The cluster's timing contract, one default for the router, the workers and their flags: a
# worker beats this often (the router drops one that missed three), a KV reservation lives
# this long unless the router renews it, and a draining worker gives its requests in flight this
# long to finish before it exits.
HEARTBEAT_INTERVAL_S = 1.0
LEASE_TTL_S = 10.0
DRAIN_TIMEOUT_S = 30.0

# Keepalive, both ways, so a dead or wedged peer is noticed without waiting for TCP: a channel
# pings its server every KEEPALIVE_TIME_MS and drops the connection (failing its calls with
# UNAVAILABLE) when no ack comes within KEEPALIVE_TIMEOUT_MS; a server pings its clients the
# same way (a router gone mid-call ends the call's handler, freeing what it holds). Servers
# accept a client's pings down to MIN_PING_INTERVAL_MS apart, with or without calls in flight,
# so a client's keepalive is never answered with GOAWAY "too_many_pings".
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_PING_INTERVAL_MS = 5_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.so_reuseport", 0),
]


class SecretSet:
    """Accepted secrets (API keys or cluster tokens), compared in constant time."""

    def __init__(self, secrets: Iterable[str]):
        self._secrets = [s.encode() for s in secrets if s]

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __repr__(self) -> str:  # never print the secrets themselves
        return f"SecretSet({len(self._secrets)} secrets)"

    def check(self, presented: str | bytes | None) -> bool:
        if presented is None:
            return False
        p = presented.encode() if isinstance(presented, str) else presented
        ok = False
        for s in self._secrets:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(s, p)
        return ok


def bearer_or_key(metadata: dict[str, Any]) -> str | None:
    """The API key a client presented: ``authorization: Bearer K`` or ``x-api-key: K``."""
    auth = metadata.get("authorization")
    if isinstance(auth, str) and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    key = metadata.get(API_KEY_KEY)
    return key if isinstance(key, str) else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata fails ``check`` with UNAUTHENTICATED (health is exempt)."""

    def __init__(self, check: Callable[[dict[str, Any]], bool], what: str):
        self._check = check
        self._what = what

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        md = {k: v for k, v in (details.invocation_metadata or ())}
        if self._check(md):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        message = f"missing or invalid {self._what}"
        logger.warning("refused %s: %s", details.method, message)

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover (makes this an async generator)

        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)


class _Malformed:
    """What a request that failed to deserialize becomes (see ``MalformedRequestInterceptor``)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse (corrupt wire format, a string field that is not
    UTF-8) with INVALID_ARGUMENT and a message, instead of gRPC's UNKNOWN "Unexpected
    DecodeError" and a logged traceback. Innermost, so authentication still comes first."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        # Only our asyncio handlers; synchronous ones (grpc's health servicer) run on gRPC's
        # executor and keep their own behaviour.
        if not (inspect.isasyncgenfunction(handler.unary_stream)
                or inspect.iscoroutinefunction(handler.unary_unary)):
            return handler
        parse = handler.request_deserializer

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except Exception as e:  # DecodeError, or whatever a custom deserializer raises
                return _Malformed(e)

        async def refuse(context: grpc.aio.ServicerContext, bad: _Malformed) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed request: {type(bad.error).__name__}: {bad.error}")

        kw = {"request_deserializer": deserialize,
              "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(context, request)
                gen = inner_stream(request, context)
                try:
                    async for msg in gen:
                        yield msg
                finally:  # now, not when collected: the handler's cleanup frees KV blocks
                    await gen.aclose()

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(context, request)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


def cluster_token_interceptor(tokens: SecretSet) -> AuthInterceptor:
    return AuthInterceptor(lambda md: tokens.check(md.get(CLUSTER_TOKEN_KEY)), "cluster token")


def api_key_interceptor(keys: SecretSet) -> AuthInterceptor:
    return AuthInterceptor(lambda md: keys.check(bearer_or_key(md)), "API key")


@dataclass(frozen=True)
class TLSFiles:
    cert_file: str
    key_file: str

    def server_credentials(self) -> grpc.ServerCredentials:
        with open(self.key_file, "rb") as k, open(self.cert_file, "rb") as c:
            return grpc.ssl_server_credentials([(k.read(), c.read())])


def make_server(interceptors: list[grpc.aio.ServerInterceptor] | None = None, *,
                max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Server:
    """A server whose calls pass ``interceptors``; messages larger than ``max_receive_bytes``
    are refused by gRPC itself (RESOURCE_EXHAUSTED) before they are parsed."""
    options = [(k, v) for k, v in SERVER_OPTIONS if k != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return grpc.aio.server(interceptors=[*(interceptors or []), MalformedRequestInterceptor()],
                           options=options)


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSFiles | None = None) -> int:
    """Bind ``host:port`` (port 0 picks a free one) and return the bound port."""
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = (server.add_secure_port(addr, tls.server_credentials()) if tls
             else server.add_insecure_port(addr))
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {addr}")
    return bound


def add_health(server: grpc.aio.Server, services: Iterable[str]) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *services):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def set_serving(servicer: health.HealthServicer, services: Iterable[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", *services):
        servicer.set(name, status)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((CLUSTER_TOKEN_KEY, token),) if token else ()
