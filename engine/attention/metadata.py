"""Per-step attention metadata, entered through a context manager that always resets.

A step's new tokens are flattened into one ``[T]`` batch: prefill segments first (each a run of
query tokens of one sequence), then decodes (one token per sequence). The metadata says where
each new token's K/V goes (``slot_mapping``) and which cached slots each query attends to.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvrelay.engine.kv_cache import slot_rows


@dataclass
class PrefillSpan:
    """One sequence's query tokens ``[q_start, q_start + q_len)`` of the flat batch.

    ``ctx_len`` keys are visible (cached prefix plus the new tokens); ``ctx_slots`` lists their
    cache slots and is None when there is no cached prefix (then keys come straight from this
    step's K/V).
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean ``[q_len, ctx_len]`` mask (True = attend), or None for plain causal."""
        if window not in self.masks:
            offset = self.ctx_len - self.q_len
            if offset == 0 and (window is None or window >= self.ctx_len):
                self.masks[window] = None
            else:
                qpos = torch.arange(offset, self.ctx_len, device=device)[:, None]
                kpos = torch.arange(self.ctx_len, device=device)[None, :]
                m = kpos <= qpos
                if window is not None:
                    m &= kpos > qpos - window
                self.masks[window] = m
        return self.masks[window]


@dataclass
class DecodeGroup:
    """Decodes ``[q_start, q_start + count)`` of the flat batch whose contexts have similar
    lengths, attended in one padded SDPA call.

    Grouping bounds the padding: one padded call over a whole batch where a single sequence
    holds 2k tokens and the rest 300 would gather (and attend over) ~6x the keys that exist.
    ``block_tables`` ``[count, width]`` lists each sequence's blocks (padded with block 0, which
    the mask hides); keys are gathered a whole block at a time.
    """

    q_start: int
    count: int
    ctx_lens: torch.Tensor  # [count]
    block_tables: torch.Tensor  # [count, width]
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor | None:
        """Boolean ``[count, 1, 1, width * block_size]`` mask (True = attend), or None when
        nothing is masked."""
        if window not in self.masks:
            width = self.block_tables.shape[1] * block_size
            kpos = torch.arange(width, device=self.ctx_lens.device)[None, :]
            lens = self.ctx_lens[:, None]
            m = kpos < lens
            if window is not None:
                m &= kpos >= lens - window
            self.masks[window] = None if bool(m.all()) else m[:, None, None, :]
        return self.masks[window]


def group_by_length(lengths: list[int], block_size: int, max_waste: float = 0.25) -> list[int]:
    """Split ``lengths`` (ascending) into runs whose padding to the run's longest stays within
    ``max_waste`` of the real blocks (a few blocks of slack let short runs grow). Returns the
    size of each run."""
    sizes: list[int] = []
    count = total = 0
    for n in lengths:
        blocks = -(-n // block_size)
        if count and (count + 1) * blocks > (1 + max_waste) * (total + blocks) + 4:
            sizes.append(count)
            count = total = 0
        count += 1
        total += blocks
    if count:
        sizes.append(count)
    return sizes


@dataclass
class LastLayerRows:
    """The rows of a step that the model's last layer runs past its K/V projection: the rows
    whose hidden states are read (those that sample, and every decode). Every row's K and V
    are still written (later steps attend to them); only these rows' queries attend, and only
    they go through the output projection and the MLP. A 256-token prompt's last layer is then
    one row of attention and MLP instead of 256.

    ``meta`` is the attention over just these rows as queries: each sampling prefill span as a
    one-row span (same visible keys), then the step's decodes as they were."""

    rows: torch.Tensor  # [R] long, ascending rows of the flat batch
    meta: AttentionMetadata


@dataclass
class AttentionMetadata:
    """What every backend's metadata of a step holds (each backend extends it with its own view
    of the batch, built by the backend from the step's :class:`~kvrelay.engine.attention.step.
    StepLayout`)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_prefill_tokens: int
    block_size: int = 0
    # Called with the layer index right after that layer's K/V are written to the cache.
    on_kv_written: Callable[[int], None] | None = field(default=None, kw_only=True)
    # Where set, the model's last layer runs only these rows past its K/V (its output then
    # holds them alone, in this order).
    last_layer: LastLayerRows | None = field(default=None, kw_only=True)
    # Under the hybrid KV layout (engine/hybrid_kv.py): each layer group's metadata of the step
    # (this one among them), its slots and block tables naming that group's pages; a layer
    # attends with its group's. None: one table serves every layer.
    groups: list[AttentionMetadata] | None = field(default=None, kw_only=True)

    @property
    def num_decodes(self) -> int:
        raise NotImplementedError

    def to_device(self, h2d: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """Its tensors through ``h2d`` (onto the device), in place; returns itself."""
        self.slot_mapping = h2d(self.slot_mapping)
        for meta in self.groups or ():
            if meta is not self:
                meta.to_device(h2d)
        return self


@dataclass
class SdpaMetadata(AttentionMetadata):
    """torch SDPA's view: one call per prefill span, one padded call per group of decodes of
    similar context length."""

    prefills: list[PrefillSpan] = field(default_factory=list)
    # Decodes follow the prefill tokens, sorted by context length into groups.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Scratch the backend gathers cached K/V into (the backend keeps it across steps: a fresh
    # buffer per gather costs more in page faults than the copy itself). None: allocate.
    workspace: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        return sum(g.count for g in self.decode_groups)

    def to_device(self, h2d: Callable[[torch.Tensor], torch.Tensor]) -> SdpaMetadata:
        super().to_device(h2d)
        for span in self.prefills:
            if span.ctx_slots is not None:
                span.ctx_slots = h2d(span.ctx_slots)
        for g in self.decode_groups:
            g.ctx_lens = h2d(g.ctx_lens)
            g.block_tables = h2d(g.block_tables)
        return self

    def gather_rows(self) -> int:
        """Cache rows (slots) the largest single gather of this step reads: K and V of one
        prefill span or one decode group at a time need twice this in ``workspace``."""
        spans = [s.ctx_len for s in self.prefills if s.ctx_slots is not None]
        groups = [g.block_tables.numel() * self.block_size for g in self.decode_groups]
        return max(spans + groups, default=0)

    def gather_slots(self, cache: torch.Tensor, slots: torch.Tensor, half: int) -> torch.Tensor:
        """The cache rows of ``slots`` (``gather`` of flat slot rows; a heads-first cache has
        none: indexed by block and offset)."""
        return self.gather(cache, slots, half) if cache.dim() == 3 else slot_rows(cache, slots)

    def gather(self, cache: torch.Tensor, index: torch.Tensor, half: int) -> torch.Tensor:
        """``cache.index_select(0, index)``, written into half ``half`` (0: K, 1: V) of the
        workspace when it is large enough."""
        row = cache[0].numel()
        n = index.numel() * row
        ws = self.workspace
        if ws is None or 2 * n > ws.numel():
            return cache.index_select(0, index)
        out = ws[half * n:(half + 1) * n].view(index.numel(), *cache.shape[1:])
        return torch.index_select(cache, 0, index, out=out)


_CURRENT: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "kvrelay_attention_metadata", default=None)


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def current_metadata() -> AttentionMetadata:
    meta = _CURRENT.get()
    if meta is None:
        raise RuntimeError("attention called outside forward_context()")
    return meta
