"""The hybrid KV layout without a model: how layers are cut into groups (``hybrid_kv.py``) and
the page bookkeeping of ``HybridBlockManager`` (windowed pages given back behind the window,
shared blocks, prefix hits over given-back pages, copy-on-write, every page accounted for).
The engine paths (Gemma 3 and gpt-oss against transformers with ``hybrid_kv="auto"``) are in
``test_gemma3_models.py`` and ``test_gpt_oss_models.py``; here only a Llama-family model with
per-layer windows (Qwen2's ``layer_types``), whose one-table path takes the fused decode
layers."""

from __future__ import annotations

import random

import pytest

from kvrelay.engine.hybrid_blocks import NULL_PAGE, HybridBlockManager
from kvrelay.engine.hybrid_kv import plan_groups
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

BS = 4


def gemma_windows(layers: int, w: int = 16, every: int = 6) -> list[int | None]:
    return [None if (i + 1) % every == 0 else w for i in range(layers)]


# -- the groups ---------------------------------------------------------------------------------
def test_not_a_hybrid_keeps_one_table() -> None:
    assert plan_groups([None] * 4) is None
    assert plan_groups([16] * 4) is None  # every layer windowed: release_out_of_window's
    assert plan_groups([8, 16, 8, 16]) is None  # windows but no full layer


@pytest.mark.parametrize("windows, k, groups, padded", [
    (gemma_windows(26), 4, 7, 2),  # Gemma 3 1B: 4 global, 22 local
    (gemma_windows(34), 5, 7, 1),  # Gemma 3 4B: 5 global, 29 local
    ([128, None] * 12, 12, 2, 0),  # gpt-oss 20b
    (gemma_windows(6), 1, 6, 0),
    ([8, 8, None, 8, 8, 8, 8, None], 2, 4, 0),
])
def test_groups_of_one_kind_each(windows: list[int | None], k: int, groups: int,
                                 padded: int) -> None:
    plan = plan_groups(windows)
    assert plan is not None
    assert (plan.k, plan.num_groups, plan.padded_slots) == (k, groups, padded)
    assert plan.windows[0] is None  # group 0 is a full one
    for layer, w in enumerate(windows):
        g, s = plan.group_of[layer], plan.slot_of[layer]
        assert plan.windows[g] == w and plan.layers[g][s] == layer
    # no two layers of a group share a slot
    assert sorted((plan.group_of[i], plan.slot_of[i]) for i in range(len(windows))) == \
        sorted({(plan.group_of[i], plan.slot_of[i]) for i in range(len(windows))})


# -- the pages ----------------------------------------------------------------------------------
def seq(rid: str, ids: list[int]) -> Sequence:
    return Sequence(rid, ids, SamplingParams(max_tokens=1000, ignore_eos=True))


def manager(pages: int = 60, windows: tuple[int | None, ...] = (None, 8, 8)) \
        -> HybridBlockManager:
    plan = plan_groups(windows)
    assert plan is not None
    bm = HybridBlockManager(pages, BS, plan)
    bm.hole_window = plan.window_values[-1]
    return bm


def check_pages(bm: HybridBlockManager, seqs: list[Sequence]) -> None:
    """Every page is free, held by exactly one block, once; each sequence's page tables name
    its blocks' pages, and NULL_PAGE exactly where it gave a windowed page back."""
    owned = [p for pages in bm.pages for p in pages if p >= 0]
    assert sorted(owned + bm._free_pages.pages()) == list(range(bm.num_pages))
    assert len(bm._free_pages) == len(bm._free_pages.pages())
    assert bm._cached_pages == sum(bm._present(b) for b in bm._free)
    for bid, g in bm._idle:  # a held block's page nobody reads, kept
        assert bm.blocks[bid].ref_count > 0 and bm.pages[bid][g] >= 0
        assert bm.wrefs[bid][bm.groups.windows[g]] == 0
    for s in seqs:
        held = bm._held[s.request_id]
        assert s.page_tables is not None
        for g, (w, table) in enumerate(zip(bm.groups.windows, s.page_tables, strict=True)):
            assert len(table) == len(s.block_table)
            for i, bid in enumerate(s.block_table):
                if w is not None and i < held[w]:
                    assert table[i] == NULL_PAGE
                else:
                    assert table[i] == bm.pages[bid][g] >= 0


