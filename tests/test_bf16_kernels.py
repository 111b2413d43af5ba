"""bf16 in the native CPU kernels (issue 51): fp32 activations, bf16 weights and KV widened to fp32
in registers. The bf16 panel GEMM gives the fp32 product of the bf16 values (they are exact in
fp32, so only the order of the sums differs from a reference), and the same bits as the fp32
kernel over the widened weights (the same FMAs in the same order)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_attention import _paged_reference, _prefill_reference

from kvrelay.engine.cpu import gemm

BF16 = torch.bfloat16
needs_gemm = pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(BF16)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of fp32 sums: 1e-5 of the output's scale."""
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@needs_gemm
def test_bf16_panels_are_the_fp32_layout_in_bf16() -> None:
    w = bf16_weight(70, 100, 0)
    for kb in (0, 48):
        p = gemm.pack_panels(w, kb)
        assert p.dtype == BF16 and p.is_contiguous()
        assert torch.equal(p.float(), gemm.pack_panels(w.float(), kb))


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
# K: not a multiple of 8 or 16 (100, 300), blocked (1000 in blocks of 256 or 40, the last one
# short) and unblocked; N = 200: a partial last panel with either panel width.
@pytest.mark.parametrize("k,kblock", [(100, 0), (300, 0), (1000, 0), (1000, 256), (300, 40),
                                      (768, 768)])
# One row; short register tiles; a tile and a short one; the fused order (13-20 rows); row
# chunks; the prefill order (past 64).
@pytest.mark.parametrize("rows", [1, 3, 7, 13, 64, 300])
def test_bf16_gemm_is_the_fp32_product_of_the_bf16_weights(two_threads, rows: int, k: int,
                                                           kblock: int, bias: bool) -> None:
    w = bf16_weight(200, k, rows * 7 + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    got = gemm.panel_linear(x, gemm.pack_panels(w, kblock), b, 200, 2, kblock)
    assert got.dtype == torch.float32
    want = x @ w.float().T + (0 if b is None else b)
    close(got, want)
    # the fp32 kernel over the widened weights: the same FMAs in the same order
    fp32 = gemm.panel_linear(x, gemm.pack_panels(w.float(), kblock), b, 200, 2, kblock)
    assert torch.equal(got, fp32)


@needs_gemm
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_every_tuning_branch_over_bf16_weights(two_threads, rows: int) -> None:
    """The one-pass fused order, the next panel's prefetch and the k-major copy of x (each
    taken on some CPU only): the fp32 kernel's bits over the widened weights."""
    w, x = bf16_weight(96, 1100, rows), torch.randn(rows, 1100)
    bf, fp = gemm.pack_panels(w, 0), gemm.pack_panels(w.float(), 0)
    before = gemm.tuning()
    try:
        for t in (gemm.Tuning(0, False, 1 << 20, 0), gemm.Tuning(20, True, 1, 1024),
                  gemm.Tuning(0, True, 1, 512)):
            gemm.tuning(dataclasses.replace(t))
            got = gemm.panel_linear(x, bf, None, 96, 2, 0)
            assert torch.equal(got, gemm.panel_linear(x, fp, None, 96, 2, 0)), t
    finally:
        gemm.tuning(before)
    close(got, x @ w.float().T)


@needs_gemm
def test_special_values_widen_exactly() -> None:
    """Infinities, NaNs, subnormals and -0 in the weights widen to their fp32 values."""
    w = torch.zeros(16, 8)
    w[0, 0], w[1, 1], w[2, 2], w[3, 3] = float("inf"), float("nan"), 1e-40, -0.0
    w[4] = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.5, 8.0, 0.25, -4.0])
    wb = w.to(BF16)
    x = torch.eye(8)
    got = gemm.panel_linear(x, gemm.pack_panels(wb, 0), None, 16, 1, 0)
    torch.testing.assert_close(got, (x @ wb.float().T), equal_nan=True, rtol=0, atol=0)


@needs_gemm
def test_a_dtype_without_a_kernel_is_refused() -> None:
    w = torch.randn(32, 16).half()
    with pytest.raises(AssertionError, match="no panel GEMM"):
        gemm.panel_linear(torch.randn(1, 16), gemm.pack_panels(w, 0), None, 32, 1, 0)


# -- attention over a bf16 KV cache ------------------------------------------------------------

