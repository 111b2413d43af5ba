"""Per-request timeline marks for latency breakdowns across processes.

``mark(event, request_id)`` logs ``"mark <event> <request_id> <time.monotonic()>"`` on the
``kvrelay.timeline`` logger at DEBUG; off by default, so a mark costs one level check. On Linux
``time.monotonic()`` is CLOCK_MONOTONIC, shared by every process of a host, so marks from the
prefill and decode workers line up (``bench/transfer/pd_latency.py`` parses them from the logs).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("kvrelay.timeline")


def mark(event: str, request_id: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("mark %s %s %.6f", event, request_id, time.monotonic())
