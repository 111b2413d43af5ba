"""OpenTelemetry tracing: one request is one trace across the router, the prefill worker and
the decode worker, under the client's own span (HTTP ``traceparent`` header or gRPC metadata).

The cluster exports over OTLP/gRPC to a collector run here (opentelemetry-proto's
TraceService), so what is checked is what a real collector would receive.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from cluster import Cluster

from kvrelay.common import tracing
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")

pytestmark = pytest.mark.slow

# name -> (the service that must report it, the name of its parent; None: the client's span)
TREE = {
    "router.request": ("kvrelay-router", None),
    "router.route": ("kvrelay-router", "router.request"),
    "router.reserve": ("kvrelay-router", "router.request"),
    "router.prefill": ("kvrelay-router", "router.request"),
    "router.stream": ("kvrelay-router", "router.request"),
    "decode.reserve": ("kvrelay-decode-worker", "router.reserve"),
    "prefill.request": ("kvrelay-prefill-worker", "router.prefill"),
    "prefill.queue": ("kvrelay-prefill-worker", "prefill.request"),
    "prefill.compute": ("kvrelay-prefill-worker", "prefill.request"),
    "prefill.kv_send": ("kvrelay-prefill-worker", "prefill.request"),
    "decode.request": ("kvrelay-decode-worker", "router.stream"),
    "decode.kv_wait": ("kvrelay-decode-worker", "decode.request"),
    "decode.decode": ("kvrelay-decode-worker", "decode.request"),
}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc,name-defined]
    """Keeps every exported span with the service that sent it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[tuple[str, Any]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30.0
                 ) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.trace(trace_id)
            if names <= {s.name for _, s in got} or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c.endpoint = f"127.0.0.1:{port}"
    yield c
    server.stop(grace=None)


@pytest.fixture(scope="module")
def traced(demo_model_dir, tmp_path_factory, collector):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("otel"), prefill=1, decode=1,
                 router_args=("--http-port", "0"),
                 env={"KVRELAY_OTLP_TRACES_ENDPOINT": collector.endpoint}) as c:
        yield c


def _client_span() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _check_tree(spans: list[tuple[str, Any]], client_span_id: str,
                tree: dict[str, tuple[str, str | None]] = TREE) -> None:
    names = [s.name for _, s in spans]
    missing = set(tree) - set(names)
    assert not missing, f"spans never exported: {sorted(missing)} (got {sorted(names)})"
    assert sorted(names) == sorted(tree)  # one request, one pass: each span once
    by_name = {s.name: (svc, s) for svc, s in spans}
    for name, (service, parent) in tree.items():
        svc, s = by_name[name]
        assert svc == service, (name, svc)
        want = client_span_id if parent is None else by_name[parent][1].span_id.hex()
        assert s.parent_span_id.hex() == want, (name, parent)
    ids = [s.span_id.hex() for _, s in spans]
    assert len(set(ids)) == len(ids)


def test_one_request_is_one_trace_across_three_processes(traced, collector) -> None:
    """The client's traceparent (HTTP header) is the root: the router's spans under it, the
    prefill worker's under the router's Prefill call, the decode worker's under its Reserve
    and Decode calls; the three processes export to the collector on their own."""
    trace_id, span_id, tp = _client_span()
    port = traced.router.ready["http_port"]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"prompt": "The quick brown fox jumps over", "max_tokens": 4,
                         "ignore_eos": True, "temperature": 0},
                   headers={"traceparent": tp}, timeout=60)
    assert r.status_code == 200, r.text
    spans = collector.wait_for(trace_id, set(TREE))
    _check_tree(spans, span_id)
    by_name = {s.name: s for _, s in spans}
    attrs = {a.key: a.value for a in by_name["router.request"].attributes}
    assert attrs["kvrelay.completion_tokens"].int_value == 4
    assert by_name["router.request"].status.code != 2  # not STATUS_CODE_ERROR
    # The spans of one request nest in time, too: the router's covers the workers'.
    root = by_name["router.request"]
    for name in ("prefill.request", "decode.request"):
        assert root.start_time_unix_nano <= by_name[name].start_time_unix_nano


