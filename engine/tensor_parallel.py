"""Tensor parallelism inside one engine replica: N ranks, one process each (their shard of the
model and KV: ``tp_shard.py``).

Rank 0 is the engine's own process and runs :class:`TPModelRunner`; ranks 1..N-1 are started
here (from a fork server) and loop on :func:`_worker_main`: each step rank 0 broadcasts the
scheduled batch packed into one int64 tensor, and every rank runs the same forward: eagerly, or
replaying its CUDA graphs of that decode batch, captured by every rank alike at start (or,
before a step that writes blocks forked choices share, the blocks to copy, and every rank copies
its heads of them). The process
group is built from a private ``TCPStore`` (no global ``torch.distributed`` state, so several
replicas can live in one process), and every collective waits at most ``tp_timeout_s``: a dead or
stuck rank makes rank 0 raise :class:`TensorParallelError` instead of hanging.

KV transfer: every rank registers its own KV with its own NIXL agent (GPU memory cannot be
registered by another process's agent), which runs in a *service* thread beside the rank's
forward loop (:class:`RankServices`; the service itself is ``kv_transfer/rank_agents.py``: the
engine only hands a picklable callable over). Rank 0's connector keeps all the bookkeeping and
orders each step's writes of every rank. Rank 0 learns that a layer's K/V are in *every* rank's
cache one layer late: when it writes layer L, each other rank has passed the all-reduce after
layer L-1 (so wrote L-1's K/V), not necessarily L's. So ``save_layer`` hears of layer L-1 then,
and ``end_step`` (after the last all-reduce) sends the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import multiprocessing as mp
import struct
import threading
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from kvrelay.engine.attention import forward_context
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.kv_cache import group_head_ranges, group_views
from kvrelay.engine.kv_connector import KVConnector, RankKV, ScheduledSeq
from kvrelay.engine.model_runner import ModelRunner, SampledTokens
from kvrelay.engine.step_inputs import StepSeq, TokenWindow
from kvrelay.engine.tp_shard import (
    TensorParallelError,
    TPShard,
    kv_head_range,
    make_groups,
    startup_timeout,
    validate_tp,
)

logger = logging.getLogger(__name__)

_OP_STOP, _OP_FORWARD, _OP_COPY, _OP_GRAPHED = 0, 1, 2, 3


# -- the step's inputs, packed -----------------------------------------------------------------
def pack_step(scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
    """``[count, layer groups (0: one table), then per sequence: computed, new, total, table
    length, new tokens, table, and under the hybrid KV layout each layer group's page table (of
    the table's length)]``."""
    groups = next((len(s.page_tables) for s, _ in scheduled if s.page_tables is not None), 0)
    out = [len(scheduled), groups]
    for seq, n in scheduled:
        c = seq.num_computed_tokens
        bt = seq.block_table
        out += [c, n, seq.num_tokens, len(bt)]
        out += seq.token_ids[c:c + n]
        out += bt
        for table in seq.page_tables or ():
            out += table
    return torch.tensor(out, dtype=torch.long)


def unpack_step(packed: torch.Tensor) -> list[ScheduledSeq]:
    v = packed.tolist()
    out: list[ScheduledSeq] = []
    groups = v[1]
    i = 2
    for _ in range(v[0]):
        c, n, total, nbt = v[i:i + 4]
        i += 4
        toks = v[i:i + n]
        i += n
        bt = v[i:i + nbt]
        i += nbt
        pts = None
        if groups:
            pts = [v[i + g * nbt:i + (g + 1) * nbt] for g in range(groups)]
            i += groups * nbt
        out.append(ScheduledSeq(StepSeq(c, total, TokenWindow(c, toks), bt, pts), n))  # type: ignore
    return out


def _serve(conn: Connection, runner: ModelRunner) -> None:
    """A rank's service thread: idle until rank 0 sends a service (a picklable callable) and its
    arguments, then runs ``fn(conn, runner, **kwargs)``: the connection is the service's."""
    try:
        fn, kwargs = conn.recv()
    except (EOFError, OSError):  # rank 0 is gone, or never needed one
        return
    try:
        fn(conn, runner, **kwargs)
    except Exception:
        logger.exception("tensor-parallel rank %d: service %s failed",
                         runner.shard.rank if runner.shard else -1, fn)
    finally:
        conn.close()


def _worker_main(config: EngineConfig, rank: int, size: int, port: int,
                 conn: Connection, service: Connection) -> None:
    timeout = datetime.timedelta(seconds=config.model.tp_timeout_s)
    startup = startup_timeout(config)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=startup)
    device = ModelRunner.device_for(config, rank)
    group, control = make_groups(store, rank, size, startup, device)
    shard = TPShard(rank, size, group, timeout, control, nccl=device.type == "cuda")
    runner = ModelRunner(config, shard=shard)
    runner.check_blocks(startup)
    threading.Thread(target=_serve, args=(service, runner), name=f"kvrelay-tp-rank{rank}-service",
                     daemon=True).start()
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
            if op == _OP_COPY:  # copy-on-write of blocks forked sequences share
                runner.copy_blocks([tuple(pair) for pair in packed.view(-1, 2).tolist()])
                continue
            if op == _OP_GRAPHED:  # rank 0 replays its decode graphs
                runner.follow_graphed(unpack_step(packed))
                continue
            inputs = runner.prepare(unpack_step(packed))
            with forward_context(inputs.meta):
                runner.model(inputs.input_ids.to(runner.device),
                             inputs.positions.to(runner.device))


