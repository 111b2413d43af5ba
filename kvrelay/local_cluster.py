"""A real kvrelay cluster on loopback: the router and workers as separate ``kvrelay``
processes, the one harness the tests and the benchmarks (soak) start clusters with.

Every process writes a ready file (its ports) and a log; every wait is bounded and shows the
log's tail when something does not come up; ``stop()`` terminates each process group, then
kills. The cluster token, if any, reaches the processes by environment (itself or the file
holding it), never argv.

Processes are forked from servers that did their imports once (``kvrelay.forking``; ``fork``,
on by default): a test suite starts about a hundred of them, each of which spends ~3.5 CPU s
importing torch or the router's tokenizer machinery when exec'd. One whose environment differs
from its server's in what is read at start-up, or that is pinned to cores, is exec'd.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvrelay.client import Client
from kvrelay.common.options import read_cluster_token
from kvrelay.common.rpc import CLUSTER_TOKEN_KEY
from kvrelay.forking import BASE_ENV, Forked, RouterZygote, ZygoteChild, fork_context, worker_env
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | Forked | ZygoteChild
    log: Path
    ready_file: Path
    ready: dict | None = None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def port(self) -> int:
        assert self.ready is not None
        return int(self.ready["port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Cluster:
    def __init__(self, model_dir: str | os.PathLike[str], workdir: Path, *, prefill: int = 1,
                 decode: int = 1, both: int = 0, worker_args: tuple[str, ...] = (),
                 router_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 cluster_token: str | None = None,
                 cluster_token_file: str | os.PathLike[str] | None = None,
                 heartbeat_s: float = 0.3,
                 ready_timeout_s: float = 90.0, fork: bool = True):
        self.model_dir = str(model_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.counts = {"prefill": prefill, "decode": decode, "both": both}
        self.worker_args = tuple(worker_args)
        self.router_args = tuple(router_args)
        self.heartbeat = str(heartbeat_s)
        self.ready_timeout_s = ready_timeout_s
        self.fork = fork
        self.env = {**os.environ, **BASE_ENV, **(env or {})}
        # The shared secret of the internal ports, given to every process by env (never argv):
        # the token itself, or the file that holds it (as the Kubernetes manifests pass it),
        # and presented by this harness's own calls to the control ports.
        if cluster_token_file is not None:
            assert not cluster_token, "the token or its file, not both"
            self.env["KVRELAY_CLUSTER_TOKEN_FILE"] = str(cluster_token_file)
            cluster_token = read_cluster_token(None, str(cluster_token_file))
        self.cluster_token = cluster_token
        if cluster_token and cluster_token_file is None:
            self.env["KVRELAY_CLUSTER_TOKEN"] = cluster_token
        self.metadata = ((CLUSTER_TOKEN_KEY, cluster_token),) if cluster_token else ()
        self.router: Proc | None = None
        self.workers: list[Proc] = []
        self._n = 0

    # -- processes -----------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               cores: str | None = None) -> Proc:
        self._n += 1
        log = self.workdir / f"{self._n:02d}-{name}.log"
        ready = self.workdir / f"{self._n:02d}-{name}.ready"
        ready.unlink(missing_ok=True)
        argv = [*args, "--ready-file", str(ready)]
        full_env = {**self.env, **(env or {})}
        if self.fork and args[0] == "worker" and cores is None:
            fork_env = worker_env(full_env)
            ctx = fork_context(fork_env)
            if ctx is not None:
                return Proc(name, Forked(ctx, argv, fork_env, log), log, ready)
        if self.fork and args[0] == "router" and cores is None:
            zygote = RouterZygote.for_env(full_env)
            if zygote is not None:
                try:
                    return Proc(name, zygote.start(argv, full_env, log), log, ready)
                except (RuntimeError, OSError) as e:  # the zygote is gone
                    logger.warning("exec'ing the router: %s", e)
        cmd = [sys.executable, "-m", "kvrelay.cli", *argv]
        if cores is not None:  # pinned to these CPUs (taskset's list syntax, e.g. "0" or "0,1")
            cmd = ["taskset", "-c", cores, *cmd]
        f = open(log, "w")  # noqa: SIM115 (the child owns it for its life)
        popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                 start_new_session=True)
        f.close()
        return Proc(name, popen, log, ready)

    def wait_ready(self, proc: Proc) -> None:
        timeout = self.ready_timeout_s
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.ready_file.exists():
                proc.ready = json.loads(proc.ready_file.read_text())
                return
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                                   f"{proc.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")

    def start(self) -> Cluster:
        self.router = self._spawn("router", ["router", "--model", self.model_dir, "--port", "0",
                                             "--control-port", "0", "--heartbeat-interval",
                                             self.heartbeat, *self.router_args])
        self.wait_ready(self.router)
        procs = [self.add_worker(role, wait=False)
                 for role, n in self.counts.items() for _ in range(n)]
        for p in procs:
            self.wait_ready(p)
        self.wait_registered()
        return self

    def add_worker(self, role: str, *, extra: tuple[str, ...] = (), wait: bool = True,
                   worker_id: str | None = None, env: dict[str, str] | None = None,
                   cores: str | None = None) -> Proc:
        assert self.router is not None
        idx = sum(1 for w in self.workers if w.name.startswith(role)) + 1
        wid = worker_id or f"{role}-{idx}"
        p = self._spawn(wid, ["worker", "--role", role, "--router",
                              f"127.0.0.1:{self.router.ready['control_port']}",
                              "--model", self.model_dir, "--worker-id", wid,
                              "--heartbeat-interval", self.heartbeat, *self.worker_args,
                              *extra],
                        env, cores)
        self.workers.append(p)
        if wait:
            self.wait_ready(p)
            self.wait_registered()
        return p

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, sig)
        if sig == signal.SIGKILL:
            proc.popen.wait(10)

    def proc(self, name: str) -> Proc:
        """The worker process named ``name`` (its worker id)."""
        return next(p for p in self.workers if p.name == name)

    def wait_exit(self, proc: Proc, timeout: float = 30.0) -> int | None:
        """The process's exit status once it exits, None if it still runs after ``timeout``."""
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        procs = [*self.workers, *([self.router] if self.router else [])]
        for p in procs:
            if p.popen.poll() is None:
                os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- views ---------------------------------------------------------------------------------
    @property
    def procs(self) -> list[Proc]:
        """The router, then the workers."""
        return [*([self.router] if self.router else []), *self.workers]

    @property
    def address(self) -> str:
        """The router's gRPC generate API."""
        assert self.router is not None
        return f"127.0.0.1:{self.router.port}"

    @property
    def http_url(self) -> str:
        """The router's OpenAI HTTP API (started with ``--http-port``)."""
        assert self.router is not None and self.router.ready.get("http_port")
        return f"http://127.0.0.1:{self.router.ready['http_port']}"

    @property
    def control_address(self) -> str:
        assert self.router is not None
        return f"127.0.0.1:{self.router.ready['control_port']}"

    def client(self, **kw: object) -> Client:
        return Client(self.address, **kw)  # type: ignore[arg-type]

    def registered(self) -> list[wpb.WorkerStatus]:
        with grpc.insecure_channel(self.control_address) as ch:
            return list(worker_pb2_grpc.RegistryStub(ch).ListWorkers(
                wpb.ListWorkersRequest(), metadata=self.metadata, timeout=5).workers)

    def wait_registered(self, timeout: float = 30.0) -> None:
        live = {p.name for p in self.workers if p.popen.poll() is None}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = {w.info.worker_id for w in self.registered()}
            if live <= got:
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers {live - got} did not register")

    def status(self, proc: Proc) -> wpb.WorkerStatus:
        with grpc.insecure_channel(proc.address) as ch:
            return worker_pb2_grpc.WorkerControlStub(ch).GetStatus(
                wpb.GetStatusRequest(), metadata=self.metadata, timeout=10)

    def free_blocks(self) -> dict[str, int]:
        return {p.name: self.status(p).load.free_blocks for p in self.workers
                if p.popen.poll() is None}

    def idle_free_blocks(self, timeout: float = 30.0) -> dict[str, int]:
        """Every live worker's free blocks once none holds a block any more (free = its pool;
        cached blocks count free), or as they are at ``timeout``: a baseline taken after an
        earlier user of the cluster has truly let go of everything, not while its last request
        is still returning its blocks."""
        deadline = time.monotonic() + timeout
        while True:
            loads = {p.name: self.status(p).load for p in self.workers if p.popen.poll() is None}
            if all(x.free_blocks == x.num_blocks for x in loads.values()) \
                    or time.monotonic() >= deadline:
                return {k: x.free_blocks for k, x in loads.items()}
            time.sleep(0.1)

    def wait_free_blocks(self, baseline: dict[str, int], timeout: float = 20.0) -> dict[str, int]:
        """Poll until every live worker is back at ``baseline`` free blocks (or time out)."""
        deadline = time.monotonic() + timeout
        now = self.free_blocks()
        while time.monotonic() < deadline:
            now = self.free_blocks()
            if all(now.get(k) == v for k, v in baseline.items() if k in now):
                break
            time.sleep(0.1)
        return now
