"""NixlConnector on both sides, driven the way the engine drives it, with real Sequences.

The test process plays the prefill engine: per step it calls ``start_step``, writes each layer's
new K/V slots by hand, calls ``save_layer``, then ``end_step``, and finishes or aborts requests.
A spawned child plays the decode engine (``kvt_procs.connector_receiver``): it reserves blocks,
opens expectations and snapshots its KV tensor the moment ``take_events`` reports a request.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kvt_procs import MODEL_ID, connector_receiver, recv_until, spawn, spec_dict, stop

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
from kvrelay.kv_transfer.messages import KVDestination, PeerInfo, PendingDestination

torch.set_num_threads(1)

BS = 8
SEND_SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=BS, num_blocks=40)
RECV_SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=BS, num_blocks=64)
CACHED = -7.0  # what the decode side's own prefix-cache blocks hold


def token_kv(rid: str, layer: int, token: int) -> torch.Tensor:
    """The K and V of one token of one layer: ``[2, kv_heads, head_dim]``, distinct everywhere."""
    g = torch.Generator().manual_seed(hash((rid, layer, token)) & 0xFFFFFFFF)
    return torch.rand(2, SEND_SPEC.num_kv_heads, SEND_SPEC.head_dim, generator=g)


def write_tokens(kv: torch.Tensor, seq: Sequence, layer: int, start: int, end: int) -> None:
    for t in range(start, end):
        kv[layer, :, seq.block_table[t // BS], t % BS] = token_kv(seq.request_id, layer, t)


@contextlib.contextmanager
def connected(layerwise: str = "on") -> Iterator[tuple[NixlConnector, torch.Tensor, Any, Any,
                                                      str]]:
    """A sending connector in this process, added as a peer to a spawned receiver:
    (connector, its KV tensor, the child's pipe, the child process, the receiver's name)."""
    recv_name, send_name = f"decode-{uuid.uuid4().hex[:6]}", f"prefill-{uuid.uuid4().hex[:6]}"
    p, conn = spawn(connector_receiver, recv_name, spec_dict(RECV_SPEC), MODEL_ID)
    kv = allocate_kv_cache(SEND_SPEC)
    c = NixlConnector(NixlConnectorConfig(send_name, MODEL_ID, write_timeout_s=10.0,
                                          layerwise=layerwise))
    try:
        c.register_kv_cache(kv, SEND_SPEC)
        _, info, _ = recv_until(conn, "info", 30)
        assert c.add_peer(PeerInfo.from_bytes(info)) is True
        yield c, kv, conn, p, recv_name
    finally:
        c.close()
        stop(p, conn)


class Req:
    def __init__(self, rid: str, peer: str, prompt: int, local: list[int], remote: list[int],
                 *, cached: int = 0, skip: int = 0) -> None:
        self.notif = f"lease-{rid}".encode()
        self.skip = skip
        self.seq = Sequence(rid, list(range(prompt)), SamplingParams(),
                            kv_transfer_params=KVDestination(peer, remote, skip, self.notif))
        self.seq.block_table = list(local)
        self.seq.num_computed_tokens = self.seq.num_cached_tokens = cached
        self.seq.status = SequenceStatus.RUNNING
        self.remote = remote


def run_step(c: NixlConnector, kv: torch.Tensor, work: list[tuple[Req, int]]) -> None:
    c.start_step([ScheduledSeq(r.seq, n) for r, n in work])
    for layer in range(SEND_SPEC.num_layers):
        for r, n in work:
            s = r.seq.num_computed_tokens
            write_tokens(kv, r.seq, layer, s, s + n)
        c.save_layer(layer)
    c.end_step()
    for r, n in work:
        r.seq.num_computed_tokens += n


def finish(c: NixlConnector, r: Req, reason: FinishReason) -> None:
    r.seq.append_token(3)
    r.seq.status, r.seq.finish_reason = SequenceStatus.FINISHED, reason
    assert c.request_finished(r.seq) is True  # the blocks stay until `sent`


def check_received(snap: torch.Tensor, r: Req) -> None:
    n = r.seq.num_prompt_tokens
    for i, rb in enumerate(r.remote):
        if i < r.skip:
            assert (snap[:, :, rb] == CACHED).all(), f"{r.seq.request_id}: cached block {i} hit"
            continue
        for t in range(i * BS, min((i + 1) * BS, n)):
            for layer in range(SEND_SPEC.num_layers):
                want = token_kv(r.seq.request_id, layer, t)
                assert torch.equal(snap[layer, :, rb, t % BS], want), (r.seq.request_id, t, layer)


def check_delivered(conn: Any, reqs: tuple[Req, ...]) -> tuple[list[str], bool]:
    """Each of ``reqs`` arrived exactly once with the right KV; the receiver's failed requests
    and whether it still expects something."""
    snaps = {}
    for _ in reqs:
        _, rid, snap = recv_until(conn, "received", 10)
        snaps[rid] = snap
    for r in reqs:
        check_received(snaps[r.seq.request_id], r)
    time.sleep(0.2)
    conn.send(("report",))
    _, received, failed, pending = recv_until(conn, "report", 10)
    assert sorted(received) == sorted(r.seq.request_id for r in reqs)  # once each
    return failed, pending


def posted_layers(c: NixlConnector) -> list[tuple[int, ...]]:
    """The layers of every write job the connector hands its I/O thread, from now on."""
    io = c._tx._io()
    seen: list[tuple[int, ...]] = []
    submit = io.submit

    def record(job: Any) -> None:
        if hasattr(job, "layers"):
            seen.append(job.layers)
        submit(job)

    io.submit = record  # type: ignore[method-assign]
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("layerwise", ["on", "off"])
def test_connector_streams_chunked_prefills_and_notifies_once_after_the_data(
        layerwise: str) -> None:
    """Layer by layer or whole at each step's end: the same bytes, one notification each."""
    with connected(layerwise) as (c, kv, conn, _, recv_name):
        jobs = posted_layers(c)
        # a: chunked 16+16+5 · b: 2 blocks in our prefix cache, 1 in theirs · c: aborted
        # d: they have 2 cached blocks, we have only 1 (their blocks are never written)
        a = Req("a", recv_name, 37, [3, 9, 4, 20, 1], [50, 2, 33, 7, 12])
        b = Req("b", recv_name, 29, [5, 6, 11, 12], [40, 41, 42, 43], cached=16, skip=1)
        cr = Req("c", recv_name, 20, [30, 31, 32], [60, 61, 62])
        d = Req("d", recv_name, 30, [13, 14, 15, 16], [20, 21, 22, 23], cached=8, skip=2)
        for r in (a, b, cr, d):
            conn.send(("reserve", r.seq.request_id, r.remote, r.notif, r.skip, CACHED))
            assert recv_until(conn, "reserved", 10)[2] is True
        for r in (b, d):  # their locally cached prefix was computed by an earlier request
            for layer in range(SEND_SPEC.num_layers):
                write_tokens(kv, r.seq, layer, 0, r.seq.num_computed_tokens)

        events = {"sent": [], "received": [], "failed": []}

        def collect() -> None:
            ev = c.take_events()
            events["sent"] += ev.sent
            events["failed"] += ev.failed
            assert not ev.received

        run_step(c, kv, [(a, 16), (cr, 10)])
        collect()
        run_step(c, kv, [(a, 16), (b, 13)])
        finish(c, b, FinishReason.LENGTH)
        finish(c, cr, FinishReason.ABORT)
        collect()
        run_step(c, kv, [(a, 5), (d, 22)])
        finish(c, a, FinishReason.STOP)
        finish(c, d, FinishReason.LENGTH)
        assert c.has_pending()

        deadline = time.monotonic() + 15
        while len(events["sent"]) < 4 and time.monotonic() < deadline:
            collect()
            time.sleep(0.002)
        assert sorted(events["sent"]) == ["a", "b", "c", "d"]
        assert [rid for rid, _ in events["failed"]] == ["c"]
        assert "aborted" in events["failed"][0][1]
        assert not c.has_pending()

        failed, pending = check_delivered(conn, (a, b, d))  # once each; c never notified
        assert failed == [] and pending is True  # c's expectation is open until its deadline
        every = tuple(range(SEND_SPEC.num_layers))
        if layerwise == "on":  # one job per layer and step
            assert jobs and all(len(j) == 1 for j in jobs), jobs
        else:  # one job per step, every layer
            assert jobs and all(j == every for j in jobs), jobs


