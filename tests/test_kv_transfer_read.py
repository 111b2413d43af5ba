"""NIXL READ between two real processes (prefix pull): a peer's blocks read into ours, byte for
byte, by descriptor index; out-of-range ids refused; a holder killed mid-read surfaces as a
retriable error within a bounded time and the peer is dropped (the reader recomputes).

The test process is the reader; the holder is a spawned child whose KV tensor is random bytes
from a known seed (``kvt_procs.transport_holder``), so the reader rebuilds it to compare. Every
wait is bounded.
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
from kvt_procs import MODEL_ID, fill_random, recv_until, spawn, spec_dict, stop, transport_holder

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import PeerInfo
from kvrelay.kv_transfer.nixl_transport import NixlTransport

torch.set_num_threads(1)

READER = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=40)
HOLDER = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=64)
SEED = 11


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def reader():
    kv = allocate_kv_cache(READER)
    tr = NixlTransport(_name("reader"), kv, KVLayout.from_spec(READER, MODEL_ID),
                       write_timeout_s=5.0)
    yield tr, kv
    tr.close()


def _holder(progress: bool = True):
    p, conn = spawn(transport_holder, _name("holder"), spec_dict(HOLDER), MODEL_ID, SEED,
                    progress)
    _, info, pid = recv_until(conn, "info", 30)
    return p, conn, PeerInfo.from_bytes(info), pid


def _expected() -> torch.Tensor:
    kv = allocate_kv_cache(HOLDER)
    fill_random(kv, SEED)
    return kv


def test_random_block_maps_are_read_byte_identical(reader) -> None:
    """Every layer's K and V of each remote block lands in its local block, nothing else
    changes."""
    tr, kv = reader
    theirs = _expected()
    p, conn, info, _ = _holder()
    try:
        tr.add_peer(info)
        rng = random.Random(3)
        for _ in range(3):
            kv.zero_()
            n = rng.randint(1, 20)
            local = rng.sample(range(READER.num_blocks), n)
            remote = rng.sample(range(HOLDER.num_blocks), n)
            h = tr.read(info.agent_name, remote, local, incarnation=info.incarnation,
                        timeout_s=10)
            assert h.op == "read" and h.nbytes == n * READER.num_layers * 2 * \
                KVLayout.from_spec(READER, MODEL_ID).block_bytes
            tr.wait(h, timeout=10)
            for lb, rb in zip(local, remote, strict=True):
                assert torch.equal(kv[:, :, lb], theirs[:, :, rb]), (lb, rb)
            untouched = [b for b in range(READER.num_blocks) if b not in local]
            assert not kv[:, :, untouched].any(), "a block that was not read changed"
    finally:
        stop(p, conn)


def test_a_holder_that_never_progresses_times_out_within_the_bound(reader) -> None:
    """The first read on a fresh connection completes only once the holder's UCX worker
    answers the handshake: a holder must progress while it lends blocks (``ExportProgress``).
    One that does not fails the read at its deadline, retriably, and the read is released."""
    tr, _ = reader
    p, conn, info, _ = _holder(progress=False)
    try:
        tr.add_peer(info)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match=r"did not complete in 0\.5 s") as ei:
            tr.wait(tr.read(info.agent_name, [1, 2], [3, 4], timeout_s=0.5), timeout=5)
        assert ei.value.retriable and time.monotonic() - t0 < 3
    finally:
        stop(p, conn)


def test_reads_are_validated(reader) -> None:
    tr, _ = reader
    with pytest.raises(KVTransferError, match="unknown KV peer") as ei:
        tr.read("nobody", [0], [0])
    assert ei.value.retriable
    with pytest.raises(KVTransferError, match="equally many"):
        tr.read("nobody", [0, 1], [0])
    p, conn, info, _ = _holder()
    try:
        tr.add_peer(info)
        with pytest.raises(KVTransferError, match="out of range") as ei:
            tr.read(info.agent_name, [HOLDER.num_blocks], [0])
        assert not ei.value.retriable
        with pytest.raises(KVTransferError, match="restarted") as ei:
            tr.read(info.agent_name, [0], [0], incarnation="an-earlier-one")
        assert ei.value.retriable
        with pytest.raises(KVTransferError, match="no time left"):
            tr.read(info.agent_name, [0], [0], timeout_s=0.0)
    finally:
        stop(p, conn)


def test_a_holder_killed_mid_read_gives_a_retriable_error_and_is_dropped(reader) -> None:
    tr, _ = reader
    p, conn, info, pid = _holder()
    name = info.agent_name
    try:
        tr.add_peer(info)
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        every = list(range(READER.num_blocks))
        with pytest.raises(KVTransferError) as ei:
            while time.monotonic() - t0 < 15:  # bounded; the error comes within a second
                tr.wait(tr.read(name, every, every, timeout_s=5), timeout=5)
        elapsed = time.monotonic() - t0
        killer.join()
        assert ei.value.retriable and ei.value.peer == name
        assert elapsed < 6, f"the dead holder took {elapsed:.1f} s to surface"
        assert not tr.has_peer(name), "dropped: the next pull from it re-adds its PeerInfo"
        with pytest.raises(KVTransferError):
            tr.wait(tr.read(name, [0], [0], timeout_s=1), timeout=2)
    finally:
        stop(p, conn)
