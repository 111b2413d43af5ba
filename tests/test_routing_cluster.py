"""Prefix-aware routing and the fast lane on a real cluster (slow).

One 2P1D cluster whose workers beat to two routers (``prefix_aware`` and ``auto``): multi-turn
conversations stay on the prefill worker that holds their prefix and the computed prefill tokens
drop to the new ones (router metrics); a decode worker's cached prefix is not transferred again;
under the fitted model, short prompts take the fast lane while the prefill pool is busy and
long ones are disaggregated. Every output is compared with the engine alone (greedy). No timing
is asserted.
"""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.request

import grpc
import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


# -- a real cluster ---------------------------------------------------------------------------
def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in body.decode().splitlines():
        m = re.match(r"^([a-zA-Z_:]+)\{(.*)\} (\S+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(ms: dict, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in ms.items()
               if n == name and all((k, v2) in labels for k, v2 in match.items()))


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    from kvrelay.engine.llm import LLM

    return LLM(demo_model_dir, num_blocks=1024)


def greedy(llm, prompt: list[int], n: int) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0,
                                               ignore_eos=True))[0].token_ids


@pytest.fixture(scope="module")
def routers(demo_model_dir, tmp_path_factory):
    """2 prefill + 1 decode workers beating to two routers: ``prefix_aware`` (the harness's)
    and ``auto``."""
    from cluster import Cluster

    class TwoRouters(Cluster):
        def start(self) -> TwoRouters:
            self.auto = self._spawn("router-auto", [
                "router", "--model", self.model_dir, "--port", "0", "--control-port", "0",
                "--http-port", "0", "--heartbeat-interval", "0.3", "--routing-policy", "auto"])
            self.wait_ready(self.auto)
            self.worker_args = (*self.worker_args, "--router",
                                f"127.0.0.1:{self.auto.ready['control_port']}")
            super().start()
            # `auto` lists a worker once it has measured it (warm-up probe)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with grpc.insecure_channel(f"127.0.0.1:{self.auto.ready['control_port']}") as ch:
                    got = worker_pb2_grpc.RegistryStub(ch).ListWorkers(
                        wpb.ListWorkersRequest(), timeout=5).workers
                if len(got) == len(self.workers):
                    return self
                time.sleep(0.1)
            raise TimeoutError("the auto router did not calibrate every worker")

        def stop(self) -> None:
            try:
                super().stop()
            finally:
                if self.auto.popen.poll() is None:
                    self.auto.popen.terminate()
                    self.auto.popen.wait(15)

    with TwoRouters(demo_model_dir, tmp_path_factory.mktemp("routing"), prefill=2, decode=1,
                    router_args=("--routing-policy", "prefix_aware", "--http-port", "0")) as c:
        yield c


def _generate(address: str, prompt: list[int], n: int):
    from kvrelay.client import Client, sampling

    with Client(address) as cl:
        return cl.generate(prompt, sampling(n, 0.0, ignore_eos=True))


def _concurrently(fn, args: list[tuple]) -> list:
    out: list = [None] * len(args)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(*args[i])
        except BaseException as e:  # collected and raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    return out


def _workers(result, name: str) -> list[str]:
    return [e.worker for e in result.trace if e.name == name]


