"""One NIXL agent per tensor-parallel rank: each rank writes the KV heads it holds from its own
process, and rank 0 orders and collects the writes.

Why per rank: GPU memory can be registered (for RDMA, or exported over CUDA IPC) only by the
process that allocated it, so rank 0's agent cannot move another rank's VRAM; vLLM's NIXL
connector runs one agent per rank for the same reason. The CPU path runs the same design (UCX
over shared memory between the processes), so it is what the tests exercise on every run.

- **Ranks 1..N-1** run :func:`serve` in their service thread (``engine/tensor_parallel.py``
  hands it over; the engine knows nothing of NIXL): a ``NixlTransport`` over the rank's own KV
  (its transport ranks: the rank, or its KV head groups), answering rank 0's orders on the
  service connection.
- **Rank 0** uses :class:`RankedTransport`, which has ``NixlTransport``'s calls: its own agent
  plus the ranks', reached through their connections. The connector, its sender thread, the
  trackers and fences above it are unchanged: a write is posted by rank 0 and ordered from
  every other rank in the same call (the lag that makes that safe: ``tensor_parallel.py``), and
  its handle is done only when every rank has reported its part done, so the one notification
  (rank 0's, after the handle is done) never precedes the last rank's bytes. A rank that fails
  its part, dies, or misses the write deadline fails the handle, and with it the requests.
- The handshake (``PeerInfo.rank_agents``) lists every rank's agent, device and KV addresses;
  every rank loads the agents of the peer's ranks its heads go to.

Receiving ranks have nothing to do but let UCX answer connection handshakes: while rank 0 polls
for notifications (it expects KV) it asks its ranks to keep their workers progressing too.

Prefix pulls go the same way: each rank reads its heads from the peer's ranks that hold them,
and the read is done when every rank's part is.

The orders (pickled tuples on the connection), rank 0 -> rank r: ``add_peer``, ``evict``,
``write``, ``read``, ``cancel``, ``progress``, ``close``; rank r -> rank 0: ``up`` (once), ``ack``
(of ``add_peer``), ``done``/``failed`` (of ``write`` and ``read``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvrelay.engine.kv_cache import kv_groups_of
from kvrelay.kv_transfer.cuda_sync import bind_thread_to
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import PeerInfo, RankAgent
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.transport_types import Notification, WriteHandle

logger = logging.getLogger(__name__)

# While rank 0 expects KV, how long each of its polls keeps the ranks' workers progressing, and
# how often it asks again: a rank goes quiet by itself a moment after rank 0 stops polling.
_PROGRESS_S, _PROGRESS_EVERY_S = 0.25, 0.05
_MIN_WAIT_S, _MAX_WAIT_S = 5e-5, 2e-3  # a rank's polls of its writes in flight (backing off)


# -- the rank's side --------------------------------------------------------------------------
def serve(conn: Connection, runner: Any, *, agent_name: str, layout: dict[str, Any],
          slots: Sequence[int], write_timeout_s: float, staging_bytes: int) -> None:
    """Rank r's agent: register the rank's KV, say ``up``, then carry out rank 0's orders until
    ``close`` or until rank 0 is gone. Runs in the rank's service thread."""
    kv = runner.kv
    bind_thread_to(kv.device if kv.is_cuda else None)
    groups = kv_groups_of(kv)
    try:
        transport = NixlTransport(agent_name, groups[0], KVLayout.from_dict(layout),
                                  rank_kvs=groups[1:], slots=slots,
                                  write_timeout_s=write_timeout_s, staging_bytes=staging_bytes)
    except Exception as e:  # rank 0 raises it: the engine does not start half-connected
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        conn.send(("up", RankAgent(agent_name, transport.metadata, max(kv.get_device(), 0),
                                   tuple(slots)), transport.slot_addresses))
        _RankLoop(conn, transport).run()
    finally:
        transport.close()


