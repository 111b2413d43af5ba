"""What every step of a request's path shares: the workers (the registry), how to choose among
them (the policy), the router's knobs, the metadata each worker call carries, and the tasks
that outlive the request that started them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvrelay.router.errors import RouterError
from kvrelay.router.policy import Policy
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.requests import GenerateSpec, RouterConfig


@dataclass
class Cluster:
    registry: WorkerRegistry
    policy: Policy
    config: RouterConfig
    md: tuple[tuple[str, str], ...] = ()  # the cluster token's metadata
    # Fire-and-forget calls (lease releases): the event loop holds tasks weakly.
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def remaining(self, spec: GenerateSpec, cap: float) -> float:
        """A call's timeout: ``cap``, or less when the request's deadline comes sooner
        (DEADLINE_EXCEEDED once it has passed)."""
        if spec.deadline is None:
            return cap
        left = spec.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded")
        return min(cap, left)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` to its end whatever happens to the request that started it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
