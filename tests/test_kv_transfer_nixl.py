"""NIXL transport between two real processes: bytes, notifications, dead and restarted peers.

The test process is the sender; the receiver is a spawned child with its own KV tensor (see
``kvt_procs``). Every wait is bounded.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import pytest
import torch
from kvt_procs import (
    MODEL_ID,
    fill_random,
    idle_cpu,
    recv_until,
    spawn,
    spec_dict,
    stop,
    transport_receiver,
)

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout
from kvrelay.kv_transfer.messages import PeerInfo
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.send_tracker import NotifJob
from kvrelay.kv_transfer.transfer_thread import TransferThread

torch.set_num_threads(1)

SEND_SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=40)
RECV_SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=64)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sender():
    kv = allocate_kv_cache(SEND_SPEC)
    fill_random(kv, seed=7)
    tr = NixlTransport(_name("send"), kv, KVLayout.from_spec(SEND_SPEC, MODEL_ID),
                       write_timeout_s=5.0)
    yield tr, kv
    tr.close()


def _start_receiver(name: str, spec: KVCacheSpec = RECV_SPEC):
    p, conn = spawn(transport_receiver, name, spec_dict(spec), MODEL_ID)
    _, info, pid = recv_until(conn, "info", 30)
    return p, conn, PeerInfo.from_bytes(info), pid


def _write_and_check(tr: NixlTransport, kv: torch.Tensor, conn, peer: str, seed: int) -> None:
    """Random block maps over single layers, layer sets and all layers; notify; compare."""
    rng = random.Random(seed)
    expected: list[tuple[int, int, int]] = []  # (layer, local block, remote block)
    handles = []
    for _ in range(4):
        n = rng.randint(1, 12)
        local = rng.sample(range(SEND_SPEC.num_blocks), n)
        remote = rng.sample(range(RECV_SPEC.num_blocks), n)
        layers = rng.choice([[rng.randrange(SEND_SPEC.num_layers)], [0, 2], None])
        # the remote blocks of one round must not be written again by a later round
        done_remote = {r for _, _, r in expected}
        pairs = [(lb, rb) for lb, rb in zip(local, remote, strict=True) if rb not in done_remote]
        if not pairs:
            continue
        local, remote = [p[0] for p in pairs], [p[1] for p in pairs]
        handles.append(tr.write(peer, layers, local, remote))
        for layer in layers if layers is not None else range(SEND_SPEC.num_layers):
            expected += [(layer, lb, rb) for lb, rb in zip(local, remote, strict=True)]
    for h in handles:
        tr.wait(h, timeout=10)
    msg = f"done-{seed}".encode()
    tr.send_notif(peer, msg)
    _, frm, got, snap = recv_until(conn, "notif", 10)
    assert (frm, got) == (tr.name, msg)
    written = torch.zeros(RECV_SPEC.num_layers, RECV_SPEC.num_blocks, dtype=torch.bool)
    for layer, lb, rb in expected:
        assert torch.equal(snap[layer, :, rb], kv[layer, :, lb]), (layer, lb, rb)
        written[layer, rb] = True
    untouched = snap.permute(0, 2, 1, 3, 4, 5)[~written]
    assert not untouched.any(), "a block that was not written changed"
    conn.send(("report",))
    _, seen, _ = recv_until(conn, "report", 10)
    assert seen.count((tr.name, msg)) == 1


@pytest.mark.slow
def test_random_block_maps_arrive_byte_identical_before_the_notification(sender) -> None:
    tr, kv = sender
    p, conn, info, _ = _start_receiver(_name("recv"))
    try:
        assert tr.add_peer(info) is True
        assert tr.add_peer(info) is False  # same incarnation: cached
        _write_and_check(tr, kv, conn, info.agent_name, seed=1)
        time.sleep(0.1)
        conn.send(("report",))
        _, seen, _ = recv_until(conn, "report", 10)
        assert len(seen) == 1  # exactly once
    finally:
        stop(p, conn)


@pytest.mark.slow
def test_killed_receiver_gives_a_retriable_error_then_a_restart_is_reconnected(sender) -> None:
    tr, kv = sender
    name = _name("recv")
    p, conn, info, pid = _start_receiver(name)
    try:
        tr.add_peer(info)
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as ei:
            while time.monotonic() - t0 < 15:  # bounded; the error comes within a second
                h = tr.write(name, None, list(range(SEND_SPEC.num_blocks)),
                             list(range(SEND_SPEC.num_blocks)))
                tr.wait(h, timeout=10)
        elapsed = time.monotonic() - t0
        killer.join()
        assert ei.value.retriable and ei.value.peer == name
        assert elapsed < 5, f"the dead peer took {elapsed:.1f} s to surface"
        assert not tr.has_peer(name)  # dropped: the next add_peer reconnects
        with pytest.raises(KVTransferError, match="unknown KV peer") as ei2:
            tr.write(name, 0, [0], [0])
        assert ei2.value.retriable
    finally:
        stop(p, conn)

    p, conn, info2, _ = _start_receiver(name)  # same agent name, new process
    try:
        assert info2.incarnation != info.incarnation
        assert tr.add_peer(info2) is True
        _write_and_check(tr, kv, conn, name, seed=2)
    finally:
        stop(p, conn)


@pytest.mark.slow
def test_gracefully_restarted_receiver_with_the_same_name_is_reconnected(sender) -> None:
    tr, kv = sender
    name = _name("recv")
    p, conn, info, _ = _start_receiver(name)
    try:
        tr.add_peer(info)
        _write_and_check(tr, kv, conn, name, seed=3)
    finally:
        stop(p, conn)
    p, conn, info2, _ = _start_receiver(name)
    try:
        assert tr.peer_incarnation(name) == info.incarnation  # we have not noticed yet
        assert tr.add_peer(info2) is True
        assert tr.peer_incarnation(name) == info2.incarnation
        with pytest.raises(KVTransferError, match="restarted") as ei:  # blocks of the old one
            tr.write(name, 0, [0], [0], incarnation=info.incarnation)
        assert ei.value.retriable
        _write_and_check(tr, kv, conn, name, seed=4)
    finally:
        stop(p, conn)


def test_incompatible_layout_is_refused_with_the_flag_to_change(sender) -> None:
    tr, _ = sender
    theirs = KVLayout.from_spec(KVCacheSpec(3, 2, 16, 32, 64), MODEL_ID)
    info = PeerInfo("decode-x", b"not-used", theirs, 0x1000, 0, "abc")
    with pytest.raises(IncompatibleKVLayout) as ei:
        tr.add_peer(info)
    msg = str(ei.value)
    assert "peer has block_size 32, we have 8: start both pools with the same --block-size" in msg
    assert not ei.value.retriable
    assert not tr.has_peer("decode-x")
    # A bf16 KV peer of an fp32 sender (or the reverse): the bytes of a block differ in size
    # and meaning, so the handshake names both dtypes and the flag.
    bf16 = KVLayout.from_spec(KVCacheSpec(3, 2, 16, 8, 64, "bfloat16"), MODEL_ID)
    with pytest.raises(IncompatibleKVLayout) as ei:
        tr.add_peer(PeerInfo("decode-y", b"not-used", bf16, 0x1000, 0, "abc"))
    assert "peer stores KV as bfloat16, we have float32: start both pools with the same " \
        "--kv-cache-dtype" in str(ei.value)
    assert not tr.has_peer("decode-y")


def test_write_validates_block_ids_and_layers(sender) -> None:
    tr, _ = sender
    with pytest.raises(KVTransferError, match="unknown KV peer"):
        tr.write("nobody", 0, [0], [0])
    with pytest.raises(KVTransferError, match="layers"):
        tr.write("nobody", 7, [0], [0])
    with pytest.raises(KVTransferError, match="equally many"):
        tr.write("nobody", 0, [0, 1], [0])


@pytest.mark.slow
def test_block_ids_out_of_range_are_refused(sender) -> None:
    tr, _ = sender
    p, conn, info, _ = _start_receiver(_name("recv"))
    try:
        tr.add_peer(info)
        with pytest.raises(KVTransferError, match="out of range") as ei:
            tr.write(info.agent_name, 0, [0], [RECV_SPEC.num_blocks])
        assert not ei.value.retriable
    finally:
        stop(p, conn)


@pytest.mark.slow
def test_an_idle_agent_burns_no_cpu() -> None:
    p, conn = spawn(idle_cpu, 1.0, False)  # a spinning thread would burn ~1 CPU s
    try:
        _, ok, cpu = recv_until(conn, "idle", 30)
    finally:
        stop(p, conn)
    assert ok, "the warm-up write did not arrive"
    assert cpu < 0.05, f"idle agents burnt {cpu:.3f} CPU s in 1 s"


@pytest.mark.slow
def test_a_notification_on_a_fresh_connection_arrives_without_any_write(sender) -> None:
    """UCX cannot send it inline before the endpoint is wired up: the I/O thread keeps
    progressing for a while after a notification so it still leaves."""
    tr, _ = sender
    p, conn, info, _ = _start_receiver(_name("recv"))
    ended: list[object] = []
    th = TransferThread(tr, lambda job, err: [], lambda job, err: ended.append(err))
    try:
        tr.add_peer(info)
        th.submit(NotifJob("r", info.agent_name, b"only-a-notif", info.incarnation))
        _, frm, msg, _ = recv_until(conn, "notif", 10)
        assert (frm, msg) == (tr.name, b"only-a-notif") and ended == [None]
    finally:
        th.close()
        stop(p, conn)


def test_ucx_preload_loads_the_plugin_nixl_itself_loads(monkeypatch, tmp_path) -> None:
    """What a fork server loads before it forks (``kvrelay.fork_preload``): NIXL's own UCX
    plugin, so that a forked process's first agent finds it loaded and opens no other copy;
    where ``NIXL_PLUGIN_DIR`` names a folder without it, nothing."""
    from nixl._api import nixl_agent, nixl_agent_config

    from kvrelay.kv_transfer.nixl_transport import preload_ucx

    def loaded() -> set[str]:
        with open("/proc/self/maps") as maps:
            return {ln.split()[-1] for ln in maps if ln.rstrip().endswith("/libplugin_UCX.so")}

    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(tmp_path))
    assert preload_ucx() is False
    monkeypatch.delenv("NIXL_PLUGIN_DIR")
    assert preload_ucx() is True
    plugin = loaded()
    assert len(plugin) == 1
    nixl_agent(f"preload-{uuid.uuid4().hex[:8]}",
               nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    assert loaded() == plugin