class _RankLoop:
    def __init__(self, conn: Connection, transport: NixlTransport):
        self.conn, self.transport = conn, transport
        self.inflight: dict[int, WriteHandle] = {}
        self.progress_until = 0.0

    def run(self) -> None:
        wait = _MIN_WAIT_S
        while True:
            if self.inflight:
                timeout: float | None = wait
            elif time.monotonic() < self.progress_until:
                timeout = 1e-3
            else:
                timeout = None  # idle: sleep until rank 0 says something
            try:
                got = self.conn.poll(timeout)
                while got:
                    if not self.handle(self.conn.recv()):
                        return
                    got = self.conn.poll(0)
            except (EOFError, OSError):  # rank 0 is gone
                return
            finished = self.poll_writes()
            if not self.inflight and time.monotonic() < self.progress_until:
                self.transport.progress()
            wait = _MIN_WAIT_S if finished else min(wait * 2, _MAX_WAIT_S)

    def handle(self, msg: tuple[Any, ...]) -> bool:
        op = msg[0]
        if op == "write":
            _, oid, peer, layers, local, remote, incarnation = msg
            self.start(oid, lambda: self.transport.write(peer, layers, local, remote,
                                                         incarnation=incarnation))
        elif op == "read":
            _, oid, peer, remote, local, incarnation, timeout_s, layers = msg
            self.start(oid, lambda: self.transport.read(peer, remote, local,
                                                        incarnation=incarnation,
                                                        timeout_s=timeout_s, layers=layers))
        elif op == "cancel":
            h = self.inflight.pop(msg[1], None)
            if h is not None:
                self.transport.cancel(h)
        elif op == "add_peer":
            _, seq, info = msg
            try:
                self.transport.add_peer(PeerInfo.from_bytes(info))
                self.conn.send(("ack", seq, None, False))
            except (KVTransferError, ValueError) as e:
                self.conn.send(("ack", seq, str(e), getattr(e, "retriable", False)))
        elif op == "evict":
            self.transport.evict_peer(msg[1])
        elif op == "progress":
            self.progress_until = time.monotonic() + msg[1]
        elif op == "close":
            return False
        return True

    def start(self, oid: int, post: Callable[[], WriteHandle]) -> None:
        """Post the transfer rank 0 ordered as ``oid``: its outcome goes back now, or once
        ``poll_writes`` sees it end."""
        try:
            h = post()
        except KVTransferError as e:
            self.conn.send(("failed", oid, str(e), e.retriable))
            return
        if h.done:
            self.conn.send(("done", oid, h.nbytes))
        else:
            self.inflight[oid] = h

    def poll_writes(self) -> bool:
        finished = False
        for oid, h in list(self.inflight.items()):
            try:
                done = self.transport.poll(h)
            except KVTransferError as e:
                del self.inflight[oid]
                self.conn.send(("failed", oid, str(e), e.retriable))
                finished = True
                continue
            if done:
                del self.inflight[oid]
                self.conn.send(("done", oid, h.nbytes))
                finished = True
        return finished


# -- rank 0's side ----------------------------------------------------------------------------
class RankedHandle(WriteHandle):
    """A write of every rank: rank 0's own handle, and the order the other ranks carry out."""

    __slots__ = ("local", "order")

    def __init__(self, local: WriteHandle, order: int, deadline: float):
        super().__init__(local.peer, local.nbytes, [], deadline, op=local.op)
        self.done = False
        self.local, self.order = local, order


