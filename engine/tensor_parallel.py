"""Tensor parallelism inside one engine replica: N ranks, one process each.

Megatron-style: q/k/v (by heads) and gate/up are column-parallel, o_proj and down_proj
row-parallel followed by an all-reduce; embedding and LM head are replicated and only rank 0
computes logits and samples. When the model has fewer KV heads than ranks, each rank keeps a
copy of the one KV head its query heads read. Every rank owns the KV cache of its heads with the
same block ids, so one scheduler (rank 0's) drives them all.

Rank 0 is the engine's own process; ranks 1..N-1 are started here (from a fork server) and loop on
:func:`_worker_main`: each step rank 0 broadcasts the scheduled batch packed into one int64
tensor, and every rank runs the same forward. The process group is built from a private
``TCPStore`` (no global ``torch.distributed`` state, so several replicas can live in one
process), and every collective waits at most ``tp_timeout_s``: a dead or stuck rank makes rank 0
raise :class:`TensorParallelError` instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import secrets
import struct
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import nn

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.llama import Linear, LlamaForCausalLM

logger = logging.getLogger(__name__)

_OP_STOP, _OP_FORWARD = 0, 1


STARTUP_TIMEOUT_S = 300.0


class TensorParallelError(RuntimeError):
    """A rank of this replica died, hung past the timeout, or failed its step."""


@dataclass(frozen=True)
class TPShard:
    """This process's place in a replica, and the group its collectives run on."""

    rank: int
    size: int
    group: dist.ProcessGroup
    timeout: datetime.timedelta
    # CPU only: each rank's KV tensor lives in the shared-memory file ``kv_shm_path(kv_shm, r)``
    # so rank 0's KV connector can register and move every rank's KV ("": private memory).
    kv_shm: str = ""

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   timeout: datetime.timedelta | None = None) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timeout or self.timeout
        self.group.allreduce([t], opts).wait(opts.timeout)

    def broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self.group.broadcast([t], opts).wait(self.timeout)


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
    if arch.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size "
                         f"{arch.intermediate_size}")


