"""The soak test's cluster: a router, one prefill and one decode worker as ``kvrelay`` processes
on loopback, each started with a ready file and stopped by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVED = "demo"


# -- processes ------------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ready_file: Path
    ready: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class SoakCluster:
    """Router + prefill + decode worker as ``python -m kvrelay.cli`` processes."""

    def __init__(self, model_dir: str, workdir: Path, worker_args: list[str]):
        self.model_dir = model_dir
        self.workdir = workdir
        self.worker_args = worker_args
        self.env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1"}
        self.procs: list[Proc] = []

    def _spawn(self, name: str, args: list[str]) -> Proc:
        log, ready = self.workdir / f"{name}.log", self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        with open(log, "wb") as f:
            popen = subprocess.Popen(
                [sys.executable, "-m", "kvrelay.cli", *args, "--ready-file", str(ready)],
                stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                cwd=str(ROOT))
        p = Proc(name, popen, log, ready)
        self.procs.append(p)
        return p

    def _wait_ready(self, p: Proc, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not p.ready_file.exists():
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not ready after {timeout:.0f}s:\n{p.tail()}")
            time.sleep(0.1)
        p.ready = json.loads(p.ready_file.read_text())

    def start(self) -> None:
        self.router = self._spawn("router", [
            "router", "--model", self.model_dir, "--served-model-name", SERVED, "--port", "0",
            "--control-port", "0", "--http-port", "0"])
        self._wait_ready(self.router)
        control = f"127.0.0.1:{self.router.ready['control_port']}"
        self.workers = [self._spawn(f"{role}-1", [
            "worker", "--role", role, "--router", control, "--worker-id", f"{role}-1",
            "--model", self.model_dir, *self.worker_args]) for role in ("prefill", "decode")]
        for w in self.workers:
            self._wait_ready(w)
        deadline = time.monotonic() + 60
        while True:  # both registered: the router answers /health
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.http_url + "/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the router never saw both workers")
            time.sleep(0.2)

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.router.ready['port']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.router.ready['http_port']}"

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(10)
