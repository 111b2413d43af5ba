"""The garbage collector of a long-running serving process.

A router or worker allocates many short-lived objects per token (protobuf messages, chunks,
futures, dicts), almost none of them in reference cycles. With CPython's default thresholds a
young-generation collection runs every 700 net allocations, and every so often a full one walks
the whole heap, which after startup holds the tokenizer, transformers' modules, the model's
Python objects and the gRPC machinery: hundreds of thousands of objects that will live as long
as the process. Profiled under a saturation load, the collector was a fifth of the router's busy
time.

:func:`settle_after_startup` runs once a process is up: it collects what startup left, moves
every surviving object into the permanent generation (``gc.freeze``), so no later collection
walks them, and raises the young generation's threshold, so collections come less often; cycles
are still found, later. ``KVRELAY_GC_GEN0=0`` leaves the collector as it is.
"""

from __future__ import annotations

import gc
import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_GEN0 = 20_000


def settle_after_startup(gen0: int | None = None) -> None:
    """Freeze the startup heap and raise the young generation's threshold (see the module)."""
    if gen0 is None:
        raw = os.environ.get("KVRELAY_GC_GEN0", "")
        try:
            gen0 = int(raw) if raw else DEFAULT_GEN0
        except ValueError:
            raise ValueError(f"KVRELAY_GC_GEN0 must be an integer, got {raw!r}") from None
    if gen0 <= 0:
        return
    gc.collect()
    gc.freeze()
    gen0 = max(gen0, gc.get_threshold()[0])
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
    logger.debug("gc: %d objects frozen, thresholds %s", gc.get_freeze_count(),
                 gc.get_threshold())
