"""The panel GEMM's K-blocked layout (``engine/cpu/csrc/gemm.c``'s ``panel_at``): every path over it
(decode-sized calls block by block, the row chunks of larger ones, the one-pass fused order,
the fused decode layers) gives the plain layout's bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hf_models import hf_greedy
from test_fused_decode import decode_logits, make_core

from kvrelay.engine.cpu import gemm, packed_linear

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")


def test_the_blocks_hold_the_plain_panels_rows() -> None:
    w = torch.randn(70, 100)
    plain, blocked = gemm.pack_panels(w, 0), gemm.pack_panels(w, 48)
    assert blocked.shape == plain.shape and blocked.is_contiguous()
    p, _, nr = plain.shape
    flat, at = blocked.view(-1), 0
    for k0, kn in ((0, 48), (48, 48), (96, 4)):  # the last block short
        block = flat[at:at + p * kn * nr].view(p, kn, nr)
        assert torch.equal(block, plain[:, k0:k0 + kn])
        at += p * kn * nr
    assert at == flat.numel()
    assert torch.equal(gemm.pack_panels(w, 100), plain)  # one block: the plain layout


@pytest.mark.parametrize("kblock", [256, 768, 40])
# No rows (nothing to run); 1-12 rows block by block (a thread's panels' first block, then their
# second...); 13-20 the fused order where the tuning takes it; 21-64 row chunks; 65 and more the
# prefill order.
@pytest.mark.parametrize("rows", [0, 1, 2, 8, 12, 13, 20, 21, 64, 65, 130])
@pytest.mark.parametrize("k", [1000, 1536])
def test_blocked_panels_give_the_plain_layouts_bits(two_threads, kblock: int, rows: int,
                                                    k: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + k)
    w, b = torch.randn(200, k, generator=g), torch.randn(200, generator=g)
    x = torch.randn(rows, k, generator=g)
    plain, blocked = gemm.pack_panels(w, 0), gemm.pack_panels(w, kblock)
    before = gemm.tuning()
    try:
        for fuse_rows, pf_min_rows in ((0, 1 << 20), (20, 1)):  # both orders; prefetch off, on
            gemm.tuning(dataclasses.replace(before, fuse_rows=fuse_rows, pf_min_rows=pf_min_rows))
            want = gemm.panel_linear(x, plain, b, 200, 2, 0)
            got = gemm.panel_linear(x, blocked, b, 200, 2, kblock)
            assert torch.equal(got, want), (fuse_rows, pf_min_rows)
    finally:
        gemm.tuning(before)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_thread_without_a_panel(two_threads, rows: int) -> None:
    """One panel (N = 20) between two threads: the second has none to run."""
    w, x = torch.randn(20, 100), torch.randn(rows, 100)
    got = gemm.panel_linear(x, gemm.pack_panels(w, 40), None, 20, 2, 40)
    assert torch.equal(got, gemm.panel_linear(x, gemm.pack_panels(w, 0), None, 20, 2, 0))


def test_a_negative_block_is_refused() -> None:
    w = torch.randn(40, 64)
    with pytest.raises(RuntimeError, match="failed"):
        gemm.panel_linear(torch.randn(2, 64), gemm.pack_panels(w, 0), None, 40, 1, -1)


@pytest.mark.parametrize("arch", ["llama_bias", "qwen2"])
def test_fused_decode_layers_over_blocked_weights(hf_model_dir, arch: str,
                                                  monkeypatch) -> None:
    """The tiny models' projections (K = 64 and 128) in 48-row blocks: the fused layers and the
    LM head give the plain layout's logits exactly, and transformers' to 1e-4."""
    model_dir = hf_model_dir(arch)
    prompt = list(range(5, 40))
    ref = hf_greedy(model_dir, prompt, 6)
    plain = make_core(model_dir)
    monkeypatch.setattr(packed_linear, "default_kblock", lambda: 48)
    blocked = make_core(model_dir)
    down = blocked.runner.model.layers[0].mlp.down
    assert down.kernel.kblock == 48 and blocked.runner.model.fused_decode is not None
    got = decode_logits(blocked, prompt, ref.token_ids)
    torch.testing.assert_close(got, decode_logits(plain, prompt, ref.token_ids), rtol=0, atol=0)
    ref_dec = ref.logits[1:]
    assert (got[:, 0] - ref_dec).abs().max() / ref_dec.abs().max() < 1e-4