@pytest.mark.slow
def test_a_killed_receiver_fails_its_requests_quickly_and_never_notifies() -> None:
    with connected() as (c, kv, conn, p, recv_name):
        a = Req("a", recv_name, 24, [0, 1, 2], [5, 6, 7])
        conn.send(("reserve", "a", a.remote, a.notif, 0, CACHED))
        recv_until(conn, "reserved", 10)
        run_step(c, kv, [(a, 8)])  # the first chunk arrives
        p.kill()
        p.join(10)
        t0 = time.monotonic()
        run_step(c, kv, [(a, 16)])
        finish(c, a, FinishReason.LENGTH)
        sent, failed = [], []
        while not sent and time.monotonic() - t0 < 10:
            ev = c.take_events()
            sent += ev.sent
            failed += ev.failed
            time.sleep(0.002)
        assert sent == ["a"], f"no outcome after {time.monotonic() - t0:.1f} s"
        assert time.monotonic() - t0 < 5
        assert failed[0][0] == "a" and "retriable" in failed[0][1], failed
        assert not c.has_pending()
        assert c.peer_incarnation(recv_name) is None  # dropped: re-add it after a restart


@pytest.mark.slow
def test_unknown_peer_fails_the_request_without_a_notification() -> None:
    kv = allocate_kv_cache(SEND_SPEC)
    c = NixlConnector(NixlConnectorConfig(f"prefill-{uuid.uuid4().hex[:6]}", MODEL_ID))
    try:
        c.register_kv_cache(kv, SEND_SPEC)
        r = Req("x", "decode-nobody", 12, [0, 1], [0, 1])
        run_step(c, kv, [(r, 12)])
        finish(c, r, FinishReason.LENGTH)
        deadline = time.monotonic() + 10
        sent, failed = [], []
        while not sent and time.monotonic() < deadline:
            ev = c.take_events()
            sent += ev.sent
            failed += ev.failed
            time.sleep(0.002)
        assert sent == ["x"]
        assert failed and failed[0][0] == "x" and "unknown KV peer" in failed[0][1]
        assert "retriable" in failed[0][1]
        assert not c.has_pending()
    finally:
        c.close()


