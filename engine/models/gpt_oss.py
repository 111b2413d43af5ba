"""gpt-oss (``GptOssForCausalLM``) on the Llama decoder.

What differs from Llama, and where it lives here:

- attention: q/k/v/o with biases, and a learned **sink** per query head: a logit that joins
  every softmax's denominator and attends to nothing (``exp(s_j) / (sum_i exp(s_i) +
  exp(sink))``), so a head can put weight on "nothing" instead of spreading it over the keys.
  The backend applies it (``sinks=``): the native CPU kernels add it to each head's softmax sum,
  the torch path attends explicitly (:func:`kvrelay.engine.attention.sdpa.sink_attention`); a
  backend without sinks (flash-attn) is replaced by torch SDPA for this model when the runner
  starts;
- layers alternate sliding-window and full attention by ``layer_types`` (``ModelArch
  .layer_windows``), the rope is YaRN (transformers' own table, as any scaled rope here);
- the MLP of every layer is a mixture of experts (:class:`GptOssMoE`): the router has a bias,
  each token takes the top ``k`` router logits and a softmax over those ``k``; each expert is a
  SwiGLU with biases and gpt-oss's clamped activation, ``(clamp(up, -l, l) + 1) * g *
  sigmoid(alpha * g)`` with ``g = min(gate, l)`` (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7).

The checkpoint stacks each layer's experts in four tensors (transformers' layout:
``experts.gate_up_proj [E, hidden, 2 * inter]`` with gate and up *interleaved* along the last
axis, ``gate_up_proj_bias [E, 2 * inter]``, ``down_proj [E, inter, hidden]``, ``down_proj_bias
[E, hidden]``). At load they are cut into one ordinary :class:`~kvrelay.engine.models.mlp.MLP`
per expert, gate and up de-interleaved into the fused ``[gate; up]`` rows and transposed to the
linears' ``[out, in]``: the platform then packs the experts as it packs every linear, tensor
parallelism cuts each expert as it cuts a dense MLP (and the sinks with their heads), and the
experts run grouped by expert (``SparseMoE.run_experts``). An MXFP4-quantized checkpoint (the
Hub's own) is refused at config time; a bf16 one is served.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvrelay.engine.attention import AttentionFn, AttentionMetadata
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear, empty_param
from kvrelay.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.weights import Cuts, WeightTarget, write

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GptOssConfig's defaults


class GptOssAttention(Attention):
    """Llama's attention (q/k/v/o biases from the arch) with a sink logit per query head."""

    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__(arch, layer, attn_fn)
        self.sinks = empty_param(arch.num_heads)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   heads: slice) -> torch.Tensor:
        return self.attn_fn(q, k, v, k_cache, v_cache, meta, self.scale, self.window,
                            sinks=self.sinks[heads])


