"""bf16 in the native CPU kernels (issue 51): fp32 activations, bf16 weights and KV widened to fp32
in registers. The bf16 panel GEMM gives the fp32 product of the bf16 values (they are exact in
fp32, so only the order of the sums differs from a reference), and the same bits as the fp32
kernel over the widened weights (the same FMAs in the same order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
