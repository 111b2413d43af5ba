"""One NIXL agent per tensor-parallel rank (``kv_transfer/rank_agents.py``), with a real second
rank: a spawned process runs the rank's service thread (``tensor_parallel._serve``, as a TP
rank does) over its own KV tensor, and rank 0 (this process) drives it through
``RankedTransport``. The receiver is an engine of two transport ranks in one agent.

- Each rank's heads arrive from its own process: the receiving blocks hold exactly what each
  sending rank held, and the write's bytes are both ranks'.
- The write is done only when the last rank is: with rank 1's report held back, the handle stays
  open after rank 0's part landed (so no notification can go out before rank 1's bytes).
- A rank whose part fails, or whose process is killed mid-write, fails the write, naming the
  rank, without waiting for the write deadline; a rank whose agent cannot start keeps rank 0's
  transport from starting.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.tensor_parallel import RankServices, _serve
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.rank_agents import RankedTransport

LAYERS, HEADS, HEAD_DIM, BLOCK, NB = 2, 4, 8, 4, 10
SPEC = KVCacheSpec(LAYERS, HEADS // 2, HEAD_DIM, BLOCK, NB)
LAYOUT = KVLayout.from_spec(SPEC, "rank-agents-model", head_ranges=((0, 2), (2, 4)),
                            model_kv_heads=HEADS)
LOCAL, REMOTE = [1, 2, 5], [7, 3, 4]


def _full() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.rand(LAYERS, 2, NB, BLOCK, HEADS, HEAD_DIM, generator=g)


class _HeldBack:
    """Rank 1's connection with its write reports held back for ``delay`` seconds."""

    def __init__(self, conn: Any, delay: float):
        self.conn, self.delay = conn, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def send(self, msg: Any) -> None:
        if msg[0] == "done":
            time.sleep(self.delay)
        self.conn.send(msg)


def _rank1(conn: Any, fault: str) -> None:
    """Tensor-parallel rank 1: its KV holds heads 2..3 of ``_full``; its service thread runs
    what rank 0 sends, as in a TP replica."""
    torch.set_num_threads(1)
    kv = _full()[..., 2:4, :].contiguous()
    if fault == "fail":
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise KVTransferError("injected: rank 1 cannot write", retriable=True)

        NixlTransport.write = refuse  # type: ignore[method-assign]
    if fault == "no-agent":  # its agent cannot come up (as without NIXL's UCX plugin)
        def no_agent(*args: Any, **kwargs: Any) -> None:
            raise KVTransferError("injected: no UCX backend", retriable=False)

        NixlTransport.__init__ = no_agent  # type: ignore[method-assign]
    if fault in ("slow", "kill"):
        conn = _HeldBack(conn, 2.0 if fault == "slow" else 60.0)
    _serve(conn, SimpleNamespace(kv=kv, shard=None))


def _rank_context() -> mp.context.BaseContext:
    """Rank processes as a TP replica starts them: forks of a server that imported torch, NIXL
    and this module once (a spawned rank imports them again each time, ~4 s)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nixl._api", __name__])
    return ctx


def _write(fault: str) -> tuple[RankedTransport, NixlTransport, list[torch.Tensor], Any,
                                mp.process.BaseProcess]:
    ctx = _rank_context()
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_rank1, args=(theirs, fault), daemon=True)
    proc.start()
    theirs.close()
    tag = uuid.uuid4().hex[:6]
    rank0 = NixlTransport(f"ra-send-{tag}", _full()[..., 0:2, :].contiguous(), LAYOUT,
                         slots=(0,), write_timeout_s=30.0)
    sender = RankedTransport(rank0, RankServices([ours], [proc]))
    dst = [torch.zeros(SPEC.shape), torch.zeros(SPEC.shape)]
    receiver = NixlTransport(f"ra-recv-{tag}", dst[0], LAYOUT, rank_kvs=dst[1:])
    info = sender.peer_info()
    assert [a.name for a in info.rank_agents] == [f"ra-send-{tag}.rank1"]
    assert info.agent_of(1)[0] == f"ra-send-{tag}.rank1"
    sender.add_peer(receiver.peer_info())
    h = sender.write(receiver.name, None, LOCAL, REMOTE)
    return sender, receiver, dst, h, proc


def _poll(sender: RankedTransport, receiver: NixlTransport, h: Any,
          on_tick: Any = None) -> None:
    deadline = time.monotonic() + 60
    while not sender.poll(h):
        receiver.progress()
        if on_tick is not None:
            on_tick()
        assert time.monotonic() < deadline
        time.sleep(0.002)


@pytest.mark.parametrize("fault", ["none", "slow"])
def test_each_rank_writes_its_heads_and_the_write_ends_with_the_last(fault: str) -> None:
    sender, receiver, dst, h, proc = _write(fault)
    seen_open_after_rank0 = []
    try:
        _poll(sender, receiver, h,
              lambda: seen_open_after_rank0.append(h.local.done and not h.done))
        full = _full()
        for slot, (a, b) in enumerate(LAYOUT.head_ranges):
            assert torch.equal(dst[slot][:, :, REMOTE], full[:, :, LOCAL, :, a:b, :])
            assert not dst[slot][:, :, [i for i in range(NB) if i not in REMOTE]].any()
        assert h.nbytes == 2 * len(LOCAL) * LAYERS * 2 * SPEC.block_bytes
        if fault == "slow":  # rank 0's part had landed while rank 1's report was held back
            assert any(seen_open_after_rank0)
    finally:
        sender.close()
        receiver.close()
        proc.join(10)
    assert proc.exitcode == 0  # ``close`` ends the rank's service


def test_a_rank_whose_part_fails_fails_the_write() -> None:
    sender, receiver, _, h, proc = _write("fail")
    try:
        with pytest.raises(KVTransferError, match=r"rank 1's part.*injected"):
            _poll(sender, receiver, h)
    finally:
        sender.close()
        receiver.close()
        proc.join(10)


def test_a_rank_whose_agent_cannot_start_stops_the_transport_from_starting() -> None:
    """The engine must not start half-connected: rank 0's transport refuses to come up, naming
    the rank and why."""
    ctx = _rank_context()
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_rank1, args=(theirs, "no-agent"), daemon=True)
    proc.start()
    theirs.close()
    rank0 = NixlTransport(f"ra-noagent-{uuid.uuid4().hex[:6]}", _full()[..., 0:2, :].contiguous(),
                          LAYOUT, slots=(0,))
    try:
        with pytest.raises(KVTransferError, match="rank 1 could not start its NIXL agent: "
                                                  "KVTransferError: injected: no UCX backend"):
            RankedTransport(rank0, RankServices([ours], [proc]))
    finally:
        rank0.close()
        proc.join(10)
    assert proc.exitcode == 0  # its service ended; nothing was left running


def test_a_rank_killed_mid_write_fails_it_at_once() -> None:
    sender, receiver, _, h, proc = _write("kill")
    try:
        with pytest.raises(KVTransferError, match="rank 1's KV agent is gone"):
            _poll(sender, receiver, h, lambda: h.local.done and proc.kill())
        # The write deadline (30 s) was not what ended it: the message says the rank is gone.
    finally:
        sender.close()
        receiver.close()
        proc.join(10)
