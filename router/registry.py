"""Workers the router knows of, fed by heartbeats; a worker that misses them is taken out.

The registry also keeps the router's own view of work it has handed out since the last beat
(prompt tokens sent to a prefill worker, blocks reserved on a decode worker), so a burst of
requests between two beats does not all land on the same worker; of the prefix-cache blocks a
worker holds (reported by its beats, plus the blocks the router just had it compute, until a beat
can report them); and of how fast each worker is, measured (``estimators``): the routing cost
model (``policy.py``) reads nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvrelay.common.rpc import insecure_channel
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.estimators import (
    PRIOR_RPC_S,
    ClusterPerf,
    Ewma,
    LinearFit,
    RateMeter,
    prefill_fit_prior,
    step_fit_prior,
)

logger = logging.getLogger(__name__)

ROLE_NAMES = {wpb.ROLE_PREFILL: "prefill", wpb.ROLE_DECODE: "decode", wpb.ROLE_BOTH: "both"}

# Bounds on what a heartbeat may claim. Each field steers routing for every request (the block
# size divides every prompt, the smallest max_model_len is the cluster's limit, the hash set is
# kept in memory), so a beat outside them is refused rather than believed.
WORKER_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MAX_ADDRESS_LEN = 256
MAX_IDENTITY_LEN = 256
MAX_BLOCK_SIZE = 1024
MIN_WORKER_MODEL_LEN = 256  # or 0: not reported
MAX_WORKER_BLOCKS = 1 << 20  # also the hashes held for a worker that reports no num_blocks


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
    if load.num_blocks > MAX_WORKER_BLOCKS or load.free_blocks > load.num_blocks:
        raise ValueError(f"num_blocks must be at most {MAX_WORKER_BLOCKS} and free_blocks at "
                         f"most num_blocks")
    # A worker holds at most num_blocks full blocks: it cannot add more hashes than that.
    if len(req.added_block_hashes) > (load.num_blocks or MAX_WORKER_BLOCKS):
        raise ValueError(f"{len(req.added_block_hashes)} block hashes added; the worker has "
                         f"{load.num_blocks or MAX_WORKER_BLOCKS} blocks")
    if len(req.removed_block_hashes) > MAX_WORKER_BLOCKS:
        raise ValueError(f"at most {MAX_WORKER_BLOCKS} block hashes removed a beat")


@dataclass
class RouteCounters:
    """What the router had workers do, for metrics (pruned when the worker leaves)."""

    prompt_tokens: int = 0  # prompt tokens of requests routed here (prefill or local)
    computed_tokens: int = 0  # of which the worker computed (the rest was in its prefix cache)
    kv_blocks_sent: int = 0  # KV blocks written into this decode worker
    kv_blocks_skipped: int = 0  # prompt blocks this decode worker already held (not sent)


@dataclass
class WorkerState:
    worker_id: str
    role: str
    address: str
    incarnation: str
    model_identity: str
    block_size: int
    max_model_len: int
    load: wpb.WorkerLoad
    last_seen: float
    channel: grpc.aio.Channel
    decode: worker_pb2_grpc.DecodeWorkerStub | None = None
    prefill: worker_pb2_grpc.PrefillWorkerStub | None = None
    # Router-side accounting: prompt tokens this router handed it that it has not computed yet
    # (and that count when the last beat arrived); blocks reserved since the last beat.
    pending_prompt_tokens: int = 0
    pending_at_beat: int = 0
    pending_blocks: int = 0
    inflight: int = 0
    inflight_at_beat: int = 0  # ``inflight`` when the last beat arrived
    suspect_until: float = 0.0
    block_hashes: set[int] = field(default_factory=set)
    # Blocks the router just had this worker compute: hash -> until when to assume it holds them
    # (the next beats report the truth).
    expected: dict[int, float] = field(default_factory=dict)
    calibrating: bool = False  # being measured by the warm-up probe: no traffic yet
    dispatches: int = 0  # prefills (P) or local generations (D) handed to it, ever
    local_inflight: int = 0  # local generations (fast lane) still prefilling here
    # Measured performance (see LinearFit): seconds to prefill x new tokens on a prefill worker
    # (its PrefillResponse.prefill_ms); seconds from GenerateLocal to the first token for x new
    # tokens on a decode worker, less the wait for its running batch; a decode step's seconds
    # for a batch of x sequences (gaps between streamed tokens); a Reserve round trip.
    prefill_fit: LinearFit = field(default_factory=prefill_fit_prior)
    local_fit: LinearFit = field(default_factory=prefill_fit_prior)
    step_fit: LinearFit = field(default_factory=step_fit_prior)
    reserve_rpc_s: Ewma = field(default_factory=lambda: Ewma(PRIOR_RPC_S))
    arrivals: RateMeter = field(default_factory=RateMeter)  # requests routed to it per second

    @property
    def draining(self) -> bool:
        return self.load.draining

    def usable(self, now: float) -> bool:
        return not self.load.draining and now >= self.suspect_until and not self.calibrating

    @property
    def batch_estimate(self) -> int:
        """Sequences in (or about to join) its batch: this router's own, counted live, plus
        those of others as of the last beat (what the beat showed beyond this router's)."""
        others = self.load.running + self.load.waiting_for_kv - self.inflight_at_beat
        return self.inflight + max(0, others)

    def cached_blocks(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of a prompt (its chained block hashes) this worker holds."""
        have, exp = self.block_hashes, self.expected
        n = 0
        for h in hashes:
            if h not in have and exp.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def expect(self, hashes: Sequence[int], until: float) -> None:
        exp = self.expected
        for h in hashes:
            if h not in self.block_hashes:
                exp[h] = until

    @property
    def free_blocks_estimate(self) -> int:
        return self.load.free_blocks - self.pending_blocks

    @property
    def queued_tokens_estimate(self) -> int:
        """Prompt tokens queued there: this router's, counted live, plus those of others as of
        the last beat (what the beat showed beyond this router's)."""
        others = self.load.queued_prompt_tokens - self.pending_at_beat
        return self.pending_prompt_tokens + max(0, others)


class WorkerRegistry:
    def __init__(self, *, heartbeat_interval_s: float = 1.0, missed_beats: int = 3,
                 suspect_s: float = 2.0, model_identity: str | None = None,
                 authenticated: bool = False):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = heartbeat_interval_s * missed_beats
        self.suspect_s = suspect_s
        self.model_identity = model_identity
        # Whether every beat was sent by a holder of the cluster token: only then may a beat
        # move a live worker id to another address (a pod restarted elsewhere).
        self.authenticated = authenticated
        self.workers: dict[str, WorkerState] = {}
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.perf = ClusterPerf()
        self.counters: dict[tuple[str, str], RouteCounters] = {}
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
        key = (w.role, w.worker_id)
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
        if w is not None and w.address != info.address and not self.authenticated:
            logger.warning("refused a beat for worker %s from %s: it is registered at %s and "
                           "this control port has no cluster token", info.worker_id,
                           info.address, w.address)
            raise WorkerIdTaken(f"worker id {info.worker_id} is registered at another address; "
                                f"reuse it once that worker has missed its heartbeats, or give "
                                f"the cluster a token (--cluster-token)")
        if w is not None and (w.incarnation != info.incarnation or w.address != info.address):
            logger.info("worker %s restarted (incarnation %s -> %s)", info.worker_id,
                        w.incarnation, info.incarnation)
            self._remove(info.worker_id, prune=False)  # the same worker: its series go on
            w = None
        want_full = False
        if w is None:
            w = self._add(info, req.load, now)
            want_full = not req.full_block_set
        else:
            w.load = req.load
            w.last_seen = now
            w.pending_at_beat = w.pending_prompt_tokens
            w.pending_blocks = 0
            w.inflight_at_beat = w.inflight
        if req.full_block_set:
            w.block_hashes = set(req.added_block_hashes)
        else:
            w.block_hashes.difference_update(req.removed_block_hashes)
            w.block_hashes.update(req.added_block_hashes)
            if len(w.block_hashes) > (w.load.num_blocks or MAX_WORKER_BLOCKS):
                # out of step with the worker: start over from a full set
                w.block_hashes.clear()
                want_full = True
        resp = wpb.HeartbeatResponse(interval_s=self.heartbeat_interval_s,
                                     want_full_block_set=want_full)
        if w.role == "decode":  # its quarantined blocks wait on these senders (any state)
            resp.live_prefill_agents.extend(
                x.worker_id for x in self.workers.values() if x.role == "prefill")
        return resp

    def _add(self, info: wpb.WorkerInfo, load: wpb.WorkerLoad, now: float) -> WorkerState:
        ch = insecure_channel(info.address)
        role = ROLE_NAMES[info.role]
        w = WorkerState(
            worker_id=info.worker_id, role=role, address=info.address,
            incarnation=info.incarnation, model_identity=info.model_identity,
            block_size=info.block_size, max_model_len=info.max_model_len, load=load,
            last_seen=now, channel=ch,
            decode=worker_pb2_grpc.DecodeWorkerStub(ch) if role in ("decode", "both") else None,
            prefill=worker_pb2_grpc.PrefillWorkerStub(ch) if role == "prefill" else None,
        )
        self.workers[info.worker_id] = w
        logger.info("worker %s (%s) joined at %s", w.worker_id, role, w.address)
        if self.on_join is not None:
            w.calibrating = True
            self.on_join(w)
        self._changed.set()
        return w

    def _remove(self, worker_id: str, *, prune: bool = True) -> None:
        """Forget a worker; ``prune``: its routing counters (metric series) too, so that pods
        coming and going do not grow the router's memory and /metrics forever."""
        w = self.workers.pop(worker_id, None)
        if prune:
            for key in [k for k in self.counters if k[1] == worker_id]:
                del self.counters[key]
        if w is not None:
            asyncio.get_running_loop().create_task(w.channel.close())
            self._changed.set()

    # -- queries -------------------------------------------------------------------------------
    def alive(self, role: str) -> list[WorkerState]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.role == role and w.usable(now)]

    def can_serve(self) -> bool:
        """Whether a request could be routed now: an aggregated worker, or a prefill worker and
        a decode worker, usable (not draining, suspect or being measured)."""
        return bool(self.alive("both")) or (bool(self.alive("prefill"))
                                            and bool(self.alive("decode")))

    def status(self) -> list[wpb.WorkerStatus]:
        now = time.monotonic()
        role = {v: k for k, v in ROLE_NAMES.items()}
        return [wpb.WorkerStatus(
            info=wpb.WorkerInfo(worker_id=w.worker_id, role=role[w.role], address=w.address,
                                incarnation=w.incarnation, model_identity=w.model_identity,
                                block_size=w.block_size, max_model_len=w.max_model_len),
            load=w.load, last_seen_ms_ago=(now - w.last_seen) * 1000.0)
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
            if not w.calibrating]

    def mark_suspect(self, worker_id: str, why: str) -> None:
        """Keep a worker that just failed a call out of routing for a moment."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.suspect_until = time.monotonic() + self.suspect_s
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
            await w.channel.close()
        self.workers.clear()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s / 2)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if w.expected:
                    w.expected = {h: t for h, t in w.expected.items() if t > now}
                if now - w.last_seen > self.timeout_s:
                    # A worker that announced draining and then went quiet has exited as
                    # planned (scale-in, SIGTERM): that is not worth a warning.
                    log = logger.info if w.draining else logger.warning
                    log("worker %s %s for %.1fs: removed", w.worker_id,
                        "drained and silent" if w.draining else "missed heartbeats",
                        now - w.last_seen)
                    self._remove(w.worker_id)
