"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

One step, in order:
  1. Every running sequence in its decode phase gets one token (decodes first: a prefill can
     never stall them for longer than one step). Out of blocks, the most recently admitted
     running sequence is preempted: its blocks are freed and it waits to be recomputed.
  2. Prefills share what is left of the budget, which a TPOT target or an ITL cap can cap
     further when the step carries decodes (``StepCostModel.prefill_room``: the time that keeps
     the step's predicted time within the target; the ITL cap yields in a step whose oldest
     queued prompt has waited too long). Short prompts (at most
     ``long_prefill_threshold`` tokens left) go first, in arrival order, so several can share
     a step; at most one long prompt prefills at a time, chunked, and keeps a reserve of the
     budget so a stream of short prompts cannot starve it.
Sequences whose KV another engine writes (``WAITING_FOR_KV``) hold their blocks but are not
scheduled until their KV has arrived and their first token is known.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrelay.engine.step_cost import StepCostModel, StepShape

logger = logging.getLogger(__name__)


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of chunks longer than one (a one-token chunk runs as a decode)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1)

    @property
    def shape(self) -> StepShape:
        """What the step computes, in the step-cost model's units; read before it runs (the
        counters still at their old values)."""
        prefill = pairs = decodes = ctx = chunks = 0
        for seq, n in self.scheduled:
            c = seq.num_computed_tokens
            if n > 1:
                prefill += n
                pairs += n * c + n * (n + 1) // 2
                chunks += 1
            else:
                decodes += 1
                ctx += c + 1
        return StepShape(prefill, pairs, decodes, ctx, chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 cost_model: StepCostModel | None = None):
        self.config = config
        self.cost_model = cost_model
        self._room: float | None = None  # seconds the step being scheduled has left for prefill
        self.eos_token_ids = eos_token_ids
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, holding blocks; in admission order
        self.waiting_for_kv: dict[str, Sequence] = {}
        self._tier_waits: set[str] = set()  # this step: queued prompts waiting on a disk load
        self._awaiting: dict[str, int] = {}  # queued prompt -> the block hash it waits to load
        # Admission keeps this many blocks free so decodes do not preempt at once.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def waiting_on_tiers(self) -> bool:
        """The last ``schedule`` left queued prompts waiting for their prefix to load."""
        return bool(self._tier_waits)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_waiting_for_kv(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv[seq.request_id] = seq

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of every queue (the caller frees or keeps its blocks)."""
        self._awaiting.pop(seq.request_id, None)
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[seq.request_id]

    def promote_ready(self) -> None:
        """Move sequences whose KV arrived and whose first token is known into the batch."""
        for rid, seq in list(self.waiting_for_kv.items()):
            if seq.kv_ready and seq.num_output_tokens > 0:
                del self.waiting_for_kv[rid]
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.promote_ready()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # 1. decodes
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if budget < 1 or len(scheduled) >= self.config.max_num_seqs:
                break
            if not self._make_room(seq, seq.num_tokens, preempted, scheduled):
                continue  # seq itself was preempted
            scheduled.append(ScheduledSeq(seq, 1))
            budget -= 1

        # 2. prefills: running partial prefills first, then the queue, short before long
        self._room = None
        if scheduled and self.cost_model is not None:
            ctx = sum(s.seq.num_tokens for s in scheduled)
            # The queue's wait only where an ITL cap may yield to it (a pass over the queue).
            wait = self._queue_wait() if self.cost_model.watches_queue else None
            self._room = self.cost_model.prefill_room(len(scheduled), ctx, wait)
            budget = min(budget, self.cost_model.budget_for(self._room))
        chunked = self.config.enable_chunked_prefill
        threshold = self.config.long_prefill_threshold
        partial = [s for s in self.running
                   if s.status == SequenceStatus.RUNNING and s.num_uncomputed_tokens > 1]
        candidates = partial + list(self.waiting)
        short = [s for s in candidates if self._remaining(s) <= threshold]
        long_ = [s for s in candidates if self._remaining(s) > threshold]
        long_reserve = min(threshold, budget // 2) if long_ else 0
        prefilling = False
        self._tier_waits.clear()
        for seq in short:
            limit = budget - long_reserve
            n = self._try_prefill(seq, limit, chunked, prefilling, scheduled)
            if n == 0 and seq.status == SequenceStatus.WAITING \
                    and seq.request_id not in self._tier_waits:
                break  # keep arrival order among the queue's short prompts (not behind a load)
            budget -= n
            prefilling = prefilling or n > 0
        long_running = [s for s in long_ if s.status == SequenceStatus.RUNNING]
        for seq in long_running or long_:
            n = self._try_prefill(seq, budget, chunked, prefilling, scheduled)
            budget -= n
            prefilling = prefilling or n > 0
            if seq.request_id in self._tier_waits:
                continue  # waiting for its prefix to load: the next long prompt may go
            if n == 0 or seq.num_uncomputed_tokens > threshold:
                break  # the one long prompt prefilling (or no room): keep the queue's order
            # Long only before its prefix matched (a prompt mostly cached, a later turn): the
            # few tokens left do not make it the long prompt, so the next one may go too.
        return SchedulerOutput(scheduled, preempted)

    def _queue_wait(self) -> float | None:
        """Seconds the oldest queued prompt has waited (None with none queued)."""
        if not self.waiting:
            return None
        return time.monotonic() - min(s.arrival_time for s in self.waiting)

    def promised_blocks(self) -> int:
        """Free blocks the admitted (running) sequences will still take to finish their
        prompts: what a pull's import must leave them."""
        return sum(self.bm.blocks_needed(s, s.num_prompt_tokens) for s in self.running)

    def _remaining(self, seq: Sequence) -> int:
        if not seq.block_table and seq.status == SequenceStatus.WAITING:
            return seq.num_tokens  # before prefix matching: an upper bound
        return seq.num_uncomputed_tokens

    def _try_prefill(self, seq: Sequence, limit: int, chunked: bool, prefilling: bool,
                     scheduled: list[ScheduledSeq]) -> int:
        """Schedule (part of) ``seq``'s prefill within ``limit`` tokens; returns tokens taken."""
        if limit <= 0 or len(scheduled) >= self.config.max_num_seqs:
            return 0
        admitting = seq.status == SequenceStatus.WAITING
        if admitting and seq.request_id in self._awaiting:
            tiers = self.bm.tiers
            if tiers is not None and tiers.is_loading(self._awaiting[seq.request_id]):
                self._tier_waits.add(seq.request_id)  # its prefix is still loading: skip it
                return 0
            del self._awaiting[seq.request_id]
        if admitting and not seq.block_table:
            # Keep at least one token to compute: its logits give the next token.
            # Prompt logprobs need every prompt position's logits: no cached prefix then.
            usable = (seq.num_tokens - 1 if seq.sampling.prompt_logprobs is None
                      or seq.num_output_tokens else 0)
            match = self.bm.match_prefix(seq.token_ids, usable, seq.hash_root)
            self.bm.allocate_prefix(seq, match)
            loading = self.bm.promote(seq, usable, self.watermark_blocks)
            if loading is not None:
                # The next prefix blocks are loading from disk: wait for them (a later step)
                # rather than recompute them, without holding blocks meanwhile.
                self._awaiting[seq.request_id] = loading
                self._tier_waits.add(seq.request_id)
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                return 0
            seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        remaining = seq.num_uncomputed_tokens
        if self._room is not None:  # the time left in the step, at this chunk's own context
            assert self.cost_model is not None
            limit = min(limit, self.cost_model.chunk_tokens(
                self._room, seq.num_computed_tokens, first=not prefilling))
        if remaining <= limit:
            n = remaining
        elif chunked:
            n = limit
        elif not prefilling:
            n = remaining  # unchunked: a prompt larger than the budget runs alone
        else:
            n = 0
        if n > 0:
            need = self.bm.write_blocks_needed(seq, seq.num_computed_tokens + n)
            reserve = self.watermark_blocks if admitting else 0
            if not self.bm.can_allocate(need + reserve):
                n = 0
        if n == 0:
            if admitting:
                self.bm.free(seq)  # give matched prefix blocks back; match again next time
                seq.num_computed_tokens = 0
            return 0
        assert self.bm.prepare_write(seq, seq.num_computed_tokens + n)
        if self._room is not None:
            assert self.cost_model is not None and self.cost_model.fit is not None
            self._room -= self.cost_model.fit.chunk_seconds(n, seq.num_computed_tokens)
        if admitting:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        scheduled.append(ScheduledSeq(seq, n))
        return n

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence],
                   scheduled: list[ScheduledSeq]) -> bool:
        """Allocate for ``seq`` up to ``num_tokens`` (copying the shared blocks it writes to),
        preempting the newest running sequences (never one already scheduled this step). False
        if ``seq`` itself had to go."""
        while not self.bm.prepare_write(seq, num_tokens):
            taken = {s.seq.request_id for s in scheduled}
            victims = [s for s in self.running if s.request_id not in taken]
            victim = victims[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (recompute)", seq.request_id)
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- after the step ------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput,
                    sampled: list[int | None]) -> list[Sequence]:
        """Advance counters, append sampled tokens; returns sequences that finished."""
        finished: list[Sequence] = []
        for (seq, n), token in zip(out.scheduled, sampled, strict=True):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += n
            self.bm.publish(seq)
            self.bm.release_out_of_window(seq)  # every layer windowed: dead blocks go back
            if token is None:
                continue
            assert seq.num_computed_tokens == seq.num_tokens
            seq.append_token(token)
            reason = self.check_stop(seq)
            if reason is not None:
                seq.finish_reason = reason
                self.running.remove(seq)
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
        return finished

    def check_stop(self, seq: Sequence) -> FinishReason | None:
        sp = seq.sampling
        last = seq.last_token_id
        if seq.grammar is not None:
            if seq.grammar.is_error:
                return FinishReason.ERROR
            # A complete grammar admits only EOS next (its mask), and ends on it, even under
            # ignore_eos. Not on the token that completed it: that one is output text, and a
            # STOP finish tells the detokenizer its last token is a stop token.
            if seq.grammar.is_stopped and (last in self.eos_token_ids
                                           or last in sp.stop_token_ids):
                return FinishReason.STOP
        if seq.num_output_tokens > sp.min_tokens or not sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in sp.stop_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