def step(bm: HybridBlockManager, s: Sequence, n: int) -> None:
    """Compute ``n`` more tokens of ``s`` as the scheduler does: room, then the counters."""
    assert bm.prepare_write(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n
    bm.publish(s)
    bm.release_out_of_window(s)


def take_every_page(bm: HybridBlockManager) -> Sequence:
    """A sequence holding every block's worth of pages the pool can give: idle pages are
    evicted for it (first), then cached free blocks."""
    fill = seq("fill", list(range(1000, 1000 + bm.num_free_blocks * BS)))
    bm.allocate_prefix(fill, bm.match_prefix(fill.token_ids, 0))
    assert bm.allocate(fill, len(fill.token_ids))
    return fill


def decode(bm: HybridBlockManager, s: Sequence, tokens: int) -> None:
    for _ in range(tokens):
        s.append_token(7)
        step(bm, s, 1)


def test_a_long_decode_holds_the_window_of_its_windowed_groups() -> None:
    bm = manager()
    assert (bm.num_pages, bm.num_blocks, bm.num_free_blocks) == (60, 20, 20)  # 3 groups
    free = bm.num_free_pages
    s = seq("a", list(range(10)))
    bm.allocate_prefix(s, bm.match_prefix(s.token_ids, 9))
    step(bm, s, 10)
    decode(bm, s, 60)  # 70 tokens: 18 blocks, window 8 = 2 blocks + the one being written
    n = len(s.block_table)
    assert n == 18
    windowed = bm.held_pages(s) - n
    assert windowed <= 2 * (8 // BS + 1)
    assert bm.num_free_pages == free - n - windowed
    check_pages(bm, [s])
    bm.free(s)
    assert bm.num_free_pages == free
    check_pages(bm, [])


def test_chunked_prefill_gives_pages_back_between_chunks() -> None:
    bm = manager()
    s = seq("a", list(range(40)))
    bm.allocate_prefix(s, bm.match_prefix(s.token_ids, 39))
    step(bm, s, 16)
    assert bm._held["a"] == {8: (16 - 8 + 1) // BS}  # its next chunk reads from position 9 on
    step(bm, s, 16)
    assert bm.held_pages(s) == 8 + 2 * (8 - 6)
    check_pages(bm, [s])


def test_a_shared_block_keeps_the_windowed_pages_a_holder_still_reads() -> None:
    """Two sequences share a prompt (a prefix hit): one decodes far past the window, the
    other has not moved; the block's windowed pages stay while the second reads them."""
    bm = manager()
    a = seq("a", list(range(17)))
    bm.allocate_prefix(a, bm.match_prefix(a.token_ids, 16))
    step(bm, a, 17)
    b = seq("b", list(range(17)) + [99])
    bm.allocate_prefix(b, bm.match_prefix(b.token_ids, 17))
    assert b.num_computed_tokens == 16  # 4 blocks shared
    decode(bm, a, 30)
    shared = a.block_table[2]  # before a's window, inside b's
    assert b.block_table[2] == shared and all(p >= 0 for p in bm.pages[shared])
    assert a.page_tables[1][2] == NULL_PAGE and b.page_tables[1][2] != NULL_PAGE
    check_pages(bm, [a, b])
    bm.free(b)
    # nobody reads it now: idle, its KV kept (the block whole) until the pool needs the page
    assert (shared, 1) in bm._idle and not bm.blocks[shared].partial
    check_pages(bm, [a])
    fill = take_every_page(bm)
    assert bm.pages[shared][1] < 0 and bm.blocks[shared].partial and not bm._idle
    assert bm.num_evicted_pages > 0
    check_pages(bm, [a, fill])


def test_a_prefix_hit_stops_where_its_window_would_read_an_evicted_page() -> None:
    bm = manager()
    a = seq("a", list(range(40)))
    bm.allocate_prefix(a, bm.match_prefix(a.token_ids, 39))
    for _ in range(5):
        step(bm, a, 8)  # chunks: the early blocks' windowed pages go idle
    # idle pages keep their KV: every block is still whole, a copy may take them all
    assert bm.num_idle_pages > 0
    assert bm.match_prefix(list(range(40)), 40, complete=True).num_blocks == 10
    bm.free(take_every_page(bm))  # the pool needed them: evicted (least recently idle first)
    assert bm.num_idle_pages < bm.num_groups and bm.blocks[a.block_table[0]].partial
    bm.free(a)
    # block 0 is partial: no whole copy for a peer
    assert bm.match_prefix(list(range(40)), 40, complete=True).num_blocks == 0
    b = seq("b", list(range(40)) + [5])
    m = bm.match_prefix(b.token_ids, 40)
    # blocks 0..7 lost their windowed pages up to a's last chunk start (32 - 8 + 1) // 4
    assert m.num_blocks == 10  # at 40 tokens the windows read blocks 8 and 9 only: whole
    bm.allocate_prefix(b, m)  # the match's windowed reads are whole (asserts in the tables)
    check_pages(bm, [b])


def test_fork_and_copy_on_write_copy_every_groups_page() -> None:
    bm = manager()
    a = seq("a", list(range(10)))
    bm.allocate_prefix(a, bm.match_prefix(a.token_ids, 9))
    step(bm, a, 10)
    decode(bm, a, 12)
    c = seq("c", list(a.token_ids))
    c.num_computed_tokens = a.num_computed_tokens
    bm.fork(a, c)
    check_pages(bm, [a, c])
    last = a.block_table[-1]
    c.append_token(8)
    assert bm.prepare_write(c, c.num_computed_tokens + 1)
    copies = bm.take_copies()
    assert len(copies) == 3 and c.block_table[-1] != last
    assert {src for src, _ in copies} == set(bm.pages[last])
    assert {dst for _, dst in copies} == set(bm.pages[c.block_table[-1]])
    check_pages(bm, [a, c])
    bm.free(a)
    bm.free(c)
    check_pages(bm, [])


def test_random_traffic_never_leaks_a_page() -> None:
    """Admissions (some over cached prefixes), chunks, decodes, forks and frees at random on a
    small pool: every page accounted for after each operation, all back at the end."""
    rng = random.Random(5)
    bm = manager(pages=90, windows=(8, None, 12, 8, 8, None))
    live: list[Sequence] = []
    base = [rng.randrange(50) for _ in range(64)]
    for t in range(600):
        op = rng.random()
        if op < 0.25 and len(live) < 6:
            ids = base[:rng.randrange(1, 60)] + [rng.randrange(50) for _ in range(rng.randrange(8))]
            s = seq(f"s{t}", ids)
            bm.allocate_prefix(s, bm.match_prefix(s.token_ids, len(ids) - 1))
            if not bm.prepare_write(s, s.num_tokens):
                bm.free(s)
                continue
            live.append(s)
        elif op < 0.75 and live:
            s = rng.choice(live)
            if s.num_computed_tokens < s.num_tokens:
                n = min(rng.randrange(1, 9), s.num_tokens - s.num_computed_tokens)
                if bm.prepare_write(s, s.num_computed_tokens + n):
                    s.num_computed_tokens += n
                    bm.publish(s)
                    bm.release_out_of_window(s)
            else:
                s.append_token(rng.randrange(50))
        elif op < 0.8 and live and len(live) < 6:
            p = rng.choice(live)
            if p.num_computed_tokens == p.num_tokens:
                c = seq(f"f{t}", list(p.token_ids))
                c.num_computed_tokens = p.num_computed_tokens
                bm.fork(p, c)
                live.append(c)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        check_pages(bm, live)
    for s in live:
        bm.free(s)
    check_pages(bm, [])
    assert bm.num_free_pages == bm.num_pages
    assert bm.num_released_pages > 100 and bm.num_cache_hits > 100  # both paths taken


def test_a_llama_family_hybrid_runs_op_by_op_and_matches_transformers(hf_model_dir) -> None:
    """Qwen2 with a full and a windowed layer: the hybrid layout turns the fused decode layers
    (which read one block table) off; tokens and logits still transformers'."""
    from test_engine_parity import GEN, GREEDY, check_logits, hf_tokens, make_core, prompts, run

    d = hf_model_dir("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1,
                     layer_types=["full_attention", "sliding_attention"])
    core = make_core(d, hybrid_kv="auto")
    assert core.runner.kv_plan is not None and core.runner.model.fused_decode is None
    ps = prompts(1, (33,))
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(d, tuple(p), GEN)
    assert core.block_manager.num_released_pages > 0
    check_logits(core, d, tol=1e-4, length=70)
