"""KV tiers in a disaggregated cluster: a prompt whose blocks every pool has evicted comes back
from the workers' host tiers (prefill and decode alike) with the engine alone's tokens, also
when its decode worker is killed mid-stream and the request migrates; every block returns."""

from __future__ import annotations

import contextlib
import random

import pytest
from cluster import Cluster
from polling import wait_for

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

POOL_BLOCKS = 64  # 1024 tokens of 16: four 300-token prompts evict a fifth
N = 300


def prompt_ids(seed: int, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("tiers")
    with Cluster(demo_model_dir, work, prefill=1, decode=2,
                 worker_args=("--num-kv-blocks", str(POOL_BLOCKS), "--kv-offload-memory",
                              "48MiB", "--kv-offload-dir", str(work / "disk"),
                              "--kv-offload-disk", "64MiB")) as c:
        yield c


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, num_blocks=512)


def alone(llm: LLM, ids: list[int], n: int) -> list[int]:
    return llm.generate(ids, SamplingParams(max_tokens=n, temperature=0,
                                            ignore_eos=True))[0].token_ids


def evict(c, first_seed: int) -> None:
    """Eight other prompts (four a decode worker): the earlier ones' blocks leave every pool."""
    for s in range(first_seed, first_seed + 8):
        c.generate(prompt_ids(s), sampling(4, 0.0, ignore_eos=True))


def host_hits(c) -> dict[str, int]:
    """Each live worker's host-tier hits, as its status reports them."""
    return {p.name: sum(t.hit_blocks for t in c.status(p).load.tiers if t.medium == "host")
            for p in c.workers if p.alive()}


def test_an_evicted_prompt_comes_back_from_the_tiers(cluster, llm) -> None:
    baseline = cluster.free_blocks()
    ids = prompt_ids(1000)
    before = host_hits(cluster)
    served: dict[str, int] | None = None

    def both_served(since: dict[str, int]) -> dict[str, int] | None:
        """The host-tier hits since ``since``, once the prefill worker and a decode worker
        both have some."""
        hits = {k: v - since.get(k, 0) for k, v in host_hits(cluster).items()}
        decode = any(v for k, v in hits.items() if k.startswith("decode"))
        return hits if hits["prefill-1"] and decode else None

    with cluster.client() as c:
        first = c.generate(ids, sampling(16, 0.0, ignore_eos=True))
        assert first.token_ids == alone(llm, ids, 16)
        # The router picks the decode worker by its estimate (the KV transfer a held prefix
        # saves against each worker's step time): on a busy host it may take the other decode
        # worker, whose tiers never held this prompt. After a second round both have held it.
        for attempt in range(2):
            evict(c, 2000 + 100 * attempt)
            again = c.generate(ids, sampling(16, 0.0, ignore_eos=True))
            assert again.token_ids == first.token_ids
            assert again.usage.cached_prompt_tokens >= N // 16 * 16 - 16, again.usage
            # It came from the host tiers (both workers': the prefill worker's to compute the
            # last token, the decode worker's for its reservation), as their status reports.
            with contextlib.suppress(TimeoutError):
                served = wait_for(lambda: both_served(before), 5, "host-tier hits", every=0.2)
                break
    assert served, host_hits(cluster)
    assert cluster.wait_free_blocks(baseline) == baseline


def test_a_tier_hit_survives_a_decode_worker_migration(cluster, llm) -> None:
    ids = prompt_ids(3000)
    n = 120
    ref = alone(llm, ids, n)
    with cluster.client() as c:
        c.generate(ids, sampling(4, 0.0, ignore_eos=True))
        evict(c, 4000)
    cluster.ensure_workers(decode=2)
    killed = cluster.stream_killing_its_decode_worker(ids, n)
    got, usage = killed.tokens, killed.usage
    assert got == ref
    assert usage is not None and usage.cached_prompt_tokens > 0, usage
