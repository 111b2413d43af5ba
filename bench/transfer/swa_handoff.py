"""Benchmark the KV handoff of sliding-window hybrids: the bytes and time of a prompt's handoff
through the connectors (the engine's path), dense GQA against Gemma 3's 5:1 hybrid and an
all-windowed model.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.swa_handoff [--reps 7]

(also ``python -m bench.transfer.kv_transfer --swa``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from bench.transfer.rig import MODEL_ID, MiB
from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache

# -- sliding-window hybrids (``--swa``): bytes and time of a prompt's handoff ------------------
# A Gemma-3-4B-like layer (4 KV heads x 256, bf16: 4 KiB of K and V per token), 12 layers (5
# local : 1 global, window 1024, as Gemma 3), a prompt of 4x the window handed over whole.
SWA_WINDOW, SWA_PROMPT, SWA_LAYERS, SWA_BS = 1024, 4096, 12, 16
SWA_SHAPES = {
    "dense GQA (every layer global)": (None,) * SWA_LAYERS,
    "Gemma 3 hybrid 5:1": tuple(None if (i + 1) % 6 == 0 else SWA_WINDOW
                                for i in range(SWA_LAYERS)),
    "all windowed (Mistral-style)": (SWA_WINDOW,) * SWA_LAYERS,
}


def _swa_spec(windows: tuple[int | None, ...]) -> KVCacheSpec:
    blocks = SWA_PROMPT // SWA_BS + 16
    return KVCacheSpec(SWA_LAYERS, 4, 256, SWA_BS, blocks, "bfloat16", layer_windows=windows)


def _swa_receiver(conn: Connection, name: str) -> None:
    """A decode worker's connector: on ("reserve", rid, blocks, notif) it expects the KV; it
    reports each request whose notification arrived."""
    torch.set_num_threads(1)
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVExpectation

    spec = _swa_spec(SWA_SHAPES["dense GQA (every layer global)"])
    kv = allocate_kv_cache(spec)
    c = NixlConnector(NixlConnectorConfig(name, MODEL_ID))
    c.register_kv_cache(kv, spec)
    conn.send(c.peer_info_bytes())
    while True:
        for rid in c.take_events().received:
            conn.send(rid)
        if conn.poll(0.001):
            cmd = conn.recv()
            if cmd == "exit":
                break
            _, rid, blocks, notif = cmd
            seq = Sequence(rid, [1] * SWA_PROMPT, SamplingParams(),
                           kv_transfer_params=KVExpectation(notif, timeout_s=60.0))
            seq.block_table = list(blocks)
            seq.status = SequenceStatus.WAITING_FOR_KV
            c.request_waiting_for_kv(seq)
    c.close()


def swa_rows(reps: int) -> list[tuple[str, int, float]]:
    """Each shape's prompt handed to a decode worker through the connectors (the engine's
    path: 512-token chunks, each step's writes posted as the step ends): (shape, bytes moved,
    median seconds from the first chunk to the notification). Printed as a table."""
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    recv_name = f"swa-recv-{os.getpid()}"
    proc = ctx.Process(target=_swa_receiver, args=(child, recv_name), daemon=True)
    proc.start()
    if not parent.poll(60):
        raise SystemExit("receiver did not start")
    info = parent.recv()
    n = SWA_PROMPT // SWA_BS
    rows = []
    for label, windows in SWA_SHAPES.items():
        spec = _swa_spec(windows)
        kv = allocate_kv_cache(spec)
        kv.view(torch.int16).random_(-1000, 1000)  # finite bf16 values
        c = NixlConnector(NixlConnectorConfig(f"swa-send-{len(rows)}-{os.getpid()}", MODEL_ID,
                                              layerwise="off", write_timeout_s=60))
        c.register_kv_cache(kv, spec)
        c.add_peer(info)
        transport = c._tx.transport
        moved: list[int] = []
        post = transport.write

        def counted(*a: object, post: Callable[..., object] = post, moved: list[int] = moved,
                    **k: object) -> object:
            h = post(*a, **k)
            moved.append(h.nbytes)  # type: ignore[attr-defined]
            return h

        transport.write = counted  # type: ignore[method-assign]
        rep = [0]

        def handoff(c: NixlConnector = c, rep: list[int] = rep, label: str = label) -> None:
            rep[0] += 1
            rid, notif = f"{label[:5]}-{rep[0]}", f"n-{label[:5]}-{rep[0]}".encode()
            parent.send(("reserve", rid, list(range(n)), notif))
            seq = Sequence(rid, [1] * SWA_PROMPT, SamplingParams(),
                           kv_transfer_params=KVDestination(recv_name, list(range(n)), 0, notif))
            seq.block_table = list(range(n))
            seq.status = SequenceStatus.RUNNING
            time.sleep(0.05)  # the reservation is open before the first write lands
            for start in range(0, SWA_PROMPT, 512):
                c.start_step([ScheduledSeq(seq, 512)])
                c.end_step()
                seq.num_computed_tokens = start + 512
            assert c.request_finished(seq)
            while rid not in c.take_events().sent:
                time.sleep(1e-4)
            assert parent.poll(30) and parent.recv() == rid

        moved.clear()
        handoff()  # warm-up, and the bytes of one handoff
        nbytes = sum(moved)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            handoff()
            times.append(time.perf_counter() - t0 - 0.05)
        rows.append((label, nbytes, statistics.median(times)))
        c.close()
    parent.send("exit")
    proc.join(10)
    dense = rows[0][1]
    print(f"\nsliding-window KV handoff: {SWA_LAYERS} layers x 4 KV heads x 256 bf16, window "
          f"{SWA_WINDOW}, prompt {SWA_PROMPT} tokens, median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<34}{'MiB moved':>10}{'KiB/token':>11}{'vs dense':>10}{'ms/1K tok':>11}")
    for label, nbytes, t in rows:
        print(f"{label:<34}{nbytes / MiB:>10.1f}{nbytes / SWA_PROMPT / 1024:>11.2f}"
              f"{nbytes / dense:>10.1%}{t * 1e3 / (SWA_PROMPT / 1000):>11.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    swa_rows(args.reps)


if __name__ == "__main__":
    main()