def test_grpc_metadata_traceparent_and_no_parent(traced, collector) -> None:
    """The generate API takes the client's traceparent from gRPC metadata; a request without
    one starts a trace of its own (the router's span is its root)."""
    trace_id, span_id, tp = _client_span()
    req = pb.GenerateRequest(text="Hello there", sampling=pb.SamplingParams(
        max_tokens=3, ignore_eos=True))
    with grpc.insecure_channel(traced.address) as ch:
        out = list(generate_pb2_grpc.GenerationStub(ch).Generate(
            req, metadata=(("traceparent", tp),), timeout=60))
        assert out and out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        _check_tree(collector.wait_for(trace_id, set(TREE)), span_id)

        rid = "otel-no-parent"
        req = pb.GenerateRequest(text="Hello again", request_id=rid,
                                 sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        out = list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    deadline = time.monotonic() + 30
    root = None
    while root is None and time.monotonic() < deadline:
        with collector.lock:
            root = next((s for _, s in collector.spans if s.name == "router.request" and any(
                a.key == "kvrelay.request_id" and a.value.string_value == rid
                for a in s.attributes)), None)
        time.sleep(0.05)
    assert root is not None and root.parent_span_id == b""
    _check_tree(collector.wait_for(root.trace_id.hex(), set(TREE)), "")


def test_prefill_ahead_keeps_the_tree(demo_model_dir, tmp_path, collector) -> None:
    """With the Prefill sent beside the Reserve (``--prefill-ahead``) the spans are the same
    tree: the early Prefill call carries its own span's traceparent."""
    trace_id, span_id, tp = _client_span()
    with Cluster(demo_model_dir, tmp_path, prefill=1, decode=1,
                 router_args=("--http-port", "0", "--prefill-ahead"),
                 env={"KVRELAY_OTLP_TRACES_ENDPOINT": collector.endpoint}) as c:
        port = c.router.ready["http_port"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                             "ignore_eos": True, "stream": True},
                       headers={"traceparent": tp}, timeout=60)
        assert r.status_code == 200 and "data: [DONE]" in r.text, r.text
        _check_tree(collector.wait_for(trace_id, set(TREE)), span_id)


def test_aggregated_worker_request_is_one_trace(demo_model_dir, tmp_path, collector) -> None:
    """A role=both worker runs the whole request (GenerateLocal): its span sits under the
    router's stream span."""
    tree: dict[str, tuple[str, str | None]] = {
        "router.request": ("kvrelay-router", None),
        "router.stream": ("kvrelay-router", "router.request"),
        "worker.generate_local": ("kvrelay-both-worker", "router.stream"),
    }
    trace_id, span_id, tp = _client_span()
    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=0, both=1,
                 router_args=("--http-port", "0"),
                 env={"KVRELAY_OTLP_TRACES_ENDPOINT": collector.endpoint}) as c:
        port = c.router.ready["http_port"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "Once upon", "max_tokens": 3, "ignore_eos": True},
                       headers={"traceparent": tp}, timeout=60)
        assert r.status_code == 200, r.text
        _check_tree(collector.wait_for(trace_id, set(tree)), span_id, tree)


def test_without_opentelemetry_tracing_stays_off(tmp_path) -> None:
    """opentelemetry is optional: with it absent an endpoint only warns, and spans stay no-ops."""
    code = (
        "import logging, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from kvrelay.common import tracing\n"
        "assert not tracing.setup('kvrelay-router', '127.0.0.1:4317')\n"
        "assert not tracing.enabled() and tracing.start('x') is None\n"
        "assert tracing.from_metadata([('traceparent', '00-' + '1' * 32 + '-' + '2' * 16 + "
        "'-01')]) is None\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok" and "not installed" in out.stderr


def test_tracing_off_is_inert() -> None:
    """Without setup (no endpoint) nothing is created and no metadata is added."""
    assert not tracing.enabled()
    assert not tracing.setup("x", None)
    assert tracing.start("a") is None
    with tracing.span("b") as s:
        assert s is None
    md = (("x-kvrelay-cluster-token", "t"),)
    assert tracing.with_parent(md, None) is md
    assert tracing.from_traceparent("00-" + "1" * 32 + "-" + "2" * 16 + "-01") is None
    assert tracing.from_metadata([("traceparent", "junk")]) is None
