"""Scheduler policy without a model: budgets, chunking, the short-prompt lane, preemption."""

from __future__ import annotations

import random

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.engine.sequence import FinishReason, Sequence


def make(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(**kw)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len=4096)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 4) -> Sequence:
    ids = [(7 * i + len(rid)) % 50 for i in range(n)]
    q = Sequence(rid, ids, SamplingParams(max_tokens=max_tokens))
    s.add(q)
    return q


def step(s: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    out = s.schedule()
    toks = [1 if sc.seq.num_computed_tokens + sc.num_new_tokens == sc.seq.num_tokens else None
            for sc in out.scheduled]
    finished = s.postprocess(out, toks)
    for f in finished:
        s.bm.free(f)
    return out, finished


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {sc.seq.request_id: sc.num_new_tokens for sc in out.scheduled}


def test_budget_and_chunking() -> None:
    s = make(max_num_batched_tokens=16, long_prefill_threshold=8)
    add(s, "long", 40)
    out, _ = step(s)
    assert shares(out) == {"long": 16}
    out, _ = step(s)
    assert shares(out) == {"long": 16}
    out, _ = step(s)
    assert shares(out) == {"long": 8}  # last chunk samples the first token
    out, _ = step(s)
    assert shares(out) == {"long": 1}  # decode


def test_short_prompts_share_a_step_with_a_long_chunk() -> None:
    s = make(max_num_batched_tokens=32, long_prefill_threshold=8)
    add(s, "long", 200)
    step(s)  # long is now partially prefilled
    add(s, "s1", 5)
    add(s, "s2", 6)
    out, _ = step(s)
    sh = shares(out)
    assert sh["s1"] == 5 and sh["s2"] == 6
    assert sh["long"] == 32 - 11  # the long prompt keeps the rest of the budget
    out, _ = step(s)
    sh = shares(out)
    assert sh["s1"] == 1 and sh["s2"] == 1 and sh["long"] == 30  # decodes ride along


def test_stream_of_short_prompts_cannot_starve_a_long_one() -> None:
    s = make(max_num_batched_tokens=32, long_prefill_threshold=8, max_num_seqs=256)
    add(s, "long", 100, max_tokens=1)
    for i in range(12):
        add(s, f"s{i}", 8, max_tokens=1)
    got_long = []
    for _ in range(12):
        out, _ = step(s)
        got_long.append(shares(out).get("long", 0))
    assert all(n >= 8 for n in got_long[:5]), got_long  # reserve of threshold each step


def test_one_long_prefill_at_a_time() -> None:
    s = make(max_num_batched_tokens=64, long_prefill_threshold=8)
    add(s, "l1", 100)
    add(s, "l2", 100)
    out, _ = step(s)
    assert set(shares(out)) == {"l1"}


def test_unchunked_prompt_larger_than_budget_runs_alone() -> None:
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False, long_prefill_threshold=4)
    add(s, "big", 40)
    out, _ = step(s)
    assert shares(out) == {"big": 40}
    add(s, "a", 10)
    add(s, "b", 10)
    out, _ = step(s)
    sh = shares(out)
    assert sh["big"] == 1 and sh["a"] == 10 and "b" not in sh  # whole prompts within budget


def test_preemption_by_recompute_frees_and_resumes() -> None:
    s = make(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    a = add(s, "a", 15, max_tokens=12)
    b = add(s, "b", 15, max_tokens=12)
    preempted = 0
    finished: list[Sequence] = []
    for _ in range(200):
        out, fin = step(s)
        preempted += len(out.preempted)
        finished += fin
        if len(finished) == 2:
            break
    assert {f.request_id for f in finished} == {"a", "b"}
    assert preempted > 0 and (a.num_preemptions + b.num_preemptions) == preempted
    assert all(f.finish_reason == FinishReason.LENGTH and f.num_output_tokens == 12
               for f in finished)
    assert s.bm.num_free_blocks == 10


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=3, max_num_batched_tokens=1000)
    for i in range(5):
        add(s, f"r{i}", 4)
    out, _ = step(s)
    assert len(out.scheduled) == 3


def test_random_workload_finishes_and_returns_all_blocks() -> None:
    rng = random.Random(1)
    s = make(num_blocks=40, block_size=4, max_num_batched_tokens=24, long_prefill_threshold=6)
    want = {}
    for i in range(40):
        q = add(s, f"r{i}", rng.randint(1, 50), max_tokens=rng.randint(1, 20))
        want[q.request_id] = q.sampling.max_tokens
    done: dict[str, int] = {}
    for _ in range(5000):
        if not s.num_unfinished:
            break
        _, fin = step(s)
        done.update({f.request_id: f.num_output_tokens for f in fin})
    assert done == want
    assert s.bm.num_free_blocks == 40
