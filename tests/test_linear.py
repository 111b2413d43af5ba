"""The CPU matmul paths: the native panel GEMM, oneDNN-packed rows, the choice between them at
load, and the MLP's row chunks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.cpu import gemm, packed_linear
from kvrelay.engine.cpu.packed_linear import MIXED_PANEL_ROWS, onednn_packing_available, packed
from kvrelay.engine.cpu.platform import mlp_chunk_rows
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.models.llama import MLP

needs_onednn = pytest.mark.skipif(not onednn_packing_available(), reason="needs oneDNN packing")
needs_panels = pytest.mark.skipif(not gemm.available(),
                                  reason="the panel GEMM needs AVX2+FMA and a C compiler")


def make(n_in: int, n_out: int, bias: bool, *, onednn: bool = True, panels: bool = False,
         kblock: int | None = None) -> tuple[Linear, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(n_in * 1000 + n_out)
    lin = Linear(n_in, n_out, bias)
    w = torch.randn(n_out, n_in, generator=g)
    lin.weight.data.copy_(w)
    b = None
    if bias:
        b = torch.randn(n_out, generator=g)
        lin.bias.data.copy_(b)
    packed_linear.pack(lin, onednn=onednn, panels=panels, kblock=kblock)
    return lin, (w, b)


@needs_panels
@pytest.mark.parametrize("bias", [False, True])
# Row counts around the register tile (6 rows on AVX2, 12 on AVX-512): one tile, a full and a
# short one, many tiles; the decode-sized rows that take the kernel's one-pass order (up to 20),
# the first beyond it; K = 300 leaves a partial K block; output widths with and without a
# partial last panel.
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 12, 13, 20, 21, 64, 300])
@pytest.mark.parametrize("n_out", [200, 256])
def test_panel_gemm_matches_f_linear(two_threads, bias: bool, rows: int, n_out: int) -> None:
    lin, (w, b) = make(300, n_out, bias, onednn=False, panels=True)
    nr = gemm.panel_width()
    assert lin.weight is None and lin.kernel.onednn is None
    assert lin.kernel.panels.shape == (-(-n_out // nr), 300, nr)
    x = torch.randn(rows, 300)
    with torch.inference_mode():
        got = lin(x)
        strided = lin(torch.randn(rows, 600)[:, ::2])  # a non-contiguous input is copied first
    assert got.shape == (rows, n_out) and strided.shape == (rows, n_out)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_panels
# Both CPUs' choices on this one: the fused order up to 20 rows, chunks of 12 + 4 (Cascade Lake);
# no fused order, balanced chunks, next-panel prefetch from 10 rows, k-major rows from K = 1024
# (Zen 4).
@pytest.mark.parametrize("choice", [gemm.Tuning(20, False, 1, 0), gemm.Tuning(0, True, 10, 1024)])
@pytest.mark.parametrize("rows", [5, 9, 13, 16, 20, 40, 64])
def test_panel_gemm_is_exact_under_each_cores_tuning(two_threads, choice: gemm.Tuning,
                                                      rows: int) -> None:
    lin, (w, b) = make(300, 200, True, onednn=False, panels=True)
    x = torch.randn(rows, 300)
    before = gemm.tuning(choice)
    try:
        assert gemm.tuning() == choice
        with torch.inference_mode():
            got = lin(x)
    finally:
        gemm.tuning(before)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 12, 13])
@pytest.mark.parametrize("k", [1024, 1100])
def test_k_major_rows_give_the_same_bits(two_threads, rows: int, k: int) -> None:
    """Calls of 2 to 12 rows (6 on AVX2) with K >= ``pack_min_k`` read x from a k-major copy
    (the same products in the same order: equal bits); 1 row and 13 never do. K = 1100 leaves
    a partial K block and a K that is no multiple of the vector width. Over the plain layout:
    blocked weights take no k-major copy (tests/test_gemm_blocks.py)."""
    lin, (w, b) = make(k, 200, True, onednn=False, panels=True, kblock=0)
    x = torch.randn(rows, k)
    before = gemm.tuning()
    got = {}
    try:
        for pack_min_k in (0, 1024):
            gemm.tuning(dataclasses.replace(before, pack_min_k=pack_min_k))
            with torch.inference_mode():
                got[pack_min_k] = lin(x)
    finally:
        gemm.tuning(before)
    assert torch.equal(got[0], got[1024])
    torch.testing.assert_close(got[1024], F.linear(x, w, b), rtol=1e-5, atol=1e-3)


@needs_panels
def test_panel_gemm_uses_the_threads_it_was_packed_with(two_threads) -> None:
    torch.set_num_threads(1)
    lin, (w, b) = make(64, 96, True, onednn=False, panels=True)
    assert lin.kernel.threads == 1
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_packed_path_matches_f_linear(two_threads, bias: bool, rows: int) -> None:
    lin, (w, b) = make(96, 200, bias)
    assert lin.weight is None and lin.kernel.panels is None
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = lin(x)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@needs_panels
def test_mixed_takes_the_panels_up_to_the_row_limit(two_threads, monkeypatch) -> None:
    lin, (w, _) = make(64, 128, False, onednn=True, panels=True)
    assert lin.kernel.panel_rows == MIXED_PANEL_ROWS
    calls = []
    real = gemm.panel_linear
    monkeypatch.setattr("kvrelay.engine.cpu.packed_linear.panel_linear",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, MIXED_PANEL_ROWS, MIXED_PANEL_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-4)
    assert calls == [1, MIXED_PANEL_ROWS]
    lin.kernel.drop("onednn")  # panels only: every row count
    assert lin.kernel.onednn is None and lin.kernel.panel_rows > 10**9


@pytest.mark.parametrize("rows", [4, 10, 16])
def test_mlp_row_chunks_match_one_pass(two_threads, rows: int) -> None:
    arch = SimpleNamespace(hidden_size=32, intermediate_size=48, mlp_bias=True)
    mlp = MLP(arch)
    assert mlp.chunk_rows is None  # chunks are the platform's call (CpuPlatform.prepare_model)
    assert mlp_chunk_rows(48) >= 2**14 and mlp_chunk_rows(2048) == 1024  # tiny MLPs never do
    g = torch.Generator().manual_seed(rows)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for m in (mlp.gate_up, mlp.down):
        packed_linear.pack(m, onednn=onednn_packing_available(), panels=gemm.available())
    x = torch.randn(rows, 32, generator=g)
    with torch.inference_mode():
        whole = mlp(x)
        mlp.chunk_rows = 4  # 10 rows: chunks of 4, 4 and 2
        chunked = mlp(x)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


_EVEN, _PANELS, _ONEDNN = (1.0, 1.0), (0.5, 1.0), (1.0, 0.5)  # (panels s, oneDNN s)


@needs_onednn
@needs_panels
@pytest.mark.parametrize(("small", "large", "kept", "panel_rows", "timed"), [
    # panels win everything: oneDNN's copy is dropped
    (_PANELS, {}, "panels", None, [8, 128, 256, 512, 1024]),
    # panels win the decode pass, oneDNN every prefill size: both kept, the panels below 128
    # rows; measuring stops after two clear wins in a row
    (_PANELS, {r: _ONEDNN for r in (128, 256)}, "mixed", 64, [8, 128, 256]),
    # ... unless oneDNN's wins are within 10%
    (_PANELS, dict.fromkeys((128, 256, 512, 1024), (1.05, 1.0)), "panels", None,
     [8, 128, 256, 512, 1024]),
    # oneDNN wins from 512 rows on: the panels keep up to 256 (decode steps of that size too)
    (_PANELS, {512: _ONEDNN, 1024: _ONEDNN}, "mixed", 256, [8, 128, 256, 512, 1024]),
    # a lone win (noise) is not a crossover: the first of two in a row is
    (_PANELS, {128: _ONEDNN, 512: _ONEDNN, 1024: _ONEDNN}, "mixed", 256,
     [8, 128, 256, 512, 1024]),
    # panels lose the decode pass: their copy is dropped, nothing else timed
    (_ONEDNN, {}, "onednn", None, [8]),
])
def test_auto_keeps_what_measures_faster(demo_model_dir, monkeypatch, tmp_path, small, large,
                                         kept: str, panel_rows: int | None,
                                         timed: list[int]) -> None:
    """linear_kernel=auto times an 8-row pass and prefill-sized ones up to a full step's rows
    both ways at load, keeps only the copies that win, and under ``mixed`` gives the panels the
    rows below oneDNN's clear wins (measured afresh: an empty cache of earlier choices)."""
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    from kvrelay.engine.attention.sdpa import sdpa_attention
    from kvrelay.engine.cpu import kernel_choice
    from kvrelay.engine.cpu.platform import CpuPlatform
    from kvrelay.engine.loader import load_model

    seen: list[int] = []

    def time_linears(model, rows, layers=None, reps=3):
        seen.append(rows)
        return small if rows == 8 else large.get(rows, _EVEN)

    monkeypatch.setattr(kernel_choice, "time_linears", time_linears)
    model, _ = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32,
                          attn_fn=sdpa_attention, max_positions=64,
                          platform=CpuPlatform(prefill_rows=1024))
    assert seen == timed
    assert kernel_choice.linear_kernel(model) == kept
    lins = kernel_choice.linears(model)
    assert all((packed(m).panels is not None) == (kept != "onednn") for m in lins)
    assert all((packed(m).onednn is not None) == (kept != "panels") for m in lins)
    if panel_rows is not None:
        assert {packed(m).panel_rows for m in lins} == {panel_rows}
        assert model.fused_decode is None or model.fused_decode.max_rows == panel_rows


