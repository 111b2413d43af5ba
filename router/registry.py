"""Workers the router knows of, fed by heartbeats; a worker that misses them is taken out.

Each worker is a ``WorkerState`` (``worker_state``): its identity, what its beats report, the
router's own accounting of work it has handed out since the last beat (prompt tokens sent to a
prefill worker, blocks reserved on a decode worker, so a burst of requests between two beats
does not all land on the same worker; blocks it just had a worker compute, until a beat can
report them), and how fast the worker is, measured (``estimators``): the routing cost model
(``policy.py``) reads nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.common import kv_layout
from kvrelay.common.convert import step_cost_from_proto
from kvrelay.common.kv_layout import CacheLayout, KVLayoutMismatch
from kvrelay.common.rpc import DRAIN_TIMEOUT_S, HEARTBEAT_INTERVAL_S, insecure_channel
from kvrelay.engine.tiers.media import DEVICE, MEDIA
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.estimators import ClusterPerf
from kvrelay.router.sessions import SessionClient
from kvrelay.router.worker_state import (
    MAX_TIER_BLOCKS,
    MAX_WORKER_BLOCKS,
    HeldPrefix,
    WorkerIdentity,
    WorkerState,
    capacity,
)

logger = logging.getLogger(__name__)

ROLE_NAMES = {wpb.ROLE_PREFILL: "prefill", wpb.ROLE_DECODE: "decode", wpb.ROLE_BOTH: "both"}
ROLE_ENUMS = {v: k for k, v in ROLE_NAMES.items()}

# Bounds on what a heartbeat may claim. Each field steers routing for every request (the block
# size divides every prompt, the smallest max_model_len is the cluster's limit, the hash set is
# kept in memory), so a beat outside them is refused rather than believed.
WORKER_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MAX_ADDRESS_LEN = 256
MAX_IDENTITY_LEN = 256
MAX_BLOCK_SIZE = 1024
MIN_WORKER_MODEL_LEN = 256  # or 0: not reported
MAX_DRAIN_TIMEOUT_S = 86_400.0
# Workers one role may register: beyond it a new worker id is refused (RESOURCE_EXHAUSTED), so
# beats with made-up ids cannot grow the registry (a channel each) without bound.
MAX_WORKERS_PER_ROLE = 1024
# MAX_WORKER_BLOCKS (worker_state): it also caps the block hashes held for a worker's KV pool,
# MAX_TIER_BLOCKS those held for each tier below it (host, disk). Over all tiers, one beat adds
# and removes at most MAX_BEAT_HASHES (32 MiB of hashes; a beat's message is at most 64 MiB).
MAX_BEAT_HASHES = 1 << 22


class RegistryFull(ValueError):
    """A beat of a new worker id when its role already has ``max_workers_per_role``."""


class WorkerIdTaken(ValueError):
    """A beat claims a live worker's id from another address, on a control port anyone can
    reach (no cluster token): believing it would hand that worker's traffic to the sender."""


def validate_beat(req: wpb.HeartbeatRequest) -> None:
    """Raises ValueError, with a message for the worker's log, when a beat is out of bounds."""
    info, load = req.worker, req.load
    if not WORKER_ID_RE.fullmatch(info.worker_id):
        raise ValueError("worker_id must be 1-128 letters, digits, '-', '_', '.', ':'")
    if not info.address or len(info.address) > MAX_ADDRESS_LEN or ":" not in info.address:
        raise ValueError(f"address must be host:port (at most {MAX_ADDRESS_LEN} characters)")
    if info.role not in ROLE_NAMES:
        raise ValueError("heartbeat needs a role (prefill, decode or both)")
    if len(info.incarnation) > MAX_IDENTITY_LEN or len(info.model_identity) > MAX_IDENTITY_LEN:
        raise ValueError(f"incarnation and model_identity take at most {MAX_IDENTITY_LEN} "
                         f"characters")
    if not (1 <= info.block_size <= MAX_BLOCK_SIZE):
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {info.block_size}")
    if info.max_model_len and info.max_model_len < max(MIN_WORKER_MODEL_LEN, info.block_size):
        raise ValueError(f"max_model_len must be at least {MIN_WORKER_MODEL_LEN} (or 0: not "
                         f"reported), got {info.max_model_len}")
    if not 0 <= info.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:  # (NaN fails too)
        raise ValueError(f"drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}] seconds, got "
                         f"{info.drain_timeout_s}")
    if load.num_blocks > MAX_WORKER_BLOCKS or load.free_blocks > load.num_blocks:
        raise ValueError(f"num_blocks must be at most {MAX_WORKER_BLOCKS} and free_blocks at "
                         f"most num_blocks")
    if info.HasField("kv_layout"):
        kv_layout.validate(info.kv_layout)
    _validate_tiers(req)


