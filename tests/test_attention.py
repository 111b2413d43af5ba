"""SDPA over the paged cache: grouped decodes against a per-sequence reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.attention import AttentionMetadata, DecodeGroup, group_by_length
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
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_prefill_tokens=0,
                             prefills=[], block_size=bs, decode_groups=groups)
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
