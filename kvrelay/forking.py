"""Starting the loopback harness's processes by fork instead of exec (``kvrelay.local_cluster``).

A worker started by exec spends ~3.3 CPU s importing torch, a router ~3.5 importing
transformers' tokenizer machinery and FastAPI, and a test suite starts about a hundred of them.
Here they fork, after those imports, from one of two servers:

- workers from this process's multiprocessing fork server, which imported torch and the worker
  (``kvrelay.fork_preload``) under a cluster's default environment with the workers' OpenMP
  defaults in place (``start_fork_server``; the tests start it first thing);
- routers from a torch-free zygote process (``RouterZygote``): torch forbidden, the router and
  its tokenizer classes imported, the heap frozen; it forks each router and reports its exit.

Each fork is still a process of its own (own session, log, environment, exit status) that runs
``kvrelay.cli.main`` as if exec'd. A process whose environment differs from its server's in
what is read at start-up (``_IMPORT_TIME_ENV``) is exec'd instead, and logged.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from pathlib import Path

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
BASE_ENV = {"NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
# What the router's tokenizer machinery reads when it is imported.
_ROUTER_IMPORT_ENV = ("HF_", "TRANSFORMERS_", "HUGGINGFACE_", "TOKENIZERS_")


def _import_env(env: dict[str, str],
                prefixes: tuple[str, ...] = _IMPORT_TIME_ENV) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(prefixes)}


def _matches(kind: str, mine: dict[str, str], its: dict[str, str]) -> bool:
    """Whether a process's start-up environment is its server's; logs the differing names."""
    if mine == its:
        return True
    logger.info("exec'ing a %s: its environment differs from its fork server's in %s", kind,
                sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k)))
    return False


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (a server started here inherits it), restored after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the OpenMP defaults that ``kvrelay worker`` sets before it imports torch."""
    from kvrelay.common.omp_env import apply_worker_omp_defaults

    env = dict(env)
    apply_worker_omp_defaults(env)
    return env


def start_fork_server() -> bool:
    """Start this process's multiprocessing fork server for the workers (see the module):
    importing torch and the worker under a cluster's default environment (this process's,
    ``BASE_ENV``, the OpenMP defaults). Call it before anything else in the process uses the
    fork server (the tests do, at session start): everyone shares one, and its preload and
    environment are fixed when it starts. False when someone else started it first."""
    global _fork_env
    if _fork_env is not None:
        return True
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False  # started by someone else (in-process tensor parallelism): unknown env
    current = dict(os.environ)
    base = _import_env(worker_env({**current, **BASE_ENV}))
    with _environ({k: v for k, v in current.items()
                   if not k.startswith(_IMPORT_TIME_ENV)} | base):
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
    _fork_env = base
    return True


def fork_context(env: dict[str, str]) -> mp.context.BaseContext | None:
    """The fork server's context when a worker of environment ``env`` (``worker_env``) may be
    forked from it: ours, and ``env`` matches what it imported under."""
    if not start_fork_server() or not _matches("worker", _import_env(env), _fork_env or {}):
        return None
    return mp.get_context("forkserver")


def _forked_main(argv: list[str], env: dict[str, str], log: str,
                 close_fds: tuple[int, ...] = ()) -> None:
    """A forked process: a session of its own, the log as stdout/stderr, the given environment,
    then ``kvrelay`` as if exec'd with ``argv``."""
    for fd in close_fds:  # the zygote's pipe to the harness
        os.close(fd)
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
    from kvrelay.cli import build_parser, run

    args = build_parser().parse_args(argv)
    if getattr(args, "tensor_parallel_size", 1) > 1:
        _fork_rank_server()
    sys.argv = ["kvrelay", *argv]
    sys.exit(run(args))


def _fork_rank_server() -> None:
    """Make this process's multiprocessing fork server (the one its TP ranks start from,
    ``engine/tensor_parallel.py``) a fork of this process, now, while it is a single-threaded
    copy of the harness's server: torch, the engine and UCX (``kvrelay.fork_preload``) are
    imported already. Started as multiprocessing starts one, it would be a new interpreter that
    imports them again: ~1.5-2.3 CPU s for every TP worker a test starts.

    What ``ForkServer.ensure_running`` does, with ``os.fork`` for its exec: the listening socket,
    the "alive" pipe (the server exits when every process holding its write end has), and the
    server's address and pid where this process's multiprocessing looks for them."""
    import socket
    from multiprocessing import connection, util

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        return
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: it exits by itself once the alive pipe closes
            code = 1
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


