"""SDPA over the paged cache: grouped decodes against a per-sequence reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.attention import DecodeGroup, SdpaMetadata, group_by_length
from kvrelay.engine.attention.sdpa import sdpa_attention


@pytest.mark.parametrize("seed", range(20))
def test_groups_bound_padding_and_cover_every_length(seed: int) -> None:
    rng = random.Random(seed)
    bs = 16
    lens = sorted(rng.choice([rng.randint(1, 400), rng.randint(1500, 2200)])
                  for _ in range(rng.randint(1, 120)))
    sizes = group_by_length(lens, bs)
    assert sum(sizes) == len(lens) and all(n > 0 for n in sizes)
    start = 0
    for n in sizes:
        blocks = [-(-x // bs) for x in lens[start:start + n]]
        assert n * blocks[-1] <= 1.25 * sum(blocks) + 4  # padding within a quarter (+ slack)
        start += n


def test_equal_lengths_make_one_group() -> None:
    assert group_by_length([300] * 50, 16) == [50]
    assert group_by_length([], 16) == []


@pytest.mark.parametrize("window", [None, 37])
def test_grouped_decodes_equal_per_sequence_attention(window: int | None) -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, kvh, heads, d, num_blocks = 16, 2, 6, 8, 400
    k_cache = torch.randn(num_blocks * bs, kvh, d)
    v_cache = torch.randn(num_blocks * bs, kvh, d)
    lens = sorted([rng.randint(1, 60) for _ in range(9)] + [700, 705, 1200])
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    groups, start = [], 0
    for count in group_by_length(lens, bs):
        run, width = lens[start:start + count], -(-lens[start + count - 1] // bs)
        padded = [t + [0] * (width - len(t)) for t in tables[start:start + count]]
        groups.append(DecodeGroup(start, count, torch.tensor(run), torch.tensor(padded)))
        start += count
    assert len(groups) > 1
    meta = SdpaMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_prefill_tokens=0,
                        block_size=bs, decode_groups=groups)
    q = torch.randn(len(lens), heads, d)
    none = torch.empty(0, kvh, d)
    out = sdpa_attention(q, none, none, k_cache, v_cache, meta, 0.3, window)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        lo = 0 if window is None else max(0, n - window)
        ks = k_cache[slots[lo:]].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        vs = v_cache[slots[lo:]].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        ref = F.scaled_dot_product_attention(q[i][:, None], ks, vs, scale=0.3)[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def _paged_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: list[list[int]], lens: list[int], bs: int, scale: float,
                     window: int | None) -> torch.Tensor:
    heads, kvh = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        lo = 0 if window is None else max(0, n - window)
        ks = k_cache[slots[lo:]].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        vs = v_cache[slots[lo:]].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        out[i] = F.scaled_dot_product_attention(q[i][:, None], ks, vs, scale=scale)[:, 0]
    return out


native = pytest.importorskip("kvrelay.engine.cpu.attention")
needs_native = pytest.mark.skipif(not native.available(),
                                  reason="native kernels need a C compiler with OpenMP")


@needs_native
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(6, 2, 16), (8, 8, 64), (4, 1, 8), (12, 4, 80)])
def test_native_paged_decode_equals_per_sequence_attention(window: int | None, heads: int,
                                                           kvh: int, d: int) -> None:
    """Every decode in one call, straight from the paged blocks: GQA, MHA and MQA, head sizes
    on and off the 16-float vector width, a sliding window, and contexts long enough to be cut
    into partitions whose softmaxes merge (1200 keys, partitions of 256)."""
    torch.manual_seed(0)
    rng = random.Random(2)
    bs, num_blocks = 16, 400
    k_cache = torch.randn(num_blocks * bs, kvh, d)
    v_cache = torch.randn(num_blocks * bs, kvh, d)
    lens = [rng.randint(1, 60) for _ in range(9)] + [700, 1, 1200, 16, 17]
    rng.shuffle(lens)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, d)
    out = torch.full_like(q, float("nan"))
    native.paged_decode(q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32), out,
                        bs, 0.3, window)
    ref = _paged_reference(q, k_cache, v_cache, tables, lens, bs, 0.3, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_single_long_sequence_uses_every_thread_and_matches() -> None:
    """Batch 1 over 3000 keys: the context is split across the threads and merged exactly."""
    torch.manual_seed(3)
    bs, kvh, heads, d = 16, 2, 4, 32
    n = 3000
    table = list(range(-(-n // bs)))[::-1]
    k_cache = torch.randn(len(table) * bs, kvh, d) * 3  # peaky softmax: merging must be exact
    v_cache = torch.randn(len(table) * bs, kvh, d)
    q = torch.randn(1, heads, d)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
                        torch.tensor([n], dtype=torch.int32), out, bs, 0.5, None)
    ref = _paged_reference(q, k_cache, v_cache, [table], [n], bs, 0.5, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_rejects_a_context_longer_than_its_block_table() -> None:
    q = torch.randn(1, 2, 16)
    cache = torch.randn(64, 1, 16)
    with pytest.raises(RuntimeError, match="failed"):
        native.paged_decode(q, cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                            torch.tensor([33], dtype=torch.int32), torch.empty_like(q), 16, 1.0,
                            None)


def test_native_build_is_cached_by_source_compiler_and_cpu(tmp_path, monkeypatch) -> None:
    """A second build of the same source finds the cached library instead of compiling."""
    from kvrelay.engine.cpu import native as kernels

    if kernels._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    first = kernels.build()
    mtime = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == mtime
    assert first.parent == tmp_path / "native"


def test_native_missing_compiler_is_a_clear_error(monkeypatch, tmp_path) -> None:
    from kvrelay.engine.cpu import native as kernels

    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"failed|no C compiler"):
        kernels.build(cc=str(tmp_path / "no-such-cc"))


def _prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       table: list[int], q_start: int, q_len: int, ctx: int, bs: int,
                       scale: float, window: int | None) -> torch.Tensor:
    heads, kvh = q.shape[1], k_cache.shape[1]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
    k = k_cache[slots].transpose(0, 1).repeat_interleave(heads // kvh, 0)
    v = v_cache[slots].transpose(0, 1).repeat_interleave(heads // kvh, 0)
    qpos = torch.arange(ctx - q_len, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    qs = q[q_start:q_start + q_len].transpose(0, 1)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


@needs_native
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(12, 4, 64), (8, 4, 32), (4, 1, 16), (6, 2, 128),
                                                 (4, 4, 80)])
def test_native_paged_prefill_equals_causal_attention(window: int | None, heads: int, kvh: int,
                                                      d: int) -> None:
    """Several spans in one call, straight from the paged blocks: fresh prompts, chunks over a
    cached prefix (bottom-right causal), one-row spans, spans across tile edges (32) and a
    sliding window; every head layout and head sizes of 1 to 8 vectors."""
    torch.manual_seed(0)
    rng = random.Random(4)
    bs, num_blocks = 16, 600
    k_cache = torch.randn(num_blocks * bs, kvh, d)
    v_cache = torch.randn(num_blocks * bs, kvh, d)
    spans = [(100, 100), (5, 5), (33, 200), (64, 64), (7, 300), (1, 40), (200, 200)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-ctx // bs))] for _, ctx in spans]
    starts = [0]
    for q_len, _ in spans[:-1]:
        starts.append(starts[-1] + q_len)
    q = torch.randn(sum(n for n, _ in spans), heads, d)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = torch.tensor([starts, [n for n, _ in spans], [c for _, c in spans]], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    native.paged_prefill(q, k_cache, v_cache, padded, meta, out, bs, 0.2, window)
    for j, (q_len, ctx) in enumerate(spans):
        ref = _prefill_reference(q, k_cache, v_cache, tables[j], starts[j], q_len, ctx, bs, 0.2,
                                 window)
        torch.testing.assert_close(out[starts[j]:starts[j] + q_len], ref, rtol=1e-5, atol=2e-5)


@needs_native
def test_native_prefill_refuses_spans_it_cannot_hold() -> None:
    q = torch.randn(4, 2, 16)
    cache = torch.randn(64, 1, 16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    for span in ([0, 4, 3], [0, 4, 33], [0, 0, 4]):  # ctx < rows; ctx > table; no rows
        with pytest.raises(RuntimeError, match="failed"):
            native.paged_prefill(q, cache, cache, table, torch.tensor(span, dtype=torch.int32)
                                 .view(3, 1), torch.empty_like(q), 16, 1.0, None)