attention = pytest.importorskip("kvrelay.engine.cpu.attention")
needs_native = pytest.mark.skipif(not attention.available(), reason="no native kernels here")


def _tables(lens: list[int], bs: int, num_blocks: int, seed: int) -> tuple[list[list[int]],
                                                                         torch.Tensor]:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


@needs_native
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 37])
# GQA, MHA, MQA; head sizes on and off the vector width (12: the scalar path).
@pytest.mark.parametrize(("heads", "kvh", "d"), [(6, 2, 16), (8, 8, 64), (4, 1, 8), (12, 4, 80),
                                                 (4, 2, 12)])
def test_native_decode_over_a_bf16_cache(two_threads, bs: int, window: int | None, heads: int,
                                         kvh: int, d: int) -> None:
    """The fp32 kernel's bits over the same cache widened (the same arithmetic on the same
    values), and per-sequence SDPA's result within fp32 tolerance; contexts long enough to be
    cut into partitions (1200 keys, partitions of 256)."""
    torch.manual_seed(bs + d)
    lens = [1, 16, 17, 33, 60, 700, 1200, 5]
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    kc = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    vc = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    tables, padded = _tables(lens, bs, num_blocks, bs)
    q = torch.randn(len(lens), heads, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = torch.full_like(q, float("nan"))
    attention.paged_decode(q, kc, vc, padded, ctx, got, bs, 0.3, window)
    want = torch.full_like(q, float("nan"))
    attention.paged_decode(q, kc.float(), vc.float(), padded, ctx, want, bs, 0.3, window)
    if d % 16 == 0:
        assert torch.equal(got, want)
    else:  # the scalar loops: the compiler may order the sums of each variant its own way
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref = _paged_reference(q, kc.float(), vc.float(), tables, lens, bs, 0.3, window)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(12, 4, 64), (4, 1, 16), (6, 2, 128),
                                                 (4, 4, 80)])
def test_native_prefill_over_a_bf16_cache(two_threads, bs: int, window: int | None, heads: int,
                                          kvh: int, d: int) -> None:
    """Fresh prompts, chunks over a cached prefix, one-row spans and spans across tile edges:
    the fp32 kernel's bits over the widened cache, and causal SDPA's within fp32 tolerance."""
    torch.manual_seed(bs * 3 + d)
    spans = [(100, 100), (5, 5), (33, 200), (64, 64), (1, 40), (70, 300)]
    num_blocks = sum(-(-c // bs) for _, c in spans) + 4
    kc = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    vc = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    tables, padded = _tables([c for _, c in spans], bs, num_blocks, d)
    starts = [sum(n for n, _ in spans[:j]) for j in range(len(spans))]
    meta = torch.tensor([starts, [n for n, _ in spans], [c for _, c in spans]], dtype=torch.int32)
    q = torch.randn(sum(n for n, _ in spans), heads, d)
    got, want = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    attention.paged_prefill(q, kc, vc, padded, meta, got, bs, 0.2, window)
    attention.paged_prefill(q, kc.float(), vc.float(), padded, meta, want, bs, 0.2, window)
    assert torch.equal(got, want)
    for j, (q_len, c) in enumerate(spans):
        ref = _prefill_reference(q, kc.float(), vc.float(), tables[j], starts[j], q_len, c, bs,
                                 0.2, window)
        torch.testing.assert_close(got[starts[j]:starts[j] + q_len], ref, rtol=1e-5, atol=2e-5)


@needs_native
@pytest.mark.parametrize("groups", [2, 4])
def test_bf16_kv_head_groups_attend_as_one_cache(two_threads, groups: int) -> None:
    """The KV head-group layout (``--kv-head-groups``: one ``[G, slots, KVH / G, D]`` tensor,
    group g holding KV heads [g KVH / G, (g + 1) KVH / G) for its query heads): each group's
    decode and prefill over its own bf16 view give the one-cache result of those heads."""
    bs, heads, kvh, d = 8, 16, 4, 32
    hq, hk = heads // groups, kvh // groups
    lens = [40, 300, 9]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    one_k = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    one_v = torch.randn(num_blocks * bs, kvh, d).to(BF16)
    gk = one_k.view(-1, groups, hk, d).transpose(0, 1).contiguous()  # [G, slots, hk, D]
    gv = one_v.view(-1, groups, hk, d).transpose(0, 1).contiguous()
    _, padded = _tables(lens, bs, num_blocks, 5)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, d)
    spans = torch.tensor([[0, 1, 2], [1, 1, 1], lens], dtype=torch.int32)  # each last row
    for run in ("decode", "prefill"):
        one = torch.empty_like(q)
        if run == "decode":
            attention.paged_decode(q, one_k, one_v, padded, ctx, one, bs, 0.25, 64)
        else:
            attention.paged_prefill(q, one_k, one_v, padded, spans, one, bs, 0.25, 64)
        for g in range(groups):
            qg = q[:, g * hq:(g + 1) * hq].contiguous()
            out = torch.empty_like(qg)
            if run == "decode":
                attention.paged_decode(qg, gk[g], gv[g], padded, ctx, out, bs, 0.25, 64)
            else:
                attention.paged_prefill(qg, gk[g], gv[g], padded, spans, out, bs, 0.25, 64)
            torch.testing.assert_close(out, one[:, g * hq:(g + 1) * hq], rtol=1e-6, atol=1e-6)


@needs_native
def test_a_mixed_or_unknown_cache_dtype_is_refused() -> None:
    q, table = torch.randn(1, 2, 16), torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32)
    for k, v in ((torch.zeros(16, 1, 16, dtype=BF16), torch.zeros(16, 1, 16)),
                 (torch.zeros(16, 1, 16).half(),) * 2):
        with pytest.raises(AssertionError):
            attention.paged_decode(q, k, v, table, lens, torch.empty_like(q), 16, 1.0, None)