def _validate_tiers(req: wpb.HeartbeatRequest) -> None:
    """A beat's tiers: each known and reported once, a lower tier's capacity bounded, and no
    tier given more hashes than it has blocks (nor a beat more than ``MAX_BEAT_HASHES``)."""
    load, seen = req.load, set()
    for t in load.tiers:
        if t.medium not in MEDIA or t.medium == DEVICE or t.medium in seen:
            raise ValueError(f"load.tiers: unknown or repeated tier {t.medium[:32]!r} (each of "
                             f"{', '.join(m for m in MEDIA if m != DEVICE)} at most once)")
        seen.add(t.medium)
        if t.capacity_blocks > MAX_TIER_BLOCKS or t.used_blocks > t.capacity_blocks:
            raise ValueError(f"tier {t.medium}: capacity_blocks must be at most "
                             f"{MAX_TIER_BLOCKS} and used_blocks at most capacity_blocks")
    seen, total = set(), 0
    for t in req.tiers:
        if t.medium not in MEDIA or t.medium in seen:
            raise ValueError(f"tiers: unknown or repeated tier {t.medium[:32]!r} (each of "
                             f"{', '.join(MEDIA)} at most once)")
        seen.add(t.medium)
        # A tier holds at most its capacity in full blocks: it cannot add more hashes.
        cap = capacity(load, t.medium)
        if len(t.added) > cap:
            raise ValueError(f"{len(t.added)} block hashes added to tier {t.medium}; it has "
                             f"{cap} blocks")
        if len(t.removed) > (MAX_WORKER_BLOCKS if t.medium == DEVICE else MAX_TIER_BLOCKS):
            raise ValueError(f"too many block hashes removed from tier {t.medium} in a beat")
        total += len(t.added) + len(t.removed)
    if total > MAX_BEAT_HASHES:
        raise ValueError(f"{total} block hashes in one beat; at most {MAX_BEAT_HASHES}")


@dataclass
class RouteCounters:
    """What the router had workers do, for metrics (pruned when the worker leaves)."""

    prompt_tokens: int = 0  # prompt tokens of requests routed here (prefill or local)
    computed_tokens: int = 0  # of which the worker computed (the rest was in its prefix cache)
    kv_blocks_sent: int = 0  # KV blocks written into this decode worker
    kv_blocks_skipped: int = 0  # prompt blocks this decode worker already held (not sent)
    # Prompt tokens the worker held when the router chose it, by the tier (device, host, disk)
    # each block was credited from (``WorkerState.cached_prefix``).
    credited_tokens: dict[str, int] = field(default_factory=dict)

    def credit(self, held: HeldPrefix, block_size: int) -> None:
        for medium, blocks in held.per_tier.items():
            self.credited_tokens[medium] = self.credited_tokens.get(medium, 0) \
                + blocks * block_size


@dataclass
class PullCounters:
    """Prefix pulls (``prefix_pull``): what the router decided and what came of it."""

    # (decision "pull" | "recompute", source pool) -> requests where another worker held more
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)  # PullOutcome name -> pulls
    pulled_tokens: int = 0
    pulled_bytes: int = 0

    def decided(self, decision: str, pool: str) -> None:
        key = (decision, pool)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    @property
    def fallbacks(self) -> int:
        return sum(n for k, n in self.outcomes.items()
                   if k not in ("PULL_DONE", "PULL_NOT_NEEDED", "PULL_NONE"))


class Stalls:
    """Spans in which the router could not read a beat: its loop ran late (blocked, or the
    process starved of CPU). A worker's silence counts only the time the router was listening,
    so a router that stalls past the timeout does not drop every worker on waking for beats
    that sat unread in its own sockets."""

    def __init__(self) -> None:
        self._spans: deque[tuple[float, float]] = deque(maxlen=64)

    def note(self, start: float, end: float) -> None:
        if end > start:
            self._spans.append((start, end))

    def silence(self, since: float, now: float) -> float:
        """Seconds from ``since`` to ``now`` in which the router was listening."""
        away = sum(max(0.0, end - max(start, since)) for start, end in self._spans)
        return now - since - away


