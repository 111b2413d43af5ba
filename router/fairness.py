"""The in-flight slots, shared fairly between tenants (API keys), with a bounded queue in front.

A request takes a slot once validated and tokenized and holds it until it ends
(``RouterService.generate``). Without fairness one API key sending enough requests takes every
slot, and every other key's requests are refused (issue 54). Here:

- **Shares.** A tenant is *active* while it holds a slot, waits for one, or ended a request
  within the last ``window_s``. Each active tenant's share is ``ceil(slots / active)``. A
  tenant under its share takes a free slot at once; one at or over it takes one only while more
  than ``reserve`` slots are free, so a share no one uses is not wasted, but the last
  ``reserve`` slots (an eighth) are always there for another tenant's next request. With one
  tenant possible (no API keys, or one) there are no shares and no reserve: any free slot.
- **The queue.** A request that cannot take a slot waits, up to ``wait_s`` (and its own
  deadline). When a slot comes back it goes to the most important waiter (lowest ``priority``,
  as vLLM counts: 0 is the default, negative is more important), among equals to the tenant
  furthest under its share, then first come. The queue holds at most ``max_waiting`` requests,
  each tenant at most its share of them.
- **Shedding.** A request that does not fit the queue sheds the least important request among
  those it competes with (its tenant's waiters when its tenant's share of the queue is full,
  else everyone's), newest first among equals; when that is the request itself it is refused.
  Every refusal is ``RESOURCE_EXHAUSTED`` (HTTP 429) with a retry hint.

Priority orders requests, it does not buy slots: a tenant's share bounds its important requests
as much as its others.

Loop-confined (the router's event loop): no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvrelay.router.errors import RouterError

DEFAULT_PRIORITY = 0  # vLLM's default; lower values are served first and shed last
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # int32, as the gRPC field carries it
ACTIVE_WINDOW_S = 30.0  # a tenant whose last request ended this long ago has no share
QUEUE_WAIT_S = 5.0
RETRY_AFTER_S = 1.0

T = TypeVar("T")


class Waiter:
    """A request waiting for a slot."""

    __slots__ = ("future", "priority", "seq", "tenant")

    def __init__(self, tenant: _Tenant, priority: int, seq: int):
        self.tenant = tenant
        self.priority = priority
        self.seq = seq
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class _Tenant:
    name: str
    held: int = 0
    waiters: list[Waiter] = field(default_factory=list)
    last_seen: float = 0.0


class Slot:
    """One request's slot; ``release`` (idempotent) gives it back to the queue."""

    __slots__ = ("_queue", "_tenant", "released")

    def __init__(self, queue: FairQueue, tenant: _Tenant):
        self._queue = queue
        self._tenant = tenant
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue._give_back(self._tenant)


def _granted(w: Waiter) -> bool:
    """Whether ``w`` was given a slot (its future done, neither shed nor cancelled)."""
    return w.future.done() and not w.future.cancelled() and w.future.exception() is None


def busy(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=RETRY_AFTER_S)


