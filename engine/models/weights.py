"""Where each checkpoint tensor goes in a model: the map a model gives the loader.

A model names its parameters by the names its checkpoints on the Hub use (and transformers'
``save_pretrained`` writes); fused parameters (q/k/v, gate/up) take several checkpoint tensors,
each into its row range.

Under tensor parallelism a rank's model is cut before anything is loaded (``tp_shard``): each
cut parameter is a new, smaller one, and its ``Cut`` says which slices of the whole parameter
it keeps. The targets still describe the whole model (the checkpoint's geometry), and every
write goes through ``write`` (``Cut.write`` for a cut parameter), which copies only the kept
part of the tensor into the shard. A rank then never holds more than its shard and the one
checkpoint tensor being read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvrelay.engine.models.mlp import MLP


@dataclass(frozen=True)
class Cut:
    """What a tensor-parallel rank keeps of a parameter: the slices ``kept`` of the whole one
    along ``dim``, concatenated in that order into ``shard``."""

    shard: torch.Tensor
    dim: int
    kept: tuple[slice, ...]

    def write(self, lo: int, hi: int, tensor: torch.Tensor) -> None:
        """The whole parameter's rows ``[lo, hi)`` are ``tensor``: copy what this cut keeps of
        them into the shard."""
        at = 0  # where the current kept slice starts in the shard
        for s in self.kept:
            n = s.stop - s.start
            if self.dim == 0:  # rows: the part of [lo, hi) this slice keeps
                a, b = max(s.start, lo), min(s.stop, hi)
                if a < b:
                    self.shard[at + a - s.start:at + b - s.start].copy_(tensor[a - lo:b - lo])
            else:  # a later axis: the target's rows, this slice of that axis
                self.shard[lo:hi].narrow(self.dim, at, n).copy_(
                    tensor.narrow(self.dim, s.start, n))
            at += n


class Cuts:
    """The cuts of one rank's model, by the whole parameter they replace. ``keep`` makes a cut
    (an empty shard on ``device``: nothing of the whole parameter is read); ``of`` finds the cut
    a write into the whole parameter goes through (``write``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._of: dict[int, tuple[torch.Tensor, Cut]] = {}  # id(whole) -> (whole, its cut)

    def keep(self, whole: torch.Tensor, kept: list[slice], dim: int) -> nn.Parameter:
        shape = list(whole.shape)
        shape[dim] = sum(s.stop - s.start for s in kept)
        shard = torch.empty(shape, dtype=whole.dtype, device=self.device)
        self._of[id(whole)] = (whole, Cut(shard, dim, tuple(kept)))  # holds ``whole``: ids stay
        return nn.Parameter(shard, requires_grad=False)

    def of(self, whole: torch.Tensor) -> Cut | None:
        entry = self._of.get(id(whole))
        return None if entry is None else entry[1]


def write(cuts: Cuts | None, whole: torch.Tensor, start: int | None, stop: int | None,
          tensor: torch.Tensor) -> None:
    """``whole[start:stop] = tensor``; where ``cuts`` cut ``whole``, only the kept part, into
    the rank's shard."""
    cut = None if cuts is None else cuts.of(whole)
    if cut is None:
        (whole if start is None else whole[start:stop]).copy_(tensor)
    else:
        cut.write(0 if start is None else start, whole.shape[0] if stop is None else stop,
                  tensor)


class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or a row slice of a fused parameter."""

    __slots__ = ("param", "start", "stop")

    def __init__(self, param: torch.Tensor, start: int | None = None, stop: int | None = None):
        self.param, self.start, self.stop = param, start, stop

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start:self.stop]

    def load(self, name: str, tensor: torch.Tensor, cuts: Cuts | None = None) -> None:
        """Copy checkpoint tensor ``name`` into its place (converted to the parameter's dtype),
        through ``cuts`` when the model is a tensor-parallel rank's. A target whose tensor
        fills several parameters (gpt-oss's experts stacked in one tensor) overrides this."""
        view = self.view()
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
        write(cuts, self.param, self.start, self.stop, tensor)


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
