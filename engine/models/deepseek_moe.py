"""DeepSeek's mixture of experts: V2's and V3's gating over :class:`SparseMoE`'s grouped
experts, with ``n_shared_experts`` shared experts (one SwiGLU of ``n_shared_experts *
moe_intermediate_size``) that every token takes, ungated.

Gating (``ModelArch.topk_method``):

- ``greedy`` / ``group_limited_greedy`` (V2): softmax over every expert's logit; the group
  limited variant first keeps the ``topk_group`` groups (of ``n_group``) with the highest single
  score and zeroes the rest; top-k of the scores are the weights (renormalised where
  ``norm_topk_prob``, DeepSeek's own reading: no released V2 sets it);
- ``noaux_tc`` (V3): sigmoid scores; the experts are *chosen* by score plus
  ``e_score_correction_bias`` (a load-balancing bias that never weighs an output), limited to
  the ``topk_group`` groups with the highest sum of their two best biased scores; the weights
  are the chosen experts' unbiased scores, renormalised where ``norm_topk_prob``.

Either way the weights are then scaled by ``routed_scaling_factor``. Scores are fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.weights import WeightTarget


class DeepseekMoE(SparseMoE):
    def __init__(self, arch: ModelArch):
        super().__init__(arch, shared_intermediate_size=arch.shared_expert_intermediate_size,
                         shared_gate=False)
        self.method = arch.topk_method
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.scaling = arch.routed_scaling_factor
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide the {self.num_experts} "
                             f"routed experts")
        # V3's selection bias (kept in fp32, as DeepSeek trains and ships it)
        self.score_bias = (nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32),
                                        requires_grad=False)
                           if self.method == "noaux_tc" else None)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` True for the experts of each row's ``topk_group`` best groups."""
        keep = torch.topk(group_scores, self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return mask.repeat_interleave(self.num_experts // self.n_group, dim=1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x).float()
        t, g = logits.shape[0], self.n_group
        if self.method == "noaux_tc":
            scores = torch.sigmoid(logits)
            choice = scores + self.score_bias
            if self.topk_group < g:
                per_group = choice.view(t, g, -1)
                best2 = torch.topk(per_group, min(2, per_group.shape[-1]), dim=-1).values
                choice = choice.masked_fill(~self._group_mask(best2.sum(-1)), float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            scores = torch.softmax(logits, dim=-1)
            if self.method == "group_limited_greedy" and self.topk_group < g:
                mask = self._group_mask(scores.view(t, g, -1).amax(-1))
                scores = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.scaling).to(x.dtype)

    def checkpoint_targets(self, prefix: str, router: str = "gate",
                           expert_names: tuple[str, str, str] | None = None,
                           shared: str = "shared_experts") -> dict[str, WeightTarget]:
        """DeepSeek's names: ``mlp.gate.weight`` (and V3's ``mlp.gate.e_score_correction_bias``),
        ``mlp.experts.N.{gate,up,down}_proj``, ``mlp.shared_experts.*``."""
        out = super().checkpoint_targets(prefix, router=router, shared=shared)
        if self.score_bias is not None:
            out[f"{prefix}{router}.e_score_correction_bias"] = WeightTarget(self.score_bias)
        return out
