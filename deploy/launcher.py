"""Run kvrelay on Ray: the router and each worker pool as actors, each replica in its own
placement group, pools scaled independently (by hand or by the autoscaler).

kvrelay adds no cluster manager: Ray places the actors (one machine or many, ``ray up`` or
KubeRay); the actors run the same ``Router``/``Worker`` code as the plain processes, and
workers find the router by heartbeat exactly as they do under Kubernetes. The controller and
the router are pinned to the driver's node (where ``kvrelay serve`` runs, and the address it
prints); workers go wherever their placement group fits and advertise their node's IP (or
127.0.0.1 on an embedded loopback-only Ray). Scale-in drains a replica (no new work; requests
in flight finish, or migrate when the drain times out) before its actor and placement group go
away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from kvrelay.deploy.actors import RouterActor, WorkerActor
from kvrelay.deploy.autoscaler import AutoscaleConfig
from kvrelay.deploy.ray_connect import NAMESPACE, worker_env
from kvrelay.deploy.spec import DEFAULT_NAME, PoolSpec, ServeSpec, model_kv_heads, name_flag

if TYPE_CHECKING:  # kvrelay.worker.process loads torch: the router actor's process must not
    from kvrelay.deploy.planner.ray_loop import PlannerSpec

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode", "both")
READY_TIMEOUT_S = 120.0  # started pools -> the router can serve a request


def controller_name(deployment: str = DEFAULT_NAME) -> str:
    return f"{deployment}-controller"


def router_name(deployment: str = DEFAULT_NAME) -> str:
    return f"{deployment}-router"


def replica_actor_name(worker_id: str, deployment: str = DEFAULT_NAME) -> str:
    """A replica's actor and placement group: ``kvrelay-prefill-1`` in the default
    deployment."""
    return f"{deployment}-{worker_id}"


@dataclass
class Replica:
    worker_id: str
    actor: Any
    pg: PlacementGroup
    address: str = ""
    node_id: str = ""
    pid: int = 0
    draining: bool = False


@ray.remote(num_cpus=0)
class Controller:
    """Owns the router and the pools; ``scale`` and the autoscaler go through here."""

    def __init__(self, spec: ServeSpec, node_id: str | None = None):
        self.spec = spec
        self.node_id = node_id  # the driver's node: the router runs there
        tps = {spec.pools.get(p, PoolSpec()).tp for p in ("prefill", "decode")}
        # Head groups pair pools of different TP sizes: only then the checkpoint's heads matter.
        self._kv_heads = model_kv_heads(spec.engine.model.model) if len(tps) > 1 else 0
        self.pools: dict[str, list[Replica]] = {p: [] for p in POOLS}
        self._serial = {p: 0 for p in POOLS}
        self._lock = asyncio.Lock()
        self._autoscale_task: asyncio.Task[None] | None = None
        self._autoscale_cfg: AutoscaleConfig | None = None
        self._autoscale_jobs: dict[str, list[asyncio.Task[None]]] = {p: [] for p in POOLS}
        self._starting = {p: 0 for p in POOLS}  # replicas being added (not in pools yet)
        self._planner_task: asyncio.Task[None] | None = None
        self.decisions: list[dict[str, Any]] = []

    async def start(self) -> dict[str, Any]:
        from kvrelay.common.logs import setup_logging

        setup_logging("controller", self.spec.log_level)
        opts: dict[str, Any] = {"name": router_name(self.spec.name)}
        if self.node_id:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id,
                                                                         soft=False)
        self.router = RouterActor.options(**opts).remote()
        self.router_info = await self.router.start.remote(self.spec.router, self.spec.log_level)
        host = "127.0.0.1" if self.spec.loopback else self.router_info["host"]
        self.control = f"{host}:{self.router_info['control_port']}"
        await self.scale({p: s.replicas for p, s in self.spec.pools.items()})
        if self.spec.autoscale is not None:
            await self.set_autoscale(self.spec.autoscale)
        if self.spec.planner is not None:
            await self.set_planner(self.spec.planner)
        # Ready means a request can be served (the router's health says SERVING): registered
        # workers may still be measured, and a pool of prefill alone serves nothing.
        if not await self.router.wait_serving.remote(READY_TIMEOUT_S):
            raise RuntimeError(f"the router cannot serve requests {READY_TIMEOUT_S:.0f}s after "
                               f"its pools started ({self.counts()}): it needs an aggregated "
                               f"worker or a prefill and a decode worker")
        return {**self.router_info, "host": host, "counts": self.counts()}

    def counts(self) -> dict[str, int]:
        return {p: sum(1 for r in rs if not r.draining) for p, rs in self.pools.items()}

    async def status(self) -> dict[str, Any]:
        cfg = self._autoscale_cfg
        return {"counts": self.counts(), "router": self.router_info,
                "replicas": {p: [{"worker_id": r.worker_id,
                                  "actor": replica_actor_name(r.worker_id, self.spec.name),
                                  "address": r.address, "node_id": r.node_id, "pid": r.pid,
                                  "draining": r.draining} for r in rs]
                             for p, rs in self.pools.items()},
                "workers": await self.router.workers.remote(),
                "autoscale": dataclasses.asdict(cfg) if cfg is not None else None,
                "decisions": [dict(d) for d in self.decisions[-50:]]}

    async def scale(self, targets: dict[str, int]) -> dict[str, int]:
        """Set replica counts per pool (pools not named keep theirs)."""
        bad = [p for p in targets if p not in POOLS or targets[p] < 0]
        if bad:
            raise ValueError(f"unknown pool or negative count: {bad}")
        # Replicas start outside the lock, so a scale-up can raise a pool's count while an
        # earlier one is still starting (a growing backlog needs both); removals choose their
        # victims and drain under it, one at a time, and wait for no start in flight.
        adds = []
        async with self._lock:
            removes = []
            for pool, n in targets.items():
                live = sum(1 for r in self.pools[pool] if not r.draining)
                if n > live + self._starting[pool]:
                    for _ in range(n - live - self._starting[pool]):
                        self._starting[pool] += 1
                        adds.append(asyncio.ensure_future(self._add(pool)))
                elif n < live and not self._starting[pool]:
                    removes.append(self._remove(pool, live - n))
            results = await asyncio.gather(*removes, return_exceptions=True)
        results += await asyncio.gather(*adds, return_exceptions=True)
        logger.info("pools now %s", self.counts())
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return self.counts()

    async def _add(self, pool: str) -> None:
        try:
            await self._start_replica(pool)
        finally:
            self._starting[pool] -= 1

    async def _start_replica(self, pool: str) -> None:
        ps = self.spec.pools.get(pool, PoolSpec())
        self._serial[pool] += 1
        wid = f"{pool}-{self._serial[pool]}"
        pg = placement_group(ps.bundles(), strategy=ps.strategy,
                             name=replica_actor_name(wid, self.spec.name))
        try:
            await asyncio.wait_for(pg.ready(), self.spec.placement_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            remove_placement_group(pg)
            raise RuntimeError(
                f"no room for replica {wid} ({ps.tp} x {ps.bundle()}) within "
                f"{self.spec.placement_timeout_s:.0f}s; available: {ray.available_resources()}"
            ) from None
        settings = replace(
            self.spec.worker, role=pool, routers=(self.control,), worker_id=wid, port=0,
            host="127.0.0.1" if self.spec.loopback else "0.0.0.0",
            # None: the actor fills in its node's IP (it may land on any node)
            advertise_host="127.0.0.1" if self.spec.loopback else None)
        threads = self.spec.engine.model.num_threads or max(1, int(ps.cpus))
        groups = self.spec.kv_head_groups(pool, self._kv_heads)
        engine = replace(self.spec.engine, role=pool,
                         model=replace(self.spec.engine.model, num_threads=threads,
                                       tensor_parallel_size=ps.tp),
                         cache=replace(self.spec.engine.cache, kv_head_groups=groups))
        # The actor's process imports torch before start() runs: what its environment (this
        # node's Ray's) lacks travels in a runtime env (see common/omp_env.py); an embedded Ray
        # has it all (init_ray), so the actor can take an idle, already started Ray worker.
        env_vars = worker_env(os.environ, loopback=self.spec.loopback)
        opts: dict[str, Any] = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
        actor = WorkerActor.options(
            num_cpus=ps.cpus, num_gpus=ps.actor_gpus, resources=ps.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
            name=replica_actor_name(wid, self.spec.name), **opts).remote()
        try:
            info = await actor.start.remote(settings, engine, self.spec.log_level)
            await self._wait_registered(wid, present=True)
        except BaseException:
            ray.kill(actor)
            remove_placement_group(pg)
            raise
        self.pools[pool].append(Replica(wid, actor, pg, info["address"], info["node_id"],
                                        info["pid"]))
        logger.info("replica %s up at %s", wid, info["address"])

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
        try:
            await self._wait_registered(r.worker_id, present=False)
        except TimeoutError as e:
            logger.warning("%s", e)
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

    # -- autoscaling -------------------------------------------------------------------------------
    async def set_autoscale(self, config: AutoscaleConfig | None) -> bool:
        """Turn the autoscaler on (with ``config``, replacing any running one) or off."""
        running = self._autoscale_task is not None
        if self._autoscale_task is not None:
            self._autoscale_task.cancel()
            await asyncio.gather(self._autoscale_task, return_exceptions=True)
            self._autoscale_task = None
        self._autoscale_cfg = config
        if config is None:
            if running:
                logger.info("autoscaler off")
            return False
        logger.info("autoscaler on: %s", config)
        from kvrelay.deploy.autoscale_loop import run_autoscaler

        self._autoscale_task = asyncio.get_running_loop().create_task(
            run_autoscaler(self, config))
        return True

    def cancel_changes(self) -> None:
        """Cancel every pool's change in flight (the autoscaler stopping)."""
        for jobs in self._autoscale_jobs.values():
            for job in jobs:
                job.cancel()

    def change_in_flight(self, pool: str) -> bool:
        jobs = self._autoscale_jobs[pool] = [j for j in self._autoscale_jobs[pool] if not j.done()]
        return bool(jobs)

    def start_change(self, who: str, pool: str, n: int, to: int, reason: str,
                     done: Any = None, extra: dict[str, Any] | None = None) -> None:
        """Run ``apply_change`` as a change of this pool: the only one in flight, or a scale-up
        beyond the one(s) in flight (``to`` counts the starting replicas)."""
        assert not self.change_in_flight(pool) or to > n
        self._autoscale_jobs[pool].append(asyncio.get_running_loop().create_task(
            self.apply_change(who, pool, n, to, reason, done, extra)))

    async def apply_change(self, who: str, pool: str, n: int, to: int, reason: str,
                           done: Any = None, extra: dict[str, Any] | None = None) -> None:
        """One scaling change of a policy (autoscaler or planner): recorded in ``decisions``
        with its reason, applied through ``scale``; ``done(t)`` runs when it has finished
        (the autoscaler's cooldown counts from there), whether it worked or not."""
        rec = {"t": time.time(), "by": who, "pool": pool, "from": n, "to": to,
               "reason": reason, "result": "pending", **(extra or {})}
        self.decisions.append(rec)
        del self.decisions[:-200]
        logger.info("%s %s: %d -> %d: %s", who, pool, n, to, reason)
        try:
            got = await self.scale({pool: to})
            rec["result"] = "done"
            rec["seconds"] = round(time.time() - rec["t"], 2)  # a replica's start-up or drain
            logger.info("%s %s: now %d replicas", who, pool, got[pool])
        except Exception as e:
            rec["result"] = f"failed: {e!r}"
            logger.exception("%s %s: %d -> %d failed", who, pool, n, to)
        finally:
            if done is not None:
                done(time.monotonic())

    # -- SLO planner ------------------------------------------------------------------------------
    async def set_planner(self, spec: PlannerSpec | None) -> bool:
        """Turn the SLO planner on (replacing any running one, and the autoscaler) or off."""
        if self._planner_task is not None:
            self._planner_task.cancel()
            await asyncio.gather(self._planner_task, return_exceptions=True)
            self._planner_task = None
        if spec is None:
            return False
        await self.set_autoscale(None)
        from kvrelay.deploy.planner.ray_loop import run_planner

        logger.info("planner on: %s", spec.config)
        self._planner_task = asyncio.get_running_loop().create_task(run_planner(self, spec))
        return True

    async def shutdown(self) -> None:
        await self.set_planner(None)
        await self.set_autoscale(None)
        async with self._lock:
            replicas = [r for rs in self.pools.values() for r in rs]

            async def stop(r: Replica) -> None:
                try:
                    await asyncio.wait_for(r.actor.stop.remote(), 10)
                except Exception as e:
                    logger.warning("stopping %s: %r", r.worker_id, e)
                ray.kill(r.actor)
                remove_placement_group(r.pg)
            await asyncio.gather(*(stop(r) for r in replicas))
            for pool in self.pools:
                self.pools[pool] = []
            try:
                await asyncio.wait_for(self.router.stop.remote(), 10)
            except Exception as e:
                logger.warning("stopping the router: %r", e)
            finally:
                ray.kill(self.router)


