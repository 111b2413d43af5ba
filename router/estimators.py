"""Online estimators of how fast workers and the cluster are, from measured samples: what the
routing cost model (``policy.py``) predicts with. Pure arithmetic, no I/O.

Step time is not fitted here: each worker's engine fits its own (``engine/step_cost_fit.py``)
and reports it in its heartbeats (``WorkerPerf.step_cost``). What only the router sees is
fitted here: KV transfer time against bytes, RPC round trips, arrival rates."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from kvrelay.engine.step_cost_fit import StepCostFit
from kvrelay.engine.tiers.media import DEFAULT_TIER_WEIGHTS, DEVICE


class LinearFit:
    """``y ~ a + b*x`` by exponentially weighted least squares, from measured samples.

    It starts from a prior given as two weak pseudo-samples (at ``x = 0`` and ``x = x_ref``) that
    stand in only until measurements arrive: every sample multiplies all earlier weight by
    ``decay`` (the prior's too) and weighs ``1 / prior_weight`` times as much as the prior. With
    samples at one ``x`` only, the slope still leans on the prior; the warm-up probe measures two
    sizes. ``a`` and ``b`` are kept non-negative (times never shrink with size).
    """

    __slots__ = ("decay", "n", "sw", "sx", "sxx", "sxy", "sy")

    def __init__(self, a: float, b: float, x_ref: float, *, decay: float = 0.97,
                 prior_weight: float = 1e-3):
        self.decay = decay
        self.n = 0  # measured samples
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._add(0.0, a, prior_weight)
        self._add(x_ref, a + b * x_ref, prior_weight)

    def _add(self, x: float, y: float, w: float) -> None:
        self.sw += w
        self.sx += w * x
        self.sy += w * y
        self.sxx += w * x * x
        self.sxy += w * x * y

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0.0 or y < 0.0:
            return
        d = self.decay
        self.sw *= d
        self.sx *= d
        self.sy *= d
        self.sxx *= d
        self.sxy *= d
        self._add(x, y, 1.0)
        self.n += 1

    def coef(self) -> tuple[float, float]:
        """(a, b): intercept and slope."""
        mx, my = self.sx / self.sw, self.sy / self.sw
        vxx = self.sxx / self.sw - mx * mx
        b = (self.sxy / self.sw - mx * my) / vxx if vxx > 1e-12 * (1.0 + mx * mx) else 0.0
        b = max(b, 0.0)
        a = my - b * mx
        if a < 0.0:  # noise would make small sizes free: through the origin instead
            a, b = 0.0, (self.sxy / self.sxx if self.sxx > 0 else b)
        return a, max(b, 0.0)

    def predict(self, x: float) -> float:
        a, b = self.coef()
        return a + b * max(x, 0.0)

    @property
    def slope(self) -> float:
        return self.coef()[1]


class Ewma:
    """Exponentially weighted mean of measured samples, from a prior until the first one."""

    __slots__ = ("decay", "n", "value")

    def __init__(self, prior: float, decay: float = 0.9):
        self.value = prior
        self.decay = decay
        self.n = 0

    def observe(self, y: float) -> None:
        if not math.isfinite(y) or y < 0.0:
            return
        self.value = y if self.n == 0 else self.decay * self.value + (1 - self.decay) * y
        self.n += 1


class RateMeter:
    """Events per second: the inverse of an exponentially weighted mean gap between events,
    where the open gap since the last event counts once it is the longer (rates decay when
    events stop)."""

    __slots__ = ("decay", "gap", "last")

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.gap: float | None = None
        self.last: float | None = None

    def tick(self, now: float) -> None:
        if self.last is not None:
            g = max(0.0, now - self.last)
            self.gap = g if self.gap is None else self.decay * self.gap + (1 - self.decay) * g
        self.last = now

    def rate(self, now: float) -> float:
        if self.gap is None or self.last is None:
            return 0.0
        g = max(self.gap, now - self.last)
        return 1.0 / g if g > 0 else 0.0


# Priors, used only until a worker's engine reports its own step-time fit (the warm-up probe of
# the `auto` policy makes it measure itself before it takes traffic): roughly a small model on
# a CPU core.
PRIOR_STEP_S = 0.005  # fixed cost of an engine step
PRIOR_TOKEN_S = 0.0005  # per prompt token prefilled, per sequence decoded
PRIOR_RPC_S = 0.001  # one router -> worker round trip
PRIOR_BYTES_PER_S = 1e9  # KV transfer bandwidth
PRIOR_STEP_COST = StepCostFit(base=PRIOR_STEP_S, prefill_token=PRIOR_TOKEN_S, attended_pair=0.0,
                              decode=PRIOR_TOKEN_S, decode_ctx_token=0.0, samples=0)
PRIOR_STEP_TOKENS = 2048  # the engine's default prefill token budget of a step
# A prefix pull (``prefix_pull``) until prefill workers report measured ones: conservative, so
# that only long prefixes are pulled before anything was measured. Fixed: ExportPrefix and
# EndExport round trips, two engine calls on each side, a NIXL connection on first use.
PRIOR_PULL_S = 0.01
PRIOR_PULL_BYTES_PER_S = 5e8


class ClusterPerf:
    """Measured costs that belong to no single worker."""

    def __init__(self) -> None:
        # Prefill RPC wall time not spent computing or transferring on an otherwise idle
        # worker (the hand-off to its engine included).
        self.prefill_rpc_s = Ewma(PRIOR_RPC_S)
        # KV delivery after the last prefill compute (PrefillResponse.transfer_ms) vs MiB sent.
        self.transfer = LinearFit(PRIOR_RPC_S, 2.0**20 / PRIOR_BYTES_PER_S, 1.0)
        self.block_bytes: float | None = None  # KV bytes of one block (kv_bytes / blocks sent)
        # A prefix pull's time (PullResult.pull_ms: export, read, end, publish) vs MiB read.
        self.pull = LinearFit(PRIOR_PULL_S, 2.0**20 / PRIOR_PULL_BYTES_PER_S, 1.0)
        # The prefix length (tokens) above which a pull beats recomputing, as last predicted
        # (``prefix_pull.crossover_tokens``); None: not yet, or never.
        self.pull_crossover_tokens: int | None = None

    def transfer_s(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        return self.transfer.predict(blocks * (self.block_bytes or 0.0) / 2.0**20)

    def observe_transfer(self, kv_bytes: int, blocks: int, seconds: float) -> None:
        if kv_bytes <= 0 or blocks <= 0:
            return
        self.block_bytes = kv_bytes / blocks
        self.transfer.observe(kv_bytes / 2.0**20, seconds)

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0:
            self.pull.observe(nbytes / 2.0**20, seconds)


@dataclass
class WorkerPerf:
    """How fast one worker is: the cost model's per-worker parameters.

    ``step_cost``: its engine's own fit of step time (``engine/step_cost_fit.py``), as its
    latest beat that had one reported it, and ``step_tokens`` the engine's prefill tokens per
    step; None until then. The cost model (``policy.CostModel``) predicts a prompt's compute
    with the prefill pool's most measured fit and a decode step with the decode pool's: the
    engine fits step time, the router does not fit its own.
    ``reserve_rpc_s``: a Reserve round trip. ``arrivals``: requests routed to it per second.
    """

    step_cost: StepCostFit | None = None
    step_tokens: int = PRIOR_STEP_TOKENS
    reserve_rpc_s: Ewma = field(default_factory=lambda: Ewma(PRIOR_RPC_S))
    arrivals: RateMeter = field(default_factory=RateMeter)
    # Set by the beat that reports ``step_cost`` (the registry runs on the router's loop):
    # calibration waits on it instead of polling.
    fit_reported: asyncio.Event = field(default_factory=asyncio.Event)

    def report_fit(self, fit: StepCostFit, step_tokens: int) -> None:
        self.step_cost, self.step_tokens = fit, step_tokens
        self.fit_reported.set()


def tier_weights(load_s_per_block: dict[str, float], fit: StepCostFit | None,
                 block_size: int) -> dict[str, float]:
    """What a prefix block held in each tier is worth to the router, as a fraction of one held
    in the KV pool (1.0: as good; 0: as good as absent): the engine's defaults
    (``DEFAULT_TIER_WEIGHTS``) until the worker has measured a tier's loads
    (``load_s_per_block``: its mean seconds to promote one block, 0 until a first load) and
    reported its step-time fit; then ``1 - load / compute`` of one block, ``compute`` being the
    fit's prefill cost of a block's tokens, clamped to [0, 1]. A block as slow to load as to
    recompute is worth nothing; the pool's own weight stays 1."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    compute = fit.prefill_token * block_size if fit is not None else 0.0
    for medium, load in load_s_per_block.items():
        if medium == DEVICE:
            continue
        if compute > 0.0 and load > 0.0 and math.isfinite(load):
            weights[medium] = min(1.0, max(0.0, 1.0 - load / compute))
        else:
            weights.setdefault(medium, 0.0)
    return weights
