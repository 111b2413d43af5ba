"""Routing policies: which decode worker reserves, which prefill worker computes.

A policy ranks candidates best first; the request lifecycle tries them in order (a worker that
refuses or fails is followed by the next).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvrelay.router.registry import WorkerState


class Policy(ABC):
    name: str

    @abstractmethod
    def rank_decode(self, workers: Sequence[WorkerState], blocks_needed: int,
                    prompt: Sequence[int]) -> list[WorkerState]: ...

    @abstractmethod
    def rank_prefill(self, workers: Sequence[WorkerState],
                     prompt: Sequence[int]) -> list[WorkerState]: ...


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._d = itertools.count()
        self._p = itertools.count()

    @staticmethod
    def _rotate(workers: Sequence[WorkerState], n: int) -> list[WorkerState]:
        ws = sorted(workers, key=lambda w: w.worker_id)
        if not ws:
            return []
        k = n % len(ws)
        return ws[k:] + ws[:k]

    def rank_decode(self, workers: Sequence[WorkerState], blocks_needed: int,
                    prompt: Sequence[int]) -> list[WorkerState]:
        return self._rotate(workers, next(self._d))

    def rank_prefill(self, workers: Sequence[WorkerState],
                     prompt: Sequence[int]) -> list[WorkerState]:
        return self._rotate(workers, next(self._p))


class LeastLoaded(Policy):
    """Decode: most KV headroom among those that fit, fewest running. Prefill: fewest queued
    prompt tokens."""

    name = "least_loaded"

    def rank_decode(self, workers: Sequence[WorkerState], blocks_needed: int,
                    prompt: Sequence[int]) -> list[WorkerState]:
        fits = [w for w in workers if w.free_blocks_estimate >= blocks_needed]
        rest = [w for w in workers if w.free_blocks_estimate < blocks_needed]

        def key(w: WorkerState) -> tuple[int, int]:
            batch = w.load.running + w.load.waiting_for_kv + w.inflight
            return (batch, -w.free_blocks_estimate)

        return sorted(fits, key=key) + sorted(rest, key=lambda w: -w.free_blocks_estimate)

    def rank_prefill(self, workers: Sequence[WorkerState],
                     prompt: Sequence[int]) -> list[WorkerState]:
        return sorted(workers, key=lambda w: (w.queued_tokens_estimate, w.inflight))


POLICIES: dict[str, type[Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of "
                         f"{', '.join(sorted(POLICIES))}") from None
