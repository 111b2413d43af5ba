"""Which of a prompt's blocks a sliding-window layer still needs after the handoff: pure
arithmetic, no I/O.

A decode worker computes from position ``P`` (the prompt's length) on; a layer with window
``w`` lets the token at position ``p`` see keys ``(p - w, p]``, so from the handoff on it reads
no prompt key before ``P - w + 1``. Block ``i`` (positions ``[i * bs, (i + 1) * bs)``) is then
read by that layer iff its last prompt position reaches ``P - w + 1``: iff ``w >= need(i)``
with ``need(i) = P - min((i + 1) * bs, P) + 2``. Full-attention layers read every block. So
the sender of a prompt's KV writes each block only for the layers that will read it; for a
model whose every layer is windowed (Mistral with ``sliding_window``) that is the last
``ceil(w / bs) + 1`` blocks at most, and for Gemma 3 (5 local : 1 global) ~1/6 of the bytes of
a prompt much longer than the window.

The blocks not written hold whatever the receiver's pool left there (zeros, or an earlier
request's finite KV). The receiver never attends to them: the native paged decode kernel does
not even load keys before ``p - w + 1``, torch SDPA gathers whole block tables and masks them
(flash-attn's paged kernel skips blocks wholly left of the window). The receiver publishes
them as *partial* (``BlockManager.mark_holes``): a later prompt may take a cached prefix that
holds them only if it ends where its windowed layers read none of them (the full-attention
layers' KV is in every block), so a follow-up turn still finds the conversation's head at the
decode worker; a partial block is never copied to a peer or a tier.

Blocks held: with one block table for every layer (a block id is the same slot of every
layer's K and V planes), a block can go back to the pool only when no layer reads it any more.
A model whose every layer is windowed gives back, as it decodes, the blocks wholly before its
widest window (``common_window``, ``BlockManager.release_out_of_window``): a long decode holds
``ceil(w / bs) + 1`` blocks per sequence instead of its whole context. A hybrid (Gemma 3, 5
local : 1 global; gpt-oss) holds every block that way: its global layers read them all. With
``--hybrid-kv auto`` it gets a page table per group of layers of one window instead
(``hybrid_kv.py``, ``hybrid_blocks.py``: one pool of pages, a page per layer group per block),
and its local layers' pages behind the window go back as it prefills and decodes: a long
decode holds its global layers' share of the context plus each local group's window (measured:
``bench.engine.swa_blocks``). A P/D handoff under it writes each layer group's pages of the
blocks that group reads (:class:`PageWrites`) into the pages the receiver's reservation holds
(none of a windowed group's blocks before its window: ``HybridBlockManager.page_ids``), and a
prefix pull reads the pages a continuation reads (``prefix_shares.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvrelay.engine.hybrid_kv import KVGroups


def block_needs(first: int, count: int, num_prompt_tokens: int, block_size: int) -> list[int]:
    """For blocks ``first .. first + count - 1`` of a prompt of ``num_prompt_tokens``: the
    smallest window of a layer that reads the block after the handoff (see the module)."""
    p = num_prompt_tokens
    return [p - min((i + 1) * block_size, p) + 2 for i in range(first, first + count)]


class LayerWrite(NamedTuple):
    """K and V of ``layers`` for the block pairs ``local[i] -> remote[i]``."""

    layers: tuple[int, ...]
    local: list[int]
    remote: list[int]


class LayerWindows:
    """A model's windows per layer (None: full attention), splitting a write of some layers'
    blocks into the writes each group of layers of one window needs."""

    def __init__(self, windows: Sequence[int | None]):
        self.windows = tuple(windows)
        self.windowed = any(w is not None for w in self.windows)

    def split(self, layers: Sequence[int], local: list[int], remote: list[int],
              needs: Sequence[int] | None) -> list[LayerWrite]:
        """The writes of ``layers`` for the block pairs, each pair only to the layers that read
        it (``needs[i]``: its pair's need, ``block_needs``; None: every layer reads every pair).
        Writes with no pair are left out; the layers of one window share a write."""
        layers = tuple(layers)
        if not self.windowed or needs is None or not layers:
            return [LayerWrite(layers, local, remote)] if local and layers else []
        by_window: dict[int | None, list[int]] = {}
        for layer in layers:
            by_window.setdefault(self.windows[layer], []).append(layer)
        out = []
        for w, group in by_window.items():
            if w is None or all(n <= w for n in needs):
                loc, rem = local, remote
            else:
                keep = [i for i, n in enumerate(needs) if n <= w]
                loc, rem = [local[i] for i in keep], [remote[i] for i in keep]
            if loc:
                out.append(LayerWrite(tuple(group), loc, rem))
        return out

    @property
    def common_window(self) -> int | None:
        """The widest window when every layer has one (a block out of it is dead for the whole
        model: ``BlockManager.release_out_of_window``), else None."""
        if not self.windows or any(w is None for w in self.windows):
            return None
        return max(w for w in self.windows if w is not None)

    @property
    def widest(self) -> int | None:
        """The widest window of any layer (None: no layer windowed)."""
        return max((w for w in self.windows if w is not None), default=None)

    def holes_end(self, num_prompt_tokens: int, block_size: int) -> int:
        """How many leading blocks of a windowed handoff of a prompt this long some layer
        skips (0: none; ``BlockManager.mark_holes``)."""
        if not self.windowed or num_prompt_tokens <= 0:
            return 0
        narrowest = min(w for w in self.windows if w is not None)
        n = -(-num_prompt_tokens // block_size)
        return sum(need > narrowest for need in block_needs(0, n, num_prompt_tokens, block_size))

    def pairs_written(self, first: int, count: int, num_prompt_tokens: int,
                      block_size: int) -> int:
        """(layer, block) pairs a handoff of blocks ``first .. first + count - 1`` writes (a
        model with no window: ``num_layers * count``)."""
        needs = block_needs(first, count, num_prompt_tokens, block_size)
        return sum(count if w is None else sum(n <= w for n in needs) for w in self.windows)

    def missing_pages(self, groups: KVGroups, pages: Sequence[Sequence[int]], first: int,
                      num_prompt_tokens: int, block_size: int) -> list[tuple[int, int]]:
        """Under the hybrid layout, ``(block, group)`` of a handoff's blocks ``first ..`` that
        some layer of the group reads but ``pages[block][group]`` names no page (-1): a
        destination must hold a page for every pair the handoff writes."""
        needs = block_needs(first, len(pages) - first, num_prompt_tokens, block_size)
        return [(first + i, g) for i, n in enumerate(needs)
                for g, w in enumerate(groups.windows)
                if (w is None or n <= w) and pages[first + i][g] < 0]

    def has_holes(self, num_prompt_tokens: int, block_size: int) -> bool:
        """Whether a windowed handoff of a prompt this long leaves some layer's block unwritten
        (then the receiver must never serve the blocks as a cached prefix)."""
        return self.holes_end(num_prompt_tokens, block_size) > 0


class PageWrites:
    """The writes of a hybrid KV layout (``hybrid_kv.py``): a block is a page per layer group,
    so a block pair is ``local[i][g] -> remote[i][g]`` (-1: that side holds no page of group
    ``g``), and layer ``l`` is slot ``slot_of[l]`` of its group's pages. ``split`` has the
    interface of :meth:`LayerWindows.split` over such pairs, and returns writes whose
    ``layers`` are slots and whose blocks are pages: what a transport addresses in a tensor of
    ``[k slots, planes, pages, ...]``, a one-table layout's arithmetic unchanged."""

    def __init__(self, groups: KVGroups):
        self.groups = groups

    def split(self, layers: Sequence[int], local: Sequence[Sequence[int]],
              remote: Sequence[Sequence[int]], needs: Sequence[int] | None) -> list[LayerWrite]:
        """One write per layer group that has some of ``layers``: its pages of the pairs its
        layers read (``needs`` as in ``LayerWindows.split``). Both sides hold a page of each
        such pair (the destination was checked: ``LayerWindows.missing_pages``; the sender
        holds its windowed pages from the prompt's window on)."""
        wanted = set(layers)
        out = []
        g = self.groups
        for group, (w, members) in enumerate(zip(g.windows, g.layers, strict=True)):
            slots = tuple(g.slot_of[x] for x in members if x in wanted)
            if not slots:
                continue
            keep = range(len(local)) if w is None or needs is None else \
                [i for i, n in enumerate(needs) if n <= w]
            loc = [local[i][group] for i in keep]
            rem = [remote[i][group] for i in keep]
            assert min(loc + rem, default=0) >= 0, ("a written pair without a page", group)
            if loc:
                out.append(LayerWrite(slots, loc, rem))
        return out