@needs_onednn
@needs_panels
def test_linear_timing_measures_both_paths(demo_model_dir) -> None:
    from kvrelay.engine.attention.sdpa import sdpa_attention
    from kvrelay.engine.cpu import kernel_choice
    from kvrelay.engine.cpu.platform import CpuPlatform
    from kvrelay.engine.loader import load_model

    model, _ = load_model(demo_model_dir, device=torch.device("cpu"), dtype=torch.float32,
                          attn_fn=sdpa_attention, max_positions=64,
                          platform=CpuPlatform(linear_kernel="mixed"))
    assert kernel_choice.linear_kernel(model) == "mixed"
    panels_s, onednn_s = kernel_choice.time_linears(model, 8, reps=2)
    assert 0 < panels_s < 10 and 0 < onednn_s < 10
    kernel_choice.keep_linear_kernel(model, "onednn")
    assert kernel_choice.linear_kernel(model) == "onednn"


def test_unknown_linear_kernel_is_refused() -> None:
    from kvrelay.engine.config import EngineConfig

    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig.from_kwargs("x", linear_kernel="fast")


def test_the_model_package_knows_no_cpu_kernel() -> None:
    """``engine/models`` imports nothing of ``engine/cpu``: the platform gives a Linear its
    kernel (``engine/cpu/packed_linear.py``) at load."""
    from test_import_graph import file_graph

    graph = file_graph()
    models = [m for m in graph if m.startswith("kvrelay.engine.models")]
    assert "kvrelay.engine.models.linear" in models
    for m in models:
        assert not [d for d in graph[m] if d.startswith("kvrelay.engine.cpu")], m
