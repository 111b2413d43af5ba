"""The CPU matmul paths: oneDNN-packed rows, the single-row GEMV over dense slabs, and the MLP's
row chunks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.models.llama import MLP, Linear, gemv_slabs, onednn_packing_available

pytestmark = pytest.mark.skipif(not onednn_packing_available(), reason="needs oneDNN packing")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def make(n_in: int, n_out: int, bias: bool,
         gemv: bool) -> tuple[Linear, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(n_in * 1000 + n_out)
    lin = Linear(n_in, n_out, bias)
    w = torch.randn(n_out, n_in, generator=g)
    lin.weight.data.copy_(w)
    b = None
    if bias:
        b = torch.randn(n_out, generator=g)
        lin.bias.data.copy_(b)
    lin.pack(gemv=gemv)
    return lin, (w, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_packed_and_gemv_paths_match_f_linear(two_threads, bias: bool, rows: int) -> None:
    lin, (w, b) = make(96, 200, bias, gemv=True)
    assert lin.weight is None and lin.slabs is not None and lin.slabs.shape == (2, 48, 200)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = lin(x)
    ref = F.linear(x, w, b)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_single_row_takes_the_slabs(two_threads, monkeypatch) -> None:
    lin, _ = make(64, 128, False, gemv=True)
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or real(*a))
    assert lin.slabs.shape == (2, 32, 128)
    with torch.inference_mode():
        lin(torch.randn(1, 64))
        assert len(calls) == 1
        lin(torch.randn(3, 64))  # several rows: oneDNN's packed GEMM
        assert len(calls) == 1


def test_slabs_follow_the_thread_count(two_threads) -> None:
    w = torch.randn(5, 8)
    slabs = gemv_slabs(w)
    assert slabs.shape == (2, 4, 5) and slabs.is_contiguous()
    torch.testing.assert_close(slabs.reshape(8, 5), w.t())
    assert gemv_slabs(torch.randn(5, 7)).shape == (1, 7, 5)  # threads do not divide: one slab
    torch.set_num_threads(1)
    lin, (w, b) = make(16, 33, True, gemv=True)  # one thread: a plain mm over one slab
    assert lin.slabs.shape == (1, 16, 33)
    x = torch.randn(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [4, 10, 16])
def test_mlp_row_chunks_match_one_pass(two_threads, rows: int) -> None:
    arch = SimpleNamespace(hidden_size=32, intermediate_size=48, mlp_bias=True)
    mlp = MLP(arch)
    assert mlp.chunk_rows >= 2**14  # tiny MLPs never chunk on their own
    g = torch.Generator().manual_seed(rows)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for m in (mlp.gate_up, mlp.down):
        m.pack(gemv=True)
    x = torch.randn(rows, 32, generator=g)
    with torch.inference_mode():
        whole = mlp(x)
        mlp.chunk_rows = 4  # 10 rows: chunks of 4, 4 and 2
        chunked = mlp(x)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("slabs_s", "packed_s", "kept"), [(0.5, 1.0, True), (1.0, 0.5, False),
                                                          (0.98, 1.0, False)])
def test_auto_keeps_the_dense_copy_only_where_it_measures_faster(
        demo_model_dir, monkeypatch, slabs_s: float, packed_s: float, kept: bool) -> None:
    """gemv_weights=None times a batch-1 pass both ways at load: the slabs stay only when they
    are clearly (> 5%) faster, since they cost a second copy of every weight."""
    if not onednn_packing_available():
        pytest.skip("no oneDNN packing in this torch build")
    from kvrelay.engine.attention.sdpa import sdpa_attention
    from kvrelay.engine.loader import load_model
    from kvrelay.engine.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "time_single_row", lambda self: (slabs_s, packed_s))
    model, _ = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32,
                          attn_fn=sdpa_attention, max_positions=64, gemv_weights=None)
    assert model.has_gemv_slabs is kept
    forced, _ = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32,
                           attn_fn=sdpa_attention, max_positions=64, gemv_weights=True)
    assert forced.has_gemv_slabs


def test_single_row_timing_measures_both_paths(demo_model_dir) -> None:
    if not onednn_packing_available():
        pytest.skip("no oneDNN packing in this torch build")
    from kvrelay.engine.attention.sdpa import sdpa_attention
    from kvrelay.engine.loader import load_model

    model, _ = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32,
                          attn_fn=sdpa_attention, max_positions=64, gemv_weights=True)
    slabs_s, packed_s = model.time_single_row(reps=2)
    assert 0 < slabs_s < 10 and 0 < packed_s < 10
    model.drop_gemv_slabs()
    assert not model.has_gemv_slabs
