"""What ``kvrelay serve`` launches on Ray: the router's settings, the worker and engine templates,
and each pool's replicas and per-replica resources (one bundle per tensor-parallel rank)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.deploy.autoscaler import AutoscaleConfig
from kvrelay.engine.config import EngineConfig
from kvrelay.router.server import RouterSettings
from kvrelay.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from kvrelay.deploy.planner.ray_loop import PlannerSpec

logger = logging.getLogger(__name__)


def model_kv_heads(model_dir: str) -> int:
    """The checkpoint's KV heads (0 where this node cannot read its config)."""
    from kvrelay.engine.models.arch import load_model_config

    try:
        return load_model_config(model_dir)[1].num_kv_heads
    except (OSError, ValueError, KeyError) as e:
        logger.warning("KV head groups left off: cannot read %s (%s)", model_dir, e)
        return 0


@dataclass(frozen=True)
class PoolSpec:
    replicas: int = 0
    cpus: float = 1.0  # per replica; also the worker's torch threads on CPU
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources
    # Tensor-parallel ranks per replica (cpus/gpus/resources are per rank), packed onto one
    # node. The worker actor spawns ranks 1..N-1 itself, as its children: on CPUs it takes bundle
    # 0 of one per rank and theirs keep Ray from placing anything else on those cores; with
    # GPUs the replica is one bundle of every rank's, all of whose GPUs the actor asks for, since
    # Ray shows an actor (and so its children) only the GPUs it was given: rank r is cuda:r
    # among them.
    tp: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.cpus < 0 or self.gpus < 0:
            raise ValueError("replicas, cpus and gpus must be non-negative")
        if self.tp < 1:
            raise ValueError(f"tp must be positive, got {self.tp}")

    def bundles(self) -> list[dict[str, float]]:
        if self.gpus and self.tp > 1:
            return [{k: v * self.tp for k, v in self.bundle().items()}]
        return [self.bundle()] * self.tp

    @property
    def actor_gpus(self) -> float:
        """The GPUs the worker actor asks for: every rank's (its ranks are its children)."""
        return self.gpus * self.tp

    @property
    def strategy(self) -> str:
        return "STRICT_PACK" if self.tp > 1 else "PACK"

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus, **self.resources}
        if self.gpus:
            b["GPU"] = self.gpus
        return {k: v for k, v in b.items() if v}


DEFAULT_NAME = "kvrelay"
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")


def check_name(name: str) -> str:
    """A deployment name: lowercase letters, digits and inner dashes, at most 40 (it prefixes
    Ray actor and placement-group names)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"deployment name {name!r}: use lowercase letters, digits and inner "
                         f"dashes, at most 40 characters")
    return name


def name_flag(name: str) -> str:
    """`` --name NAME`` for a command naming deployment ``name``; nothing for the default."""
    return "" if name == DEFAULT_NAME else f" --name {name}"


@dataclass(frozen=True)
class ServeSpec:
    router: RouterSettings
    worker: WorkerSettings  # template: role, routers and ids are filled in per replica
    engine: EngineConfig  # template: role is filled in per pool
    pools: dict[str, PoolSpec]
    loopback: bool = True  # embedded local Ray: bind everything to 127.0.0.1
    autoscale: AutoscaleConfig | None = None
    planner: PlannerSpec | None = None  # the SLO planner (exclusive with autoscale)
    log_level: str = "INFO"
    # How long a new replica may wait for its placement group (on KubeRay: for a node to be
    # added) before the scale-up fails.
    placement_timeout_s: float = 600.0
    # The deployment's name on its Ray cluster: its controller, router, replicas and their
    # placement groups are named after it, so several (one per model, say) share one cluster.
    name: str = DEFAULT_NAME

    def __post_init__(self) -> None:
        check_name(self.name)

    def kv_head_groups(self, pool: str, kv_heads: int) -> int:
        """The KV head groups of ``pool``'s engines (see engine/kv_cache.py), where its TP size
        is at most the other prefill/decode pool's: the engine template's setting, or else,
        when the other's TP size is N times this one's, N if it divides the KV heads each of
        this pool's ranks holds (``kv_heads``: the model's; 0: unknown), so that KV moves
        between the pools rank to rank. 1 (none) anywhere else, and where the KV is stored heads
        first (``--kv-layout``: by default on GPUs), which moves any split as a run of heads per
        block already (groups would only cost the GPU its CUDA graphs)."""
        if pool not in ("prefill", "decode"):
            return 1
        ps = self.pools.get(pool, PoolSpec())
        layout = self.engine.cache.kv_layout
        gpu = ps.gpus > 0 or str(self.engine.model.device).startswith("cuda")
        if layout == "heads" or (layout == "auto" and gpu):
            return 1
        own = ps.tp
        other = self.pools.get("decode" if pool == "prefill" else "prefill", PoolSpec()).tp
        if own > other:
            return 1
        if self.engine.cache.kv_head_groups > 1:
            return self.engine.cache.kv_head_groups
        n = other // own
        fits = other % own == 0 and kv_heads >= own and (kv_heads // own) % n == 0
        return n if n > 1 and fits else 1
