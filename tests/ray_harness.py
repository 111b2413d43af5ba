"""Shared by the tests that run kvrelay on a real local Ray (test_ray, test_planner_live): the
embedded Ray (``embedded_ray``), ``kvrelay serve``'s arguments and handle, a streaming load of
client threads, and the checks on a served cluster (KV blocks back, listening addresses).
Every wait is a bounded poll."""

from __future__ import annotations

import ipaddress
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from polling import wait_for

from kvrelay.client import Client, Completion, sampling
from kvrelay.common.rpc import token_metadata
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

CLIENTS = 16
HEARTBEAT_S = "0.5"
# The actors' logs reach this process (and pytest's report); INFO shows every request.
LOG_LEVEL = os.environ.get("KVRELAY_TEST_RAY_LOG_LEVEL", "WARNING")


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(7, 4000) for _ in range(n)]


@dataclass(frozen=True)
class Job:
    ids: list[int]
    max_tokens: int
    want: list[int] = field(default_factory=list)  # greedy tokens of the engine alone


def embedded_ray() -> Iterator[Any]:
    """The embedded Ray ``kvrelay serve`` starts, for the length of the generator (conftest's
    session fixture ``ray_session``: one for every module that runs on Ray)."""
    from kvrelay.deploy.ray_connect import AUTH_MODE_ENV, init_ray

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        pytest.skip("another Ray session is already attached to this process")
    # Ray read the loopback switch when it was first imported and stays imported: the switch
    # stays set after the session (a later module's session needs it), the auth mode is restored.
    saved = {AUTH_MODE_ENV: os.environ.get(AUTH_MODE_ENV)}
    # init_ray imports ray itself, after setting the loopback-only switch Ray reads at import.
    # 8 logical CPUs on this 2-core box: 2P2D at one CPU per replica, plus headroom.
    assert init_ray(None, num_cpus=8, object_store_memory="96MiB")
    ray = sys.modules["ray"]
    try:
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serve_args(model: str, *extra: str) -> Any:
    from kvrelay.cli import build_parser

    return build_parser().parse_args([
        "serve", "--model", model, "--prefill", "1", "--decode", "1",
        "--grpc-port", "0", "--control-port", "0", "--http-port", "-1",
        "--kv-cache-memory", "96MiB", "--heartbeat-interval", HEARTBEAT_S,
        "--drain-timeout", "60", "--log-level", LOG_LEVEL, *extra])


@dataclass
class Served:
    handle: Any
    info: dict[str, Any]
    gcs: str
    token: str  # the cluster token this launch generated for its internal ports

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    def status(self) -> dict[str, Any]:
        return self.handle.status()

    def counts(self) -> dict[str, int]:
        return self.status()["counts"]

    def replicas(self) -> dict[str, dict[str, Any]]:
        """worker_id -> replica (address, actor name, ...) of the live replicas."""
        return {r["worker_id"]: r for rs in self.status()["replicas"].values() for r in rs}


def worker_status(address: str, token: str) -> wpb.WorkerStatus:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerControlStub(ch).GetStatus(
            wpb.GetStatusRequest(), timeout=10, metadata=token_metadata(token))


def blocks(served: Served) -> dict[str, tuple[int, int]]:
    """worker_id -> (free KV blocks, all KV blocks), asked of each live worker itself."""
    out = {}
    for wid, r in served.replicas().items():
        load = worker_status(r["address"], served.token).load
        out[wid] = (load.free_blocks, load.num_blocks)
    return out


def assert_no_leaked_blocks(served: Served, timeout: float = 30.0) -> None:
    """Idle workers hold no KV: every block is free again (prefix-cached blocks count free)."""
    def settled() -> bool:
        return all(free == total for free, total in blocks(served).values())
    try:
        wait_for(settled, timeout, "every KV block back", every=0.2)
    except TimeoutError:
        pytest.fail(f"KV blocks leaked: {blocks(served)}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(pid: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Addresses the TCP sockets of process ``pid`` listen on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    raw = bytes.fromhex(cols[1].split(":")[0])
                    out.add(ipaddress.ip_address(b"".join(
                        raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return out


def is_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def kvrelay_cli(*argv: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvrelay ...`` as a separate driver; no RAY_AUTH_MODE in its environment, as in a
    fresh shell (it must find the local cluster's token by itself)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["NIXL_LOG_LEVEL"] = "WARN"
    p = subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"kvrelay {' '.join(argv)} failed:\n{p.stdout}\n{p.stderr[-3000:]}"
    return p


# -- load ------------------------------------------------------------------------------------------
@dataclass
class Done:
    client: int
    job: int
    started: float
    out: Completion


class Load:
    """``clients`` threads sending requests back to back (streamed) until stopped."""

    def __init__(self, target: str, make: Callable[[int, int], tuple[int, list[int], int]],
                 clients: int = CLIENTS, max_per_client: int = 200, timeout: float = 180.0):
        self.target, self.make, self.clients = target, make, clients
        self.max_per_client, self.timeout = max_per_client, timeout
        self.done: list[Done] = []
        self.errors: list[tuple[int, BaseException]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(clients)]

    def _run(self, k: int) -> None:
        with Client(self.target) as c:
            for i in range(self.max_per_client):
                if self._stop.is_set():
                    return
                job, ids, n = self.make(k, i)
                t0 = time.monotonic()
                try:
                    out = c.generate(ids, sampling(n, 0.0, ignore_eos=True),
                                     timeout=self.timeout)
                except BaseException as e:  # collected, asserted by the test
                    with self._lock:
                        self.errors.append((job, e))
                    continue
                with self._lock:
                    self.done.append(Done(k, job, t0, out))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 240.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client is stuck"

    def done_since(self, t: float) -> list[Done]:
        """The requests answered so far that were sent at or after ``t``."""
        with self._lock:
            return [d for d in self.done if d.started >= t]

    def each_client_started_after(self, t: float) -> bool:
        return len({d.client for d in self.done_since(t)}) == self.clients

    def check(self, jobs: list[Job] | None) -> None:
        assert not self.errors, f"{len(self.errors)} requests failed: {self.errors[:3]}"
        assert self.done
        for d in self.done:
            assert d.out.finish_reason == "length", (d.job, d.out.finish_reason)
            if jobs is not None:
                assert d.out.token_ids == jobs[d.job].want, f"job {d.job}"


def cycling(jobs: list[Job]) -> Callable[[int, int], tuple[int, list[int], int]]:
    def make(k: int, i: int) -> tuple[int, list[int], int]:
        j = (k * 7 + i * CLIENTS) % len(jobs)
        return j, jobs[j].ids, jobs[j].max_tokens
    return make


def workers_used(done: list[Done]) -> set[str]:
    return {e.worker for d in done for e in d.out.trace if e.worker}
