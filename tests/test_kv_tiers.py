"""The KV hierarchy below an engine's pool (engine/tiers): blocks the pool evicts are demoted to
a host tier (and from there spilled to a disk tier) and promoted back on a prefix hit, giving
the same greedy tokens as recomputing them; a corrupted, truncated or foreign tier file is a
counted miss that recomputes; every pool block and tier slot comes back on abort."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from engine_runs import run_one, seeded_prompt

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.prefix_hash import block_hashes
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tiers.disk_files import (
    HEAD_BYTES,
    DiskFiles,
    DiskReadError,
    layout_fingerprint,
)
from kvrelay.engine.tiers.media import DEVICE, DISK, HOST
from kvrelay.engine.tiers.tier_index import TierIndex

BLOCK = 8
POOL = 48  # blocks: 384 tokens, so a few 160-token prompts evict each other
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# One block of every layer of the tiny demo model (6 layers, K and V, 4 KV heads of 32, fp32).
SLOT_BYTES = 6 * 2 * BLOCK * 4 * 32 * 4


def make_core(model_dir: str, **kw: object) -> EngineCore:
    opts: dict[str, object] = dict(block_size=BLOCK, num_blocks=POOL,
                                   max_num_batched_tokens=64, seed=0)
    opts.update(kw)
    return EngineCore(EngineConfig.from_kwargs(model_dir, **opts))


def prompt(seed: int, n: int = 160) -> list[int]:
    return seeded_prompt(seed, n)


def run(core: EngineCore, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and how many prompt tokens were cached."""
    return run_one(core, rid, tokens, GREEDY)


def settle(core: EngineCore) -> None:
    assert core.tiers is not None
    core.tiers.drain()
    core.block_manager.flush_stores()


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    """Greedy tokens of each test prompt, recomputed by an engine without tiers."""
    core = make_core(demo_model_dir)
    return {s: run(core, f"ref{s}", prompt(s))[0] for s in range(6)}


def test_tier_index_lru_pins_and_readiness() -> None:
    idx = TierIndex(2)
    a, _ = idx.take(1, 0, (1,))
    assert idx.lookup(1, 0, (1,)) is None, "not ready until its bytes are complete"
    idx.mark_ready(a)
    b, _ = idx.take(2, 0, (2,))
    idx.mark_ready(b)
    assert idx.hash_set() == {1, 2} and idx.hash_set() is idx.hash_set()
    idx.touch(a)  # b is now least recently used
    idx.pin(b)
    slot, evicted = idx.take(3, 0, (3,))
    assert slot == a and evicted is not None and evicted.hash == 1, "pinned b was skipped"
    assert idx.take(4, 0, (4,)) is None, "a is not ready, b is pinned: nothing to evict"
    idx.unpin(b)
    assert idx.lookup(2, 0, (2,)) == b and idx.lookup(2, 0, (9,)) is None
    assert idx.lookup(2, 7, (2,)) is None, "another parent is another block"


def _files(root: Path, layout: str = "layout-a", keep: bool = False) -> DiskFiles:
    return DiskFiles(root, layout_fingerprint(layout), slots=8, payload_bytes=256,
                     max_tokens=4, keep=keep)


def _flip(files: DiskFiles, at: int) -> None:
    """Flip one byte of the tier's file at ``at``."""
    with open(files.file, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0xFF]))


def test_disk_record_round_trip_and_every_corruption_is_refused(tmp_path: Path) -> None:
    files = _files(tmp_path)
    payload = torch.arange(64, dtype=torch.float32)
    files.write(3, 11, 10, (5, 6), payload)
    into = torch.zeros(64)
    files.read(3, 11, 10, (5, 6), into)
    assert torch.equal(into, payload)
    for block, parent, toks in ((12, 10, (5, 6)), (11, 9, (5, 6)), (11, 10, (5, 7))):
        with pytest.raises(DiskReadError):
            files.read(3, block, parent, toks, torch.zeros(64))
    with pytest.raises(DiskReadError, match="layout"):
        _read_foreign(tmp_path, into)
    end = files.offset(3) + files.payload_at + files.payload_bytes
    _flip(files, end - 1)  # the payload's last byte
    with pytest.raises(DiskReadError, match="payload checksum"):
        files.read(3, 11, 10, (5, 6), torch.zeros(64))
    _flip(files, end - 1)
    files.read(3, 11, 10, (5, 6), into)  # whole again
    _flip(files, files.offset(3) + HEAD_BYTES + 8)  # the second token id
    with pytest.raises(DiskReadError, match="header checksum"):
        files.read(3, 11, 10, (5, 6), torch.zeros(64))
    files.write(7, 11, 10, (5, 6), payload)
    os.truncate(files.file, files.offset(7) + files.payload_at + 100)  # cut inside the payload
    with pytest.raises(DiskReadError, match="truncated"):
        files.read(7, 11, 10, (5, 6), torch.zeros(64))
    with pytest.raises(DiskReadError):
        files.read(4, 11, 10, (5, 6), torch.zeros(64))  # never written
    with pytest.raises(ValueError, match="payload of 16 bytes"):
        files.write(4, 1, 0, (1,), torch.zeros(4))
    files.close()
    assert not files.file.exists()


