"""The router carries bytes, ids and text: no torch in its process, nothing slow on its loop.

A router is started the way ``kvrelay router`` starts (``kvrelay.cli.main`` in a fresh process,
on loopback, no workers); a thread in that process waits until it serves, sends requests that
tokenize and template (they end in 503: no workers), and reports whether torch got loaded and
the process's RSS. Tokenization of a large prompt is checked against a coroutine ticking beside
it: the ticks go on while the tokenizer works.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest

from kvrelay.router.service import OFFLOAD_CHARS, RouterService

ROUTER_RSS_LIMIT_MIB = 200  # DESIGN.md: ~100 MiB; with torch a router starts at ~370 MiB

_ENV = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_router_modules_import_no_torch() -> None:
    code = ("import sys, kvrelay.cli, kvrelay.router.server, kvrelay.router.http_api; "
            "kvrelay.cli.build_parser(); print(sorted(m for m in sys.modules "
            "if m == 'torch' or m.startswith(('torch.', 'kvrelay.engine.models', "
            "'kvrelay.engine.sampler', 'kvrelay.engine.model_runner'))))")
    out = subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# Runs in the router's own process, beside kvrelay.cli.main (which owns the main thread).
_PROBE = textwrap.dedent("""
    import json, os, sys, threading, time, urllib.error, urllib.request
    from kvrelay.cli import main

    ready, report, model = sys.argv[1:4]

    def post(port, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, ""
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)["error"]["message"]

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

    def probe():
        deadline = time.monotonic() + 90
        while not os.path.exists(ready):
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.05)
        port = json.load(open(ready))["http_port"]
        idle = rss_kib()
        big = "the quick brown fox jumps over the lazy dog. " * 2000  # 88 KiB: off the loop
        codes = [post(port, "/v1/completions", {"model": "demo", "prompt": "hello"}),
                 post(port, "/v1/completions", {"model": "demo", "prompt": big}),
                 post(port, "/v1/chat/completions",
                      {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
                 post(port, "/v1/chat/completions",
                      {"model": "demo", "messages": [{"role": "user", "content": big}]})]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            codes.append((r.status, ""))
        with open(report + ".tmp", "w") as f:
            json.dump({"torch": sys.modules.get("torch") is not None, "codes": codes,
                       "rss_idle_kib": idle, "rss_kib": rss_kib()}, f)
        os.rename(report + ".tmp", report)
        os.kill(os.getpid(), 15)  # SIGTERM: the router's own shutdown path

    threading.Thread(target=probe, daemon=True).start()
    sys.exit(main(["router", "--model", model, "--port", "0", "--control-port", "0",
                   "--http-port", "0", "--served-model-name", "demo", "--ready-file", ready,
                   "--worker-wait", "0.2"]))
""")


@pytest.mark.slow
def test_started_router_carries_no_torch(demo_model_dir: str, tmp_path: Path) -> None:
    ready, report = tmp_path / "router.ready", tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ready), str(report), demo_model_dir], env=_ENV,
        capture_output=True, text=True, timeout=180)
    assert report.exists(), f"router exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(report.read_text())
    assert proc.returncode == 0, proc.stderr
    # Small prompts are tokenized and templated, then refused for want of workers; the large
    # ones are tokenized (off the loop) and found longer than the demo model's context.
    (small, _), (large, why), (small_chat, _), (large_chat, why_chat), (models, _) = got["codes"]
    assert (small, small_chat, models) == (503, 503, 200), got
    assert (large, large_chat) == (400, 400), got
    assert "the prompt has" in why and "the prompt has" in why_chat, got
    assert not got["torch"], "the started router imported torch"
    assert got["rss_kib"] < ROUTER_RSS_LIMIT_MIB * 1024, got


# -- the event loop -----------------------------------------------------------------------------
class _ThreadRecorder:
    """The tokenizer, noting which thread each encode ran on."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.threads: list[str] = []

    def encode(self, *args: Any, **kw: Any) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self._tok.encode(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def service(demo_model_dir: str) -> Any:
    from kvrelay.engine.tokenizer import load_tokenizer

    tok = _ThreadRecorder(load_tokenizer(demo_model_dir))
    lifecycle = types.SimpleNamespace(registry=types.SimpleNamespace(workers={}))
    svc = RouterService(lifecycle, tok, model_name="demo", vocab_size=1 << 30,
                        max_model_len=1 << 30, eos_token_ids=frozenset())
    yield svc
    svc.close()


def _slow_text(tok: Any, at_least_s: float = 0.25) -> str:
    """A text whose tokenization takes at least ``at_least_s`` here (or the largest prompt)."""
    corpus = files("kvrelay.engine").joinpath("demo_corpus.txt").read_text()
    n = 1 << 18
    while True:
        text = (corpus * (n // len(corpus) + 1))[:n]
        t0 = time.perf_counter()
        tok.encode(text)
        if time.perf_counter() - t0 >= at_least_s or n >= 4 << 20:
            return text
        n *= 2


def test_small_input_stays_on_the_loop_large_goes_off(service: Any) -> None:
    tok = service.tokenizer
    tok.threads.clear()
    asyncio.run(service.encode("hello world"))
    asyncio.run(service.encode("x " * OFFLOAD_CHARS))
    asyncio.run(service.encode_chat([{"role": "user", "content": "x " * OFFLOAD_CHARS}]))
    main = threading.main_thread().name
    assert tok.threads[0] == main
    assert all(t != main for t in tok.threads[1:]), tok.threads


@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_large_tokenization_does_not_stall_the_loop(service: Any, kind: str) -> None:
    text = _slow_text(service.tokenizer)

    async def tokenize() -> list[int]:
        if kind == "chat":
            return await service.encode_chat([{"role": "user", "content": text}])
        return await service.encode(text)

    async def run() -> tuple[float, list[float]]:
        ticks: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                await asyncio.sleep(0.01)
                ticks.append(time.perf_counter())

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        ids = await tokenize()
        t1 = time.perf_counter()
        done.set()
        await task
        assert len(ids) > OFFLOAD_CHARS // 8
        return t1 - t0, [t0, *(t for t in ticks if t0 < t < t1), t1]

    took, marks = asyncio.run(run())
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    # On the loop, the longest gap is the whole tokenization and no tick lands inside it.
    # Off the loop the ticker keeps going: its longest pause is a small part of the work.
    assert len(marks) - 2 >= 3, (took, marks)
    assert max(gaps) < took / 2, (took, max(gaps))
