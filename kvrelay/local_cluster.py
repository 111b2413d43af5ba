"""A real kvrelay cluster on loopback: the router and workers as separate ``kvrelay``
processes, the one harness the tests and the benchmarks (soak) start clusters with.

Every process writes a ready file (its ports) and a log; every wait is bounded and shows the
log's tail when something does not come up; ``stop()`` terminates each process group, then
kills. The cluster token, if any, reaches the processes by environment, never argv.

Workers start as forks of one fork server that imported torch and the worker once
(``fork_workers``, on by default): a worker started by exec spends ~3 CPU s of its ~4 importing
torch, which a test suite that starts a hundred workers pays in full. Each is still a process
of its own (own session, log, environment, exit status), with ``kvrelay worker``'s own code
path from ``kvrelay.cli.main``; a worker whose environment differs from the fork server's in
what is read at import time, or that is pinned to cores, is started by exec instead.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path

import grpc

from kvrelay.client import Client
from kvrelay.common.rpc import CLUSTER_TOKEN_KEY
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

logger = logging.getLogger(__name__)

# Read when a process starts (the interpreter, the loader, malloc) or loads OpenMP: a fork has
# the fork server's values. (CUDA is initialized lazily, in the fork, with its own environment;
# PYTHONBREAKPOINT, which Ray sets in its driver, is read at each breakpoint().)
_IMPORT_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "LD_", "MALLOC", "PYTHONPATH",
                    "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONOPTIMIZE", "PYTHONWARNINGS",
                    "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE")
_PRELOAD = ["kvrelay.fork_preload"]
_fork_env: dict[str, str] | None = None  # the import-time environment of our fork server
# What every process of a cluster gets on top of this process's environment.
_BASE_ENV = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV)}


def _worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the OpenMP defaults that ``kvrelay worker`` sets before it imports torch."""
    from kvrelay.common.omp_env import apply_worker_omp_defaults

    env = dict(env)
    apply_worker_omp_defaults(env)
    return env


def start_fork_server() -> bool:
    """Start this process's multiprocessing fork server for the workers (see the module):
    importing torch and the worker under a cluster's default environment (this process's,
    ``_BASE_ENV``, the OpenMP defaults). Call it before anything else in the process uses the
    fork server (the tests do, at session start): everyone shares one, and its preload and
    environment are fixed when it starts. False when someone else started it first."""
    global _fork_env
    if _fork_env is not None:
        return True
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False  # started by someone else (in-process tensor parallelism): unknown env
    saved = dict(os.environ)
    base = _import_env(_worker_env({**saved, **_BASE_ENV}))
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items()
                       if not k.startswith(_IMPORT_TIME_ENV)} | base)
    try:
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _fork_env = base
    return True


def _fork_context(env: dict[str, str]) -> mp.context.BaseContext | None:
    """The fork server's context when a worker of environment ``env`` (``_worker_env``) may be
    forked from it: ours, and ``env`` matches what it imported under."""
    if not start_fork_server():
        return None
    mine, its = _import_env(env), _fork_env or {}
    if mine != its:
        logger.info("exec'ing a worker: its environment differs from the fork server's in %s",
                    sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k)))
        return None
    return mp.get_context("forkserver")


def _forked_main(argv: list[str], env: dict[str, str], log: str) -> None:
    """A forked worker: a session of its own, the log as stdout/stderr, the given environment,
    then ``kvrelay`` as if exec'd with ``argv``."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    # A worker of several tensor-parallel ranks starts them as its own children (see Forked).
    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    from kvrelay.cli import main

    sys.argv = ["kvrelay", *argv]
    sys.exit(main(argv))


class Forked:
    """``subprocess.Popen``'s view (pid, poll, wait, returncode) of a forked worker. Daemonic
    to multiprocessing, so a harness that never stopped it does not hang its exit in a join;
    the worker itself drops the flag (``_forked_main``) so it may start rank processes."""

    def __init__(self, ctx: mp.context.BaseContext, argv: list[str], env: dict[str, str],
                 log: Path):
        self._p = ctx.Process(target=_forked_main, args=(argv, env, str(log)), daemon=True,
                              name=f"kvrelay {' '.join(argv[:3])}")
        self._p.start()
        self.pid: int = self._p.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | Forked
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
                 cluster_token: str | None = None, heartbeat_s: float = 0.3,
                 ready_timeout_s: float = 90.0, fork_workers: bool = True):
        self.model_dir = str(model_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.counts = {"prefill": prefill, "decode": decode, "both": both}
        self.worker_args = tuple(worker_args)
        self.router_args = tuple(router_args)
        self.heartbeat = str(heartbeat_s)
        self.ready_timeout_s = ready_timeout_s
        self.fork_workers = fork_workers
        self.env = {**os.environ, **_BASE_ENV, **(env or {})}
        # The shared secret of the internal ports, given to every process by env (never argv),
        # and presented by this harness's own calls to the control ports.
        self.cluster_token = cluster_token
        if cluster_token:
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
        if self.fork_workers and args[0] == "worker" and cores is None:
            fork_env = _worker_env(full_env)
            ctx = _fork_context(fork_env)
            if ctx is not None:
                return Proc(name, Forked(ctx, argv, fork_env, log), log, ready)
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
