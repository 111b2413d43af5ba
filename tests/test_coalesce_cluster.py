"""Slow readers against the shared disaggregated cluster (1 prefill, 2 decode): a client reading
slower than tokens come gets fewer messages than tokens, over SSE and over gRPC, with the same
tokens, text, logprobs, finish reason and usage as a fast reader of the same greedy or seeded
request; ``n > 1`` choices keep their own output; a slow client that leaves still frees its
request at once.

The slow clients keep their receive windows small (a 4 KiB socket buffer; gRPC without BDP
probing and a 1 KiB stream window): with the defaults, a loopback client's kernel or gRPC
library takes the whole stream in before it reads a byte, and the router never sees it lag."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import api_fixtures
import grpc
import httpx
import pytest

from kvrelay.client import sampling
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
PAUSE = 0.05  # the slow clients' pause between reads
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]

cluster, oai = api_fixtures.cluster, api_fixtures.oai


def _events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]


def _dechunk(payload: bytes) -> bytes:
    """An HTTP/1.1 chunked body, decoded."""
    out, rest = b"", payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def _slow_sse(url: str, body: dict[str, Any], read: int = 512) -> list[dict[str, Any]]:
    """The events of a streamed request read ``read`` bytes at a time, ``PAUSE`` apart, through
    a 4 KiB socket receive buffer."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect((host, int(port)))
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
                  + data)
        buf, deadline = b"", time.monotonic() + 120
        while b"data: [DONE]" not in buf:
            assert time.monotonic() < deadline, "the stream did not end"
            got = s.recv(read)
            if not got:
                break
            buf += got
            time.sleep(PAUSE)
    head, _, payload = buf.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    return _events(_dechunk(payload).decode())


def _sse_output(events: list[dict[str, Any]]) -> dict[str, Any]:
    chunks = [e["choices"][0] for e in events if e["choices"]]
    return {"text": "".join(c["text"] for c in chunks),
            "tokens": [t for c in chunks for t in c["logprobs"]["tokens"]],
            "logprobs": [x for c in chunks for x in c["logprobs"]["token_logprobs"]],
            "finish": [c["finish_reason"] for c in chunks if c["finish_reason"]],
            "usage": [e["usage"] for e in events if e.get("usage")]}


def test_a_slow_sse_reader_gets_fewer_events_with_the_same_output(cluster) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "logprobs": 1, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    r = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=120)
    fast = _events(r.text)
    slow = _slow_sse(cluster.http_url, body)
    f, s = _sse_output(fast), _sse_output(slow)
    assert len(f["tokens"]) == 200
    assert len([e for e in slow if e["choices"]]) < 200 * 3 // 4  # several tokens an event
    assert s["text"] == f["text"] and s["tokens"] == f["tokens"]
    assert s["logprobs"] == pytest.approx(f["logprobs"], abs=1e-4)
    assert s["finish"] == f["finish"] == ["length"]
    assert len(s["usage"]) == 1 and slow[-1]["usage"]  # the last event
    counts = ("prompt_tokens", "completion_tokens")  # (the second one hits the prefix cache)
    assert [slow[-1]["usage"][k] for k in counts] == [fast[-1]["usage"][k] for k in counts]


def _grpc(cluster, params: pb.SamplingParams, *, slow: bool) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(cluster.address,
                               options=SMALL_WINDOW if slow else []) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = []
        for m in stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=params), timeout=120):
            msgs.append(m)
            if slow:
                time.sleep(PAUSE)
    return msgs


def _choice(msgs: list[pb.GenerateResponse], i: int) -> tuple[str, list[int], list[int]]:
    mine = [m for m in msgs if m.index == i]
    return ("".join(m.text for m in mine), [t for m in mine for t in m.token_ids],
            [m.finish_reason for m in mine if m.finish_reason])


def test_a_slow_grpc_reader_gets_fewer_messages_with_the_same_output(cluster) -> None:
    params = sampling(200, 0.0, ignore_eos=True)
    fast = _grpc(cluster, params, slow=False)
    slow = _grpc(cluster, params, slow=True)
    assert len(slow) < 200 // 2
    assert _choice(slow, 0) == _choice(fast, 0)
    assert len(_choice(slow, 0)[1]) == 200
    assert slow[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [m.HasField("usage") for m in slow].count(True) == 1 and slow[-1].HasField("usage")
    assert (slow[-1].usage.prompt_tokens, slow[-1].usage.completion_tokens) \
        == (fast[-1].usage.prompt_tokens, fast[-1].usage.completion_tokens)
    assert slow[-1].usage.completion_tokens == 200


def test_a_slow_reader_of_n_choices_gets_each_choice_whole(cluster) -> None:
    params = sampling(60, 0.9, ignore_eos=True, n=3, seed=11)
    fast = _grpc(cluster, params, slow=False)
    slow = _grpc(cluster, params, slow=True)
    assert len(slow) < 3 * 60
    for i in range(3):
        text, ids, finish = _choice(slow, i)
        assert (text, ids, finish) == _choice(fast, i)
        assert len(ids) == 60 and finish == [pb.FINISH_REASON_LENGTH]
    assert slow[-1].HasField("usage") and slow[-1].usage.completion_tokens == 180
    assert len({_choice(slow, i)[0] for i in range(3)}) > 1


def _wait_freed(cluster, baseline: dict[str, int]) -> None:
    """Every decode worker stops generating and every KV block comes back (bounded)."""
    deadline = time.monotonic() + 30
    while any(cluster.status(p).load.running for p in cluster.live("decode")):
        assert time.monotonic() < deadline, "the request kept generating"
        time.sleep(0.1)
    assert cluster.wait_free_blocks(baseline) == baseline


def test_a_slow_reader_leaving_frees_its_request(cluster) -> None:
    baseline = cluster.idle_free_blocks()
    with grpc.insecure_channel(cluster.address, options=SMALL_WINDOW) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        call = stub.Generate(pb.GenerateRequest(
            text=PROMPT, sampling=sampling(3000, 0.0, ignore_eos=True)), timeout=120)
        got = 0
        for m in call:
            got += len(m.token_ids)
            time.sleep(PAUSE)  # slow: once the window is full, the router reads ahead
            if got >= 100:  # (a message of many tokens: it does)
                break
        call.cancel()
    _wait_freed(cluster, baseline)


def test_a_slow_sse_reader_leaving_frees_its_request(cluster) -> None:
    baseline = cluster.idle_free_blocks()
    host, port = cluster.http_url.removeprefix("http://").split(":")
    data = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 3000, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect((host, int(port)))
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        assert s.recv(512)
        time.sleep(1.5)  # not reading: the router's sends wait for the client
        for _ in range(4):
            assert s.recv(512)
            time.sleep(PAUSE)
    _wait_freed(cluster, baseline)
