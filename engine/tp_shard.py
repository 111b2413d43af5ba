"""A rank's shard of a tensor-parallel replica: its place and process group (``TPShard``),
the heads and KV it owns, and the model cut to its slice.

Megatron-style: q/k/v (by heads) and gate/up are column-parallel, o_proj and down_proj
row-parallel followed by an all-reduce (a mixture of experts: every expert's gate/up and down
split so, the router replicated, one all-reduce after the experts' outputs are combined);
embedding and LM head are replicated and only rank 0 computes logits and samples. When the
model has fewer KV heads than ranks, each rank keeps a copy of the one KV head its query heads
read. Every rank owns the KV cache of its heads with the same block ids, so one scheduler (rank
0's) drives them all. The ranks' processes and rank 0's runner are ``tensor_parallel.py``'s.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.models.llama import LlamaForCausalLM
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.weights import Cuts

logger = logging.getLogger(__name__)


STARTUP_TIMEOUT_S = 300.0


class TensorParallelError(RuntimeError):
    """A rank of this replica died, hung past the timeout, or failed its step."""


@dataclass(frozen=True)
class TPShard:
    """This process's place in a replica and the groups its collectives run on.

    Two kinds of collective, two groups: ``group`` carries activations (the row-parallel
    all-reduces: NCCL on GPUs, gloo on CPUs), ``control`` carries the control plane (the step
    header's payload, the block-count check: always gloo, CPU tensors). NCCL takes CUDA tensors
    only, and a control message over it would crash a GPU replica at start; every collective
    here goes through the method of its kind, which refuses the wrong tensor for its group."""

    rank: int
    size: int
    group: dist.ProcessGroup
    timeout: datetime.timedelta
    control: dist.ProcessGroup | None = None  # None: ``group`` (a CPU replica's one gloo group)
    nccl: bool = False  # ``group`` is NCCL: activations only, CUDA tensors only

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """An activation all-reduce. On NCCL it is stream-ordered: the host does not wait for
        the GPU (the group's own timeout and async error handling bound it)."""
        if self.nccl and t.device.type != "cuda":
            raise TensorParallelError(f"a {t.device.type} tensor would reach an NCCL "
                                      f"collective (NCCL carries CUDA activations only)")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.timeout
        work = self.group.allreduce([t], opts)
        if self.nccl:
            work.wait()  # the current stream waits, not the host
        else:
            work.wait(self.timeout)

    def control_all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                           timeout: datetime.timedelta | None = None) -> None:
        """A control all-reduce over gloo (a CPU tensor), bounded by ``timeout``."""
        if t.device.type != "cpu":
            raise TensorParallelError("control collectives carry CPU tensors")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timeout or self.timeout
        (self.control or self.group).allreduce([t], opts).wait(opts.timeout)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's control payload (the packed step) to every rank, over gloo."""
        if t.device.type != "cpu":
            raise TensorParallelError("control collectives carry CPU tensors")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        (self.control or self.group).broadcast([t], opts).wait(self.timeout)


def make_groups(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(activation group, control group or None) of the rank on ``device``: on GPUs NCCL for
    activations and gloo for control, each under its own store prefix; on CPUs one gloo group
    for both. The NCCL group is bound to the rank's GPU, which is made current first (NCCL
    sets its communicator up on the current device)."""
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, size, timeout), None
    torch.cuda.set_device(device)
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = timeout
    activations = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, nccl_opts)
    activations.bound_device_id = device
    control = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    return activations, control


def startup_timeout(config: EngineConfig) -> datetime.timedelta:
    """The wait for the ranks to start, join and load the model: spawning a process that imports
    torch and loads a checkpoint takes longer than a step, and far longer on a loaded machine, so
    it gets at least STARTUP_TIMEOUT_S whatever ``tp_timeout_s`` (the steps' bound) is."""
    return datetime.timedelta(seconds=max(config.model.tp_timeout_s, STARTUP_TIMEOUT_S))


def validate_tp(arch: ModelArch, size: int) -> None:
    """Raise a clear error where ``arch`` cannot be split over ``size`` ranks."""
    if size == 1:
        return
    if arch.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the {arch.num_heads} "
                         f"attention heads")
    kvh = arch.num_kv_heads
    if (kvh >= size and kvh % size) or (kvh < size and size % kvh):
        raise ValueError(f"tensor_parallel_size {size} and the {kvh} KV heads must divide one "
                         f"another")
    if not all(arch.sparse_layers) and arch.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size "
                         f"{arch.intermediate_size}")
    if arch.is_moe and arch.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide moe_intermediate_size "
                         f"{arch.moe_intermediate_size} (each rank holds a slice of every "
                         f"expert)")
    if arch.is_moe and arch.shared_expert_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide "
                         f"shared_expert_intermediate_size {arch.shared_expert_intermediate_size}")


