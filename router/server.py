"""The router process: public gRPC API (API keys, optional TLS) and an internal control port
(worker registry, optional cluster token)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.common import tracing
from kvrelay.common.limits import MAX_GRPC_REQUEST_BYTES
from kvrelay.common.options import warn_if_exposed_without_token
from kvrelay.common.rpc import (
    HEARTBEAT_INTERVAL_S,
    SecretSet,
    TLSFiles,
    add_health,
    api_key_interceptor,
    bind,
    cluster_token_interceptor,
    make_server,
    set_serving,
    token_metadata,
)
from kvrelay.proto import generate_pb2_grpc, worker_pb2_grpc
from kvrelay.router.admission import concurrency_limit
from kvrelay.router.calibration import Calibrator
from kvrelay.router.grpc_api import GenerationServicer, RegistryServicer
from kvrelay.router.grpc_limits import ConcurrentCallLimit
from kvrelay.router.lifecycle import Lifecycle, RouterConfig
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.policy import make_policy
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.service import RouterService

logger = logging.getLogger(__name__)

PUBLIC_SERVICES = ("kvrelay.v1.Generation",)


@dataclass(frozen=True)
class RouterSettings:
    model: str  # checkpoint directory: tokenizer and config
    host: str = "127.0.0.1"
    port: int = 50051  # public gRPC
    control_host: str = "127.0.0.1"
    control_port: int = 50052  # worker heartbeats
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # OpenAI-compatible HTTP API when set
    # The scrape port (/metrics, /version) when set: Prometheus and the planner, not clients.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    # Required to read /metrics (Bearer) wherever it is served when set; the public HTTP port
    # serves /metrics only with it, or when no API keys are set.
    metrics_token: str | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    # Each API key gets its own prefix-cache namespace (cache_salt derived from the key);
    # None: so when API keys are set.
    cache_salt_by_api_key: bool | None = None
    chat_template: str | None = None  # Jinja; None: the tokenizer's own
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans to this collector when set
    cluster_token: str | None = None
    tls: TLSFiles | None = None
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    config: RouterConfig = field(default_factory=RouterConfig)
    # Calls the public gRPC server runs at once (health checks aside); None: as many as the
    # HTTP server's connections (admission.concurrency_limit of max_inflight).
    max_concurrent_rpcs: int | None = None

    def __post_init__(self) -> None:
        for name in ("port", "control_port", "http_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < 65536):
                raise ValueError(f"{name} must be in [0, 65536)")


def warn_if_control_exposed(st: RouterSettings) -> bool:
    """Logs a warning, and returns True, when the control port listens beyond loopback with no
    cluster token: whoever reaches it can register a worker that receives prompts and returns
    output of its choosing."""
    return warn_if_exposed_without_token("the router's control port", st.control_host,
                                         st.control_port, st.cluster_token)


class Router:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.port = self.control_port = 0
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.http: Any = None  # http_api.HttpServer, when serving the OpenAI API
        self.scrape: Any = None  # http_metrics.MetricsServer, when serving the scrape port
        self._stopped = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self.serving = False

    async def start(self) -> None:
        from kvrelay.engine.models.arch import load_model_config
        from kvrelay.engine.tokenizer import eos_token_ids, load_tokenizer

        st = self.settings
        if st.otlp_traces_endpoint:
            tracing.setup("kvrelay-router", st.otlp_traces_endpoint)
        _, arch = load_model_config(st.model)
        tokenizer = load_tokenizer(st.model)
        self.registry = WorkerRegistry(heartbeat_interval_s=st.heartbeat_interval_s,
                                       model_identity=arch.identity,
                                       authenticated=bool(st.cluster_token))
        self.registry.start()
        policy = make_policy(st.config.policy)
        lifecycle = Lifecycle(self.registry, policy, st.config, token_metadata(st.cluster_token))
        if policy.calibrate:
            Calibrator(lifecycle)  # measures joining workers before they take traffic
        name = st.served_model_name or os.path.basename(os.path.normpath(st.model))
        self.metrics = RouterMetrics(self.registry, name)
        self.service = RouterService(
            lifecycle, tokenizer, model_name=name, vocab_size=arch.vocab_size,
            max_model_len=arch.max_position_embeddings,
            eos_token_ids=frozenset(eos_token_ids(st.model, tokenizer)),
            max_inflight=st.config.max_inflight, metrics=self.metrics,
            cache_salt_by_api_key=(bool(st.api_keys) if st.cache_salt_by_api_key is None
                                   else st.cache_salt_by_api_key),
            chat_template=st.chat_template, tenant_keys=len(set(st.api_keys)),
            max_queued=st.config.max_queued, queue_wait_s=st.config.queue_wait_s)

        keys = SecretSet(st.api_keys)
        self._start_public(keys)

        warn_if_control_exposed(st)
        tokens = SecretSet([st.cluster_token] if st.cluster_token else [])
        self.control = make_server([cluster_token_interceptor(tokens)] if tokens else [])
        worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(self.registry),
                                                       self.control)
        add_health(self.control, ["kvrelay.v1.Registry"])
        self.control_port = bind(self.control, st.control_host, st.control_port)
        await self.public.start()
        await self.control.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_serving())
        await self._start_http(keys)
        logger.info("router serving %s: gRPC %s:%d, control %s:%d%s%s", name, st.host,
                    self.port, st.control_host, self.control_port,
                    f", HTTP {st.http_host}:{self.http_port}" if self.http_port else "",
                    f", metrics {st.metrics_host}:{self.metrics_port}" if self.metrics_port
                    else "")

    async def _start_http(self, keys: SecretSet) -> None:
        """The OpenAI HTTP API and the scrape port, each when asked for."""
        from kvrelay.router.http_api import HttpServer
        from kvrelay.router.http_metrics import MetricsServer

        st = self.settings
        token = SecretSet([st.metrics_token] if st.metrics_token else [])
        if st.http_port is not None:
            self.http = HttpServer(self.service, self.metrics, host=st.http_host,
                                   port=st.http_port, api_keys=keys, tls=st.tls,
                                   metrics_token=token)
            await self.http.start()
            self.http_port = self.http.port
        if st.metrics_port is not None:
            self.scrape = MetricsServer(self.metrics, host=st.metrics_host,
                                        port=st.metrics_port, token=token)
            await self.scrape.start()
            self.metrics_port = self.scrape.port

    def _start_public(self, keys: SecretSet) -> None:
        """The public gRPC server, bound: API keys, then the concurrent-call limit."""
        st = self.settings
        self.call_limit = ConcurrentCallLimit(st.max_concurrent_rpcs
                                              or concurrency_limit(st.config.max_inflight))
        # A public request is at most a maximal prompt; the internal ports carry KV metadata.
        self.public = make_server([*([api_key_interceptor(keys)] if keys else []),
                                   self.call_limit], max_receive_bytes=MAX_GRPC_REQUEST_BYTES)
        generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.service),
                                                           self.public)
        # NOT_SERVING until a worker path exists: a readiness probe that passes before then
        # sends traffic that can only fail with UNAVAILABLE.
        self._health = add_health(self.public, PUBLIC_SERVICES)
        set_serving(self._health, PUBLIC_SERVICES, False)
        self.serving = False
        self.port = bind(self.public, st.host, st.port, st.tls)

    async def _watch_serving(self) -> None:
        """Keeps the public health status equal to whether a request could be routed now
        (workers join, leave, drain and turn suspect without telling this task: it polls)."""
        period = min(0.25, self.settings.heartbeat_interval_s / 4)
        while True:
            serving = self.registry.can_serve()
            if serving != self.serving:
                self.serving = serving
                set_serving(self._health, PUBLIC_SERVICES, serving)
                (logger.info if serving else logger.warning)(
                    "router %s", "ready: can serve requests" if serving
                    else "not serving: no usable prefill+decode pair or aggregated worker")
            await asyncio.sleep(period)

    async def wait_serving(self, timeout: float) -> bool:
        """Whether the router can serve a request within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.serving:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        if self._watch is not None:
            self._watch.cancel()
        set_serving(self._health, PUBLIC_SERVICES, False)
        if self.http is not None:
            await self.http.stop()
        if self.scrape is not None:
            await self.scrape.stop()
        await self.public.stop(grace=2.0)
        await self.control.stop(grace=1.0)
        await self.registry.stop()
        self.service.close()
        if self.settings.otlp_traces_endpoint:
            await asyncio.to_thread(tracing.shutdown)  # flushes the spans still queued
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def run_router(settings: RouterSettings,
                     on_ready: Callable[[Router], None] | None = None) -> None:
    router = Router(settings)
    await router.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(router.stop()))
    if on_ready is not None:
        on_ready(router)
    await router.wait()
