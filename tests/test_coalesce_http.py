"""The router's HTTP server (``HttpServer``, the real app under uvicorn, plain and TLS) before a
stand-in service streaming one-token deltas: a client that reads slower than they come gets
fewer SSE events than tokens with the same text, because the server's transports push back
early (``http_api.hold_back_unsent``) and the stream coalesces (``router.coalesce``); a fast
client gets the same text. No cluster, no model."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_security import make_certs

from bench.serving.http_standin import StandinService
from kvrelay.common.rpc import TLSFiles
from kvrelay.router.http_api import HttpServer

pytestmark = pytest.mark.slow

TOKENS = 600


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module", params=["plain", "tls"])
def server(request: pytest.FixtureRequest, certs) -> Iterator[tuple[int, ssl.SSLContext | None]]:
    ca, cert, key = certs
    tls = request.param == "tls"
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        svc = StandinService(gap_s=0.001)  # one-token deltas, one every millisecond
        s = HttpServer(svc, None, host="127.0.0.1", port=0,  # type: ignore[arg-type]
                       tls=TLSFiles(str(cert), str(key)) if tls else None)
        await s.start()
        box["port"], box["stop"] = s.port, asyncio.Event()
        box["loop"] = asyncio.get_running_loop()
        started.set()
        await box["stop"].wait()
        await s.stop()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert started.wait(30)
    yield box["port"], ssl.create_default_context(cafile=str(ca)) if tls else None
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(10)


def _stream(port: int, ctx: ssl.SSLContext | None, *, pause: float) -> list[dict[str, Any]]:
    """The SSE events of one streamed completion, read 1 KiB at a time through a 4 KiB socket
    receive buffer, ``pause`` between reads."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(30)
    raw.connect(("127.0.0.1", port))
    s = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx is not None else raw
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": TOKENS,
                       "stream": True}).encode()
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body)
        buf, deadline = b"", time.monotonic() + 120
        while b"data: [DONE]" not in buf:
            assert time.monotonic() < deadline, "the stream did not end"
            got = s.recv(1024)
            if not got:
                break
            buf += got
            if pause:
                time.sleep(pause)
    # Each event is a chunk of its own: its "data: {...}" line is never split.
    return [json.loads(line[6:]) for line in buf.decode().split("\n")
            if line.startswith("data: {")]


def test_a_slow_reader_gets_fewer_events_with_the_same_text(server) -> None:
    port, ctx = server
    fast = _stream(port, ctx, pause=0.0)
    # A read through TLS returns at most one record (an event), so 10 ms is as slow there.
    slow = _stream(port, ctx, pause=0.01 if ctx is not None else 0.02)
    text = "".join(f" t{i}" for i in range(TOKENS))
    for events in (fast, slow):
        assert "".join(e["choices"][0]["text"] for e in events) == text
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
        assert not any(e["choices"][0]["finish_reason"] for e in events[:-1])
    assert len(slow) < TOKENS * 3 // 4
