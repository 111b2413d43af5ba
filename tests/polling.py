"""Bounded polling for tests: wait until a condition holds, or fail saying what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    """``pred()``'s first truthy value, polled every ``every`` seconds; TimeoutError naming
    ``what`` once ``timeout`` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not within {timeout:g}s")
        time.sleep(every)