class WorkerRegistry:
    def __init__(self, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, missed_beats: int = 3,
                 suspect_s: float = 2.0, model_identity: str | None = None,
                 authenticated: bool = False, max_workers_per_role: int = MAX_WORKERS_PER_ROLE):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_workers_per_role = max_workers_per_role
        self.timeout_s = heartbeat_interval_s * missed_beats
        self.suspect_s = suspect_s
        self.model_identity = model_identity
        # Whether every beat was sent by a holder of the cluster token: only then may a beat
        # move a live worker id to another address (a pod restarted elsewhere).
        self.authenticated = authenticated
        self.workers: dict[str, WorkerState] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # channels of removed workers (strong refs)
        self._changed = asyncio.Event()
        self.stalls = Stalls()
        self.perf = ClusterPerf()
        self.counters: dict[tuple[str, str], RouteCounters] = {}
        self.pulls = PullCounters()
        self._refused: dict[str, str] = {}  # worker id -> why its layout was last refused
        # Called with each worker that joins; set by a policy that measures workers first (the
        # worker is `calibrating`, hence unused and unlisted, until the callee clears it).
        self.on_join: Callable[[WorkerState], None] | None = None

    @property
    def expect_s(self) -> float:
        """How long the router assumes a worker holds blocks it just computed: until two beats
        sent after that can have reported them."""
        return 2.0 * self.heartbeat_interval_s + 0.5

    def counter(self, w: WorkerState) -> RouteCounters:
        """The worker's routing counters; a worker that has left (a request still finishing on
        it) gets a throwaway set, so its metric series stay pruned."""
        if self.workers.get(w.worker_id) is not w:
            return RouteCounters()
        key = (w.identity.role, w.worker_id)
        c = self.counters.get(key)
        if c is None:
            c = self.counters[key] = RouteCounters()
        return c

    def notify(self) -> None:
        """Wake ``wait_for`` callers (a worker became usable)."""
        self._changed.set()

    # -- heartbeats ----------------------------------------------------------------------------
    def heartbeat(self, req: wpb.HeartbeatRequest) -> wpb.HeartbeatResponse:
        info, now = req.worker, time.monotonic()
        validate_beat(req)
        if self.model_identity and info.model_identity != self.model_identity:
            raise ValueError(f"worker {info.worker_id} serves model {info.model_identity}, this "
                             f"router serves {self.model_identity}")
        w = self.workers.get(info.worker_id)
        if req.leaving:
            self._leave(w, info)
            return wpb.HeartbeatResponse(interval_s=self.heartbeat_interval_s)
        known = w.identity if w is not None else None
        if known is not None and known.address != info.address and not self.authenticated:
            logger.warning("refused a beat for worker %s from %s: it is registered at %s and "
                           "this control port has no cluster token", info.worker_id,
                           info.address, known.address)
            raise WorkerIdTaken(f"worker id {info.worker_id} is registered at another address; "
                                f"reuse it once that worker has missed its heartbeats, or give "
                                f"the cluster a token (--cluster-token)")
        restarted = known is not None and (known.incarnation != info.incarnation
                                           or known.address != info.address)
        joined = w is None or restarted
        if joined:
            # Before anything changes: a refused restart leaves the old incarnation in place
            # until its beats stop.
            self._check_layout(info)
        if restarted:
            assert known is not None
            logger.info("worker %s restarted (incarnation %s -> %s)", info.worker_id,
                        known.incarnation, info.incarnation)
            self._remove(info.worker_id, prune=False)  # the same worker: its series go on
            w = None
        if w is None:
            self._check_room(info)
            w = WorkerState(_connect(info))
        # A joining worker's delta is against sets this registry never had: ask for the full
        # sets, as when a delta leaves a set out of step.
        want_full = w.reported.apply_beat(req, now) or (
            joined and not (req.tiers and all(t.full for t in req.tiers)))
        fit = step_cost_from_proto(req.load.step_cost)
        if fit is not None:  # a beat without one keeps the last (none: the priors)
            w.perf.report_fit(*fit)
        w.reported.refit_weights(w.perf, w.identity.block_size)
        w.accounting.at_beat()
        if joined:
            self._add(w)
        resp = wpb.HeartbeatResponse(interval_s=self.heartbeat_interval_s,
                                     want_full_block_set=want_full)
        if w.identity.role == "decode":  # its quarantined blocks wait on these senders (any state)
            resp.live_prefill_agents.extend(
                x.worker_id for x in self.workers.values() if x.identity.role == "prefill")
        return resp

    def _check_layout(self, info: wpb.WorkerInfo) -> None:
        """Refuse a joining worker whose KV layout (``common/kv_layout.py``) differs from that
        of the workers this router routes to, or that hashes prefixes unlike this router:
        KVLayoutMismatch (FAILED_PRECONDITION), with a message naming each differing field and
        both values. A worker that reports no layout (a tool, a test double) is not checked;
        the first one to report one sets the reference, for as long as one such is
        registered."""
        theirs = CacheLayout.from_info(info)
        if theirs is None:
            return
        them = f"worker {info.worker_id}"
        try:
            kv_layout.check_hashing(theirs, them=them)
            ref = next((w for w in self.workers.values() if w.identity.kv_layout is not None
                        and w.worker_id != info.worker_id), None)
            if ref is not None:
                assert ref.identity.kv_layout is not None
                kv_layout.check(theirs, ref.identity.kv_layout, them=them,
                                us=f"the workers this router routes to ({ref.worker_id})")
        except KVLayoutMismatch as e:
            if self._refused.get(info.worker_id) != str(e):  # once per worker and reason
                if len(self._refused) >= self.max_workers_per_role:
                    self._refused.clear()
                self._refused[info.worker_id] = str(e)
                logger.error("%s", e)
            raise
        self._refused.pop(info.worker_id, None)

    def _check_room(self, info: wpb.WorkerInfo) -> None:
        """Refuse a new worker whose role is full (before a channel is opened to it)."""
        role = ROLE_NAMES[info.role]
        n = sum(1 for x in self.workers.values() if x.identity.role == role)
        if n >= self.max_workers_per_role:
            logger.warning("refused worker %s: %d %s workers registered already (the most)",
                           info.worker_id, n, role)
            raise RegistryFull(f"this router already has {n} {role} workers, the most it "
                               f"registers; worker {info.worker_id} was not added")

    def _add(self, w: WorkerState) -> None:
        """Register a worker that just sent its first beat (``on_join`` may hold it out of
        routing to measure it first)."""
        self.workers[w.worker_id] = w
        logger.info("worker %s (%s) joined at %s", w.worker_id, w.identity.role,
                    w.identity.address)
        if self.on_join is not None:
            w.accounting.calibrating = True
            self.on_join(w)
        self._changed.set()

    def _leave(self, w: WorkerState | None, info: wpb.WorkerInfo) -> None:
        """A worker's last beat (it is stopping): forget it now, not after missed beats. Only
        the registered incarnation at its address may: a late last beat of an earlier one (the
        worker restarted since) or of another process using the id changes nothing."""
        if w is None or (w.identity.incarnation, w.identity.address) != (info.incarnation,
                                                                          info.address):
            return
        logger.info("worker %s left", w.worker_id)
        self._remove(w.worker_id, stopping=True)

    def _remove(self, worker_id: str, *, prune: bool = True, stopping: bool = False) -> None:
        """Forget a worker; ``prune``: its routing counters (metric series) too, so that pods
        coming and going do not grow the router's memory and /metrics forever. ``stopping``:
        it said it is (its calls in flight end with its server)."""
        w = self.workers.pop(worker_id, None)
        if prune:
            for key in [k for k in self.counters if k[1] == worker_id]:
                del self.counters[key]
        if w is not None:
            # A draining worker finishes its calls in flight before it exits: beats it sent
            # late (a starved core) do not cut them, and they break by themselves if it has
            # gone (as do a stopping worker's). Any other worker that went silent is presumed
            # lost: its calls are cancelled now, and their requests resume elsewhere.
            grace = w.identity.drain_timeout_s if w.reported.draining or stopping else None
            task = asyncio.get_running_loop().create_task(w.identity.channel.close(grace))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            self._changed.set()

    # -- queries -------------------------------------------------------------------------------
    def alive(self, role: str) -> list[WorkerState]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.identity.role == role and w.usable(now)]

    def can_serve(self) -> bool:
        """Whether a request could be routed now: an aggregated worker, or a prefill worker and
        a decode worker, usable (not draining, suspect or being measured)."""
        return bool(self.alive("both")) or (bool(self.alive("prefill"))
                                            and bool(self.alive("decode")))

    def status(self) -> list[wpb.WorkerStatus]:
        now = time.monotonic()
        return [_status(w, now) for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
                if not w.accounting.calibrating]

    def mark_suspect(self, worker_id: str, why: str) -> None:
        """Keep a worker that just failed a call out of routing for a moment."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.accounting.suspect_until = time.monotonic() + self.suspect_s
            logger.warning("worker %s suspect for %.1fs: %s", worker_id, self.suspect_s, why)

    async def wait_for(self, role: str, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.alive(role)) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))
        return True

    # -- expiry --------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._reap())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for w in list(self.workers.values()):
            await w.identity.channel.close()
        self.workers.clear()

    async def _reap(self) -> None:
        period = self.heartbeat_interval_s / 2
        due = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if now - due > period / 2:  # this loop ran late: no beat was read meanwhile
                self.stalls.note(due, now)
            due = now + period
            self.expire(now)

    def expire(self, now: float) -> None:
        """Remove each worker silent for longer than the timeout (counting only the time the
        router was listening)."""
        for w in list(self.workers.values()):
            w.accounting.drop_expired(now)
            seen = w.reported
            silent = self.stalls.silence(seen.last_seen, now)
            if silent > self.timeout_s:
                # A worker that announced draining and then went quiet has exited as
                # planned (scale-in, SIGTERM): that is not worth a warning.
                log = logger.info if seen.draining else logger.warning
                log("worker %s %s for %.1fs: removed", w.worker_id,
                    "drained and silent" if seen.draining else "missed heartbeats", silent)
                self._remove(w.worker_id)


def _connect(info: wpb.WorkerInfo) -> WorkerIdentity:
    """A joining worker's identity, with a channel (and its role's stubs) to reach it by."""
    ch = insecure_channel(info.address)
    role = ROLE_NAMES[info.role]
    decode = worker_pb2_grpc.DecodeWorkerStub(ch) if role in ("decode", "both") else None
    return WorkerIdentity(
        worker_id=info.worker_id, role=role, address=info.address,
        incarnation=info.incarnation, model_identity=info.model_identity,
        block_size=info.block_size, max_model_len=info.max_model_len, channel=ch,
        drain_timeout_s=info.drain_timeout_s or DRAIN_TIMEOUT_S,
        kv_layout=CacheLayout.from_info(info),
        decode=decode, streams=SessionClient(decode) if decode is not None else None,
        prefill=worker_pb2_grpc.PrefillWorkerStub(ch) if role == "prefill" else None)


def _status(w: WorkerState, now: float) -> wpb.WorkerStatus:
    i = w.identity
    info = wpb.WorkerInfo(worker_id=i.worker_id, role=ROLE_ENUMS[i.role], address=i.address,
                          incarnation=i.incarnation, model_identity=i.model_identity,
                          block_size=i.block_size, max_model_len=i.max_model_len,
                          drain_timeout_s=i.drain_timeout_s)
    if i.kv_layout is not None:
        info.kv_layout.CopyFrom(i.kv_layout.to_proto())
    return wpb.WorkerStatus(info=info, load=w.reported.load,
                            last_seen_ms_ago=(now - w.reported.last_seen) * 1000.0)


def tier_usage(load: wpb.WorkerLoad) -> dict[str, dict[str, float]]:
    """A worker's KV tiers as its last beat reported them, by medium, for status output: the
    pool (``device``) and each tier below it, with blocks held, capacity and, below the pool,
    hits, mean load seconds per block and failed loads."""
    out: dict[str, dict[str, float]] = {}
    if load.num_blocks:
        used = load.num_blocks - load.free_blocks
        out[DEVICE] = {"used_blocks": used, "capacity_blocks": load.num_blocks,
                       "usage": used / load.num_blocks}
    for t in load.tiers:
        out[t.medium] = {"used_blocks": t.used_blocks, "capacity_blocks": t.capacity_blocks,
                         "usage": t.used_blocks / t.capacity_blocks if t.capacity_blocks else 0.0,
                         "hit_blocks": t.hit_blocks,
                         "load_seconds_per_block": t.load_seconds_per_block,
                         "load_failures": t.load_failures}
    return out
