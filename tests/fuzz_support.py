"""What the fuzz modules (``test_fuzz_grpc``, ``test_fuzz_http``, ``test_fuzz_limits``) share:
the router they fuzz, the model's sizes, hand-written protobuf wire bytes, and the check that an
HTTP request was refused.

The malformed-request modules (grpc, http) fuzz the real router in this process, with no workers
(``router_in_process``): every case must be refused before anything is routed, so none needs a
worker, and an HTTP request costs no socket. Each module gets a router of its own (module scope),
so an error a module provokes is reported against it: the router's logs must hold no error when
the module is done. ``test_fuzz_limits``, whose cases may be served, fuzzes the session's shared
cluster (``api_fixtures``) and checks it still serves afterwards.
"""

from __future__ import annotations

import string
from collections.abc import Iterator

import grpc
import httpx
import pytest
from cluster import Cluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from router_in_process import RouterInProcess

from kvrelay.proto import generate_pb2 as pb

MODEL = "demo"
VOCAB = 4096  # the tiny demo model
CONTEXT = 4096
SETTINGS = settings(max_examples=400, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def router(demo_model_dir: str) -> Iterator[RouterInProcess]:
    with RouterInProcess(demo_model_dir, served_model_name=MODEL) as r:
        yield r
        assert not r.errors, [rec.getMessage() for rec in r.errors[:5]]


@pytest.fixture(scope="module")
def generate(router: RouterInProcess) -> Iterator[grpc.UnaryStreamMultiCallable]:
    """Generate over raw bytes (requests the protobuf library itself would not serialize)."""
    with grpc.insecure_channel(router.address) as ch:
        yield raw_generate(ch)


def raw_generate(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    return channel.unary_stream("/kvrelay.v1.Generation/Generate",
                                request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)


def http_client(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{cluster.router.ready['http_port']}",
                        timeout=30)


def check_still_serving(cluster: Cluster, http: httpx.Client) -> None:
    """A normal request is served over gRPC, completions and chat completions."""
    from kvrelay.client import sampling

    with cluster.client() as c:
        r = c.generate("still serving?", sampling(4, 0.0, ignore_eos=True))
        assert r.finish_reason == "length" and len(r.token_ids) == 4
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# -- protobuf wire bytes ------------------------------------------------------------------------
def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint (low 7 bits first)."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire_field(number: int, wire: int, payload: bytes) -> bytes:
    """A field by hand: its tag (field number and wire type), then ``payload`` as given."""
    return varint(number << 3 | wire) + payload


ID_CHARS = string.ascii_letters + string.digits + "_.:-"
# A request id with a character outside [A-Za-z0-9_.:-] (a trailing newline among them), or too
# long.
BAD_REQUEST_ID = st.one_of(
    st.tuples(st.text(ID_CHARS, max_size=8),
              st.one_of(st.sampled_from(" \n\t/#\x00é€"),
                        st.characters(codec="utf-8").filter(lambda c: c not in ID_CHARS)),
              st.text(max_size=4)).map("".join),
    st.text(ID_CHARS, min_size=129, max_size=300))


def check_http(http: RouterInProcess | httpx.Client, path: str, text: bytes,
               broken: list[str]) -> None:
    """``text`` posted to ``path`` is refused with a 400 (or a 404, where ``broken`` holds
    ``model``) and an OpenAI-style error that says why."""
    r = http.post(path, content=text, headers={"content-type": "application/json"})
    allowed = {400, 404} if "model" in broken else {400}
    assert r.status_code in allowed, (broken, text[:300], r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], (broken, r.text)
    assert err["code"] == r.status_code

