"""What the KV transfer benchmarks share: the payload's KV shape, the median timer, a receiving
process's answer loop (it keeps its agents progressing and checksums blocks), and a prompt's
P -> D handoff through the connectors (``handoff_row``) and the table of such rows
(``print_handoff_rows``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache

MiB = 1 << 20
# 64 KiB blocks (16 tokens x 8 KV heads x 128 dims x fp32); 2 layers x 2 x 2048 blocks = 512 MiB
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2048)
MODEL_ID = "bench-model"


def time_median(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``, after one warm-up call (first touch,
    connection set-up)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def answer_sums(conn: Connection, agents: Sequence[Any], kvs: Sequence[torch.Tensor]) -> None:
    """A receiver's loop: keep its agents progressing (a sender's first write waits on the
    connection handshake) and answer each list of blocks with their sum over ``kvs``, until
    "exit"."""
    while True:
        while not conn.poll(0.002):
            for a in agents:
                a.progress()
        cmd = conn.recv()
        if cmd == "exit":
            return
        conn.send(sum(kv[:, :, cmd].double().sum().item() for kv in kvs))


CHUNK = 512  # a handoff's prefill chunk (tokens): each step's writes are posted as it ends


def _connector_receiver(conn: Connection, name: str, spec: dict[str, Any], prompt: int) -> None:
    """A decode worker's connector: on ("reserve", rid, blocks, notif) it expects the KV; it
    reports each request whose notification arrived."""
    torch.set_num_threads(1)
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVExpectation

    kv_spec = KVCacheSpec(**spec)
    c = NixlConnector(NixlConnectorConfig(name, MODEL_ID))
    c.register_kv_cache(allocate_kv_cache(kv_spec), kv_spec)
    conn.send(c.peer_info_bytes())
    while True:
        for rid in c.take_events().received:
            conn.send(rid)
        if conn.poll(0.001):
            cmd = conn.recv()
            if cmd == "exit":
                break
            _, rid, blocks, notif = cmd
            seq = Sequence(rid, [1] * prompt, SamplingParams(),
                           kv_transfer_params=KVExpectation(notif, timeout_s=60.0))
            seq.block_table = list(blocks)
            seq.status = SequenceStatus.WAITING_FOR_KV
            c.request_waiting_for_kv(seq)
    c.close()


def print_handoff_rows(rows: Sequence[tuple[str, int, float]], prompt: int, label: str,
                       base: str, base_bytes: int) -> None:
    """``handoff_row``'s results (label, bytes moved, seconds) of a ``prompt``-token prompt, a
    line each: MiB moved, KiB per token, the share of ``base``'s bytes (``base_bytes``) and
    milliseconds per 1K prompt tokens; ``label`` heads the first column."""
    width = max(len(label), *(len(r[0]) for r in rows)) + 2
    vs = f"vs {base}"
    print(f"{label:<{width}}{'MiB moved':>10}{'KiB/token':>11}{vs:>10}{'ms/1K tok':>11}")
    for name, nbytes, t in rows:
        print(f"{name:<{width}}{nbytes / MiB:>10.2f}{nbytes / prompt / 1024:>11.2f}"
              f"{nbytes / base_bytes:>10.1%}{t * 1e3 / (prompt / 1000):>11.2f}")


def handoff_row(label: str, spec: KVCacheSpec, prompt: int, reps: int) -> tuple[int, float]:
    """A ``prompt``-token prompt handed from a prefill-side connector over ``spec``'s cache to
    a decode-side one in another process (NIXL over UCX), the engine's path (``CHUNK``-token
    chunks, each step's writes posted as it ends, then the notification): (bytes one handoff
    moved, counted from the transport's writes; median seconds from the first chunk to the
    notification)."""
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tag = f"{label[:3].lower()}-{os.getpid()}"
    proc = ctx.Process(target=_connector_receiver,
                       args=(child, f"recv-{tag}", asdict(spec), prompt), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise SystemExit("receiver did not start")
    info = parent.recv()
    kv = allocate_kv_cache(spec)
    kv.view(torch.int16).random_(-1000, 1000)  # finite bf16 values
    c = NixlConnector(NixlConnectorConfig(f"send-{tag}", MODEL_ID, layerwise="off",
                                          write_timeout_s=120))
    c.register_kv_cache(kv, spec)
    c.add_peer(info)
    transport = c._tx.transport
    moved: list[int] = []
    post = transport.write

    def counted(*a: object, post: Callable[..., Any] = post, **k: object) -> Any:
        h = post(*a, **k)
        moved.append(h.nbytes)
        return h

    transport.write = counted  # type: ignore[method-assign]
    n = prompt // spec.block_size
    rep = [0]

    def handoff() -> None:
        rep[0] += 1
        rid, notif = f"{tag}-{rep[0]}", f"n-{tag}-{rep[0]}".encode()
        parent.send(("reserve", rid, list(range(n)), notif))
        seq = Sequence(rid, [1] * prompt, SamplingParams(),
                       kv_transfer_params=KVDestination(f"recv-{tag}", list(range(n)), 0, notif))
        seq.block_table = list(range(n))
        seq.status = SequenceStatus.RUNNING
        time.sleep(0.05)  # the reservation is open before the first write lands
        for start in range(0, prompt, CHUNK):
            c.start_step([ScheduledSeq(seq, min(CHUNK, prompt - start))])
            c.end_step()
            seq.num_computed_tokens = min(prompt, start + CHUNK)
        assert c.request_finished(seq)
        while rid not in c.take_events().sent:
            time.sleep(1e-4)
        assert parent.poll(60) and parent.recv() == rid

    handoff()  # warm-up, and the bytes of one handoff
    nbytes = sum(moved)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        handoff()
        times.append(time.perf_counter() - t0 - 0.05)
    c.close()
    parent.send("exit")
    proc.join(10)
    return nbytes, statistics.median(times)
