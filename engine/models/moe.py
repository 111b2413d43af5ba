"""The sparse mixture-of-experts block of Mixtral, Qwen3-MoE and Qwen2-MoE, in place of a layer's
MLP.

A router (a linear to one logit per expert) scores each token; softmax over the experts, the
top ``k`` kept, renormalised to sum 1 where the architecture says so (Mixtral always, the Qwen
MoEs per ``norm_topk_prob``). Each expert is a SwiGLU :class:`~kvrelay.engine.models.mlp.MLP`
with its gate/up fused, an ordinary module of :class:`~kvrelay.engine.models.linear.Linear`
layers, so a platform packs the experts at load as it packs the dense linears (on CPU: the panel
GEMM / oneDNN copies in the checkpoint's dtype, bf16 stays bf16).

The step's tokens are run grouped by expert (:meth:`SparseMoE.run_experts`): the ``T * k``
(token, expert) pairs are sorted by expert (one stable argsort), and each expert that any token
chose multiplies its tokens' rows in one call per linear; the outputs, gathered back to their
tokens and scaled by their routing weights, are summed per token. The loop is over the active
experts (at most ``min(E, T * k)``), never over tokens; one host sync per layer reads the group
sizes. The per-token sums run in ascending expert order, as transformers' loop adds them.

A shared expert (Qwen2-MoE's; ``ModelArch.shared_expert_intermediate_size``) is a SwiGLU every
token takes besides its routed ones, added after them, its output scaled by
``sigmoid(shared_expert_gate(x))`` where the architecture gates it. A family with other routing
(DeepSeek's grouped top-k) or ungated shared experts subclasses this block and overrides
:meth:`SparseMoE.route` (and its checkpoint names); the grouped dispatch and the shared expert
are reused as they are.

Under tensor parallelism every rank holds a slice of every expert's FFN, the shared expert's
too (gate/up split by columns, down by rows: :meth:`SparseMoE.sharded_mlps`, ``tp_shard.py``),
and the router and the shared expert's gate whole: each rank routes the same (replicated) rows
the same way, combines its partial expert outputs with the routing weights and its partial
shared output with the gate (both linear in the partials, so they sum to the whole), and one
all-reduce per layer sums them, as the dense MLP's down projection does.

A platform whose linears stay unpacked (CUDA) may instead run every expert of a layer in two
grouped GEMMs (:meth:`SparseMoE.use_grouped_mm`: ``torch._grouped_mm`` over the experts'
weights stacked ``[E, out, in]``, the per-expert linears then views of the stack): no loop and
no host sync, the group offsets computed on the device. :func:`grouped_mm_available` probes it
on the device and dtype first (on CUDA torch's kernel needs a recent GPU; on CPU it exists for
fp32), so a platform falls back to the loop where it is missing or wrong. Its math is tested on
CPU in fp32 (tests/test_moe_models.py); not yet run on a GPU.

Not here yet: expert parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.weights import DENSE_MLP_NAMES, WeightTarget, mlp_targets
from kvrelay.engine.pointwise import silu_mul


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here, for ``dtype`` on ``device``, and gets a small
    product with an empty group right (checked against a loop of matmuls)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-2, 3, (24, 16), generator=g).to(device, dtype)
        w = torch.randint(-2, 3, (3, 32, 16), generator=g).to(device, dtype)
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        want = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T])
        return bool(torch.equal(got.float(), want.float()))  # small integers: exact sums
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def enable_grouped_mm(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Give every sparse layer of ``model`` (weights and activations of ``dtype``, unpacked)
    the grouped GEMMs where :func:`grouped_mm_available` and its widths are multiples of 8
    (CUDA's kernel wants 16-byte aligned rows); returns how many layers took them."""
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not moes or not grouped_mm_available(device, dtype):
        return 0
    n = 0
    for m in moes:
        e = m.experts[0]
        if e.inter % 8 == 0 and e.gate_up.weight is not None \
                and e.gate_up.weight.shape[1] % 8 == 0:
            m.use_grouped_mm()
            n += 1
    return n


