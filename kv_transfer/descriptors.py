"""Descriptor arithmetic of the KV tensor: one NIXL descriptor per (layer, K|V, block).

Row ``(layer * 2 + kv) * num_blocks + block`` of an engine's descriptor list addresses
``KVCacheSpec.plane_block_offset(layer, kv, block)``, so a write is a pair of index lists. NIXL
merges descriptors that are adjacent on both sides, so consecutive blocks cost one copy.
Pure numpy/Python: no NIXL here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrelay.kv_transfer.layout import KVLayout

_SMALL = 512  # below this many indices plain Python beats numpy's per-call overhead


def region_descs(base_address: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """``[n, 3]`` (address, length, device) rows in tensor order, for ``prep_xfer_dlist``."""
    n = layout.num_layers * 2 * layout.num_blocks
    bb = layout.block_bytes
    descs = np.empty((n, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_address) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
    descs[:, 1] = bb
    descs[:, 2] = device_id
    return descs


def plane_indices(planes: Sequence[int], block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """Indices of ``block_ids`` in each plane (``plane = layer * 2 + kv``), plane-major."""
    return [p * num_blocks + b for p in planes for b in block_ids]


def plane_block_indices(planes: Sequence[int], block_ids: Sequence[int],
                        num_blocks: int) -> list[int] | np.ndarray:
    """``plane_indices``, as an int32 array when large (what ``make_prepped_xfer`` takes)."""
    if len(planes) * len(block_ids) <= _SMALL:
        return plane_indices(planes, block_ids, num_blocks)
    idx = np.asarray(planes, dtype=np.int64)[:, None] * num_blocks + np.asarray(block_ids)[None, :]
    return idx.ravel().astype(np.int32)


def block_bounds(ids: Sequence[int]) -> tuple[int, int]:
    """(min, max) of block ids."""
    if len(ids) > _SMALL:
        a = np.asarray(ids)
        return int(a.min()), int(a.max())
    return min(ids), max(ids)
