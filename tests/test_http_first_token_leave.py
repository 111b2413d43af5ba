"""A client that leaves before its first token stops its request at once, streamed or not:
the router's HTTP server (the real app under uvicorn) before a stand-in service whose first
delta waits, as a prompt queued behind others does. Without this, a request whose client has
gone still takes its turn at prefill and holds its blocks; after an overload, a backlog of them
stalls every request that comes next. No cluster, no model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from polling import wait_for

from bench.serving.http_standin import StandinService
from kvrelay.router.http_api import HttpServer
from kvrelay.router.lifecycle import GenerateSpec
from kvrelay.router.outputs import Delta


class _Service(StandinService):
    """Holds each request before its first delta until ``release`` is set; records what
    became of it: ``closed`` (its stream was closed) and ``delivered`` (deltas it yielded)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.started: set[str] = set()
        self.closed: set[str] = set()
        self.delivered: dict[str, int] = {}

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Delta]:
        rid, n = spec.request_id, spec.sampling.max_tokens
        self.started.add(rid)
        try:
            await self.release.wait()  # queued behind other prompts
            for i in range(n):
                self.delivered[rid] = self.delivered.get(rid, 0) + 1
                yield self.delta(spec, i)
        finally:
            self.closed.add(rid)


@pytest.fixture
def server() -> Iterator[tuple[int, _Service, asyncio.AbstractEventLoop]]:
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        svc = _Service()
        s = HttpServer(svc, None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        await s.start()
        box.update(port=s.port, svc=svc, stop=asyncio.Event(), loop=asyncio.get_running_loop())
        started.set()
        await box["stop"].wait()
        svc.release.set()
        await s.stop()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert started.wait(30)
    yield box["port"], box["svc"], box["loop"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(10)


def _send(port: int, rid: str, stream: bool) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": stream,
                       "request_id": rid}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)
    return s


def _read_all(s: socket.socket) -> bytes:
    buf = b""
    with s:
        while got := s.recv(65536):
            buf += got
    return buf


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_leaving_before_the_first_token_closes_the_request(server, stream: bool) -> None:
    port, svc, loop = server
    stays, leaves = _send(port, "stays", stream), _send(port, "leaves", stream)
    wait_for(lambda: {"stays", "leaves"} <= svc.started, 10, "the requests starting",
             every=0.02)
    leaves.close()
    # The stream of the request whose client left is closed while it still waits, before
    # it yields anything; the other one keeps waiting.
    wait_for(lambda: "leaves" in svc.closed, 10, "the request ending with its client",
             every=0.02)
    assert "leaves" not in svc.delivered and "stays" not in svc.closed
    loop.call_soon_threadsafe(svc.release.set)
    answer = _read_all(stays)
    assert answer.startswith(b"HTTP/1.1 200")
    if stream:
        events = [json.loads(line[6:]) for line in answer.decode().split("\n")
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        text = json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]
    assert text == " t0 t1 t2 t3"
    assert svc.delivered["stays"] == 4 and "leaves" not in svc.delivered
