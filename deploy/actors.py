"""The Ray actors that host kvrelay's processes: the router and one worker replica each run
the same ``Router``/``Worker`` code as the plain processes, inside an actor's event loop. The
controller (:mod:`kvrelay.deploy.launcher`) starts, drains and stops them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import ray

from kvrelay.engine.config import EngineConfig
from kvrelay.router.registry import tier_usage
from kvrelay.router.server import RouterSettings
from kvrelay.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

@ray.remote(num_cpus=0)
class RouterActor:
    async def start(self, settings: RouterSettings, log_level: str) -> dict[str, Any]:
        from kvrelay.common.gc_tuning import settle_after_startup
        from kvrelay.common.logs import setup_logging
        from kvrelay.common.torch_free import forbid_torch, torch_loaded
        from kvrelay.router.server import Router

        setup_logging("router", log_level)
        # This actor has its own process; keep transformers from loading torch into it.
        if torch_loaded():
            logger.warning("torch is already loaded in the router actor's process")
        else:
            forbid_torch()
        self.router = Router(settings)
        await self.router.start()
        settle_after_startup()
        return {"port": self.router.port, "control_port": self.router.control_port,
                "http_port": self.router.http_port, "host": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "torch": torch_loaded()}

    async def workers(self) -> list[dict[str, Any]]:
        out = []
        for w in self.router.registry.workers.values():
            ld = w.reported.load
            out.append({"worker_id": w.worker_id, "role": w.identity.role,
                        "address": w.identity.address,
                        "draining": ld.draining, "queued_prompt_tokens": ld.queued_prompt_tokens,
                        "kv_usage": 1 - ld.free_blocks / ld.num_blocks if ld.num_blocks else 0,
                        "running": ld.running + ld.waiting_for_kv + ld.waiting,
                        "free_blocks": ld.free_blocks, "num_blocks": ld.num_blocks,
                        "tiers": tier_usage(ld)})
        return out

    async def wait_serving(self, timeout_s: float) -> bool:
        return await self.router.wait_serving(timeout_s)

    async def recent_latency(self, window_s: float) -> dict[str, float | None]:
        ttft, itl = self.router.service.recent_latency(window_s)
        return {"ttft_ms": ttft, "itl_ms": itl}

    async def metrics_text(self) -> str:
        return self.router.metrics.render().decode()

    async def planner_report(self, decision: Any, current: dict[str, int]) -> None:
        """Export a planner decision on the router's /metrics (created on first use)."""
        if not hasattr(self, "planner_metrics"):
            from kvrelay.deploy.planner.metrics import PlannerMetrics

            self.planner_metrics = PlannerMetrics(self.router.metrics.registry)
        self.planner_metrics.record(decision, current)

    async def stop(self) -> None:
        await self.router.stop()


@ray.remote(num_cpus=0)
class WorkerActor:
    async def start(self, settings: WorkerSettings, engine: EngineConfig,
                    log_level: str) -> dict[str, Any]:
        from kvrelay.common.gc_tuning import settle_after_startup
        from kvrelay.common.logs import setup_logging
        from kvrelay.worker.process import Worker

        setup_logging(f"{settings.role}-worker", log_level)
        if settings.advertise_host is None:
            # Joined to a cluster: the router (on another node, maybe) dials this node's IP.
            settings = replace(settings, advertise_host=ray.util.get_node_ip_address())
        self.worker = Worker(settings, engine)
        await self.worker.start()
        settle_after_startup()
        return {"worker_id": self.worker.worker_id, "port": self.worker.port,
                "address": self.worker.info.address, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    async def drain(self, timeout_s: float) -> None:
        await self.worker.drain(timeout_s)

    async def stop(self) -> None:
        await self.worker.stop()
