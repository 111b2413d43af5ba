"""What the fuzz modules (``test_fuzz_grpc``, ``test_fuzz_http``, ``test_fuzz_limits``) share:
the router they fuzz, the model's sizes, hand-written protobuf wire bytes, and the check that an
HTTP request was refused.

The malformed-request modules (grpc, http) fuzz the real router in this process, with no workers
(``router_in_process``): every case must be refused before anything is routed, so none needs a
worker, and an HTTP request costs no socket. Each module gets a router of its own (module scope),
so an error a module provokes is reported against it: the router's logs must hold no error when
the module is done. ``test_fuzz_limits``, whose cases may be served, fuzzes the session's shared
cluster (``api_fixtures``) and checks it still serves afterwards.

Throughout each module a liveness prober (``fuzz_liveness``, autouse where a module binds it)
sends the module's ``probe`` (a small normal request to the router under fuzz) every half
second from a thread and records its latency: the router must answer every probe, each within
``LIVENESS_BOUND_S`` (issue 54: "the router answering a normal request within 1 s
throughout"). Every fuzz case that ran and passed is counted (``counted``: each hypothesis
example and each explicit case); the counts and the probes' latencies are written to
``.bench-out/fuzz_cases.json`` after each module and summed up at the end of the session.
"""

from __future__ import annotations

import functools
import json
import statistics
import string
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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



# -- liveness during the fuzz, and the count of cases ------------------------------------------
LIVENESS_BOUND_S = 1.0
PROBE_INTERVAL_S = 0.5
CASES: dict[str, dict[str, int]] = {}  # module -> test function -> cases that ran and passed
REPORT: dict[str, dict[str, Any]] = {}  # module -> its cases and its probes' latencies


def counted(test: Callable[..., None]) -> Callable[..., None]:
    """``test``, counting each call that returns (under ``@given``: each example that passed;
    under ``parametrize``: each case) in ``CASES``."""
    module, name = test.__module__, test.__name__

    @functools.wraps(test)
    def run(*args: Any, **kw: Any) -> None:
        test(*args, **kw)
        by_test = CASES.setdefault(module, {})
        by_test[name] = by_test.get(name, 0) + 1
    return run


class LivenessProber:
    """``probe()`` every ``interval_s`` from a thread, until ``stop``: each one's latency, or
    the exception it raised."""

    def __init__(self, probe: Callable[[], None], interval_s: float = PROBE_INTERVAL_S):
        self.probe = probe
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def __enter__(self) -> LivenessProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.probe()
            except Exception as e:  # reported, not raised: the module's teardown asserts
                self.failures.append(f"{type(e).__name__}: {e}"[:300])
            else:
                self.latencies.append(time.perf_counter() - t)
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t)))


class _Summary:
    """The session's closing lines: each fuzz module's cases and probes (a pytest plugin,
    registered by the first module that runs)."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not REPORT:
            return
        tr = terminalreporter
        tr.section("fuzz cases and liveness (issue 54)")
        for module, r in REPORT.items():
            tr.write_line(f"{module}: {r['cases']} cases ({r['hypothesis_examples']} hypothesis "
                          f"examples, {r['explicit_cases']} explicit); {r['probes']} probes, "
                          f"median {r['probe_median_s']:.3f}s, max {r['probe_max_s']:.3f}s")
        total = sum(r["cases"] for r in REPORT.values())
        failed = len(tr.stats.get("failed", [])) + len(tr.stats.get("error", []))
        tr.write_line(f"fuzz: {total} cases passed in all"
                      + (f" ({failed} tests failed or errored)" if failed else ", 0 x 5xx")
                      + f"; slowest probe {max(r['probe_max_s'] for r in REPORT.values()):.3f}s "
                      f"(bound {LIVENESS_BOUND_S:.0f}s)")


_SUMMARY = _Summary()


def _report(request: pytest.FixtureRequest, module: str, prober: LivenessProber) -> None:
    by_test = CASES.get(module, {})
    given = {n for n, f in ((n, getattr(request.module, n, None)) for n in by_test)
             if getattr(f, "is_hypothesis_test", False)}
    hyp = sum(c for n, c in by_test.items() if n in given)
    lat = prober.latencies or [0.0]
    REPORT[module.rsplit(".", 1)[-1]] = {
        "cases": sum(by_test.values()), "hypothesis_examples": hyp,
        "explicit_cases": sum(by_test.values()) - hyp, "by_test": dict(sorted(by_test.items())),
        "probes": len(prober.latencies), "probe_failures": prober.failures,
        "probe_median_s": round(statistics.median(lat), 4), "probe_max_s": round(max(lat), 4),
        "probe_bound_s": LIVENESS_BOUND_S}
    out = Path(request.config.rootpath) / ".bench-out" / "fuzz_cases.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(REPORT, indent=1) + "\n")


@pytest.fixture(scope="module", autouse=True)
def fuzz_liveness(request: pytest.FixtureRequest, probe: Callable[[], None]
                  ) -> Iterator[LivenessProber]:
    """The module's ``probe`` every half second while its tests run; then every probe must have
    been answered within ``LIVENESS_BOUND_S``, and the module's report is written."""
    pm = request.config.pluginmanager
    if not pm.is_registered(_SUMMARY):
        pm.register(_SUMMARY, "kvrelay-fuzz-summary")
    probe()  # once before: the router is up and the probe is a valid request
    with LivenessProber(probe) as prober:
        yield prober
    _report(request, request.module.__name__, prober)
    assert not prober.failures, prober.failures[:5]
    assert prober.latencies, "no probe was answered while the module ran"
    slow = [round(x, 3) for x in prober.latencies if x >= LIVENESS_BOUND_S]
    assert not slow, (f"{len(slow)} of {len(prober.latencies)} probes took "
                      f"{LIVENESS_BOUND_S}s or more", slow[:10])


def tokenize_probe(post: Callable[..., Any]) -> Callable[[], None]:
    """A probe: ``/tokenize`` of a short prompt, answered 200 by the router itself."""
    def probe() -> None:
        r = post("/tokenize", json={"model": MODEL, "prompt": "are you there?"})
        assert r.status_code == 200 and r.json()["count"] > 0, (r.status_code, r.text[:200])
    return probe
