"""KV bytes per token and P -> D handoff time, multi-head latent attention vs per-head K/V.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.mla_kv [--reps 5] [--prompt 1024]

Three layer shapes of DeepSeek-V3's width (hidden 7168, 128 query heads), bf16, ``--layers``
layers, a prompt handed from a prefill-side connector to a decode-side one in another process
(NIXL over UCX), the engine's path (512-token chunks, each step's writes posted as it ends, then
the notification), as ``kv_transfer --swa`` does:

  - MLA: DeepSeek-V3's latent cache, one plane of 512 + 64 per token per layer;
  - GQA: the same width with 8 KV heads of 128 (the usual dense model of that width), K and V;
  - MHA: V3's 128 heads of 128 uncompressed, K and V (what MLA replaces).

Columns: bytes a handoff moved (counted from the transport's writes), KiB per token (all
layers), the share of the GQA row's, and the median milliseconds per 1K prompt tokens from the
first chunk to the notification. Times move with the shared machine's load (printed).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache

MiB = 1 << 20
MODEL_ID = "bench-mla"
BS, CHUNK = 16, 512
# label -> (KV heads, head dim, planes) of one layer's cache
SHAPES = {
    "MLA (DeepSeek-V3: latent 512 + rope 64)": (1, 576, 1),
    "GQA (8 KV heads x 128, same width)": (8, 128, 2),
    "MHA (128 heads x 128, uncompressed)": (128, 128, 2),
}


def spec_of(shape: tuple[int, int, int], layers: int, prompt: int) -> KVCacheSpec:
    heads, dim, planes = shape
    return KVCacheSpec(layers, heads, dim, BS, prompt // BS + 4, "bfloat16", planes=planes)


def _receiver(conn: Connection, name: str, spec: dict[str, Any], prompt: int) -> None:
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


def handoff_row(label: str, spec: KVCacheSpec, prompt: int, reps: int) -> tuple[int, float]:
    """(bytes one handoff moved, median seconds of a handoff) for ``spec``."""
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tag = f"{label[:3].lower()}-{os.getpid()}"
    proc = ctx.Process(target=_receiver, args=(child, f"recv-{tag}", asdict(spec), prompt),
                       daemon=True)
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
    n = prompt // BS
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=1024, help="tokens (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for label, shape in SHAPES.items():
        spec = spec_of(shape, args.layers, args.prompt)
        nbytes, t = handoff_row(label, spec, args.prompt, args.reps)
        per_token = spec.bytes_per_block_all_layers // BS
        assert nbytes == per_token * args.prompt, (label, nbytes, per_token)
        rows.append((label, nbytes, t))
    gqa = rows[1][1]
    print(f"\nKV handoff P -> D: {args.layers} layers of DeepSeek-V3's width, bf16, prompt "
          f"{args.prompt} tokens, median of {args.reps}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'layer cache':<42}{'MiB moved':>10}{'KiB/token':>11}{'vs GQA':>9}{'ms/1K tok':>11}")
    for label, nbytes, t in rows:
        print(f"{label:<42}{nbytes / MiB:>10.2f}{nbytes / args.prompt / 1024:>11.2f}"
              f"{nbytes / gqa:>9.1%}{t * 1e3 / (args.prompt / 1000):>11.2f}")
    print("\nper token per layer (bytes, bf16): " + ", ".join(
        f"{label.split(' (')[0]} {spec_of(s, 1, BS).bytes_per_block_all_layers // BS}"
        for label, s in SHAPES.items()))


if __name__ == "__main__":
    main()