@pytest.mark.slow
def test_multi_turn_conversations_stay_on_their_prefill_worker(routers, llm) -> None:
    http = routers.router.ready["http_port"]
    convs = [ids(600, 100 + k) for k in range(4)]
    home: dict[int, str] = {}
    prev_len = [0] * len(convs)
    for turn in range(3):
        before = metrics(http)
        results = _concurrently(_generate, [(routers.address, c, 8) for c in convs])
        after = metrics(http)
        routed = total(after, "kvrelay:router_prompt_tokens_routed_total", pool="prefill") - \
            total(before, "kvrelay:router_prompt_tokens_routed_total", pool="prefill")
        computed = total(after, "kvrelay:router_prompt_tokens_computed_total",
                         pool="prefill") - \
            total(before, "kvrelay:router_prompt_tokens_computed_total", pool="prefill")
        assert routed == sum(len(c) for c in convs)
        # each prefill worker computes only what it does not hold: the previous turn's prompt
        # (full blocks) is its prefix cache
        new = sum(len(c) - p // 16 * 16 for c, p in zip(convs, prev_len, strict=True))
        assert computed == new, (turn, computed, new)
        if turn:
            assert computed < routed / 2
        for k, r in enumerate(results):
            assert r.token_ids == greedy(llm, convs[k], 8), (turn, k)
            (p,) = _workers(r, "prefill_end")
            assert home.setdefault(k, p) == p, f"conversation {k} moved {home[k]} -> {p}"
            if turn:
                assert r.usage.cached_prompt_tokens >= prev_len[k] // 16 * 16
            prev_len[k] = len(convs[k])
            convs[k] = convs[k] + r.token_ids + ids(40, 1000 * turn + k)
    assert len(set(home.values())) == 2  # both prefill workers took conversations


@pytest.mark.slow
def test_decode_prefix_is_not_transferred_again(routers, llm) -> None:
    http = routers.router.ready["http_port"]

    def blocks(fn) -> tuple[float, float, float]:
        before = metrics(http)
        r = fn()
        after = metrics(http)
        d = [total(after, n) - total(before, n) for n in (
            "kvrelay:router_kv_blocks_sent_total", "kvrelay:router_kv_blocks_skipped_total",
            "kvrelay:kv_transfer_bytes_total")]
        return r, *d

    prompt = ids(640, 200)
    r1, sent, skipped, nbytes = blocks(lambda: _generate(routers.address, prompt, 8))
    assert (sent, skipped) == (40, 0) and nbytes > 0
    assert r1.token_ids == greedy(llm, prompt, 8)
    # the next turn: the decode worker holds the prompt and what it generated (40 full blocks)
    turn2 = prompt + r1.token_ids + ids(40, 201)
    r2, sent2, skipped2, nbytes2 = blocks(lambda: _generate(routers.address, turn2, 8))
    assert skipped2 == 40 and sent2 == -(-len(turn2) // 16) - 40
    assert nbytes2 == nbytes * sent2 / sent
    assert r2.token_ids == greedy(llm, turn2, 8)
    # every block of a repeated prompt is cached: nothing travels, the output is unchanged
    whole = ids(320, 202)
    ra = _generate(routers.address, whole, 6)
    rb, sent3, skipped3, nbytes3 = blocks(lambda: _generate(routers.address, whole, 6))
    assert (sent3, skipped3, nbytes3) == (0, 20, 0)
    assert ra.token_ids == rb.token_ids == greedy(llm, whole, 6)


@pytest.mark.slow
def test_fast_lane_short_prompts_local_long_disaggregated(routers, llm) -> None:
    auto = routers.auto.ready
    address = f"127.0.0.1:{auto['port']}"
    ms = metrics(auto["http_port"])
    # every worker's engine fitted its step time on the warm-up probe (16 steps at least) and
    # its beats carried the fit to the router
    for pool, w in (("prefill", "prefill-1"), ("prefill", "prefill-2"), ("decode", "decode-1")):
        def term(name: str, pool: str = pool, w: str = w) -> float:
            return ms[("kvrelay:router_cost_model", (("param", name), ("pool", pool),
                                                     ("worker", w)))]

        assert term("step_samples") >= 16
        # a prompt costs something (which terms carry it is the least-squares fit's choice)
        assert term("step_prefill_token_seconds") + term("step_attended_pair_seconds") \
            + term("step_prefill_chunk_seconds") > 0
    warm = [_generate(address, ids(24, 300 + k), 4) for k in range(4)]  # requests arriving
    longs: list = [None, None]
    long_prompts = [ids(3000, 310), ids(3000, 311)]

    def run_long(i: int) -> None:
        longs[i] = _generate(address, long_prompts[i], 4)

    threads = [threading.Thread(target=run_long, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # both long prompts are prefilling: the prefill pool is busy
    shorts = [_generate(address, ids(20, 320 + k), 4) for k in range(3)]
    for t in threads:
        t.join(120)
    for r in longs:
        assert _workers(r, "prefill_start") and not _workers(r, "local_start")
    for r in shorts:
        assert _workers(r, "local_start") == ["decode-1"] and not _workers(r, "prefill_start")
    for prompt, r in [*zip(long_prompts, longs, strict=True),
                      *((ids(20, 320 + k), r) for k, r in enumerate(shorts)),
                      *((ids(24, 300 + k), r) for k, r in enumerate(warm))]:
        assert r.token_ids == greedy(llm, prompt, 4)
    ms = metrics(auto["http_port"])
    local = total(ms, "kvrelay:router_decisions_total", decision="local")
    disagg = total(ms, "kvrelay:router_decisions_total", decision="disaggregated")
    assert local >= 3 and disagg >= 2
    assert total(ms, "kvrelay:router_prompt_tokens_routed_total", pool="decode") >= 60
