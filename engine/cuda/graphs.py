"""CUDA graphs for decode-only steps (issue 24).

A decode step of a small batch launches a few hundred small kernels whose launch cost, not their
work, sets the step time on a GPU. Replaying a captured CUDA graph launches them all at once. A
graph replays fixed addresses and shapes, so a decode step runs from *static buffers*: token ids,
positions, slot mapping, block tables (padded to the widest a sequence can need), context lengths
and the flash-attn ``cu_seqlens``, sized for the largest captured batch. A batch of ``n`` decodes
runs as the next captured size ``B >= n`` (:func:`capture_sizes`); rows ``n..B`` are padding:
token 0 at position 0, their K/V written to a reserved *scratch block* (never handed out by the
block manager), attending to that one slot only, so no real sequence's KV is ever touched.

Only decode-only steps of at most ``--cuda-graph-max-batch`` sequences replay graphs; prefill and
mixed steps, and everything on the CPU, stay eager (:func:`graphs_off_reason` decides once, when
the runner is built). Everything here except :meth:`DecodeGraphRunner.capture` is plain torch and
runs on the CPU: there the same fill-then-forward path runs eagerly, which is how the tests check
it against the normal eager path without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvrelay.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeRows,
    forward_context,
)
from kvrelay.engine.kv_connector import ScheduledSeq

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured for ``max_batch``: 1, 2, 4, then every multiple of 8, and
    ``max_batch`` itself (so a batch pads by fewer than 8 rows). Empty when ``max_batch < 1``."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += range(8, max_batch + 1, 8)
    if sizes and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def bucket_for(n: int, sizes: Seq[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows, or None when none does."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphs_off_reason(device: torch.device, *, enforce_eager: bool, max_batch: int,
                      paged_flash: bool, num_blocks: int,
                      kv_head_groups: int = 1) -> str | None:
    """Why decode steps run eagerly on this runner, or None when they replay CUDA graphs.
    Decided once, when the runner is built: the CPU path never pays for graphs per step.
    Under tensor parallelism every rank decides alike (the same configuration, the same block
    count) and captures the same sizes in the same order, each graph with its all-reduces
    inside (stream-ordered NCCL collectives capture as any kernel)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if max_batch < 1:
        return "--cuda-graph-max-batch 0"
    if not paged_flash:
        # SDPA's decode masks and the gather path size tensors from host-side values.
        return "needs flash-attn reading the paged cache (block_table)"
    if num_blocks < 2:
        return "the KV cache has no block to spare for padding rows"
    if kv_head_groups > 1:
        return "not with KV head groups (attention runs per group, never captured)"
    return None


def graph_batch(scheduled: Seq[ScheduledSeq], sizes: Seq[int]) -> int | None:
    """The captured size a step runs as, or None when it runs eagerly: only steps where every
    sequence computes exactly one token, at most ``sizes[-1]`` of them."""
    if not scheduled or not sizes or len(scheduled) > sizes[-1]:
        return None
    if any(s.num_new_tokens != 1 for s in scheduled):
        return None
    return bucket_for(len(scheduled), sizes)


