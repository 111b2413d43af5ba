"""The sparse mixture-of-experts block of Mixtral and Qwen3-MoE, in place of a layer's MLP.

A router (a linear to one logit per expert) scores each token; softmax over the experts, the
top ``k`` kept, renormalised to sum 1 where the architecture says so (Mixtral always, Qwen3-MoE
per ``norm_topk_prob``). Each expert is a SwiGLU :class:`~kvrelay.engine.models.mlp.MLP` with
its gate/up fused, an ordinary module of :class:`~kvrelay.engine.models.linear.Linear` layers, so
a platform packs the experts at load as it packs the dense linears (on CPU: the panel GEMM /
oneDNN copies in the checkpoint's dtype, bf16 stays bf16).

The step's tokens are run grouped by expert: the ``T * k`` (token, expert) pairs are sorted by
expert (one stable argsort), and each expert that any token chose multiplies its tokens' rows in
one call per linear; its outputs, scaled by their routing weights, are added into their tokens'
rows. The loop is over the active experts (at most ``min(E, T * k)``), never over tokens; one
host sync per layer reads the group sizes. The per-token sums run in ascending expert order, as
transformers' loop adds them.

Under tensor parallelism every rank holds a slice of every expert's FFN (gate/up split by
columns, down by rows, ``tp_shard.py``) and the router whole: each rank routes the same
(replicated) rows the same way, combines its partial expert outputs with the routing weights
(linear in them, so the partials sum to the whole), and one all-reduce per layer sums them, as
the dense MLP's down projection does.

Not here yet: a grouped GEMM on CUDA (one kernel for every expert, which CUDA graphs could
capture: the host sync above keeps MoE models' decode steps eager there), expert parallelism,
shared experts and DeepSeek's grouped top-k gating.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.models.mlp import MLP


class SparseMoE(nn.Module):
    """Router, top-k and the experts of one sparse layer: ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.router = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(arch, arch.moe_intermediate_size, bias=False)
                                     for _ in range(arch.num_experts))
        # Under tensor parallelism: the all-reduce of the combined partial outputs.
        self.reduce: Callable[[torch.Tensor], None] | None = None

    @property
    def chunk_rows(self) -> int | None:
        return self.experts[0].chunk_rows

    @chunk_rows.setter
    def chunk_rows(self, rows: int | None) -> None:
        """The platform's row chunks, for each expert's own MLP (an expert's group is at most
        the step's rows)."""
        for e in self.experts:
            e.chunk_rows = rows

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts ``[T, k]`` (ids) and their weights ``[T, k]`` (in ``x``'s
        dtype): the softmax over every expert's logit (fp32), top-k, renormalised where the
        architecture says."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        k = self.top_k
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs by expert
        rows = order // k  # the token of each pair, in that order
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if n:
                stop = start + n
                ys[start:stop] = self.experts[e](xs[start:stop])
                start = stop
        # Weighted, then into their tokens' rows in one pass (a token's pairs in expert order).
        ys.mul_(weights.view(-1).index_select(0, order).unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, rows, ys)
        if self.reduce is not None:
            self.reduce(out)
        return out
