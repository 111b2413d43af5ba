"""The vLLM P/D proxy: what ``vllm-pd`` is loaded through (``run_serving.py pd-proxy``).

It follows vLLM's documented disaggregated flow: prefill with ``max_tokens=1`` and
``kv_transfer_params.do_remote_decode``, then decode with the ``kv_transfer_params`` the
prefill answered, streamed back as the decode server sends it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import httpx


def build_pd_proxy(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> Any:
    """A Starlette app: prefill (max_tokens=1, do_remote_decode) then stream from decode."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits)

    async def completions(request: Request) -> Response:
        body = await request.json()
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        r = await client.post(prefill_url + "/v1/completions", json=pre)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        dec = {**body, "kv_transfer_params": r.json().get("kv_transfer_params")}
        req = client.build_request("POST", decode_url + "/v1/completions", json=dec)
        resp = await client.send(req, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        async def relay() -> Any:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"))

    async def models(request: Request) -> Response:
        r = await client.get(decode_url + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        for url in (prefill_url, decode_url):
            r = await client.get(url + "/health")
            if r.status_code != 200:
                return JSONResponse({"status": f"{url} unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


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
