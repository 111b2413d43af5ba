"""The sender's proof that the leases it writes under are still current (self-fencing).

A decode worker reuses the blocks it promised to a prefill worker once no router has listed that
worker for ``sender_gone_grace_s`` (``recv_tracker.Quarantine.observe_alive``). A prefill worker
that is alive but partitioned from the routers, or wedged (a stopped process, a starved CPU), must
therefore stop writing before that grace can run out, on its own clock: each heartbeat a router
answers proves the worker was listed when the beat went out; writes are allowed for
``horizon_s`` after the latest such proof, and ``horizon_s`` plus the longest a posted write can
stay in flight (the transport's write timeout) is shorter than the receivers' grace
(``NixlConnectorConfig`` checks it).

A lapse (no proof for ``horizon_s``) is final for everything the worker knew before it: each
request is tagged with the proof *epoch* current when it arrived, a lapse starts a new epoch,
and a request (or a queued write) of an older epoch never writes. After a lapse the worker also
refuses new requests for ``horizon_s`` more: a destination that reaches it right after it
resumes may have been sent while it was gone, and its blocks given away since.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class SelfFence:
    """Thread-safe. ``horizon_s`` None: never fenced (no router vouches for anybody: a worker
    without routers is never declared gone by its receivers either)."""

    def __init__(self, horizon_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if horizon_s is not None and not horizon_s > 0:
            raise ValueError(f"the self-fence horizon must be positive, got {horizon_s}")
        self.horizon_s = horizon_s
        self._clock = clock
        self._lock = threading.Lock()
        self._until = -math.inf  # writes allowed before this (no proof yet: none)
        self._settled_at = -math.inf  # after a lapse, new work waits until this
        self._epoch = 0
        self._lapsed = False
        self.num_lapses = 0

    @property
    def enabled(self) -> bool:
        return self.horizon_s is not None

    def proved(self, sent_at: float) -> None:
        """A router answered the heartbeat sent at ``sent_at`` (this clock): it listed us then."""
        if self.horizon_s is None:
            return
        with self._lock:
            now = self._clock()
            first = self._until == -math.inf
            if sent_at >= self._until or self._lapsed:  # the proof had run out meanwhile
                if not self._lapsed:
                    self._bump()
                self._lapsed = False
                if not first:
                    self._settled_at = max(self._settled_at, now + self.horizon_s)
            self._until = max(self._until, sent_at + self.horizon_s)

    def _bump(self) -> None:
        self._epoch += 1
        if self._until != -math.inf:
            self.num_lapses += 1

    def _check(self, now: float) -> bool:
        """Whether writes are allowed now (under the lock); notes a lapse."""
        if now >= self._until:
            if not self._lapsed:
                self._bump()
                self._lapsed = True
            return False
        return True

    def admit(self) -> int | None:
        """The epoch to tag a newly arrived request with; None: refuse it (no current proof,
        or settling after a lapse)."""
        if self.horizon_s is None:
            return 0
        with self._lock:
            now = self._clock()
            if not self._check(now) or now < self._settled_at:
                return None
            return self._epoch

    def valid(self, epoch: int | None) -> bool:
        """Whether work tagged ``epoch`` may write now."""
        if self.horizon_s is None:
            return True
        if epoch is None:
            return False
        with self._lock:
            return self._check(self._clock()) and epoch == self._epoch

    def remaining_s(self) -> float:
        """Seconds of proof left (inf when disabled, <= 0 when fenced)."""
        if self.horizon_s is None:
            return math.inf
        with self._lock:
            return self._until - self._clock()