class RankedTransport:
    """Rank 0's transport under tensor parallelism: ``local`` (its own agent) and ranks
    1..N-1's agents, started through ``services`` (``tensor_parallel.RankServices``). It
    answers the calls of ``NixlTransport`` the connector makes."""

    def __init__(self, local: NixlTransport, services: Any, *, staging_bytes: int = 64 << 20,
                 start_timeout_s: float = 60.0) -> None:
        self.local = local
        self.name = local.name
        self.layout = local.layout
        self.write_timeout_s = local.write_timeout_s
        self.incarnation = local.incarnation
        self._services = services
        self._io = threading.Lock()  # sending on and reading from the connections
        self._orders = itertools.count(1)
        self._open: dict[int, dict[int, tuple[Any, ...]]] = {}  # order -> rank -> its answer
        self._acks: dict[int, dict[int, tuple[Any, ...]]] = {}
        self._dead: dict[int, str] = {}  # rank -> why its connection is gone
        self._progress_sent = 0.0
        self._closed = False
        per_rank = len(local.slots)
        size = self.layout.tp_size // per_rank
        self._conns: list[Connection] = services.start(serve, [
            {"agent_name": f"{local.name}.rank{r}", "layout": self.layout.to_dict(),
             "slots": tuple(range(r * per_rank, (r + 1) * per_rank)),
             "write_timeout_s": local.write_timeout_s, "staging_bytes": staging_bytes}
            for r in range(1, size)])
        self._agents: list[tuple[RankAgent, dict[int, int]]] = []
        for r, conn in enumerate(self._conns, 1):
            if not conn.poll(start_timeout_s):
                raise KVTransferError(f"tensor-parallel rank {r} did not start its NIXL agent "
                                      f"in {start_timeout_s:g} s", retriable=False)
            msg = conn.recv()
            if msg[0] != "up":
                raise KVTransferError(f"tensor-parallel rank {r} could not start its NIXL agent: "
                                      f"{msg[1]}", retriable=False)
            self._agents.append((msg[1], msg[2]))
        logger.info("KV transfer: %d rank agents beside %s (%s)", len(self._agents), self.name,
                    ", ".join(a.name for a, _ in self._agents))

    # -- identity and peers --------------------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        return self.local.peer_info(self._agents)

    def add_peer(self, info: PeerInfo) -> bool:
        """Add ``info`` on rank 0 and every rank (each loads the agents its heads go to); a
        rank that refuses undoes it on rank 0 too, so no request is planned half-connected."""
        if not self.local.add_peer(info):
            return False
        data = info.to_bytes()
        with self._io:
            seq = next(self._orders)
            self._acks[seq] = {}
            self._send_all(("add_peer", seq, data))
        try:
            answers = self._await_acks(seq, time.monotonic() + self.write_timeout_s)
        except KVTransferError:
            self.evict_peer(info.agent_name)
            raise
        bad = [(r, a) for r, a in answers.items() if a[2] is not None]
        if bad:
            self.evict_peer(info.agent_name)
            r, a = bad[0]
            raise KVTransferError(f"tensor-parallel rank {r} could not add KV peer "
                                  f"{info.agent_name}: {a[2]}", retriable=a[3],
                                  peer=info.agent_name)
        return True

    def _await_acks(self, seq: int, deadline: float) -> dict[int, tuple[Any, ...]]:
        want = len(self._conns)
        while True:
            with self._io:
                self._drain()
                got = self._acks[seq]
                if len(got) == want:
                    return self._acks.pop(seq)
                gone = [r for r in range(1, want + 1) if r in self._dead and r not in got]
            if gone:
                self._acks.pop(seq, None)
                raise self._rank_gone(gone[0])
            if time.monotonic() >= deadline:
                self._acks.pop(seq, None)
                raise KVTransferError("tensor-parallel ranks did not answer in time",
                                      retriable=True)
            time.sleep(1e-3)

    def has_peer(self, name: str) -> bool:
        return self.local.has_peer(name)

    def peer_incarnation(self, name: str) -> str | None:
        return self.local.peer_incarnation(name)

    def evict_peer(self, name: str) -> bool:
        known = self.local.evict_peer(name)
        with self._io:
            self._send_all(("evict", name))
        return known

    # -- writes ----------------------------------------------------------------------------------
    def write(self, peer: str, layers: int | Sequence[int] | None,
              local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
              incarnation: str | None = None) -> WriteHandle:
        """Post rank 0's part and order every other rank's; the handle is done when all are."""
        own = self.local.write(peer, layers, local_block_ids, remote_block_ids,
                               incarnation=incarnation)
        if isinstance(layers, int):
            layers = (layers,)
        order = ("write", 0, peer, None if layers is None else tuple(layers),
                 list(local_block_ids), list(remote_block_ids), incarnation)
        with self._io:
            oid = next(self._orders)
            self._open[oid] = {}
            self._send_all((order[0], oid, *order[2:]))
        return RankedHandle(own, oid, own.deadline)

    def poll(self, handle: WriteHandle) -> bool:
        if handle.done:
            return True
        if not isinstance(handle, RankedHandle):
            return self.local.poll(handle)
        try:
            own_done = self.local.poll(handle.local)
        except KVTransferError:
            self._forget(handle)
            raise
        with self._io:
            self._drain()
            answers = self._open.get(handle.order, {})
            failed = next(((r, a) for r, a in answers.items() if a[0] == "failed"), None)
            gone = [r for r in range(1, len(self._conns) + 1)
                    if r in self._dead and r not in answers]
        if failed is not None:
            self._forget(handle)
            r, a = failed
            verb = "read from" if handle.op == "read" else "write to"
            raise KVTransferError(f"tensor-parallel rank {r}'s part of a {verb} "
                                  f"{handle.peer} failed: {a[2]}", retriable=a[3],
                                  peer=handle.peer)
        if gone:
            self._forget(handle)
            raise self._rank_gone(gone[0], handle.peer)
        if own_done and len(answers) == len(self._conns):
            with self._io:
                self._open.pop(handle.order, None)
            handle.nbytes = handle.local.nbytes + sum(a[2] for a in answers.values())
            handle.done = True
            return True
        if time.monotonic() >= handle.deadline:
            slow = [r for r in range(1, len(self._conns) + 1) if r not in answers]
            self._forget(handle)
            raise KVTransferError(
                f"a {handle.op} of {handle.peer} did not complete in "
                f"{handle.deadline - handle.posted_at:.3g} s (tensor-parallel ranks "
                f"{slow or [0]} not done)", retriable=True, peer=handle.peer)
        return False

    def wait(self, handle: WriteHandle, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll(handle):
            if deadline is not None and time.monotonic() >= deadline:
                self.cancel(handle)
                raise KVTransferError(f"a {handle.op} of {handle.peer} not done in {timeout:g} s",
                                      retriable=True, peer=handle.peer)
            time.sleep(1e-4)

    def cancel(self, handle: WriteHandle) -> None:
        if isinstance(handle, RankedHandle):
            self._forget(handle)
        else:
            self.local.cancel(handle)

    def _forget(self, handle: RankedHandle) -> None:
        """Stop waiting for ``handle``: rank 0's part released, the ranks told to let go of
        theirs (a late answer is dropped)."""
        self.local.cancel(handle.local)
        handle.done = True
        with self._io:
            if self._open.pop(handle.order, None) is not None:
                self._send_all(("cancel", handle.order))

    def read(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             *, incarnation: str | None = None, timeout_s: float | None = None,
             layers: Sequence[int] | None = None) -> WriteHandle:
        """A prefix pull: rank 0 reads its heads and orders every other rank to read its own;
        the handle is done when all have."""
        own = self.local.read(peer, remote_block_ids, local_block_ids, incarnation=incarnation,
                              timeout_s=timeout_s, layers=layers)
        with self._io:
            oid = next(self._orders)
            self._open[oid] = {}
            self._send_all(("read", oid, peer, list(remote_block_ids), list(local_block_ids),
                            incarnation, timeout_s, None if layers is None else list(layers)))
        return RankedHandle(own, oid, own.deadline)

    # -- notifications and progress --------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes, *, incarnation: str | None = None) -> None:
        self.local.send_notif(peer, msg, incarnation=incarnation)

    def progress(self) -> None:
        self.local.progress()
        self._keep_ranks_progressing()

    def get_notifs(self) -> list[Notification]:
        self._keep_ranks_progressing()
        return self.local.get_notifs()

    def _keep_ranks_progressing(self) -> None:
        """Rank 0 is expecting KV (or lingering after a notification): the peer's ranks may be
        connecting to ours, whose workers must answer."""
        now = time.monotonic()
        if now - self._progress_sent < _PROGRESS_EVERY_S:
            return
        self._progress_sent = now
        with self._io:
            self._send_all(("progress", _PROGRESS_S))

    # -- the connections -------------------------------------------------------------------------
    def _send_all(self, msg: tuple[Any, ...]) -> None:
        """Under ``_io``. A rank whose connection broke is marked dead (its orders fail)."""
        for r, conn in enumerate(self._conns, 1):
            if r in self._dead:
                continue
            try:
                conn.send(msg)
            except (OSError, ValueError) as e:
                self._dead[r] = f"its connection broke ({e})"

    def _drain(self) -> None:
        """Under ``_io``: file every answer the ranks have sent."""
        for r, conn in enumerate(self._conns, 1):
            if r in self._dead:
                continue
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    kind = msg[0]
                    if kind == "ack" and msg[1] in self._acks:
                        self._acks[msg[1]][r] = msg
                    elif kind in ("done", "failed") and msg[1] in self._open:
                        self._open[msg[1]][r] = msg
            except (EOFError, OSError) as e:
                self._dead[r] = f"its connection closed ({type(e).__name__})"
            if r not in self._dead and not self._services.alive(r):
                self._dead[r] = "its process exited"

    def _rank_gone(self, rank: int, peer: str | None = None) -> KVTransferError:
        return KVTransferError(f"tensor-parallel rank {rank}'s KV agent is gone: "
                               f"{self._dead.get(rank, 'unknown')}", retriable=True, peer=peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._io:
            self._send_all(("close",))
        self.local.close()
