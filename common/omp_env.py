"""OpenMP settings of an engine process, applied before anything loads an OpenMP runtime.

GNU OpenMP (torch's CPU build and the native kernels both use it) lets a thread that finishes
its share of a parallel region spin on the CPU for ``GOMP_SPINCOUNT`` iterations (300 000 by
default, a few hundred microseconds) before it sleeps, so the next region starts without a
wake-up. An engine step is dozens of short regions with Python host work between them, and on
a machine where the engine shares its cores with the router, the client or a second worker,
that spinning takes the time those processes needed: measured on the 2-core host with the tiny
model at saturation (200 x 256->32, router and client on the same cores), 20 000 spins gave
+7-22% output tok/s in five paired runs against the default and took ~2 core-seconds less
worker CPU per run; ``OMP_WAIT_POLICY=PASSIVE`` (no spinning) lost as often as it won.

The runtime reads these variables once, when it loads: :func:`apply_worker_omp_defaults` must
run before ``torch`` (or a native kernel) is imported. A value the user set is kept.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

WORKER_OMP_DEFAULTS: dict[str, str] = {"GOMP_SPINCOUNT": "20000"}


def apply_worker_omp_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every unset variable of :data:`WORKER_OMP_DEFAULTS` in ``env`` (``os.environ`` by
    default); return the ones set. Warns when torch is already loaded (too late to matter)."""
    target = os.environ if env is None else env
    applied = {k: v for k, v in WORKER_OMP_DEFAULTS.items() if k not in target}
    target.update(applied)
    if applied and env is None and "torch" in sys.modules:
        logger.warning("OpenMP defaults %s set after torch was imported: they take no effect "
                       "in this process", applied)
    return applied
