"""One worker as the router sees it, in parts that change for different reasons.

* ``WorkerIdentity``: what the worker is and how to reach it; fixed for an incarnation (a
  restarted worker gets a new ``WorkerState``).
* ``ReportedLoad``: what its heartbeats say; each beat replaces it (``ReportedLoad.apply_beat``).
* ``Accounting``: what this router counts itself between two beats: work it handed out that a
  beat cannot have reported yet, blocks it just had the worker compute, whether the worker is
  suspect or being measured. Each beat takes a snapshot (``Accounting.at_beat``).
* ``WorkerPerf`` (``estimators``): how fast the worker is, measured over its life.

``WorkerState`` holds the four; the estimates the routing policy reads (``policy.py``) combine a
beat's figures with this router's own counts, so they are its methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvrelay.common.kv_layout import CacheLayout
from kvrelay.common.rpc import DRAIN_TIMEOUT_S
from kvrelay.engine.tiers.media import DEFAULT_TIER_WEIGHTS, DEVICE
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.estimators import WorkerPerf, tier_weights
from kvrelay.router.sessions import SessionClient

# The most KV blocks a worker may claim (a beat's bound, see ``registry.validate_beat``); also
# the most block hashes held for a worker that reports no num_blocks.
MAX_WORKER_BLOCKS = 1 << 20
# The most blocks a tier below the pool (host, disk) may claim: the most hashes held for it.
MAX_TIER_BLOCKS = 1 << 22


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker is and how to reach it, as its first beat of an incarnation said."""

    worker_id: str
    role: str  # "prefill", "decode" or "both"
    address: str
    incarnation: str
    model_identity: str
    block_size: int
    max_model_len: int  # 0: not reported
    channel: grpc.aio.Channel
    decode: worker_pb2_grpc.DecodeWorkerStub | None = None
    # Decode and GenerateLocal over one Session (``RouterConfig.stream_sessions``).
    streams: SessionClient | None = None
    prefill: worker_pb2_grpc.PrefillWorkerStub | None = None
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # how long it finishes its calls once draining
    kv_layout: CacheLayout | None = None  # None: not reported (``common/kv_layout.py``)


@dataclass
class ReportedLoad:
    """What the worker's heartbeats say: its load as of the last one, when that came, and the
    hashes of the prefix-cache blocks each of its tiers holds (``tier_hashes``, by medium, kept
    up to date by each beat's deltas), with what a block in each tier is worth to the router
    (``tier_weights``, refitted each beat: ``estimators.tier_weights``)."""

    load: wpb.WorkerLoad = field(default_factory=wpb.WorkerLoad)
    last_seen: float = 0.0
    tier_hashes: dict[str, set[int]] = field(default_factory=lambda: {DEVICE: set()})
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))

    @property
    def draining(self) -> bool:
        return self.load.draining

    def hashes(self, medium: str = DEVICE) -> set[int]:
        """The hashes ``medium`` holds (the KV pool's by default), as the beats reported."""
        held = self.tier_hashes.get(medium)
        if held is None:
            held = self.tier_hashes[medium] = set()
        return held

    def capacity(self, medium: str) -> int:
        """The most blocks ``medium`` can hold, as the last beat said (the hashes held for it
        are capped by it)."""
        return capacity(self.load, medium)

    def apply_beat(self, beat: wpb.HeartbeatRequest, now: float) -> bool:
        """Take a (validated) beat; True when the worker should send its full block sets next:
        a delta left a tier more hashes than it has blocks (out of step: start over)."""
        self.load = beat.load
        self.last_seen = now
        out_of_step = False
        for t in beat.tiers:
            if t.full:
                held = self.tier_hashes[t.medium] = set(t.added)
            else:
                held = self.hashes(t.medium)
                held.difference_update(t.removed)
                held.update(t.added)
            if len(held) > self.capacity(t.medium):
                held.clear()
                out_of_step = True
        return out_of_step

    def refit_weights(self, perf: WorkerPerf, block_size: int) -> None:
        """Each tier's weight from its measured load cost and the worker's step-time fit."""
        measured = {t.medium: t.load_seconds_per_block for t in self.load.tiers
                    if t.hit_blocks}
        self.tier_weights = tier_weights(measured, perf.step_cost, block_size)