@dataclass
class DecodeBuffers:
    """A decode batch as tensors: the static buffers (``max_batch`` rows, on the device), or one
    step's host-side values (exactly ``B`` rows) that are copied into their first rows."""

    input_ids: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long
    slot_mapping: torch.Tensor  # [B] long: where each row's new K/V goes
    seq_lens: torch.Tensor  # [B] int32: keys each row attends to (its new token included)
    block_tables: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: 0, 1, ..., B
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: prefix sums of seq_lens

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> DecodeBuffers:
        i32, i64 = torch.int32, torch.long
        return cls(
            input_ids=torch.zeros(rows, dtype=i64, device=device),
            positions=torch.zeros(rows, dtype=i64, device=device),
            slot_mapping=torch.zeros(rows, dtype=i64, device=device),
            seq_lens=torch.ones(rows, dtype=i32, device=device),
            block_tables=torch.zeros(rows, width, dtype=i32, device=device),
            cu_seqlens_q=torch.arange(rows + 1, dtype=i32, device=device),
            cu_seqlens_k=torch.arange(rows + 1, dtype=i32, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                self.block_tables, self.cu_seqlens_q, self.cu_seqlens_k)


def host_inputs(scheduled: Seq[ScheduledSeq], rows: int, block_size: int, width: int,
                scratch_block: int, group: int | None = None,
                window: int | None = None) -> DecodeBuffers:
    """One decode step's inputs for ``rows >= len(scheduled)`` rows, in scheduled order. Padding
    rows read token 0 at position 0, write their K/V to the first slot of ``scratch_block`` and
    attend to that slot alone (its table is the scratch block throughout).

    Under the hybrid KV layout, the inputs of layer group ``group`` (its page tables; its
    scratch page) of window ``window``: a windowed group's tables start at the first block the
    row reads, its lengths counted from there (as ``ModelRunner.prepare`` lays them out)."""
    n = len(scheduled)
    if rows < n:
        raise ValueError(f"{n} decodes do not fit {rows} rows")
    pad = rows - n
    scratch_slot = scratch_block * block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    lens: list[int] = []
    tables: list[list[int]] = []
    for seq, num_new in scheduled:
        assert num_new == 1, "a decode step computes one token per sequence"
        c = seq.num_computed_tokens
        skip = 0 if window is None else max(0, c - window + 1) // block_size
        if c + 1 - skip * block_size > width * block_size:
            raise ValueError(f"a context of {c + 1} tokens exceeds the static tables' "
                             f"{width} blocks")
        bt = seq.block_table if group is None else seq.page_tables[group]
        ids.append(seq.token_ids[c])
        pos.append(c)
        slots.append(bt[c // block_size] * block_size + c % block_size)
        lens.append(c + 1 - skip * block_size)
        row = bt[skip:skip + width]
        tables.append(row + [0] * (width - len(row)))
    ids += [0] * pad
    pos += [0] * pad
    slots += [scratch_slot] * pad
    lens += [1] * pad
    tables += [[scratch_block] * width] * pad
    i32, i64 = torch.int32, torch.long
    seq_lens = torch.tensor(lens, dtype=i32)
    cu_k = torch.zeros(rows + 1, dtype=i32)
    cu_k[1:] = seq_lens.cumsum(0, dtype=i32)
    return DecodeBuffers(
        input_ids=torch.tensor(ids, dtype=i64), positions=torch.tensor(pos, dtype=i64),
        slot_mapping=torch.tensor(slots, dtype=i64), seq_lens=seq_lens,
        block_tables=torch.tensor(tables, dtype=i32).view(rows, width),
        cu_seqlens_q=torch.arange(rows + 1, dtype=i32), cu_seqlens_k=cu_k)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's static output, [B, vocab]


@dataclass(eq=False)
class DecodeGraphRunner:
    """Decode steps from static buffers: captured as CUDA graphs (:meth:`capture`, CUDA only)
    and replayed, or run eagerly from the same buffers where nothing was captured (the CPU,
    which is how tests check the fill and the padding).

    ``model`` is the runner's model with the KV cache bound; ``attention`` its attention
    backend, which lays out the static buffers as its metadata (flash-attn on CUDA; SDPA or the
    native kernels only for the eager check on the CPU)."""

    model: torch.nn.Module
    attention: AttentionBackend
    device: torch.device
    block_size: int
    width: int  # block table columns: enough for the longest sequence the runner allows
    scratch_block: int  # KV block the padding rows write; the block manager never hands it out
    max_batch: int
    # Whether the graphs end in the logits (rank 0's), or in the hidden states (a tensor-
    # parallel rank > 0: it samples nothing, and the head is the whole vocabulary on each rank).
    computes_logits: bool = True
    # Under the hybrid KV layout: per layer group, (its window, its tables' width, its scratch
    # page); each group has buffers of its own (``group_buffers``), ``buffers`` is group 0's.
    groups: tuple[tuple[int | None, int, int], ...] = ()
    sizes: list[int] = field(init=False)
    buffers: DecodeBuffers = field(init=False)
    group_buffers: list[DecodeBuffers] = field(init=False, default_factory=list)
    captured: dict[int, _Captured] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = capture_sizes(self.max_batch)
        if not self.sizes:
            raise ValueError(f"cuda_graph_max_batch must be positive, got {self.max_batch}")
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], self.width, self.device)
        self.group_buffers = [DecodeBuffers.allocate(self.sizes[-1], width, self.device)
                              for _, width, _ in self.groups[1:]]
        if self.groups:
            self.group_buffers.insert(0, self.buffers)
            assert self.groups[0][1:] == (self.width, self.scratch_block)

    def handles(self, scheduled: Seq[ScheduledSeq]) -> bool:
        return graph_batch(scheduled, self.sizes) is not None

    # -- the static path -----------------------------------------------------------------------
    def fill(self, scheduled: Seq[ScheduledSeq], rows: int) -> None:
        """Write the step's inputs into the first ``rows`` rows of the static buffers."""
        if not self.groups:
            self._copy(self.buffers, host_inputs(scheduled, rows, self.block_size, self.width,
                                                 self.scratch_block))
            return
        for g, ((window, width, scratch), buffers) in enumerate(
                zip(self.groups, self.group_buffers, strict=True)):
            self._copy(buffers, host_inputs(scheduled, rows, self.block_size, width, scratch,
                                            g, window))

    def _copy(self, buffers: DecodeBuffers, host: DecodeBuffers) -> None:
        cuda = self.device.type == "cuda"
        for dst, src in zip(buffers.tensors(), host.tensors(), strict=True):
            if cuda:  # from pinned memory the copy is asynchronous, ordered before the replay
                src = src.pin_memory()
            dst[:src.shape[0]].copy_(src, non_blocking=cuda)

    def metadata(self, rows: int) -> AttentionMetadata:
        """The attention metadata of a ``rows``-row decode step, as views of the static
        buffers (a graph captured with it reads whatever :meth:`fill` last wrote); under the
        hybrid KV layout each layer group's, in ``groups``."""
        if not self.groups:
            return self._metadata(self.buffers, self.width, rows)
        metas = [self._metadata(b, width, rows)
                 for (_, width, _), b in zip(self.groups, self.group_buffers, strict=True)]
        metas[0].groups = metas
        return metas[0]

    def _metadata(self, b: DecodeBuffers, width: int, rows: int) -> AttentionMetadata:
        return self.attention.decode_metadata(DecodeRows(
            self.block_size, b.slot_mapping[:rows], b.seq_lens[:rows], b.block_tables[:rows],
            b.cu_seqlens_q[:rows + 1], b.cu_seqlens_k[:rows + 1],
            # A bound, not this step's longest: the captured kernel must suit every later step.
            width * self.block_size))

    def forward(self, rows: int) -> torch.Tensor:
        """The model over the first ``rows`` rows of the static buffers: ``[rows, vocab]``
        logits (what a graph captures), or the hidden states without ``computes_logits``."""
        b = self.buffers
        with forward_context(self.metadata(rows)):
            hidden = self.model(b.input_ids[:rows], b.positions[:rows])
        return self.model.compute_logits(hidden) if self.computes_logits else hidden

    @torch.inference_mode()
    def logits(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        """Logits ``[len(scheduled), vocab]`` of a decode-only step, in scheduled order: the
        batch padded to its captured size, the graph replayed (or the same forward run eagerly
        where that size was not captured). The rows are views of a static output: use them
        before the next step. Without ``computes_logits``: the hidden states."""
        rows = graph_batch(scheduled, self.sizes)
        if rows is None:
            raise ValueError("not a decode-only step within the captured sizes")
        self.fill(scheduled, rows)
        cap = self.captured.get(rows)
        if cap is None:
            out = self.forward(rows)
        else:
            cap.graph.replay()
            out = cap.logits
        return out[:len(scheduled)]

    # -- capture (CUDA only) -------------------------------------------------------------------
    def _fill_padding(self, rows: int) -> None:
        self.fill([], rows)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size once, largest first, into one memory pool (the smaller graphs
        reuse the largest one's activations). Each size first runs eagerly from padding-only
        inputs (lazy initialisation: cuBLAS handles and workspaces, flash-attn's first call),
        which writes nothing but the scratch block."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):
            self._fill_padding(rows)
            for _ in range(2):
                self.forward(rows)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(rows)
            self.captured[rows] = _Captured(graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs: decode batches %s captured (%.0f MiB)", self.sizes,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**20)
