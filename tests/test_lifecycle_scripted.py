"""The router's request lifecycle against scripted workers (``fake_workers``): each branch of
retry and migration, driven on purpose and checked in milliseconds, where the chaos tests
(real processes, stalls and kills under load) reach them by chance.

The router is the real one, in this process (``router_in_process``); its workers answer from
a script. Every request must end with the output ``expected`` says (a resumed stream continues
exactly) or with the status the branch calls for, and every lease a worker granted must end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from fake_workers import Failure, FakeWorker, expected, fake
from polling import wait_for
from router_in_process import RouterInProcess

from kvrelay.client import Client, sampling
from kvrelay.common.failures import FailureKind, failure_md
from kvrelay.router.requests import RouterConfig

BEAT_S = 0.05
PROMPT = [11, 12, 13, 14, 15]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
PER_CALL = pytest.mark.parametrize("router", [True, False], ids=["sessions", "per-call"],
                                   indirect=True)


@pytest.fixture(scope="module")
def router(demo_model_dir: str, request: pytest.FixtureRequest) -> Iterator[RouterInProcess]:
    """The decode streams go over each worker's Session; ``PER_CALL`` tests run again with
    one RPC per stream (``RouterConfig.stream_sessions`` off)."""
    config = RouterConfig(kv_wait_s=0.3, worker_wait_s=1.0, max_migrations=2,
                          stream_sessions=getattr(request, "param", True))
    with RouterInProcess(demo_model_dir, heartbeat_interval_s=BEAT_S, config=config) as r:
        yield r


@pytest.fixture
def start(router: RouterInProcess) -> Iterator[Callable[..., FakeWorker]]:
    """``start(role, **fields) -> FakeWorker``, joined; all of them stopped after the test,
    and gone from the registry before the next."""
    registry = router.router.registry
    started: list[FakeWorker] = []

    def start(role: str, **kw: object) -> FakeWorker:
        w = fake(role, registry.model_identity, **kw)
        router.call(w.start(router.control_address, BEAT_S))
        started.append(w)
        wait_for(lambda: w.worker_id in registry.workers, 5, f"{w.worker_id} joining",
                 every=0.01)
        return w

    yield start
    for w in started:
        router.call(w.stop())
    wait_for(lambda: not registry.workers, 5, "stopped workers leaving the registry",
             every=0.01)


def _run(router: RouterInProcess, max_tokens: int, prompt: list[int] = PROMPT
         ) -> tuple[list[int], list[tuple[str, str]], grpc.RpcError | None]:
    """The tokens a request got, its trace (event, worker) and the error it ended with."""
    tokens: list[int] = []
    trace: list[tuple[str, str]] = []
    with Client(router.address) as c:
        try:
            for msg in c.stream(prompt, sampling(max_tokens, 0.0, ignore_eos=True), timeout=30):
                tokens.extend(msg.token_ids)
                if msg.finish_reason:
                    trace = [(e.name, e.worker) for e in msg.trace]
        except grpc.RpcError as e:
            return tokens, trace, e
    return tokens, trace, None


def _no_open_lease(*workers: FakeWorker) -> None:
    wait_for(lambda: not any(w.open_leases() for w in workers), 5,
             f"every lease ending (open: {[w.open_leases() for w in workers]})", every=0.01)


def _names(trace: list[tuple[str, str]]) -> list[str]:
    return [name for name, _ in trace]


@PER_CALL
def test_a_decode_stream_broken_mid_way_resumes_on_another_decode_worker(router, start) -> None:
    p = start("prefill")
    d1 = start("decode")
    d2 = start("decode", script=d1.script)  # whichever streams first breaks after 5 tokens
    d1.fail("Decode", Failure(UNAVAILABLE, after_tokens=5))
    tokens, trace, err = _run(router, 20)
    assert err is None and tokens == expected(PROMPT, 20), (err, trace)
    names = _names(trace)
    assert names.count("migrate") == 1, trace
    decoders = [w for name, w in trace if name == "decode_start"]
    assert len(decoders) == 2 and decoders[0] != decoders[1], trace  # the broken one is suspect
    # The resumed pass re-prefilled prompt + the 6 tokens produced (first + 5 streamed).
    assert p.calls["Prefill"] == 2 and d1.calls["Reserve"] + d2.calls["Reserve"] == 2
    _no_open_lease(d1, d2)
    # The broken stream's lease is released by the router, nothing left to write into it.
    assert sorted(lease.ended for d in (d1, d2) for lease in d.leases.values()) == \
        ["decoded", "settled"]


def test_a_prefill_refused_before_writing_reruns_under_the_same_lease(router, start) -> None:
    p1 = start("prefill")
    p2 = start("prefill", script=p1.script)  # whichever is asked first refuses
    d = start("decode")
    p1.fail("Prefill", Failure(UNAVAILABLE, failure_md(FailureKind.FAILURE_OVERLOADED,
                                                       nothing_written=True)))
    tokens, trace, err = _run(router, 8)
    assert err is None and tokens == expected(PROMPT, 8), (err, trace)
    names = _names(trace)
    assert "prefill_failed" in names and "migrate" not in names, trace
    # One lease, promised to the first prefill worker, then rebound to the second.
    assert d.calls["Reserve"] == 1 and p1.calls["Prefill"] == p2.calls["Prefill"] == 1
    (lease,) = d.leases.values()
    assert len(lease.senders) == 2 and set(lease.senders) == {p1.worker_id, p2.worker_id}
    _no_open_lease(d)


def test_a_prefill_worker_that_left_before_its_call_is_replaced(router, start) -> None:
    """The prefill worker chosen for a request sends its last beat (it drained and stops)
    while the request reserves KV: the router has closed its channel, so the Prefill is never
    sent; it goes to the other prefill worker under the same lease."""
    p1, p2 = start("prefill"), start("prefill")
    d = start("decode")
    by_id = {p.worker_id: p for p in (p1, p2)}

    async def chosen_leaves(req) -> None:
        await by_id[req.sender_agent].leave()  # answered: the registry has dropped it
        assert req.sender_agent not in router.router.registry.workers
    d.before["Reserve"] = chosen_leaves
    tokens, trace, err = _run(router, 8)
    assert err is None and tokens == expected(PROMPT, 8), (err, trace)
    (failed,) = [w for name, w in trace if name == "prefill_failed"]
    assert by_id[failed].calls["Prefill"] == 0 and "migrate" not in _names(trace), trace
    (lease,) = d.leases.values()
    assert lease.senders == [failed, next(p for p in by_id if p != failed)]
    _no_open_lease(d)


def test_a_prefill_that_may_have_written_takes_a_fresh_lease(router, start) -> None:
    p1 = start("prefill")
    start("prefill", script=p1.script)
    d = start("decode")
    p1.fail("Prefill", Failure(UNAVAILABLE))  # without the nothing-written trailer
    tokens, trace, err = _run(router, 8)
    assert err is None and tokens == expected(PROMPT, 8), (err, trace)
    assert "migrate" in _names(trace), trace
    # The first lease is given up with its writes unsettled (the decode worker fences its
    # sender before reusing the blocks); the second decodes.
    assert d.calls["Reserve"] == 2
    _no_open_lease(d)
    assert sorted(lease.ended for lease in d.leases.values()) == ["decoded", "released"]


def test_a_failed_kv_destination_moves_the_request_to_another_decode_worker(router,
                                                                            start) -> None:
    start("prefill").fail("Prefill",
                          Failure(UNAVAILABLE, failure_md(FailureKind.FAILURE_KV_DESTINATION)))
    d1, d2 = start("decode"), start("decode")
    tokens, trace, err = _run(router, 8)
    assert err is None and tokens == expected(PROMPT, 8), (err, trace)
    reserved = [w for name, w in trace if name == "reserved"]
    assert len(reserved) == 2 and reserved[0] != reserved[1], trace  # the failed one: suspect
    _no_open_lease(d1, d2)


@PER_CALL
def test_a_draining_decode_worker_is_passed_over_and_not_suspected(router, start) -> None:
    start("prefill")
    d1 = start("decode")
    d2 = start("decode", script=d1.script)  # whichever is asked first says it is draining
    d1.fail("Reserve", Failure(UNAVAILABLE, failure_md(FailureKind.FAILURE_DRAINING)))
    tokens, trace, err = _run(router, 4)
    assert err is None and tokens == expected(PROMPT, 4), (err, trace)
    registry = router.router.registry
    refused = d1 if d1.calls["Reserve"] == 1 and not d1.leases else d2
    assert not refused.leases
    assert registry.workers[refused.worker_id].accounting.suspect_until == 0.0
    _no_open_lease(d1, d2)


@PER_CALL
def test_full_decode_workers_refuse_with_resource_exhausted(router, start) -> None:
    start("prefill")
    d1 = start("decode")
    d2 = start("decode", script=d1.script)
    d1.fail("Reserve", *[Failure(grpc.StatusCode.RESOURCE_EXHAUSTED)] * 1000)
    tokens, _, err = _run(router, 4)
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert tokens == [] and d1.calls["Reserve"] >= 1 and d2.calls["Reserve"] >= 1
    assert not d1.leases and not d2.leases


def test_migrations_are_bounded_and_the_output_so_far_is_right(router, start) -> None:
    start("prefill")
    d1 = start("decode")  # three: a worker whose stream broke is suspect for a while
    ds = [d1, start("decode", script=d1.script), start("decode", script=d1.script)]
    d1.fail("Decode", *[Failure(UNAVAILABLE, after_tokens=2)] * 10)  # every stream breaks
    tokens, _, err = _run(router, 50)
    assert err is not None and err.code() == UNAVAILABLE, err
    assert "after 2 migrations" in err.details(), err.details()
    # three passes (the first and two migrations), each the first token and 2 streamed
    assert tokens == expected(PROMPT, 9), tokens
    _no_open_lease(*ds)


@PER_CALL
def test_a_client_leaving_mid_stream_ends_the_lease(router, start) -> None:
    start("prefill")
    d = start("decode")
    with Client(router.address) as c:
        call = c.stream(PROMPT, sampling(4000, 0.0, ignore_eos=True), timeout=30)
        got = []
        for msg in call:
            got.extend(msg.token_ids)
            if len(got) >= 10:
                call.cancel()
                break
    assert got[:10] == expected(PROMPT, 10)
    _no_open_lease(d)
    (lease,) = d.leases.values()
    assert lease.ended == "settled" and d.calls["Release"] == 1


def test_a_draining_worker_whose_beats_stop_finishes_its_streams(router, start) -> None:
    """A draining decode worker whose beats stop (late on a starved core, or it exited) leaves
    the registry, but the stream it serves is not cut: a draining worker finishes what it holds
    (were it gone, the stream would break by itself and migrate)."""
    start("prefill")
    d = start("decode", token_gap_s=0.005)  # 200 tokens: ~1 s, the beat timeout 0.15 s
    registry = router.router.registry
    dropped: list[float] = []

    def drain_then_fall_silent() -> None:
        wait_for(lambda: d.calls["Decode"] >= 1, 5, "the stream starting", every=0.01)
        d.draining = True
        wait_for(lambda: registry.workers[d.worker_id].reported.draining, 5,
                 "the router seeing it", every=0.01)
        d.silent = True
        wait_for(lambda: d.worker_id not in registry.workers, 5, "the router dropping it",
                 every=0.01)
        dropped.append(time.monotonic())

    t = threading.Thread(target=drain_then_fall_silent)
    t.start()
    tokens, trace, err = _run(router, 200)
    ended = time.monotonic()
    t.join(10)
    assert err is None and tokens == expected(PROMPT, 200), (err, trace)
    assert dropped and dropped[0] < ended, "the worker was not dropped while it streamed"
    assert "migrate" not in _names(trace), trace
