"""Admission before work at the router's front (issue 54): what a request may cost before it is
routed. The real router in this process, no workers, its HTTP API on a loopback port.

A body is counted before it is parsed (a 25 MiB body of numbers took 3.9 s of the event loop and
1.5 GB to refuse, and a small request beside it waited as long), parsed off the loop when large,
and admitted on arrival: the in-flight cap, the requests and bytes being parsed, and the
tokenizer's queue are checked before anything is read, parsed or tokenized.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from fuzz_support import MODEL, raw_generate
from router_in_process import RouterInProcess

from kvrelay.common.limits import MAX_HTTP_BODY_BYTES
from kvrelay.proto import generate_pb2 as pb
from kvrelay.router import service as service_mod
from kvrelay.router import validation
from kvrelay.router.admission import Admission
from kvrelay.router.http_api import connection_limit
from kvrelay.router.validation import json_values

SMALL = {"model": MODEL, "prompt": "hello there"}


@pytest.fixture(scope="module")
def router(demo_model_dir: str) -> Iterator[RouterInProcess]:
    with RouterInProcess(demo_model_dir, served_model_name=MODEL, http_port=0) as r:
        yield r
        assert not r.errors, [rec.getMessage() for rec in r.errors[:5]]


@pytest.fixture()
def url(router: RouterInProcess) -> str:
    assert router.router is not None
    return f"http://127.0.0.1:{router.router.http_port}"


@pytest.fixture()
def encodes(router: RouterInProcess, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the tokenizer's encode calls and chat renderings (each appends its size)."""
    assert router.router is not None
    tok = router.router.service.tokenizer
    calls: list[int] = []
    orig_encode = tok.encode

    def encode(text, *a, **kw):
        calls.append(len(text))
        return orig_encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", encode)
    orig_chat = service_mod.apply_chat_template

    def chat(tokenizer, messages, *a, **kw):
        calls.append(len(messages))
        return orig_chat(tokenizer, messages, *a, **kw)

    monkeypatch.setattr(service_mod, "apply_chat_template", chat)
    return calls


def _post(url: str, path: str, body: bytes) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as c:
        return c.post(path, content=body, headers={"content-type": "application/json"})


def _error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert words in r.json()["error"]["message"], r.text[:300]


# -- counting a body's values before it is parsed -------------------------------------------------
def _reference(body: bytes) -> int:
    rest = validation._JSON_STRING.sub(b"", body)
    return rest.count(b",") + rest.count(b"[") + rest.count(b"{")


