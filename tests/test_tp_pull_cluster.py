"""Pull instead of recompute between tensor-parallel workers, end to end (real processes, real
NIXL, one agent per rank): turn two's prefill worker (TP=2) reads the history the decode worker
(TP=2) generated, each prefill rank its own heads from the decode rank holding them, computes
only the rest, and serves the engine alone's greedy tokens; every block comes back.

Before each rank had its own agent, a pull between TP pools was refused (one agent could not
read heads into another process's cache) and the prompt was recomputed.
"""

from __future__ import annotations

import pytest
from cluster import Cluster
from test_prefix_pull_cluster import (
    alone,
    prompt_ids,
    second_turn_pulls_from_the_decode_worker,
)

from kvrelay.engine.llm import LLM

pytestmark = pytest.mark.slow

TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("tp-pull"), prefill=0, decode=0,
                 router_args=("--http-port", "0", "--policy", "round_robin",
                              "--prefix-pull", "always")) as c:
        decode = c.add_worker("decode", extra=TP2, wait=False)  # both start at once
        c.add_worker("prefill", extra=TP2)
        c.wait_ready(decode)
        c.wait_registered()
        yield c


def test_turn_two_pulls_the_history_from_a_tp_decode_worker(cluster, demo_model_dir) -> None:
    llm = LLM(demo_model_dir, num_blocks=256)
    second_turn_pulls_from_the_decode_worker(
        cluster, lambda ids, n: alone(llm, ids, n), prompt_ids(11), prompt_ids(12, 20))
