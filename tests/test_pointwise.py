"""The fused per-token ops (engine/pointwise.py) equal the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine import pointwise
from kvrelay.engine.cpu import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="no native kernels here")


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 768 takes the multi-threaded path
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_add_then_rms_norm(rows: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 768, generator=g)
    delta = torch.randn(rows, 768, generator=g) if with_delta else None
    w = torch.randn(768, generator=g)
    ref_h = h + delta if with_delta else h.clone()
    ref = F.rms_norm(ref_h, (768,), w, 1e-6)
    out = pointwise.add_rms_norm(h, delta, w, 1e-6)
    assert out.data_ptr() != h.data_ptr()
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)  # the residual add, in place
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_takes_a_strided_delta() -> None:
    h, big = torch.randn(5, 64), torch.randn(5, 128)
    ref = F.rms_norm(h + big[:, :64], (64,), torch.ones(64), 1e-5)
    torch.testing.assert_close(pointwise.add_rms_norm(h, big[:, :64], torch.ones(64), 1e-5), ref)


@pytest.mark.parametrize("rows", [1, 9, 600])
def test_rope_on_a_strided_qkv_view_matches_rotate_half(rows: int) -> None:
    heads, kv_heads, d = 4, 2, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    assert rows == 1 or not q.is_contiguous()
    pos = torch.randint(0, 4096, (rows,), generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = pos[:, None].float() * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()

    def ref(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    for x in (q, k):
        out = pointwise.rope(x, cos, sin)
        assert out.is_contiguous()
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 40])  # 40 x 3072 takes the multi-threaded path
def test_silu_mul_on_a_strided_gate_up_matches_silu_times_up(rows: int) -> None:
    inter = 3072 + 3  # a tail past the last whole vector
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * inter + 5, generator=g) * 8  # |x| up to ~40: both exp tails
    gu = wide[:, :2 * inter]
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(pointwise.silu_mul(gu, inter), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 400])  # 400 rows x 256 floats takes the threaded path
def test_write_kv_rows_equals_index_copy_from_qkv_views(rows: int, cache: torch.dtype) -> None:
    """Natively where it can; into a bf16 cache with the bits torch's rounding store gives."""
    heads, kv_heads, d = 4, 2, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows + 2, (heads + 2 * kv_heads) * d, generator=g)  # 2 padding rows
    qkv[0, heads * d:heads * d + 4] = torch.tensor([float("nan"), 1e39, 1 + 2**-8, 2**-130])
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows + 2, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(rows + 2, kv_heads, d)
    slots = torch.randperm(1000, generator=g)[:rows]
    kc = torch.zeros(1000, kv_heads, d, dtype=cache)
    vc = torch.zeros(1000, kv_heads, d, dtype=cache)
    ref_k, ref_v = kc.clone(), vc.clone()
    pointwise.write_kv_rows(kc, vc, k, v, slots)
    ref_k.index_copy_(0, slots, k[:rows].to(cache))
    ref_v.index_copy_(0, slots, v[:rows].to(cache))
    bits = (lambda t: t.view(torch.int16)) if cache == torch.bfloat16 else (lambda t: t)
    # bf16 NaNs: torch keeps the payload's top bits, the kernel writes one NaN; both are NaN
    nan = ref_k.isnan()
    assert torch.equal(kc.isnan(), nan)
    assert torch.equal(bits(kc)[~nan], bits(ref_k)[~nan]) and torch.equal(bits(vc), bits(ref_v))


def _argmax_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    nan_mid = torch.randn(4, 100, generator=g)
    nan_mid[2, 50] = nan_mid[2, 70] = float("nan")
    tail_max = torch.randn(4, 100, generator=g)
    tail_max[1, 99] = 1e9  # the largest in the tail past the last full vector
    return [
        torch.randn(8, 32000, generator=g),  # 8 x 32000 takes the multi-threaded path
        torch.randn(3, 17, generator=g), torch.randn(1, 5, generator=g),
        torch.full((2, 40), float("-inf")),
        torch.tensor([[1.0, 3.0, 3.0, 2.0] * 10]),  # ties: the first wins
        torch.randint(0, 2, (64, 333), generator=g).float(),  # ties across vector lanes
        torch.tensor([[-0.0, 0.0, -0.0] + [-1.0] * 20]),
        torch.tensor([[0.0, float("nan"), 5.0, float("nan")] + [1.0] * 30]),
        torch.tensor([[float("-inf")] * 20 + [float("nan")]]),
        nan_mid, tail_max, torch.randn(0, 7),
    ]


@pytest.mark.parametrize("case", range(len(_argmax_cases())))
def test_argmax_rows_equals_torch_argmax(case: int) -> None:
    """The same index as torch's argmax: ties go to the first, a NaN beats every number, -inf
    rows give 0; tails shorter than a vector; no rows."""
    x = _argmax_cases()[case]
    got = pointwise.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_falls_back_where_it_cannot_run_natively() -> None:
    x = torch.randn(16, 40)
    for t in (x[:, ::2], x.double(), x.view(4, 4, 40)):  # strided, fp64, 3-D
        assert torch.equal(pointwise.argmax_rows(t), t.argmax(dim=-1))