def capacity(load: wpb.WorkerLoad, medium: str) -> int:
    """The blocks ``medium`` holds at most per ``load``: the pool's ``num_blocks`` (or the
    bound, when not reported), a lower tier's reported capacity (0 when it reports none)."""
    if medium == DEVICE:
        return load.num_blocks or MAX_WORKER_BLOCKS
    for t in load.tiers:
        if t.medium == medium:
            return min(t.capacity_blocks, MAX_TIER_BLOCKS)
    return 0


@dataclass(frozen=True)
class HeldPrefix:
    """A prompt's leading blocks that a worker holds, each in the best tier that holds it
    (``WorkerState.cached_prefix``)."""

    blocks: int  # leading blocks held in any tier
    credit: float  # those blocks, each weighted by its tier's weight (device: 1)
    per_tier: dict[str, int]  # blocks by the tier they were credited from

    @property
    def device_blocks(self) -> int:
        return self.per_tier.get(DEVICE, 0)


NOTHING_HELD = HeldPrefix(0, 0.0, {})


@dataclass
class Accounting:
    """What this router counts itself: the work it handed the worker (a burst between two beats
    must not all land on one worker), the blocks it had it compute, its own verdicts."""

    # Prompt tokens this router handed it that it has not computed yet, and that count when
    # the last beat arrived (the beat's queue includes them).
    pending_prompt_tokens: int = 0
    pending_at_beat: int = 0
    pending_blocks: int = 0  # blocks reserved on it since the last beat
    inflight: int = 0  # this router's requests there (reserved, prefilling or decoding)
    inflight_at_beat: int = 0  # ``inflight`` when the last beat arrived
    suspect_until: float = 0.0  # a call to it just failed: no traffic until then
    # Blocks the router just had it compute: hash -> until when to assume it holds them (the
    # next beats report the truth).
    expected: dict[int, float] = field(default_factory=dict)
    calibrating: bool = False  # being measured by the warm-up probe: no traffic yet
    dispatches: int = 0  # prefills handed to it, ever (a prefill worker's)
    local_inflight: int = 0  # local generations (fast lane) still prefilling here

    def at_beat(self) -> None:
        """A beat arrived: its figures include this router's work so far (snapshot it), and
        the blocks reserved before it."""
        self.pending_at_beat = self.pending_prompt_tokens
        self.pending_blocks = 0
        self.inflight_at_beat = self.inflight

    def drop_expired(self, now: float) -> None:
        """Forget expected blocks that the beats have had time to report."""
        if self.expected:
            self.expected = {h: t for h, t in self.expected.items() if t > now}

    def charge(self, *, prompt_tokens: int = 0, local: bool = False) -> Charge:
        """Count one request of this router's on the worker (``inflight``), with
        ``prompt_tokens`` it has yet to compute, and (``local``) as a local generation still
        prefilling; the returned ``Charge`` takes it all back once."""
        return Charge(self, prompt_tokens, local)


class Charge:
    """One request's load on a worker as this router counts it: every count it adds, and the
    undoing of each, here together. ``prefilled()`` takes back the prompt's part (its tokens
    are computed, the request stays); ``undo()`` (or leaving a ``with`` block) takes back what
    is left. Both are idempotent, so a path may end it early and a ``finally`` end it again."""

    __slots__ = ("_acct", "_inflight", "_local", "_tokens")

    def __init__(self, acct: Accounting, prompt_tokens: int, local: bool):
        self._acct = acct
        self._tokens = prompt_tokens
        self._local = local
        self._inflight = True
        acct.inflight += 1
        acct.pending_prompt_tokens += prompt_tokens
        if local:
            acct.local_inflight += 1

    @property
    def prefilling(self) -> bool:
        """The prompt's part is still counted (``prefilled()`` not called yet)."""
        return bool(self._tokens) or self._local

    def prefilled(self) -> None:
        acct = self._acct
        if self._tokens:
            acct.pending_prompt_tokens = max(0, acct.pending_prompt_tokens - self._tokens)
            self._tokens = 0
        if self._local:
            acct.local_inflight -= 1
            self._local = False

    def undo(self) -> None:
        self.prefilled()
        if self._inflight:
            self._acct.inflight -= 1
            self._inflight = False

    def __enter__(self) -> Charge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