class ClusterHandle:
    """Python API over a running kvrelay on Ray (``connect`` or ``start``)."""

    def __init__(self, controller: Any):
        self.controller = controller

    def scale(self, *, prefill: int | None = None, decode: int | None = None,
              both: int | None = None, timeout: float = 900.0) -> dict[str, int]:
        targets = {k: v for k, v in (("prefill", prefill), ("decode", decode),
                                     ("both", both)) if v is not None}
        return ray.get(self.controller.scale.remote(targets), timeout=timeout)

    def status(self, timeout: float = 30.0) -> dict[str, Any]:
        return ray.get(self.controller.status.remote(), timeout=timeout)

    def autoscale(self, config: AutoscaleConfig | None, timeout: float = 30.0) -> bool:
        """Turn the autoscaler on with ``config`` (replacing the running one) or off (None)."""
        return ray.get(self.controller.set_autoscale.remote(config), timeout=timeout)

    def planner(self, spec: PlannerSpec | None, timeout: float = 30.0) -> bool:
        """Turn the SLO planner on with ``spec`` (replacing the running policy) or off (None)."""
        return ray.get(self.controller.set_planner.remote(spec), timeout=timeout)

    def shutdown(self, timeout: float = 120.0) -> None:
        try:
            ray.get(self.controller.shutdown.remote(), timeout=timeout)
        finally:
            ray.kill(self.controller)


