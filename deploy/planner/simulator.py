"""Replay a load trace against profiled replicas in virtual time (deterministic, no sleeping).

The model follows kvrelay's request path (DESIGN.md, decode-first):

* arrival: the request reserves decode KV (prompt + output tokens) on the decode replica with
  the most room; with no room it waits (FIFO), failing after ``kv_wait_s`` as the router does;
* prefill: the replica with the least queued tokens net of its cached prefix (an LRU of hash
  ids) takes it; a replica runs steps of up to ``max_num_batched_tokens`` over its FIFO queue,
  chunking long prompts, each step timed by the profile's prefill curve;
* decode: the first token comes from prefill (TTFT = prefill end + KV transfer - arrival); the
  request joins its decode replica's batch at the next step; a step of ``B`` sequences of mean
  context ``C`` takes ``itl(B, C)``; its ITL is the mean of its steps;
* co-located pools (``Profile.contention`` non-zero, ``contention.py``): all replicas share one
  host's cores and a step slows while the other pool works; off, a step takes the profile's time
  and a decode replica's steps up to its batch's next finish are one event (the same times,
  ~2x faster replays), ended early where a request joins.

Every ``interval_s`` a policy sees an ``Observation`` and names replica counts. A new replica
serves ``startup_s`` later; a removed one drains (finishes its work) first. Replica-seconds run
from a replica's start request to its removal.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvrelay.deploy.planner.contention import SharedCores
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.signals import Observation, PlanDecision, ScalingPolicy
from kvrelay.deploy.planner.sim_state import (
    DecodeReplica,
    PrefillReplica,
    Replica,
    SimRequest,
    StepPlan,
)
from kvrelay.deploy.planner.trace import HASH_BLOCK, TraceRequest


@dataclass(frozen=True)
class SimConfig:
    ttft_slo_ms: float
    itl_slo_ms: float
    prefill: int = 1  # replicas at the start
    decode: int = 1
    interval_s: float = 2.0
    startup_s: float | None = None  # default: the profile's
    kv_wait_s: float = 5.0
    prefix_cache_blocks: int = 256  # hash blocks a prefill replica keeps
    latency_window_s: float = 10.0  # TTFT/ITL p90 over requests finished this recently
    measure_from_s: float = 0.0  # requests arriving earlier are a warm-up, left out of the result


@dataclass
class SimResult:
    attainment: float  # requests meeting both SLOs (failed ones do not)
    replica_seconds: float
    ttft_p90_ms: float
    itl_p90_ms: float
    failed: int
    requests: int
    duration_s: float
    timeline: list[dict] = field(default_factory=list)  # one row per interval


class Simulator:
    def __init__(self, profile: Profile, trace: list[TraceRequest], config: SimConfig,
                 policy: ScalingPolicy | None = None):
        self.p, self.cfg, self.policy = profile, config, policy
        self.trace = trace
        self.startup = profile.startup_s if config.startup_s is None else config.startup_s
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.prefill: list[PrefillReplica] = []
        self.decode: list[DecodeReplica] = []
        self.reqs = [SimRequest(r, left=r.prompt_len) for r in trace]
        self._kv_wait: deque = deque()
        self._kv_retry = -1.0
        self._pf_wait: deque = deque()
        self._finished: list[SimRequest] = []
        self._arrivals = 0
        self._interval_done: list[SimRequest] = []
        self.timeline: list[dict] = []
        self._cores = SharedCores(profile.contention, self._at) if any(profile.contention) else None

    # -- events --------------------------------------------------------------------------------
    def _at(self, t: float, fn: Callable, *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for _ in range(self.cfg.prefill):
            self.prefill.append(PrefillReplica(0.0, 0.0))
        for _ in range(self.cfg.decode):
            self.decode.append(DecodeReplica(0.0, 0.0))
        for r in self.reqs:
            self._at(r.tr.t, self._arrive, r)
        end_t = self.trace[-1].t if self.trace else 0.0
        if self.policy is not None:
            self._at(self.cfg.interval_s, self._tick)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            if fn == self._tick and t > end_t and len(self._finished) == len(self.reqs):
                continue
            self.now = t
            fn(*args)
        return self._result()

    def _arrive(self, r: SimRequest) -> None:
        self._arrivals += 1
        self._kv_wait.append(r)
        self._drain_kv_wait()

    def _drain_kv_wait(self) -> None:
        while self._kv_wait:
            r = self._kv_wait[0]
            if self.now - r.tr.t > self.cfg.kv_wait_s:
                self._kv_wait.popleft()
                self._fail(r)
                continue
            need = r.tr.prompt_len + r.tr.output_len
            room = [d for d in self.decode if d.ready(self.now)
                    and d.kv_used + need <= self.p.kv_capacity_tokens]
            if not room:
                if need > self.p.kv_capacity_tokens:
                    self._kv_wait.popleft()
                    self._fail(r)
                    continue
                deadline = r.tr.t + self.cfg.kv_wait_s + 1e-6
                if self._kv_retry != deadline:
                    self._kv_retry = deadline
                    self._at(deadline, self._drain_kv_wait)
                break
            self._kv_wait.popleft()
            d = min(room, key=lambda d: (d.kv_used, len(d.running) + len(d.pending)))
            d.kv_used += need
            r.dec = d
            self._pf_wait.append(r)
        self._dispatch_prefill()

    def _dispatch_prefill(self) -> None:
        live = [p for p in self.prefill if p.ready(self.now)]
        while self._pf_wait and live:
            r = self._pf_wait.popleft()
            best, best_cost, best_hit = None, 0.0, 0
            for p in live:
                hit = 0
                for h in r.tr.hash_ids:
                    if h not in p.cache:
                        break
                    hit += 1
                cached = min(r.tr.prompt_len - 1, hit * HASH_BLOCK)
                cost = p.queued_tokens + r.tr.prompt_len - cached
                if best is None or cost < best_cost:
                    best, best_cost, best_hit = p, cost, cached
            assert best is not None
            for h in r.tr.hash_ids:
                best.cache[h] = True
                best.cache.move_to_end(h)
            while len(best.cache) > self.cfg.prefix_cache_blocks:
                best.cache.popitem(last=False)
            r.cached = r.done = best_hit
            r.left = r.tr.prompt_len - best_hit
            best.queue.append(r)
            best.queued_tokens += r.left
            if not best.busy:
                self._prefill_step(best)

    def _prefill_step(self, p: PrefillReplica) -> None:
        budget, tokens, sq, batch = self.p.max_num_batched_tokens, 0, 0.0, []
        for r in p.queue:
            if tokens >= budget:
                break
            n = min(r.left, budget - tokens)
            batch.append((r, n))
            tokens += n
            sq += (r.done + n) ** 2 - r.done**2
        if not batch:
            p.busy = False
            self._maybe_remove(p)
            return
        p.busy = True
        work = self.p.prefill_step_s(tokens, sq)
        if self._cores is None:
            self._at(self.now + work, self._prefill_done, p, batch)
        else:
            self._cores.start(self.now, id(p), work, prefill=True, seqs=0,
                              done=lambda: self._prefill_done(p, batch))

    def _prefill_done(self, p: PrefillReplica, batch: list) -> None:
        for r, n in batch:
            r.left -= n
            r.done += n
            p.queued_tokens -= n
            if r.left == 0:
                p.queue.remove(r)
                r.ttft = self.now + self.p.transfer_s - r.tr.t
                if r.tr.output_len <= 1:
                    self._finish(r)
                else:
                    self._at(self.now + self.p.transfer_s, self._join_decode, r)
        self._prefill_step(p)

    def _join_decode(self, r: SimRequest) -> None:
        d = r.dec
        assert d is not None
        d.pending.append(r)
        if not d.busy:
            self._decode_step(d)
        elif d.plan is not None:  # it joins after the step under way: end the plan there
            j = d.plan.ended_by(self.now)
            if j < d.cut:
                d.cut, d.epoch = j, d.epoch + 1
                self._at(d.plan.end(j)[0], self._planned_done, d, d.epoch)

    def _decode_step(self, d: DecodeReplica) -> None:
        # A step costs O(requests joining or finishing), not O(batch) (~1M steps a replay), and
        # without shared cores the steps up to the batch's next finish are one event.
        for r in d.pending:
            r.gen, r.itl_sum = -d.steps, -d.step_s
            d.ctx += r.tr.prompt_len + r.gen
            heapq.heappush(d.running, (d.steps + r.tr.output_len - 1, next(self._seq), r))
        d.pending = []
        if not d.running:
            d.busy = False
            self._maybe_remove(d)
            return
        d.busy = True
        n = len(d.running)
        if self._cores is None:
            # The batch stays as it is until its next finish: those steps' times are known.
            first, growth = self.p.decode_line(n, d.ctx + n * d.steps)
            count = d.running[0][0] - d.steps
            d.plan = StepPlan(self.now, d.step_s, first, growth, count)
            d.cut, d.epoch = count - 1, d.epoch + 1
            self._at(d.plan.end(count - 1)[0], self._planned_done, d, d.epoch)
            return
        # One step at a time on shared cores: its ITL is the time it took at the speeds it met.
        work, t0 = self.p.itl_s(n, (d.ctx + n * d.steps) / n), self.now
        self._cores.start(self.now, id(d), work, prefill=False, seqs=n,
                          done=lambda: self._decode_done(d, self.now - t0))

    def _planned_done(self, d: DecodeReplica, epoch: int) -> None:
        """The planned steps up to ``d.cut`` have ended (unless a join moved the cut since)."""
        if epoch != d.epoch:
            return
        assert d.plan is not None
        d.steps += d.cut + 1
        d.step_s = d.plan.end(d.cut)[1]
        d.plan = None
        self._steps_ended(d)

    def _decode_done(self, d: DecodeReplica, dt: float) -> None:
        d.steps += 1
        d.step_s += dt
        self._steps_ended(d)

    def _steps_ended(self, d: DecodeReplica) -> None:
        """``d.steps``/``d.step_s`` are up to date: retire what finished, start the next step."""
        freed = False
        while d.running and d.running[0][0] <= d.steps:  # output_len - 1 tokens after the first
            r = heapq.heappop(d.running)[2]
            freed = True
            d.ctx -= r.tr.prompt_len + r.gen
            r.gen += d.steps
            r.itl_sum += d.step_s
            d.kv_used -= r.tr.prompt_len + r.tr.output_len
            self._finish(r)
        self._decode_step(d)
        if freed and self._kv_wait:
            self._drain_kv_wait()

    def _finish(self, r: SimRequest) -> None:
        r.end = self.now
        self._finished.append(r)
        self._interval_done.append(r)

    def _fail(self, r: SimRequest) -> None:
        r.failed = True
        self._finish(r)

    # -- scaling -------------------------------------------------------------------------------
    def _maybe_remove(self, rep: Replica) -> None:
        if not rep.draining or rep.removed is not None or rep.busy:
            return
        if isinstance(rep, PrefillReplica) and rep.queue:
            return
        if isinstance(rep, DecodeReplica) and (rep.running or rep.pending):
            return
        rep.removed = self.now
        if self.policy is not None:
            self.policy.change_done("prefill" if isinstance(rep, PrefillReplica) else "decode",
                                    self.now)

    def _ready(self, pool: str) -> None:
        if pool == "prefill":
            self._dispatch_prefill()
        else:
            self._drain_kv_wait()
        if self.policy is not None:
            self.policy.change_done(pool, self.now)

    def _live(self, pool: str) -> list:
        reps = self.prefill if pool == "prefill" else self.decode
        return [r for r in reps if not r.draining and r.removed is None]

    def _changing(self, pool: str) -> bool:
        reps = self.prefill if pool == "prefill" else self.decode
        return any((r.ready_at > self.now and not r.draining) or
                   (r.draining and r.removed is None) for r in reps)

    def scale(self, pool: str, n: int) -> None:
        live = self._live(pool)
        if n > len(live):
            for _ in range(n - len(live)):
                rep = (PrefillReplica if pool == "prefill" else DecodeReplica)(self.now,
                                                                   self.now + self.startup)
                (self.prefill if pool == "prefill" else self.decode).append(rep)
                self._at(rep.ready_at, self._ready, pool)
        elif n < len(live):
            def load(r: Replica) -> tuple:  # starting ones first, then the least loaded
                work = r.queued_tokens if isinstance(r, PrefillReplica) else r.kv_used
                return (r.ready_at <= self.now, work)
            for rep in sorted(live, key=load)[:len(live) - n]:
                rep.draining = True
                if rep.ready_at > self.now:  # never started: gone at once
                    rep.removed = self.now
                else:
                    self._maybe_remove(rep)

    def observe(self) -> Observation:
        done = self._interval_done
        ok = [r for r in done if not r.failed]
        i = len(self._finished)  # in the order they ended: the window is a suffix
        while i and self._finished[i - 1].end >= self.now - self.cfg.latency_window_s:
            i -= 1
        window = [r for r in self._finished[i:] if not r.failed]
        ttft = [r.ttft * 1000 for r in window if r.ttft is not None]
        itl = [r.itl_sum / r.gen * 1000 for r in window if r.gen]
        dec = self._live("decode")
        ready_dec = [d for d in dec if d.ready_at <= self.now]
        return Observation(
            t=self.now, interval_s=self.cfg.interval_s,
            prefill_replicas=len(self._live("prefill")), decode_replicas=len(dec),
            arrivals=self._arrivals, finished=len(ok),
            prompt_tokens=sum(r.tr.prompt_len for r in ok),
            cached_tokens=sum(r.cached for r in ok),
            output_tokens=sum(r.tr.output_len for r in ok),
            queued_prompt_tokens=sum(p.queued_tokens for p in self.prefill)
            + sum(r.tr.prompt_len for r in self._pf_wait),
            decode_running=sum(len(d.running) + len(d.pending) for d in self.decode)
            + len(self._kv_wait),
            kv_usage=(sum(d.kv_used for d in ready_dec) / len(ready_dec)
                      / self.p.kv_capacity_tokens) if ready_dec else 0.0,
            ttft_p90_ms=float(np.percentile(ttft, 90)) if ttft else None,
            itl_p90_ms=float(np.percentile(itl, 90)) if itl else None,
            changing=tuple(p for p in ("prefill", "decode") if self._changing(p)))

    def _tick(self) -> None:
        assert self.policy is not None
        obs = self.observe()
        self._arrivals, self._interval_done = 0, []
        d: PlanDecision = self.policy.decide(obs)
        self.timeline.append({"t": self.now, "rate": obs.rate, "prefill": obs.prefill_replicas,
                              "decode": obs.decode_replicas, "target_prefill": d.prefill,
                              "target_decode": d.decode, "ttft_p90_ms": obs.ttft_p90_ms,
                              "itl_p90_ms": obs.itl_p90_ms, "reason": d.reason, **d.details})
        for pool in ("prefill", "decode"):
            if d.target(pool) != obs.replicas(pool):
                self.scale(pool, d.target(pool))
        self._at(self.now + self.cfg.interval_s, self._tick)

    # -- result --------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        end = max([self.now] + [r.end for r in self.reqs if r.end is not None])
        rs = sum((rep.removed if rep.removed is not None else end) - rep.created
                 for rep in self.prefill + self.decode)
        reqs = [r for r in self.reqs if r.tr.t >= self.cfg.measure_from_s]
        ok = [r for r in reqs if not r.failed and r.ttft is not None]
        met = sum(1 for r in ok if r.ttft * 1000 <= self.cfg.ttft_slo_ms
                  and (not r.gen or r.itl_sum / r.gen * 1000 <= self.cfg.itl_slo_ms))
        ttft = [r.ttft * 1000 for r in ok]
        itl = [r.itl_sum / r.gen * 1000 for r in ok if r.gen]
        return SimResult(
            attainment=met / len(reqs) if reqs else 1.0, replica_seconds=rs,
            ttft_p90_ms=float(np.percentile(ttft, 90)) if ttft else 0.0,
            itl_p90_ms=float(np.percentile(itl, 90)) if itl else 0.0,
            failed=sum(r.failed for r in reqs), requests=len(reqs),
            duration_s=end, timeline=self.timeline)


def simulate(profile: Profile, trace: list[TraceRequest], config: SimConfig,
             policy: ScalingPolicy | None = None) -> SimResult:
    return Simulator(profile, trace, config, policy).run()
