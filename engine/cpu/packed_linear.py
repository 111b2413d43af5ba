"""The CPU kernels of a :class:`~kvrelay.engine.models.linear.Linear`: its weight repacked once at
load (a plain GEMM repacks it on every call, which at decode-sized batches costs 2-3x the matmul
itself) into one or both of

- ``panels``: the native panel GEMM (:mod:`kvrelay.engine.cpu.gemm`), whose threads each stream
  their share of the weight exactly once per call: at decode-sized row counts that runs at the
  memory bandwidth, where oneDNN's kernels reach ~50-80% of it;
- ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn``).

With both (``mixed``), rows up to ``panel_rows`` take the panels. Which the platform packs is
:mod:`kvrelay.engine.cpu.kernel_choice`'s; ``cpu/fused_decode.py`` reads the panels directly."""

from __future__ import annotations

import torch

from kvrelay.engine.cpu.gemm import default_kblock, pack_panels, panel_linear
from kvrelay.engine.models.linear import Linear

LINEAR_KERNELS = ("auto", "panels", "onednn", "mixed")
# Row counts up to which "mixed" sends a linear through the panel GEMM (oneDNN above).
MIXED_PANEL_ROWS = 64
EVERY_ROW = 1 << 62  # ``panel_rows`` of a kernel whose panels take every row count


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


class PackedLinear:
    """One linear's weight in oneDNN's layout (``onednn``) and/or as the panel GEMM's panels
    (``panels``, ``[ceil(out / NR), in, NR]`` in K blocks of ``kblock`` rows, multiplied on the
    ``threads`` it was packed under); with both, rows up to ``panel_rows`` take the panels."""

    def __init__(self, weight: torch.Tensor, *, onednn: bool = True, panels: bool = False,
                 kblock: int | None = None):
        assert onednn or panels
        w = weight.detach()
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
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")

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
    :func:`~kvrelay.engine.cpu.gemm.default_kblock`), and drop the dense parameter."""
    w = lin.weight if weight is None else weight
    assert w is not None
    kernel = PackedLinear(w, onednn=onednn, panels=panels, kblock=kblock)
    lin.kernel, lin.weight = kernel, None
    return kernel


def packed(lin: Linear) -> PackedLinear | None:
    """``lin``'s CPU kernel, or None (unpacked)."""
    k = lin.kernel
    return k if isinstance(k, PackedLinear) else None
