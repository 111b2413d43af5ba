"""Rotary embedding tables for a checkpoint, computed as transformers computes them."""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.engine.models.arch import rope_parameters


def rope_inv_freq(cfg: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, exactly as transformers computes them."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.float(), float(scale)