class PendingReq(Req):
    """A prefill sent ahead of its destination (``PendingDestination``), named by ``name()``."""

    def __init__(self, rid: str, peer: str, prompt: int, local: list[int],
                 remote: list[int]) -> None:
        super().__init__(rid, peer, prompt, local, remote)
        self.dest = self.seq.kv_transfer_params
        self.seq.kv_transfer_params = self.holder = PendingDestination()

    def name(self, c: NixlConnector) -> None:
        assert self.holder.resolve(self.dest)
        c.destination_ready(self.seq.request_id)


@pytest.mark.slow
@pytest.mark.parametrize("layerwise", ["on", "off"])
def test_destinations_named_late_still_deliver_every_block_once(layerwise: str) -> None:
    """Named before the step, mid-step (after some layers were saved), after the request
    finished, or never (abandoned / aborted): the received KV is exact, one notification
    each, and an unnamed request's blocks come back without one."""
    with connected(layerwise) as (c, kv, conn, _, recv_name):
        early = PendingReq("early", recv_name, 20, [0, 1, 2], [10, 11, 12])
        mid = PendingReq("mid", recv_name, 37, [3, 4, 5, 6, 7], [13, 14, 15, 16, 17])
        late = PendingReq("late", recv_name, 12, [8, 9], [18, 19])
        never = PendingReq("never", recv_name, 9, [20, 21], [20, 21])
        aborted = PendingReq("aborted", recv_name, 9, [22, 23], [22, 23])
        for r in (early, mid, late):
            conn.send(("reserve", r.seq.request_id, r.remote, r.notif, 0, CACHED))
            assert recv_until(conn, "reserved", 10)[2] is True
        early.name(c)
        # One step: "mid" is named after layer 0 was saved (chunked: 16 of 37 tokens).
        work = [(early, 20), (mid, 16), (late, 12), (never, 9), (aborted, 9)]
        c.start_step([ScheduledSeq(r.seq, n) for r, n in work])
        for layer in range(SEND_SPEC.num_layers):
            for r, n in work:
                write_tokens(kv, r.seq, layer, r.seq.num_computed_tokens,
                             r.seq.num_computed_tokens + n)
            if layer == 1:
                mid.name(c)
            c.save_layer(layer)
        c.end_step()
        for r, n in work:
            r.seq.num_computed_tokens += n
        for r in (early, late, never):
            finish(c, r, FinishReason.LENGTH)
        aborted.seq.status, aborted.seq.finish_reason = SequenceStatus.FINISHED, \
            FinishReason.ABORT
        assert c.request_finished(aborted.seq) is False  # never named: nothing to wait for
        run_step(c, kv, [(mid, 21)])  # the rest of "mid", its destination known now
        finish(c, mid, FinishReason.LENGTH)
        late.name(c)  # after it finished: all of it goes now
        assert c.abandon("never") and not c.abandon("never")
        sent, failed = [], []
        deadline = time.monotonic() + 15
        while len(sent) < 4 and time.monotonic() < deadline:
            ev = c.take_events()
            sent += ev.sent
            failed += ev.failed
            time.sleep(0.002)
        assert sorted(sent) == ["early", "late", "mid", "never"]
        assert [rid for rid, _ in failed] == ["never"]
        assert check_delivered(conn, (early, mid, late))[0] == []


def test_layerwise_auto_streams_only_where_the_copy_can_overlap_the_compute() -> None:
    from kvrelay.kv_transfer.sending import streams_layerwise

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert streams_layerwise("auto", cuda, cores=1, threads=1)  # the copy engines
    assert not streams_layerwise("auto", cpu, cores=1, threads=1)  # pinned to one core
    assert not streams_layerwise("auto", cpu, cores=2, threads=2)  # every core computes
    assert streams_layerwise("auto", cpu, cores=4, threads=2)  # the I/O thread has a core
    assert streams_layerwise("on", cpu, cores=1, threads=1)
    assert not streams_layerwise("off", cuda, cores=8, threads=1)
    with pytest.raises(ValueError, match="layerwise"):
        NixlConnectorConfig("prefill-x", MODEL_ID, layerwise="sometimes")