def _native_lib():
    from kvrelay.engine.cpu import native

    lib = native.load()
    if lib is None:
        pytest.skip("no native kernels here")
    return lib


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Random values plus every rounding case: ties to even (up and down), the largest finite
    value rounding to inf, infinities, NaNs of both signs and payloads, subnormals, -0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g))
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000,
                         0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
                         0x807FFFFF, 0x80000000, 0x00000000, 0x0001FFFF, 0x3FFF7FFF, 0xC0008000],
                        dtype=torch.int64)
    special = bits.to(torch.uint32).view(torch.float32)
    return torch.cat([special, x])


@pytest.mark.parametrize("row", [3, 16, 64, 259])
def test_native_bf16_kv_store_rounds_as_torch(row: int) -> None:
    """kvr_write_kv_bf16 (and the row store the fused layers use) leave the bits that torch's
    ``index_copy_`` of ``.to(torch.bfloat16)`` leaves: nearest even, NaN as torch writes it."""
    lib = _native_lib()
    n = 5
    vals = special_floats(n * row * 2, row)[:2 * n * row]
    k, v = vals[:n * row].view(n, row), vals[n * row:].view(n, row)
    slots = torch.tensor([7, 0, 3, 9, 4])
    want_k = torch.zeros(12, row, dtype=BF16)
    want_v = torch.zeros(12, row, dtype=BF16)
    want_k.index_copy_(0, slots, k.to(BF16))
    want_v.index_copy_(0, slots, v.to(BF16))
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    assert lib.kvr_write_kv_bf16(k.data_ptr(), row, v.data_ptr(), row, slots.data_ptr(), n,
                                 got_k.data_ptr(), got_v.data_ptr(), row, 2) == 0
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))


def test_an_fp16_cache_runs_the_native_backend_through_sdpa(hf_model_dir) -> None:
    """The native kernels read fp32 and bf16 caches: with an fp16 one the native backend runs
    every step through SDPA (and the fused layers decline it), with SDPA's results."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.sampling_params import SamplingParams

    model_dir = hf_model_dir("llama")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = {}
    for backend in ("native", "sdpa"):
        core = EngineCore(EngineConfig.from_kwargs(
            model_dir, block_size=8, num_blocks=64, max_num_batched_tokens=32, seed=0,
            kv_cache_dtype="float16", attention_backend=backend))
        assert core.runner.kv.dtype == torch.float16
        if backend == "native" and attention.available():
            assert isinstance(core.runner.attention, attention.NativeBackend)
            assert not core.runner.attention.native_kv
        core.add_request("a", list(range(5, 30)), sp)
        core.add_request("b", list(range(40, 45)), sp)
        out: dict[str, list[int]] = {"a": [], "b": []}
        while core.has_unfinished():
            for o in core.step():
                out[o.request_id] += o.new_token_ids
        got[backend] = out
    assert got["native"] == got["sdpa"] and len(got["sdpa"]["a"]) == 8
