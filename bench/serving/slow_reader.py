"""Where a slow reader's messages pile up, and how many it gets: one request at a time on a
1P1D cluster of the tiny model, read fast and read slowly, over gRPC and over SSE.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.serving.slow_reader [--tokens 300] [--pause 0.05]

Each row is one greedy request of ``--tokens`` tokens (ignore_eos). Readers: *fast* reads as
the stream comes; *slow* sleeps ``--pause`` between reads (a gRPC message, or a 300-byte socket
read); *small window* is a slow gRPC client without BDP probing and a 1 KiB stream window;
*4 KiB rcvbuf* a slow SSE client with a 4 KiB socket receive buffer. Printed per row: messages
(gRPC) or SSE events, tokens, bytes (SSE), when the client had read the whole stream, and when
the router had handed its last token out (the trace's ``finished`` event): a router done long
before its client means the backlog sat past the router (the client's kernel or gRPC library),
one message per token, where nothing can merge it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import grpc

from kvrelay.client import sampling
from kvrelay.local_cluster import Cluster
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]
PROMPT = "The quick brown fox jumps over the lazy dog."
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def grpc_row(c: Cluster, tokens: int, pause: float,
             options: list[tuple[str, Any]] | None = None) -> tuple[dict[str, Any], list[int]]:
    req = pb.GenerateRequest(text=PROMPT, sampling=sampling(tokens, 0.0, ignore_eos=True))
    with grpc.insecure_channel(c.address, options=options or []) as ch:
        t0 = time.monotonic()
        msgs = []
        for m in generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=600):
            msgs.append(m)
            if pause:
                time.sleep(pause)
        done = time.monotonic() - t0
    fin = [e.t_ms for e in msgs[-1].trace if e.name == "finished"]
    ids = [t for m in msgs for t in m.token_ids]
    return {"messages": len(msgs), "tokens": len(ids), "client_s": done,
            "router_s": fin[0] / 1000 if fin else float("nan")}, ids


def sse_row(c: Cluster, tokens: int, pause: float, rcvbuf: int | None = None) -> dict[str, Any]:
    host, port = c.http_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "return_trace": True}).encode()
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(60)
    s.connect((host, int(port)))
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body)
        t0, buf = time.monotonic(), b""
        while b"data: [DONE]" not in buf:
            got = s.recv(300 if pause else 65536)
            if not got:
                break
            buf += got
            if pause:
                time.sleep(pause)
        done = time.monotonic() - t0
    events = [json.loads(line[6:]) for line in buf.decode().split("\n")
              if line.startswith("data: {")]
    fin = [x["t_ms"] for e in events for x in e.get("kvrelay_trace", [])
           if x["name"] == "finished"]
    return {"events": len(events), "bytes": len(buf), "client_s": done,
            "router_s": fin[0] / 1000 if fin else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".bench-out/models/tiny")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--pause", type=float, default=0.05)
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        subprocess.run([*KVRELAY, "demo-model", args.model], check=True)
    print(f"model {args.model}; {args.tokens} tokens a request, slow readers pause "
          f"{args.pause * 1e3:.0f} ms between reads; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as wd, \
            Cluster(args.model, Path(wd), prefill=1, decode=1,
                    router_args=("--http-port", "0", "--served-model-name", "demo")) as c:
        grpc_row(c, args.tokens, 0.0)  # warm-up
        rows: list[tuple[str, dict[str, Any]]] = []
        fast, ids = grpc_row(c, args.tokens, 0.0)
        rows.append(("gRPC fast", fast))
        for name, opts in (("gRPC slow", None), ("gRPC slow, small window", SMALL_WINDOW)):
            row, got = grpc_row(c, args.tokens, args.pause, opts)
            assert got == ids, f"{name}: token ids differ from the fast reader's"
            rows.append((name, row))
        rows.append(("SSE fast", sse_row(c, args.tokens, 0.0)))
        rows.append(("SSE slow", sse_row(c, args.tokens, args.pause)))
        rows.append(("SSE slow, 4 KiB rcvbuf", sse_row(c, args.tokens, args.pause, 4096)))
    print(f"{'reader':<26} {'msgs':>5} {'bytes':>7} {'client done':>12} {'router done':>12}")
    for name, r in rows:
        n = r.get("messages", r.get("events"))
        size = f"{r['bytes']:>7}" if "bytes" in r else f"{'':>7}"
        print(f"{name:<26} {n:>5} {size} {r['client_s']:>11.2f}s {r['router_s']:>11.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
