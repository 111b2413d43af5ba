"""kvrelay on a real local Ray: ``kvrelay serve``'s launcher, live scaling and the autoscaler.

One embedded, loopback-only Ray session and one cluster (router + worker actors, a placement
group per replica) serve the whole module, started exactly as ``kvrelay serve`` starts it
(its parser and ``build_spec``). Nothing is mocked: requests go over gRPC to the router, KV
over NIXL from prefill to decode actors. Every wait is a bounded poll; nothing asserts timing.

1. 1P1D answers with the engine-alone greedy tokens; the router runs on the driver's node.
2. 1P1D -> 2P2D while 16 clients stream: every request completes with the right tokens.
3. 2P2D -> 1P1D (``kvrelay scale``, another process) under load: no request fails, the drained
   actors and their placement groups are gone, no KV block is leaked on the survivors.
4. The autoscaler (``--autoscale`` and its thresholds) grows prefill under long prompts and
   decode under long generations, each alone, and shrinks both back when idle.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvrelay.client import Client, Completion, sampling
from kvrelay.common.rpc import token_metadata
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

pytestmark = pytest.mark.slow

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


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        time.sleep(every)


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, num_blocks=1024, num_threads=1)


@pytest.fixture(scope="module")
def jobs(llm) -> list[Job]:
    """Mixed requests with their reference tokens (computed before the cluster starts)."""
    rng = random.Random(4)
    raw = [(prompt_ids(rng.choice([1, 17, 60, 200, 513]), rng), rng.randint(8, 40))
           for _ in range(32)]
    outs = llm.generate([ids for ids, _ in raw],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                         for _, n in raw])
    return [Job(ids, n, o.token_ids) for (ids, n), o in zip(raw, outs, strict=True)]


@pytest.fixture(scope="module")
def ray_session():
    """One embedded Ray for the module, started as ``kvrelay serve`` starts it."""
    from kvrelay.deploy.ray_cli import AUTH_MODE_ENV, LOOPBACK_ENV, init_ray

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        pytest.skip("another Ray session is already attached to this process")
    saved = {k: os.environ.get(k) for k in (AUTH_MODE_ENV, LOOPBACK_ENV)}
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


@pytest.fixture(scope="module")
def served(ray_session, demo_model_dir, jobs):
    from kvrelay.deploy.launcher import start
    from kvrelay.deploy.ray_cli import build_spec

    ray = ray_session
    spec = build_spec(serve_args(demo_model_dir), loopback=True)
    assert spec.worker.cluster_token  # generated: no --cluster-token was given
    handle, info = start(spec)
    try:
        yield Served(handle, info, ray.get_runtime_context().gcs_address,
                     spec.worker.cluster_token)
    finally:
        handle.shutdown()


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

    def each_client_started_after(self, t: float) -> bool:
        with self._lock:
            return len({d.client for d in self.done if d.started >= t}) == self.clients

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


# -- 1. serve 1P1D ---------------------------------------------------------------------------------
def test_serve_1p1d_greedy_equals_engine_alone(served, jobs, ray_session) -> None:
    ray = ray_session
    st = served.status()
    assert st["counts"] == {"prefill": 1, "decode": 1, "both": 0}
    # The router is pinned to the driver's node; embedded Ray: everything on loopback.
    assert st["router"]["node_id"] == ray.get_runtime_context().get_node_id()
    assert st["router"]["torch"] is False  # the router actor's process carries no torch
    assert served.info["host"] == "127.0.0.1"
    assert {w["worker_id"]: w["role"] for w in st["workers"]} == {"prefill-1": "prefill",
                                                                  "decode-1": "decode"}
    assert all(w["address"].startswith("127.0.0.1:") for w in st["workers"])
    assert all(r["address"].startswith("127.0.0.1:") for r in served.replicas().values())
    if os.path.isdir("/proc/self/fd"):  # workers listen on loopback only, KV data plane too
        for r in served.replicas().values():
            addrs = listening(r["pid"])
            assert addrs and all(is_loopback(a) for a in addrs), (r["worker_id"], addrs)
    assert_no_leaked_blocks(served)
    with Client(served.target) as c:
        for k, job in enumerate(jobs[:8]):
            got = c.generate(job.ids, sampling(job.max_tokens, 0.0, ignore_eos=True),
                             timeout=120)
            assert got.finish_reason == "length"
            assert got.token_ids == job.want, f"job {k} ({len(job.ids)} prompt tokens)"
            assert {"prefill-1", "decode-1"} <= {e.worker for e in got.trace}
    assert_no_leaked_blocks(served)


# -- 2. scale out under load -----------------------------------------------------------------------
def test_scale_to_2p2d_while_16_requests_stream(served, jobs) -> None:
    with Load(served.target, cycling(jobs)) as load:
        wait_for(lambda: len(load.done) >= CLIENTS // 2, 120, "first answers")
        counts = served.handle.scale(prefill=2, decode=2)
        assert counts == {"prefill": 2, "decode": 2, "both": 0}
        scaled = time.monotonic()
        # Every client gets at least one more answer from the grown cluster.
        wait_for(lambda: load.each_client_started_after(scaled), 180,
                 "an answer for each client after the scale-out")
    load.check(jobs)
    st = served.status()
    assert sorted(w["worker_id"] for w in st["workers"]) == [
        "decode-1", "decode-2", "prefill-1", "prefill-2"]
    assert not any(w["draining"] for w in st["workers"])
    after = [d for d in load.done if d.started >= scaled]
    assert workers_used(after) & {"prefill-2", "decode-2"}, "new replicas took no work"
    assert_no_leaked_blocks(served)


# -- 3. scale in under load ------------------------------------------------------------------------
def test_scale_back_to_1p1d_under_load_drains(served, jobs, ray_session) -> None:
    from ray.util.placement_group import placement_group_table

    from kvrelay.deploy.launcher import NAMESPACE

    ray = ray_session
    before = served.replicas()
    assert len(before) == 4
    with Load(served.target, cycling(jobs)) as load:
        wait_for(lambda: len(load.done) >= CLIENTS, 120, "answers before the scale-in")
        # Another driver, as an operator would: `kvrelay scale` against this Ray.
        out = kvrelay_cli("scale", "--address", served.gcs, "--prefill", "1", "--decode", "1")
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {
            "prefill": 1, "decode": 1, "both": 0}
        scaled = time.monotonic()
        wait_for(lambda: load.each_client_started_after(scaled), 180,
                 "an answer for each client after the scale-in")
    load.check(jobs)  # no request failed while two workers drained away

    after = served.replicas()
    assert len(after) == 2
    assert {r["draining"] for r in after.values()} == {False}
    gone = set(before) - set(after)
    assert {g.split("-")[0] for g in gone} == {"prefill", "decode"}
    # Drained actors are gone: not reachable by name, their processes exited, their gRPC ports
    # closed, their placement groups removed, and the router no longer lists them.
    for wid in gone:
        r = before[wid]
        with pytest.raises(ValueError):
            ray.get_actor(r["actor"], namespace=NAMESPACE)
        wait_for(lambda pid=r["pid"]: not pid_alive(pid), 30, f"{wid}'s process to exit")
        with pytest.raises(grpc.RpcError) as e:
            worker_status(r["address"], served.token)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    pgs = {p["name"]: p["state"] for p in placement_group_table().values()}
    assert all(pgs[before[wid]["actor"]] == "REMOVED" for wid in gone), pgs
    assert all(pgs[r["actor"]] == "CREATED" for r in after.values()), pgs

    st = json.loads(kvrelay_cli("status", "--address", served.gcs).stdout)
    assert st["counts"] == {"prefill": 1, "decode": 1, "both": 0}
    assert sorted(w["worker_id"] for w in st["workers"]) == sorted(after)
    # The survivors hold no KV of the finished (or drained-away) requests.
    assert_no_leaked_blocks(served)
    with Client(served.target) as c:
        job = jobs[3]
        got = c.generate(job.ids, sampling(job.max_tokens, 0.0, ignore_eos=True), timeout=60)
        assert got.token_ids == job.want


# -- 4. the autoscaler -----------------------------------------------------------------------------
def autoscale_config(model: str) -> Any:
    """The ``--autoscale`` flags of ``kvrelay serve``, small enough for a test."""
    from kvrelay.deploy.ray_cli import build_spec

    args = serve_args(
        model, "--autoscale", "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1",
        "--max-decode", "2", "--prefill-queued-tokens-target", "1000",
        "--decode-running-target", "10", "--decode-kv-usage-target", "0.9",
        "--autoscale-interval", "0.5", "--autoscale-sustain", "2",
        "--autoscale-idle-ticks", "4", "--autoscale-cooldown", "2")
    cfg = build_spec(args, loopback=True).autoscale
    assert cfg is not None and cfg.prefill_queued_tokens_per_replica == 1000
    assert cfg.interval_s == 0.5 and cfg.cooldown_s == 2.0 and cfg.decode.max_replicas == 2
    return cfg


def run_until_scaled(served: Served, load: Load, pool: str, other: str,
                     timeout: float = 150.0) -> None:
    """Wait (bounded) for ``pool`` to reach 2 replicas; ``other`` must stay at 1 meanwhile."""
    def grown() -> bool:
        c = served.counts()
        assert c[other] == 1, f"{other} moved under {pool} load: {c}"
        assert not load.errors, load.errors[:3]
        return c[pool] == 2
    wait_for(grown, timeout, f"{pool} scaled up", every=0.5)


def wait_idle_shrink(served: Served, pool: str, since: float, timeout: float = 120.0) -> None:
    """Wait (bounded) for ``pool`` back at 1 replica, its autoscaler changes all finished."""
    def shrunk() -> bool:
        st = served.status()
        return (st["counts"] == {"prefill": 1, "decode": 1, "both": 0}
                and len(st["workers"]) == 2
                and any(d["pool"] == pool and d["to"] == 1 for d in st["decisions"]
                        if d["t"] >= since)
                and all(d["result"] != "pending" for d in st["decisions"]))
    wait_for(shrunk, timeout, f"{pool} back to 1 when idle", every=0.5)


def decisions(served: Served, since: float) -> list[dict[str, Any]]:
    return [d for d in served.status()["decisions"] if d["t"] >= since]


def test_autoscaler_grows_each_pool_on_its_own_signal_and_shrinks_when_idle(
        served, demo_model_dir) -> None:
    assert served.counts() == {"prefill": 1, "decode": 1, "both": 0}
    assert served.handle.autoscale(autoscale_config(demo_model_dir))
    try:
        # (a) A burst of long prompts (one token each): the prefill queue grows, decode does not.
        # The prefill worker clears a 1200-token prompt quickly, so the queue swings between
        # one and five prompts; the target (1000) sits below one prompt so that every tick of
        # the burst counts as over it, whatever the timing.
        t0 = time.time()

        def long_prompt(k: int, i: int) -> tuple[int, list[int], int]:
            return -1, prompt_ids(1200, random.Random(k * 1000 + i)), 1
        with Load(served.target, long_prompt, clients=5) as load:
            run_until_scaled(served, load, "prefill", "decode")
        load.check(None)
        wait_idle_shrink(served, "prefill", t0)
        made = decisions(served, t0)
        assert [(d["pool"], d["from"], d["to"]) for d in made] == [
            ("prefill", 1, 2), ("prefill", 2, 1)], made
        assert "queued prompt tokens" in made[0]["reason"]
        assert made[1]["reason"].startswith("idle")
        assert all(d["result"] == "done" for d in made), made

        # (b) Many long generations from short prompts: decode grows, prefill does not.
        t1 = time.time()

        def long_generation(k: int, i: int) -> tuple[int, list[int], int]:
            return -1, prompt_ids(8, random.Random(50_000 + k * 1000 + i)), 256
        with Load(served.target, long_generation, clients=CLIENTS) as load:
            run_until_scaled(served, load, "decode", "prefill")
        load.check(None)
        wait_idle_shrink(served, "decode", t1)
        made = decisions(served, t1)
        assert [(d["pool"], d["from"], d["to"]) for d in made] == [
            ("decode", 1, 2), ("decode", 2, 1)], made
        assert "running" in made[0]["reason"] and made[1]["reason"].startswith("idle")
        assert all(d["result"] == "done" for d in made), made
    finally:
        served.handle.autoscale(None)
    assert served.status()["autoscale"] is None
    assert_no_leaked_blocks(served)