class _PopenView:
    """What the harness uses of ``subprocess.Popen`` (pid, returncode, poll, wait, signals), for
    a process it did not start itself; subclasses give ``returncode`` and ``wait``."""

    pid: int

    @property
    def returncode(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        raise NotImplementedError

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(_PopenView):
    """A worker forked by the fork server. Daemonic to multiprocessing, so a harness that never
    stopped it does not hang its exit in a join; the worker itself drops the flag
    (``_forked_main``) so it may start rank processes."""

    def __init__(self, ctx: mp.context.BaseContext, argv: list[str], env: dict[str, str],
                 log: Path):
        self._p = ctx.Process(target=_forked_main, args=(argv, env, str(log)), daemon=True,
                              name=f"kvrelay {' '.join(argv[:3])}")
        self._p.start()
        self.pid: int = self._p.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._p.exitcode


# -- routers: a torch-free zygote --------------------------------------------------------------
def _router_import_env(env: dict[str, str]) -> dict[str, str]:
    return _import_env(env, _IMPORT_TIME_ENV + _ROUTER_IMPORT_ENV)


def _zygote_main(conn: Connection) -> None:
    """The router zygote: import what a router imports (torch forbidden, as ``kvrelay router``
    does), freeze the heap, then fork a router per request and report each one's exit."""
    from kvrelay.common.torch_free import forbid_torch

    forbid_torch()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401  (lazy in it)

    import kvrelay.cli
    import kvrelay.router.server

    kvrelay.cli.build_parser()
    gc.collect()
    gc.freeze()
    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]  (it forks)
    fork = mp.get_context("fork")
    children: dict[int, mp.process.BaseProcess] = {}  # sentinel -> process
    while True:
        ready = wait([conn, *children])
        for r in ready:
            if r is conn:
                try:
                    argv, env, log = conn.recv()
                except EOFError:  # the harness is gone
                    for p in children.values():
                        p.kill()
                    return
                p = fork.Process(target=_forked_main, args=(argv, env, log, (conn.fileno(),)),
                                 daemon=True)
                p.start()
                children[p.sentinel] = p
                conn.send(("started", p.pid))
            else:
                p = children.pop(r)  # type: ignore[call-overload]
                p.join()
                conn.send(("exit", p.pid, p.exitcode))


class RouterZygote:
    """The harness's side of the router zygote: starts it (spawned, under this process's
    environment), asks it for routers, and collects their exit statuses."""

    _instance: RouterZygote | None = None

    def __init__(self, env: dict[str, str]):
        self.import_env = _router_import_env(env)
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        with _environ(env):  # the zygote imports under a cluster's environment
            self._proc = ctx.Process(target=_zygote_main, args=(theirs,), daemon=True,
                                     name="kvrelay-router-zygote")
            self._proc.start()
        theirs.close()
        self._lock = threading.Lock()  # one start request at a time
        self._cond = threading.Condition()
        self._started: list[int] = []
        self.codes: dict[int, int] = {}
        threading.Thread(target=self._read, name="router-zygote-reader", daemon=True).start()

    @classmethod
    def for_env(cls, env: dict[str, str]) -> RouterZygote | None:
        """The zygote that may fork a router of environment ``env``: started on first use,
        None when ``env`` differs from its start-up environment."""
        if cls._instance is None:
            cls._instance = cls(env)
        z = cls._instance
        if not _matches("router", _router_import_env(env), z.import_env):
            return None
        return z if z._proc.is_alive() else None

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            with self._cond:
                if msg[0] == "started":
                    self._started.append(msg[1])
                else:
                    self.codes[msg[1]] = msg[2]
                self._cond.notify_all()

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ZygoteChild:
        with self._lock:
            self._conn.send((argv, env, str(log)))
            with self._cond:
                # A zygote that died at start-up (its main module imported torch, say) answers
                # nothing: its process ends.
                for _ in range(150):
                    if self._started or not self._proc.is_alive():
                        break
                    self._cond.wait(0.2)
                if not self._started:
                    raise RuntimeError(f"the router zygote did not answer (exit code "
                                       f"{self._proc.exitcode})")
                pid = self._started.pop(0)
        return ZygoteChild(self, pid)


class ZygoteChild(_PopenView):
    """A router forked by the zygote; its exit status comes back through the zygote."""

    def __init__(self, zygote: RouterZygote, pid: int):
        self._z = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._z.codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        with self._z._cond:
            if not self._z._cond.wait_for(lambda: self.pid in self._z.codes, timeout=timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._z.codes[self.pid]
