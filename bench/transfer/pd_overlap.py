"""Is the KV transfer hidden behind prefill compute? TTFT with streaming / TTFT of prefill alone.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.pd_overlap [--model DIR] [--tokens 2048]

Two real engines in two processes on this machine, each pinned to its own core: a decode-role
engine (the receiver: ``EngineCore.reserve`` with a ``KVExpectation``, stepping as a decode
worker does) and, here, a prefill-role engine with the NIXL connector. For one prompt of
``--tokens`` tokens on the ~150M demo model (written to a temporary directory unless ``--model``)
it measures, alternating to cancel drift:

- alone: the prefill engine computes the prompt with no destination; time to its first token;
- streamed: the same, with a ``KVDestination`` naming the receiver's reserved blocks; the first
  token is reported only after every layer of every block has been written and the notification
  sent (what a prefill worker returns to the router), and the receiver confirms arrival.

Target: streamed / alone <= 1.10 (layer L is written while layer L+1 computes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams

RECEIVER = "bench-decode"
SENDER = "bench-prefill"


def engine(model: str, role: str, threads: int, blocks: int, connector: object) -> EngineCore:
    cfg = EngineConfig.from_kwargs(model, role=role, num_threads=threads, num_blocks=blocks,
                                   max_num_batched_tokens=2048, enable_prefix_caching=False)
    return EngineCore(cfg, connector, eos_token_ids=frozenset())


def receiver(conn: Connection, model: str, blocks: int, core_id: int | None) -> None:
    """A decode-role engine: reserve on request, step until the KV arrived, report, free."""
    if core_id is not None:
        os.sched_setaffinity(0, {core_id})
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.layout import model_identity
    from kvrelay.kv_transfer.messages import KVExpectation

    c = NixlConnector(NixlConnectorConfig(RECEIVER, model_identity(model)))
    core = engine(model, "decode", 1, blocks, c)
    conn.send(("info", c.peer_info().to_bytes()))
    while True:
        if core.has_unfinished():
            for o in core.step():
                if o.kv_arrived:
                    conn.send(("arrived", o.request_id, time.perf_counter()))
                    core.abort(o.request_id)
        if not conn.poll(0.002):
            continue
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        _, rid, ids, notif = cmd
        res = core.reserve(rid, ids, kv_transfer_params=KVExpectation(notif, timeout_s=60.0))
        conn.send(("reserved", list(res.block_ids)))
    c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="prefill engine compute threads")
    ap.add_argument("--layerwise", default="auto", choices=["auto", "on", "off"],
                    help="the connector's KV streaming (NixlConnectorConfig.layerwise)")
    args = ap.parse_args()
    tmp = None
    model = args.model
    if model is None:
        from kvrelay.engine.demo_model import write_demo_model

        tmp = tempfile.TemporaryDirectory(prefix="kvrelay-overlap-")
        model = write_demo_model(os.path.join(tmp.name, "base"), size="base")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, set(cores[:-1]))
    blocks = args.tokens // 16 + 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, model, blocks,
                                              cores[-1] if len(cores) >= 2 else None),
                       daemon=True)
    proc.start()

    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.layout import model_identity
    from kvrelay.kv_transfer.messages import KVDestination, PeerInfo

    torch.set_num_threads(args.threads)
    c = NixlConnector(NixlConnectorConfig(SENDER, model_identity(model),
                                          layerwise=args.layerwise))
    core = engine(model, "prefill", args.threads, blocks, c)
    if not parent.poll(120):
        raise SystemExit("receiver did not start")
    _, info = parent.recv()
    c.add_peer(PeerInfo.from_bytes(info))
    g = torch.Generator().manual_seed(0)
    vocab = core.vocab_size
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run(i: int, stream: bool) -> float:
        ids = torch.randint(10, vocab - 1, (args.tokens,), generator=g).tolist()
        rid = f"r{i}-{int(stream)}"
        params = None
        if stream:
            notif = f"{rid}|lease".encode()
            parent.send(("reserve", rid, ids, notif))
            _, remote = parent.recv()
            params = KVDestination(RECEIVER, remote, 0, notif)
        t0 = time.perf_counter()
        core.add_request(rid, ids, sp, kv_transfer_params=params)
        done = None
        while done is None:
            for o in core.step():
                if o.request_id == rid and o.finished:
                    done = time.perf_counter()
        if stream:
            if not parent.poll(60):
                raise SystemExit("KV never arrived")
            msg = parent.recv()
            assert msg[0] == "arrived" and msg[1] == rid, msg
        return done - t0

    run(-1, False)
    run(-2, True)  # warm-up: first registration, connection set-up
    alone, streamed = [], []
    for i in range(args.reps):
        alone.append(run(2 * i, False))
        streamed.append(run(2 * i + 1, True))
    a, s = statistics.median(alone), statistics.median(streamed)
    kv_mb = core.runner.kv_spec.bytes_per_block_all_layers * (args.tokens // 16) / 1e6
    print(f"{args.tokens}-token prompt, {kv_mb:.0f} MB of KV, prefill on {args.threads} "
          f"thread(s), receiver on its own core; load average {os.getloadavg()[0]:.2f}")
    print(f"TTFT prefill alone      median {a * 1e3:8.1f} ms  (min {min(alone) * 1e3:.1f})")
    print(f"TTFT prefill + stream   median {s * 1e3:8.1f} ms  (min {min(streamed) * 1e3:.1f})")
    print(f"ratio streamed / alone  {s / a:.3f}  (target <= 1.10)")
    parent.send(("exit",))
    proc.join(10)
    c.close()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
