"""Child processes for the KV transfer tests: a real KV tensor and a real NIXL agent each.

Children are forked from a fork server that imported this module (and torch) once, as the
engine's tensor-parallel ranks are, and talk to the test over a ``Pipe``. Each one
polls for KV every 2 ms, like an engine loop waiting for KV, and answers commands in between.
Every wait on the test side is bounded (``recv_until``) so nothing can hang.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache

MODEL_ID = "test-model-0001"
POLL_S = 0.002


def spawn(target: Callable[..., None], *args: Any) -> tuple[mp.Process, Connection]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # if this process's server is not running yet
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


def recv_until(conn: Connection, kind: str, timeout: float) -> tuple[Any, ...]:
    """The next message whose first item is ``kind`` (others are dropped), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise TimeoutError(f"no {kind!r} message within {timeout} s")
        msg = conn.recv()
        if msg[0] == kind:
            return msg


def stop(p: mp.Process, conn: Connection, timeout: float = 5.0) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("exit",))
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout)


def spec_dict(spec: KVCacheSpec) -> dict[str, Any]:
    return asdict(spec)


def fill_random(kv: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.copy_(torch.rand(kv.shape, generator=g, dtype=torch.float32).to(kv.dtype))


# -- child: a bare transport that reports every notification with a snapshot of its KV ----------
def transport_receiver(conn: Connection, name: str, spec: dict[str, Any], model_id: str) -> None:
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    kv_spec = KVCacheSpec(**spec)
    kv = allocate_kv_cache(kv_spec)
    tr = NixlTransport(name, kv, KVLayout.from_spec(kv_spec, model_id))
    conn.send(("info", tr.peer_info().to_bytes(), os.getpid()))
    seen: list[tuple[str, bytes]] = []
    while True:
        for n in tr.get_notifs():
            seen.append((n.peer, n.msg))
            # The snapshot is taken the moment the notification is seen: it proves the data
            # was there before the notification.
            conn.send(("notif", n.peer, n.msg, kv.clone()))
        if conn.poll(POLL_S):
            cmd = conn.recv()
            if cmd[0] == "exit":
                break
            if cmd[0] == "report":
                conn.send(("report", list(seen), kv.clone()))
    tr.close()


# -- child: a decode-side NixlConnector driven like an engine ------------------------------------
def connector_receiver(conn: Connection, name: str, spec: dict[str, Any], model_id: str) -> None:
    """Commands: ("reserve", rid, block_ids, notif, cached_value | None) opens an expectation
    (blocks of a cached prefix are pre-filled with ``cached_value``); ("report",)."""
    torch.set_num_threads(1)
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVExpectation

    kv_spec = KVCacheSpec(**spec)
    kv = allocate_kv_cache(kv_spec)
    c = NixlConnector(NixlConnectorConfig(name, model_id))
    c.register_kv_cache(kv, kv_spec)
    conn.send(("info", c.peer_info().to_bytes(), os.getpid()))
    received: list[str] = []
    failed: list[tuple[str, str]] = []
    while True:
        ev = c.take_events()
        for rid in ev.received:
            received.append(rid)
            conn.send(("received", rid, kv.clone()))
        failed += ev.failed
        if conn.poll(POLL_S):
            cmd = conn.recv()
            if cmd[0] == "exit":
                break
            if cmd[0] == "reserve":
                _, rid, blocks, notif, skip, cached_value = cmd
                for b in blocks[:skip]:
                    kv[:, :, b] = cached_value
                seq = Sequence(rid, [1] * (len(blocks) * kv_spec.block_size), SamplingParams(),
                               kv_transfer_params=KVExpectation(notif, timeout_s=30.0))
                seq.block_table = list(blocks)
                seq.status = SequenceStatus.WAITING_FOR_KV
                c.request_waiting_for_kv(seq)
                conn.send(("reserved", rid, c.has_pending()))
            elif cmd[0] == "report":
                conn.send(("report", list(received), list(failed), c.has_pending()))
    c.close()


# -- child: the CPU an idle agent burns ----------------------------------------------------------
def idle_cpu(conn: Connection, seconds: float, prog_thread: bool) -> None:
    """Two agents in this process, one write between them, then ``seconds`` of idleness:
    reports the CPU seconds burnt meanwhile (whole process, all threads)."""
    torch.set_num_threads(1)
    import resource

    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.nixl_transport import NixlTransport
    from kvrelay.kv_transfer.transfer_thread import TransferThread, WriteJob

    spec = KVCacheSpec(2, 2, 16, 16, 32)
    a_kv, b_kv = allocate_kv_cache(spec), allocate_kv_cache(spec)
    fill_random(a_kv, 1)
    layout = KVLayout.from_spec(spec, MODEL_ID)
    a = NixlTransport(f"idle-a-{os.getpid()}", a_kv, layout)
    b = NixlTransport(f"idle-b-{os.getpid()}", b_kv, layout)
    a.add_peer(b.peer_info())
    done: list[object] = []
    th = TransferThread(a, lambda job, err: done.append(err) or [], lambda job, err: None)
    th.submit(WriteJob(b.name, (0, 1), [0, 1, 2], [5, 6, 7], ("r",)))
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        b.progress()  # the receiver answers the connection handshake
        time.sleep(POLL_S)
    ok = bool(done) and done[0] is None and torch.equal(a_kv[:, :, 0:3], b_kv[:, :, 5:8])
    if prog_thread:  # NIXL's default: an agent with its progress thread on
        from nixl._api import nixl_agent, nixl_agent_config

        extra = nixl_agent(f"idle-c-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        extra.register_memory(torch.zeros(1024))
    time.sleep(0.2)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    conn.send(("idle", ok, cpu))
    th.close()
    a.close()
    b.close()


# -- child: a KV holder that peers read from (prefix pull) ---------------------------------------
def transport_holder(conn: Connection, name: str, spec: dict[str, Any], model_id: str,
                     seed: int, progress: bool) -> None:
    """A transport over a KV tensor of random bytes (``fill_random(seed)``: the reader rebuilds
    it to compare). ``progress``: progress UCX every ``POLL_S``, as a holder with an export open
    does; else only answer commands."""
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    kv_spec = KVCacheSpec(**spec)
    kv = allocate_kv_cache(kv_spec)
    fill_random(kv, seed)
    tr = NixlTransport(name, kv, KVLayout.from_spec(kv_spec, model_id))
    conn.send(("info", tr.peer_info().to_bytes(), os.getpid()))
    while True:
        if progress:
            tr.progress()
        if conn.poll(POLL_S):
            cmd = conn.recv()
            if cmd[0] == "exit":
                break
    tr.close()
