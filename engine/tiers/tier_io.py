"""The thread that moves blocks between the host tier and the disk tier.

Jobs run one at a time: *urgent* ones (loads a request waits for) before *background* ones
(spills), each kind in submission order. No job needs another's order to be correct: a spill
reads a staging copy or a pinned host slot and writes a disk slot no load can read until the
spill has completed, and a load reads a pinned disk slot into a host slot nothing else reads
until the load has completed. The engine thread submits jobs and collects their results
(``poll``) at the start of each step; it never waits on a job on its own path. File IO and the
CRC release the GIL, so the thread costs the engine little beyond the memory traffic.
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
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tag: Any, job: Callable[[], Any], *, urgent: bool = False) -> None:
        self.in_flight += 1
        with self._cv:
            (self._urgent if urgent else self._background).append((tag, job))
            self._cv.notify()

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
        """Finish the jobs submitted, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _next(self) -> tuple[Any, Callable[[], Any]] | None:
        with self._cv:
            while not (self._urgent or self._background or self._closing):
                self._cv.wait()
            if self._urgent:
                return self._urgent.popleft()
            if self._background:
                return self._background.popleft()
            return None  # closing, nothing left

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            tag, job = item
            try:
                self._done.put(JobResult(tag, job(), None))
            except Exception as e:  # a failed job is reported to the engine, never fatal here
                logger.warning("tier IO job %r failed: %s", tag, e)
                self._done.put(JobResult(tag, None, e))