def local_kv_heads(arch: ModelArch, size: int) -> int:
    """KV heads one rank holds: a share, or one replicated head when there are fewer than
    ranks."""
    return max(1, arch.num_kv_heads // size)


def kv_head_range(arch: ModelArch, rank: int, size: int) -> range:
    """Which of the model's KV heads rank ``rank`` holds."""
    n = local_kv_heads(arch, size)
    first = rank * arch.num_kv_heads // size if arch.num_kv_heads < size else rank * n
    return range(first, first + n)


class RowParallelLinear(Linear):
    """A row-parallel linear: this rank's partial product, summed over the ranks. Only rank 0
    adds the bias."""

    shard: TPShard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.shard.all_reduce(y)
        return y


def _row_parallel(lin: Linear, shard: TPShard) -> None:
    # The class swap keeps the TP=1 Linear free of any per-call check.
    lin.__class__ = RowParallelLinear
    lin.shard = shard  # type: ignore[attr-defined]


def _keep(w: torch.Tensor | None, rows: list[slice], dim: int = 0, *,
          cuts: Cuts) -> nn.Parameter | None:
    """The slices ``rows`` of ``w`` along ``dim``, concatenated: an empty shard the loader
    fills through ``cuts`` (None where ``w`` is)."""
    return None if w is None else cuts.keep(w, rows, dim)


def shard_model(model: LlamaForCausalLM, shard: TPShard, cuts: Cuts) -> None:
    """Cut a model not loaded yet (dense, unpacked) down to ``shard.rank``'s part, in place:
    before packing, so the kernels pack only the shard. Only the decoder layers are cut (the
    embedding, the final norm and the head stay whole on every rank). Each cut parameter is an
    empty shard, and the loader writes each checkpoint tensor's kept part through ``cuts``
    (``weights.Cuts``): a rank never holds more than its shard and one checkpoint tensor."""
    for layer in model.layers:
        shard_layer(model, layer, shard, cuts)


def shard_layer(model: LlamaForCausalLM, layer: nn.Module, shard: TPShard,
                cuts: Cuts) -> None:
    """Cut one decoder layer of ``model`` down to ``shard.rank``'s part, in place (``cuts``: as
    in ``shard_model``). A model that cuts itself (DeepSeek's latent attention) does it in its
    ``shard_layer_tensor_parallel``."""
    own = getattr(model, "shard_layer_tensor_parallel", None)
    if own is not None:
        own(layer, shard, cuts)
        return
    arch, r, n = model.arch, shard.rank, shard.size
    hd = arch.head_dim
    heads = arch.num_heads // n
    kv = kv_head_range(arch, r, n)
    q_size, kv_size = arch.num_heads * hd, arch.num_kv_heads * hd
    q_rows = slice(r * heads * hd, (r + 1) * heads * hd)
    k_rows = slice(q_size + kv.start * hd, q_size + kv.stop * hd)
    v_rows = slice(q_size + kv_size + kv.start * hd, q_size + kv_size + kv.stop * hd)
    a, m = layer.attn, layer.mlp
    a.qkv.weight = _keep(a.qkv.weight, [q_rows, k_rows, v_rows], cuts=cuts)
    a.qkv.bias = _keep(a.qkv.bias, [q_rows, k_rows, v_rows], cuts=cuts)
    a.num_heads, a.num_kv_heads = heads, len(kv)
    a.q_size, a.kv_size = heads * hd, len(kv) * hd
    a.qkv.out_features = a.q_size + 2 * a.kv_size
    a.o.weight = _keep(a.o.weight, [q_rows], dim=1, cuts=cuts)
    if getattr(a, "sinks", None) is not None:  # gpt-oss: a sink per query head, with it
        a.sinks = _keep(a.sinks, [slice(r * heads, (r + 1) * heads)], cuts=cuts)
    if r != 0:
        a.o.bias = None
    _row_parallel(a.o, shard)
    shard_ffn(m, shard, cuts)


def shard_ffn(m: nn.Module, shard: TPShard, cuts: Cuts) -> None:
    """Rank ``shard.rank``'s part of a layer's feed-forward block: a dense SwiGLU's columns,
    or every expert's. A mixture of experts keeps its router whole (every rank routes the same
    rows alike); each expert (and a shared expert) is cut as a dense MLP is, and its partial
    outputs are summed once per layer, after the routing weights (the shared expert's gate)
    combine them."""
    r, n = shard.rank, shard.size
    if isinstance(m, SparseMoE):
        for expert in m.sharded_mlps():
            _shard_mlp(expert, r, n, cuts)
        m.reduce = shard.all_reduce
    else:
        _shard_mlp(m, r, n, cuts)
        _row_parallel(m.down, shard)


def _shard_mlp(m: MLP, r: int, n: int, cuts: Cuts) -> None:
    """Rank ``r`` of ``n``'s slice of a SwiGLU: its columns of gate and up, its rows of down
    (whose partial product the caller reduces)."""
    inter = m.inter
    i_per = inter // n
    gate_rows = slice(r * i_per, (r + 1) * i_per)
    up_rows = slice(inter + r * i_per, inter + (r + 1) * i_per)
    m.gate_up.weight = _keep(m.gate_up.weight, [gate_rows, up_rows], cuts=cuts)
    m.gate_up.bias = _keep(m.gate_up.bias, [gate_rows, up_rows], cuts=cuts)
    m.gate_up.out_features = 2 * i_per
    m.inter = i_per
    m.down.weight = _keep(m.down.weight, [gate_rows], dim=1, cuts=cuts)
    if r != 0:
        m.down.bias = None
