"""bf16 weights under fp32 activations on CPU: each kernel that takes them (the panel GEMM, which
widens them in registers; oneDNN's bf16 linear where the CPU has one) gives the fp32 product of
the bf16 values, the kernel choice keeps bf16's measurements apart from fp32's, and a bf16 model
packed at load holds its weights only as bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvrelay.engine.cpu import kernel_choice, packed_linear
from kvrelay.engine.cpu.packed_linear import onednn_packing_available, packed, panels_available
from kvrelay.engine.models.linear import Linear

BF16 = torch.bfloat16
HAVE_PANELS = panels_available(BF16)
HAVE_ONEDNN = onednn_packing_available(BF16)
# The kernels taking bf16 weights here, as (onednn, panels) packing flags.
KERNELS = {name: flags for name, flags, here in (
    ("panels", (False, True), HAVE_PANELS),
    ("onednn", (True, False), HAVE_ONEDNN),
    ("mixed", (True, True), HAVE_PANELS and HAVE_ONEDNN),
) if here}


def bf16_linear(n_in: int, n_out: int, bias: torch.dtype | None
                ) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A Linear with a bf16 weight (and a bias of dtype ``bias``, or none), and the reference
    weight and bias in fp32 (the bf16 values, exactly)."""
    g = torch.Generator().manual_seed(n_in * 1000 + n_out)
    lin = Linear(n_in, n_out, bias is not None)
    lin.weight = nn.Parameter(torch.randn(n_out, n_in, generator=g).to(BF16),
                              requires_grad=False)
    b = None
    if bias is not None:
        lin.bias = nn.Parameter(torch.randn(n_out, generator=g).to(bias), requires_grad=False)
        b = lin.bias.float()
    return lin, lin.weight.float(), b


def test_the_dense_path_widens_a_bf16_weight_for_fp32_rows() -> None:
    for bias in (None, BF16, torch.float32):
        lin, w, b = bf16_linear(96, 40, bias)
        x = torch.randn(5, 96)
        with torch.inference_mode():
            got = lin(x)
        assert got.dtype == torch.float32
        want = x @ w.T + (0 if b is None else b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not KERNELS, reason="no CPU kernel takes bf16 weights here")
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("bias", [None, BF16, torch.float32])
# One row, a short register tile, several tiles, past MIXED_PANEL_ROWS (oneDNN's rows under
# "mixed"); K = 300 leaves a partial K block; N = 200 a partial last panel.
@pytest.mark.parametrize("rows", [1, 7, 13, 65, 300])
def test_each_kernel_gives_the_fp32_product_of_the_bf16_weights(two_threads, kernel: str,
                                                               bias: torch.dtype | None,
                                                               rows: int) -> None:
    lin, w, b = bf16_linear(300, 200, bias)
    onednn, panels = KERNELS[kernel]
    k = packed_linear.pack(lin, onednn=onednn, panels=panels)
    assert lin.weight is None and lin.kernel is k and k.dtype == BF16
    assert all(t is None or t.dtype == BF16 for t in (k.panels, k.onednn))
    assert lin.bias is None or lin.bias.dtype == torch.float32  # widened once, at packing
    x = torch.randn(rows, 300)
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    want = x @ w.T + (0 if b is None else b)
    if k.panels is not None and rows <= k.panel_rows:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # oneDNN takes bf16 rows: x and the product rounded to bf16 (2**-9 relative)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0.25)