def local_kv_heads(arch: ModelArch, size: int) -> int:
    """KV heads one rank holds: a share, or one replicated head when there are fewer than
    ranks."""
    return max(1, arch.num_kv_heads // size)


def kv_head_range(arch: ModelArch, rank: int, size: int) -> range:
    """Which of the model's KV heads rank ``rank`` holds."""
    n = local_kv_heads(arch, size)
    first = rank * arch.num_kv_heads // size if arch.num_kv_heads < size else rank * n
    return range(first, first + n)


def kv_shm_path(prefix: str, rank: int) -> str:
    return f"/dev/shm/{prefix}-rank{rank}"


def shared_kv_cache(prefix: str, rank: int, shape: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s KV tensor in a shared-memory file (created zero-filled, or mapped when
    it exists): the same bytes in the rank's process and in rank 0's."""
    numel = 1
    for d in shape:
        numel *= d
    path = kv_shm_path(prefix, rank)
    need = numel * torch.empty((), dtype=dtype).element_size()
    st = os.statvfs(os.path.dirname(path))
    if not os.path.exists(path) and st.f_bavail * st.f_frsize < need:
        # Past a tmpfs's size the first touch of a page kills the process (SIGBUS): refuse.
        raise ValueError(f"tensor-parallel rank {rank} needs {need / 2**20:.0f} MiB of KV cache "
                         f"in {os.path.dirname(path)}, which has "
                         f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free: lower "
                         f"--kv-cache-memory or give /dev/shm more room (k8s: the dshm volume's "
                         f"sizeLimit)")
    t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    return t.view(shape)


def unlink_kv_shm(prefix: str, size: int) -> None:
    """Remove the files (the mappings stay valid until every process unmaps them)."""
    for r in range(size):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kv_shm_path(prefix, r))


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


def _keep(w: torch.Tensor | None, rows: list[slice], dim: int = 0) -> nn.Parameter | None:
    if w is None:
        return None
    parts = [w.narrow(dim, s.start, s.stop - s.start) for s in rows]
    return nn.Parameter(torch.cat(parts, dim).contiguous(), requires_grad=False)


def shard_model(model: LlamaForCausalLM, shard: TPShard) -> None:
    """Cut a loaded (dense, unpacked) model down to ``shard.rank``'s part, in place: before
    packing, so the kernels pack only the shard."""
    arch, r, n = model.arch, shard.rank, shard.size
    hd, inter = arch.head_dim, arch.intermediate_size
    heads = arch.num_heads // n
    kv = kv_head_range(arch, r, n)
    q_size, kv_size = arch.num_heads * hd, arch.num_kv_heads * hd
    q_rows = slice(r * heads * hd, (r + 1) * heads * hd)
    k_rows = slice(q_size + kv.start * hd, q_size + kv.stop * hd)
    v_rows = slice(q_size + kv_size + kv.start * hd, q_size + kv_size + kv.stop * hd)
    i_per = inter // n
    gate_rows = slice(r * i_per, (r + 1) * i_per)
    up_rows = slice(inter + r * i_per, inter + (r + 1) * i_per)
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        a.qkv.weight = _keep(a.qkv.weight, [q_rows, k_rows, v_rows])
        a.qkv.bias = _keep(a.qkv.bias, [q_rows, k_rows, v_rows])
        a.num_heads, a.num_kv_heads = heads, len(kv)
        a.q_size, a.kv_size = heads * hd, len(kv) * hd
        a.qkv.out_features = a.q_size + 2 * a.kv_size
        a.o.weight = _keep(a.o.weight, [q_rows], dim=1)
        if r != 0:
            a.o.bias = None
        _row_parallel(a.o, shard)
        m.gate_up.weight = _keep(m.gate_up.weight, [gate_rows, up_rows])
        m.gate_up.bias = _keep(m.gate_up.bias, [gate_rows, up_rows])
        m.gate_up.out_features = 2 * i_per
        m.inter = i_per
        m.down.weight = _keep(m.down.weight, [gate_rows], dim=1)
        if r != 0:
            m.down.bias = None
        _row_parallel(m.down, shard)


# -- the step's inputs, packed -----------------------------------------------------------------
class _Window:
    """The tokens ``[start, start + len)`` of a sequence, sliceable by absolute position."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start:s.stop - self.start]


@dataclass
class _RemoteSeq:
    """What :meth:`ModelRunner.prepare` reads of a sequence, on a rank that has no scheduler."""

    num_computed_tokens: int
    num_tokens: int
    token_ids: _Window
    block_table: list[int]


def pack_step(scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
    """``[count, then per sequence: computed, new, total, table length, new tokens, table]``."""
    out = [len(scheduled)]
    for seq, n in scheduled:
        c = seq.num_computed_tokens
        bt = seq.block_table
        out += [c, n, seq.num_tokens, len(bt)]
        out += seq.token_ids[c:c + n]
        out += bt
    return torch.tensor(out, dtype=torch.long)


def unpack_step(packed: torch.Tensor) -> list[ScheduledSeq]:
    v = packed.tolist()
    out: list[ScheduledSeq] = []
    i = 1
    for _ in range(v[0]):
        c, n, total, nbt = v[i:i + 4]
        i += 4
        toks = v[i:i + n]
        i += n
        bt = v[i:i + nbt]
        i += nbt
        out.append(ScheduledSeq(_RemoteSeq(c, total, _Window(c, toks), bt), n))  # type: ignore
    return out


# -- process group -----------------------------------------------------------------------------
def _make_group(store: dist.Store, rank: int, size: int,
                timeout: datetime.timedelta, cuda: bool) -> dist.ProcessGroup:
    if cuda:
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _worker_main(config: EngineConfig, rank: int, size: int, port: int,
                 conn: Connection, kv_shm: str = "") -> None:
    from kvrelay.engine.attention import forward_context
    from kvrelay.engine.model_runner import ModelRunner

    timeout = datetime.timedelta(seconds=config.model.tp_timeout_s)
    startup = startup_timeout(config)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=startup)
    cuda = ModelRunner.device_for(config, rank).type == "cuda"
    shard = TPShard(rank, size, _make_group(store, rank, size, startup, cuda), timeout,
                    "" if cuda else kv_shm)
    runner = ModelRunner(config, shard=shard)
    runner.check_blocks(startup)
    with torch.inference_mode():
        while True:
            try:  # idle for as long as it takes: the step header comes through a pipe
                op, length = struct.unpack("<qq", conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                return
            if op == _OP_STOP:
                return
            packed = torch.empty(length, dtype=torch.long)
            shard.broadcast(packed)
            inputs = runner.prepare(unpack_step(packed))
            with forward_context(inputs.meta):
                runner.model(inputs.input_ids.to(runner.device),
                             inputs.positions.to(runner.device))


def _rank_context() -> mp.context.BaseContext:
    """Ranks start from a fork server that has imported this module (torch with it) once: a
    spawned rank spends ~1.5-3 CPU s importing torch before it can join, and a process that
    starts several replicas (or a replica of many ranks) paid that for each rank. Each rank is
    still a fresh single-threaded fork, not a copy of this process's threads and caches."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class Ranks:
    """Rank 0's handle on the replica's other ranks: starts them, feeds them, stops them."""

    def __init__(self, config: EngineConfig):
        size = config.model.tensor_parallel_size
        self.size = size
        self.abandoned = False  # a collective failed: the ranks are killed, not asked to stop
        self.timeout = datetime.timedelta(seconds=config.model.tp_timeout_s)
        startup = startup_timeout(config)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=startup,
                                   wait_for_workers=False)
        ctx = _rank_context()
        # The step header (op, payload length) goes through a pipe, so an idle replica waits
        # without a collective that would time out; the payload goes by broadcast.
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        from kvrelay.engine.model_runner import ModelRunner

        cuda = ModelRunner.device_for(config, 0).type == "cuda"
        self.kv_shm = "" if cuda else f"kvrelay-kv-{os.getpid()}-{secrets.token_hex(6)}"
        self.procs = [ctx.Process(target=_worker_main, name=f"kvrelay-tp-rank{r}", daemon=True,
                                  args=(config, r, size, self.store.port, pipes[r - 1][0],
                                        self.kv_shm))
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        for recv, _ in pipes:
            recv.close()
        self.conns = [send for _, send in pipes]
        try:
            group = _make_group(self.store, 0, size, startup, cuda)
        except RuntimeError as e:
            self.close()
            raise self.error("joining the process group", e) from e
        self.shard = TPShard(0, size, group, self.timeout, self.kv_shm)
        self.closed = False

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def error(self, doing: str, cause: BaseException) -> TensorParallelError:
        dead = [f"rank {r} (exit code {p.exitcode})"
                for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
        who = ", ".join(dead) if dead else "no rank exited: one is stuck or slow"
        return TensorParallelError(
            f"tensor-parallel replica of {self.size} ranks failed while {doing} (timeout "
            f"{self.timeout.total_seconds():g}s; {who}): {cause}")

    def send_step(self, scheduled: Seq[ScheduledSeq]) -> None:
        packed = pack_step(scheduled)
        header = struct.pack("<qq", _OP_FORWARD, packed.numel())
        for c in self.conns:
            c.send_bytes(header)
        self.shard.broadcast(packed)

    def abandon(self) -> None:
        """After a failed collective: stop without telling the ranks (the group is broken);
        ``close`` then kills them at once, as one may be stuck and never exit by itself."""
        self.closed = self.abandoned = True

    def close(self) -> None:
        if getattr(self, "closed", True) is False:
            self.closed = True
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.send_bytes(struct.pack("<qq", _OP_STOP, 0))
        for c in getattr(self, "conns", []):
            c.close()
        if getattr(self, "kv_shm", ""):
            unlink_kv_shm(self.kv_shm, self.size)
        for p in self.procs:
            if not self.abandoned:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def tp_model_config(config: EngineConfig) -> EngineConfig:
    """One torch thread per rank unless ``num_threads`` says otherwise."""
    mc = config.model
    if mc.tensor_parallel_size > 1 and mc.num_threads is None:
        return dataclasses.replace(config, model=dataclasses.replace(mc, num_threads=1))
    return config
