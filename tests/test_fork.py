"""Forked sequences (``n > 1``): shared blocks with copy-on-write, and an engine whose forks
each equal a single request of that choice's seed."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.kv_connector import KVConnector, ScheduledSeq, TransferEvents
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence


def seq(rid: str, ids: list[int]) -> Sequence:
    return Sequence(rid, ids, SamplingParams())


# -- block manager ----------------------------------------------------------------------------
def test_fork_shares_every_block_and_free_returns_them() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    b = seq("b", list(range(10)))
    bm.fork(a, b)
    assert b.block_table == a.block_table and bm.num_free_blocks == 7
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 7  # b still holds them
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_appending_to_a_shared_partial_block_copies_it_first() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", list(range(10)))
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    b = seq("b", list(range(10)))
    bm.fork(a, b)
    b.num_computed_tokens = 10
    last = a.block_table[-1]
    for s in (a, b):
        s.append_token(99)
    # a writes token 10 into the shared last block: it gets a private copy of it.
    assert bm.prepare_write(a, 11)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != last
    assert bm.take_copies() == [(last, a.block_table[2])]
    assert bm.blocks[last].ref_count == 1
    # b is the last holder: it writes in place.
    assert bm.prepare_write(b, 11) and b.block_table[2] == last
    assert bm.take_copies() == []
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_full_shared_blocks_are_never_copied() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", list(range(8)))  # exactly 2 blocks: the next token opens a new one
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    b = seq("b", list(range(8)))
    bm.fork(a, b)
    b.num_computed_tokens = 8
    for s in (a, b):
        s.append_token(7)
        assert bm.write_blocks_needed(s, 9) == 1
        assert bm.prepare_write(s, 9)
    assert bm.take_copies() == []
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]


def test_copy_on_write_without_room_changes_nothing() -> None:
    bm = BlockManager(3, 4)
    a = seq("a", list(range(10)))
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    b = seq("b", list(range(10)))
    bm.fork(a, b)
    a.append_token(1)
    table = list(a.block_table)
    assert bm.write_blocks_needed(a, 11) == 1
    assert not bm.prepare_write(a, 11)
    assert a.block_table == table and bm.take_copies() == []


# -- engine -----------------------------------------------------------------------------------
class LocalKV(KVConnector):
    """Stands in for the transport: the test computes a reserved prompt's KV on the engine's
    own runner (as a prefill worker would into these blocks) and then says it arrived."""

    def __init__(self) -> None:
        self.arrived: list[str] = []

    def register_kv_cache(self, kv: torch.Tensor, spec: KVCacheSpec) -> None:
        pass

    def request_finished(self, seq: Sequence) -> bool:
        return False

    def take_events(self) -> TransferEvents:
        received, self.arrived = self.arrived, []
        return TransferEvents([], received, [])

    def has_pending(self) -> bool:
        return False


def _run_to_end(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(500):
        if not core.has_unfinished():
            break
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished()
    return out


def _forked(core: EngineCore, kv: LocalKV, prompt: list[int], sampling: SamplingParams,
            abort_parent_after: int | None = None) -> list[list[int]]:
    res = core.reserve("r", prompt)
    assert res.num_cached_tokens == 0
    parent = core.seqs["r"]
    # The prefill: the prompt's KV into the reserved blocks, the n first tokens sampled.
    parent.sampling = sampling
    sampled = core.runner.run([ScheduledSeq(parent, len(prompt))])
    first = sampled.tokens[0]
    assert first is not None and len(parent.fork_firsts) == sampling.n - 1
    kv.arrived.append("r")
    forks = [(f"r#{k}", tok) for k, (tok, _) in enumerate(parent.fork_firsts, start=1)]
    core.start_decode("r", first, sampling, forks)
    ids = ["r"] + [cid for cid, _ in forks]
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while core.has_unfinished():
        for o in core.step():
            outs[o.request_id].extend(o.new_token_ids)
        steps += 1
        if steps == abort_parent_after:
            core.abort("r")
    return [[tok] + outs[rid] for rid, tok in zip(ids, [first] + [t for _, t in forks],
                                                    strict=True)]



@pytest.fixture
def engines(demo_model_dir: str) -> tuple[EngineCore, LocalKV, EngineCore]:
    torch.manual_seed(0)
    kv = LocalKV()
    cfg = EngineConfig.from_kwargs(demo_model_dir, num_blocks=64, block_size=16)
    return EngineCore(cfg, connector=kv), kv, EngineCore(cfg)


def test_each_fork_equals_a_single_request_of_its_seed(engines) -> None:
    core, kv, ref = engines
    prompt = list(range(5, 26))  # 21 tokens: the last block is partial and shared
    sp = SamplingParams(n=4, seed=1234, temperature=0.9, max_tokens=12, ignore_eos=True)
    choices = _forked(core, kv, prompt, sp)
    for k in range(4):
        ref.add_request(f"ref{k}", prompt, sp.choice(k))
    want = _run_to_end(ref)
    assert choices == [want[f"ref{k}"] for k in range(4)]
    assert len({tuple(c) for c in choices}) > 1  # the seeds differ, so do the choices
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_greedy_forks_are_equal(engines) -> None:
    core, kv, ref = engines
    prompt = list(range(40, 59))
    sp = SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)
    choices = _forked(core, kv, prompt, sp)
    ref.add_request("ref", prompt, sp.choice(0))
    assert choices == [_run_to_end(ref)["ref"]] * 3
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_aborting_one_fork_leaves_the_others_and_returns_every_block(engines) -> None:
    core, kv, ref = engines
    prompt = list(range(7, 30))
    sp = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=10, ignore_eos=True)
    choices = _forked(core, kv, prompt, sp, abort_parent_after=3)
    assert len(choices[0]) < 10 and [len(c) for c in choices[1:]] == [10, 10]
    for k in (1, 2):
        ref.add_request(f"ref{k}", prompt, sp.choice(k))
    want = _run_to_end(ref)
    assert choices[1:] == [want["ref1"], want["ref2"]]
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_aborting_a_reservation_before_its_kv_ends_its_waiting_forks(engines) -> None:
    core = engines[0]
    prompt = list(range(3, 24))
    core.reserve("r", prompt)
    core.start_decode("r", 5, SamplingParams(n=3, max_tokens=8), [("r#1", 6), ("r#2", 7)])
    assert core.seqs["r#1"].status.value == "waiting_for_kv"
    core.abort("r")
    outs = {o.request_id: o for o in core.step()}
    assert {rid: o.finish_reason.value for rid, o in outs.items()} == {
        "r": "abort", "r#1": "abort", "r#2": "abort"}
    assert not core.has_unfinished()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_more_forks_than_n_allows_are_refused_and_change_nothing(engines) -> None:
    """A decode naming more fork first tokens than ``n - 1`` (or than ``MAX_N`` allows) is
    refused before any child exists: no sequence, no shared block."""
    from kvrelay.engine.sampling_params import check_fork_count

    core = engines[0]
    core.reserve("r", list(range(3, 24)))
    free = core.block_manager.num_free_blocks
    for n, forks in ((1, 1), (3, 3), (SamplingParams.MAX_N, SamplingParams.MAX_N),
                     (SamplingParams.MAX_N, 10_000)):
        with pytest.raises(ValueError, match="forks"):
            core.start_decode("r", 5, SamplingParams(n=n, max_tokens=4),
                              [(f"r#{k}", 6) for k in range(1, forks + 1)])
        assert set(core.seqs) == {"r"} and core.block_manager.num_free_blocks == free
    check_fork_count(SamplingParams.MAX_N - 1, SamplingParams.MAX_N)  # the most there can be
    with pytest.raises(ValueError):
        check_fork_count(SamplingParams.MAX_N, 10**6)  # n past MAX_N does not lift the bound
    core.abort("r")
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
