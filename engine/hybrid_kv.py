"""The hybrid KV layout: per-layer-group pages for a model whose layers differ in window (Gemma 3's
5 local : 1 global, gpt-oss's alternating window-128 and full layers). Pure arithmetic, no torch.

Why: one block table for every layer means a block goes back to the pool only when no layer
reads it, and a hybrid's full-attention layers read every block, so a long decode holds its
whole context in every layer (``kv_window.py``). Here the layers are cut into *groups* of ``k``
layers of one kind (full attention, or one window ``w``), and a *page* is ``k`` layers' worth of
one block of one group: the KV tensor is ``[k slots, planes, num_pages, block_size, H, D]``, and
layer ``l`` reads slot ``slot[l]`` of the pages its group's block table names. A sequence's
logical block ``i`` is one page per group; a windowed group's page of a block wholly before the
window goes back to the one free list every group draws from (``hybrid_blocks.py``), so a long
decode holds ``ceil(w / bs) + 1`` pages per windowed group instead of its whole context, and a
short context (inside the window) still uses the whole pool.

``k``: the count of the rarer kind, so each kind fills whole groups, unless that pads more than
1/8 of the layers (a short group's unused slots are memory no layer reads); then the largest
smaller ``k`` that does not (at worst 1: a group per layer, one block table each per step).
Gemma 3 1B (4 global, 22 local): k=4, 7 groups, 2 padded slots; gpt-oss (12 + 12): k=12, 2
groups; a 6-layer Gemma (1 : 5): k=1, 6 groups.

A step (``ModelRunner.prepare``) gives each backend one ``StepLayout`` per group, whose slots
and tables name that group's pages, and the metadata it builds per group rides in
``AttentionMetadata.groups``: each layer attends with its group's (``Attention._step_meta``). A
windowed group's tables start at the first block its queries read, lengths counted from there
(every mask is relative), so no backend gathers or indexes a page given back. CUDA graphs keep
static buffers per group (``cuda/graphs.py``), a windowed group's as wide as its window, and a
scratch page per group for the padding rows. The fused CPU decode layers read one table: the
runner turns them off under this layout.

A model with no window, or one window on every layer, is not a hybrid (:func:`plan_groups`
returns None): it keeps the one-table layout (``kv_cache.py``), byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The most padded slots a plan may have, as a fraction of the layers.
MAX_PAD = 1 / 8


@dataclass(frozen=True)
class KVGroups:
    """Layers in groups of ``k``, each group of one window (None: full attention)."""

    k: int
    windows: tuple[int | None, ...]  # per group
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, slot order (may be < k)
    group_of: tuple[int, ...]  # per layer
    slot_of: tuple[int, ...]  # per layer

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def window_values(self) -> tuple[int, ...]:
        """The distinct windows, ascending."""
        return tuple(sorted({w for w in self.windows if w is not None}))

    def groups_of_window(self, window: int) -> tuple[int, ...]:
        return tuple(g for g, w in enumerate(self.windows) if w == window)

    @property
    def padded_slots(self) -> int:
        return self.k * self.num_groups - len(self.group_of)

    @property
    def signature(self) -> str:
        """The plan in words, for a KV layout handshake: peers address pages alike only when
        their plans are equal (``kv_transfer/layout.py``)."""
        windows = ",".join("full" if w is None else str(w) for w in self.windows)
        layers = "/".join(",".join(map(str, g)) for g in self.layers)
        return f"k={self.k};windows={windows};layers={layers}"

    def pages_held(self, num_blocks: int, first_held: dict[int, int]) -> int:
        """Pages a sequence of ``num_blocks`` logical blocks references when it holds each
        window ``w``'s pages from block ``first_held[w]`` on."""
        return sum(num_blocks if w is None else num_blocks - first_held.get(w, 0)
                   for w in self.windows)


def plan_groups(layer_windows: Sequence[int | None]) -> KVGroups | None:
    """The groups of a model with these per-layer windows, or None where it is not a hybrid
    (no window, or every layer windowed: ``BlockManager.release_out_of_window`` serves that)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(layer)
    if len(kinds) < 2 or None not in kinds:
        return None
    n = len(layer_windows)
    k = min(len(v) for v in kinds.values())
    while k > 1 and sum(-(-len(v) // k) * k - len(v) for v in kinds.values()) > MAX_PAD * n:
        k -= 1
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    group_of = [0] * n
    slot_of = [0] * n
    # full attention first: group 0 is always a full group
    for w in sorted(kinds, key=lambda w: -1 if w is None else w):
        members = kinds[w]
        for start in range(0, len(members), k):
            chunk = tuple(members[start:start + k])
            for slot, layer in enumerate(chunk):
                group_of[layer], slot_of[layer] = len(windows), slot
            windows.append(w)
            layers.append(chunk)
    return KVGroups(k, tuple(windows), tuple(layers), tuple(group_of), tuple(slot_of))
