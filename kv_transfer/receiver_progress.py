"""The receiving side's UCX progress, off the engine thread.

NIXL notifications (and, over TCP, the data itself) move only when the receiver progresses its
UCX worker. Progressing once per engine step is too rare on a GPU worker whose steps are long:
a long prompt over TCP then stalls the sender into its write timeout. While the connector
expects KV, this thread progresses every ``interval_s``; otherwise it sleeps on an event.

A holder lending blocks to a peer's read (a prefix pull) runs one too, while a loan is open:
the reader's first read on a fresh connection waits for this side's handshake answer."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvrelay.kv_transfer.errors import KVTransferError

logger = logging.getLogger(__name__)


class ReceiverProgress:
    def __init__(self, progress: Callable[[], None], expecting: Callable[[], bool],
                 interval_s: float, on_start: Callable[[], None] | None = None,
                 name: str = "kv-recv-progress") -> None:
        self._progress, self._expecting = progress, expecting
        self._interval = interval_s
        self._on_start = on_start
        self._name = name
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        """Something is now expected: progress until nothing is."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name,
                                            daemon=True)
            self._thread.start()
        self._kick.set()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            self._kick.wait()
            self._kick.clear()
            while self._expecting() and not self._stop.wait(self._interval):
                try:
                    self._progress()
                except KVTransferError as e:  # the engine's own poll reports it
                    logger.debug("receiver progress: %s", e)