# What the ranks' fork server imports before it forks them: this module (torch with it), and
# what a layer above registers with ``preload_in_ranks`` (the KV transfer: its UCX).
_RANK_PRELOAD = [__name__]


def preload_in_ranks(module: str) -> None:
    """Have the ranks' fork server import ``module`` too, once, before it forks them: for work
    every rank would otherwise repeat (takes effect where this process has not started its
    ranks' fork server yet)."""
    if module not in _RANK_PRELOAD:
        _RANK_PRELOAD.append(module)


def _rank_context() -> mp.context.BaseContext:
    """Ranks start from a fork server that has imported this module (torch with it) once: a
    spawned rank spends ~1.5-3 CPU s importing torch before it can join, and a process that
    starts several replicas (or a replica of many ranks) paid that for each rank. Each rank is
    still a fresh single-threaded fork, not a copy of this process's threads and caches."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_RANK_PRELOAD))
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
        services = [ctx.Pipe(duplex=True) for _ in range(1, size)]
        device = ModelRunner.device_for(config, 0)
        self.procs = [ctx.Process(target=_worker_main, name=f"kvrelay-tp-rank{r}", daemon=True,
                                  args=(config, r, size, self.store.port, pipes[r - 1][0],
                                        services[r - 1][1]))
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        for (recv, _), (_, theirs) in zip(pipes, services, strict=True):
            recv.close()
            theirs.close()
        self.conns = [send for _, send in pipes]
        self.services = RankServices([ours for ours, _ in services], self.procs)
        try:
            group, control = make_groups(self.store, 0, size, startup, device)
        except RuntimeError as e:
            self.close()
            raise self.error("joining the process group", e) from e
        self.shard = TPShard(0, size, group, self.timeout, control, nccl=device.type == "cuda")
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

    def send_step(self, scheduled: Seq[ScheduledSeq], graphed: bool = False) -> None:
        """The step every rank runs: eagerly, or (``graphed``) from the decode graphs'
        static buffers, padded as rank 0 pads it."""
        self._send(_OP_GRAPHED if graphed else _OP_FORWARD, pack_step(scheduled))

    def send_copies(self, copies: Seq[tuple[int, int]]) -> None:
        """Every rank copies KV blocks ``src -> dst`` of its own heads (copy-on-write)."""
        self._send(_OP_COPY, torch.tensor([b for pair in copies for b in pair],
                                          dtype=torch.long))

    def _send(self, op: int, packed: torch.Tensor) -> None:
        header = struct.pack("<qq", op, packed.numel())
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
        if hasattr(self, "services"):
            self.services.close()
        for p in self.procs:
            if not self.abandoned:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class RankServices:
    """Rank 0's line to the service thread of each of ranks 1..N-1: what runs there beside the
    forward loop (the KV transfer's per-rank NIXL agents, ``kv_transfer/rank_agents.py``). A
    service is a picklable callable ``fn(conn, runner, **kwargs)``; once started, the
    connections are its own."""

    def __init__(self, conns: list[Connection], procs: list[mp.process.BaseProcess]):
        self.conns = conns
        self.procs = procs
        self.started = False

    def start(self, fn: Callable[..., None], kwargs: Seq[dict[str, Any]]) -> list[Connection]:
        """Start ``fn`` on every rank 1..N-1 with its ``kwargs`` (rank r's at r - 1); the
        connections, in the same order."""
        if self.started:
            raise RuntimeError("a rank service runs already")
        if len(kwargs) != len(self.conns):
            raise ValueError(f"{len(kwargs)} sets of arguments for {len(self.conns)} ranks")
        self.started = True
        for c, kw in zip(self.conns, kwargs, strict=True):
            c.send((fn, kw))
        return self.conns

    def alive(self, rank: int) -> bool:
        return self.procs[rank - 1].exitcode is None

    def close(self) -> None:
        for c in self.conns:
            c.close()


def tp_model_config(config: EngineConfig) -> EngineConfig:
    """One torch thread per rank unless ``num_threads`` says otherwise."""
    mc = config.model
    if mc.tensor_parallel_size > 1 and mc.num_threads is None:
        return dataclasses.replace(config, model=dataclasses.replace(mc, num_threads=1))
    return config


class TPModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig):
        from kvrelay.engine.models.arch import load_model_config

        validate_tp(load_model_config(config.model.model)[1],
                    config.model.tensor_parallel_size)
        config = tp_model_config(config)
        self.ranks = Ranks(config)
        self._finalizer = weakref.finalize(self, self.ranks.close)
        try:
            super().__init__(config, shard=self.ranks.shard)
            self.check_blocks(startup_timeout(config))
            self.rank_kv = self._rank_kv()
        except ValueError:
            self.close()
            raise
        except RuntimeError as e:
            self.ranks.abandon()
            self.close()
            raise self.ranks.error("loading the model", e) from e
        logger.info("tensor parallel: %d ranks (pids %s), %d KV heads per rank",
                    self.ranks.size, self.ranks.pids, self.kv_spec.num_kv_heads)
        self._failed: TensorParallelError | None = None

    def _guarded(self, send: Callable[[], None], fn: Callable[[], Any]) -> Any:
        """``send()`` (what the other ranks run), then ``fn()`` (rank 0's part); a failure of
        either breaks the replica for good."""
        if self._failed is not None:
            raise self._failed
        try:
            send()
            return fn()
        except (RuntimeError, OSError) as e:
            if isinstance(e, TensorParallelError):
                raise
            self._failed = self.ranks.error("running a step", e)
            self.ranks.abandon()
            self.close()
            raise self._failed from e

    def _rank_kv(self) -> RankKV:
        """The KV transport's ranks: every rank's KV head groups, rank after rank; rank 0
        holds its own, the others theirs (reached through ``ranks.services``)."""
        size, groups = self.ranks.size, self.kv_groups
        ranges = [r for rank in range(size)
                  for r in group_head_ranges(kv_head_range(self.arch, rank, size), groups)]
        own = group_views(self.kv, kv_head_range(self.arch, 0, size))
        return RankKV([t for t, _ in own[1:]], tuple(ranges), self.arch.num_kv_heads,
                      slots=tuple(range(groups)), services=self.ranks.services)

    def run(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None = None) \
            -> SampledTokens:
        graphed = self.graphed(scheduled, connector)  # decided once, for every rank
        return self._guarded(functools.partial(self.ranks.send_step, scheduled, graphed),
                             functools.partial(self.run_step, scheduled, connector, graphed))

    def _kv_written_hook(self, connector: KVConnector) -> Callable[[int], None]:
        def lagged(layer: int) -> None:  # see the module docstring
            if layer > 0:
                connector.save_layer(layer - 1)

        return lagged

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy-on-write of the blocks a decode worker's forked choices share (n > 1), on
        every rank: each holds its own heads of every block."""
        self._guarded(functools.partial(self.ranks.send_copies, copies),
                      functools.partial(super().copy_blocks, copies))

    def logits_for(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        return self._guarded(functools.partial(self.ranks.send_step, scheduled),
                             functools.partial(super().logits_for, scheduled))

    @property
    def worker_pids(self) -> list[int | None]:
        """Process ids of ranks 1..N-1."""
        return self.ranks.pids

    def close(self) -> None:
        """Stop the other ranks (also at garbage collection and interpreter exit)."""
        self._finalizer()