def test_json_values_skip_strings_across_windows(monkeypatch) -> None:
    """Commas and brackets inside strings do not count, wherever a window splits a string or
    an escape (windows of 1 to 40 bytes here)."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice('ab,[{"\\é') for _ in range(rng.randint(0, 200)))
        obj = {"p": text, "l": [rng.choice([1, 'x,"', [2, 3], {"k": "v\\"}])
                                for _ in range(rng.randint(0, 20))]}
        body = json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
        raw = body.count(b",") + body.count(b"[") + body.count(b"{")
        monkeypatch.setattr(validation, "SCAN_WINDOW", rng.randint(1, 40))
        # a limit under the raw count forces the scan past the strings
        assert json_values(body, raw - 1) == _reference(body), body


def test_json_values_stop_at_the_limit() -> None:
    body = b"[" + b",".join([b"1"] * 100_000) + b"]"
    assert 1000 < json_values(body, 1000) < 100_000
    text = json.dumps({"prompt": ",[{" * 100_000}).encode()  # all inside one string
    assert json_values(text, 1000) == 1


# -- refused before it is parsed or tokenized, and the loop keeps serving -------------------------
def _big_bodies() -> dict[str, tuple[str, bytes]]:
    n_ids = (MAX_HTTP_BODY_BYTES - 1024) // 5
    ids = b'{"model":"demo","max_tokens":2,"prompt":[' + b",".join([b"1000"] * n_ids) + b"]}"
    bias = (b'{"model":"demo","prompt":"x","logit_bias":{'
            + b",".join(b'"%d":0' % i for i in range(MAX_HTTP_BODY_BYTES // 12)) + b"}}")
    many = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": ""}] * 200_000}).encode()
    return {"ids": ("/v1/completions", ids), "bias": ("/v1/completions", bias),
            "messages": ("/v1/chat/completions", many)}


@pytest.mark.parametrize("kind", ["ids", "bias", "messages"])
def test_a_body_of_many_values_is_refused_before_parsing(router, url, encodes, kind) -> None:
    """A maximal body of numbers, a logit_bias of a million entries, 200,000 empty messages:
    a 400 that says why, nothing tokenized or rendered, and a small request sent meanwhile is
    served without waiting for it (before: the small one waited as long as the refusal, 3.9 s
    for the numbers)."""
    path, body = _big_bodies()[kind]
    with httpx.Client(base_url=url, timeout=60) as c:
        idle = []
        for _ in range(5):
            t = time.monotonic()
            assert c.post("/tokenize", json=SMALL).status_code == 200
            idle.append(time.monotonic() - t)
        encodes.clear()
        result: dict[str, object] = {}

        def big() -> None:
            t = time.monotonic()
            result["r"] = _post(url, path, body)
            result["s"] = time.monotonic() - t

        thread = threading.Thread(target=big)
        thread.start()
        beside: list[float] = []
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline:
            t = time.monotonic()
            assert c.post("/tokenize", json=SMALL).status_code == 200
            beside.append(time.monotonic() - t)
        thread.join(10)
    _error(result["r"], 400, "JSON values")  # type: ignore[arg-type]
    assert encodes == [len(SMALL["prompt"])] * len(beside), encodes[:5]  # only the small ones
    assert beside, "no small request completed while the big one was refused"
    # Relative, with room: a small request is served in a fraction of the big one's time.
    assert statistics.median(beside) < max(result["s"] / 3, 2 * max(idle)), (beside, result)


def test_a_deep_body_is_a_400(router, url) -> None:
    """Nesting past the parser's limit, in an ignored field or in guided_json: 400."""
    for field in ('"junk":' + "[" * 5000 + "]" * 5000,
                  '"guided_json":' + '{"a":' * 5000 + "1" + "}" * 5000):
        body = ('{"model":"demo","prompt":"hi","max_tokens":2,' + field + "}").encode()
        _error(_post(url, "/v1/completions", body), 400, "recursion limit")


