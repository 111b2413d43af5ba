"""The token-level engine: requests in, token deltas out, one ``step()`` at a time.

``step()`` is three calls: ``schedule()``, ``run(batch)``, ``postprocess(batch, tokens)``,
preceded by collecting KV transfer events. Text, stop strings and streaming live above it
(``OutputProcessor``); transport lives below it (``KVConnector``). Not thread-safe: one thread
drives an engine (see ``AsyncEngine``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence as Sequence_
from collections.abc import Set as AbstractSet
from dataclasses import replace

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.cpu import prefetch_tuner
from kvrelay.engine.engine_types import (  # the workers import these from here too
    EngineOverloaded,
    EngineStats,
    RequestIdInUse,
    RequestOutput,
    Reservation,
)
from kvrelay.engine.heap import HeapTrimmer
from kvrelay.engine.hybrid_blocks import HybridBlockManager
from kvrelay.engine.kv_connector import KVConnector
from kvrelay.engine.kv_events import KVEventSink
from kvrelay.engine.kv_window import LayerWindows
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.outputs import ErrorKind
from kvrelay.engine.prefix_hash import HASH_SCHEME
from kvrelay.engine.prefix_shares import PrefixShares
from kvrelay.engine.sampler import seeded_generator, skip_draw
from kvrelay.engine.sampling_params import SamplingParams, check_fork_count
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrelay.engine.step_cost import StepCostModel
from kvrelay.engine.step_log import StepLog
from kvrelay.engine.structured import GrammarCompiler, StructuredOutput
from kvrelay.engine.tiers.disk_files import layout_fingerprint
from kvrelay.engine.tiers.kv_tiers import KVTiers, TierConfig
from kvrelay.engine.tiers.media import DEVICE

logger = logging.getLogger(__name__)

# A step that found only prompts waiting for disk-tier loads sleeps this long before the next.
TIER_WAIT_S = 0.001
# Blocks stored into the host tier after a step that carried decodes (~0.05 ms each on the ~150M
# model): a prompt's KV arriving whole on a decode worker is stored over several steps, not in
# one stall of every stream (measured: ITL p99 61 -> 191 ms in the multi-round QA benchmark).
STORE_BLOCKS_PER_DECODE_STEP = 16


class EngineCore:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None,
                 eos_token_ids: frozenset[int] = frozenset()):
        if config.model.tensor_parallel_size > 1:
            from kvrelay.engine.tensor_parallel import TPModelRunner

            self.runner: ModelRunner = TPModelRunner(config)
        else:
            self.runner = ModelRunner(config)
        self.runner.eos_token_ids = eos_token_ids  # min_tokens masks them
        if self.runner.block_size != config.cache.block_size:  # paged flash-attn on CUDA
            config = replace(config, cache=replace(config.cache,
                                                   block_size=self.runner.block_size))
        self.config = config
        plan = self.runner.kv_plan  # the hybrid KV layout's layer groups (None: one table)
        self.tiers = self._build_tiers(config)
        if plan is None:
            self.block_manager = BlockManager(self.runner.num_usable_blocks,
                                              config.cache.block_size,
                                              config.cache.enable_prefix_caching, self.tiers)
        else:
            self.block_manager = HybridBlockManager(self.runner.num_usable_blocks,
                                                    config.cache.block_size, plan,
                                                    config.cache.enable_prefix_caching,
                                                    self.tiers)
        sc = config.scheduler
        # Fitted on every step (its coefficients are exported as metrics); it caps a step's
        # prefill tokens only when a TPOT target or an ITL cap is set.
        self.step_cost = StepCostModel(
            None if sc.tpot_slo_ms is None else sc.tpot_slo_ms / 1e3, sc.max_num_batched_tokens,
            itl_cap_s=None if sc.itl_cap_ms is None else sc.itl_cap_ms / 1e3,
            itl_cap_max_queue_s=sc.itl_cap_max_queue_ms / 1e3)
        self.scheduler = Scheduler(sc, self.block_manager, self.runner.max_model_len,
                                   eos_token_ids, self.step_cost)
        self.shares = PrefixShares(self.block_manager)  # prefix blocks lent to / read from peers
        self.step_log = StepLog.from_env()  # KVRELAY_STEP_LOG: a line per step, for benches
        self.connector = connector
        if connector is not None:
            rank_kv = getattr(self.runner, "rank_kv", None)
            try:
                if rank_kv is not None:
                    connector.register_kv_cache(self.runner.transfer_kv, self.runner.kv_spec,
                                                rank_kv)
                else:
                    connector.register_kv_cache(self.runner.transfer_kv, self.runner.kv_spec)
            except BaseException:  # e.g. a rank could not start its NIXL agent: stop the ranks
                if hasattr(self.runner, "close"):
                    self.runner.close()
                raise
        self.seqs: dict[str, Sequence] = {}
        # Each layer's window: arriving KV may lack a windowed layer's blocks out of its window.
        self._windows = LayerWindows(self.runner.kv_spec.layer_windows)
        self.block_manager.release_window = self._windows.common_window
        self.block_manager.hole_window = self._windows.widest
        # Finished requests whose blocks the connector still reads, with the output to report
        # once they are delivered (None when nobody waits for one).
        self._sending: dict[str, tuple[Sequence, RequestOutput | None]] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step()
        # Forks waiting for their parent's KV to arrive: parent request id -> child ids.
        self._fork_waiting: dict[str, list[str]] = {}
        self.num_preemptions = 0
        self.heap = HeapTrimmer()
        self.eos_token_ids = eos_token_ids
        self._grammar: GrammarCompiler | None = None  # built on the first structured request
        self._grammar_lock = threading.Lock()

    def _build_tiers(self, config: EngineConfig) -> KVTiers | None:
        cc = config.cache
        if not cc.kv_offload_memory:
            return None
        if config.model.tensor_parallel_size > 1:
            raise ValueError("KV offload tiers are not yet supported under tensor parallelism")
        kv = self.runner.kv
        plan = self.runner.kv_plan  # hybrid KV: a block is a page per layer group
        per_block = 1 if plan is None else plan.num_groups
        slot_bytes = per_block * kv.select(-4, 0).numel() * kv.element_size()
        host_slots = cc.kv_offload_memory // slot_bytes
        disk_slots = cc.kv_offload_disk // slot_bytes if cc.kv_offload_dir else 0
        if host_slots < 1:
            raise ValueError(f"--kv-offload-memory {cc.kv_offload_memory} holds no block: one "
                             f"block of every layer takes {slot_bytes} bytes")
        spec = self.runner.kv_spec
        layout = (f"{self.runner.arch.identity}|{spec.num_layers}x{spec.num_kv_heads}x"
                  f"{spec.head_dim}|groups={cc.kv_head_groups}|bs={spec.block_size}|"
                  f"{spec.dtype}|{HASH_SCHEME}")
        if plan is not None:  # slots of another layout (pages per group) are other bytes
            layout += f"|hybrid={plan.k}x{plan.windows}/{plan.group_of}"
        step_blocks = config.scheduler.max_num_batched_tokens // cc.block_size
        if host_slots < 4 * step_blocks:
            logger.warning("the host tier (%d blocks) holds under 4 steps' worth of new blocks "
                           "(%d a step): blocks may skip it while its slots are busy; give "
                           "--kv-offload-memory several times the KV pool", host_slots,
                           step_blocks)
        tiers = KVTiers(kv, cc.block_size, TierConfig(host_slots, cc.kv_offload_dir, disk_slots,
                                                      keep_disk=cc.kv_offload_keep),
                        layout_fingerprint(layout),
                        pages_of=None if plan is None else
                        lambda bid: self.block_manager.pages_of(bid),  # type: ignore[attr-defined]
                        pages_per_block=per_block)
        logger.info("KV tiers: host %d blocks (%.0f MiB)%s", host_slots,
                    host_slots * slot_bytes / 2**20,
                    f", disk {disk_slots} blocks in {cc.kv_offload_dir}" if disk_slots else "")
        return tiers

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        """Report every block each tier starts or stops holding to ``sink`` (engine thread)."""
        self.block_manager.events = sink
        if self.tiers is not None:
            self.tiers.events = sink

    def close(self) -> None:
        """Let every prefix share go and stop the tiers' IO (the model runner is closed by its
        owner)."""
        self.shares.abort_all()
        if self.tiers is not None:
            self.tiers.close()

    # -- properties ----------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.arch.vocab_size

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.waiting_for_kv), num_sending=len(self._sending),
            prefix_cache_queries=self.block_manager.num_cache_queries,
            prefix_cache_hits=self.block_manager.num_cache_hits,
            num_preemptions=self.num_preemptions,
            waiting_prompt_tokens=sum(q.num_uncomputed_tokens for q in s.waiting)
            + sum(q.num_uncomputed_tokens for q in s.running if not q.is_decode),
            step_cost=self.step_cost.fit,
            prefill_budget=self.step_cost.last_budget,
            max_step_tokens=self.step_cost.max_tokens,
            num_capped_steps=self.step_cost.num_capped_steps,
            num_cap_yields=self.step_cost.num_cap_yields,
            kv_transfer=self.connector.counters() if self.connector is not None else {},
            gemm_prefetch=prefetch_tuner.snapshot(self.runner),
            kv_tiers=self.tiers.counters() if self.tiers is not None else {},
            prefix_shares={"exported_blocks": self.shares.num_exported_blocks,
                           "imported_blocks": self.shares.num_imported_blocks,
                           "failed_imports": self.shares.num_failed_imports})

    def cached_hash_sets(self) -> dict[str, AbstractSet[int]]:
        """The prefix-block hashes each tier holds, by medium (``engine/tiers/media.py``), for
        prefix-aware routing: each the same set object while that tier is unchanged. Empty
        without prefix caching. Callable from another thread (see ``cached_hash_set``)."""
        if not self.block_manager.enable_prefix_caching:
            return {}
        sets: dict[str, AbstractSet[int]] = {DEVICE: self.block_manager.cached_hash_set()}
        if self.tiers is not None:
            sets.update(self.tiers.hash_sets())
        return sets

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self._sending) or bool(self._pending)

    def has_schedulable(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._pending
                    or any(q.kv_ready and q.num_output_tokens for q in s.waiting_for_kv.values()))

    # -- requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it needs at least one token")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; this model serves at most "
                             f"{self.max_model_len - 1} prompt tokens (max_model_len "
                             f"{self.max_model_len})")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def validate_sampling(self, sampling: SamplingParams) -> None:
        top = sampling.max_token_id()
        if top >= self.vocab_size:
            raise ValueError(f"token id {top} in logit_bias/allowed_token_ids/bad_words is "
                             f"outside the vocabulary [0, {self.vocab_size})")
        if sampling.structured is not None:
            self.grammar.check(sampling.structured)

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler over the checkpoint's tokenizer (thread-safe: async
        callers compile on other threads ahead of admission, see ``AsyncEngine``)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.from_checkpoint(
                    self.config.model.model, self.vocab_size, self.eos_token_ids)
            return self._grammar

    def _attach_grammar(self, seq: Sequence, so: StructuredOutput | None) -> None:
        """Give ``seq`` a matcher for ``so`` that has consumed the output the request made
        before it came here (``resumed_output_tokens`` at the prompt's end, and any output)."""
        seq.grammar = None
        if so is not None:
            seq.grammar = self.grammar.matcher(so, seq.penalized_output_token_ids)

    def _new_seq(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 kv_transfer_params: object | None, arrival_time: float | None,
                 cache_salt: str | None = None) -> Sequence:
        if request_id in self.seqs or request_id in self._sending:
            raise RequestIdInUse(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        self.validate_sampling(sampling)
        seq = Sequence(request_id, prompt_token_ids, sampling,
                       kv_transfer_params=kv_transfer_params, arrival_time=arrival_time,
                       cache_salt=cache_salt)
        self._attach_grammar(seq, sampling.structured)
        if seq.grammar is not None and seq.grammar.is_stopped:
            raise ValueError("the resumed output already completes the request's grammar")
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    *, kv_transfer_params: object | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request to prefill here (and decode, unless it stops after its first token).
        Only requests of equal ``cache_salt`` share cached prefix blocks."""
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests already waiting")
        seq = self._new_seq(request_id, prompt_token_ids, sampling, kv_transfer_params,
                            arrival_time, cache_salt)
        self.seqs[request_id] = seq
        self.block_manager.prefetch(seq)  # start disk loads of its prefix now, not at admission
        self.scheduler.add(seq)

    def reserve(self, request_id: str, prompt_token_ids: list[int], *,
                kv_transfer_params: object | None = None,
                cache_salt: str | None = None) -> Reservation:
        """Hold blocks for a prompt whose KV another engine will write (decode role)."""
        seq = self._new_seq(request_id, prompt_token_ids, SamplingParams(), kv_transfer_params,
                            None, cache_salt)
        bm = self.block_manager
        self._sync_tiers()
        n = seq.num_prompt_tokens
        # The matched blocks first: those still free (cached, unreferenced) leave the free list
        # as they are taken, so the room left is known only after.
        bm.allocate_prefix(seq, bm.match_prefix(seq.token_ids, n, seq.hash_root))
        bm.promote(seq, n)  # blocks the host tier holds: each one promoted is one less to send
        if not bm.allocate(seq, n):
            need = bm.blocks_needed(seq, n)
            bm.free(seq)
            raise EngineOverloaded(f"no KV room for {n} tokens: {need} more blocks needed, "
                                   f"{bm.num_free_blocks} free")
        seq.num_cached_tokens = seq.num_computed_tokens
        page_ids: tuple[int, ...] = ()
        if isinstance(bm, HybridBlockManager):
            # A windowed layer group's pages of blocks the first decode (at position n) reads
            # no key of go: a fresh block's at once (never written), a cached one's idle; but
            # the cached prefix's last window stays held while the prompt's prefill may still
            # pull it from here.
            bm.keep_prefix_window(seq)
            bm.release_out_of_window(seq, upto=n,
                                     valid_blocks=seq.num_cached_tokens // bm.block_size)
            page_ids = bm.page_ids(seq)
        self.seqs[request_id] = seq
        if seq.num_computed_tokens == n:
            self._kv_arrived(seq)  # every prompt block was cached here already
        self.scheduler.add_waiting_for_kv(seq)
        if self.connector is not None and not seq.kv_ready:
            self.connector.request_waiting_for_kv(seq)
        return Reservation(list(seq.block_table), seq.num_computed_tokens, page_ids)

    def start_decode(self, request_id: str, first_token_id: int,
                     sampling: SamplingParams,
                     forks: Sequence_[tuple[str, int]] = ()) -> None:
        """Give a reserved request its first token (sampled by the prefill engine).

        ``forks``: more choices of the same prompt, ``(child request id, its first token)``
        each; child ``k`` (from 1) shares the reservation's blocks and samples with
        ``sampling.choice(k)``. A child is a request of its own from then on (abort, outputs)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.WAITING_FOR_KV:
            raise KeyError(f"no reservation for request {request_id!r}")
        if seq.num_output_tokens:
            raise ValueError(f"request {request_id!r} already started decoding")
        if not (0 <= first_token_id < self.vocab_size):
            raise ValueError(f"first token {first_token_id} is outside the vocabulary")
        self.validate_sampling(sampling)
        check_fork_count(len(forks), sampling.n)
        for cid, tok in forks:
            if cid in self.seqs or cid in self._sending:
                raise RequestIdInUse(f"request id {cid!r} is already in use")
            if not (0 <= tok < self.vocab_size):
                raise ValueError(f"first token {tok} is outside the vocabulary")
        children = [self._fork(seq, cid, sampling.choice(k)) for k, (cid, _) in
                    enumerate(forks, start=1)]
        self._begin(seq, first_token_id, sampling.choice(0) if forks else sampling)
        if children and not all(c.kv_ready for c in children):
            self._fork_waiting[request_id] = [c.request_id for c in children]
        for child, (_, tok) in zip(children, forks, strict=True):
            self._begin(child, tok, child.sampling)

    def _fork(self, parent: Sequence, child_id: str, sampling: SamplingParams) -> Sequence:
        """A reserved child of ``parent``: same prompt, shared blocks, same KV state."""
        child = Sequence(child_id, parent.token_ids[:parent.num_prompt_tokens], sampling,
                         arrival_time=parent.arrival_time)
        child.hash_root = parent.hash_root
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.kv_ready = parent.kv_ready
        self.seqs[child_id] = child
        self.scheduler.add_waiting_for_kv(child)
        return child

    def _begin(self, seq: Sequence, first_token_id: int, sampling: SamplingParams) -> None:
        seq.sampling = sampling
        # The matcher replays the resumed output, then takes the first token here (not in
        # append_token), so a token that breaks the grammar is refused before anything changes.
        self._attach_grammar(seq, sampling.structured)
        grammar, seq.grammar = seq.grammar, None
        if grammar is not None and not grammar.accept(first_token_id):
            raise ValueError(f"first token {first_token_id} does not match the request's "
                             f"grammar: {grammar.error()}")
        if not sampling.greedy and sampling.seed is not None:
            seq.generator = seeded_generator(sampling.seed, self.runner.device)
            skip_draw(seq.generator, self.runner.device)
        seq.append_token(first_token_id)
        seq.grammar = grammar
        reason = self.scheduler.check_stop(seq)
        if reason is not None:
            self._finish(seq, reason)

    def abort(self, request_id: str, *, emit: bool = True) -> bool:
        """Finish a request as aborted; ``emit=False``: without a final output (nobody reads
        it, and a later request of the same id must not receive it)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT, emit=emit)
        return True

    # -- prefix pull: blocks lent to and read from peers (engine/prefix_shares.py) -------------
    def export_prefix(self, share_id: str, token_ids: list[int], *,
                      cache_salt: str | None = None,
                      ttl_s: float = 30.0) -> tuple[list[int], int]:
        """Hold the blocks of ``token_ids``' longest prefix held here (pool or host tier) for
        a peer to read: their ids and the tokens they cover (``([], 0)``: none held)."""
        self.validate_prompt(token_ids)
        self._sync_tiers()
        self.shares.expire()
        return self.shares.export(share_id, token_ids, cache_salt, ttl_s)

    def share_pages(self, share_id: str, first: int = 0) -> tuple[int, ...]:
        """Under the hybrid KV layout, an open export's or import's pages per layer group of its
        blocks from ``first`` on (what a prefix pull reads from and into); ``()`` otherwise."""
        return self.shares.pages(share_id, first)

    def end_export(self, share_id: str) -> bool:
        """Release an export; True if it was held until now (what the peer read is valid)."""
        return self.shares.end_export(share_id)

    def begin_import(self, share_id: str, token_ids: list[int], *,
                     cache_salt: str | None = None,
                     ttl_s: float = 30.0) -> tuple[list[int], int]:
        """Fresh blocks to read a peer's KV of ``token_ids``' full blocks into (the leading ones
        that fit beside what admitted requests still need: a pull may be partial), and how
        many leading blocks are held here already (not returned: no read needed)."""
        self.validate_prompt(token_ids)
        self._sync_tiers()
        self.shares.expire()
        return self.shares.begin_import(share_id, token_ids, cache_salt, ttl_s,
                                        reserve=self.scheduler.promised_blocks())

    def end_import(self, share_id: str, complete: bool) -> int:
        """Publish an import's blocks (``complete``: every byte read and verified) or drop them;
        returns the tokens published."""
        return self.shares.end_import(share_id, complete)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._collect_transfer_events()
        self._sync_tiers()
        if self.shares.num_open:
            self.shares.expire()
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        outputs, self._pending = self._pending, []
        if not out.scheduled:
            if self.scheduler.waiting_on_tiers:
                time.sleep(TIER_WAIT_S)  # only prompts waiting on disk loads: do not spin
            return outputs
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        shape = out.shape
        copies = self.block_manager.take_copies()
        if copies:  # copy-on-write of blocks forks shared, before this step writes them
            self.runner.copy_blocks(copies)
        sampled = self.runner.run(out.scheduled, self.connector)
        done = time.monotonic()
        self.step_cost.observe(shape, done - now)
        if self.step_log is not None:
            self.step_log.record(now, done - now, shape)
        self.heap.after_step(out.num_prefill_tokens)
        finished = {s.request_id for s in self.scheduler.postprocess(out, sampled.tokens)}
        # This step's new blocks into the host tier: a bounded number while streams are
        # decoding (the rest follow in later steps, or when the pool reuses them).
        self.block_manager.flush_stores(STORE_BLOCKS_PER_DECODE_STEP if shape.decodes else None)
        for (seq, _), tok, lp in zip(out.scheduled, sampled.tokens, sampled.logprobs,
                                     strict=True):
            if tok is None or seq.request_id not in self.seqs:
                continue
            o = RequestOutput(seq.request_id, [tok], logprobs=[lp],
                              num_prompt_tokens=seq.num_prompt_tokens,
                              num_cached_tokens=seq.num_cached_tokens,
                              scheduled_at=seq.first_scheduled_time, computed_at=done,
                              fork_firsts=seq.fork_firsts)
            if seq.sampling.prompt_logprobs is not None and seq.num_output_tokens == 1:
                o.prompt_logprobs = list(seq.prompt_logprobs)
            if seq.request_id in finished:
                o.finished, o.finish_reason = True, seq.finish_reason
                if self._release(seq, o):
                    continue  # reported once its KV is delivered
            outputs.append(o)
        return outputs

    # -- internals -----------------------------------------------------------------------------
    def _sync_tiers(self) -> None:
        """Apply finished tier IO (blocks published outside a step's run, KV that arrived from a
        prefill engine, are stored after the next step's run, or when the pool reuses them)."""
        if self.tiers is not None:
            self.tiers.poll()

    def _finish(self, seq: Sequence, reason: FinishReason, *, emit: bool = True,
                error: str | None = None, error_kind: ErrorKind | None = None) -> None:
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq, None)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            # Forks still waiting for this reservation's KV would wait for a transfer given up.
            for cid in self._fork_waiting.pop(seq.request_id, []):
                child = self.seqs.get(cid)
                if child is not None and child.status == SequenceStatus.WAITING_FOR_KV:
                    self._finish(child, reason, emit=emit, error=error, error_kind=error_kind)
        if emit:
            if reason is FinishReason.ERROR and error_kind is None:
                error_kind = ErrorKind.ENGINE
            self._pending.append(RequestOutput(seq.request_id, [], True, reason, error=error,
                                               error_kind=error_kind,
                                               num_prompt_tokens=seq.num_prompt_tokens,
                                               num_cached_tokens=seq.num_cached_tokens))

    def _release(self, seq: Sequence, output: RequestOutput | None) -> bool:
        """Forget ``seq``; free its blocks unless the connector still reads them (True)."""
        self.seqs.pop(seq.request_id, None)
        if self.connector is not None and self.connector.request_finished(seq):
            self._sending[seq.request_id] = (seq, output)
            return True
        self.block_manager.free(seq)
        return False

    def _collect_transfer_events(self) -> None:
        if self.connector is None:
            return
        ev = self.connector.take_events()
        for rid, reason in ev.failed:
            seq = self.seqs.get(rid)
            if seq is not None and seq.status == SequenceStatus.WAITING_FOR_KV:
                logger.warning("KV for %s will not arrive: %s", rid, reason)
                self._finish(seq, FinishReason.ERROR, error=f"KV transfer failed: {reason}",
                             error_kind=ErrorKind.KV_TRANSFER)
            elif rid in self._sending and self._sending[rid][1] is not None:
                o = self._sending[rid][1]
                o.finish_reason, o.error = FinishReason.ERROR, f"KV transfer failed: {reason}"
                o.error_kind = ErrorKind.KV_TRANSFER
            for cid in self._fork_waiting.pop(rid, []):
                child = self.seqs.get(cid)
                if child is not None and child.status == SequenceStatus.WAITING_FOR_KV:
                    self._finish(child, FinishReason.ERROR, error=f"KV transfer failed: {reason}",
                                 error_kind=ErrorKind.KV_TRANSFER)
        for rid in ev.sent:
            held = self._sending.pop(rid, None)
            if held is not None:
                self.block_manager.free(held[0])
                if held[1] is not None:
                    self._pending.append(held[1])
        for rid in ev.received:
            seq = self.seqs.get(rid)
            if seq is not None and seq.status == SequenceStatus.WAITING_FOR_KV:
                self._kv_arrived(seq)
            self._forks_ready(rid)  # even when the parent itself has finished already

    def _forks_ready(self, parent_id: str) -> None:
        for cid in self._fork_waiting.pop(parent_id, []):
            child = self.seqs.get(cid)
            if child is not None and child.status == SequenceStatus.WAITING_FOR_KV:
                child.kv_ready = True
                child.num_computed_tokens = child.num_prompt_tokens
                self._mark_holes(child)  # it shares the parent's blocks

    def _mark_holes(self, seq: Sequence) -> None:
        """Arrived KV of a windowed model lacks its windowed layers' blocks before their window
        (``kv_window.py``): those blocks are partial (``BlockManager.mark_holes``). The blocks
        the reservation matched in this engine's own cache were not written. (Under the
        hybrid KV layout the reservation held no page of those: its blocks are partial
        already, and ``HybridBlockManager.mark_holes`` has nothing to mark.)"""
        bs = self.block_manager.block_size
        end = self._windows.holes_end(seq.num_prompt_tokens, bs)
        first = seq.num_cached_tokens // bs
        if end > first:
            self.block_manager.mark_holes(seq, first, end)

    def _kv_arrived(self, seq: Sequence) -> None:
        if isinstance(self.block_manager, HybridBlockManager):
            self.block_manager.let_go_prefix_window(seq)  # the prefill is done with it
        seq.kv_ready = True
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._mark_holes(seq)
        self._forks_ready(seq.request_id)
        self.block_manager.publish(seq)
        self._pending.append(RequestOutput(seq.request_id, [], kv_arrived=True,
                                           num_prompt_tokens=seq.num_prompt_tokens,
                                           num_cached_tokens=seq.num_cached_tokens))

