"""One worker process: an engine in a role, its gRPC servicers, heartbeats, graceful drain.

``role=prefill`` serves PrefillWorker and streams KV out; ``role=decode`` serves DecodeWorker
and receives KV; ``role=both`` serves DecodeWorker.GenerateLocal only (the aggregated
baseline). SIGTERM drains: the worker reports itself draining, refuses new work, lets requests
in flight finish (bounded by ``drain_timeout_s``), then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable

import grpc

from kvrelay.common import tracing
from kvrelay.common.convert import step_cost_to_proto
from kvrelay.common.failures import refusals
from kvrelay.common.kv_layout import CacheLayout
from kvrelay.common.rpc import (
    SecretSet,
    add_health,
    bind,
    cluster_token_interceptor,
    make_server,
    set_serving,
    token_metadata,
)
from kvrelay.decode_worker.fencing import Fencer
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore, EngineStats
from kvrelay.engine.kv_cache import dtype_name
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.worker.heartbeat import Heartbeater, tier_loads
from kvrelay.worker.prefix_exports import PrefixExports
from kvrelay.worker.settings import WorkerSettings
from kvrelay.worker.watchdog import EngineWatchdog, WatchdogConfig

logger = logging.getLogger(__name__)

_ROLE = {"prefill": wpb.ROLE_PREFILL, "decode": wpb.ROLE_DECODE, "both": wpb.ROLE_BOTH}


class ControlServicer(worker_pb2_grpc.WorkerControlServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def GetStatus(self, request: wpb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> wpb.WorkerStatus:
        w = self.worker
        stats = await w.engine.call(w.engine.core.stats)
        return wpb.WorkerStatus(info=w.info, load=w.load_message(stats))

    async def Drain(self, request: wpb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> wpb.DrainResponse:
        w = self.worker
        in_flight = len(w.engine.core.seqs)
        asyncio.get_running_loop().create_task(
            w.drain(request.timeout_ms / 1000.0 if request.timeout_ms else None))
        return wpb.DrainResponse(in_flight=in_flight)

    async def ExportPrefix(self, request: wpb.ExportPrefixRequest,
                           context: grpc.aio.ServicerContext) -> wpb.ExportPrefixResponse:
        async with refusals(context):
            e = await self.worker.exports.export(
                request.share_id, list(request.prompt_token_ids), request.cache_salt,
                request.ttl_ms / 1000.0)
        return wpb.ExportPrefixResponse(block_ids=e.block_ids, tokens_covered=e.tokens,
                                        peer_info=e.peer_info, agent_name=e.agent_name,
                                        incarnation=e.incarnation, page_ids=e.page_ids)

    async def EndExport(self, request: wpb.EndExportRequest,
                        context: grpc.aio.ServicerContext) -> wpb.EndExportResponse:
        held = await self.worker.exports.end(request.share_id)
        return wpb.EndExportResponse(held=held)


EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine failed for good (a tensor-parallel rank died)


def _on_cuda(device: str) -> bool:
    from kvrelay.engine.device import resolve_device

    return resolve_device(device).type == "cuda"


class Worker:
    """Assembles and runs one worker; ``start()`` then ``wait()`` (or ``stop()``)."""

    def __init__(self, settings: WorkerSettings, engine_config: EngineConfig):
        if engine_config.role != settings.role:
            raise ValueError("engine role and worker role differ")
        tp = engine_config.model.tensor_parallel_size
        if settings.role != "both" and tp > 1 and _on_cuda(engine_config.model.device):
            raise ValueError(f"--tensor-parallel-size {tp} with --role {settings.role}: KV "
                             f"transfer under tensor parallelism needs CPU KV caches (use "
                             f"--role both on GPUs)")
        self.settings = settings
        self.engine_config = engine_config
        self.worker_id = settings.resolved_worker_id()
        self.incarnation = secrets.token_hex(8)
        self.port = 0
        self._stopped = asyncio.Event()
        self._draining = False
        self._last_tokens = (time.monotonic(), 0)
        self._step_tokens = 0
        self._tokens_per_s = 0.0
        self._live_senders: dict[str, frozenset[str]] = {}  # router -> prefill agents it lists
        self._answered_at: dict[str, float] = {}  # router -> when it last answered a beat
        self.fencer: Fencer | None = None
        self.watchdog: EngineWatchdog | None = None
        self._engine_stuck = False  # the watchdog's verdict: beats say "draining" meanwhile

    # -- assembly ------------------------------------------------------------------------------
    async def _build_engine(self) -> None:
        from kvrelay.engine.tokenizer import eos_token_ids

        role = self.settings.role
        model_dir = self.engine_config.model.model
        self.kv = None
        if role != "both":
            from kvrelay.kv_transfer.config import NixlConnectorConfig
            from kvrelay.kv_transfer.connector import NixlConnector
            from kvrelay.kv_transfer.layout import model_identity

            if self.settings.host in ("127.0.0.1", "localhost", "::1"):
                # UCX listens on every interface unless told; a loopback worker keeps its KV
                # data plane on loopback too.
                os.environ.setdefault("UCX_NET_DEVICES", "lo")
            grace, fence, write = self.settings.kv_timing()
            # A sender fences itself once no router vouches for it; without routers nobody
            # declares it gone either (its receivers' holds end otherwise).
            fenced = role == "prefill" and bool(self.settings.routers)
            self.kv = NixlConnector(NixlConnectorConfig(
                self.worker_id, model_identity(model_dir), layerwise=self.settings.kv_layerwise,
                sender_gone_grace_s=grace, write_timeout_s=write,
                self_fence_s=fence if fenced else None))
        # From the files: the worker never tokenizes (structured output reads tokenizer.json
        # when a request first needs it, without transformers).
        eos = eos_token_ids(model_dir)
        connector = self.kv
        # Loaded on the engine thread itself (see AsyncEngine.spawn: one OpenMP pool).
        self.engine = await AsyncEngine.spawn(
            lambda: EngineCore(self.engine_config, connector, eos), on_step=self._on_step,
            on_fatal=self._on_fatal)

    def _on_fatal(self, error: BaseException) -> None:
        """The engine can never step again (a tensor-parallel rank died or hung). Exit now, as a
        crash would: the router sees this worker's streams break and migrates its requests
        (their output so far is kept), and the registry drops it; its supervisor restarts it.
        Failing the requests instead would end them with an error the client sees."""
        logger.critical("worker %s exits: its engine is unusable (%s)", self.worker_id, error)
        close = getattr(self.engine.core.runner, "close", None)
        if close is not None:
            close()  # stop the surviving ranks
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)

    def _on_step(self, seconds: float, tokens: int) -> None:
        self._step_tokens += tokens
        if self.metrics is not None:
            self.metrics.step_time.observe(seconds)

    def _load(self) -> wpb.WorkerLoad:
        now = time.monotonic()
        t0, n0 = self._last_tokens
        if now - t0 >= 1.0:
            self._tokens_per_s = (self._step_tokens - n0) / (now - t0)
            self._last_tokens = (now, self._step_tokens)
        return self.load_message(self.engine.stats)

    def load_message(self, s: EngineStats) -> wpb.WorkerLoad:
        return wpb.WorkerLoad(
            num_blocks=s.num_blocks, free_blocks=s.num_free_blocks, running=s.num_running,
            waiting=s.num_waiting, waiting_for_kv=s.num_waiting_for_kv,
            queued_prompt_tokens=s.waiting_prompt_tokens,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            step_tokens_per_s=self._tokens_per_s, draining=self._draining or self._engine_stuck,
            step_cost=step_cost_to_proto(s.step_cost, s.max_step_tokens),
            tiers=tier_loads(s.kv_tiers))

    async def start(self) -> None:
        st = self.settings
        if st.otlp_traces_endpoint:
            tracing.setup(f"kvrelay-{st.role}-worker", st.otlp_traces_endpoint)
        self.metrics = None
        self.metrics_port: int | None = None
        await self._build_engine()
        if st.metrics_port is not None:
            from kvrelay.worker.metrics import WorkerMetrics

            runner = self.engine.core.runner
            self.metrics = WorkerMetrics(lambda: self.engine.stats, st.role, self.worker_id,
                                         attention=runner.backend, device=runner.device.type)
            self.metrics_port = self.metrics.serve(st.host, st.metrics_port)
        self.kv_events = None
        if st.kv_events_endpoint:  # the KV events in vLLM's format, for external routers
            from kvrelay.worker.kv_events_zmq import ZmqKVEventPublisher

            self.kv_events = ZmqKVEventPublisher(
                st.kv_events_endpoint, st.kv_events_topic, st.kv_events_replay_endpoint,
                encoding=st.kv_events_encoding)
            self.kv_events.start()
            await self.engine.call(self.engine.core.set_kv_event_sink, self.kv_events)
        interceptors = []
        if st.cluster_token:
            interceptors.append(cluster_token_interceptor(SecretSet([st.cluster_token])))
        self.server = make_server(interceptors)
        services = self._add_servicers()
        self.health = add_health(self.server, services)
        self._services = services
        self.port = bind(self.server, st.host, st.port)
        await self.server.start()
        if st.engine_watchdog_s is not None:
            self.watchdog = EngineWatchdog(self.engine.busy_since,
                                           WatchdogConfig(st.engine_watchdog_s),
                                           self._on_engine_stuck)
            self.watchdog.start()
        core = self.engine.core
        # What its block hashes and KV bytes mean: a router refuses a worker that differs
        # from its cluster (common/kv_layout.py).
        runner = core.runner
        plan = runner.kv_spec.groups
        layout = CacheLayout.local(runner.arch.identity, core.config.cache.block_size,
                                   dtype_name(runner.kv_dtype),
                                   "latent" if runner.arch.kv_latent else "kv",
                                   "heads" if runner.heads_first else "tokens",
                                   "" if plan is None else plan.signature)
        self.info = info = wpb.WorkerInfo(
            worker_id=self.worker_id, role=_ROLE[st.role], address=st.advertised(self.port),
            incarnation=self.incarnation, model_identity=layout.model_identity,
            block_size=layout.block_size, max_model_len=core.max_model_len,
            drain_timeout_s=st.drain_timeout_s, kv_layout=layout.to_proto())
        # Each KV tier's block hashes ride on the beats (deltas) for prefix-aware routing.
        self.heartbeater = Heartbeater(list(st.routers), info, self._load,
                                       core.cached_hash_sets,
                                       interval_s=st.heartbeat_interval_s,
                                       cluster_token=st.cluster_token,
                                       on_answer=self._on_beat_answer,
                                       on_proof=self.kv.router_answered
                                       if self.kv is not None and st.role == "prefill" else None)
        self.heartbeater.start()
        logger.info("worker %s (%s) serving on %s:%d, routers %s", self.worker_id, st.role,
                    st.host, self.port, ", ".join(st.routers) or "none")

    def _add_servicers(self) -> list[str]:
        """Put the role's servicers (and the control service) on ``self.server``; the names
        of the services it now serves, for the health service."""
        st = self.settings
        services: list[str] = []
        self.decode_servicer = self.decode_service = None
        self.prefill_servicer = self.prefill_service = None
        if st.role in ("decode", "both"):
            from kvrelay.decode_worker.leases import LeaseTable
            from kvrelay.decode_worker.service import DecodeService
            from kvrelay.decode_worker.servicer import DecodeServicer

            self.leases = LeaseTable(self.engine.abort, default_ttl_s=st.lease_ttl_s)
            self.leases.start()
            self.decode_service = DecodeService(self.engine, self.leases, self.kv)
            self.decode_servicer = DecodeServicer(self.decode_service)
            if self.kv is not None:  # blocks given up early wait for their sender: ask it
                self.fencer = Fencer(self.kv.settle, cluster_token=st.cluster_token)
                self.fencer.start()
                self.kv.on_hold = self.fencer.on_hold
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.decode_servicer, self.server)
            services.append("kvrelay.v1.DecodeWorker")
        if st.role == "prefill":
            from kvrelay.prefill_worker.peers import DecodePeers
            from kvrelay.prefill_worker.pull import PrefixPull
            from kvrelay.prefill_worker.service import PrefillService
            from kvrelay.prefill_worker.servicer import PrefillServicer

            md = token_metadata(st.cluster_token)
            peers = DecodePeers(self.engine, self.kv, md)
            self.prefill_service = PrefillService(self.engine, self.kv, peers,
                                                  PrefixPull(self.engine, self.kv, md))
            self.prefill_servicer = PrefillServicer(self.prefill_service, self.worker_id)
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.prefill_servicer,
                                                                self.server)
            services.append("kvrelay.v1.PrefillWorker")
        self.exports = PrefixExports(self.engine, self.kv)  # lends prefix blocks to pulls
        worker_pb2_grpc.add_WorkerControlServicer_to_server(ControlServicer(self), self.server)
        services.append("kvrelay.v1.WorkerControl")
        return services

    def _on_engine_stuck(self, stuck: bool) -> None:
        """The watchdog's verdict changed: readiness off while a step is stuck, back after; the
        beats meanwhile report the worker draining, so routers send it nothing new."""
        self._engine_stuck = stuck
        set_serving(self.health, self._services, not stuck and not self._draining)
        if self.metrics is not None:
            self.metrics.engine_stuck.set(1 if stuck else 0)
            if stuck:
                self.metrics.engine_stalls.inc()

    def _on_beat_answer(self, router: str, resp: wpb.HeartbeatResponse) -> None:
        """A decode worker's held blocks wait on their senders: one gone from every router's
        list for a grace period can no longer write (``Quarantine.observe_alive``)."""
        if self.settings.role != "decode" or self.kv is None:
            return
        self._live_senders[router] = frozenset(resp.live_prefill_agents)
        # Absence counts only across observations dense enough that no listing was missed: a
        # router lists a sender for 3 beats after its last one, so every router must have
        # answered within 2.5 beats (else a sender could have been listed, and proved itself
        # alive, unseen; it keeps writing for its self-fence horizon after that).
        now, gap = time.monotonic(), 2.5 * self.settings.heartbeat_interval_s
        prev = self._answered_at.get(router)
        self._answered_at[router] = now
        continuous = (prev is not None and now - prev <= gap
                      and len(self._answered_at) == len(set(self.settings.routers))
                      and all(now - t <= gap for t in self._answered_at.values()))
        self.kv.observe_alive(set().union(*self._live_senders.values()), continuous)

    # -- shutdown ------------------------------------------------------------------------------
    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new work, let requests in flight finish (bounded), then stop."""
        if self._draining:
            return
        self._draining = True
        logger.info("draining: no new requests; waiting for %d in flight",
                    len(self.engine.core.seqs))
        set_serving(self.health, self._services, False)
        for s in (self.decode_service, self.prefill_service):
            if s is not None:
                s.draining = True
        with contextlib.suppress(Exception):
            await self.heartbeater.beat_now()
        deadline = time.monotonic() + (timeout_s or self.settings.drain_timeout_s)
        while self.engine.core.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        await self.heartbeater.stop()
        if self.watchdog is not None:
            await self.watchdog.stop()
        # Routers forget this worker now; its calls still in flight end with the server.
        await self.heartbeater.beat_now(leaving=True, timeout_s=1.0)
        if self.decode_servicer is not None:  # sessions end once their calls did
            self.decode_servicer.sessions.close()
        await self.server.stop(grace=1.0)
        self.exports.close()
        if self.prefill_service is not None:
            await self.prefill_service.pull.close()
        if self.decode_servicer is not None:
            await self.leases.stop()
        if self.fencer is not None:
            await self.fencer.stop()
        self.engine.shutdown()
        if self.kv_events is not None:  # the engine's last events, then a closing reset
            await asyncio.to_thread(self.kv_events.close)
        if self.metrics is not None:
            self.metrics.close()
        if self.settings.otlp_traces_endpoint:
            await asyncio.to_thread(tracing.shutdown)  # flushes the spans still queued
        self._stopped.set()
        logger.info("worker %s stopped", self.worker_id)

    async def wait(self) -> None:
        await self._stopped.wait()


async def run_worker(settings: WorkerSettings, engine_config: EngineConfig,
                     on_ready: Callable[[Worker], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT (which drain) or the worker stops."""
    worker = Worker(settings, engine_config)
    await worker.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(worker.drain()))
    if on_ready is not None:
        on_ready(worker)
    await worker.wait()
