"""The router's HTTP layer alone: CPU per request and per streamed token, no cluster.

The real FastAPI app (``router.http_api.HttpServer``) runs in this process behind uvicorn on
loopback, in front of a stand-in service that answers at once: each request streams
``--tokens`` one-token deltas. Client threads (a separate process, so its CPU is not counted)
keep ``--concurrency`` requests open. Printed: requests/s, streamed tokens/s, and the
server process's CPU seconds per request and per 1000 tokens (the number to compare between
commits: it does not depend on how fast the machine is at the moment as much as rates do).

    .venv/bin/python -m bench.serving.router_http [--requests 2000] [--tokens 32] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, tokens: int, ready: Any, done: Any, cpu: Any) -> None:
    from bench.serving.http_standin import StandinService
    from kvrelay.router.http_api import HttpServer

    async def main() -> None:
        server = HttpServer(StandinService(), None,  # type: ignore[arg-type]
                            host="127.0.0.1", port=port)
        await server.start()
        ready.set()
        c0 = time.process_time()
        while not done.is_set():
            await asyncio.sleep(0.05)
        cpu.value = time.process_time() - c0
        await server.stop()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    port = _free_port()
    ctx = mp.get_context("spawn")
    ready, done, cpu = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(target=_serve, args=(port, args.tokens, ready, done, cpu), daemon=True)
    proc.start()
    if not ready.wait(60):
        sys.exit("server did not start")
    body = {"model": "demo", "prompt": "hi", "max_tokens": args.tokens, "stream": args.stream}
    left = [args.requests]
    lock = threading.Lock()
    got_tokens = [0]

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                if args.stream:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        n = sum(1 for line in r.iter_lines()
                                if line.startswith("data: {") and '"text"' in line)
                else:
                    r = c.post("/v1/completions", json=body)
                    n = json.loads(r.content)["usage"]["completion_tokens"]
                with lock:
                    got_tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    proc.join(30)
    mode = "stream" if args.stream else "plain"
    print(f"router HTTP ({mode}, {args.tokens} tokens/request, {args.requests} requests, "
          f"{got_tokens[0]} tokens): {args.requests / wall:.0f} req/s, "
          f"{got_tokens[0] / wall:.0f} tok/s; server CPU "
          f"{cpu.value / args.requests * 1e3:.2f} ms/request, "
          f"{cpu.value / max(1, got_tokens[0]) * 1e6:.1f} ms/1000 tokens")


if __name__ == "__main__":
    main()
