"""Prefix pull between two engines, engine side (engine/prefix_shares.py): the holder exports
the blocks of a prefix it holds (pool or host tier), the reader imports them into fresh blocks
that join its prefix cache only when the read completed, and then serves the prompt with the
tokens recomputing gives. The bytes move here by a copy between the two KV tensors, as the NIXL
read moves them between workers."""

from __future__ import annotations

import pytest
from engine_runs import run_one, seeded_prompt

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.prefix_hash import block_hashes
from kvrelay.engine.sampling_params import SamplingParams

BLOCK = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SLOT_BYTES = 6 * 2 * BLOCK * 4 * 32 * 4


def make_core(model_dir: str, **kw: object) -> EngineCore:
    opts: dict[str, object] = dict(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64,
                                   seed=0)
    opts.update(kw)
    return EngineCore(EngineConfig.from_kwargs(model_dir, **opts))


def prompt(seed: int, n: int = 150) -> list[int]:
    return seeded_prompt(seed, n)


def run(core: EngineCore, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and how many prompt tokens were cached."""
    return run_one(core, rid, tokens, GREEDY)


def copy_blocks(src: EngineCore, src_ids: list[int], dst: EngineCore, dst_ids: list[int]) -> None:
    for a, b in zip(src_ids, dst_ids, strict=True):
        dst.runner.kv.select(-4, b).copy_(src.runner.kv.select(-4, a))


@pytest.fixture(scope="module")
def engines(demo_model_dir):
    holder = make_core(demo_model_dir, kv_offload_memory=128 * SLOT_BYTES)
    reader = make_core(demo_model_dir)
    yield holder, reader
    holder.close()
    reader.close()


def test_a_pulled_prefix_serves_the_recomputed_tokens(engines) -> None:
    holder, reader = engines
    history = prompt(1)
    answer, _ = run(holder, "turn1", history)  # the holder computed the prompt and the answer
    turn2 = history + answer + prompt(2, 20)
    ref, _ = run(make_core_like(reader), "ref", turn2)

    # The reader pulls what the holder has of turn 2's prompt: the history and the answer.
    src, covered = holder.export_prefix("x1", turn2[:-1])
    assert covered == (len(history) + len(answer) - 1) // BLOCK * BLOCK
    dst, have = reader.begin_import("i1", turn2[:covered])
    assert have == 0 and len(dst) == len(src)
    copy_blocks(holder, src, reader, dst)
    assert holder.end_export("x1"), "held throughout: the read is valid"
    assert reader.end_import("i1", complete=True) == covered
    got, cached = run(reader, "turn2", turn2)
    assert got == ref and cached == covered
    assert reader.block_manager.num_free_blocks == reader.block_manager.num_blocks
    assert holder.block_manager.num_free_blocks == holder.block_manager.num_blocks


def test_an_incomplete_pull_is_never_served(engines) -> None:
    holder, reader = engines
    p = prompt(3)
    run(holder, "h", p)
    ref, _ = run(make_core_like(reader), "ref", p)
    src, covered = holder.export_prefix("x2", p)
    dst, _ = reader.begin_import("i2", p[:covered])
    copy_blocks(holder, src[: len(src) // 2], reader, dst[: len(dst) // 2])  # cut mid-read
    assert reader.end_import("i2", complete=False) == 0
    holder.end_export("x2")
    got, cached = run(reader, "p", p)
    assert got == ref and cached == 0, "nothing of the partial read was used"
    assert reader.stats().prefix_shares["failed_imports"] >= 1


def test_an_expired_export_tells_the_reader_and_returns_its_blocks(engines) -> None:
    holder, _ = engines
    p = prompt(4)
    run(holder, "h4", p)
    src, covered = holder.export_prefix("x3", p, ttl_s=0.0)
    assert src and covered
    holder.step()  # expires it
    assert not holder.end_export("x3"), "the reader must not trust a read past expiry"
    assert holder.block_manager.num_free_blocks == holder.block_manager.num_blocks


def test_a_demoted_prefix_is_exported_from_the_host_tier(engines) -> None:
    holder, _ = engines
    p = prompt(5)
    run(holder, "h5", p)
    for s in range(6, 10):  # push p out of the holder's pool (64 blocks)
        run(holder, f"e{s}", prompt(s))
    assert not set(block_hashes(p, BLOCK)) & holder.cached_hash_sets()["device"]
    _, covered = holder.export_prefix("x4", p)
    assert covered == len(p) // BLOCK * BLOCK, "promoted from the host tier to be read"
    holder.end_export("x4")


def make_core_like(core: EngineCore) -> EngineCore:
    return EngineCore(core.config)


def test_a_pull_without_room_for_all_imports_the_leading_blocks_that_fit(demo_model_dir) -> None:
    """A reader whose pool has fewer free blocks than the prefix lacks imports the leading ones
    that fit beside what its admitted prompts still need, and serves the recomputed tokens with
    the pulled part cached; with no room beyond that promise it refuses (MemoryError)."""
    holder = make_core(demo_model_dir)
    reader = make_core(demo_model_dir, num_blocks=24)  # chunks of 64 tokens (8 blocks)
    try:
        p = prompt(11, 180)  # 22 full blocks
        run(holder, "h", p)
        ref, _ = run(make_core_like(reader), "ref", p)
        bm = reader.block_manager
        # 13 blocks; one output token, as on a prefill worker (the promise covers prompts)
        reader.add_request("busy", prompt(12, 100), SamplingParams(max_tokens=1))
        reader.step()  # admitted: its first chunk holds 8, it will take 5 more
        assert reader.scheduler.promised_blocks() == 5 and bm.num_free_blocks == 16
        src, covered = holder.export_prefix("x5", p)
        dst, have = reader.begin_import("i5", p[:covered])
        assert have == 0 and len(dst) == 11, "the leading blocks that fit beside the promise"
        copy_blocks(holder, src[:len(dst)], reader, dst)
        holder.end_export("x5")
        assert reader.end_import("i5", complete=True) == 11 * BLOCK
        while reader.has_unfinished():
            reader.step()
        got, cached = run(reader, "p", p)
        assert got == ref and cached == 11 * BLOCK, "the pulled blocks serve, the rest computes"

        with pytest.raises(MemoryError, match="promised"):
            reader.shares.begin_import("i6", p[:covered], None, 5.0,
                                       reserve=bm.num_free_blocks)
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        holder.close()
        reader.close()
