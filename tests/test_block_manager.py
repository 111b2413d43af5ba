"""Block manager: ref counts, prefix cache reuse verified by token ids, LRU eviction."""

from __future__ import annotations

import random

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.prefix_hash import block_hashes, hash_block
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence


def seq(rid: str, ids: list[int]) -> Sequence:
    return Sequence(rid, ids, SamplingParams())


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", list(range(9)))
    assert bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 7
    assert bm.allocate(a, 12) and len(a.block_table) == 3  # still fits
    assert bm.allocate(a, 13) and len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 10 and a.block_table == []


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(3, 4)
    a = seq("a", list(range(20)))
    assert not bm.allocate(a, 20)
    assert a.block_table == [] and bm.num_free_blocks == 3


def test_prefix_reuse_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    a = seq("a", prompt)
    bm.allocate(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.publish(a)
    b = seq("b", prompt + [7, 8])
    m = bm.match_prefix(b.token_ids, b.num_tokens - 1)
    assert m.block_ids == a.block_table[:2]
    bm.allocate_prefix(b, m)
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in m.block_ids)
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in m.block_ids)
    bm.free(b)
    assert bm.num_free_blocks == 16
    # Freed but cached: still matchable until reused.
    c = seq("c", prompt)
    assert bm.match_prefix(c.token_ids, c.num_tokens).num_blocks == 2


def test_hash_collision_is_caught_by_token_ids() -> None:
    bm = BlockManager(8, 2)
    a = seq("a", [1, 2, 3, 4])
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.publish(a)
    # Forge a collision: point the hash of [5, 6] at a's first block.
    forged = hash_block(0, [5, 6])
    bm._cached[forged] = a.block_table[0]
    assert bm.match_prefix([5, 6, 7], 3).num_blocks == 0


def test_eviction_reuses_least_recently_freed_and_unpublishes() -> None:
    bm = BlockManager(4, 2)
    a = seq("a", [1, 2, 3, 4])
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.publish(a)
    bm.free(a)
    filler = seq("f", list(range(8)))
    assert bm.allocate(filler, 8)  # takes every block, evicting a's prefix
    assert bm.match_prefix([1, 2, 3, 4], 4).num_blocks == 0
    assert bm.cached_block_hashes() == []


def test_publish_only_full_blocks_with_kv() -> None:
    bm = BlockManager(8, 4)
    a = seq("a", list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 6
    bm.publish(a)
    assert len(bm.cached_block_hashes()) == 1
    a.num_computed_tokens = 10
    bm.publish(a)
    assert sorted(bm.cached_block_hashes()) == sorted(block_hashes(list(range(10)), 4))


def test_random_alloc_free_never_leaks() -> None:
    rng = random.Random(0)
    bm = BlockManager(64, 4)
    live: list[Sequence] = []
    for i in range(2000):
        if live and rng.random() < 0.45:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
            continue
        n = rng.randint(1, 40)
        ids = [rng.randint(0, 5) for _ in range(n)]  # small alphabet: many shared prefixes
        s = seq(f"s{i}", ids)
        m = bm.match_prefix(ids, n - 1)
        bm.allocate_prefix(s, m)
        if bm.allocate(s, n):
            s.num_computed_tokens = n
            bm.publish(s)
            live.append(s)
        else:
            bm.free(s)
        refs = [0] * 64
        for t in live:
            for b in t.block_table:
                refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
        assert bm.num_free_blocks == sum(1 for r in refs if r == 0)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 64


def test_cache_salt_partitions_the_prefix_cache() -> None:
    """Requests share cached blocks only with requests of the same cache_salt (vLLM's name):
    one tenant cannot learn from cached tokens whether another sent a prompt."""
    bm = BlockManager(16, 4)
    prompt = list(range(100, 111))
    a = Sequence("a", prompt, SamplingParams(), cache_salt="tenant-a")
    bm.allocate(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.publish(a)
    for salt, want in (("tenant-a", 2), ("tenant-b", 0), (None, 0)):
        s = Sequence("s", prompt, SamplingParams(), cache_salt=salt)
        assert bm.match_prefix(s.token_ids, s.num_tokens, s.hash_root).num_blocks == want, salt
    # The chain a router computes from the prompt and salt is what the worker reports.
    assert Sequence("u", prompt, SamplingParams()).hash_root == 0
    assert set(block_hashes(prompt, 4, a.hash_root)) == set(bm.cached_block_hashes())


def test_reuse_checks_the_parent_hash_not_only_the_blocks_own_tokens(monkeypatch) -> None:
    """A hash collision between two chains whose blocks hold the same tokens (here: the same
    prompt under two cache salts, with a hash that ignores the parent) must not serve one
    chain's block to the other: its KV depends on everything before it."""
    import kvrelay.engine.block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block",
                        lambda parent, ids: int.from_bytes(bytes(t % 256 for t in ids)[:8],
                                                           "little"))
    bm = BlockManager(16, 4)
    prompt = list(range(100, 109))  # 2 full blocks
    a = Sequence("a", prompt, SamplingParams(), cache_salt="tenant-a")
    bm.allocate(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.publish(a)
    assert bm.match_prefix(prompt, len(prompt), a.hash_root).num_blocks == 2  # its own chain
    b = Sequence("b", prompt, SamplingParams(), cache_salt="tenant-b")
    assert b.hash_root != a.hash_root
    assert bm.match_prefix(prompt, len(prompt), b.hash_root).num_blocks == 0
    # A different first block, the same second: the second is not reused either.
    other = [7, 7, 7, 7, *prompt[4:]]
    assert bm.match_prefix(other, len(other), a.hash_root).num_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 16
