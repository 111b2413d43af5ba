"""Whether the panel GEMM prefetches its next panel at a decode batch size, picked online from
paired timings of the decode steps themselves.

At decode sizes a step streams every weight once, and at batch ~8 it sits on the ridge between
the memory stream and the FMA units. Whether pulling a thread's next panel into L2 beside its
current one (``gemm.Tuning.pf_min_rows``) pays then depends on how much bandwidth the memory has
to spare, and on a shared host that swings within seconds. The ~150M demo model at batch 8 on
the 2-vCPU Zen 4, paired step by step and binned by a plain read's bandwidth beside each round:
with the prefetch, 0.971-0.978x the step time while a read ran at ~60 GB/s, 1.095-1.10x while
it ran at ~37; at batch 1 1.17x slower, at batch 32 1.05x faster in both. No fixed choice is
right at batch 8, so the engine measures both.

Each batch size (rows of a decode-only step, ``min_rows`` to ``max_rows``) has a choice. At batch
1 the prefetch lost wherever it was measured (1.17x above, 1.12-1.18x in ``gemm.c``'s notes), so
a probe there would only cost steps. A probe runs the next eight steps of a size in the order on,
off, off, on, on, off, off, on, and keeps the arm with the lower median of the four (on / off)
pair ratios: neighbouring steps of one batch differ by a token of context, and the ABBA order
cancels a drift. A probe runs at the first step of a size, every ``period_s`` after, and as soon
as two steps in a row move more than ``jump`` away from the running mean of that size (the
memory changed phase), though not within ``min_gap_s`` of the last one (a batch whose contexts
spread widely moves its step time too). A probe left unfinished for ``probe_timeout_s`` (the
batch changed size) starts over. Paired against the fixed choice in blocks of 30 steps at batch
8: 0.949-0.958x the step time in the fast phase, 1.003-1.005x in the slow one (the probes' cost).

Prefetching moves no result: every arm computes the same products in the same order.
``KVRELAY_GEMM_AUTOTUNE=0`` keeps the CPU's fixed choice.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.engine.cpu import gemm

logger = logging.getLogger(__name__)

PATTERN = (True, False, False, True, True, False, False, True)


def enabled() -> bool:
    return os.environ.get("KVRELAY_GEMM_AUTOTUNE", "1") != "0"


def applies() -> bool:
    """Whether an engine here tunes the prefetch: on unless turned off, where the kernel has one."""
    return enabled() and gemm.next_panel_prefetch()


@dataclass(frozen=True)
class PrefetchChoices:
    """A tuner's state for the worker's metrics: each batch size's choice (True: the next panel
    is prefetched) and how many probes have ended."""

    choices: dict[int, bool]
    probes: int


def snapshot(runner: object) -> PrefetchChoices | None:
    """The state of ``runner``'s tuner; None where it has none (no fused decode layers, a
    tensor-parallel runner, an AVX2 kernel, ``KVRELAY_GEMM_AUTOTUNE=0``)."""
    fused = getattr(getattr(runner, "model", None), "fused_decode", None)
    tuner = getattr(fused, "tuner", None)
    return None if tuner is None else PrefetchChoices(tuner.choices(), tuner.num_probes)


@dataclass
class _Size:
    on: bool
    mean: float | None = None  # running mean of this size's step time under `on`
    due: float = 0.0  # when the next probe starts
    last: float = float("-inf")  # when the latest probe ended
    started: float = 0.0  # when the probe in hand began
    samples: list[tuple[bool, float]] = field(default_factory=list)
    strikes: int = 0  # steps in a row far from the mean


class PrefetchTuner:
    """``begin(rows)`` before a decode step's layers applies its arm; ``end(seconds)`` after them
    records their time. ``skip()`` before any other step restores the fixed choice.

    ``apply(pf_min_rows)`` sets the kernel's threshold (``gemm.set_prefetch_min_rows``)."""

    def __init__(self, base_min_rows: int, apply: Callable[[int], None], *, min_rows: int = 2,
                 max_rows: int = 16,
                 period_s: float = 3.0, jump: float = 0.08, probe_timeout_s: float = 1.0,
                 min_gap_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.base = base_min_rows
        self.apply = apply
        self.min_rows, self.max_rows = min_rows, max_rows
        self.period_s, self.jump, self.probe_timeout_s = period_s, jump, probe_timeout_s
        self.min_gap_s = min_gap_s
        self.clock = clock
        self.sizes: dict[int, _Size] = {}
        self.num_probes = 0
        self._pending: tuple[_Size, bool, bool] | None = None  # (size, arm, probing)

    def choices(self) -> dict[int, bool]:
        """Each batch size's current choice (True: the next panel is prefetched)."""
        return {rows: s.on for rows, s in sorted(self.sizes.items())}

    def begin(self, rows: int) -> None:
        if rows < self.min_rows or rows > self.max_rows:
            self.skip()
            return
        s = self.sizes.get(rows)
        if s is None:
            s = self.sizes[rows] = _Size(on=self.base <= rows)
        now = self.clock()
        if s.samples and now - s.started > self.probe_timeout_s:
            s.samples.clear()  # abandoned: the batch changed size meanwhile
        probing = bool(s.samples) or now >= s.due
        if probing and not s.samples:
            s.started = now
        arm = PATTERN[len(s.samples)] if probing else s.on
        self.apply(min(self.base, rows) if arm else max(self.base, rows + 1))
        self._pending = (s, arm, probing)

    def skip(self) -> None:
        self._pending = None
        self.apply(self.base)

    def end(self, seconds: float) -> None:
        if self._pending is None:
            return
        s, arm, probing = self._pending
        self._pending = None
        if probing:
            s.samples.append((arm, seconds))
            if len(s.samples) == len(PATTERN):
                self._decide(s)
            return
        if s.mean is None:
            s.mean = seconds
            return
        s.strikes = s.strikes + 1 if abs(seconds / s.mean - 1.0) > self.jump else 0
        if s.strikes >= 2:  # the memory changed phase (or the batch did): measure again
            s.strikes, s.due = 0, min(s.due, max(self.clock(), s.last + self.min_gap_s))
        s.mean += 0.2 * (seconds - s.mean)

    def _decide(self, s: _Size) -> None:
        pairs = list(zip(s.samples[0::2], s.samples[1::2], strict=True))
        ratio = statistics.median((a[1] / b[1]) if a[0] else (b[1] / a[1]) for a, b in pairs)
        s.on = ratio < 1.0
        s.mean = statistics.median(t for arm, t in s.samples if arm == s.on)
        s.samples.clear()
        s.last = self.clock()
        s.strikes, s.due = 0, s.last + self.period_s
        self.num_probes += 1
        logger.debug("next-panel prefetch %s (on/off %.3f)", "on" if s.on else "off", ratio)