class FairQueue:
    def __init__(self, slots: int, *, max_waiting: int | None = None,
                 wait_s: float = QUEUE_WAIT_S, shared: bool = False,
                 window_s: float = ACTIVE_WINDOW_S):
        """``slots``: requests in flight at once; ``shared``: several tenants may come (more
        than one API key), so shares and the reserve apply."""
        if slots < 0 or (max_waiting is not None and max_waiting < 0) or wait_s < 0:
            raise ValueError("the fair queue's bounds must not be negative")
        self.slots = slots
        self.max_waiting = slots if max_waiting is None else max_waiting
        self.wait_s = wait_s
        self.shared = shared
        self.window_s = window_s
        self.inflight = 0
        self.waiting = 0
        self.shed = 0  # requests refused or dropped from the queue, all told
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()
        self._pruned_at = 0.0

    # -- shares --------------------------------------------------------------------------------
    @property
    def reserve(self) -> int:
        """Free slots no tenant over its share may take: kept for another tenant's arrival."""
        return max(1, self.slots // 8) if self.shared and self.slots > 1 else 0

    def _active(self) -> int:
        now = time.monotonic()
        if now - self._pruned_at >= 1.0:
            self._pruned_at = now
            for name in [n for n, t in self._tenants.items() if not t.held and not t.waiters
                         and now - t.last_seen > self.window_s]:
                del self._tenants[name]
        return max(1, len(self._tenants))

    def share(self, of: int) -> int:
        """An active tenant's share of ``of`` (slots, or places in the queue)."""
        if not self.shared:
            return of
        return math.ceil(of / self._active())

    def slot_share(self) -> int:
        """An active tenant's share of the slots: never the reserve."""
        return min(self.share(self.slots), self.slots - self.reserve)

    def _may_take(self, t: _Tenant) -> bool:
        free = self.slots - self.inflight
        return free > 0 and (t.held < self.slot_share() or free > self.reserve)

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(name)
        t.last_seen = time.monotonic()
        return t

    # -- arrival -------------------------------------------------------------------------------
    def refusal(self, tenant: str, priority: int | None = None) -> RouterError | None:
        """The refusal a request of ``tenant`` would meet now, checked before its body is read
        or its prompt tokenized; None when it may go on. ``priority`` None (an HTTP body not yet
        parsed): refused only if any priority would be, except that a tenant at its share of
        the queue while other tenants are active is refused as a request of the default
        priority would be: a flooding key's excess costs the router no parse, and its
        important requests get no more than its share anyway."""
        t = self._tenant(tenant)
        self._dispatch()
        if self._may_take(t):
            return None
        if priority is None:
            flooding = self.shared and self._active() > 1 \
                and len(t.waiters) >= self.share(self.max_waiting)
            priority = DEFAULT_PRIORITY if flooding else MIN_PRIORITY
        room, _ = self._room(t, priority)
        return None if room else self._refused(t)

    def _refused(self, t: _Tenant) -> RouterError:
        self.shed += 1
        if self.shared and self._active() > 1:
            return busy(f"router at capacity for this API key: {t.held} of its requests in "
                        f"flight and {len(t.waiters)} queued (its share: "
                        f"{self.slot_share()} and {self.share(self.max_waiting)})")
        return busy(f"router at capacity ({self.inflight} requests in flight, {self.waiting} "
                    f"queued)")

    def _room(self, t: _Tenant, priority: int) -> tuple[bool, Waiter | None]:
        """Whether a newcomer of ``t`` with ``priority`` gets into the queue, and the waiter it
        sheds for that (None when there is room): of its tenant's waiters when the tenant's
        share of the queue is full, else of everyone's, the least important, newest first
        (among other tenants' equals: the one of the tenant holding and queueing the most)."""
        mine = len(t.waiters) >= self.share(self.max_waiting)
        if not mine and self.waiting < self.max_waiting:
            return True, None
        pool = t.waiters if mine else [w for u in self._tenants.values() for w in u.waiters]

        def rank(w: Waiter) -> tuple[int, int, int]:  # the largest is shed
            return w.priority, len(w.tenant.waiters) + w.tenant.held, w.seq
        if not pool:
            return False, None
        victim = max(pool, key=rank)
        newcomer = (priority, len(t.waiters) + t.held + 1, 1 << 62)
        return (True, victim) if rank(victim) > newcomer else (False, None)

    async def take(self, tenant: str, priority: int = DEFAULT_PRIORITY,
                   deadline: float | None = None) -> Slot:
        """A slot for a request of ``tenant``: at once, or after a wait in the queue (bounded
        by ``wait_s`` and ``deadline``, a ``time.monotonic()``). RouterError
        RESOURCE_EXHAUSTED (with a retry hint) when it is shed or waited too long,
        DEADLINE_EXCEEDED when its deadline passed while it waited."""
        t = self._tenant(tenant)
        self._dispatch()  # waiters first: a share that has grown since, a window run out
        if self._may_take(t):
            return self._grant(t)
        room, victim = self._room(t, priority)
        if not room:
            raise self._refused(t)
        if victim is not None:
            self._drop(victim)
            self.shed += 1
            victim.future.set_exception(busy(
                f"router at capacity: this request (priority {victim.priority}) was shed from "
                f"the queue for a more important one"))
        w = Waiter(t, priority, next(self._seq))
        t.waiters.append(w)
        self.waiting += 1
        return await self._wait(w, deadline)

    async def _wait(self, w: Waiter, deadline: float | None) -> Slot:
        wait = self.wait_s
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        try:
            # asyncio.wait, not wait_for: it neither cancels the future nor, on 3.11, swallows
            # a cancellation that comes as the slot is granted.
            await asyncio.wait((w.future,), timeout=wait)
        except asyncio.CancelledError:  # the client left
            if _granted(w):
                Slot(self, w.tenant).release()
            elif not w.future.done():
                self._drop(w)
            raise
        if not w.future.done():
            self._drop(w)
            self.shed += 1
            if deadline is not None and time.monotonic() >= deadline:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline exceeded while waiting for a slot")
            raise busy(f"router at capacity: waited {wait:.1f}s for a slot")
        if (shed := w.future.exception()) is not None:
            raise shed
        return Slot(self, w.tenant)

    # -- slots coming back ---------------------------------------------------------------------
    def _grant(self, t: _Tenant) -> Slot:
        t.held += 1
        self.inflight += 1
        return Slot(self, t)

    def _drop(self, w: Waiter) -> None:
        w.tenant.waiters.remove(w)
        self.waiting -= 1

    def _give_back(self, t: _Tenant) -> None:
        t.held -= 1
        self.inflight -= 1
        t.last_seen = time.monotonic()
        self._dispatch()

    def _dispatch(self) -> None:
        """Free slots to the waiters that may take them: the most important first, then the
        tenant furthest under its share, then the oldest."""
        while self.waiting and self.inflight < self.slots:
            ready = [w for u in self._tenants.values() if self._may_take(u) for w in u.waiters]
            if not ready:
                return
            best = min(ready, key=lambda w: (w.priority, w.tenant.held, w.seq))
            self._drop(best)
            best.tenant.held += 1
            self.inflight += 1
            best.future.set_result(None)


class FairThreads:
    """Jobs for a few threads (the router's tokenizer threads), taken from each tenant in turn.

    The tokenizer threads encode long prompts, render long chats, parse large bodies and compile
    structured-output grammars for every tenant. Handed to the threads first come first served,
    one key's flood of slow jobs (unique ``guided_json`` grammars, long prompts) put every other
    key's job behind all of its own (``tests/test_tokenizer_fairness.py``: a key flooding unique
    grammars made another key's long prompt 8x slower than idle). Here at most ``threads`` jobs
    run at once, and a thread that comes free takes the oldest job of the tenant with the fewest
    jobs running, among equals the one served longest ago: a newcomer's job waits for the jobs
    running, not for the queues of the others. With one tenant this is first come first served.

    ``refusal`` bounds each tenant's jobs (waiting or running) to its share of ``max_jobs``
    among the tenants with jobs, never the last quarter, when ``shared`` (several API keys).

    Loop-confined (the router's event loop): no locks.
    """

    def __init__(self, executor: Executor, threads: int, *, max_jobs: int,
                 shared: bool = False):
        self._executor = executor
        self.threads = threads
        self.max_jobs = max_jobs
        self.shared = shared
        self.running = 0  # jobs handed to the threads and not yet done
        self._jobs: dict[str, int] = {}  # bounded jobs (waiting or running) per tenant
        self._waiting: dict[str, deque[tuple[Callable[[], Any], asyncio.Future[Any]]]] = {}
        self._running: dict[str, int] = {}  # per tenant
        self._served: dict[str, int] = {}  # tenant -> when its latest job started (a count)
        self._starts = itertools.count()

    def refusal(self, tenant: str) -> str | None:
        """Why a new bounded job of ``tenant`` is refused (its share of the jobs is taken), or
        None."""
        if not self.shared:
            return None
        held = self._jobs.get(tenant, 0)
        present = len(self._jobs) + (tenant not in self._jobs)
        cap = max(1, min(self.max_jobs - self.max_jobs // 4,
                         math.ceil(self.max_jobs / present)))
        if held < cap:
            return None
        return (f"router busy: {held} jobs of this API key wait for the tokenizer (its share "
                f"of {self.max_jobs})")

    async def run(self, tenant: str, fn: Callable[[], T], *, bounded: bool = True) -> T:
        """``fn()`` on the threads, in ``tenant``'s turn; ``bounded`` jobs count in its share
        (``refusal`` is the caller's to check first)."""
        if bounded:
            self._jobs[tenant] = self._jobs.get(tenant, 0) + 1
        try:
            if self.running < self.threads and not self._waiting:
                return await self._start(tenant, fn)
            ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(tenant, deque()).append((fn, ready))
            try:
                started = await ready  # cancelled while waiting: the job is skipped
            except asyncio.CancelledError:
                if ready.done() and not ready.cancelled():  # started as the caller left
                    ready.result().cancel()
                raise
            return await started
        finally:
            if bounded:
                _count(self._jobs, tenant, -1)

    def _start(self, tenant: str, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        self.running += 1
        _count(self._running, tenant, 1)
        self._served[tenant] = next(self._starts)
        done = self._executor.submit(fn)
        # the thread is free when the job ends, whether or not its caller still waits
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, tenant))
        return asyncio.wrap_future(done, loop=loop)

    def _finished(self, tenant: str) -> None:
        self.running -= 1
        _count(self._running, tenant, -1)
        if tenant not in self._running and tenant not in self._waiting:
            del self._served[tenant]
        self._next()

    def _next(self) -> None:
        """Free threads to the tenants with jobs waiting: the fewest jobs running first, then
        the one served longest ago; each its oldest job still awaited."""
        while self.running < self.threads and self._waiting:
            tenant = min(self._waiting, key=lambda t: (self._running.get(t, 0),
                                                       self._served.get(t, -1)))
            jobs = self._waiting[tenant]
            fn, ready = jobs.popleft()
            if not jobs:
                del self._waiting[tenant]
            if not ready.cancelled():
                ready.set_result(self._start(tenant, fn))
            elif tenant not in self._running and tenant not in self._waiting:
                self._served.pop(tenant, None)


def _count(counts: dict[str, int], key: str, by: int) -> None:
    """``counts[key] += by``, the key dropped at 0."""
    left = counts.get(key, 0) + by
    if left:
        counts[key] = left
    else:
        del counts[key]
