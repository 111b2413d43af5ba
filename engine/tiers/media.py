"""Tier names, their default routing weights, and the per-tier counters an engine reports.

Pure Python (no torch): the router imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE = "device"  # the engine's KV pool
HOST = "host"  # --kv-offload-memory: DRAM (pinned and NIXL-registered on a GPU worker)
DISK = "disk"  # --kv-offload-dir: files on a local disk
MEDIA = (DEVICE, HOST, DISK)

# What a prefix block held in each tier is worth to the prefix-aware router before it has a
# measured load cost for the worker (1.0: as good as held in the pool; 0: as good as absent).
DEFAULT_TIER_WEIGHTS = {DEVICE: 1.0, HOST: 0.75, DISK: 0.25}


@dataclass
class TierStats:
    """Counters of one tier below the pool (``host`` or ``disk``), cumulative since start."""

    medium: str
    capacity_blocks: int  # slots (one block across every layer each)
    used_blocks: int = 0  # slots holding a block (stored or in flight)
    stored_blocks: int = 0  # blocks written into this tier
    stored_bytes: int = 0
    hit_blocks: int = 0  # blocks promoted from this tier for a prefix hit
    loaded_bytes: int = 0
    load_seconds: float = 0.0  # summed over loads (for the mean load cost per block)
    load_failures: int = 0  # loads that failed verification: the request recomputed
    evicted_blocks: int = 0  # blocks dropped from this tier (or moved down from it)

    @property
    def load_seconds_per_block(self) -> float:
        return self.load_seconds / self.hit_blocks if self.hit_blocks else 0.0
