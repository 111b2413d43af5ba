"""Owns the model and the KV tensor; turns a scheduled batch into tensors, runs it, samples."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch
import torch.distributed as dist

from kvrelay.engine.attention import SdpaBackend, StepLayout, forward_context
from kvrelay.engine.config import CacheConfig, EngineConfig
from kvrelay.engine.cuda.graphs import DecodeGraphRunner
from kvrelay.engine.device import rank_device
from kvrelay.engine.grammar_mask import MaskFiller, StepMasks
from kvrelay.engine.hybrid_kv import KVGroups, plan_groups
from kvrelay.engine.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    blocks_for_budget,
    check_kv_head_groups,
    dtype_from_name,
    dtype_name,
    group_views,
    kv_groups_of,
    plane_view,
)
from kvrelay.engine.kv_connector import KVConnector, RankKV, ScheduledSeq
from kvrelay.engine.loader import load_model
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.platform import Platform, platform_for
from kvrelay.engine.prompt_logprobs import record_prompt_logprobs
from kvrelay.engine.sampler import TokenLogprob, sample
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.step_inputs import (  # padded_rows: imported from here by the tests too
    StepInputs,
    StepSeq,
    TokenWindow,
    padded_rows,
    row_order,
    sampled_rows,
)
from kvrelay.engine.tp_shard import TPShard, local_kv_heads

logger = logging.getLogger(__name__)


class SampledTokens(NamedTuple):
    tokens: list[int | None]  # per scheduled sequence (None: a partial prefill chunk)
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(self, config: EngineConfig, shard: TPShard | None = None):
        mc = config.model
        self.device = self.device_for(config, 0 if shard is None else shard.rank)
        # What differs between a CPU and a GPU engine: engine/cpu/, engine/cuda/.
        self.platform: Platform = platform_for(self.device, config)
        self.platform.configure()
        from kvrelay.engine.models.arch import load_model_config

        hf_cfg, arch = load_model_config(mc.model)  # read once, passed on to the loader
        # Three dtypes: the weights' (the checkpoint's under auto), the activations' (the
        # platform's: fp32 on CPU whatever the weights) and the KV cache's (the weights' under
        # auto: what a peer's layout must match).
        checkpoint = None if arch.checkpoint_dtype is None else \
            dtype_from_name(arch.checkpoint_dtype)
        self.dtype = self.platform.weight_dtype(checkpoint) if mc.dtype == "auto" else \
            dtype_from_name(mc.dtype)
        self.compute_dtype = self.platform.compute_dtype(self.dtype)
        cc = config.cache
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else \
            dtype_from_name(cc.kv_cache_dtype)
        self.attention = self.platform.attention(mc.attention_backend, self.compute_dtype)
        if arch.attention_sinks and not self.attention.supports_sinks:
            logger.info("attention: torch SDPA, %s has attention sinks, which the %s backend "
                        "lacks", arch.architecture, self.attention.name)
            self.attention = SdpaBackend()
        if arch.kv_latent and not isinstance(self.attention, SdpaBackend):
            # MLA attends over its latent cache through SDPA's metadata (models/mla.py): on the
            # CPU the native backend (an SdpaBackend) keeps its paged decode kernel for it.
            logger.info("attention: torch SDPA, %s caches a latent, which the %s backend does "
                        "not read", arch.architecture, self.attention.name)
            self.attention = SdpaBackend()
        self.backend = self.attention.name
        max_len = min(mc.max_model_len or arch.max_position_embeddings,
                      arch.max_position_embeddings)
        self.model, self.arch = load_model(mc.model, device=self.device, dtype=self.dtype,
                                           compute_dtype=self.compute_dtype,
                                           attn_fn=self.attention, max_positions=max_len,
                                           shard=shard, platform=self.platform,
                                           model_config=(hf_cfg, arch))
        self.shard = shard
        # Under TP each rank holds its own heads' KV (the budget is per rank).
        kv_heads = arch.num_kv_heads if shard is None else local_kv_heads(arch, shard.size)
        block_size = self.platform.kv_block_size(cc.block_size, self.attention)
        # --num-kv-blocks counts blocks of the configured size: keep the tokens it meant.
        exact = None if cc.num_blocks is None else max(1, cc.num_blocks * cc.block_size
                                                         // block_size)
        # The hybrid KV layout (engine/hybrid_kv.py): a page is k layers of one block of one
        # layer group, the tensor [k, planes, pages, ...]; its "blocks" below are pages.
        self.kv_plan = plan_groups(arch.layer_windows) if cc.hybrid_kv == "auto" else None
        if self.kv_plan is not None and cc.kv_head_groups > 1:
            raise ValueError("--kv-head-groups lays KV out for a P/D peer of one block table: "
                             "with it, serve this sliding-window hybrid with --hybrid-kv off "
                             "(on both pools)")
        slots = self._kv_slots()
        per_block = 1 if self.kv_plan is None else self.kv_plan.num_groups
        self.kv_groups = groups = cc.kv_head_groups
        check_kv_head_groups(groups, kv_heads)
        self.heads_first = kv_heads_first(cc, self.device, arch, self.backend)
        self._kv_heads = kv_heads
        self.block_size = block_size
        self.prune_last = False  # until the cache is bound (the backend decides it then)
        # Steps of more rows than this are padded to a bucketed count (see padded_rows).
        self.pad_above: int | None = self.platform.pad_rows_above(self.model)

        def fitting(budget: int) -> int:  # blocks (pages, under the hybrid layout) in budget
            return blocks_for_budget(budget, num_layers=slots, num_kv_heads=kv_heads,
                                     head_dim=arch.head_dim, block_size=block_size,
                                     dtype=dtype_name(self.kv_dtype), planes=arch.kv_planes)

        self.warm_up_bytes: int | None = None  # what the warm-up step took (None: none ran)
        if exact:
            num_blocks = per_block * exact
        elif self.platform.warms_up_before_kv(cc.kv_cache_memory):
            # As vLLM sizes its cache: the largest step the scheduler may build runs first, over
            # a cache just large enough for it, and the cache then leaves room for what that
            # step took (activations, workspaces) within --gpu-memory-utilization.
            tokens = min(config.scheduler.max_num_batched_tokens, max_len)
            self._bind_kv(per_block * (-(-tokens // block_size)))
            self.warm_up_bytes = self.platform.step_memory(
                lambda: self.warm_up(tokens, min(config.scheduler.max_num_seqs, tokens)))
            self._let_go_kv()
            num_blocks = fitting(self.platform.kv_budget(
                cc.kv_cache_memory, cc.gpu_memory_utilization, activations=self.warm_up_bytes))
            if shard is not None:  # one block manager addresses every rank: the fewest blocks
                fewest = torch.tensor([num_blocks], dtype=torch.long)
                shard.control_all_reduce(fewest, dist.ReduceOp.MIN, shard.timeout)
                num_blocks = int(fewest.item())
        else:
            num_blocks = fitting(self.platform.kv_budget(cc.kv_cache_memory,
                                                         cc.gpu_memory_utilization))
        self._bind_kv(num_blocks)
        # The last layer on the rows read alone (where the backend can); TP ranks run every row.
        self.prune_last = self.attention.prunes_last_layer and shard is None
        # CUDA graphs for decode steps (decided once, here): they take the last block as the
        # padding rows' scratch, so the block manager gets one block fewer.
        off = self.platform.graphs_off_reason(
            enforce_eager=mc.enforce_eager, max_batch=mc.cuda_graph_max_batch,
            paged_flash=self.attention.paged, num_blocks=num_blocks, kv_head_groups=groups)
        # (the hybrid KV layout: a scratch page per layer group, the last ones)
        self.num_usable_blocks = num_blocks if off is not None else num_blocks - per_block
        # A sequence can never hold more tokens than the cache has slots (a page per group).
        self.max_model_len = min(max_len, self.num_usable_blocks // per_block * block_size)
        self.decode_graphs: DecodeGraphRunner | None = None
        # No step holds more sequences than the scheduler runs at once.
        self.graph_max_batch = min(mc.cuda_graph_max_batch, config.scheduler.max_num_seqs)
        if off is None:  # (under TP every rank captures here, in step: the all-reduces inside)
            self.decode_graphs = self.static_decode(self.graph_max_batch)
            self.decode_graphs.capture()
        self.generator = torch.Generator(device=self.device)
        self.eos_token_ids: frozenset[int] = frozenset()
        # Grammar masks of constrained rows: filled on a thread while the forward runs when the
        # forward leaves a CPU core free (a GPU forward; a CPU one on fewer threads than cores:
        # Platform.overlaps_forward), else inline before sampling, on as many llguidance workers as
        # torch has threads: a mask thread beside a CPU forward that already uses every core
        # oversubscribes them (OpenMP barriers stall on a descheduled thread, see
        # AsyncEngine.spawn), and one llguidance worker beside OpenMP threads still spinning after
        # the forward took 0.4 ms median but 7 ms p90 for 32 rows on an idle 2-core machine; two
        # took 0.36 / 0.40 ms.
        overlap = self.platform.overlaps_forward()
        self.masks = MaskFiller(self.arch.vocab_size, overlap=overlap,
                                threads=1 if overlap else torch.get_num_threads())
        self.generator.manual_seed(mc.seed)
        logger.info("KV cache: %d %s x %d tokens (%.1f MiB), backend %s, max_model_len %d",
                    num_blocks, "blocks" if self.kv_plan is None else
                    f"pages of {self.kv_plan.k} layers in {self.kv_plan.num_groups} layer groups",
                    block_size, self.kv.numel() * self.kv.element_size() / 2**20,
                    self.backend, self.max_model_len)

    def _bind_kv(self, num_blocks: int) -> None:
        """Allocate the KV cache of ``num_blocks`` blocks (pages, under the hybrid layout) and
        give the model, the attention backend and a KV transport their views of it."""
        arch, kv_heads, groups = self.arch, self._kv_heads, self.kv_groups
        self.kv_spec = KVCacheSpec(self._kv_slots(), kv_heads // groups, arch.head_dim,
                                   self.block_size, num_blocks, dtype_name(self.kv_dtype),
                                   layer_windows=arch.layer_windows, planes=arch.kv_planes,
                                   groups=self.kv_plan, heads_first=self.heads_first)
        self.kv = allocate_kv_cache(self.kv_spec, self.device, groups)
        if self.kv_plan is None:
            if self.heads_first:
                self.model.bind_kv_cache(self.kv, heads_first=True)
            else:
                self.model.bind_kv_cache(self.kv)
        else:
            bind_hybrid(self.model, self.kv, self.kv_plan, self.heads_first)
            if getattr(self.model, "fused_decode", None) is not None:
                logger.info("hybrid KV: the fused decode layers read one block table; op by op")
                self.model.fused_decode = None
        self.attention.bind_cache(self.kv_spec.num_kv_heads, arch.head_dim, self.kv_dtype,
                                  self.device)
        # What a KV transport registers: the tensor, or group 0 and the others as its ranks
        # (under TP each rank registers its own groups: TPModelRunner).
        self.transfer_kv = kv_groups_of(self.kv)[0]
        if groups > 1 and self.shard is None:
            self.rank_kv = RankKV.from_views(group_views(self.kv, range(kv_heads)), kv_heads)

    def _kv_slots(self) -> int:
        """Layers of the KV tensor: the model's, or the hybrid layout's slots per page."""
        return self.arch.num_layers if self.kv_plan is None else self.kv_plan.k

    def _let_go_kv(self) -> None:
        """Release the cache bound now (the warm-up's), before the real one is sized: the model
        is bound to a one-block cache meanwhile, so no view keeps the old one alive."""
        self._bind_kv(1 if self.kv_plan is None else self.kv_plan.num_groups)
        self.platform.release_cached_memory()

    @torch.inference_mode()
    def warm_up(self, tokens: int, rows: int) -> None:
        """The largest step the scheduler may build, over the cache bound now (which must hold
        ``tokens``): one prefill of ``tokens`` tokens (every row through the last layer), and
        logits for ``rows`` of them (a decode step of that many sequences samples as many).
        Every rank of a tensor-parallel replica runs it at the same point (its collectives)."""
        bs = self.block_size
        nb = -(-tokens // bs)
        plan = self.kv_plan
        pages = None if plan is None else [
            [g * nb + i for i in range(nb)] for g in range(plan.num_groups)]
        seq = StepSeq(0, tokens, TokenWindow(0, [0] * tokens), list(range(nb)), pages)
        inputs = self.prepare([ScheduledSeq(seq, tokens)], all_rows=True)  # type: ignore
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids.to(self.device),
                                inputs.positions.to(self.device))
        self.model.compute_logits(hidden[:rows])

    def static_decode(self, max_batch: int, scratch_block: int | None = None) \
            -> DecodeGraphRunner:
        """Decode steps from static buffers over this runner's model and cache (captured as
        CUDA graphs by the caller on CUDA; run eagerly by tests on the CPU). ``scratch_block``
        (default: the last) must be a block the block manager never hands out; under the hybrid
        KV layout, the first of as many pages as layer groups (default: the last ones)."""
        width = -(-self.max_model_len // self.block_size)
        plan = self.kv_plan
        n = 1 if plan is None else plan.num_groups
        first = self.kv_spec.num_blocks - n if scratch_block is None else scratch_block
        groups: tuple[tuple[int | None, int, int], ...] = ()
        if plan is not None:  # a windowed group's tables hold its window at most
            groups = tuple((w, width if w is None else min(width, -(-w // self.block_size) + 1),
                            first + g) for g, w in enumerate(plan.windows))
        return DecodeGraphRunner(
            model=self.model, attention=self.attention, device=self.device,
            block_size=self.block_size, width=width, scratch_block=first, max_batch=max_batch,
            computes_logits=self.shard is None or self.shard.rank == 0, groups=groups)

    @staticmethod
    def device_for(config: EngineConfig, rank: int) -> torch.device:
        """The device of tensor-parallel rank ``rank`` (0 without TP): ``device.rank_device``."""
        return rank_device(config.model.device, rank, config.model.tensor_parallel_size)

    def check_blocks(self, timeout: datetime.timedelta) -> None:
        """Under TP: every rank must have the same number of KV blocks (one block manager
        addresses them all)."""
        assert self.shard is not None
        n = self.kv_spec.num_blocks
        hi_lo = torch.tensor([n, -n], dtype=torch.long)
        self.shard.control_all_reduce(hi_lo, dist.ReduceOp.MAX, timeout)
        if hi_lo.tolist() != [n, -n]:
            raise ValueError(f"tensor-parallel ranks disagree on the KV block count: "
                             f"{-int(hi_lo[1])} to {int(hi_lo[0])} (a per-rank budget must "
                             f"give every rank the same)")

    # -- inputs --------------------------------------------------------------------------------
    def prepare(self, scheduled: Seq[ScheduledSeq], all_rows: bool = False) -> StepInputs:
        """The step's inputs (the model's output: the rows read alone unless ``all_rows``). The
        attention's metadata is the backend's own, built from the step's layout."""
        bs = self.block_size
        prefill, decode = row_order(scheduled)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        hybrid = self.kv_plan is not None
        # per layer group (hybrid KV): its pages' slots and tables
        gslots: list[list[int]] = [[] for _ in range(self.kv_plan.num_groups)] if hybrid else []
        gtables: list[list[list[int]]] = [[] for _ in gslots]
        gctx: list[list[int]] = [[] for _ in gslots]
        windows = self.kv_plan.windows if hybrid else ()
        logits_rows: list[int] = []
        sampled_order: list[int] = []
        sampling: list[int] = []  # the prefill chunks that sample (their index among them)
        for j, i in enumerate(prefill + decode):
            seq, n = scheduled[i]
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            pos.extend(range(c, c + n))
            q_lens.append(n)
            ctx_lens.append(c + n)
            if hybrid:
                # A windowed group's table starts at the first block its first query reads
                # (keys and lengths relative to it: every mask is relative), so no backend
                # gathers, or even indexes, the pages given back behind the window.
                for gs, gt, gc, pt, w in zip(gslots, gtables, gctx, seq.page_tables, windows,
                                             strict=True):
                    gs.extend(pt[p // bs] * bs + p % bs for p in range(c, c + n))
                    skip = 0 if w is None else max(0, c - w + 1) // bs
                    gt.append(pt[skip:] if skip else pt)
                    gc.append(c + n - skip * bs)
            else:
                bt = seq.block_table
                slots.extend(bt[p // bs] * bs + p % bs for p in range(c, c + n))
                tables.append(bt)
            if c + n == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled_order.append(i)
                sampling += [j] if n > 1 else []
        if hybrid:
            metas = [self.attention.metadata(StepLayout(
                bs, torch.tensor(gs, dtype=torch.long), q_lens, gc, gt, len(prefill)))
                for gs, gt, gc in zip(gslots, gtables, gctx, strict=True)]
            meta = metas[0]
            meta.groups = metas
        else:
            meta = self.attention.metadata(StepLayout(
                bs, torch.tensor(slots, dtype=torch.long), q_lens, ctx_lens, tables,
                len(prefill)))
        if self.prune_last and not all_rows and not any(
                scheduled[i].seq.sampling.prompt_logprobs is not None for i in prefill):
            # the last layer's rows, over its own layer group's pages (hybrid KV)
            last = meta if not hybrid else metas[self.kv_plan.group_of[-1]]
            index = self.attention.last_layer_rows(last, sampling)
            meta.last_layer = last.last_layer
            logits_rows = logits_rows if index is None else [index[r] for r in logits_rows]
        if self.pad_above is not None and len(ids) > self.pad_above:
            extra = padded_rows(len(ids)) - len(ids)  # token 0 at position 0: no KV, no attention
            ids.extend([0] * extra)
            pos.extend([0] * extra)
        if self.pad_above is not None and len(logits_rows) > self.pad_above:
            logits_rows.extend([logits_rows[-1]] * (padded_rows(len(logits_rows))
                                                    - len(logits_rows)))
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                          meta.to_device(self._h2d), sampled_rows(logits_rows, ids),
                          sampled_order)

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        """A step input on the device (through pinned memory on a GPU: Platform.to_device)."""
        return self.platform.to_device(t)

    @torch.inference_mode()
    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` on every layer, both planes (copy-on-write of a
        block forked sequences shared)."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        self.kv[..., dst, :, :, :] = self.kv[..., src, :, :, :]  # every head group

    # -- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None = None) \
            -> SampledTokens:
        return self.run_step(scheduled, connector, self.graphed(scheduled, connector))

    def run_step(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None,
                 graphed: bool) -> SampledTokens:
        """The step, through the decode graphs where ``graphed`` (``graphed``'s answer)."""
        if graphed:
            assert self.decode_graphs is not None
            return self._run_graphed(self.decode_graphs, scheduled, connector)
        inputs = self.prepare(scheduled)
        meta = inputs.meta
        seqs = [scheduled[i].seq for i in inputs.sampled_order]
        masks = self.masks.start(seqs)
        if connector is not None:
            connector.start_step(scheduled)
            if connector.wants_layer_hooks(scheduled):
                meta.on_kv_written = self._kv_written_hook(connector)
        with forward_context(meta):
            hidden = self.model(self._h2d(inputs.input_ids), self._h2d(inputs.positions))
        if connector is not None:
            connector.end_step()
        record_prompt_logprobs(self.model.compute_logits, scheduled, hidden)
        if not inputs.sampled_order:
            return SampledTokens([None] * len(scheduled), [None] * len(scheduled))
        idx = inputs.logits_indices  # None: the rows are those that sample (a decode step)
        rows = hidden if idx is None else hidden.index_select(0, self._h2d(idx))
        logits = self.model.compute_logits(rows)[:len(inputs.sampled_order)]
        return self._sample(scheduled, logits, inputs.sampled_order, seqs, masks)

    def graphed(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None) -> bool:
        """Whether this step replays the decode graphs: a decode-only step within the captured
        sizes, with no per-layer KV work (``save_layer`` cannot be called from a replay). On
        the CPU (no graphs) one attribute test."""
        graphs = self.decode_graphs
        return graphs is not None and graphs.handles(scheduled) and (
            connector is None or not connector.wants_layer_hooks(scheduled))

    def follow_graphed(self, scheduled: Seq[ScheduledSeq]) -> None:
        """A tensor-parallel rank > 0's part of a step rank 0 replays its decode graphs for:
        the same padded rows from the same static buffers, replayed where this rank captured
        them (every rank decides alike), else run eagerly from buffers made at the first such
        step (the same collectives either way, in the same order)."""
        if self.decode_graphs is None:
            self.decode_graphs = self.static_decode(self.graph_max_batch)
        self.decode_graphs.logits(scheduled)

    def _run_graphed(self, graphs: DecodeGraphRunner, scheduled: Seq[ScheduledSeq],
                     connector: KVConnector | None) -> SampledTokens:
        """A decode-only step through the captured graphs (the connector has no per-layer
        work in it: ``save_layer`` cannot be called from inside a replay)."""
        # A one-token chunk of a prompt that continues samples nothing.
        order = [i for i, (seq, _) in enumerate(scheduled)
                 if seq.num_computed_tokens + 1 == seq.num_tokens]
        seqs = [scheduled[i].seq for i in order]
        masks = self.masks.start(seqs)
        if connector is not None:
            connector.start_step(scheduled)
        logits = graphs.logits(scheduled)
        if connector is not None:
            connector.end_step()
        if not order:
            return SampledTokens([None] * len(scheduled), [None] * len(scheduled))
        if len(order) < len(scheduled):
            logits = logits[torch.tensor(order, device=logits.device)]
        return self._sample(scheduled, logits, order, seqs, masks)

    def _sample(self, scheduled: Seq[ScheduledSeq], logits: torch.Tensor,
                sampled_order: list[int], seqs: list[Sequence],
                masks: StepMasks | None) -> SampledTokens:
        """``seqs``: the sequences of ``sampled_order``, one per row of ``logits``."""
        tokens: list[int | None] = [None] * len(scheduled)
        logprobs: list[TokenLogprob | None] = [None] * len(scheduled)
        sampled, lps = sample(logits, seqs, self.generator, self.eos_token_ids, masks)
        for i, tok, lp in zip(sampled_order, sampled, lps, strict=True):
            tokens[i], logprobs[i] = tok, lp
        return SampledTokens(tokens, logprobs)

    def _kv_written_hook(self, connector: KVConnector) -> Callable[[int], None]:
        """What the attention calls once a layer's new K/V are in the cache."""
        return connector.save_layer

    @torch.inference_mode()
    def logits_for(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        """Logits of every new token of a step (tests compare them with transformers)."""
        inputs = self.prepare(scheduled, all_rows=True)
        with forward_context(inputs.meta):
            hidden = self.model(self._h2d(inputs.input_ids), self._h2d(inputs.positions))
        return self.model.compute_logits(hidden[:inputs.meta.slot_mapping.shape[0]])


def kv_heads_first(cc: CacheConfig, device: torch.device, arch: ModelArch,
                   backend: str) -> bool:
    """Whether the KV cache keeps each head's tokens together inside a block
    (``CacheConfig.kv_layout``): on CUDA by default (a peer of another TP split then moves a
    run of heads per block), never for a latent cache (one "head": the layouts are the same)."""
    if cc.kv_layout == "tokens" or arch.kv_latent:
        return False
    if cc.kv_layout == "auto":
        return device.type == "cuda" and cc.kv_head_groups == 1
    if backend not in ("sdpa", "flash"):
        raise ValueError(f"--kv-layout heads needs the sdpa or flash attention backend (the "
                         f"{backend} backend reads each token's heads together): add "
                         f"--attention-backend sdpa, or keep --kv-layout tokens")
    if cc.kv_head_groups > 1:
        raise ValueError("--kv-layout heads and --kv-head-groups both arrange KV heads for a "
                         "peer of another TP split: use one (heads needs none)")
    return True


def bind_hybrid(model: torch.nn.Module, kv: torch.Tensor, plan: KVGroups,
                heads_first: bool = False) -> None:
    """Give each layer views (``kv_cache.plane_view``) of its slot's K and V planes of the
    hybrid KV tensor ``[k, 2, pages, ...]`` and its layer group (whose pages its metadata
    names)."""
    for i, layer in enumerate(model.layers):
        s = plan.slot_of[i]
        views = (plane_view(kv[s, 0], heads_first), plane_view(kv[s, 1], heads_first))
        layer.attn.k_cache, layer.attn.v_cache = views
        layer.attn.kv_groups = [views]
        layer.attn.kv_group = plan.group_of[i]
