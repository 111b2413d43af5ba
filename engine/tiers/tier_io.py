"""The thread that moves blocks between the host tier and the disk tier.

Jobs run one at a time in submission order, which is what keeps them correct without locks:
a spill of a host slot is submitted before the store that reuses that slot, so it reads the
old bytes first. The engine thread submits jobs and collects their results (``poll``) at the
start of each step; it never waits on a job on its own path. File IO and the CRC release the
GIL, so the thread costs the engine little beyond the memory traffic.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class JobResult(NamedTuple):
    tag: Any  # what the submitter needs to apply the result
    value: Any  # the job's return value (None when it raised)
    error: BaseException | None


class TierIO:
    def __init__(self, name: str = "kv-tier-io"):
        self._jobs: queue.SimpleQueue[tuple[Any, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self.in_flight = 0  # submitted, not yet polled (engine thread only)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tag: Any, job: Callable[[], Any]) -> None:
        self.in_flight += 1
        self._jobs.put((tag, job))

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
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            tag, job = item
            try:
                self._done.put(JobResult(tag, job(), None))
            except Exception as e:  # a failed job is reported to the engine, never fatal here
                logger.warning("tier IO job %r failed: %s", tag, e)
                self._done.put(JobResult(tag, None, e))