def start(spec: ServeSpec, timeout: float = 900.0) -> tuple[ClusterHandle, dict[str, Any]]:
    """Start the router and pools on the connected Ray cluster; the controller and the router
    run on this driver's node. One deployment of each name (``spec.name``) per cluster."""
    try:
        ray.get_actor(controller_name(spec.name), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RuntimeError(f"kvrelay deployment {spec.name!r} is already running on this Ray "
                           f"cluster (`kvrelay status{name_flag(spec.name)}`; another "
                           f"deployment takes another --name)")
    node_id = ray.get_runtime_context().get_node_id()
    controller = Controller.options(
        name=controller_name(spec.name), namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(spec, node_id)
    handle = ClusterHandle(controller)
    try:
        info = ray.get(controller.start.remote(), timeout=timeout)
    except BaseException:
        try:
            handle.shutdown(timeout=60)
        except Exception as e:
            logger.warning("cleaning up after a failed start: %r", e)
        raise
    return handle, info


def connect(name: str = DEFAULT_NAME) -> ClusterHandle:
    """The kvrelay deployment ``name`` running on the Ray cluster this driver is connected
    to."""
    try:
        return ClusterHandle(ray.get_actor(controller_name(name), namespace=NAMESPACE))
    except ValueError:
        running = deployments()
        hint = (f"running here: {', '.join(running)} (pick one with --name)" if running
                else "start one with `kvrelay serve`")
        raise RuntimeError(f"no kvrelay deployment {name!r} is running on this Ray cluster; "
                           f"{hint}") from None


def deployments() -> list[str]:
    """The names of the kvrelay deployments running on the connected Ray cluster."""
    suffix = controller_name("")
    return sorted(n[:-len(suffix)] for n in ray.util.list_named_actors()
                  if n.endswith(suffix) and len(n) > len(suffix))
