"""Disaggregated serving with tensor parallelism in the pools: a prefill worker of TP=A streams
its prompt KV to a decode worker of TP=B (real router, worker and rank processes, real NIXL).

For (A, B) in (2, 1), (1, 2), (2, 2), and (2, 1) / (1, 2) / (2, 4) with the smaller side in two
KV head groups: greedy tokens equal the engine alone and transformers, for prompts within one
block, across blocks and chunked; every KV block of both workers comes back.
A rank of a TP=2 decode worker killed mid-stream: its requests migrate, output identical.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from cluster import Cluster
from hf_models import hf_greedy

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = (5, 17, 300)
GEN = 8


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def want(demo_model_dir) -> dict[int, list[int]]:
    """The engine alone (TP=1) per prompt length, checked against transformers."""
    llm = LLM(demo_model_dir, num_blocks=256)
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    out = {}
    for i, n in enumerate(LENGTHS):
        ids = prompt_ids(n, i)
        out[n] = llm.generate(ids, sp)[0].token_ids
        assert out[n] == hf_greedy(demo_model_dir, ids, GEN).token_ids
    return out


def _tp(n: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(n)) if n > 1 else ()


GROUPS = ("--kv-head-groups", "2")


@pytest.mark.parametrize(("p_tp", "d_tp", "p_extra", "d_extra"), [
    (2, 1, (), ()), (1, 2, (), ()), (2, 2, (), ()),
    # The smaller side in two KV head groups: the writes go rank to rank, no repacking.
    (2, 1, (), GROUPS), (1, 2, GROUPS, ()), (2, 4, GROUPS, ())],
    ids=["2-1", "1-2", "2-2", "2-1g", "1g-2", "2g-4"])
def test_greedy_identical_across_tp_sizes(demo_model_dir, tmp_path, want, p_tp: int,
                                          d_tp: int, p_extra: tuple[str, ...],
                                          d_extra: tuple[str, ...]) -> None:
    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=0,
                 worker_args=("--max-num-batched-tokens", "128")) as c:
        c.add_worker("prefill", extra=_tp(p_tp) + p_extra, wait=False)
        c.add_worker("decode", extra=_tp(d_tp) + d_extra, wait=False)
        for p in c.workers:
            c.wait_ready(p)
        c.wait_registered()
        baseline = c.free_blocks()
        with c.client() as cl:
            for i, n in enumerate(LENGTHS):
                got = cl.generate(prompt_ids(n, i), sampling(GEN, 0.0, ignore_eos=True))
                assert got.finish_reason == "length"
                assert got.token_ids == want[n], f"P={p_tp} D={d_tp}, prompt of {n} tokens"
                # The KV came from the prefill worker: the decode worker never prefilled it.
                names = [e.name for e in got.trace]
                assert "received" in names and "prefill_end" in names, names
        assert c.wait_free_blocks(baseline) == baseline


def _rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes of a worker: the children of its multiprocessing fork
    server (a child of the worker)."""
    procs: dict[int, tuple[int, bytes]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                procs[int(d)] = (ppid, f.read())
        except (OSError, IndexError, ValueError):
            continue
    servers = {pid for pid, (ppid, cmd) in procs.items()
               if ppid == worker_pid and b"forkserver" in cmd}
    return [pid for pid, (ppid, _) in procs.items() if ppid in servers]


def test_a_killed_rank_of_a_tp_decode_worker_migrates_its_requests(demo_model_dir,
                                                                    tmp_path) -> None:
    """Rank 1 of a TP=2 decode worker dies mid-stream: the worker exits (its engine can never
    step again), the router migrates its requests to the other decode worker, and every output
    equals the engine alone's, token for token."""
    max_tokens = 160
    prompts = [prompt_ids(n, 50 + i) for i, n in enumerate((12, 40, 9, 70))]
    llm = LLM(demo_model_dir, num_blocks=256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = [llm.generate(p, sp)[0].token_ids for p in prompts]
    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=0) as c:
        c.add_worker("prefill", wait=False)
        tp_decode = c.add_worker("decode", extra=_tp(2), wait=False)
        c.add_worker("decode", wait=False)
        for p in c.workers:
            c.wait_ready(p)
        c.wait_registered()
        ranks = _rank_pids(tp_decode.popen.pid)
        assert len(ranks) == 1, ranks
        got: dict[int, tuple[list[int], list[str]]] = {}
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                with c.client() as cl:
                    r = cl.generate(prompts[i], sampling(max_tokens, 0.0, ignore_eos=True))
                    got[i] = (list(r.token_ids), [e.name for e in r.trace])
            except BaseException as e:  # asserted below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while c.status(tp_decode).load.running < 1:
            assert time.monotonic() < deadline, "the TP decode worker never streamed"
            assert all(t.is_alive() for t in threads), "requests ended before the kill"
            time.sleep(0.02)
        os.kill(ranks[0], signal.SIGKILL)
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert not errors, errors
        assert c.wait_exit(tp_decode, 60) == 70
        migrated = [i for i, (_, trace) in got.items() if "migrate" in trace]
        assert migrated, "no request was on the TP decode worker"
        for i, (tokens, _) in got.items():
            assert tokens == want[i], f"request {i} (migrated: {i in migrated})"