def test_records_carry_zlibs_crc32_whichever_library_computed_it(tmp_path: Path) -> None:
    """The tier's CRC-32 is zlib's (zlib-ng computes the same one faster): a record a process
    with zlib-ng wrote passes a check made with zlib, and the other way round."""
    import zlib

    from kvrelay.engine.tiers import disk_files

    data = os.urandom(70_000)
    assert disk_files.crc32(data) == zlib.crc32(data)
    assert disk_files.crc32(data[1000:], disk_files.crc32(data[:1000])) == zlib.crc32(data)
    files = _files(tmp_path)
    payload = torch.arange(64, dtype=torch.float32)
    files.write(0, 11, 10, (5, 6), payload)
    with open(files.file, "rb") as f:
        f.seek(files.offset(0))
        head = f.read(HEAD_BYTES)
    assert int.from_bytes(head[HEAD_BYTES - 8:HEAD_BYTES - 4], "little") == \
        zlib.crc32(payload.numpy().tobytes())
    files.close()


def _read_foreign(tmp_path: Path, into: torch.Tensor) -> None:
    """A record written under one layout, read by a tier of another."""
    writer = _files(tmp_path / "x", "layout-a", keep=True)
    writer.write(0, 1, 0, (1,), into)
    writer.close()
    reader = _files(tmp_path / "x", "layout-b", keep=True)  # finds the file, takes nothing
    assert reader.found == []
    reader.read(0, 1, 0, (1,), into)


def test_a_kept_tier_file_gives_back_the_intact_records_of_its_layout(tmp_path: Path) -> None:
    a = _files(tmp_path, keep=True)
    for slot in (1, 2, 5):
        a.write(slot, 100 + slot, 99, (slot, slot + 1), torch.full((64,), float(slot)))
    a.remove(2)
    a.close()
    b = _files(tmp_path, keep=True)
    assert b.dir == a.dir and b.found == [(1, 101, 99, (1, 2)), (5, 105, 99, (5, 6))]
    into = torch.zeros(64)
    b.read(5, 105, 99, (5, 6), into)
    assert torch.equal(into, torch.full((64,), 5.0))
    b.close()
    c = _files(tmp_path)  # not kept: nothing is taken, and the earlier records are gone
    assert c.found == []
    with pytest.raises(DiskReadError):
        c.read(5, 105, 99, (5, 6), into)
    c.close()


def test_workers_sharing_a_tier_directory_get_one_each(tmp_path: Path) -> None:
    a = _files(tmp_path)
    b = _files(tmp_path)
    assert a.dir != b.dir and a.dir.parent == b.dir.parent == tmp_path
    a.write(0, 1, 0, (1,), torch.ones(64))
    a.close()
    c = _files(tmp_path)  # takes the directory a gave up...
    assert c.dir == a.dir and c.found == []  # ...and none of its blocks
    with pytest.raises(DiskReadError):
        c.read(0, 1, 0, (1,), torch.ones(64))
    b.close()
    c.close()


def test_deferred_stores_are_bounded_a_step_and_never_lost_on_reuse() -> None:
    """After a step with decodes at most a few blocks are stored (the rest wait), and a block
    whose store is still waiting when the pool reuses it is stored first: its KV reaches the
    host tier intact."""
    from kvrelay.engine.block_manager import BlockManager
    from kvrelay.engine.sampling_params import SamplingParams as SP
    from kvrelay.engine.sequence import Sequence
    from kvrelay.engine.tiers.kv_tiers import KVTiers, TierConfig

    kv = torch.zeros(2, 2, 8, 4, 1, 2)  # 2 layers, K/V, 8 blocks of 4 tokens, 1 head of 2
    for b in range(8):
        kv[:, :, b] = b + 1
    tiers = KVTiers(kv, 4, TierConfig(host_slots=16), b"x" * 16)
    bm = BlockManager(8, 4, True, tiers)
    seq = Sequence("a", list(range(1, 17)), SP())
    assert bm.allocate(seq, 16)
    seq.num_computed_tokens = 16
    bm.publish(seq)  # 4 full blocks queued
    first = list(seq.block_table)
    bm.flush_stores(limit=1)
    assert len(tiers.hash_sets()[HOST]) == 1
    bm.free(seq)
    other = Sequence("b", list(range(100, 132)), SP())
    assert bm.allocate(other, 32)  # every block, a's included: the 3 waiting are stored first
    assert len(tiers.hash_sets()[HOST]) == 4
    hashes = block_hashes(list(range(1, 17)), 4)
    for h, bid in zip(hashes, first, strict=True):
        slot = tiers.host_index.slot_of(h)
        assert slot is not None
        assert torch.equal(tiers.host[slot], torch.full_like(kv[:, :, 0], bid + 1))