class SparseMoE(nn.Module):
    """Router, top-k, the routed experts and the shared expert (where the architecture has one)
    of one sparse layer: ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, arch: ModelArch, *, shared_intermediate_size: int | None = None,
                 shared_gate: bool | None = None):
        """``shared_intermediate_size`` / ``shared_gate`` override the arch's shared expert (a
        subclass's: DeepSeek's is ``n_shared_experts`` experts wide, ungated)."""
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.router = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(arch, arch.moe_intermediate_size, bias=False)
                                     for _ in range(arch.num_experts))
        shared = (arch.shared_expert_intermediate_size if shared_intermediate_size is None
                  else shared_intermediate_size)
        gated = arch.shared_expert_gate if shared_gate is None else shared_gate
        self.shared_expert = MLP(arch, shared, bias=False) if shared else None
        self.shared_expert_gate = (Linear(arch.hidden_size, 1, bias=False)
                                   if shared and gated else None)
        # Under tensor parallelism: the all-reduce of the combined partial outputs.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        # The experts' gate/up and down weights stacked [E, out, in] (use_grouped_mm).
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_grouped_mm(self) -> None:
        """Run the experts through two grouped GEMMs from now on: their (loaded, unpacked,
        sharded) weights are stacked, and each expert's linears become views of the stack (no
        second copy)."""
        stacks = []
        for name in ("gate_up", "down"):
            lins = [getattr(e, name) for e in self.experts]
            assert all(lin.weight is not None and lin.bias is None for lin in lins)
            stack = torch.stack([lin.weight for lin in lins])
            for i, lin in enumerate(lins):
                lin.weight = nn.Parameter(stack[i], requires_grad=False)
            stacks.append(stack)
        self.stacked = (stacks[0], stacks[1])

    def sharded_mlps(self) -> list[MLP]:
        """The SwiGLUs tensor parallelism cuts as it cuts a dense MLP (each rank a slice of
        every one): the routed experts and the shared expert. Their partial outputs are summed
        by :attr:`reduce`, once."""
        shared = [] if self.shared_expert is None else [self.shared_expert]
        return [*self.experts, *shared]

    @property
    def chunk_rows(self) -> int | None:
        return self.experts[0].chunk_rows

    @chunk_rows.setter
    def chunk_rows(self, rows: int | None) -> None:
        """The platform's row chunks, for each expert's own MLP (an expert's group is at most
        the step's rows)."""
        for e in self.sharded_mlps():
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

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert[ids[t, j]](x[t])`` for every row ``t`` (a new tensor,
        not reduced), the experts run grouped: one call per active expert over its rows, or
        two grouped GEMMs over all of them (:meth:`use_grouped_mm`)."""
        t, k = ids.shape
        ids, perm = torch.sort(ids, dim=1)  # a row's experts ascending: its sum's order
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs by expert
        xs = x.index_select(0, order // k)
        if self.stacked is not None:
            # Group e's rows end at offs[e]: the pairs of experts <= e (no host sync).
            offs = torch.searchsorted(flat.index_select(0, order),
                                      torch.arange(self.num_experts, device=x.device),
                                      right=True).to(torch.int32)
            gate_up, down = self.stacked
            inter = down.shape[2]
            h = silu_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs), inter)
            ys = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
                if n:
                    stop = start + n
                    ys[start:stop] = self.experts[e](xs[start:stop])
                    start = stop
        # Back in (token, expert) order by a gather, weighted, each token's k summed. (Not an
        # index_add_ into the tokens' rows: on 2 threads its parallel scatter took 0.5-1 ms for
        # 32 rows of 512 on the shared 2-core host, the gather ~60 us; the bench MoE's B=8
        # decode step went from 46.7 to 44.9 ms, median of 15 paired steps.)
        pairs = ys.index_select(0, torch.argsort(order)).view(t, k, ys.shape[1])
        pairs.mul_(weights.gather(1, perm).unsqueeze(2))
        return pairs.sum(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.run_experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared.mul_(torch.sigmoid(self.shared_expert_gate(x)))
            out.add_(shared)
        if self.reduce is not None:
            self.reduce(out)
        return out

    def checkpoint_targets(self, prefix: str, router: str = "gate",
                           expert_names: tuple[str, str, str] = DENSE_MLP_NAMES,
                           shared: str = "shared_expert") -> dict[str, WeightTarget]:
        """This block's tensors under ``prefix`` (the layer's ``mlp.``), by the names its
        checkpoints use: the router's ``{router}.weight``, ``experts.N.{gate,up,down}``
        (``expert_names``), the shared expert's ``{shared}.gate_proj/up_proj/down_proj`` and
        its gate's ``{shared}_gate.weight``."""
        out = {f"{prefix}{router}.weight": WeightTarget(self.router.weight)}
        for e, expert in enumerate(self.experts):
            out.update(mlp_targets(expert, f"{prefix}experts.{e}.", expert_names))
        if self.shared_expert is not None:
            out.update(mlp_targets(self.shared_expert, f"{prefix}{shared}."))
        if self.shared_expert_gate is not None:
            out[f"{prefix}{shared}_gate.weight"] = WeightTarget(self.shared_expert_gate.weight)
        return out
