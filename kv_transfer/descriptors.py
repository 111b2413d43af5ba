"""Descriptor arithmetic of the KV tensor: one NIXL descriptor per (layer, plane, block), a
plane being K or V (or, in a latent layout, the one latent plane: ``KVLayout.planes``).

Row ``(layer * planes + kv) * num_blocks + block`` of an engine's descriptor list addresses
``KVCacheSpec.plane_block_offset(layer, kv, block)``, so a write is a pair of index lists. NIXL
merges descriptors that are adjacent on both sides, so consecutive blocks cost one copy.
Pure numpy/Python: no NIXL here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrelay.kv_transfer.layout import HeadRun, KVLayout

_SMALL = 512  # below this many indices plain Python beats numpy's per-call overhead


def layer_planes(layers: Sequence[int], planes: int) -> list[int]:
    """The plane rows of ``layers`` (each layer's K and V, or its one latent plane)."""
    return [layer * planes + kv for layer in layers for kv in range(planes)]


def region_descs(base_address: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """``[n, 3]`` (address, length, device) rows in tensor order, for ``prep_xfer_dlist``."""
    return uniform_descs(base_address, layout.num_layers * layout.planes * layout.num_blocks,
                         layout.block_bytes, device_id)


def rank_region_descs(rank_addresses: Sequence[int], layout: KVLayout,
                      device_id: int) -> np.ndarray:
    """``region_descs`` of every rank's KV tensor, rank after rank: rank ``r``'s (plane, block)
    row at ``r * num_layers * planes * num_blocks`` plus its own index."""
    return np.concatenate([region_descs(a, layout, device_id) for a in rank_addresses])


def uniform_descs(base_address: int, n: int, nbytes: int, device_id: int) -> np.ndarray:
    """``[n, 3]`` rows of ``n`` adjacent regions of ``nbytes`` each from ``base_address``."""
    descs = np.empty((n, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_address) + np.arange(n, dtype=np.uint64) * np.uint64(nbytes)
    descs[:, 1] = nbytes
    descs[:, 2] = device_id
    return descs


def plane_indices(planes: Sequence[int], block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """Indices of ``block_ids`` in each plane (``plane = layer * planes + kv``), plane-major."""
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


def split_descs(local: KVLayout, local_addrs: Sequence[int], remote: KVLayout,
                remote_addrs: Sequence[int], runs: Sequence[HeadRun], planes: Sequence[int],
                local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                local_device: int = 0, remote_device: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination ``[n, 3]`` rows of a write between engines whose KV heads are split
    over ranks differently (``runs`` from :func:`~kvrelay.kv_transfer.layout.head_runs`).

    A block is ``[block_size, heads, head_dim]``: where a run is every head of both ranks' blocks,
    a block is one contiguous row; otherwise each token's slice of the run's heads is one row
    (strided by each side's heads per token). Heads first (``KVLayout.heads_first``, both
    sides), a block is ``[heads, block_size, head_dim]``: every run is one row per block."""
    bs, hd = local.block_size, local.head_dim
    esz = local.block_bytes // (bs * local.num_kv_heads * hd)
    heads_first = local.heads_first
    # Bytes from one token to the next, and from one head to the next, inside a block.
    tok_l, tok_r = (hd * esz,) * 2 if heads_first else \
        (local.num_kv_heads * hd * esz, remote.num_kv_heads * hd * esz)
    head_step = bs * hd * esz if heads_first else hd * esz
    p = np.asarray(planes, dtype=np.uint64)[:, None]
    lb = (p * np.uint64(local.num_blocks)
          + np.asarray(local_block_ids, dtype=np.uint64)[None, :]).ravel()
    rb = (p * np.uint64(remote.num_blocks)
          + np.asarray(remote_block_ids, dtype=np.uint64)[None, :]).ravel()
    src_parts, dst_parts = [], []
    for run in runs:
        whole = run.count == local.num_kv_heads == remote.num_kv_heads
        one_row = whole or heads_first
        toks = np.zeros(1, dtype=np.uint64) if one_row else np.arange(bs, dtype=np.uint64)
        length = run.count * head_step if heads_first else \
            local.block_bytes if whole else run.count * hd * esz
        for parts, base, blocks, bb, tok, head, dev in (
                (src_parts, local_addrs[run.src], lb, local.block_bytes, tok_l, run.src_head,
                 local_device),
                (dst_parts, remote_addrs[run.dst], rb, remote.block_bytes, tok_r, run.dst_head,
                 remote_device)):
            rows = np.empty((blocks.size * toks.size, 3), dtype=np.uint64)
            rows[:, 0] = (np.uint64(base + head * head_step) + blocks[:, None] * np.uint64(bb)
                          + toks[None, :] * np.uint64(tok)).ravel()
            rows[:, 1] = length
            rows[:, 2] = dev
            parts.append(rows)
    return np.concatenate(src_parts), np.concatenate(dst_parts)
