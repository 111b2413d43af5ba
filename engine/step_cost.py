"""An online model of how long a step takes, and the prefill budget that keeps a TPOT target.

Sarathi-Serve's point: a step that carries decodes must not take longer than the decodes' time
per output token (TPOT) allows, so the prefill tokens riding along with them have to be capped;
a fixed token budget is either too small (idle compute, slow prefills) or too large (every
decode in the step misses its TPOT). The right cap depends on the machine, the model, the batch
and the contexts, so the engine learns it: each step's duration is fitted online against what
the step did,

    t = base + per_prefill_token * P + per_attended_pair * A + per_decode * D + per_ctx * K
          + per_chunk * C

with P prefill tokens, A (query, key) pairs those tokens attend over, D decodes, K keys the
decodes attend over and C prefill chunks. A chunk has a cost of its own, whatever its length:
its attention call over its context, and past the fused layers' rows the per-op path (served
on the ~7M model, ~2.5 ms a step before steps with small chunks were fused, ~1.3 ms after,
against ~0.06 ms a prefill token; a model without this term under-predicted every step that
mixed a small chunk with decodes). The fit is least squares over the last ``window`` steps
(refit every few steps; it is a few microseconds of numpy), with a small ridge so that a window
with no prefill (or no decodes) leaves that coefficient near its last value instead of wild.

:meth:`StepCostModel.prefill_budget` then answers: with these decodes in the step, how many
prefill tokens keep the predicted step time within what the target allows? That count is a fresh
prompt's, whose tokens attend over their own chunk only; the scheduler then holds each chunk to
the time left (:meth:`StepCostModel.prefill_room`, :meth:`StepCostModel.chunk_tokens`) at its
own context, so a chunk deep into a long prompt, whose every token attends over the whole
prefix, is cut shorter than a fresh prompt's. TPOT is a mean over a request's tokens, so a step
may run past the target by the slack that the steps before it left under it (a batch of five
decodes stepping in 20 ms against a 150 ms target banks 130 ms a step, which a prefill chunk may
then spend). The slack is kept over about ``slack_steps`` steps' worth of target: enough to let
whole prompts through between decodes at light load, never so much that one step stalls the
batch for long. Capping each step at the target alone (Sarathi-Serve's fixed chunk) starves
prefills at moderate load, where most steps run far under it: measured on the ~150M model at 1.5
req/s, TTFT grew without bound. Where the tail of the inter-token latency matters too, an ITL
cap bounds every step with decodes (no slack): that is Sarathi-Serve's own cap, and with both
set a step takes the smaller room. The cap trades prefill speed for the tail, so it yields
when the queue backs up: in a step whose oldest queued prompt has waited ``itl_cap_max_queue_s``
or more, only the TPOT target (if any) limits the step, and the queue drains at full speed.
Without that, a cap that holds the ITL tail at light load also caps prefill throughput under
load (measured on the ~7M model with a 5 ms cap: goodput 18 req/s against 39 uncapped). Until
the model has seen enough steps, and when no target is set, the configured token budget
applies.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np

from kvrelay.engine.step_cost_fit import FEATURES, StepCostFit, StepShape

logger = logging.getLogger(__name__)

__all__ = ["FEATURES", "StepCostFit", "StepCostModel", "StepShape"]  # the fit's types too


class StepCostModel:
    """Fits step time online and turns a TPOT target (and an ITL cap) into a per-step prefill
    budget."""

    def __init__(self, tpot_slo_s: float | None, max_tokens: int, *,
                 itl_cap_s: float | None = None, itl_cap_max_queue_s: float | None = None,
                 window: int = 256, min_samples: int = 16, refit_every: int = 8,
                 headroom: float = 0.9, min_prefill_tokens: int = 16, slack_steps: float = 4.0):
        self.tpot_slo_s = tpot_slo_s
        self.itl_cap_s = itl_cap_s
        self.itl_cap_max_queue_s = itl_cap_max_queue_s  # None: the cap never yields
        self.max_tokens = max_tokens
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        # Aim below the target: the fit is a mean, steps vary, and the client sees more than
        # the step (streaming, its own scheduling).
        self.headroom = headroom
        self.min_prefill_tokens = min_prefill_tokens  # prefills always make some progress
        self.slack_steps = slack_steps
        self.slack_s = 0.0  # time the recent steps with decodes left under the target
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.fit: StepCostFit | None = None
        self.last_budget: int = max_tokens
        self.num_capped_steps = 0
        self.num_cap_yields = 0  # steps with decodes in which the ITL cap yielded to the queue

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.prefill_tokens == 0 and shape.decodes == 0:
            return
        if self.tpot_slo_s is not None and shape.decodes:
            # Banked against the aim, not the target: against the target, a loaded engine
            # spends every bit of slack and its steps average the target itself, so half the
            # requests miss it (measured served: TPOT p50 51.4 ms against a 50 ms target).
            cap = self.slack_steps * self.tpot_slo_s
            aim = self.headroom * self.tpot_slo_s
            self.slack_s = max(-cap, min(cap, self.slack_s + aim - seconds))
        self._x.append(shape.features())
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) >= self.min_samples and (self.fit is None
                                                 or self._since_fit >= self.refit_every):
            self._refit()

    def _refit(self) -> None:
        x = np.array(self._x, dtype=np.float64)
        y = np.asarray(self._y)
        # Columns scaled to unit size, so one ridge weight fits features of any magnitude; the
        # ridge pulls towards the previous fit (or zero), which keeps a coefficient whose
        # feature did not vary in this window where it was.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        xs = x / scale
        prior = (np.array(self.fit.as_tuple()) * scale if self.fit is not None
                 else np.zeros(x.shape[1]))
        lam = 1e-3 * len(y)
        a = xs.T @ xs + lam * np.eye(x.shape[1])
        b = xs.T @ y + lam * prior
        try:
            coef = np.linalg.solve(a, b) / scale
        except np.linalg.LinAlgError:
            return
        coef = np.maximum(coef, 0.0)  # no feature makes a step faster
        self.fit = StepCostFit(**dict(zip(FEATURES, map(float, coef), strict=True)),
                               samples=len(y))
        self._since_fit = 0

    @property
    def watches_queue(self) -> bool:
        """Whether :meth:`prefill_room` reads the queue's wait: an ITL cap that may yield."""
        return self.itl_cap_s is not None and self.itl_cap_max_queue_s is not None

    def prefill_room(self, decodes: int, decode_ctx_tokens: int,
                     queue_wait_s: float | None = None) -> float | None:
        """Seconds the prefill chunks of a step with these decodes may add to it; None for no
        limit (no target set, no decodes in the step, the model still warming up, or only an
        ITL cap, which yields because the oldest queued prompt has waited ``queue_wait_s``;
        None: none queued)."""
        if (self.tpot_slo_s is None and self.itl_cap_s is None) or decodes == 0 \
                or self.fit is None:
            return None
        f = self.fit
        fixed = f.base + f.decode * decodes + f.decode_ctx_token * decode_ctx_tokens
        limits = []
        if self.tpot_slo_s is not None:
            limits.append(self.headroom * self.tpot_slo_s + max(0.0, self.slack_s))
        if self.itl_cap_s is not None:
            if self.itl_cap_max_queue_s is not None and queue_wait_s is not None \
                    and queue_wait_s >= self.itl_cap_max_queue_s:
                self.num_cap_yields += 1
            else:
                limits.append(self.headroom * self.itl_cap_s)
        return min(limits) - fixed if limits else None

    def chunk_tokens(self, room: float, context: int, *, first: bool) -> int:
        """The most tokens one chunk over ``context`` computed tokens may take within ``room``
        seconds, its own cost per chunk included. The step's first chunk gets at least
        ``min_prefill_tokens``: prefills always move."""
        assert self.fit is not None
        f = self.fit
        floor = self.min_prefill_tokens if first else 0
        r = room - f.prefill_chunk
        if r <= 0:
            return floor
        # attended_pair * n^2 / 2 + (prefill_token + attended_pair * (context + 1/2)) * n <= r
        a = f.attended_pair
        lin = f.prefill_token + a * (context + 0.5)
        if a > 0:
            n = (math.sqrt(lin * lin + 2.0 * a * r) - lin) / a
        elif lin > 0:
            n = r / lin
        else:
            n = self.max_tokens
        return max(floor, min(self.max_tokens, int(n)))

    def prefill_budget(self, decodes: int, decode_ctx_tokens: int,
                       queue_wait_s: float | None = None) -> int:
        """Prefill tokens a step with these decodes may carry (:meth:`budget_for` the room
        :meth:`prefill_room` gives it)."""
        return self.budget_for(self.prefill_room(decodes, decode_ctx_tokens, queue_wait_s))

    def budget_for(self, room: float | None) -> int:
        """The prefill tokens of a step with ``room`` seconds for prefill: as many as one fresh
        prompt's chunk (no context before it) could take, an upper bound that the scheduler
        then cuts chunk by chunk at each one's own context (the configured budget when the room
        is None: no limit)."""
        if room is None:
            self.last_budget = self.max_tokens
            return self.max_tokens
        budget = self.chunk_tokens(room, 0, first=True)
        if budget < self.max_tokens:
            self.num_capped_steps += 1
        self.last_budget = budget
        return budget
