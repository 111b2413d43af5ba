"""The serving benchmark's processes: start them pinned to cores, wait for them, stop them.

``Proc`` is one process (its own session, its log file), ``Deployment`` the processes of one
running configuration and the base URL to load; ``wait_file`` and ``wait_http`` wait for
readiness while checking every process stays alive; ``idle_cpu_cores`` measures the CPU a
deployment burns while idle (from /proc, descendants included).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]

# the runner's logger: its log lines read as before
logger = logging.getLogger("bench.serving.run_serving")
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


def wait_registered(control: str, n: int, dep: Deployment, timeout_s: float) -> None:
    """Poll the router's registry at ``control`` until it lists ``n`` workers (routable; the
    processes must stay alive meanwhile)."""
    import grpc

    from kvrelay.proto import worker_pb2 as wpb
    from kvrelay.proto import worker_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while True:
        dep.check_alive()
        with grpc.insecure_channel(control) as ch:
            listed = worker_pb2_grpc.RegistryStub(ch).ListWorkers(
                wpb.ListWorkersRequest(), timeout=10).workers
        if len(listed) == n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(listed)} of {n} workers registered")
        time.sleep(0.2)


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


def stat_cpu(path: str | Path) -> tuple[str, float] | None:
    """(name, user + system CPU seconds) from a /proc ``stat`` file (a process's, or a
    thread's under ``task/``); None when it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    name = text[text.index("(") + 1:text.rindex(")")]
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    return sum(s[1] for p in pids if (s := stat_cpu(f"/proc/{p}/stat")) is not None)


def idle_cpu_cores(dep: Deployment, seconds: float = 5.0) -> float:
    """CPU the deployment burns while idle, in cores (1.0 = one core busy)."""
    tree = process_tree(dep.pids())
    a = cpu_seconds(tree)
    time.sleep(seconds)
    return (cpu_seconds(tree) - a) / seconds
