"""The threads that move blocks between the host tier and the disk tier.

Two threads, each running its kind of job one at a time in submission order: *urgent* ones
(loads a request waits for) and *background* ones (spills). No job needs another's order to be
correct, nor to run alone: a spill reads a staging copy or a pinned host slot and writes a disk
slot (a file of its own) no load can read until the spill has completed, and a load reads a
pinned disk slot into a host slot nothing else reads until the load has completed. So a load
a request waits for never queues behind a spill already running.

Both threads run at the process's priority. A spill thread at the lowest one (nice 19) was
tried: a decode with every block spilling behind it stayed 8 % slower on two cores (the file
writes' kernel work and writeback, not the thread), and under a full test suite's load the
starved spills left the host tier full of blocks it should have moved to disk, so the tier
chose other blocks to evict (bench/results/kv_tiers.txt).

The engine thread submits jobs and collects their results (``poll``) at the start of each step;
it never waits on a job on its own path. File IO and the CRC release the GIL, so the threads
cost the engine little beyond the memory traffic.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class JobResult(NamedTuple):
    tag: Any  # what the submitter needs to apply the result
    value: Any  # the job's return value (None when it raised)
    error: BaseException | None


class TierIO:
    def __init__(self, name: str = "kv-tier-io"):
        self._urgent: deque[tuple[Any, Callable[[], Any]]] = deque()
        self._background: deque[tuple[Any, Callable[[], Any]]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self.in_flight = 0  # submitted, not yet polled (engine thread only)
        self._threads = [threading.Thread(target=self._run, args=(urgent,), daemon=True,
                                          name=f"{name}-{'urgent' if urgent else 'background'}")
                         for urgent in (True, False)]
        for t in self._threads:
            t.start()

    def submit(self, tag: Any, job: Callable[[], Any], *, urgent: bool = False) -> None:
        self.in_flight += 1
        with self._cv:
            (self._urgent if urgent else self._background).append((tag, job))
            self._cv.notify_all()

    def poll(self) -> list[JobResult]:
        """Results of the jobs finished since the last poll, in completion order."""
        out: list[JobResult] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        return out

    def drain(self, timeout_s: float = 30.0) -> list[JobResult]:
        """Wait for every submitted job (tests, shutdown); returns their results."""
        out: list[JobResult] = []
        while self.in_flight > len(out):
            try:
                out.append(self._done.get(timeout=timeout_s))
            except queue.Empty:
                logger.warning("tier IO: %d jobs still running after %.0f s",
                               self.in_flight - len(out), timeout_s)
                break
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        """Finish the jobs submitted, then stop the threads."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)

    def _next(self, urgent: bool) -> tuple[Any, Callable[[], Any]] | None:
        jobs = self._urgent if urgent else self._background
        with self._cv:
            while not (jobs or self._closing):
                self._cv.wait()
            if jobs:
                return jobs.popleft()
            return None  # closing, nothing left

    def _run(self, urgent: bool) -> None:
        while True:
            item = self._next(urgent)
            if item is None:
                return
            tag, job = item
            try:
                self._done.put(JobResult(tag, job(), None))
            except Exception as e:  # a failed job is reported to the engine, never fatal here
                logger.warning("tier IO job %r failed: %s", tag, e)
                self._done.put(JobResult(tag, None, e))

