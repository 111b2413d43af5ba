"""The CPU kernels of a :class:`~kvrelay.engine.models.linear.Linear`: its weight repacked once at
load (a plain GEMM repacks it on every call, which at decode-sized batches costs 2-3x the matmul
itself) into one or both of

- ``panels``: the native panel GEMM (:mod:`kvrelay.engine.cpu.gemm`), whose threads each stream
  their share of the weight exactly once per call: at decode-sized row counts that runs at the
  memory bandwidth, where oneDNN's kernels reach ~50-80% of it;
- ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn``).

With both (``mixed``), rows up to ``panel_rows`` take the panels. Which the platform packs is
:mod:`kvrelay.engine.cpu.kernel_choice`'s; ``cpu/fused_decode.py`` reads the panels directly.

The weight is fp32 or bf16 (``PACKED_DTYPES``); the activations are fp32 either way. bf16
panels are widened to fp32 in registers by the panel GEMM (half the bytes streamed per decode
step, fp32 arithmetic: the product is ``x @ W.float().T`` up to the order of the sums). oneDNN
multiplies bf16 only by bf16 (where this CPU has it at all, see
:func:`onednn_packing_available`): its copy rounds the activations to bf16 for the call and
widens the product back. The bias is always the activations' fp32 (:func:`pack` widens a bf16
one once): the panel GEMM and the fused decode layers add it to their fp32 sums."""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvrelay.engine.cpu import gemm
from kvrelay.engine.cpu.gemm import default_kblock, pack_panels, panel_linear
from kvrelay.engine.models.linear import Linear

LINEAR_KERNELS = ("auto", "panels", "onednn", "mixed")
# Row counts up to which "mixed" sends a linear through the panel GEMM (oneDNN above).
MIXED_PANEL_ROWS = 64
EVERY_ROW = 1 << 62  # ``panel_rows`` of a kernel whose panels take every row count
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # the weights the kernels take


def onednn_packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build can prepack ``dtype`` linear weights for oneDNN on this CPU:
    fp32 in x86 CPU builds; bf16 only where the CPU converts bf16 natively (torch asks for
    avx512bw+vl+dq or avx_ne_convert; not on AVX2-only cores such as the Zen 3 host)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), w, None, "none",
                                               [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y.float(), torch.full((2, 4), 4.0)))


def panels_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the native panel GEMM takes ``dtype`` weights here: fp32 wherever it is built,
    bf16 where its library has the bf16 kernel (probed once on a small exact product)."""
    if not gemm.available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _bf16_panels_work())


@functools.cache
def _bf16_panels_work() -> bool:
    w = (torch.arange(40 * 24).reshape(40, 24) % 7 - 3).to(torch.bfloat16)  # small integers:
    x = (torch.arange(3 * 24).reshape(3, 24) % 5 - 2).float()  # every sum exact
    try:
        p = pack_panels(w, 0)
        # Twice the room, so that a kernel reading the panels as fp32 stays inside the buffer.
        room = torch.zeros(2 * p.numel(), dtype=p.dtype)
        room[:p.numel()] = p.reshape(-1)
        y = panel_linear(x, room[:p.numel()].view(p.shape), None, 40, 1, 0)
    except (RuntimeError, AssertionError, AttributeError):  # AttributeError: no such symbol
        return False
    return p.dtype == torch.bfloat16 and bool(torch.equal(y, x @ w.float().T))


class PackedLinear:
    """One linear's weight in oneDNN's layout (``onednn``) and/or as the panel GEMM's panels
    (``panels``, ``[ceil(out / NR), in, NR]`` in K blocks of ``kblock`` rows, multiplied on the
    ``threads`` it was packed under); with both, rows up to ``panel_rows`` take the panels.
    Both copies are of the weight's ``dtype`` (fp32 or bf16); ``forward`` takes and returns
    fp32."""

    def __init__(self, weight: torch.Tensor, *, onednn: bool = True, panels: bool = False,
                 kblock: int | None = None):
        assert onednn or panels
        w = weight.detach()
        assert w.dtype in PACKED_DTYPES, w.dtype
        self.dtype = w.dtype
        self.out_features = w.shape[0]
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w, None) if onednn else None
        self.panels: torch.Tensor | None = None
        self.kblock = 0
        self.panel_rows = 0
        if panels:
            self.kblock = default_kblock() if kblock is None else kblock
            self.panels = pack_panels(w, self.kblock)
            self.panel_rows = EVERY_ROW if not onednn else MIXED_PANEL_ROWS
        self.threads = torch.get_num_threads()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.panel_rows:
            return self.panel_forward(x, bias)
        return self.onednn_forward(x, bias)

    def onednn_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Through oneDNN's prepacked weight, whatever the row count."""
        assert self.onednn is not None
        if x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        # bf16 weights: oneDNN has no bf16 x fp32 product, so the rows go in as bf16.
        b = None if bias is None else bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.onednn, b, "none", [],
                                                  "").to(x.dtype)

    def panel_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Through the panel GEMM, whatever the row count."""
        assert self.panels is not None
        return panel_linear(x, self.panels, bias, self.out_features, self.threads, self.kblock)

    def drop(self, kernel: str) -> None:
        """Keep only the other kernel's copy (``kernel``: ``"panels"`` or ``"onednn"``)."""
        if kernel == "panels":
            assert self.onednn is not None
            self.panels, self.panel_rows = None, 0
        else:
            assert self.panels is not None
            self.onednn, self.panel_rows = None, EVERY_ROW


def pack(lin: Linear, weight: torch.Tensor | None = None, *, onednn: bool = True,
         panels: bool = False, kblock: int | None = None) -> PackedLinear:
    """Give ``lin`` a :class:`PackedLinear` of ``weight`` (default: its own; a tied LM head
    passes the embedding) for oneDNN and/or the panel GEMM (its K blocks: ``kblock``, default
    :func:`~kvrelay.engine.cpu.gemm.default_kblock`), and drop the dense parameter. A bias
    of another dtype than fp32 is widened to it (see the module's doc)."""
    w = lin.weight if weight is None else weight
    assert w is not None
    kernel = PackedLinear(w, onednn=onednn, panels=panels, kblock=kblock)
    if lin.bias is not None and lin.bias.dtype != torch.float32:
        lin.bias = nn.Parameter(lin.bias.detach().float(), requires_grad=False)
    lin.kernel, lin.weight = kernel, None
    return kernel


def packed(lin: Linear) -> PackedLinear | None:
    """``lin``'s CPU kernel, or None (unpacked)."""
    k = lin.kernel
    return k if isinstance(k, PackedLinear) else None
