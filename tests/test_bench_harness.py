"""Fast tests of the serving-benchmark harness (bench/): no vLLM, no model servers.

A tiny in-process OpenAI-style SSE server (Starlette on uvicorn, in a thread on 127.0.0.1) with
deterministic delays stands in for the servers under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.serving import loadgen, run_serving
from bench.serving.workloads import (
    WORKLOADS,
    Vocab,
    make_requests,
    poisson_arrivals,
    read_vocab,
)

ROOT = Path(__file__).resolve().parents[1]

np = pytest.importorskip("numpy")
uvicorn = pytest.importorskip("uvicorn")
starlette = pytest.importorskip("starlette")


# -- statistics ----------------------------------------------------------------------------------
def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert loadgen.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges() -> None:
    assert loadgen.percentile([], 50) is None
    assert loadgen.percentile([7.0], 99) == 7.0
    assert loadgen.percentile([1.0, float("nan"), 3.0], 50) == 2.0
    with pytest.raises(ValueError):
        loadgen.percentile([1.0], 101)
    d = loadgen.distribution([None, 1.0, 2.0, 3.0, 4.0])
    assert d["n"] == 4 and d["mean"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    assert d["p50"] == 2.5
    assert loadgen.distribution([])["p99"] is None


# -- goodput search ------------------------------------------------------------------------------
def _fake_attainment(knee: float) -> tuple[list[float], Any]:
    probed: list[float] = []

    async def evaluate(rate: float) -> float:
        probed.append(rate)
        return 1.0 if rate <= knee else 0.5

    return probed, evaluate


def test_goodput_bisect_brackets_the_knee() -> None:
    probed, ev = _fake_attainment(7.3)
    g = asyncio.run(loadgen.goodput_search(ev, lo=0.5, hi=32.0, iters=8))
    assert g["method"] == "bisect" and not g["capped"] and not g["below_range"]
    assert g["goodput_rps"] <= 7.3
    assert g["goodput_rps"] >= 7.3 / (64 ** (1 / 2 ** 8))  # geometric bracket after 8 steps
    assert 0.5 not in probed  # lo is not probed when a step passed
    assert [p["rate"] for p in g["points"]] == sorted(probed)


def test_goodput_capped_and_below_range() -> None:
    _, ev = _fake_attainment(100.0)
    g = asyncio.run(loadgen.goodput_search(ev, lo=1, hi=16, iters=3))
    assert g["capped"] and g["goodput_rps"] == 16
    assert len(g["points"]) == 1
    _, ev = _fake_attainment(0.1)
    g = asyncio.run(loadgen.goodput_search(ev, lo=1, hi=16, iters=3))
    assert g["below_range"] and g["goodput_rps"] == 0.0


def test_goodput_sweep_stops_after_misses() -> None:
    probed, ev = _fake_attainment(3.0)
    g = asyncio.run(loadgen.goodput_search(ev, rates=[8, 1, 2, 4, 16, 32]))
    assert g["method"] == "sweep" and g["goodput_rps"] == 2
    assert probed == [1, 2, 4, 8]  # two misses in a row end the sweep


def test_goodput_threshold_is_90_percent() -> None:
    async def ev(rate: float) -> float:
        return 0.9 if rate <= 4 else 0.89

    g = asyncio.run(loadgen.goodput_search(ev, rates=[2, 4, 8]))
    assert g["goodput_rps"] == 4


# -- workloads -----------------------------------------------------------------------------------
def test_poisson_schedule_is_deterministic_and_poisson() -> None:
    a = poisson_arrivals(2000, 4.0, seed=3, tag="x")
    assert a == poisson_arrivals(2000, 4.0, seed=3, tag="x")
    assert a != poisson_arrivals(2000, 4.0, seed=4, tag="x")
    assert a != poisson_arrivals(2000, 4.0, seed=3, tag="y")
    assert a[0] == 0.0 and all(b >= x for x, b in itertools.pairwise(a))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert gaps.std() == pytest.approx(0.25, rel=0.15)  # exponential: std == mean
    b = poisson_arrivals(2000, 8.0, seed=3, tag="x")  # same pattern, twice the pace
    assert np.allclose(np.array(a) / 2, b)
    assert poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5
    assert poisson_arrivals(0, 1.0, seed=0) == []


def _write_tokenizer(d: Path, n: int = 500, special: int = 4) -> None:
    vocab = {f"t{i}": i for i in range(special, n)}
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in range(special)]
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab},
                                                  "added_tokens": added}))
    (d / "config.json").write_text(json.dumps({"vocab_size": n}))


def test_read_vocab_and_requests(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path, n=500, special=4)
    v = read_vocab(tmp_path)
    assert v.size == 500 and v.special_ids == frozenset(range(4))
    reqs = make_requests("mixed", 100, v, seed=0, tag="t")
    assert [r.index for r in reqs] == list(range(100))
    assert sum(r.kind == "long" for r in reqs) == 10  # exact 90/10 split
    for r in reqs:
        want = (2048, 64) if r.kind == "long" else (256, 32)
        assert (r.prompt_tokens, r.max_tokens) == want
        assert all(4 <= t < 500 for t in r.prompt_token_ids)
    again = make_requests("mixed", 100, v, seed=0, tag="t")
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = make_requests("mixed", 100, v, seed=0, tag="u")
    assert other[0].prompt_token_ids != reqs[0].prompt_token_ids
    assert {r.kind for r in make_requests("uniform", 7, v, 0)} == {"short"}
    assert WORKLOADS["mixed"].describe() == "90% 256->32, 10% 2048->64"


def test_read_vocab_caps_at_model_vocab(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path, n=600)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    assert read_vocab(tmp_path).size == 300


# -- SSE -----------------------------------------------------------------------------------------
def test_sse_parser_handles_splits_crlf_multiline_and_comments() -> None:
    p = loadgen.SSEParser()
    stream = (b": keep-alive\r\n\r\ndata: {\"a\": 1}\r\n\r\ndata: line1\ndata: line2\n\n"
              b"event: x\nid: 3\ndata: [DONE]\n\n")
    out: list[str] = []
    for i in range(len(stream)):  # one byte at a time: worst-case splits (\r|\n included)
        out += p.feed(stream[i:i + 1])
    assert out == ['{"a": 1}', "line1\nline2", "[DONE]"]
    p2 = loadgen.SSEParser()
    assert p2.feed(b"data: x") == []
    assert p2.close() == ["x"]  # unterminated last event


def test_chunk_tokens() -> None:
    assert loadgen.chunk_tokens({"choices": [{"text": "a", "finish_reason": None}]}) == 1
    assert loadgen.chunk_tokens({"choices": [{"text": "", "finish_reason": None}]}) == 1
    assert loadgen.chunk_tokens({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert loadgen.chunk_tokens({"choices": [{"text": "ab", "token_ids": [1, 2]}]}) == 2
    assert loadgen.chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 0


# -- a fake OpenAI server -----------------------------------------------------------------------
class FakeServer:
    """SSE completions with deterministic delays; prompt[0] selects failure modes."""

    HTTP_500, STALL, STREAM_ERROR = 999_001, 999_002, 999_003

    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.01):
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.bodies: list[dict[str, Any]] = []
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def completions(request: Any) -> Any:
            body = await request.json()
            self.bodies.append(body)
            first = body["prompt"][0]
            n = int(body["max_tokens"])
            if first == self.HTTP_500:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": "x", "finish_reason": "length"}],
                                     "kv_transfer_params": {"remote": len(body["prompt"])}})

            async def gen() -> Any:
                await asyncio.sleep(10 if first == self.STALL else self.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.itl_s)
                    if first == self.STREAM_ERROR and i == 2:
                        yield b'data: {"error": {"message": "worker died"}}\n\n'
                        break
                    doc = {"choices": [{"index": 0, "text": f" t{i}",
                                        "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(doc)}\n\n".encode()
                usage = {"choices": [], "usage": {"completion_tokens": n}}
                yield f"data: {json.dumps(usage)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        async def models(request: Any) -> Any:
            return JSONResponse({"data": [{"id": "fake"}]})

        async def health(request: Any) -> Any:
            return JSONResponse({"status": "ok"})

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/models", models), Route("/health", health)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, app: Any = None) -> FakeServer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cfg = uvicorn.Config(app or self.app(), host="127.0.0.1", port=self.port,
                             log_level="warning", access_log=False)
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    srv = FakeServer().start()
    try:
        yield srv
    finally:
        srv.stop()


VOCAB = Vocab(size=1000, special_ids=frozenset({0, 1, 2}))


def test_run_requests_measures_ttft_itl_tpot(fake: FakeServer) -> None:
    specs = make_requests("uniform", 6, VOCAB, seed=0)
    arrivals = poisson_arrivals(6, 50.0, seed=0)
    run = asyncio.run(loadgen.run_requests(fake.url, "fake", specs, arrivals, timeout_s=10))
    assert all(r.success for r in run.results), [r.error for r in run.results]
    for r in run.results:
        assert r.output_tokens == 32 and r.usage_tokens == 32
        assert len(r.chunk_times_s) == 32 and len(r.itl_ms) == 31
        assert 40 <= r.ttft_ms < 1000
        assert 8 <= r.tpot_ms < 200
        assert r.sent_s >= r.scheduled_s - 0.005
        assert r.e2e_ms >= r.ttft_ms + 31 * 9
    body = fake.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 32
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 256
    s = run.summary(slo_ttft_ms=1000, slo_tpot_ms=200)
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["slo"]["attainment"] == 1.0
    assert s["output_throughput"] == pytest.approx(6 * 32 / run.duration_s)
    assert s["itl_ms"]["n"] == 6 * 31
    assert s["by_kind"]["short"]["count"] == 6
    s_strict = run.summary(slo_ttft_ms=1.0, slo_tpot_ms=200)
    assert s_strict["slo"]["attainment"] == 0.0
    rows = loadgen.itl_timeline(run.results)
    assert len(rows) == 6 * 31 and rows == sorted(rows, key=lambda r: r[0])


def test_failures_are_recorded_not_raised(fake: FakeServer) -> None:
    specs = make_requests("uniform", 4, VOCAB, seed=0)
    for spec, first in zip(specs, (FakeServer.HTTP_500, FakeServer.STALL,
                                   FakeServer.STREAM_ERROR, None), strict=True):
        if first is not None:
            spec.prompt_token_ids[0] = first
    specs[3] = dataclasses.replace(specs[3], max_tokens=16)
    t = time.monotonic()
    # The healthy request streams for ~0.2 s: a timeout with room for a loaded machine.
    run = asyncio.run(loadgen.run_requests(fake.url, "fake", specs, [0.0] * 4, timeout_s=1.5))
    assert time.monotonic() - t < 8  # the stalled request (10 s) is bounded by its timeout
    r500, stall, broken, ok = run.results
    assert not r500.success and r500.error.startswith("HTTP 500") and r500.status == 500
    assert not stall.success and "timeout" in stall.error
    assert not broken.success and "worker died" in broken.error
    assert ok.success
    s = run.summary()
    assert s["failed"] == 3 and s["completed"] == 1 and len(s["errors"]) == 3


def test_run_deadline_cancels_open_requests(fake: FakeServer) -> None:
    specs = make_requests("uniform", 2, VOCAB, seed=0)
    specs[0].prompt_token_ids[0] = FakeServer.STALL
    run = asyncio.run(loadgen.run_requests(fake.url, "fake", specs, [0.0, 0.0], timeout_s=30,
                                           run_timeout_s=1.0))
    assert not run.results[0].success and "deadline" in run.results[0].error
    assert run.results[1].success


def test_benchmark_run_document_round_trips(fake: FakeServer) -> None:
    plan = loadgen.RunPlan("mixed", 10, 40.0, seed=1, timeout_s=10)
    doc = asyncio.run(loadgen.benchmark_run(fake.url, "fake", VOCAB, plan))
    doc = json.loads(json.dumps(doc))
    assert doc["schema"] == loadgen.SCHEMA and doc["meta"]["rate"] == 40.0
    assert doc["summary"]["completed"] == 10
    assert len(doc["long_arrivals_s"]) == 1
    back = [loadgen.RequestResult.from_json(r) for r in doc["requests"]]
    assert sum(len(r.itl_ms) for r in back) == len(doc["itl_timeline"])
    again = loadgen.summarize(back, doc["summary"]["duration_s"])
    assert again["ttft_ms"] == doc["summary"]["ttft_ms"]


def test_pd_proxy_follows_kv_transfer_flow(fake: FakeServer) -> None:
    proxy = FakeServer().start(run_serving.build_pd_proxy(fake.url, fake.url))
    try:
        specs = make_requests("uniform", 2, VOCAB, seed=0)
        run = asyncio.run(loadgen.run_requests(proxy.url, "fake", specs, [0.0, 0.0],
                                               timeout_s=10))
        assert all(r.success and r.output_tokens == 32 for r in run.results)
    finally:
        proxy.stop()
    pre = [b for b in fake.bodies if not b.get("stream")]
    dec = [b for b in fake.bodies if b.get("stream")]
    assert len(pre) == 2 and len(dec) == 2
    assert all(b["max_tokens"] == 1 and b["kv_transfer_params"]["do_remote_decode"]
               and "stream_options" not in b for b in pre)
    assert all(b["kv_transfer_params"] == {"remote": 256} and b["max_tokens"] == 32
               for b in dec)


def test_run_serving_command_line_defaults_are_the_settings_defaults() -> None:
    """One source of defaults: ``run_serving`` with no options gives ``Settings()``'s values
    (the goodput range once disagreed: 0.25-128 on the command line, 0.25-32 in Settings)."""
    st = run_serving.settings_from_args(run_serving.build_parser().parse_args([]))
    plain = run_serving.Settings(model_dir=st.model_dir, results_dir=st.results_dir,
                                 cores=st.cores)
    assert st == plain
    assert st.goodput_range == (0.25, 128.0)


def test_the_tpot_and_itl_configurations_pass_their_slo_flags() -> None:
    from bench.serving.serving_configs import CONFIGS, slo_args

    st = run_serving.settings_from_args(run_serving.build_parser().parse_args(
        ["--slo-tpot-ms", "40", "--itl-cap-ms", "6"]))
    assert slo_args("kvrelay-agg", st) == slo_args("kvrelay-1p1d", st) == []
    assert slo_args("kvrelay-agg-tpot", st) == slo_args("kvrelay-dp2-tpot", st) \
        == ["--tpot-slo-ms", "40"]
    assert slo_args("kvrelay-agg-itl", st) == ["--tpot-slo-ms", "40", "--itl-cap-ms", "6"]
    assert "kvrelay-agg-itl" in CONFIGS
