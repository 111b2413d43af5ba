"""The SwiGLU MLP: a dense layer's, and each expert of a mixture of experts (``moe.py``)."""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.pointwise import silu_mul


class MLP(nn.Module):
    """SwiGLU of ``intermediate_size`` (default: the arch's dense one), gate and up fused into
    one weight, over all rows at once or, where the platform sets ``chunk_rows``, in chunks of
    that many rows (the CPU's: so one chunk's gate/up activations stay in its cache)."""

    def __init__(self, arch: ModelArch, intermediate_size: int | None = None,
                 bias: bool | None = None):
        super().__init__()
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        bias = arch.mlp_bias if bias is None else bias
        self.inter = inter
        self.gate_up = Linear(arch.hidden_size, 2 * inter, bias)
        self.down = Linear(inter, arch.hidden_size, bias)
        self.chunk_rows: int | None = None

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(x), self.inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], self.chunk_rows
        if c is None or n <= c:
            return self._swiglu(x)
        out = x.new_empty(n, x.shape[1])
        for start in range(0, n, c):
            out[start:start + c] = self._swiglu(x[start:start + c])
        return out