@dataclass
class WorkerState:
    """A worker as this router knows it (see the module docstring for the parts)."""

    identity: WorkerIdentity
    reported: ReportedLoad = field(default_factory=ReportedLoad)
    accounting: Accounting = field(default_factory=Accounting)
    perf: WorkerPerf = field(default_factory=WorkerPerf)

    @property
    def worker_id(self) -> str:
        """The worker's name in every log line, trace event, metric label and ranking tie-break
        (and the registry's key): kept short here; it is fixed, like all of the identity."""
        return self.identity.worker_id

    def usable(self, now: float) -> bool:
        acct = self.accounting
        return not self.reported.draining and now >= acct.suspect_until and not acct.calibrating

    @property
    def batch_estimate(self) -> int:
        """Sequences in (or about to join) its batch: this router's own, counted live, plus
        those of others as of the last beat (what the beat showed beyond this router's)."""
        load, acct = self.reported.load, self.accounting
        others = load.running + load.waiting_for_kv - acct.inflight_at_beat
        return acct.inflight + max(0, others)

    @property
    def free_blocks_estimate(self) -> int:
        return self.reported.load.free_blocks - self.accounting.pending_blocks

    @property
    def queued_tokens_estimate(self) -> int:
        """Prompt tokens queued there: this router's, counted live, plus those of others as of
        the last beat (what the beat showed beyond this router's)."""
        acct = self.accounting
        others = self.reported.load.queued_prompt_tokens - acct.pending_at_beat
        return acct.pending_prompt_tokens + max(0, others)

    def cached_prefix(self, hashes: Sequence[int], now: float) -> HeldPrefix:
        """Leading blocks of a prompt (its chained block hashes) this worker holds, each
        credited by the best (highest-weight) tier holding it: the pool, where the beats report
        it or this router just had the worker compute it (``expect``), else a tier below (host,
        disk) at that tier's weight. The first block no tier holds ends the prefix."""
        rep, exp = self.reported, self.accounting.expected
        device = rep.tier_hashes.get(DEVICE, ())
        n = 0
        for h in hashes:  # the pool first: most prompts' prefixes end there
            if h not in device and exp.get(h, 0.0) <= now:
                break
            n += 1
        if n == len(hashes):
            return HeldPrefix(n, float(n), {DEVICE: n}) if n else NOTHING_HELD
        weights = rep.tier_weights
        lower = sorted(((weights.get(m, 0.0), m, held) for m, held in rep.tier_hashes.items()
                        if m != DEVICE and held), key=lambda x: -x[0])
        if not lower:
            return HeldPrefix(n, float(n), {DEVICE: n}) if n else NOTHING_HELD
        per_tier = {DEVICE: n} if n else {}
        credit = float(n)
        for h in hashes[n:]:
            if h in device or exp.get(h, 0.0) > now:
                weight, medium = 1.0, DEVICE
            else:
                best = next(((wt, m) for wt, m, held in lower if h in held), None)
                if best is None:
                    break
                weight, medium = best
            per_tier[medium] = per_tier.get(medium, 0) + 1
            credit += weight
            n += 1
        return HeldPrefix(n, credit, per_tier)

    def cached_blocks(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of a prompt this worker holds in any tier (``cached_prefix``)."""
        return self.cached_prefix(hashes, now).blocks

    def expect(self, hashes: Sequence[int], until: float) -> None:
        """Count on the worker holding these blocks in its KV pool until ``until`` (those the
        beats do not report there yet): it just computed (or promoted) them."""
        have, exp = self.reported.hashes(DEVICE), self.accounting.expected
        for h in hashes:
            if h not in have:
                exp[h] = until
