"""Run kvrelay on Ray: the router and each worker pool as actors, each replica in its own
placement group, pools scaled independently (by hand or by the autoscaler).

kvrelay adds no cluster manager: Ray places the actors (one machine or many, ``ray up`` or
KubeRay); the actors run the same ``Router``/``Worker`` code as the plain processes, and
workers find the router by heartbeat exactly as they do under Kubernetes. Scale-in drains a
replica (no new work; requests in flight finish, or migrate when the drain times out) before
its actor and placement group go away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolAutoscaler, PoolSample
from kvrelay.engine.config import EngineConfig
from kvrelay.router.server import RouterSettings
from kvrelay.worker import WorkerSettings

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "kvrelay-controller"
NAMESPACE = "kvrelay"
POOLS = ("prefill", "decode", "both")


@dataclass(frozen=True)
class PoolSpec:
    replicas: int = 0
    cpus: float = 1.0  # per replica; also the worker's torch threads on CPU
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.cpus < 0 or self.gpus < 0:
            raise ValueError("replicas, cpus and gpus must be non-negative")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus, **self.resources}
        if self.gpus:
            b["GPU"] = self.gpus
        return {k: v for k, v in b.items() if v}


@dataclass(frozen=True)
class ServeSpec:
    router: RouterSettings
    worker: WorkerSettings  # template: role, routers and ids are filled in per replica
    engine: EngineConfig  # template: role is filled in per pool
    pools: dict[str, PoolSpec]
    loopback: bool = True  # embedded local Ray: bind everything to 127.0.0.1
    autoscale: AutoscaleConfig | None = None
    log_level: str = "INFO"


@ray.remote(num_cpus=0)
class RouterActor:
    async def start(self, settings: RouterSettings, log_level: str) -> dict[str, Any]:
        from kvrelay.logs import setup_logging
        from kvrelay.router.server import Router

        setup_logging("router", log_level)
        self.router = Router(settings)
        await self.router.start()
        return {"port": self.router.port, "control_port": self.router.control_port,
                "http_port": self.router.http_port, "host": ray.util.get_node_ip_address()}

    async def workers(self) -> list[dict[str, Any]]:
        out = []
        for w in self.router.registry.workers.values():
            ld = w.load
            out.append({"worker_id": w.worker_id, "role": w.role, "address": w.address,
                        "draining": ld.draining, "queued_prompt_tokens": ld.queued_prompt_tokens,
                        "kv_usage": 1 - ld.free_blocks / ld.num_blocks if ld.num_blocks else 0,
                        "running": ld.running + ld.waiting_for_kv + ld.waiting,
                        "free_blocks": ld.free_blocks, "num_blocks": ld.num_blocks})
        return out

    async def recent_latency(self, window_s: float) -> dict[str, float | None]:
        ttft, itl = self.router.service.recent_latency(window_s)
        return {"ttft_ms": ttft, "itl_ms": itl}

    async def stop(self) -> None:
        await self.router.stop()


@ray.remote(num_cpus=0)
class WorkerActor:
    async def start(self, settings: WorkerSettings, engine: EngineConfig,
                    log_level: str) -> dict[str, Any]:
        from kvrelay.logs import setup_logging
        from kvrelay.worker import Worker

        setup_logging(f"{settings.role}-worker", log_level)
        self.worker = Worker(settings, engine)
        await self.worker.start()
        return {"worker_id": self.worker.worker_id, "port": self.worker.port}

    async def drain(self, timeout_s: float) -> None:
        await self.worker.drain(timeout_s)

    async def stop(self) -> None:
        await self.worker.stop()


@dataclass
class Replica:
    worker_id: str
    actor: Any
    pg: PlacementGroup
    draining: bool = False


@ray.remote(num_cpus=0)
class Controller:
    """Owns the router and the pools; ``scale`` and the autoscaler go through here."""

    def __init__(self, spec: ServeSpec):
        self.spec = spec
        self.pools: dict[str, list[Replica]] = {p: [] for p in POOLS}
        self._serial = {p: 0 for p in POOLS}
        self._lock = asyncio.Lock()
        self._autoscale_task: asyncio.Task[None] | None = None
        self.decisions: list[dict[str, Any]] = []

    async def start(self) -> dict[str, Any]:
        from kvrelay.logs import setup_logging

        setup_logging("controller", self.spec.log_level)
        self.router = RouterActor.options(name="kvrelay-router").remote()
        self.router_info = await self.router.start.remote(self.spec.router, self.spec.log_level)
        host = "127.0.0.1" if self.spec.loopback else self.router_info["host"]
        self.control = f"{host}:{self.router_info['control_port']}"
        await self.scale({p: s.replicas for p, s in self.spec.pools.items()})
        if self.spec.autoscale is not None:
            self._autoscale_task = asyncio.get_running_loop().create_task(self._autoscale())
        return {**self.router_info, "host": host, "counts": self.counts()}

    def counts(self) -> dict[str, int]:
        return {p: sum(1 for r in rs if not r.draining) for p, rs in self.pools.items()}

    async def status(self) -> dict[str, Any]:
        return {"counts": self.counts(), "router": self.router_info,
                "workers": await self.router.workers.remote(), "decisions": self.decisions[-50:]}

    async def scale(self, targets: dict[str, int]) -> dict[str, int]:
        """Set replica counts per pool (pools not named keep theirs)."""
        bad = [p for p in targets if p not in POOLS or targets[p] < 0]
        if bad:
            raise ValueError(f"unknown pool or negative count: {bad}")
        async with self._lock:
            jobs = []
            for pool, n in targets.items():
                live = [r for r in self.pools[pool] if not r.draining]
                if n > len(live):
                    jobs += [self._add(pool) for _ in range(n - len(live))]
                elif n < len(live):
                    jobs.append(self._remove(pool, len(live) - n))
            await asyncio.gather(*jobs)
            logger.info("pools now %s", self.counts())
            return self.counts()

    async def _add(self, pool: str) -> None:
        ps = self.spec.pools.get(pool, PoolSpec())
        self._serial[pool] += 1
        wid = f"{pool}-{self._serial[pool]}"
        pg = placement_group([ps.bundle()], strategy="PACK", name=f"kvrelay-{wid}")
        await pg.ready()
        host = "127.0.0.1" if self.spec.loopback else "0.0.0.0"
        settings = replace(self.spec.worker, role=pool, routers=(self.control,), worker_id=wid,
                           host=host, port=0,
                           advertise_host="127.0.0.1" if self.spec.loopback else None)
        threads = self.spec.engine.model.num_threads or max(1, int(ps.cpus))
        engine = replace(self.spec.engine, role=pool,
                         model=replace(self.spec.engine.model, num_threads=threads))
        actor = WorkerActor.options(
            num_cpus=ps.cpus, num_gpus=ps.gpus, resources=ps.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
            name=f"kvrelay-{wid}").remote()
        try:
            await actor.start.remote(settings, engine, self.spec.log_level)
            await self._wait_registered(wid, present=True)
        except Exception:
            ray.kill(actor)
            remove_placement_group(pg)
            raise
        self.pools[pool].append(Replica(wid, actor, pg))
        logger.info("replica %s up", wid)

    async def _remove(self, pool: str, n: int) -> None:
        load = {w["worker_id"]: w for w in await self.router.workers.remote()}

        def busy(r: Replica) -> float:
            w = load.get(r.worker_id, {})
            return w.get("running", 0) + w.get("queued_prompt_tokens", 0) / 1000
        victims = sorted((r for r in self.pools[pool] if not r.draining), key=busy)[:n]
        for r in victims:
            r.draining = True
        await asyncio.gather(*(self._drain(pool, r) for r in victims))

    async def _drain(self, pool: str, r: Replica) -> None:
        timeout = self.spec.worker.drain_timeout_s
        logger.info("draining %s", r.worker_id)
        try:
            await asyncio.wait_for(r.actor.drain.remote(timeout), timeout + 15)
        except Exception as e:  # a dead actor drains trivially
            logger.warning("drain of %s ended with %r", r.worker_id, e)
        ray.kill(r.actor)
        remove_placement_group(r.pg)
        self.pools[pool].remove(r)
        await self._wait_registered(r.worker_id, present=False)
        logger.info("replica %s removed", r.worker_id)

    async def _wait_registered(self, worker_id: str, *, present: bool,
                               timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = {w["worker_id"] for w in await self.router.workers.remote()}
            if (worker_id in ids) == present:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{worker_id} {'never registered' if present else 'still listed'}")

    async def _autoscale(self) -> None:
        cfg = self.spec.autoscale
        assert cfg is not None
        scalers = {p: PoolAutoscaler(p, cfg) for p in ("prefill", "decode")}
        while True:
            await asyncio.sleep(cfg.interval_s)
            try:
                workers = await self.router.workers.remote()
                lat = await self.router.recent_latency.remote(max(5.0, 5 * cfg.interval_s))
                for pool, scaler in scalers.items():
                    ws = [w for w in workers if w["role"] == pool and not w["draining"]]
                    n = self.counts()[pool]
                    sample = PoolSample(
                        replicas=n,
                        queued_prompt_tokens=sum(w["queued_prompt_tokens"] for w in ws),
                        kv_usage=sum(w["kv_usage"] for w in ws) / len(ws) if ws else 0.0,
                        running=sum(w["running"] for w in ws),
                        ttft_ms=lat["ttft_ms"], itl_ms=lat["itl_ms"])
                    d = scaler.decide(sample, time.monotonic())
                    if d.delta:
                        logger.info("autoscale %s %s -> %d: %s", pool, n, n + d.delta, d.reason)
                        self.decisions.append({"t": time.time(), "pool": pool, "from": n,
                                               "to": n + d.delta, "reason": d.reason})
                        await self.scale({pool: n + d.delta})
            except Exception:
                logger.exception("autoscaler tick failed")

    async def shutdown(self) -> None:
        if self._autoscale_task is not None:
            self._autoscale_task.cancel()
        async with self._lock:
            for pool, rs in self.pools.items():
                for r in list(rs):
                    try:
                        await asyncio.wait_for(r.actor.stop.remote(), 10)
                    except Exception as e:
                        logger.warning("stopping %s: %r", r.worker_id, e)
                    ray.kill(r.actor)
                    remove_placement_group(r.pg)
                self.pools[pool] = []
            try:
                await asyncio.wait_for(self.router.stop.remote(), 10)
            finally:
                ray.kill(self.router)


class ClusterHandle:
    """Python API over a running kvrelay on Ray (``connect`` or ``start``)."""

    def __init__(self, controller: Any):
        self.controller = controller

    def scale(self, *, prefill: int | None = None, decode: int | None = None,
              both: int | None = None, timeout: float = 300.0) -> dict[str, int]:
        targets = {k: v for k, v in (("prefill", prefill), ("decode", decode),
                                     ("both", both)) if v is not None}
        return ray.get(self.controller.scale.remote(targets), timeout=timeout)

    def status(self, timeout: float = 30.0) -> dict[str, Any]:
        return ray.get(self.controller.status.remote(), timeout=timeout)

    def shutdown(self, timeout: float = 120.0) -> None:
        ray.get(self.controller.shutdown.remote(), timeout=timeout)
        ray.kill(self.controller)


def start(spec: ServeSpec, timeout: float = 300.0) -> tuple[ClusterHandle, dict[str, Any]]:
    """Start the router and pools on the connected Ray cluster."""
    controller = Controller.options(name=CONTROLLER_NAME, namespace=NAMESPACE).remote(spec)
    info = ray.get(controller.start.remote(), timeout=timeout)
    return ClusterHandle(controller), info


def connect() -> ClusterHandle:
    """The kvrelay running on the Ray cluster this driver is connected to."""
    return ClusterHandle(ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE))
