"""Pull instead of recompute, the router's side: whether a Prefill first reads the prompt's
prefix from another worker that holds more of it (``PullHint``), and what a pull costs.

A source is any other usable prefill or decode worker whose beats (or this router's own
expectations) say it holds more leading blocks of the prompt than the chosen prefill worker
(``pull_sources.best_source``). The routing cost model counts the same pull when it chooses the
prefill worker (``CostModel.prefill``): a worker that could pull a prefix is priced as if it
did, where that is cheaper than its recompute.

``--prefix-pull auto`` pulls when the predicted pull time of the blocks the prefill worker lacks
is below the predicted recompute time of their tokens; ``always`` whenever a source holds more
(tests, and measuring the crossover); ``off`` never. Recompute time comes from the prefill
pool's step-time fit (``CostModel``), pull time from ``ClusterPerf.pull``: a linear fit of the
pull times prefill workers report (``PullResult``) against the bytes read, starting from a
conservative prior (``estimators.PRIOR_PULL_*``). From the two follows the *crossover*: the
prefix length above which a pull beats recomputing it, logged whenever it moves by more than
``CROSSOVER_LOG_CHANGE`` and exported (``kvrelay:router_pull_crossover_tokens``).

A pull's budget (``PullHint.timeout_ms``) is what recomputing those tokens would take (at
least twice the predicted pull, within [``MIN_PULL_TIMEOUT_S``, ``MAX_PULL_TIMEOUT_S``]): a
pull that fails or runs out of it costs at most that before the worker recomputes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.estimators import ClusterPerf
from kvrelay.router.policy import CostModel, RouteRequest
from kvrelay.router.pull_sources import best_source, pull_seconds
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.worker_state import WorkerState

logger = logging.getLogger(__name__)

PULL_MODES = ("off", "auto", "always")
MIN_PULL_TIMEOUT_S = 0.2
MAX_PULL_TIMEOUT_S = 10.0
CROSSOVER_LOG_CHANGE = 0.2  # log the crossover again once it moved by this fraction
MAX_CROSSOVER_TOKENS = 1 << 20


@dataclass(frozen=True)
class PullPlan:
    """A pull decided for one Prefill on ``worker``."""

    source: WorkerState
    source_blocks: int  # leading prompt blocks the source holds
    own_blocks: int  # of those, the prefill worker holds already
    block_size: int
    pull_s: float | None  # predicted (None: no measure of a block's bytes yet)
    recompute_s: float  # predicted compute of the blocks it would pull

    @property
    def tokens(self) -> int:
        """Prompt tokens the pull saves computing."""
        return (self.source_blocks - self.own_blocks) * self.block_size

    @property
    def source_pool(self) -> str:
        return self.source.identity.role

    def hint(self) -> wpb.PullHint:
        budget = max(self.recompute_s, 2.0 * (self.pull_s or 0.0))
        budget = min(MAX_PULL_TIMEOUT_S, max(MIN_PULL_TIMEOUT_S, budget))
        ident = self.source.identity
        return wpb.PullHint(source_address=ident.address, source_agent=ident.worker_id,
                            prefix_tokens=self.source_blocks * self.block_size,
                            timeout_ms=int(budget * 1e3))


def recompute_seconds(fit: StepCostFit, step_tokens: int, prompt: int, have: int,
                      would_have: int) -> float:
    """What computing a prompt of ``prompt`` tokens holding ``have`` cached costs more than
    holding ``would_have``."""
    return max(0.0, fit.prompt_seconds(prompt - have, step_tokens, context=have)
               - fit.prompt_seconds(prompt - would_have, step_tokens, context=would_have))


def crossover_tokens(perf: ClusterPerf, fit: StepCostFit, step_tokens: int,
                     block_size: int) -> int | None:
    """The shortest prefix (whole blocks) that a pull brings in faster than computing it from
    nothing; None when no pull is predicted faster up to ``MAX_CROSSOVER_TOKENS`` (or a
    block's bytes are unknown yet)."""
    if not perf.block_bytes:
        return None

    def wins(blocks: int) -> bool:
        n = blocks * block_size
        pull = pull_seconds(perf, blocks)
        return pull is not None and pull < fit.prompt_compute_seconds(n, step_tokens)

    hi = 1
    while not wins(hi):
        hi *= 2
        if hi * block_size > MAX_CROSSOVER_TOKENS:
            return None
    lo = hi // 2  # loses (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if wins(mid):
            hi = mid
        else:
            lo = mid
    return hi * block_size


class PrefixPulls:
    def __init__(self, registry: WorkerRegistry, cost: CostModel, mode: str = "off") -> None:
        if mode not in PULL_MODES:
            raise ValueError(f"prefix pull mode must be one of {PULL_MODES}, got {mode!r}")
        self.registry = registry
        self.cost = cost
        self.mode = cost.pull_mode = mode  # the cost model prices prefill workers by it too
        self.counters = registry.pulls
        self._logged: int | None = None
        self._crossover_of: tuple[object, ...] = ()  # what it was computed from

    def plan(self, p: WorkerState, req: RouteRequest, now: float | None = None, *,
             count: bool = True) -> PullPlan | None:
        """The pull ``p``'s Prefill of ``req`` should start with, or None. Counted (``count``)
        where another worker held more: as a pull or as a recompute decision."""
        if self.mode == "off":
            return None
        now = time.monotonic() if now is None else now
        bs = p.identity.block_size
        hashes = req.hashes(bs)[:(len(req) - 1) // bs]  # the engine computes the last token
        own = p.cached_prefix(hashes, now).blocks
        best = best_source(self.registry, p, hashes, own, now)
        if best is None:
            return None
        n, src = best
        fit = self.cost.prompt_fit(now)
        plan = PullPlan(src, n, own, bs, pull_seconds(self.registry.perf, n - own),
                        recompute_seconds(fit, p.perf.step_tokens, len(req), own * bs, n * bs))
        self._note_crossover(fit, p.perf.step_tokens, bs)
        pull = self.mode == "always" or (plan.pull_s is not None
                                         and plan.pull_s < plan.recompute_s)
        if count:
            self.counters.decided("pull" if pull else "recompute", plan.source_pool)
        return plan if pull else None

    def observe(self, p: WorkerState, result: wpb.PullResult, *, record: bool = True) -> None:
        """``p`` answered a Prefill that carried a pull hint: count how its pull went and
        (``record``) fit the pull time from it."""
        c = self.counters
        name = wpb.PullOutcome.Name(result.outcome)
        c.outcomes[name] = c.outcomes.get(name, 0) + 1
        if result.outcome != wpb.PULL_DONE:
            logger.info("%s's pull fell back to recompute: %s", p.worker_id, name)
            return
        c.pulled_tokens += result.pulled_tokens
        c.pulled_bytes += result.bytes_read
        if record and result.blocks_read and result.bytes_read:
            perf = self.registry.perf
            perf.block_bytes = perf.block_bytes or result.bytes_read / result.blocks_read
            perf.observe_pull(result.bytes_read, result.pull_ms / 1e3)

    def _note_crossover(self, fit: StepCostFit, step_tokens: int, block_size: int) -> None:
        perf = self.registry.perf
        key = (fit, step_tokens, block_size, perf.pull.n, perf.block_bytes)
        if key == self._crossover_of:
            return
        self._crossover_of = key
        n = perf.pull_crossover_tokens = crossover_tokens(perf, fit, step_tokens, block_size)
        last = self._logged
        if n is None or (last is not None and abs(n - last) <= CROSSOVER_LOG_CHANGE * last):
            return
        self._logged = n
        a, b = self.registry.perf.pull.coef()
        logger.info("prefix pull crossover: pulling beats recomputing above %d prompt tokens "
                    "(pull %.2f ms + %.3f ms/MiB from %d measured pulls; prefill %.1f us/token)",
                    n, a * 1e3, b * 1e3, self.registry.perf.pull.n, fit.prefill_token * 1e6)