class GptOssExpert(MLP):
    """One expert: gate/up fused (with biases), gpt-oss's clamped SwiGLU, down (with bias)."""

    def __init__(self, arch: ModelArch):
        super().__init__(arch, arch.moe_intermediate_size, bias=True)
        self.alpha, self.limit = SWIGLU_ALPHA, SWIGLU_LIMIT

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[n, 2 * inter]`` (gate; up, biases added) -> ``[n, inter]``: the clamped SwiGLU."""
        gate, up = gate_up.split(self.inter, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activate(self.gate_up(x)))


class GptOssMoE(SparseMoE):
    """``SparseMoE`` with gpt-oss's router (a bias; softmax over the top-k logits) and experts
    (:class:`GptOssExpert`); the grouped dispatch, TP's cut and the reduce are the base's. Its
    grouped-GEMM path (:meth:`use_grouped_mm`, CUDA's) adds the experts' biases, gathered per
    row, and runs gpt-oss's activation between the two GEMMs."""

    def __init__(self, arch: ModelArch):
        with torch.device("meta"):  # the base's own router and experts, replaced just below
            super().__init__(arch)
        self.router = Linear(arch.hidden_size, arch.num_experts, bias=True)
        self.experts = nn.ModuleList(GptOssExpert(arch) for _ in range(arch.num_experts))
        # use_grouped_mm: the experts' biases stacked [E, 2 * inter] and [E, hidden] (the down
        # biases None on a tensor-parallel rank other than 0, which adds none).
        self.stacked_bias: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def use_grouped_mm(self) -> None:
        """The base's stacked weights (each expert's linears become views of the stacks), and
        the biases stacked beside them."""
        stacks = []
        for name in ("gate_up", "down"):
            lins = [getattr(e, name) for e in self.experts]
            stack = torch.stack([lin.weight for lin in lins])
            for i, lin in enumerate(lins):
                lin.weight = nn.Parameter(stack[i], requires_grad=False)
            stacks.append(stack)
        self.stacked = (stacks[0], stacks[1])
        down_b = [e.down.bias for e in self.experts]
        self.stacked_bias = (torch.stack([e.gate_up.bias for e in self.experts]),
                             None if down_b[0] is None else torch.stack(down_b))

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """The base's, but on the grouped-GEMM path: its dispatch and combine (rows sorted by
        expert, gathered back, weighted, each token's ``k`` summed in ascending expert order)
        around the two GEMMs with the biases and gpt-oss's activation."""
        if self.stacked is None or self.stacked_bias is None:
            return super().run_experts(x, ids, weights)
        t, k = ids.shape
        ids, perm = torch.sort(ids, dim=1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        xs = x.index_select(0, order // k)
        expert = flat.index_select(0, order)  # each sorted pair's expert
        offs = torch.searchsorted(expert, torch.arange(self.num_experts, device=x.device),
                                  right=True).to(torch.int32)
        (gate_up, down), (gate_up_b, down_b) = self.stacked, self.stacked_bias
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
        h = self.experts[0].activate(h.add_(gate_up_b.index_select(0, expert)))
        ys = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
        if down_b is not None:
            ys.add_(down_b.index_select(0, expert))
        pairs = ys.index_select(0, torch.argsort(order)).view(t, k, ys.shape[1])
        pairs.mul_(weights.gather(1, perm).unsqueeze(2))
        return pairs.sum(dim=1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts by router logit and the softmax (fp32) of those k logits
        (= the full softmax's top-k renormalised, computed as transformers does)."""
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype)

    def checkpoint_targets(self, prefix: str) -> dict[str, WeightTarget]:  # type: ignore[override]
        """The router's ``router.weight/bias`` and the stacked experts' four tensors under
        ``prefix`` (the layer's ``mlp.``)."""
        out = {f"{prefix}router.weight": WeightTarget(self.router.weight),
               f"{prefix}router.bias": WeightTarget(self.router.bias)}
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            out[f"{prefix}experts.{name}"] = StackedExperts(self, name)
        return out


class StackedExperts(WeightTarget):
    """One of the four stacked expert tensors, cut into every expert's own parameter: expert
    ``e``'s slice, gate/up de-interleaved (even columns: gate, odd: up) into ``[gate; up]``,
    the matrices transposed to ``[out, in]``. The parameters are taken when the target is made
    (the whole model's: a tensor-parallel rank's are cut after, and written through its cuts)."""

    __slots__ = ("fused", "name", "params")

    def __init__(self, moe: GptOssMoE, name: str):
        super().__init__(moe.experts[0].gate_up.weight)
        self.name = name
        self.fused = name.startswith("gate_up")
        attr = {"gate_up_proj": ("gate_up", "weight"), "gate_up_proj_bias": ("gate_up", "bias"),
                "down_proj": ("down", "weight"), "down_proj_bias": ("down", "bias")}[name]
        self.params = [getattr(getattr(e, attr[0]), attr[1]) for e in moe.experts]

    def load(self, name: str, tensor: torch.Tensor, cuts: Cuts | None = None) -> None:
        for e, param in enumerate(self.params):
            shape = tuple(param.shape) if param.ndim == 1 else tuple(param.shape[::-1])
            if tensor.ndim != 1 + len(shape) or tensor.shape[0] != len(self.params) \
                    or tuple(tensor.shape[1:]) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{(len(self.params), *shape)}")
            t = tensor[e]
            if self.fused:  # [..., 2 * inter] interleaved -> [gate; up] along the last axis
                t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
            write(cuts, param, None, None, t if t.ndim == 1 else t.t())


class GptOssDecoderLayer(DecoderLayer):
    attention_class = GptOssAttention

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> GptOssMoE:  # type: ignore[override]
        return GptOssMoE(arch)


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's model with gpt-oss's layers; the rope table (YaRN) is built as Llama's is."""

    layer_class = GptOssDecoderLayer

    @classmethod
    def from_config(cls, arch: ModelArch, hf_cfg: Any, attn_fn: AttentionFn,
                    max_positions: int, compute_dtype: torch.dtype) -> GptOssForCausalLM:
        model = super().from_config(arch, hf_cfg, attn_fn, max_positions, compute_dtype)
        alpha = float(getattr(hf_cfg, "swiglu_alpha", SWIGLU_ALPHA))
        limit = float(getattr(hf_cfg, "swiglu_limit", SWIGLU_LIMIT))
        for layer in model.layers:
            for expert in layer.mlp.experts:
                expert.alpha, expert.limit = alpha, limit
        return model  # type: ignore[return-value]

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        out = {k: t for k, t in super().checkpoint_targets().items() if ".mlp." not in k}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.sinks"] = WeightTarget(layer.attn.sinks)
            out.update(layer.mlp.checkpoint_targets(p + "mlp."))
        return out
