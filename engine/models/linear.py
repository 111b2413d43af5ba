"""The models' linear layer. It knows no kernel: a platform may give it one at load (on CPU,
``engine/cpu/packed_linear.py``'s copies of the weight in a kernel's layout), and without one it
is ``F.linear``."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearKernel(Protocol):
    """A platform's copy of a linear's weight and the routine that multiplies by it."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``, in ``x``'s dtype."""
        ...


class Linear(nn.Module):
    """``y = x W^T + b``: through ``kernel`` where the platform set one at load (the dense
    ``weight`` is then usually dropped: the kernel holds the only copy), else ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.out_features = out_features
        self.weight: nn.Parameter | None = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.kernel: LinearKernel | None = None

    @property
    def is_packed(self) -> bool:
        """Whether a kernel's copy of the weight stands in for the dense one."""
        return self.kernel is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.forward(x, self.bias)
        return self.dense_forward(x)

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
