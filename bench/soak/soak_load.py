"""The soak test's load: ``--concurrency`` clients, each looping over a weighted mix of requests.

gRPC streams, HTTP completions (streamed and not), chat, prompts of a few to a thousand tokens,
prompts sharing a long prefix, streams cancelled part way, requests that hit their deadline,
and malformed requests the router must refuse. Every outcome is counted as expected or not;
none stops the soak.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import grpc
import httpx

from bench.soak.soak_cluster import SERVED
from kvrelay.common.rpc import CHANNEL_OPTIONS
from kvrelay.local_cluster import Cluster
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

# -- load -----------------------------------------------------------------------------------------
KINDS = {  # kind: weight
    "grpc_stream": 4, "grpc_prefix": 2, "grpc_cancel": 1, "grpc_deadline": 1,
    "http_stream": 3, "http_plain": 2, "http_chat": 2, "http_invalid": 1, "grpc_invalid": 1,
}


class Load:
    def __init__(self, cluster: Cluster, concurrency: int, seed: int, vocab: int):
        self.cluster = cluster
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.outcomes: Counter[str] = Counter()
        self.tokens_out = 0
        self.unexpected: list[str] = []
        self.shared_prefix = [self.rng.randrange(10, vocab) for _ in range(512)]
        self._stop = asyncio.Event()

    def _ids(self, rng: random.Random) -> list[int]:
        n = rng.choice([8, 32, 128, 256, 512, 1024])
        return [rng.randrange(10, self.vocab) for _ in range(n)]

    def _note(self, kind: str, ok: bool, what: str = "") -> None:
        self.outcomes[f"{kind}:{'ok' if ok else 'unexpected'}"] += 1
        if not ok and len(self.unexpected) < 50:
            self.unexpected.append(f"{kind}: {what}"[:300])

    async def run(self, seconds: float) -> None:
        async with httpx.AsyncClient(base_url=self.cluster.http_url, timeout=120) as http, \
                grpc.aio.insecure_channel(self.cluster.address,
                                          options=CHANNEL_OPTIONS) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            until = time.monotonic() + seconds
            await asyncio.gather(*(self._client(k, stub, http, until)
                                   for k in range(self.concurrency)))

    async def _client(self, k: int, stub: Any, http: httpx.AsyncClient, until: float) -> None:
        rng = random.Random(self.rng.random())
        kinds, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            try:
                await getattr(self, "_" + kind)(rng, stub, http)
            except Exception as e:  # counted, never fatal: the soak goes on
                self._note(kind, False, f"{type(e).__name__}: {e}")

    # gRPC
    async def _grpc(self, stub: Any, ids: list[int], max_tokens: int, **kw: Any) -> int:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **kw)
        req.token_ids.ids.extend(ids)
        n = 0
        async for msg in stub.Generate(req, timeout=120):
            n += len(msg.token_ids)
        return n

    async def _grpc_stream(self, rng, stub, http) -> None:
        n = rng.randint(8, 64)
        got = await self._grpc(stub, self._ids(rng), n)
        self.tokens_out += got
        self._note("grpc_stream", got == n, f"{got} of {n} tokens")

    async def _grpc_prefix(self, rng, stub, http) -> None:
        ids = self.shared_prefix + [rng.randrange(10, self.vocab) for _ in range(rng.randint(1,
                                                                                          64))]
        got = await self._grpc(stub, ids, 16)
        self.tokens_out += got
        self._note("grpc_prefix", got == 16, f"{got} of 16 tokens")

    async def _grpc_cancel(self, rng, stub, http) -> None:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=200, temperature=0.0,
                                                            ignore_eos=True))
        req.token_ids.ids.extend(self._ids(rng))
        call = stub.Generate(req, timeout=120)
        stop_after = rng.randint(0, 5)  # 0: before the first token (mid-prefill)
        if stop_after == 0:
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            call.cancel()
        else:
            seen = 0
            async for _ in call:
                seen += 1
                if seen >= stop_after:
                    call.cancel()
                    break
        self._note("grpc_cancel", True)

    async def _grpc_deadline(self, rng, stub, http) -> None:
        try:
            await self._grpc(stub, self._ids(rng), 2000, timeout_ms=rng.randint(50, 500))
            self._note("grpc_deadline", False, "finished 2000 tokens within its deadline")
        except grpc.aio.AioRpcError as e:
            self._note("grpc_deadline", e.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"{e.code().name} {e.details()}")

    async def _grpc_invalid(self, rng, stub, http) -> None:
        req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
            max_tokens=4, temperature=rng.choice([-1.0, 1000.0])))
        try:
            async for _ in stub.Generate(req, timeout=30):
                pass
            self._note("grpc_invalid", False, "served")
        except grpc.aio.AioRpcError as e:
            self._note("grpc_invalid", e.code() == grpc.StatusCode.INVALID_ARGUMENT,
                       f"{e.code().name} {e.details()}")

    # HTTP
    async def _http_stream(self, rng, stub, http) -> None:
        n = rng.randint(8, 64)
        body = {"model": SERVED, "prompt": self._ids(rng), "max_tokens": n, "stream": True,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        got, done = None, False
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                self._note("http_stream", False, f"HTTP {r.status_code}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        got = doc["usage"]["completion_tokens"]
        self.tokens_out += got or 0
        self._note("http_stream", done and got == n, f"done={done} {got} of {n} tokens")

    async def _http_plain(self, rng, stub, http) -> None:
        n = rng.randint(4, 32)
        r = await http.post("/v1/completions", json={
            "model": SERVED, "prompt": self._ids(rng), "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stop": ["zzzz"]})
        got = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else 0
        self.tokens_out += got or 0
        self._note("http_plain", got == n, f"HTTP {r.status_code} {r.text[:100]}")

    async def _http_chat(self, rng, stub, http) -> None:
        msgs = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": f"Tell me about the number {rng.randint(0, 999)}."}]
        r = await http.post("/v1/chat/completions", json={
            "model": SERVED, "messages": msgs, "max_tokens": rng.randint(4, 32),
            "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 100)})
        ok = r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        if ok:
            self.tokens_out += r.json()["usage"]["completion_tokens"]
        self._note("http_chat", ok, f"HTTP {r.status_code} {r.text[:100]}")

    async def _http_invalid(self, rng, stub, http) -> None:
        body = rng.choice([{"model": SERVED, "prompt": "", "max_tokens": 4},
                           {"model": SERVED, "prompt": [999999], "max_tokens": 4},
                           {"model": SERVED, "prompt": "x", "max_tokens": 0}])
        r = await http.post("/v1/completions", json=body)
        self._note("http_invalid", r.status_code == 400, f"HTTP {r.status_code}")
