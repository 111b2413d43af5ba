"""The load generator's HTTP side: streaming ``/v1/completions`` requests over aiohttp, read as SSE.

``run_requests`` sends each request at its scheduled time and fills a ``RequestResult`` per
request from the time-stamped SSE chunks; every request has a timeout, and the run a deadline
after which the requests still open are cancelled and counted as failed.

The client shares the cores of the server it measures, so what it costs per streamed token is
taken from the server: aiohttp (C HTTP parser, as ``vllm bench serve`` uses) and orjson. With
httpx (pure-Python h11 over anyio) and ``json.loads`` the client took 2.4-3.7 CPU-seconds of a
9-second saturation run of the tiny model (200 x 256->32), more than the router; now 0.7-0.9.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from bench.serving.metrics import RequestResult, RunResult
from bench.serving.workloads import RequestSpec

# the load generator's logger: its log lines read as before
logger = logging.getLogger("bench.serving.loadgen")


# -- SSE --------------------------------------------------------------------------------------
class SSEParser:
    """Incremental Server-Sent-Events parser: bytes in, the ``data`` payload of each event out.

    Handles ``\\n``, ``\\r\\n`` and ``\\r`` line ends, events split across network chunks,
    multi-line data (joined with ``\\n``), comments and other fields (ignored).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes | str) -> list[str]:
        text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buf += text.replace("\r\n", "\n").replace("\r", "\n")
        out: list[str] = []
        while True:
            nl = self._buf.find("\n")
            if nl < 0:
                break
            line, self._buf = self._buf[:nl], self._buf[nl + 1:]
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
        return out

    def close(self) -> list[str]:
        """Events still open at the end of the stream (a server that omits the last blank line)."""
        out = self.feed("\n\n") if self._buf else []
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out


def chunk_tokens(doc: dict[str, Any]) -> int:
    """Tokens an OpenAI completion chunk carries: ``token_ids`` when sent, else 1 per choice.

    A chunk with no choices (the usage chunk) carries none; every chunk with a choice counts as
    one token event (servers may send an empty ``text`` for a token whose bytes are incomplete).
    """
    n = 0
    for ch in doc.get("choices") or []:
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            n += len(ids)
        elif ch.get("text") or ch.get("delta") or ch.get("finish_reason") is None:
            n += 1
    return n


_JSON = {"Content-Type": "application/json"}


# -- one request -----------------------------------------------------------------------------------
def completion_body(model: str, spec: RequestSpec,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": spec.prompt_token_ids, "max_tokens": spec.max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if extra:
        body.update(extra)
    return body


async def _stream_one(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      res: RequestResult, t0: float) -> None:
    """Send one streaming request and fill ``res`` (raises on transport errors)."""
    parser = SSEParser()
    data = orjson.dumps(body)
    sent = time.perf_counter()
    res.sent_s = sent - t0
    first: float | None = None
    last = sent
    async with client.post(url, data=data, headers=_JSON) as resp:
        res.status = resp.status
        if resp.status != 200:
            text = (await resp.read()).decode("utf-8", errors="replace")
            res.error = f"HTTP {resp.status}: {text[:300]}"
            return
        done = False

        def handle(payloads: list[str], now: float) -> None:
            nonlocal done, first
            for payload in payloads:
                if payload.strip() == "[DONE]":
                    done = True
                    continue
                try:
                    doc = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    res.error = f"bad SSE payload: {payload[:200]}"
                    continue
                if "error" in doc:
                    err = doc["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    continue
                n = chunk_tokens(doc)
                if n:
                    if first is None:
                        first = now
                    res.chunk_times_s.append(now - t0)
                    res.chunk_tokens.append(n)
                usage = doc.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])

        async for raw in resp.content.iter_any():
            last = time.perf_counter()
            handle(parser.feed(raw), last)
        handle(parser.close(), last)
        if not done and res.error is None:
            res.error = "stream ended without [DONE]"
    end = last
    res.output_tokens = (res.usage_tokens if res.usage_tokens is not None
                         else sum(res.chunk_tokens))
    if first is not None:
        res.ttft_ms = (first - sent) * 1e3
        res.e2e_ms = (end - sent) * 1e3
        if res.output_tokens > 1:
            res.tpot_ms = (res.e2e_ms - res.ttft_ms) / (res.output_tokens - 1)
    if res.error is None and first is None:
        res.error = "no tokens"
    res.success = res.error is None


# -- one run ---------------------------------------------------------------------------------------
async def run_requests(base_url: str, model: str, specs: Sequence[RequestSpec],
                       arrivals: Sequence[float], *, timeout_s: float = 120.0,
                       run_timeout_s: float | None = None, api_key: str | None = None,
                       extra_body: dict[str, Any] | None = None) -> RunResult:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds after the start; wait for all (bounded)."""
    if len(specs) != len(arrivals):
        raise ValueError("one arrival time per request")
    url = base_url.rstrip("/") + "/v1/completions"
    n = max(1, len(specs))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    # Each request's whole time is bounded by asyncio.wait_for below; here only the connect.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout_s))
    results = [RequestResult(s.index, s.kind, s.prompt_tokens, s.max_tokens, a)
               for s, a in zip(specs, arrivals, strict=True)]
    if run_timeout_s is None:
        run_timeout_s = (max(arrivals) if arrivals else 0.0) + timeout_s + 30.0
    started_at = time.time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 4),
                                     timeout=timeout, headers=headers) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, res: RequestResult) -> None:
            delay = res.scheduled_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(
                    _stream_one(client, url, completion_body(model, spec, extra_body), res, t0),
                    timeout=timeout_s)
            except asyncio.TimeoutError:
                res.error = f"timeout after {timeout_s:g}s"
            except asyncio.CancelledError:
                res.error = res.error or "cancelled at the run deadline"
                raise
            except aiohttp.ClientError as e:
                res.error = f"{type(e).__name__}: {e}"
            except Exception as e:  # a bench run records failures, it does not stop on them
                logger.exception("request %d failed", spec.index)
                res.error = f"{type(e).__name__}: {e}"
            if res.error is not None:
                res.success = False

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(specs, results, strict=True)]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                logger.warning("run deadline (%.0fs): cancelled %d open requests",
                               run_timeout_s, len(pending))
                await asyncio.gather(*pending, return_exceptions=True)
                for r in results:
                    if r.error is None and not r.success:
                        r.error = "cancelled at the run deadline"
        ends = [r.sent_s + r.e2e_ms / 1e3 for r in results
                if r.sent_s is not None and r.e2e_ms is not None]
        duration = max(ends) if ends else time.perf_counter() - t0
    return RunResult(results, max(duration, 1e-9), started_at)


# -- the served model ------------------------------------------------------------------------------
async def fetch_model_name(base_url: str, api_key: str | None = None,
                           timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     headers=headers) as client, \
            client.get(base_url.rstrip("/") + "/v1/models", raise_for_status=True) as r:
        return str((await r.json())["data"][0]["id"])
