"""Where each checkpoint tensor goes in a model: the map a model gives the loader.

A model names its parameters by the names its checkpoints on the Hub use (and transformers'
``save_pretrained`` writes); fused parameters (q/k/v, gate/up) take several checkpoint tensors,
each into its row range.
"""

from __future__ import annotations

import torch

from kvrelay.engine.models.mlp import MLP


class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or a row slice of a fused parameter."""

    __slots__ = ("param", "start", "stop")

    def __init__(self, param: torch.Tensor, start: int | None = None, stop: int | None = None):
        self.param, self.start, self.stop = param, start, stop

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start:self.stop]

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` into its place (converted to the parameter's dtype).
        A target whose tensor fills several parameters (gpt-oss's experts stacked in one
        tensor) overrides this."""
        view = self.view()
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
        view.copy_(tensor)


# A SwiGLU's checkpoint names: (gate, up, down). Mixtral's experts call them w1, w3, w2.
DENSE_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def mlp_targets(m: MLP, prefix: str,
                names: tuple[str, str, str] = DENSE_MLP_NAMES) -> dict[str, WeightTarget]:
    """A SwiGLU's gate and up (into the fused ``gate_up``) and down, under ``prefix``."""
    gate, up, down = names
    inter = m.inter
    out: dict[str, WeightTarget] = {}
    for kind, fused in (("weight", m.gate_up.weight), ("bias", m.gate_up.bias)):
        if fused is not None:
            out[prefix + f"{gate}.{kind}"] = WeightTarget(fused, 0, inter)
            out[prefix + f"{up}.{kind}"] = WeightTarget(fused, inter, 2 * inter)
    out[prefix + f"{down}.weight"] = WeightTarget(m.down.weight)
    if m.down.bias is not None:
        out[prefix + f"{down}.bias"] = WeightTarget(m.down.bias)
    return out
