"""Keep an engine's heap bounded: hand freed memory back to the OS (glibc), and cap oneDNN's
caches of compiled primitives.

A prefill step allocates activations sized by its prompt lengths (up to hundreds of MiB for a
long chunk). glibc keeps freed chunks in its arenas for reuse, and prompts of ever-different
lengths fragment them, so an engine's RSS grows without a leak: 1.6 -> 2.5 GiB over 3000
prompts of 8-1500 tokens (tiny model, engine alone; Python objects and tensors flat), where a
``malloc_trim(0)`` now and then keeps it flat at ~1.35 GiB. One call costs ~3 ms (measured),
so :class:`HeapTrimmer` makes it at most once per interval and only after prefill work. (It
returns free pages only: memory malloc still counts in use, such as oneDNN's primitive cache,
~150 MiB once warm in that run, stays.)

oneDNN compiles one primitive per GEMM shape, and a linear's shape includes its row count: every
new step size (prompt length, chunk, batch) is a new primitive of ~0.6 MiB (measured: 64 new row
counts of one 768 -> 3072 linear, +37-42 MiB). Two caches keep them: ideep's
(``LRU_CACHE_CAPACITY``) and oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), each 1024
entries by default, so under prompts of varied lengths a worker grows by hundreds of MiB before
they fill (tiny model, engine alone, 480 prompts of 8-1500 tokens: +484 MiB; both capped at 64,
+16 MiB over 1600 such prompts, in the same time). :data:`ONEDNN_CACHE_CAPACITY` bounds them at
~150 MiB, which holds a step's working set: the runner pads steps to a few row counts (see
``padded_rows`` in :mod:`kvrelay.engine.step_inputs`) and a decode loop's shapes are used every
step, so LRU keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
ONEDNN_CACHE_CAPACITY = 256  # primitives per cache: ~150 MiB at most
ONEDNN_CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's primitive caches (ideep's and oneDNN's own) unless the environment already
    sets them. Both are read when the process first runs a oneDNN op, so call this before
    that (after ``import torch`` is fine). Returns the values in effect."""
    for var in ONEDNN_CACHE_VARS:
        os.environ.setdefault(var, str(capacity))
    return {var: os.environ[var] for var in ONEDNN_CACHE_VARS}


def libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` after steps that ran prefill tokens, at most once per
    ``interval_s``."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None):
        self.interval_s = interval_s
        self._clock = clock
        self._trim = trim if trim is not None else libc_malloc_trim()
        self._last = clock()
        self._pending_tokens = 0
        self.num_trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_step(self, prefill_tokens: int) -> bool:
        """Note a step's prefill tokens; trim when some are pending and the interval has
        passed. Returns whether it trimmed."""
        if self._trim is None:
            return False
        self._pending_tokens += prefill_tokens
        now = self._clock()
        if not self._pending_tokens or now - self._last < self.interval_s:
            return False
        self._trim(0)
        logger.debug("heap trimmed after %d prefill tokens", self._pending_tokens)
        self._last, self._pending_tokens = now, 0
        self.num_trims += 1
        return True
