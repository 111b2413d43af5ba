"""A linear layer whose weight is repacked once at load into a CPU kernel's layout: the
native panel GEMM (``engine/cpu/gemm.py``) or oneDNN's blocked layout. Every model's projections are
these; ``cpu/fused_decode.py`` reads their panels directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.cpu.gemm import default_kblock, pack_panels, panel_linear


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def onednn_packing_available() -> bool:
    """Whether this torch build can prepack fp32 linear weights for oneDNN (x86 CPU builds)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y, torch.full((2, 4), 4.0)))


LINEAR_KERNELS = ("auto", "panels", "onednn", "mixed")
# Row counts up to which "mixed" sends a linear through the panel GEMM (oneDNN above).
MIXED_PANEL_ROWS = 64


class Linear(nn.Module):
    """``y = x W^T + b``. On CPU in fp32 the weight is repacked once at load into a kernel's
    layout (a plain GEMM repacks it on every call, which at decode-sized batches costs 2-3x the
    matmul itself):

    - ``panels``: the native panel GEMM (:mod:`kvrelay.engine.cpu.gemm`), whose threads each stream
      their share of the weight exactly once per call: at decode-sized row counts that runs at
      the memory bandwidth, where oneDNN's kernels reach ~50-80% of it;
    - ``packed``: oneDNN's blocked layout (``torch.ops.mkldnn``).

    A layer holds one or both; with both, rows up to ``panel_rows`` take the panels."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.out_features = out_features
        self.weight: nn.Parameter | None = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None  # [ceil(out / NR), in, NR], K-blocked by kblock
        self.kblock = 0
        self.panel_rows = 0
        self.threads = 1

    def pack(self, weight: torch.Tensor | None = None, *, onednn: bool = True,
             panels: bool = False, kblock: int | None = None) -> None:
        """Repack (``weight`` defaults to this layer's own) for oneDNN and/or the panel GEMM
        (its K blocks: ``kblock``, default :func:`~kvrelay.engine.cpu.gemm.default_kblock`), and
        drop the dense parameter."""
        w = self.weight if weight is None else weight
        assert w is not None and (onednn or panels)
        w = w.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None) if onednn else None
        if panels:
            self.kblock = default_kblock() if kblock is None else kblock
            self.panels = pack_panels(w, self.kblock)
            self.panel_rows = 1 << 62 if not onednn else MIXED_PANEL_ROWS
        self.threads = torch.get_num_threads()
        self.weight = None

    @property
    def is_packed(self) -> bool:
        """Whether a kernel's copy of the weight stands in for the dense one."""
        return self.packed is not None or self.panels is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.panel_rows:
            return self.panel_forward(x)
        if self.packed is None:
            return self.dense_forward(x)
        return self.packed_forward(x)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` over the dense weight, in ``x``'s dtype. Weights stored narrower than the
        activations (bf16 under fp32 on CPU) are widened for the call, bias too, not ``x``
        rounded to theirs: the product is then the packed kernels' (which widen in registers)
        up to the order of the sums, whether or not a kernel is here. On the 2-core Zen 3
        (AVX2, ~150M demo model, one layer's linears, 2 threads, two runs) bf16 ``F.linear``
        (with the conversions) took 1.6 / 9-12 / 33-46 / 620-700 / 2200-3400 ms at 1 / 8 / 32 /
        512 / 2048 rows, the widened weight 4.7-10 / 15-25 / 19-31 / 128-141 / 322-561: 2-3x
        slower at decode sizes, 5-7x faster at prefill sizes, and exact."""
        w, b = self.weight, self.bias
        if w.dtype == x.dtype:
            return F.linear(x, w, b)
        return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Through oneDNN's prepacked weight, whatever the row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def panel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Through the panel GEMM, whatever the row count."""
        assert self.panels is not None
        return panel_linear(x, self.panels, self.bias, self.out_features, self.threads,
                            self.kblock)

    def drop(self, kernel: str) -> None:
        """Keep only the other kernel's copy (``kernel``: ``"panels"`` or ``"onednn"``)."""
        if kernel == "panels":
            assert self.packed is not None
            self.panels, self.panel_rows = None, 0
        else:
            assert self.panels is not None
            self.packed, self.panel_rows = None, 1 << 62
