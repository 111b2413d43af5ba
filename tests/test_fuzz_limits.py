"""Numeric fields at the edges of the types that carry them, and lists and strings past their
limits, over gRPC and HTTP against a real cluster (the session's shared one, ``api_fixtures``):
some of these requests are served, so they reach the workers.

Such requests are served or refused (INVALID_ARGUMENT / HTTP 4xx, with a message), never
answered with a 5xx or an UNKNOWN; nothing crashes (no process exits, the router logs no
traceback while the module runs), and the cluster still serves a normal request afterwards.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import api_fixtures
import fuzz_support
import grpc
import httpx
import pytest
from fuzz_support import (
    CONTEXT,
    MODEL,
    SETTINGS,
    VOCAB,
    check_still_serving,
    counted,
    http_client,
    raw_generate,
    varint,
    wire_field,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.common.limits import (
    MAX_GRPC_REQUEST_BYTES,
    MAX_HTTP_BODY_BYTES,
    MAX_PROMPT_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from kvrelay.proto import generate_pb2 as pb

pytestmark = pytest.mark.slow

cluster = api_fixtures.cluster
fuzz_liveness = fuzz_support.fuzz_liveness


@pytest.fixture(scope="module")
def probe(cluster):
    """The liveness probe: ``/tokenize`` of a short prompt on the router the fuzz loads,
    answered by the router itself. It measures what the 1 s bound is about, the router's loop
    staying responsive; a completion through the workers measured their CPU share under the
    suite's parallel load instead (a 2-token completion took 1.66 s once in a full `make test`
    on 2 cores, with the router idle)."""
    client = http_client(cluster)
    yield fuzz_support.tokenize_probe(client.post)
    client.close()


@pytest.fixture(scope="module")
def generate(cluster) -> Iterator[grpc.UnaryStreamMultiCallable]:
    """Generate over raw bytes (requests the protobuf library itself would not serialize)."""
    with grpc.insecure_channel(cluster.address) as ch:
        yield raw_generate(ch)


@pytest.fixture(scope="module")
def http(cluster) -> Iterator[httpx.Client]:
    """The router's HTTP API; when the module is done, no process of the cluster that ran when it
    began has exited (the shared cluster keeps the workers an earlier module killed in its list)
    and the router logged no traceback while it ran."""
    start = cluster.router.log.stat().st_size
    running = [p for p in [cluster.router, *cluster.workers] if p.alive()]
    with http_client(cluster) as client:
        yield client
    assert all(p.alive() for p in running), [p.name for p in running if not p.alive()]
    with cluster.router.log.open("rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace")
    for marker in ("Traceback", "Exception in ASGI application", "Unexpected ["):
        assert marker not in log, log[-6000:]

# Every numeric field gets values at the edges of the type that carries it (0, float32 and
# float64 denormals and values that round to 0 in float32, 2**31, 2**32, 2**63, 2**64, NaN,
# +-inf). Each is either served or refused with a 4xx / INVALID_ARGUMENT: never a 5xx (an
# int32 field that overflowed, logits divided by a denormal, ...).
EDGE_INTS = [0, 1, -1, 2, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 - 1, 2**32,
             2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-320, 1e-50, 1e-45, 1.4e-45, 1e-40, 1.1754942e-38,
               1.1754944e-38, 1e-30, 1e-3, 0.5, 1.0, 1.0000001, 2.0, 3.4028235e38, 1e39,
               1.7976931348623157e308, math.nan, math.inf, -math.inf, -1e-45]
edge_numbers = st.one_of(st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_FLOATS),
                         st.sampled_from(EDGE_INTS).map(float))
HTTP_NUMERIC = ["max_tokens", "temperature", "top_p", "top_k", "seed", "timeout_ms", "n",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "stop_token_ids", "prompt_id"]
EDGES = settings(SETTINGS, max_examples=150)


@EDGES
@given(data=st.data())
@counted
def test_http_numeric_edges_never_fail_the_server(http, data) -> None:
    chat = data.draw(st.booleans())
    fields = HTTP_NUMERIC + (["max_completion_tokens", "top_logprobs"] if chat
                             else ["logprobs"])
    body: dict = {"model": MODEL, "max_tokens": 2, "stream": data.draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
        body["logprobs"] = data.draw(st.booleans())
    else:
        body["prompt"] = [1, 2, 3]
    for name in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3,
                                   unique=True)):
        v = data.draw(edge_numbers)
        if name == "stop_token_ids":
            body[name] = [v]
        elif name == "prompt_id":
            body["prompt" if not chat else "stop_token_ids"] = [1, v]
        else:
            body[name] = v
    text = json.dumps(body).encode()  # NaN / Infinity as Python's json writes them
    # A deadline of a millisecond or so may expire before the answer: 504, as it says.
    ok = {200, 400, 504} if "timeout_ms" in body else {200, 400}
    with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions",
                     content=text, headers={"content-type": "application/json"}) as r:
        r.read()
    assert r.status_code in ok, (body, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text
    elif body["stream"]:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text
        assert '"error"' not in r.text or ('"code": 504' in r.text and 504 in ok), r.text
    else:
        assert r.json()["choices"], r.text


def _f32(x: float) -> bytes:
    try:
        return struct.pack("<f", x)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, x))


# (field number, wire encoding) of every numeric field of SamplingParams, by name
_SAMPLING_NUMERIC = {"temperature": (1, "f32"), "top_p": (2, "f32"), "top_k": (3, "varint"),
                     "seed": (4, "varint"), "max_tokens": (5, "varint"),
                     "stop_token_ids": (7, "varint"), "logprobs": (9, "varint")}


def _numeric_field(number: int, how: str, v: float | int) -> bytes:
    if how == "f32":
        return wire_field(number, 5, _f32(float(v)))
    return wire_field(number, 0, varint(int(v) % 2**64))  # negatives: two's complement


@EDGES
@given(data=st.data())
@counted
def test_grpc_numeric_edges_never_fail_the_server(generate, data) -> None:
    ints = st.sampled_from(EDGE_INTS)
    sampling = _numeric_field(5, "varint", 2)  # max_tokens=2 unless drawn below
    top = wire_field(3, 2, varint(3) + wire_field(1, 0, b"\x05") * 3)  # token ids [5, 5, 5]
    names = data.draw(st.lists(st.sampled_from([*_SAMPLING_NUMERIC, "timeout_ms", "prompt_id"]),
                               min_size=1, max_size=3, unique=True))
    for name in names:
        if name in _SAMPLING_NUMERIC:
            number, how = _SAMPLING_NUMERIC[name]
            v = data.draw(st.sampled_from(EDGE_FLOATS) if how == "f32" else ints)
            sampling += _numeric_field(number, how, v)  # a repeated field: the last one wins
        elif name == "timeout_ms":
            top += _numeric_field(5, "varint", data.draw(ints))
        else:
            ids = varint(5) + varint(data.draw(ints) % 2**64)
            top = wire_field(3, 2, varint(len(ids)) + ids)
    raw = top + wire_field(4, 2, varint(len(sampling)) + sampling)
    allowed = {grpc.StatusCode.INVALID_ARGUMENT}
    if "timeout_ms" in names:
        allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)
    try:
        list(generate(raw, timeout=30))
    except grpc.RpcError as e:
        assert e.code() in allowed, (names, e.code(), e.details())
        assert len(e.details() or "") > 5, names


@counted
def test_values_that_overflowed_the_wire_are_refused(http, generate) -> None:
    # top_k >= 2**31 passed validation, then overflowed the int32 field to the workers: a 500.
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]})):
        for stream in (False, True):
            r = http.post(path, json={"model": MODEL, "max_tokens": 2, "top_k": 2**31,
                                      "stream": stream, **extra})
            assert r.status_code == 400 and "top_k" in r.text, r.text
    # A top_p that rounds to 0 in float32 is raised to the smallest one the workers take.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                           "top_p": 1e-50, "temperature": 1e-40})
    assert r.status_code == 200, r.text


@counted
def test_oversized_lists_and_strings_are_refused(cluster, http, generate) -> None:
    def refused(r: httpx.Response, status: int, words: str) -> None:
        assert r.status_code == status, (r.status_code, r.text[:300])
        assert words in r.json()["error"]["message"], r.text[:300]

    # stop_token_ids: bounded in count (each one is copied into every worker message)
    ids = list(range(MAX_STOP_TOKEN_IDS + 1))
    refused(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                               "stop_token_ids": ids}), 400, "at most")
    m = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    m.sampling.stop_token_ids.extend(ids)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(m.SerializeToString(), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most" in e.value.details()
    # a token-id prompt longer than the context is refused by its length, before its ids are
    # scanned (the bad id at the end would take a scan to find)
    long_ids = [7] * (CONTEXT + 10) + [VOCAB]
    refused(http.post("/v1/completions", json={"model": MODEL, "prompt": long_ids,
                                               "max_tokens": 2}), 400, "the prompt has")
    # chat messages: their total size is bounded before they are templated and tokenized
    big = "a" * (MAX_PROMPT_CHARS // 2 + 1)
    refused(http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": big},
                                                      {"role": "user", "content": big}]}),
        400, "characters")
    # the HTTP body: by Content-Length, and counted when chunked
    body = b'{"model": "demo", "prompt": "' + b"a" * MAX_HTTP_BODY_BYTES + b'"}'
    refused(http.post("/v1/completions", content=body,
                      headers={"content-type": "application/json"}), 413, "larger than")

    def chunks():
        for i in range(0, len(body), 2**20):
            yield body[i:i + 2**20]
    refused(http.post("/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"}), 413, "larger than")
    # the public gRPC port takes no message beyond what a maximal valid request needs
    m = pb.GenerateRequest(text="a" * MAX_GRPC_REQUEST_BYTES)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(m.SerializeToString(), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()


@counted
def test_deep_or_many_parts_are_refused_with_a_400(http) -> None:
    """Inputs whose cost is in their shape, not their size: a guided_json nested past the
    parser's recursion (was an HTTP 500), the same nesting inside the body itself, and a chat
    of 200,000 empty messages (was templated on the event loop: 5.2 s, and a small request
    beside it waited as long). The small request here is served while the big one is refused."""
    def refused(r: httpx.Response, words: str) -> None:
        assert r.status_code == 400, (r.status_code, r.text[:300])
        assert words in r.json()["error"]["message"], r.text[:300]

    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    refused(http.post("/v1/completions", json={**base, "guided_json": "[" * 5000}),
            "nests deeper")
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    r = http.post("/v1/completions", content=json.dumps(base)[:-1] + ', "guided_json": '
                  + deep + "}", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    many = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": ""}] * 200_000}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(http.post, "/v1/chat/completions", json=many)
        small = http.post("/v1/completions", json=base)
        assert small.status_code == 200, small.text[:300]
        # by the body's value count before it is parsed, or by the message count
        r = big.result(timeout=120)
        assert r.status_code == 400, (r.status_code, r.text[:300])
        assert any(w in r.json()["error"]["message"] for w in ("at most", "JSON values")), \
            r.text[:300]


@counted
def test_still_serving_after_the_fuzz(cluster, http) -> None:
    check_still_serving(cluster, http)
