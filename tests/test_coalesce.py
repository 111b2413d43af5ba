"""Coalescing for slow readers (router.coalesce), without a cluster: merged deltas keep the
stream's content, choices are never merged, the last delta stays last, a ready delta goes out at
once (and a client that keeps up costs no task), errors come after the deltas before them, and
closing or cancelling the stream mid-way closes its source. The HTTP server's transports:
tests/test_coalesce_http.py; the real APIs against a cluster: tests/test_coalesce_cluster.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.router.coalesce import SLOW_SEND_S, Coalescer, merge, take_ready
from kvrelay.router.errors import RouterError
from kvrelay.router.outputs import Delta, Usage

SLOW = 0.03  # a consumer this long on each message: far over coalesce.SLOW_SEND_S
assert SLOW > 3 * SLOW_SEND_S


def _lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -0.5, [(t, -0.5)])


def _stream(n: int, choices: int = 1, *, text: str = "t") -> list[Delta]:
    """n deltas per choice, choices interleaved as a decode worker's steps give them; each
    choice's last finished; the request's last done (with the usage)."""
    out = []
    for k in range(n):
        for i in range(choices):
            last = k == n - 1
            out.append(Delta("r", f"{text}{i}.{k} ", [100 * i + k], [_lp(100 * i + k)],
                             finished=last, finish_reason=FinishReason.LENGTH if last else None,
                             index=i))
    out[-1].done, out[-1].usage = True, Usage(3, n * choices)
    out[0].prompt_logprobs = [_lp(1), _lp(2)]
    return out


async def _source(deltas: list[Delta], closed: list[bool] | None = None, *,
                  error: Exception | None = None) -> AsyncIterator[Delta]:
    try:
        for d in deltas:
            await asyncio.sleep(0)  # one event-loop turn each, as tokens come off the network
            yield d
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


async def _send(stream: Coalescer, d: Delta, pause: float) -> None:
    """Send ``d`` as the APIs do, the send taking ``pause`` (a slow client's)."""
    t = time.monotonic()
    if pause:
        await asyncio.sleep(pause)
    stream.sent(d, time.monotonic() - t)


async def _read(stream: Coalescer, pause: float = 0.0) -> list[Delta]:
    """Every message of ``stream``, each send taking ``pause``."""
    got = []
    async for d in stream:
        got.append(d)
        await _send(stream, d, pause)
    return got


def _by_choice(msgs: list[Delta], i: int) -> tuple[str, list[int], list, str | None]:
    mine = [d for d in msgs if d.index == i]
    reason = mine[-1].finish_reason.value if mine[-1].finish_reason else None
    return ("".join(d.text for d in mine), [t for d in mine for t in d.token_ids],
            [lp for d in mine for lp in d.logprobs], reason)


def test_merge_joins_content_and_keeps_the_last_state() -> None:
    ds = _stream(4)
    m = merge(ds)
    assert m.text == "t0.0 t0.1 t0.2 t0.3 " and m.token_ids == [0, 1, 2, 3]
    assert [lp.token_id for lp in m.logprobs] == [0, 1, 2, 3]
    assert m.finished and m.done and m.finish_reason == FinishReason.LENGTH
    assert m.usage == Usage(3, 4)
    assert m.prompt_logprobs == ds[0].prompt_logprobs
    assert not merge(ds[1:3]).finished and merge(ds[1:3]).prompt_logprobs is None
    assert merge(ds[:1]) is ds[0]


def test_take_ready_never_merges_choices_and_keeps_the_last_delta_last() -> None:
    ready = _stream(3, choices=2)  # a0 b0 a1 b1 a2 b2(done)
    first = take_ready(ready)
    assert first.index == 0 and first.token_ids == [0, 1, 2] and first.finished
    assert not first.done
    last = take_ready(ready)
    assert last.index == 1 and last.token_ids == [100, 101, 102] and last.done
    assert ready == []
    # The request's last delta belongs to the first choice ready: it waits for the other's.
    a0, b0, a1 = (Delta("r", "a", [1], [None]), Delta("r", "b", [2], [None], index=1),
                  Delta("r", "c", [3], [None], finished=True, done=True))
    ready = [a0, b0, a1]
    assert [take_ready(ready) for _ in range(3)] == [a0, b0, a1]


@pytest.mark.parametrize("pause", [0.0, SLOW])
def test_a_ready_delta_goes_out_at_once(pause: float) -> None:
    """Each delta is produced only once the previous message was received: a coalescer that
    held a ready delta back to wait for more would never get one (bounded by a timeout)."""
    deltas = _stream(6, choices=2)

    async def main() -> list[Delta]:
        q: asyncio.Queue[Delta] = asyncio.Queue()

        async def lockstep() -> AsyncIterator[Delta]:
            for _ in deltas:
                yield await q.get()

        got: list[Delta] = []
        stream = Coalescer(lockstep())
        for d in deltas:
            q.put_nowait(d)
            got.append(await asyncio.wait_for(anext(stream), 10))
            await _send(stream, got[-1], pause)
        # A client that keeps up costs no task; a slow one is read ahead for.
        assert stream.reading_ahead == (pause > 0)
        await stream.aclose()
        return got

    assert asyncio.run(main()) == deltas


@pytest.mark.parametrize("choices", [1, 3])
def test_a_slow_consumer_gets_fewer_messages_with_the_same_content(choices: int) -> None:
    deltas = _stream(40, choices)

    async def main() -> list[Delta]:
        return await _read(Coalescer(_source(deltas)), pause=SLOW)

    got = asyncio.run(main())
    assert len(got) < len(deltas) // 4
    for i in range(choices):
        assert _by_choice(got, i) == _by_choice(deltas, i)
        mine = [d for d in got if d.index == i]
        assert mine[-1].finished and not any(d.finished for d in mine[:-1])
    assert got[-1].done and got[-1].usage == Usage(3, 40 * choices)
    assert not any(d.done for d in got[:-1])
    assert got[0].prompt_logprobs == deltas[0].prompt_logprobs


def test_an_error_comes_after_the_deltas_before_it() -> None:
    deltas = _stream(10)[:-1]  # never finishes: the worker failed
    err = RouterError(grpc.StatusCode.UNAVAILABLE, "gone")
    got: list[Delta] = []

    async def main() -> None:
        stream = Coalescer(_source(deltas, error=err))
        async for d in stream:
            got.append(d)
            await _send(stream, d, SLOW)

    with pytest.raises(RouterError, match="gone"):
        asyncio.run(main())
    assert len(got) < len(deltas)
    assert _by_choice(got, 0)[:2] == _by_choice(deltas, 0)[:2]


def test_closing_mid_stream_closes_the_source_at_once() -> None:
    closed: list[bool] = []

    async def endless() -> AsyncIterator[Delta]:
        try:
            k = 0
            while True:
                await asyncio.sleep(0.001)
                k += 1
                yield Delta("r", "x", [k], [None])
        finally:
            closed.append(True)

    async def main() -> int:
        stream = Coalescer(endless())
        n = 0
        async for d in stream:
            n += 1
            await _send(stream, d, SLOW)  # slow: reading ahead by now
            if n == 3:
                break
        await stream.aclose()
        assert closed == [True]
        return n

    assert asyncio.run(main()) == 3


def test_a_cancelled_consumer_cancels_the_source() -> None:
    closed: list[bool] = []
    deltas = _stream(10_000)

    async def main() -> None:
        stream = Coalescer(_source(deltas, closed))

        async def consume() -> None:
            async for d in stream:
                await _send(stream, d, SLOW)

        task = asyncio.get_running_loop().create_task(consume())
        await asyncio.sleep(SLOW * 3)  # the consumer has been slow: it reads ahead by now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        assert closed == [True]

    asyncio.run(main())