def test_bf16_keeps_its_own_kernel_choice(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    shapes = [(256, 512), (256, 256)]
    fp32 = kernel_choice.cache_key(shapes, 2, 2048, torch.float32)
    bf16 = kernel_choice.cache_key(shapes, 2, 2048, BF16)
    assert fp32 != bf16 and bf16 == kernel_choice.cache_key(list(shapes), 2, 2048, BF16)
    kernel_choice.save(fp32, "onednn", 0, {"panels_8": 2.0, "onednn_8": 1.0})
    assert kernel_choice.load(fp32) == ("onednn", 0) and kernel_choice.load(bf16) is None


class _NoPacking:
    """A platform that leaves the loaded model as it is (the test casts it, then packs)."""

    def prepare_model(self, model: object, dtype: torch.dtype) -> str:
        model.fused_decode = None
        return "dense"


def bf16_model(model_dir: str):
    """A tiny checkpoint loaded in fp32 and cast as a bf16 one is loaded on CPU: the linears'
    weights (and biases) and the embedding bf16, the rest fp32. Returns the model and its
    linears' weights as fp32 references."""
    from kvrelay.engine.attention.sdpa import sdpa_attention
    from kvrelay.engine.loader import load_model

    model, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32,
                          attn_fn=sdpa_attention, max_positions=64, platform=_NoPacking())
    model.embed = nn.Parameter(model.embed.detach().to(BF16), requires_grad=False)
    refs = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            if m.weight is not None:
                m.weight = nn.Parameter(m.weight.detach().to(BF16), requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(m.bias.detach().to(BF16), requires_grad=False)
            w = model.embed if m.weight is None else m.weight
            refs[name] = (w.float(), None if m.bias is None else m.bias.float())
    return model, refs


def _linear_shaped_fp32(model: nn.Module, shapes: set[tuple[int, ...]]
                        ) -> list[tuple[str, tuple[int, ...]]]:
    """Every fp32 tensor the model holds (parameters, buffers, its linears' kernels' copies)
    of one of ``shapes`` or of a linear's panels' shape."""
    held = [*model.named_parameters(), *model.named_buffers()]
    for name, m in model.named_modules():
        k = packed(m) if isinstance(m, Linear) else None
        if k is not None:
            held += [(f"{name}.kernel.{a}", t) for a in ("panels", "onednn")
                     if (t := getattr(k, a)) is not None]
            if k.panels is not None:
                shapes = shapes | {tuple(k.panels.shape)}
    return [(n, tuple(t.shape)) for n, t in held
            if t.dtype == torch.float32 and tuple(t.shape) in shapes]


@pytest.mark.skipif(not KERNELS, reason="no CPU kernel takes bf16 weights here")
@pytest.mark.parametrize("arch", ["llama_bias", "llama_tied"])
def test_prepare_model_packs_bf16_and_holds_no_fp32_weight(hf_model_dir, arch: str,
                                                           monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    from kvrelay.engine.cpu.platform import CpuPlatform

    model, refs = bf16_model(hf_model_dir(arch))
    kernel = CpuPlatform(linear_kernel="auto").prepare_model(model, BF16)
    assert kernel in KERNELS and kernel_choice.linear_kernel(model) == kernel
    lins = dict((n, m) for n, m in model.named_modules() if isinstance(m, Linear))
    assert lins and set(lins) == set(refs)
    for name, m in lins.items():
        k = packed(m)
        assert m.weight is None and k is not None and k.dtype == BF16, name
        assert all(t is None or t.dtype == BF16 for t in (k.panels, k.onednn)), name
        assert m.bias is None or m.bias.dtype == torch.float32, name
    assert not _linear_shaped_fp32(model, {tuple(w.shape) for w, _ in refs.values()})
    x = torch.randn(3, model.arch.hidden_size)
    w, b = refs["lm_head"]
    with torch.inference_mode():
        got = model.lm_head(x)
    torch.testing.assert_close(got, x @ w.T + (0 if b is None else b), rtol=1e-5, atol=1e-4)
    w, b = refs["layers.0.attn.qkv"]
    with torch.inference_mode():
        got = model.layers[0].attn.qkv(x)
    torch.testing.assert_close(got, x @ w.T + (0 if b is None else b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not HAVE_PANELS, reason="no bf16 panel GEMM here")
def test_a_bf16_model_does_not_take_the_fp32_choice(hf_model_dir, monkeypatch,
                                                     tmp_path) -> None:
    """An fp32 engine's kept choice (here oneDNN) is not a bf16 one's: the bf16 model of the
    same shapes measures afresh where oneDNN takes bf16, else packs the panels untimed."""
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    from kvrelay.engine.cpu.platform import CpuPlatform

    model, _ = bf16_model(hf_model_dir("llama"))
    key = kernel_choice.cache_key(kernel_choice.linear_shapes(model), torch.get_num_threads(),
                                  kernel_choice.PREFILL_ROWS, torch.float32)
    kernel_choice.save(key, "onednn", 0, {})
    timed: list[int] = []

    def time_linears(model, rows, layers=None, reps=3):
        timed.append(rows)
        return (0.5, 1.0)  # the panels win

    monkeypatch.setattr(kernel_choice, "time_linears", time_linears)
    assert CpuPlatform(linear_kernel="auto").prepare_model(model, BF16) == "panels"
    assert timed if HAVE_ONEDNN else not timed
