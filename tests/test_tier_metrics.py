"""What the KV tiers show an operator: the worker's own metrics of each tier below its pool
(occupancy, hits, bytes, load latency, failures, from ``EngineStats.kv_tiers``), the router's
tier usage per worker (from the beats) and the prefix tokens it credited per tier when it
routed, and the tier usage a status view renders (``registry.tier_usage``).

The router is the real one, in this process, with scripted workers (``fake_workers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_workers import FakeWorker, fake
from polling import wait_for
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_in_process import RouterInProcess

from kvrelay.client import Client, sampling
from kvrelay.engine.engine_types import EngineStats
from kvrelay.engine.prefix_hash import block_hashes
from kvrelay.engine.tiers.media import DISK, HOST, TierStats
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.registry import tier_usage
from kvrelay.worker.heartbeat import tier_loads
from kvrelay.worker.metrics import WorkerMetrics

BEAT_S = 0.05


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name`` in a Prometheus exposition, by their sorted labels."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def stats(**tiers: TierStats) -> EngineStats:
    return EngineStats(num_blocks=100, num_free_blocks=60, num_running=0, num_waiting=0,
                       num_waiting_for_kv=0, num_sending=0, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_preemptions=0, waiting_prompt_tokens=0,
                       kv_tiers=tiers)


HOST_STATS = TierStats(HOST, capacity_blocks=400, used_blocks=100, stored_blocks=150,
                       stored_bytes=150 << 16, hit_blocks=20, loaded_bytes=20 << 16,
                       load_seconds=0.01, load_failures=2, evicted_blocks=50)
DISK_STATS = TierStats(DISK, capacity_blocks=4000, used_blocks=1000, stored_blocks=1000,
                       stored_bytes=1000 << 16, evicted_blocks=0)


def test_worker_metrics_show_each_tier_below_the_pool() -> None:
    current = stats(host=HOST_STATS, disk=DISK_STATS)
    m = WorkerMetrics(lambda: current, "prefill", "w1")
    text = generate_latest(m.registry).decode()

    def tier(name: str) -> dict[str, float]:
        return {dict(k)["tier"]: v for k, v in samples(text, name).items()
                if dict(k)["worker"] == "w1" and dict(k)["pool"] == "prefill"}

    assert tier("kvrelay:kv_tier_capacity_blocks") == {"host": 400, "disk": 4000}
    assert tier("kvrelay:kv_tier_used_blocks") == {"host": 100, "disk": 1000}
    assert tier("kvrelay:kv_tier_usage_perc") == {"host": 0.25, "disk": 0.25}
    assert tier("kvrelay:kv_tier_hit_blocks_total") == {"host": 20, "disk": 0}
    assert tier("kvrelay:kv_tier_stored_bytes_total")["host"] == 150 << 16
    assert tier("kvrelay:kv_tier_loaded_bytes_total")["host"] == 20 << 16
    assert tier("kvrelay:kv_tier_load_seconds_total")["host"] == pytest.approx(0.01)
    assert tier("kvrelay:kv_tier_load_seconds_per_block")["host"] == pytest.approx(0.0005)
    assert tier("kvrelay:kv_tier_load_failures_total") == {"host": 2, "disk": 0}
    assert tier("kvrelay:kv_tier_evicted_blocks_total") == {"host": 50, "disk": 0}
    # without tiers: no tier series at all
    current = stats()
    assert "kv_tier" not in generate_latest(m.registry).decode()


def test_tier_usage_renders_the_pool_and_each_tier_of_a_beat() -> None:
    load = wpb.WorkerLoad(num_blocks=100, free_blocks=60,
                          tiers=tier_loads({HOST: HOST_STATS, DISK: DISK_STATS}))
    usage = tier_usage(load)
    assert list(usage) == ["device", "disk", "host"]
    assert usage["device"] == {"used_blocks": 40, "capacity_blocks": 100, "usage": 0.4}
    assert usage["host"]["used_blocks"] == 100 and usage["host"]["usage"] == 0.25
    assert usage["host"]["hit_blocks"] == 20 and usage["host"]["load_failures"] == 2
    assert usage["host"]["load_seconds_per_block"] == pytest.approx(0.0005)
    assert tier_usage(wpb.WorkerLoad()) == {}


@pytest.fixture(scope="module")
def router(demo_model_dir: str) -> Iterator[RouterInProcess]:
    with RouterInProcess(demo_model_dir, heartbeat_interval_s=BEAT_S) as r:
        yield r


def test_the_router_routes_to_a_host_held_prefix_and_counts_it_by_tier(router) -> None:
    registry = router.router.registry
    prompt = [7 + (i * 37) % 3000 for i in range(100)]  # 6 full blocks of 16, and 4 tokens
    hs = block_hashes(prompt, 16)
    # a tie would go to the first id: the holder's must win on its credit
    workers = [FakeWorker("prefill", "a-holds-nothing", registry.model_identity),
               FakeWorker("prefill", "z-holds-in-host", registry.model_identity,
                          tier_hashes={HOST: hs}),
               fake("decode", registry.model_identity)]
    for w in workers:
        router.call(w.start(router.control_address, BEAT_S))
    try:
        wait_for(lambda: len(registry.alive("prefill")) == 2 and registry.alive("decode"), 5,
                 "workers joining", every=0.01)
        holder = workers[1].worker_id
        wait_for(lambda: registry.workers[holder].reported.hashes(HOST) == set(hs), 5,
                 "the host tier's hashes", every=0.01)
        with Client(router.address) as c:
            out = c.generate(prompt, sampling(2, 0.0, ignore_eos=True), timeout=30)
        assert len(out.token_ids) == 2
        assert (workers[1].calls["Prefill"], workers[0].calls["Prefill"]) == (1, 0)
        text = router.router.metrics.render().decode()
        credited = samples(text, "kvrelay:router_prefix_tokens_credited_total")
        # the holder held every usable block (6, the last token computed anyway) in host
        assert credited == {(("pool", "prefill"), ("tier", "host"), ("worker", holder)): 96}
        usage = samples(text, "kvrelay:kv_tier_usage_perc")  # as the worker names it
        assert usage == {(("pool", "prefill"), ("tier", "host"), ("worker", holder)): 0.0}
        weights = samples(text, "kvrelay:router_tier_weight")
        assert weights[(("pool", "prefill"), ("tier", "host"), ("worker", holder))] == 0.75
        # operators listing the workers see each tier's load
        (status,) = [s for s in registry.status() if s.info.worker_id == holder]
        assert [t.medium for t in status.load.tiers] == [HOST]
    finally:
        for w in workers:
            router.call(w.stop())
        wait_for(lambda: not registry.workers, 5, "workers leaving", every=0.01)
