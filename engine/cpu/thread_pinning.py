"""The engine's OpenMP threads pinned one per CPU.

Unpinned, the OS decides where the engine's threads run, and after an idle gap it decides
badly: the thread that wakes the sleeping OpenMP worker is often given that worker on its own
CPU (the scheduler's wake-affine placement), and the two share one CPU, a scheduler slice at a
time, until load balancing moves one away some 10-20 ms later. Every parallel region in that
window takes ~1-2 ms instead of microseconds. Measured on the 2-vCPU host (a plain C OpenMP
loop, a parallel region after 20-300 ms idle): the first ~15 regions 0.5-1 ms each, 2.4 us once
warm; pinned, the first 80 us and then 2.4 us. In the engine, the ~7M demo model on both cores,
one request after 0.3 s idle: a 1-token step 11.8 ms (p90 15.7) unpinned against 1.9 ms (2.2)
pinned, a 256-token prefill 22.2 ms (p90 29.5) against 18.2 (20.2). A served request at a few
requests per second arrives after such gaps: this was most of the TTFT tail.

``auto`` pins only where the process may run on exactly as many CPUs as the engine has
threads (a worker given its cores: ``taskset``, a cgroup cpuset, the benchmark's pinning):
there every CPU is the engine's and pinning cannot stack two engines on one CPU. ``on`` pins
to the first ``num_threads`` CPUs the process may use; ``off`` leaves placement to the OS.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from kvrelay.engine.config import THREAD_BINDINGS as MODES
from kvrelay.engine.cpu import native

logger = logging.getLogger(__name__)


def plan(mode: str, threads: int, allowed: set[int]) -> list[int] | None:
    """The CPU of each engine thread (the calling thread first), or None: leave them be."""
    if mode not in MODES:
        raise ValueError(f"thread binding must be one of {MODES}, got {mode!r}")
    if mode == "off" or threads < 2 or len(allowed) < threads:
        return None
    if mode == "auto" and len(allowed) != threads:
        return None
    return sorted(allowed)[:threads]


def pin_engine_threads(mode: str, device: torch.device) -> dict[int, int]:
    """Pin the calling thread (the one that runs the engine's steps) and its OpenMP workers per
    :func:`plan`; returns ``{thread id: cpu}`` of the threads pinned (empty: none)."""
    if device.type != "cpu":
        return {}
    cpus = plan(mode, torch.get_num_threads(), os.sched_getaffinity(0))
    if cpus is None:
        return {}
    lib = native.load()
    if lib is None:
        logger.info("engine threads not pinned: the native kernels are unavailable")
        return {}
    n = len(cpus)
    arr = (ctypes.c_int32 * n)(*cpus)
    tids = (ctypes.c_int64 * n)()
    left = lib.kvr_pin_threads(arr, n, tids)
    pinned = {int(t): c for t, c in zip(tids, cpus, strict=True) if t}
    if left:
        logger.warning("pinned %d of %d engine threads (CPUs %s)", len(pinned), n, cpus)
    else:
        logger.info("engine threads pinned to CPUs %s", cpus)
    return pinned