# -- admission on arrival ------------------------------------------------------------------------
def _hold(port: int, path: str = "/v1/completions") -> socket.socket:
    """A connection whose request has its headers sent and half its body: admitted, holding
    its ticket while the router waits for the rest."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              f"content-length: 100\r\n\r\n".encode() + b'{"model":')
    return s


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_full_admission_refuses_with_a_retry_hint(router, url, encodes) -> None:
    """A request admitted (its headers in, its body still coming) holds its place; with no
    place left the next one is a 429 with Retry-After before its body is parsed; the place
    comes back when the client leaves."""
    admission = router.router.service.admission
    old = admission.max_requests
    admission.max_requests = admission.requests + 1
    held = None
    try:
        held = _hold(router.router.http_port)
        _wait_for(lambda: admission.requests == admission.max_requests, "not admitted")
        r = _post(url, "/v1/completions", json.dumps({**SMALL, "max_tokens": 2}).encode())
        _error(r, 429, "router busy")
        assert int(r.headers["Retry-After"]) >= 1
        assert encodes == []  # refused before its body was parsed or tokenized
    finally:
        if held is not None:
            held.close()
        _wait_for(lambda: admission.requests < admission.max_requests, "ticket kept")
        admission.max_requests = old
    assert _post(url, "/tokenize", json.dumps(SMALL).encode()).status_code == 200


def test_the_byte_budget_counts_bodies_before_reading_them(router, url) -> None:
    admission = router.router.service.admission
    old = admission.max_bytes
    admission.max_bytes = 4096
    try:
        body = json.dumps({**SMALL, "prompt": "x" * 5000}).encode()
        _error(_post(url, "/tokenize", body), 429, "body bytes")
        assert _post(url, "/tokenize", json.dumps(SMALL).encode()).status_code == 200
        assert admission.requests == 0 and admission.bytes == 0
    finally:
        admission.max_bytes = old


def test_the_inflight_cap_applies_before_parsing(router, url, encodes) -> None:
    """At the in-flight cap, with no place left in the queue for a slot, a generation request
    is refused on arrival (429, Retry-After), its prompt never tokenized; gRPC too
    (RESOURCE_EXHAUSTED, retry-after-ms). /tokenize generates nothing and is still served."""
    service = router.router.service
    old = service.fair.slots, service.fair.max_waiting
    service.fair.slots = service.fair.max_waiting = 0
    try:
        r = _post(url, "/v1/completions",
                  json.dumps({**SMALL, "prompt": "long " * 10_000}).encode())
        _error(r, 429, "at capacity")
        assert int(r.headers["Retry-After"]) >= 1
        with grpc.insecure_channel(router.address) as ch:
            req = pb.GenerateRequest(text="long " * 10_000,
                                     sampling=pb.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as e:
                list(raw_generate(ch)(req.SerializeToString(), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) > 0
        assert encodes == []
        assert _post(url, "/tokenize", json.dumps(SMALL).encode()).status_code == 200
    finally:
        service.fair.slots, service.fair.max_waiting = old


def test_the_tokenizer_queue_is_bounded(router, url, monkeypatch) -> None:
    """With the tokenizer threads' queue full, a request whose work would queue there is a
    429, not one more job behind seconds of others; a small one (no thread hop) is served."""
    service = router.router.service
    monkeypatch.setattr(service, "_queued", service_mod.MAX_TOKENIZER_QUEUE)
    big = json.dumps({**SMALL, "prompt": "word " * 10_000}).encode()
    _error(_post(url, "/tokenize", big), 429, "wait for the tokenizer")
    _error(_post(url, "/v1/completions", big), 429, "wait for the tokenizer")
    assert _post(url, "/tokenize", json.dumps(SMALL).encode()).status_code == 200


def test_the_server_bounds_its_connections(router) -> None:
    server = router.router.http._server
    assert server.config.limit_concurrency == connection_limit(router.router.service.max_inflight)


def test_admission_counts_requests_and_bytes() -> None:
    a = Admission(max_requests=2, max_bytes=100)
    t1 = a.enter(60)
    assert t1 is not None and a.enter(50) is None  # bytes
    t2 = a.enter(0)
    assert t2 is not None and a.enter(0) is None  # requests
    assert not t2.grow(41) and t2.grow(40) and a.bytes == 100
    t1.release()
    t1.release()  # once only
    assert (a.requests, a.bytes, a.refused) == (1, 40, 2)
    t2.release()
    assert (a.requests, a.bytes) == (0, 0)


@pytest.mark.parametrize("field", [
    {"guided_json": "[" * 5000},
    {"guided_regex": "(" * 5000 + "a" + ")" * 5000},
    {"guided_regex": "[" * 5000},
    {"guided_grammar": "root ::= " + "(" * 5000},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": "[" * 5000}}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "schema": json.loads('{"items":' * 100 + "{}" + "}" * 100)}}},
])
def test_a_deep_structured_output_spec_is_a_400(router, url, field) -> None:
    """Every malformed structured-output spec, nested deep: a 400 with a message (guided_json
    of "[" * 5000 was an HTTP 500)."""
    r = _post(url, "/v1/completions", json.dumps({**SMALL, "max_tokens": 2, **field}).encode())
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]