def test_host_tier_promotes_evicted_prefixes_with_the_recomputed_tokens(demo_model_dir,
                                                                        reference) -> None:
    core = make_core(demo_model_dir, kv_offload_memory=128 * SLOT_BYTES)
    try:
        first = run(core, "a0", prompt(0))
        assert first == (reference[0], 0)
        for s in (1, 2, 3):  # three more 160-token prompts: prompt 0 leaves the pool
            assert run(core, f"a{s}", prompt(s))[0] == reference[s]
        sets = core.cached_hash_sets()
        h0 = block_hashes(prompt(0), BLOCK)
        assert not set(h0) & sets[DEVICE], "the pool no longer holds prompt 0"
        assert set(h0) <= sets[HOST], "...but the host tier does: still routable"
        again, cached = run(core, "b0", prompt(0))
        assert again == reference[0]
        assert cached == (160 - 1) // BLOCK * BLOCK
        st = core.stats().kv_tiers[HOST]
        assert st.hit_blocks == cached // BLOCK and st.load_failures == 0
        assert st.stored_blocks >= 4 * (160 // BLOCK)
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        core.close()


def test_disk_tier_spills_and_loads_back_and_a_bad_file_recomputes(demo_model_dir, reference,
                                                                   tmp_path: Path) -> None:
    # A host tier of two prompts: after four, prompt 0 is on disk only.
    core = make_core(demo_model_dir, kv_offload_memory=40 * SLOT_BYTES,
                     kv_offload_dir=str(tmp_path), kv_offload_disk=200 * SLOT_BYTES)
    try:
        for s in range(4):
            assert run(core, f"a{s}", prompt(s))[0] == reference[s]
        settle(core)
        h0 = block_hashes(prompt(0), BLOCK)
        sets = core.cached_hash_sets()
        assert set(h0) <= sets[DISK] and not set(h0) & (sets[DEVICE] | sets[HOST])
        again, cached = run(core, "b0", prompt(0))
        assert again == reference[0] and cached == (160 - 1) // BLOCK * BLOCK
        disk = core.stats().kv_tiers[DISK]
        assert disk.hit_blocks == cached // BLOCK and disk.load_failures == 0

        # Prompt 1 is on disk too; corrupt one of its files: that block and every block
        # after it recompute, the tokens stay right, the failure is counted.
        for s in (2, 3, 4, 5):
            run(core, f"c{s}", prompt(s))
        settle(core)
        h1 = block_hashes(prompt(1), BLOCK)
        assert set(h1) <= core.cached_hash_sets()[DISK]
        assert core.tiers is not None and core.tiers.disk_index is not None
        slot = core.tiers.disk_index.slot_of(h1[5])
        disk = core.tiers.disk
        assert slot is not None and disk is not None
        _flip(disk, disk.offset(slot) + disk.payload_at + disk.payload_bytes - 100)
        failures = core.stats().kv_tiers[DISK].load_failures
        again, cached = run(core, "b1", prompt(1))
        assert again == reference[1]
        assert cached == 5 * BLOCK, "blocks before the bad one were used, none after it"
        assert core.stats().kv_tiers[DISK].load_failures == failures + 1
    finally:
        core.close()


def test_a_kept_disk_tier_serves_the_worker_that_restarts_on_it(demo_model_dir, reference,
                                                                 tmp_path: Path) -> None:
    """--kv-offload-keep: the disk tier's files outlive the engine; the next one on the
    directory indexes the intact records of its layout (a torn one is not taken) and serves
    them with the recomputed tokens; without keep the records go at start."""
    tiers = dict(kv_offload_memory=40 * SLOT_BYTES, kv_offload_dir=str(tmp_path),
                 kv_offload_disk=200 * SLOT_BYTES, kv_offload_keep=True)
    first = make_core(demo_model_dir, **tiers)
    try:
        for s in range(3):
            run(first, f"a{s}", prompt(s))
        settle(first)
        assert first.tiers is not None and first.tiers.disk is not None
        h1 = block_hashes(prompt(1), BLOCK)
        disk = first.tiers.disk
        bad = first.tiers.disk_index.slot_of(h1[4])  # type: ignore[union-attr]
        assert bad is not None
    finally:
        first.close()
    _flip(disk, disk.offset(bad) + HEAD_BYTES)  # torn after its writer left: a token id

    second = make_core(demo_model_dir, **tiers)
    try:
        on_disk = second.cached_hash_sets()[DISK]
        assert set(block_hashes(prompt(0), BLOCK)) <= on_disk
        assert h1[3] in on_disk and h1[4] not in on_disk
        again, cached = run(second, "b0", prompt(0))
        assert again == reference[0] and cached == (160 - 1) // BLOCK * BLOCK
        again, cached = run(second, "b1", prompt(1))
        assert again == reference[1] and cached == 4 * BLOCK, "up to the torn block"
        assert second.stats().kv_tiers[DISK].load_failures == 0
    finally:
        second.close()

    third = make_core(demo_model_dir, **{**tiers, "kv_offload_keep": False})
    try:
        assert not third.cached_hash_sets()[DISK], "not kept: an earlier run's files go"
    finally:
        third.close()


def test_requests_sharing_a_prefix_being_loaded_share_its_loads(demo_model_dir, reference,
                                                                 tmp_path: Path) -> None:
    """Four prompts that extend one prefix on disk (long prompts until their prefix matched):
    each block is read once, and all four are admitted together once it has loaded, not one
    long prompt a step; and each is matched against the cache again once, when the last of its
    prefix's loads is in, not as each block lands (the reads are slowed to land a few steps
    apart)."""
    import time

    core = make_core(demo_model_dir, kv_offload_memory=40 * SLOT_BYTES,
                     kv_offload_dir=str(tmp_path), kv_offload_disk=200 * SLOT_BYTES,
                     long_prefill_threshold=32)
    try:
        for s in range(4):
            run(core, f"a{s}", prompt(s))
        settle(core)
        blocks = 160 // BLOCK
        assert set(block_hashes(prompt(0), BLOCK)) <= core.cached_hash_sets()[DISK]
        assert not set(block_hashes(prompt(0), BLOCK)) & core.cached_hash_sets()[DEVICE]
        assert core.tiers is not None and core.tiers.disk is not None
        disk, bm = core.tiers.disk, core.block_manager
        read, match = disk.read, bm.match_prefix
        matches = []

        def slow_read(*a, **kw):
            time.sleep(0.003)
            return read(*a, **kw)

        def counted_match(*a, **kw):
            matches.append(1)
            return match(*a, **kw)

        disk.read, bm.match_prefix = slow_read, counted_match  # type: ignore[method-assign]
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for j in range(4):
            core.add_request(f"c{j}", prompt(0) + [7 + j], first)
        finished_at: dict[str, int] = {}
        for step in range(200):
            for o in core.step():
                if o.finished:
                    finished_at[o.request_id] = step
            if len(finished_at) == 4:
                break
        assert len(set(finished_at.values())) == 1, finished_at
        hits = core.stats().kv_tiers[DISK].hit_blocks
        assert 0 < hits <= blocks, "each block read at most once, for all four"
        assert len(matches) <= 2 * 4, f"{len(matches)} prefix matches for four requests"
    finally:
        core.close()


def test_abort_while_loading_returns_every_block_and_slot(demo_model_dir, tmp_path: Path) -> None:
    core = make_core(demo_model_dir, kv_offload_memory=40 * SLOT_BYTES,
                     kv_offload_dir=str(tmp_path), kv_offload_disk=200 * SLOT_BYTES)
    try:
        for s in range(4):
            run(core, f"a{s}", prompt(s))
        settle(core)
        core.add_request("x", prompt(0), GREEDY)  # its prefix starts loading from disk now
        assert core.tiers is not None and core.tiers._loading
        core.step()
        core.abort("x")
        core.step()
        settle(core)
        bm = core.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        tiers = core.tiers
        assert not tiers._loading and tiers._staged_spills == 0
        for idx in (tiers.host_index, tiers.disk_index):
            assert idx is not None
            assert all(idx.entry(s).ready and idx.entry(s).pins == 0
                       for s in list(idx._entries)), "no slot left in flight or pinned"
        # The loaded blocks stayed in the host tier: the next request finds them there.
        _, cached = run(core, "y", prompt(0))
        assert cached > 0
    finally:
        core.close()


def test_a_demoted_prefix_is_found_only_under_its_own_cache_salt(demo_model_dir,
                                                                 reference) -> None:
    core = make_core(demo_model_dir, kv_offload_memory=128 * SLOT_BYTES)
    try:
        sp = GREEDY
        core.add_request("a", prompt(0), sp, cache_salt="tenant-a")
        while core.has_unfinished():
            core.step()
        for s in (1, 2, 3):
            run(core, f"e{s}", prompt(s))
        assert core.stats().kv_tiers[HOST].hit_blocks == 0
        got, cached = run(core, "unsalted", prompt(0))  # another namespace: recomputed
        assert got == reference[0] and cached == 0
        core.add_request("b", prompt(0), sp, cache_salt="tenant-b")
        outs = [o for _ in range(200) for o in core.step() if o.request_id == "b"]
        assert outs[-1].finished and outs[-1].num_cached_tokens == 0
        assert core.stats().kv_tiers[HOST].hit_blocks == 0, "no tier hit across salts"
    finally:
        core.close()


def test_a_decode_engine_reserving_a_demoted_prompt_promotes_it(demo_model_dir) -> None:
    core = make_core(demo_model_dir, kv_offload_memory=128 * SLOT_BYTES)
    try:
        for s in range(4):
            run(core, f"a{s}", prompt(s))
        res = core.reserve("r", prompt(0))
        assert res.num_cached_tokens == 160 // BLOCK * BLOCK
        assert core.stats().kv_tiers[HOST].hit_blocks == 160 // BLOCK
        core.abort("r", emit=False)
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        core.close()


def test_offload_flags_are_checked() -> None:
    from kvrelay.engine.config import CacheConfig

    with pytest.raises(ValueError, match="needs kv_offload_memory"):
        CacheConfig(kv_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="needs kv_offload_dir"):
        CacheConfig(kv_offload_memory=2**20, kv_offload_keep=True)
    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(kv_offload_memory=2**20, enable_prefix_caching=False)
    assert CacheConfig(kv_offload_memory="1GiB").kv_offload_memory == 2**30


@pytest.mark.parametrize(("arch", "hybrid"), [
    ("deepseek_v3", "off"), ("qwen3_moe", "off"), ("gemma3", "off"), ("gpt_oss", "off"),
    ("gemma3", "auto")])
def test_other_layouts_demote_spill_and_load_back_their_own_kv(arch, hybrid, hf_model_dir,
                                                             tmp_path: Path) -> None:
    """A tier slot is a pool block across every layer and plane, whatever the model caches:
    DeepSeek-V3's one latent plane per layer (multi-head latent attention), an MoE model's K
    and V, a sliding-window hybrid's (Gemma 3, gpt-oss with its sinks; under the hybrid KV
    layout a page of every layer group). Evicted to the host tier, spilled to disk and loaded
    back, the prompts' tokens are the ones recomputing them gives. (Under the hybrid layout
    the pool first evicts idle windowed pages, copying their block down whole first, and the
    partial block stays indexed in the pool for a continuation its windows allow.)"""
    model = hf_model_dir(arch)
    plain = make_core(model, hybrid_kv=hybrid)
    refs = {s: run(plain, f"r{s}", prompt(s))[0] for s in range(4)}
    slot = plain.runner.kv_spec.bytes_per_block_all_layers
    if plain.runner.kv_plan is not None:
        slot *= plain.runner.kv_plan.num_groups  # k layers a page, a page per group
    plain.close()
    core = make_core(model, kv_offload_memory=40 * slot, kv_offload_dir=str(tmp_path),
                     kv_offload_disk=200 * slot, hybrid_kv=hybrid)
    try:
        for s in range(4):
            assert run(core, f"a{s}", prompt(s)) == (refs[s], 0)
        settle(core)
        sets = core.cached_hash_sets()
        h0 = block_hashes(prompt(0), BLOCK)
        assert set(h0) <= sets[DISK]
        if hybrid == "off":
            assert not set(h0) & (sets[DEVICE] | sets[HOST])
        for s in (0, 1):  # prompt 0 from disk, prompt 1 from wherever it went
            assert run(core, f"b{s}", prompt(s)) == (refs[s], (160 - 1) // BLOCK * BLOCK)
        st = core.stats().kv_tiers
        assert st[DISK].hit_blocks >= 159 // BLOCK
        assert st[DISK].load_failures == st[HOST].load_failures == 0
    finally:
        core.close()
