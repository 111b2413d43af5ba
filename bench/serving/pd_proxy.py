"""The vLLM P/D proxy: what ``vllm-pd`` is loaded through (``run_serving.py pd-proxy``).

It follows vLLM's documented disaggregated flow: prefill with ``max_tokens=1`` and
``kv_transfer_params.do_remote_decode``, then decode with the ``kv_transfer_params`` the
prefill answered, streamed back as the decode server sends it. Its HTTP client is aiohttp (C
parser; what vLLM's own proxies use), so the proxy takes little of the cores the two servers
share.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp


def build_pd_proxy(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> Any:
    """A Starlette app: prefill (max_tokens=1, do_remote_decode) then stream from decode."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, aiohttp.ClientSession]]:
        async with aiohttp.ClientSession(  # in the serving loop, closed with the app
                connector=aiohttp.TCPConnector(limit=2048),
                timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)) as session:
            yield {"client": session}  # request.state.client

    async def completions(request: Request) -> Response:
        body = await request.json()
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        async with request.state.client.post(prefill_url + "/v1/completions", json=pre) as r:
            if r.status != 200:
                return Response(await r.read(), status_code=r.status,
                                media_type=r.headers.get("content-type"))
            params = (await r.json()).get("kv_transfer_params")
        resp = await request.state.client.post(decode_url + "/v1/completions",
                                   json={**body, "kv_transfer_params": params})
        if resp.status != 200:
            async with resp:
                return Response(await resp.read(), status_code=resp.status,
                                media_type=resp.headers.get("content-type"))

        async def relay() -> Any:
            async with resp:
                async for chunk in resp.content.iter_any():
                    yield chunk

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"))

    async def models(request: Request) -> Response:
        async with request.state.client.get(decode_url + "/v1/models") as r:
            return Response(await r.read(), status_code=r.status, media_type="application/json")

    async def health(request: Request) -> Response:
        for url in (prefill_url, decode_url):
            async with request.state.client.get(url + "/health") as r:
                if r.status != 200:
                    return JSONResponse({"status": f"{url} unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)],
                     lifespan=lifespan)


def cmd_pd_proxy(argv: Sequence[str]) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="run_serving.py pd-proxy")
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    uvicorn.run(build_pd_proxy(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host,
                port=a.port, log_level="warning", access_log=False)
    return 0
