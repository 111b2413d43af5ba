"""kvrelay on a real local Ray: ``kvrelay serve``'s launcher, live scaling and the autoscaler.

One cluster (router + worker actors, a placement group per replica), on the session's embedded,
loopback-only Ray, serves the whole module (and then test_planner_live: conftest's
``ray_served``), started exactly as ``kvrelay serve`` starts it (its parser and
``build_spec``). Nothing is mocked: requests go over gRPC to the router, KV over NIXL from
prefill to decode actors. Every wait is a bounded poll; nothing asserts timing.

1. 1P1D answers with the engine-alone greedy tokens; the router runs on the driver's node.
2. 1P1D -> 2P2D while 16 clients stream: every request completes with the right tokens.
3. 2P2D -> 1P1D (``kvrelay scale``, another process) under load: no request fails, the drained
   actors and their placement groups are gone, no KV block is leaked on the survivors.
4. The autoscaler (``--autoscale`` and its thresholds) grows prefill under long prompts and
   decode under long generations, each alone, and shrinks both back when idle.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import grpc
import pytest
from ray_harness import (
    CLIENTS,
    Job,
    Load,
    Served,
    assert_no_leaked_blocks,
    cycling,
    is_loopback,
    kvrelay_cli,
    listening,
    pid_alive,
    prompt_ids,
    serve_args,
    wait_for,
    worker_status,
    workers_used,
)

from kvrelay.client import Client, sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


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
def served(ray_served, jobs):
    """The session's cluster (conftest's ``ray_served``), fresh: this module runs first."""
    return ray_served


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
    # Each worker's KV tiers as its beats report them (here the pool alone: no offload tiers).
    assert all(set(w["tiers"]) == {"device"} and w["tiers"]["device"]["capacity_blocks"] > 0
               for w in st["workers"])
    assert all(r["address"].startswith("127.0.0.1:") for r in served.replicas().values())
    if os.path.isdir("/proc/self/fd"):  # workers listen on loopback only, KV data plane too
        for r in served.replicas().values():
            addrs = listening(r["pid"])
            assert addrs and all(is_loopback(a) for a in addrs), (r["worker_id"], addrs)
            # Set before torch and UCX loaded: inherited from the embedded Ray (no runtime env)
            with open(f"/proc/{r['pid']}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            assert env[b"UCX_NET_DEVICES"] == b"lo" and env[b"GOMP_SPINCOUNT"] == b"20000"
        assert "UCX_NET_DEVICES" not in os.environ  # the driver's own is left as it was
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
        # ... and the new replicas take some of it (they join a moment after the scale call
        # returns; fast answers can all land on the old pair before then).
        wait_for(lambda: workers_used(load.done_since(scaled)) & {"prefill-2", "decode-2"}, 180,
                 "work on a new replica")
    load.check(jobs)
    st = served.status()
    assert sorted(w["worker_id"] for w in st["workers"]) == [
        "decode-1", "decode-2", "prefill-1", "prefill-2"]
    assert not any(w["draining"] for w in st["workers"])
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
    # (The session's Ray also holds the removed groups of an earlier module's cluster, under
    # the same names.)
    pgs: dict[str, set[str]] = {}
    for p in placement_group_table().values():
        pgs.setdefault(p["name"], set()).add(p["state"])
    assert all(pgs[before[wid]["actor"]] == {"REMOVED"} for wid in gone), pgs
    assert all(pgs[r["actor"]] <= {"CREATED", "REMOVED"} and "CREATED" in pgs[r["actor"]]
               for r in after.values()), pgs

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
        "--autoscale-idle-ticks", "2", "--autoscale-cooldown", "2")
    cfg = build_spec(args, loopback=True).autoscale
    assert cfg is not None and cfg.prefill_queued_tokens_per_replica == 1000
    assert cfg.interval_s == 0.5 and cfg.cooldown_s == 2.0 and cfg.decode.max_replicas == 2
    return cfg


def run_until_decided(served: Served, load: Load, pool: str, other: str, since: float,
                      timeout: float = 150.0) -> None:
    """Wait (bounded) under ``load`` for the autoscaler's decision to grow ``pool`` to 2;
    ``other`` must stay at 1 meanwhile. (The test then stops the load: the replica that starts
    need not share the cores with it, and the decision is what the load was for.)"""
    def decided() -> bool:
        assert served.counts()[other] == 1, f"{other} moved under {pool} load"
        assert not load.errors, load.errors[:3]
        return any(d["pool"] == pool and d["to"] == 2 for d in decisions(served, since))
    wait_for(decided, timeout, f"{pool} scaling up", every=0.5)


def wait_scaled(served: Served, pool: str, other: str, timeout: float = 150.0) -> None:
    """Wait (bounded) for ``pool`` at 2 replicas; ``other`` must stay at 1 meanwhile."""
    def grown() -> bool:
        c = served.counts()
        assert c[other] == 1, f"{other} moved while {pool} grew: {c}"
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
            run_until_decided(served, load, "prefill", "decode", t0)
        load.check(None)
        wait_scaled(served, "prefill", "decode")
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
            return -1, prompt_ids(8, random.Random(50_000 + k * 1000 + i)), 128
        with Load(served.target, long_generation, clients=CLIENTS) as load:
            run_until_decided(served, load, "decode", "prefill", t1)
        load.check(None)
        wait_scaled(served, "decode", "prefill")
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
