"""The SLO planner on a real local Ray (``kvrelay serve --planner``): under a ramp low -> heavy ->
low it scales the pools up, then back down, and no request fails.

The session's cluster on its embedded Ray (conftest's ``ray_served``, which test_ray used
before), the planner turned on for the module (helpers in ray_harness). The planner reads the
committed demo profile (measured with 2 torch threads; the replicas here run 1, so its
corrections have real work to do). Every wait is a bounded poll; nothing asserts timing.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from ray_harness import LOG_LEVEL, Load, Served, prompt_ids, serve_args, wait_for, workers_used

pytestmark = pytest.mark.slow
PROFILE = Path(__file__).resolve().parent.parent / "bench/results/planner/profile-demo.json"


@pytest.fixture(scope="module")
def served(ray_served, demo_model_dir):
    """The session's cluster (conftest's ``ray_served``, at 1P1D), the planner on as
    ``kvrelay serve --planner`` with these flags would start it. At most 3 replicas: the ramp
    asks for 3P1D, which the budget holds to 2P1D, so a scale-up starts one replica (starting
    two, on a host the load already keeps busy, took ~12 s instead of ~7 s, and their scale-down
    took two down steps)."""
    from kvrelay.deploy.ray_cli import build_spec

    args = serve_args(demo_model_dir, "--planner", "--profile", str(PROFILE),
                      "--ttft-slo-ms", "150", "--itl-slo-ms", "40", "--max-replicas", "3",
                      "--planner-interval", "1", "--planner-down-delay", "2",
                      "--planner-down-step", "2",
                      "--replica-startup", "6", "--planner-burst-memory", "10")
    spec = build_spec(args, loopback=True)
    assert spec.planner is not None and spec.autoscale is None and LOG_LEVEL
    assert ray_served.handle.planner(spec.planner)
    try:
        yield ray_served
    finally:
        ray_served.handle.planner(None)


def planner_decisions(served: Served, since: float) -> list[dict[str, Any]]:
    return [d for d in served.status()["decisions"] if d["t"] >= since and d["by"] == "planner"]


def test_planner_scales_up_under_a_ramp_and_back_down_with_no_failed_request(served) -> None:
    assert served.counts() == {"prefill": 1, "decode": 1, "both": 0}
    first = set(served.replicas())
    t0 = time.time()

    def light(k: int, i: int) -> tuple[int, list[int], int]:
        return -1, prompt_ids(64, random.Random(k * 1000 + i)), 8

    def heavy(k: int, i: int) -> tuple[int, list[int], int]:
        return -1, prompt_ids(1200, random.Random(90_000 + k * 1000 + i)), 8

    with Load(served.target, light, clients=1) as low:
        time.sleep(2)
    low.check(None)
    with Load(served.target, heavy, clients=4, max_per_client=400) as high:
        def grown() -> bool:
            assert not high.errors, high.errors[:3]
            return sum(served.counts().values()) > 2
        wait_for(grown, 180, "the planner scaled up", every=0.5)
        added = set(served.replicas()) - first
        wait_for(lambda: workers_used(high.done) & added, 60,  # requests on the grown pools
                 f"a request served by {sorted(added)}", every=0.2)
    high.check(None)
    with Load(served.target, light, clients=1, max_per_client=10_000) as back:
        def shrunk() -> bool:
            st = served.status()
            return (st["counts"] == {"prefill": 1, "decode": 1, "both": 0}
                    and all(d["result"] != "pending" for d in st["decisions"]))
        wait_for(shrunk, 240, "the planner scaled back to 1P1D", every=0.5)
    back.check(None)
    made = planner_decisions(served, t0)
    ups = [d for d in made if d["to"] > d["from"]]
    downs = [d for d in made if d["to"] < d["from"]]
    assert ups and downs and ups[0]["t"] < downs[-1]["t"], made
    assert all(d["result"] == "done" for d in made), made
    assert all("need" in d["reason"] and "predicted_rate" in d for d in made), made
