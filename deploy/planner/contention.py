"""Co-located pools: prefill and decode replicas sharing one host's cores, in virtual time.

Off by default (``Profile.contention == (0, 0)``): every replica has hardware of its own (the
Ray and Kubernetes deployments, a replica per node or GPU), and a step takes exactly the
profile's time. The simulator then never builds a ``SharedCores``.

On, every replica of the simulation is on one host, and a step runs as processor sharing: at
any moment it progresses at ``1 / (1 + k * load)`` of its uncontended speed, where

* a prefill step has ``k = contention[0]`` and ``load`` = the sequences being decoded beside it
  (the decode engine's thread, and the token each of them streams every step through its
  worker, the router and the client, all take CPU from the same cores);
* a decode step has ``k = contention[1]`` and ``load`` = the prefill steps running beside it.

The speeds are re-evaluated whenever a step starts or ends anywhere, so a long prefill step is
slowed only for the part of it that overlaps decoding, and its duration is the time its
uncontended work takes at the speeds it meets. ``deploy/planner/calibrate.py`` fits
``contention[0]`` from a low-load live run; ``contention[1]`` is left to the caller (0 there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Step:
    prefill: bool
    seqs: int  # sequences of a decode step (its load on a prefill step); 0 for prefill
    work: float  # seconds of the step still to run at full speed
    done: Callable[[], None]
    speed: float = 0.0  # 0: not scheduled yet
    since: float = 0.0  # when ``work`` was last brought up to date
    token: int = 0  # the scheduled finish that is current; older ones are ignored


class SharedCores:
    """The steps in flight on the host, each finishing when its work is done."""

    def __init__(self, contention: tuple[float, float],
                 schedule: Callable[..., None]) -> None:
        if min(contention) < 0:
            raise ValueError(f"contention must not be negative, got {contention}")
        self.k_prefill, self.k_decode = contention
        self._schedule = schedule  # (t, fn, *args): the simulator's event queue
        self._steps: dict[int, _Step] = {}
        self._tokens = 0

    def start(self, now: float, key: int, work: float, *, prefill: bool, seqs: int,
              done: Callable[[], None]) -> None:
        """A step of ``work`` uncontended seconds starts now on replica ``key``; ``done`` runs
        when it ends."""
        self._settle(now)
        self._steps[key] = _Step(prefill, seqs, work, done, since=now)
        self._reschedule(now)

    def _speed(self, st: _Step) -> float:
        if st.prefill:
            load = sum(o.seqs for o in self._steps.values() if not o.prefill)
            return 1.0 / (1.0 + self.k_prefill * load)
        load = sum(1 for o in self._steps.values() if o.prefill)
        return 1.0 / (1.0 + self.k_decode * load)

    def _settle(self, now: float) -> None:
        for st in self._steps.values():
            st.work = max(0.0, st.work - (now - st.since) * st.speed)
            st.since = now

    def _reschedule(self, now: float) -> None:
        for key, st in self._steps.items():
            speed = self._speed(st)
            if speed != st.speed:
                st.speed = speed
                self._tokens += 1
                st.token = self._tokens
                end = now + st.work / speed
                self._schedule(end, self._finish, key, st.token, end)

    def _finish(self, key: int, token: int, now: float) -> None:
        st = self._steps.get(key)
        if st is None or st.token != token:
            return  # rescheduled since: a later event finishes it
        del self._steps[key]
        self._settle(now)
        st.done()  # may start the replica's next step (which reschedules)
        self._reschedule(now)
